"""The OpenVINO form of a decoder graph: TreeAttention from primitives, new rows as outputs.

OpenVINO's ONNX frontend reads neither ONNX `Attention` (opset 23) nor `TensorScatter`
(opset 24), the ops TreeAttention's standard body is made of, and a compiled OpenVINO
model cannot update one of its inputs in place, which is how ONNX Runtime keeps the cache
(the same buffer bound as `past_*` and `present_*`). `OpenvinoAttentionPass` replaces each
TreeAttention node by the op's rule spelled in ops the frontend reads:

    slots     = write_pos[b] + 0 .. N-1                      # [B, N], where the rows land
    k_valid   = ScatterElements(k_cache[:, :, :L], slots, k)  # the cache the op attends over
    v_valid   = ScatterElements(v_cache[:, :, :L], slots, v)
    out       = softmax(where(mask, cap(scale * q.k_valid), -inf)) . v_valid   # grouped heads

Only the `L` slots the mask covers are copied, so a step costs what its context costs, not
the cache's capacity. The graph's `present_key_i` / `present_value_i` outputs become
`new_key_i` / `new_value_i`, the N new rows themselves ([B, Hkv, N, D]): the caller writes
them at `write_pos` (`specx.runtime.targets.openvino`), which completes the op's rule. It needs
`write_pos[b] + N <= L` for every row, as every forward of specx's runtime has.

`RotateHalfPass` respells RoPE's rotate_half so that OpenVINO's CPU plugin fuses each RoPE
into one node (see its docstring).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes import common as onnx_ir_passes

from specx.graphs import tree_attention as tree_op
from specx.graphs.ir_values import inputs_of
from specx.graphs.rotate_half import match_rotate_half

__all__ = ["NEW_ROWS_PREFIX", "OpenvinoAttentionPass", "RotateHalfPass", "lower_for_openvino"]

NEW_ROWS_PREFIX = "new_"  # present_key_0 -> new_key_0
_PRESENT_PREFIX = "present_"


class _Constants:
    """Shared int64 / float constants, registered once as initializers (named by value)."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        self.values: dict[str, ir.Value] = {}

    def __call__(self, name: str, array: np.ndarray) -> ir.Value:
        key = f"ov_{name}"
        if key not in self.values:  # an earlier pass may have registered it
            value = self.graph.initializers.get(key)
            if value is None:
                value = ir.val(key, const_value=ir.tensor(array, name=key))
                self.graph.register_initializer(value)
            self.values[key] = value
        return self.values[key]

    def ints(self, *values: int) -> ir.Value:
        name = "i" + "_".join(str(v).replace("-", "m") for v in values)
        return self(name, np.array(values, dtype=np.int64))


class OpenvinoAttentionPass(InPlacePass):
    """Each TreeAttention node as primitives; the cache outputs as the new rows (see above)."""

    def call(self, model: ir.Model) -> PassResult:
        """Replaces every TreeAttention node of the main graph and drops the op's function."""
        graph = model.graph
        nodes = [n for n in graph if (n.domain, n.op_type) == (tree_op.DOMAIN, tree_op.OP_TYPE)]
        constants = _Constants(graph)
        for node in nodes:
            _replace(graph, constants, node)
        for key in [k for k in model.functions if k[:2] == (tree_op.DOMAIN, tree_op.OP_TYPE)]:
            del model.functions[key]
        if nodes:
            model.opset_imports.pop(tree_op.DOMAIN, None)
            graph.opset_imports.pop(tree_op.DOMAIN, None)
        return PassResult(model, modified=bool(nodes))


def _replace(graph: ir.Graph, const: _Constants, node: ir.Node) -> None:
    q, k, v, k_cache, v_cache, write_pos, mask = inputs_of(node)
    out, k_cache_out, v_cache_out = node.outputs
    tape = ir.tape.Tape()
    kv_len = tape.op("Shape", [mask], attributes={"start": 3, "end": 4})  # [1]: L
    rows = tape.op("Shape", [q], attributes={"start": 2, "end": 3})  # [1]: N
    zero, one = const("zero", np.array(0, np.int64)), const("one", np.array(1, np.int64))
    steps = tape.op("Range", [zero, tape.op("Squeeze", [rows]), one])
    slots = tape.op("Add", [tape.op("Unsqueeze", [write_pos, const.ints(1)]), steps])  # [B, N]
    slots = tape.op("Unsqueeze", [slots, const.ints(1, 3)])  # [B, 1, N, 1]
    valid = {}
    for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
        window = tape.op("Slice", [cache, const.ints(0), kv_len, const.ints(2)])
        index = tape.op("Expand", [slots, tape.op("Shape", [new])])
        valid[name] = tape.op("ScatterElements", [window, index, new], attributes={"axis": 2})
    attended = _grouped_attention(tape, const, node, q, valid["k"], valid["v"], mask)
    graph.insert_before(node, tape.nodes)
    out.replace_all_uses_with(attended)
    for cache_out, new in ((k_cache_out, k), (v_cache_out, v)):
        _output_new_rows(graph, cache_out, new)
    graph.remove(node, safe=True)


def _grouped_attention(tape, const: _Constants, node: ir.Node, q, k_valid, v_valid, mask):
    """softmax(where(mask, cap(scale * q.k), -inf)) . v, returned as [B, H, N, D].

    q [B, H, N, D] is seen as [B, Hkv, H/Hkv, N, D], each kv head serving its group.
    """
    heads = node.attributes.get_int("num_heads")
    kv_heads = node.attributes.get_int("num_kv_heads")
    scale = node.attributes.get_float("scale")
    softcap = node.attributes.get_float(tree_op.SOFTCAP, 0.0)
    head_dim = q.shape[3] if q.shape is not None else None
    if not isinstance(head_dim, int):
        raise ValueError(f"{node.name}: the query's head size is not static ({q.shape})")
    grouped = const.ints(0, kv_heads, heads // kv_heads, -1, head_dim)
    q_grouped = tape.op("Reshape", [q, grouped])  # [B, Hkv, G, N, D]
    k_t = tape.op(
        "Transpose",
        [tape.op("Unsqueeze", [k_valid, const.ints(2)])],
        attributes={"perm": [0, 1, 2, 4, 3]},
    )
    scores = tape.op("MatMul", [q_grouped, k_t])  # [B, Hkv, G, N, L]
    scores = tape.op("Mul", [scores, const(f"scale_{scale}", np.array(scale, np.float32))])
    if softcap > 0:
        cap = const(f"cap_{softcap}", np.array(softcap, np.float32))
        scores = tape.op("Mul", [tape.op("Tanh", [tape.op("Div", [scores, cap])]), cap])
    visible = tape.op("Unsqueeze", [mask, const.ints(1)])  # [B, 1, 1, N, L]
    scores = tape.op("Where", [visible, scores, const("neg_inf", np.array(-np.inf, np.float32))])
    weights = tape.op("Softmax", [scores], attributes={"axis": -1})
    v_grouped = tape.op("Unsqueeze", [v_valid, const.ints(2)])  # [B, Hkv, 1, L, D]
    attended = tape.op("MatMul", [weights, v_grouped])  # [B, Hkv, G, N, D]
    return tape.op("Reshape", [attended, tape.op("Shape", [q])])


def _output_new_rows(graph: ir.Graph, cache_out: ir.Value, new: ir.Value) -> None:
    """Replaces the graph output `present_*` (`cache_out`) by `new_*`: the rows themselves."""
    name = cache_out.name or ""
    if cache_out.uses() or not name.startswith(_PRESENT_PREFIX):
        raise ValueError(f"{name!r}: a TreeAttention cache output must be a present_* output only")
    rows = ir.node("Identity", [new])
    rows.outputs[0].name = NEW_ROWS_PREFIX + name.removeprefix(_PRESENT_PREFIX)
    rows.outputs[0].shape, rows.outputs[0].type = new.shape, new.type
    graph.append(rows)
    graph.outputs[graph.outputs.index(cache_out)] = rows.outputs[0]


class RotateHalfPass(InPlacePass):
    """RoPE's rotate_half, Concat(-x2, x1), spelled with Slices and a Mul by -1.

    That is how PyTorch's converter to OpenVINO spells it; specx's export has Split and Neg.
    OpenVINO's CPU plugin fuses `x * cos + rotate_half(x) * sin` into one RoPE node only in
    the Slice / Mul(-1) spelling (its pattern does not take Split and Neg); fused, a layer
    runs 2 RoPE nodes instead of about 12 small ones (Split, Neg, Concat, Mul, Add for q and
    k). The arithmetic is the same; what it saves a call: docs/decisions.md#ov-rope-fused.
    """

    def call(self, model: ir.Model) -> PassResult:
        """Respells every rotate_half of the main graph."""
        graph = model.graph
        constants = _Constants(graph)
        matches = [m for m in map(match_rotate_half, graph) if m is not None]
        for match in matches:
            x, half = match.x, match.half
            tape = ir.tape.Tape()
            last = constants.ints(-1)
            second = tape.op("Slice", [x, constants.ints(half), constants.ints(2 * half), last])
            first = tape.op("Slice", [x, constants.ints(0), constants.ints(half), last])
            minus_one = constants("minus_one", np.array(-1.0, np.float32))
            negated = tape.op("Mul", [second, minus_one])
            turned = tape.op("Concat", [negated, first], attributes={"axis": -1})
            graph.insert_before(match.concat, tape.nodes)
            match.concat.outputs[0].replace_all_uses_with(turned)
        if matches:  # the Split / Neg / Concat left without uses
            onnx_ir_passes.RemoveUnusedNodesPass()(model)
        return PassResult(model, modified=bool(matches))


def lower_for_openvino(model: ir.Model) -> ir.Model:
    """`model` (an exported fp32 decoder or stateless graph) in the form OpenVINO reads."""
    OpenvinoAttentionPass()(model)
    RotateHalfPass()(model)
    return model
