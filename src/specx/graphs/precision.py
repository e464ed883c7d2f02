"""`ConvertPrecisionPass`: an fp32 graph computed in fp16 or bf16, precision-critical parts kept.

TensorRT 11 networks are strongly typed: a layer runs in the dtype of its tensors, so the
precision of an engine is decided in the ONNX graph, not by builder flags. This pass
rewrites a specx graph's float32 tensors to a lower precision under three rules:

1. Values computed only from integers and constants stay float32 ("pinned"): RoPE
   angles are `position * inv_freq`, which fp16 cannot hold past a few hundred
   positions; they are rounded only where they meet a low-precision tensor (cos/sin).
2. Normalisations accumulate in float32 (`RMSNormalization.stash_type` = FLOAT). The
   softmax inside Attention is left to the backend's fused kernel, which accumulates in
   float32: TensorRT's parser refuses an Attention node that carries `softmax_precision`.
3. The interface stays float32 except the KV caches: `past_*`/`present_*` take the low
   dtype (halving cache memory is the point), every other float input is cast down
   on entry and every other float output (logits, hidden states) cast up on exit, so
   verification math and the runtime see float32 logits.

Constants (initializers, `Constant` nodes) take the dtype of their consumers; one used by
both float32 and low-precision nodes is duplicated.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from specx.graphs.ir_values import input_at, name_of, producer_of

__all__ = ["FLOAT_DTYPES", "ConvertPrecisionPass", "is_cache_name"]

FLOAT_DTYPES: dict[str, ir.DataType] = {  # a float precision's name -> its dtype
    "fp32": ir.DataType.FLOAT,
    "fp16": ir.DataType.FLOAT16,
    "bf16": ir.DataType.BFLOAT16,
}
_NUMPY = {ir.DataType.FLOAT16: np.float16, ir.DataType.BFLOAT16: ml_dtypes.bfloat16}
_FLOAT = ir.DataType.FLOAT


def is_cache_name(name: str | None) -> bool:
    """True for a KV-cache input or output (`past_key_3`, `present_value_0`)."""
    return name is not None and name.startswith(
        ("past_key_", "past_value_", "present_key_", "present_value_")
    )


class ConvertPrecisionPass(InPlacePass):
    """Rewrites a float32 graph to compute in `dtype` (see the module docstring for the rules)."""

    def __init__(self, dtype: ir.DataType):
        super().__init__()
        if dtype not in _NUMPY:
            raise ValueError(f"ConvertPrecisionPass converts to fp16 or bf16, not {dtype}")
        self.dtype = dtype

    def call(self, model: ir.Model) -> PassResult:
        """Converts `model` in place."""
        graph = model.graph
        pinned = _pinned_values(graph)
        constants = {id(v) for v in graph.initializers.values()}
        constants |= {id(n.outputs[0]) for n in graph if n.op_type == "Constant"}
        low_copies: dict[int, ir.Value] = {}

        for value in graph.inputs:
            if value.dtype == _FLOAT:
                if is_cache_name(value.name):
                    value.dtype = self.dtype
                else:
                    self._cast_after_input(graph, value)
        for node in list(graph):
            if node.op_type == "Cast" and node.attributes["to"].value == _FLOAT:
                if id(node.outputs[0]) in pinned:
                    continue
                node.attributes["to"] = ir.AttrInt64("to", self.dtype)
            if node.op_type == "RMSNormalization":
                node.attributes["stash_type"] = ir.AttrInt64("stash_type", _FLOAT)
            if any(id(o) in pinned for o in node.outputs) or node.op_type == "Constant":
                continue
            for index, operand in enumerate(node.inputs):
                if operand is None or operand.dtype != _FLOAT:
                    continue
                if id(operand) in constants:
                    node.replace_input_with(index, self._low_constant(graph, operand, low_copies))
                elif id(operand) in pinned:
                    node.replace_input_with(index, self._low_cast(graph, operand, low_copies))
            for value in node.outputs:
                if value.dtype == _FLOAT:
                    value.dtype = self.dtype
        for index, value in enumerate(list(graph.outputs)):
            if value.dtype == self.dtype and not is_cache_name(value.name):
                graph.outputs[index] = self._cast_before_output(graph, value)
        _drop_unused_constants(graph)
        return PassResult(model, modified=True)

    def _low_constant(self, graph: ir.Graph, value: ir.Value, cache: dict[int, ir.Value]):
        if id(value) in cache:
            return cache[id(value)]
        array = value.const_value.numpy() if value.const_value is not None else None
        if array is None:  # a Constant node's output
            array = producer_of(value).attributes["value"].value.numpy()
        low = ir.Value(
            name=f"{value.name}_{self.dtype.name.lower()}",
            shape=value.shape,
            type=ir.TensorType(self.dtype),
            const_value=ir.tensor(array.astype(_NUMPY[self.dtype]), dtype=self.dtype),
        )
        graph.register_initializer(low)
        cache[id(value)] = low
        return low

    def _low_cast(self, graph: ir.Graph, value: ir.Value, cache: dict[int, ir.Value]):
        if id(value) not in cache:
            cast = _cast(value, self.dtype, f"{value.name}_{self.dtype.name.lower()}")
            graph.insert_after(producer_of(value), cast)
            cache[id(value)] = cast.outputs[0]
        return cache[id(value)]

    def _cast_after_input(self, graph: ir.Graph, value: ir.Value) -> None:
        users = list(value.uses())
        cast = _cast(value, self.dtype, f"{value.name}_low")
        graph.insert_before(graph.node(0), cast)
        for user, index in users:
            user.replace_input_with(index, cast.outputs[0])

    def _cast_before_output(self, graph: ir.Graph, value: ir.Value) -> ir.Value:
        name = name_of(value)
        value.name = f"{name}_low"
        cast = _cast(value, _FLOAT, name)
        graph.append(cast)
        return cast.outputs[0]


def _cast(value: ir.Value, to: ir.DataType, output_name: str) -> ir.Node:
    """A Cast node of `value` to `to` whose output, typed and shaped, is `output_name`."""
    cast = ir.node("Cast", [value], {"to": to}, name=f"cast_{output_name}")
    cast.outputs[0].name = output_name
    cast.outputs[0].dtype, cast.outputs[0].shape = to, value.shape
    return cast


def _pinned_values(graph: ir.Graph) -> set[int]:
    """Float values computed from integers and constants only (rule 1), by id."""
    constants = {id(v) for v in graph.initializers.values()}
    pinned: set[int] = set()
    for node in graph:
        if node.op_type == "Constant":
            constants.add(id(node.outputs[0]))
            continue
        floats = [v for v in node.inputs if v is not None and v.dtype == _FLOAT]
        if node.op_type == "Cast":
            source = input_at(node, 0)
            if source.dtype is None:
                raise ValueError(f"Cast input {source.name!r} has no dtype")
            if not source.dtype.is_floating_point() or id(source) in pinned:
                pinned.update(id(o) for o in node.outputs)
            continue
        if not floats or not all(id(v) in pinned or id(v) in constants for v in floats):
            continue
        if any(id(v) in pinned for v in floats):
            pinned.update(id(o) for o in node.outputs if o.dtype == _FLOAT)
    return pinned


def _drop_unused_constants(graph: ir.Graph) -> None:
    for name, value in list(graph.initializers.items()):
        if not value.uses() and value not in graph.outputs:
            del graph.initializers[name]
    for node in list(graph):
        if node.op_type == "Constant" and not node.outputs[0].uses():
            graph.remove(node, safe=True)
