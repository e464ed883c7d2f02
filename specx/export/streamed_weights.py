"""Weights that stay on disk until the export writes them: exports in bounded memory.

The target is traced with placeholder parameters (`torch.empty`: address space, no
resident memory), without the exporter's constant folding, so every weight in the graph is
an initializer named after its parameter. `bind_checkpoint_weights` then makes each of
those initializers a `StreamedTensor` that knows which checkpoint tensor(s) it is computed
from (`FoldWeightTransposesPass` turns `Transpose(weight)` into a transposed source, and
`specx.graphs.packed_matmuls` a concatenated one), and `specx.graphs.model_io` writes them
one at a time: a StreamedTensor reads its source in the stored dtype, transposes or
concatenates there, and widens to float32 in row blocks as it writes. Peak memory is the
graph plus about twice the largest tensor in its stored dtype, whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from specx.export.tensor_files import RawTensor

if TYPE_CHECKING:
    from specx.export.checkpoint import CheckpointTensors

__all__ = ["FoldWeightTransposesPass", "StreamedTensor", "bind_checkpoint_weights"]

_BLOCK_BYTES = 64 << 20


class StreamedTensor(ir.LazyTensor):
    """A float32 weight computed from checkpoint tensors when it is written.

    `keys` are concatenated along axis 1 (after transposing each when `transposed`); one
    key is the common case.
    """

    def __init__(
        self,
        tensors: CheckpointTensors,
        keys: Sequence[str],
        transposed: bool,
        shape: Sequence[int],
        name: str,
    ):
        self.tensors, self.keys, self.is_transposed = tensors, tuple(keys), transposed
        super().__init__(
            lambda: ir.tensor(self.raw().float32(), name=name),
            dtype=ir.DataType.FLOAT,
            shape=ir.Shape(list(shape)),
            name=name,
        )

    def raw(self) -> RawTensor:
        """The values in the stored dtype, transposed and concatenated as the graph needs."""
        parts = [self.tensors.raw(key) for key in self.keys]
        if self.is_transposed:
            parts = [p.map(lambda a: np.ascontiguousarray(a.T)) for p in parts]
        if len(parts) == 1:
            return parts[0]
        if len({p.dtype for p in parts}) > 1:
            parts = [RawTensor(p.float32(), "F32") for p in parts]
        return RawTensor(np.concatenate([p.array for p in parts], axis=1), parts[0].dtype)

    def transposed(self, name: str) -> StreamedTensor:
        """This 2D weight transposed (a `Transpose` node folded away)."""
        assert len(self.keys) == 1 and len(self.shape) == 2
        shape = (self.shape[1], self.shape[0])
        return StreamedTensor(self.tensors, self.keys, not self.is_transposed, shape, name)

    def concatenated(self, others: Sequence[ir.TensorProtocol], name: str):
        """This 2D weight and `others` side by side along axis 1 (packed sibling MatMuls).

        NotImplemented unless every one is a StreamedTensor of the same checkpoint and
        orientation (then the caller concatenates in memory).
        """
        parts = [self, *others]
        if not all(
            isinstance(p, StreamedTensor)
            and p.is_transposed == self.is_transposed
            and p.tensors is self.tensors
            for p in parts
        ):
            return NotImplemented
        keys = [key for p in parts for key in p.keys]
        shape = (self.shape[0], sum(p.shape[1] for p in parts))
        return StreamedTensor(self.tensors, keys, self.is_transposed, shape, name)

    def tofile(self, file: BinaryIO) -> None:
        """Writes the float32 bytes in row blocks (onnx_ir's writer calls this)."""
        raw = self.raw()
        array = raw.array.reshape(raw.array.shape[0], -1) if raw.array.ndim else raw.array
        rows = max(1, _BLOCK_BYTES // max(4 * int(np.prod(array.shape[1:])), 1))
        for start in range(0, max(len(array), 1), rows):
            block = RawTensor(array[start : start + rows], raw.dtype).float32()
            file.write(memoryview(np.ascontiguousarray(block)).cast("B"))


def bind_checkpoint_weights(model: ir.Model, tensors: CheckpointTensors) -> int:
    """Makes every initializer named like a checkpoint tensor a StreamedTensor of it.

    Returns:
        How many initializers were bound.
    """
    bound = 0
    for value in model.graph.initializers.values():
        if value.name in tensors and value.const_value is not None:
            shape = tuple(value.const_value.shape)
            value.const_value = StreamedTensor(tensors, [value.name], False, shape, value.name)
            bound += 1
    return bound


class FoldWeightTransposesPass(InPlacePass):
    """`Transpose(streamed weight)` becomes a transposed streamed initializer.

    The exporter's own folding would compute each transposed weight in memory; here the
    transpose is only recorded and done when the weight is written.
    """

    def call(self, model: ir.Model) -> PassResult:  # noqa: D102
        graph, folded = model.graph, 0
        for node in list(graph):
            source = node.inputs[0] if node.inputs else None
            if not _is_weight_transpose(node, source):
                continue
            output = node.outputs[0]
            name = f"{source.name}.T"
            weight = ir.Value(name=name, const_value=source.const_value.transposed(name))
            weight.shape, weight.type = weight.const_value.shape, ir.TensorType(ir.DataType.FLOAT)
            graph.register_initializer(weight)
            ir.convenience.replace_all_uses_with(output, weight)
            graph.remove(node, safe=True)
            folded += 1
        for name in [n for n, v in graph.initializers.items() if not v.uses()]:
            if not graph.initializers[name].is_graph_output():
                graph.initializers.pop(name)
        return PassResult(model, modified=bool(folded))


def _is_weight_transpose(node: ir.Node, source: ir.Value | None) -> bool:
    if (node.domain, node.op_type) != ("", "Transpose") or source is None:
        return False
    if not isinstance(source.const_value, StreamedTensor) or len(source.const_value.shape) != 2:
        return False
    perm = node.attributes.get_ints("perm", None)
    return perm is None or list(perm) == [1, 0]
