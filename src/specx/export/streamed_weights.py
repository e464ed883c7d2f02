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

__all__ = [
    "FoldWeightTransposesPass",
    "Scratch",
    "StreamedTensor",
    "bind_checkpoint_weights",
]

_BLOCK_BYTES = 64 << 20
_TILE = 128


class Scratch:
    """One float32 buffer reused for every block written.

    Fresh arrays per block cost more in page faults than the conversion itself (measured
    widening a bf16 matrix: docs/decisions.md#streamed-weights-copies).
    """

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.float32)
        self._raw = bytearray()

    def rows(self, count: int, width: int) -> np.ndarray:
        """A float32 block [count, width] (overwritten by the next call)."""
        if self._buffer.size < count * width:
            self._buffer = np.empty(count * width, dtype=np.float32)
        return self._buffer[: count * width].reshape(count, width)

    def raw(self, sizes: Sequence[int]) -> list[memoryview]:
        """Byte buffers of `sizes` for the stored tensors being written (reused)."""
        if len(self._raw) < sum(sizes):
            self._raw = bytearray(sum(sizes))
        views, start = [], 0
        for size in sizes:
            views.append(memoryview(self._raw)[start : start + size])
            start += size
        return views


def _widen(out: np.ndarray, source: np.ndarray, dtype: str) -> None:
    if dtype == "BF16":
        np.left_shift(source, 16, out=out.view(np.uint32), dtype=np.uint32, casting="unsafe")
    else:
        out[...] = source


def _widen_into(out: np.ndarray, source: np.ndarray, dtype: str) -> None:
    """Writes `source` (stored dtype) into float32 `out` without temporaries.

    A transposed source (a view whose rows are columns in memory) is copied in 128 x 128
    tiles that fit the cache: measured faster than numpy's strided copy on a transposed bf16
    weight (docs/decisions.md#streamed-weights-copies).
    """
    if source.ndim != 2 or source.strides[0] >= source.strides[1]:
        _widen(out, source, dtype)
        return
    for i in range(0, source.shape[0], _TILE):
        for j in range(0, source.shape[1], _TILE):
            tile = (slice(i, i + _TILE), slice(j, j + _TILE))
            _widen(out[tile], source[tile], dtype)


class StreamedTensor(ir.LazyTensor):
    """A float32 weight computed from checkpoint tensors when it is written.

    `keys` are concatenated along axis 1 (after transposing each when `transposed`); one
    key is the common case.
    """

    writes_blocks = True  # specx.graphs.model_io: call tofile() rather than tobytes()

    def __init__(
        self,
        tensors: CheckpointTensors,
        keys: Sequence[str],
        transposed: bool,
        shape: Sequence[int],
        name: str,
        scratch: Scratch | None = None,
    ):
        self.tensors, self.keys, self.is_transposed = tensors, tuple(keys), transposed
        self.scratch = scratch or Scratch()
        super().__init__(
            lambda: ir.tensor(self._float32(), name=name),
            dtype=ir.DataType.FLOAT,
            shape=ir.Shape(list(shape)),
            name=name,
        )

    def _parts(self, reuse: bool = False) -> list[RawTensor]:
        """The stored tensors, 2D views as the graph sees them (transposed where needed).

        `reuse`: read into the scratch's byte buffers (valid until the next call).
        """
        buffers: Sequence[memoryview | None] = [None] * len(self.keys)
        if reuse:
            buffers = self.scratch.raw([self.tensors.nbytes(key) for key in self.keys])
        parts = [self.tensors.raw(k, b) for k, b in zip(self.keys, buffers, strict=True)]
        if self.is_transposed:
            parts = [p.map(lambda a: a.T) for p in parts]
        return parts

    def _float32(self) -> np.ndarray:
        parts = [p.float32() for p in self._parts()]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    def transposed(self, name: str) -> StreamedTensor:
        """This 2D weight transposed (a `Transpose` node folded away)."""
        assert len(self.keys) == 1 and len(self.shape) == 2
        rows, columns = self.shape.numpy()
        return StreamedTensor(
            self.tensors, self.keys, not self.is_transposed, (columns, rows), name, self.scratch
        )

    def concatenated(self, others: Sequence[ir.TensorProtocol], name: str):
        """This 2D weight and `others` side by side along axis 1 (packed sibling MatMuls).

        NotImplemented unless every one is a StreamedTensor of the same checkpoint and
        orientation (then the caller concatenates in memory).
        """
        parts = [self, *others]
        streamed = [
            p
            for p in parts
            if isinstance(p, StreamedTensor)
            and p.is_transposed == self.is_transposed
            and p.tensors is self.tensors
        ]
        if len(streamed) != len(parts):
            return NotImplemented
        keys = [key for p in streamed for key in p.keys]
        shape = (self.shape.numpy()[0], sum(p.shape.numpy()[1] for p in streamed))
        return StreamedTensor(self.tensors, keys, self.is_transposed, shape, name, self.scratch)

    def tofile(self, file: BinaryIO) -> None:
        """Writes the float32 bytes in row blocks through the shared scratch buffers."""
        parts = self._parts(reuse=True)
        arrays = [
            p.array.reshape(p.array.shape[0], -1) if p.array.ndim else p.array.reshape(1, 1)
            for p in parts
        ]
        rows, width = arrays[0].shape[0], sum(a.shape[1] for a in arrays)
        step = max(1, _BLOCK_BYTES // (4 * width))
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            block = self.scratch.rows(stop - start, width)
            column = 0
            for part, array in zip(parts, arrays, strict=True):
                columns = array.shape[1]
                _widen_into(block[:, column : column + columns], array[start:stop], part.dtype)
                column += columns
            file.write(block.data.cast("B"))


def bind_checkpoint_weights(model: ir.Model, tensors: CheckpointTensors) -> int:
    """Makes every initializer named like a checkpoint tensor a StreamedTensor of it.

    Returns:
        How many initializers were bound.
    """
    bound, scratch = 0, Scratch()
    for value in model.graph.initializers.values():
        name, tensor = value.name, value.const_value
        if name is not None and name in tensors and tensor is not None:
            shape = tensor.shape.numpy()
            value.const_value = StreamedTensor(tensors, [name], False, shape, name, scratch)
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
            transposed = _weight_transpose(node)
            if transposed is None:
                continue
            source, streamed = transposed
            output = node.outputs[0]
            name = f"{source.name}.T"
            weight = ir.val(name, const_value=streamed.transposed(name))  # FLOAT, its shape
            graph.register_initializer(weight)
            ir.convenience.replace_all_uses_with(output, weight)
            graph.remove(node, safe=True)
            folded += 1
        for name in [n for n, v in graph.initializers.items() if not v.uses()]:
            if not graph.initializers[name].is_graph_output():
                graph.initializers.pop(name)
        return PassResult(model, modified=bool(folded))


def _weight_transpose(node: ir.Node) -> tuple[ir.Value, StreamedTensor] | None:
    """(source, its streamed weight) if `node` transposes a 2D streamed weight, else None."""
    source = node.inputs[0] if node.inputs else None
    if (node.domain, node.op_type) != ("", "Transpose") or source is None:
        return None
    weight = source.const_value
    if not isinstance(weight, StreamedTensor) or len(weight.shape) != 2:
        return None
    perm = node.attributes.get_ints("perm", None)
    return (source, weight) if perm is None or list(perm) == [1, 0] else None
