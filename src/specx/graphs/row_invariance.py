"""Row invariance on ONNX Runtime's CPU kernels: a token's result not depending on its chunk.

Greedy speculative decoding is lossless when the target computes the same logits for a
token whether it comes alone (a plain decoding step) or among the rows of a verify chunk.
ONNX Runtime's CPU kernels do so for float MatMuls over constant weights and for
multi-row Attention, but two take another path for a single row whose results differ in
the last bits: Attention with one query, and the integer MatMul (`MatMulIntegerToFloat`,
fused from QDQ) with one row. In a float graph such a difference moves a logit by about
1e-6. After static INT8 quantization it does not stay small: one activation that sits on
a rounding boundary of its QuantizeLinear flips by a whole quantization step, and the
logits move by ~1e-2, enough to swap a near-tie and make speculative output differ from
plain decoding of the same INT8 target, as it did on pyref-7m
(docs/decisions.md#row-invariant-int8).

`RowInvariantPass` makes every such kernel see at least two rows: TreeAttention's
fallback body attends with one extra query row (`tree_attention.function_proto(
row_invariant=True)`), and every quantized MatMul gets a copy of its input's last row
(before the QuantizeLinear, so ONNX Runtime still fuses the QDQ pattern) and drops that
row of its output. Rows then come out bit-identical for chunks of any size, which
`tests/test_row_invariance.py` checks. What it does not cover: a tree's accepted path
sits at other cache slots than the same tokens in plain decoding, which changes the
order of attention's sums (a chain's path does not move).

`PadRowPass` is the remedy for kernels that compute rows in pairs: MatMulNBits at int8
compute with blocks of 64 or more (measured here, ONNX Runtime 1.23, AVX-512) multiplies
rows two at a time and a last odd row alone, on paths whose results differ in the last
bits. A row is computed the same in every pair and in every position of a pair, so the
whole graph runs one row more than the step has (a copy of the last token at the last
position): a decode step becomes a pair, a verify chunk's real rows always fall in pairs,
and only the padding row, whose outputs are dropped, may be computed alone. Its key and
value land in the slot after the step (one spare cache slot, `kv_spare_slots`), which no
real row's mask shows and the next step overwrites. Where a step streams its weights (1B
scale), the bytes blocks of 128 save over blocks of 32 (the blocks that are row-invariant
alone) outweigh the pair's extra row, so pairs win there; on targets whose weights sit in
cache the extra row is compute and bytes matter little, so they lose, and the build uses
blocks of 32 (`specx.builders.ort.STREAMED_WEIGHTS`). The costs as measured:
docs/decisions.md#pad-row-at-blocks-of-128.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from specx.graphs import tree_attention as tree_op
from specx.graphs.ir_values import input_at, producer_of

__all__ = ["PadRowPass", "RowInvariantPass"]

_ROW_AXIS = -2  # [B, N, features]: the new tokens' axis of a MatMul input


class RowInvariantPass(InPlacePass):
    """Pads single rows to two where ONNX Runtime's CPU kernels would special-case them."""

    def call(self, model: ir.Model) -> PassResult:
        """Replaces the TreeAttention function and pads every quantized MatMul."""
        graph = model.graph
        key = (tree_op.DOMAIN, tree_op.OP_TYPE, "")
        modified = False
        if key in model.functions:
            model.functions[key] = ir.serde.deserialize_function(
                tree_op.function_proto(
                    row_invariant=True, softcap=tree_op.graph_uses_softcap(graph)
                )
            )
            modified = True
        constants = _Constants(graph)
        padded: dict[int, tuple[ir.Value, ir.Value]] = {}
        for matmul in [n for n in graph if (n.domain, n.op_type) == ("", "MatMul")]:
            quantize = _quantized_input(matmul)
            if quantize is None:
                continue
            source = input_at(quantize, 0)
            _float_graph_output(graph, source, quantize)
            if id(source) not in padded:
                padded[id(source)] = _append_last_row(graph, source, constants)
            rows, count = padded[id(source)]
            quantize.replace_input_with(0, rows)
            for value in (quantize.outputs[0], input_at(matmul, 0)):
                value.shape = None
            _drop_last_row(graph, matmul, count, constants)
            modified = True
        return PassResult(model, modified=modified)


class PadRowPass(InPlacePass):
    """Runs the graph on one token row more than it is given; outputs keep the real rows.

    Inputs: input_ids / position_ids [B, N] get a copy of their last column, the
    attention mask [B, 1, N, L] a copy of its last row and a column no row sees. Outputs on
    the token axis (logits, hidden taps) drop their last row; the caches are untouched.
    """

    def call(self, model: ir.Model) -> PassResult:  # noqa: D102
        graph = model.graph
        inputs = {value.name: value for value in graph.inputs}
        ids_shape = inputs["input_ids"].shape
        assert ids_shape is not None, "the exporter gives input_ids its [B, N] shape"
        tokens = ids_shape[1]
        constants = _Constants(graph)
        first = graph.node(0)
        for name, axis in (("input_ids", 1), ("position_ids", 1), ("attention_mask", 2)):
            uses = list(inputs[name].uses())
            padded = _pad_end(graph, first, inputs[name], axis, constants, mode="edge")
            if name == "attention_mask":  # the padding row's slot, unseen by every row
                padded = _pad_end(graph, first, padded, 3, constants, mode="constant")
            for use in uses:
                use.node.replace_input_with(use.idx, padded)
        for index, output in enumerate(list(graph.outputs)):
            if output.shape is not None and len(output.shape) > 1 and output.shape[1] == tokens:
                graph.outputs[index] = _without_last_row(graph, output, constants)
        return PassResult(model, modified=True)


def _pad_end(
    graph: ir.Graph, before: ir.Node, value: ir.Value, axis: int, constants: _Constants, mode: str
) -> ir.Value:
    """`value` with one more entry at the end of `axis`: a copy of the last, or zeros/False."""
    node = ir.node(
        "Pad",
        [value, constants.get("pad_end", [0, 1]), None, constants.get(f"axis_{axis}", axis)],
        {"mode": mode},
        name=f"{value.name}_pad_{axis}",
    )
    graph.insert_before(before, node)
    return node.outputs[0]


def _without_last_row(graph: ir.Graph, output: ir.Value, constants: _Constants) -> ir.Value:
    """A graph output's real rows: [B, N + 1, ...] -> [B, N, ...] under the output's name."""
    real = ir.node(
        "Slice",
        [output, constants.get("zero", 0), constants.get("last", -1), constants.get("axis_1", 1)],
        name=f"{output.name}_real",
    )
    graph.insert_after(producer_of(output), real)
    name, shape, dtype = output.name, output.shape, output.type
    output.name, output.shape = f"{name}_padded", None
    real.outputs[0].name, real.outputs[0].shape, real.outputs[0].type = name, shape, dtype
    return real.outputs[0]


def _quantized_input(matmul: ir.Node) -> ir.Node | None:
    """The QuantizeLinear behind the MatMul's activation (Q -> DQ -> MatMul), if any."""
    dequantize = matmul.inputs[0].producer() if matmul.inputs[0] is not None else None
    if dequantize is None or dequantize.op_type != "DequantizeLinear":
        return None
    quantize = input_at(dequantize, 0).producer()
    if quantize is None or quantize.op_type != "QuantizeLinear":
        return None
    return quantize


def _float_graph_output(graph: ir.Graph, source: ir.Value, quantize: ir.Node) -> None:
    """Gives a graph output that the quantizer routed through Q/DQ its float value back.

    ONNX Runtime's quantizer renames a quantized tensor that is also a graph output (the
    final hidden states, `hidden_taps`) so the output is the dequantized copy; draft heads
    read the float value, and a padded copy could not be an output anyway.
    """
    for dequantize in [use.node for use in quantize.outputs[0].uses()]:
        output = dequantize.outputs[0]
        for index, value in enumerate(graph.outputs):
            if value is output:
                name, shape, dtype = output.name, output.shape, output.type
                output.name = f"{name}_dequantized"
                source.name, source.shape, source.type = name, shape, dtype
                graph.outputs[index] = source


def _append_last_row(
    graph: ir.Graph, source: ir.Value, constants: _Constants
) -> tuple[ir.Value, ir.Value]:
    """`source` with a copy of its last row appended, and its own row count."""
    name = source.name
    last = ir.node(
        "Slice",
        [source, constants.get("last", -1), constants.get("end", 2**63 - 1), constants.axis],
        name=f"{name}_last_row",
    )
    rows = ir.node("Concat", [source, last.outputs[0]], {"axis": _ROW_AXIS}, name=f"{name}_rows")
    count = ir.node(
        "Shape", [source], {"start": _ROW_AXIS, "end": _ROW_AXIS + 1}, name=f"{name}_row_count"
    )
    nodes = [last, rows, count]
    anchor = source.producer()
    if anchor is None:
        graph.insert_before(graph.node(0), nodes)
    else:
        graph.insert_after(anchor, nodes)
    rows.outputs[0].name = f"{name}_rows"
    return rows.outputs[0], count.outputs[0]


def _drop_last_row(graph: ir.Graph, matmul: ir.Node, count: ir.Value, constants: _Constants):
    """Slices the MatMul's output back to its real rows, for every consumer and output."""
    output = matmul.outputs[0]
    uses = list(output.uses())
    real = ir.node(
        "Slice",
        [output, constants.get("zero", 0), count, constants.axis],
        name=f"{output.name}_real",
    )
    graph.insert_after(matmul, real)
    for use in uses:
        use.node.replace_input_with(use.idx, real.outputs[0])
    name, shape, dtype = output.name, output.shape, output.type
    output.name, output.shape = f"{name}_rows", None
    real.outputs[0].name, real.outputs[0].shape, real.outputs[0].type = name, shape, dtype
    for index, value in enumerate(graph.outputs):
        if value is output:
            graph.outputs[index] = real.outputs[0]


class _Constants:
    """One int64 initializer per value, created on first use."""

    def __init__(self, graph: ir.Graph):
        self._graph = graph
        self._values: dict[str, ir.Value] = {}

    @property
    def axis(self) -> ir.Value:
        """The row axis, as Slice's `axes` input."""
        return self.get("row_axis", _ROW_AXIS)

    def get(self, name: str, value: int | list[int]) -> ir.Value:
        """The 1-D int64 initializer `row_invariance_<name>` holding `value`."""
        full = f"row_invariance_{name}"
        if full not in self._values:
            array = np.array(value if isinstance(value, list) else [value], dtype=np.int64)
            tensor = ir.tensor(array, name=full)
            constant = ir.Value(
                name=full,
                shape=ir.Shape(list(array.shape)),
                type=ir.TensorType(ir.DataType.INT64),
                const_value=tensor,
            )
            self._graph.register_initializer(constant)
            self._values[full] = constant
        return self._values[full]
