"""Saving onnx-ir models with their weights in one external data file, one tensor at a time.

Lazy initializers (weights streamed from a checkpoint, quantized weights) are computed as
they are written, one at a time, so peak memory does not grow with the model. The data
file's sha256 is computed on a second thread while it is written, so the manifest need not
read it back, which was measured as a noticeable share of a 1.5B export's time
(docs/decisions.md#sha256-while-writing). Hand-written rather than
`onnx_ir.save(external_data=...)` for that digest and so that tensors may be written before
the graph that uses them exists (`DataFile.reuse`: the export writes weights while it
traces); the graph itself is then saved by `onnx_ir.save`, which keeps external tensors as
references.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, cast

import onnx_ir as ir

__all__ = ["SIZE_THRESHOLD", "DataFile", "TensorSink", "save_streamed"]

SIZE_THRESHOLD = 1024  # initializers of more bytes go to the data file

# A tensor already in the data file, or None: lets a caller place tensors written earlier.
Reuse = Callable[[ir.TensorProtocol], ir.ExternalTensor | None]


class _WritesBlocks(Protocol):
    """A tensor that writes itself in blocks (`writes_blocks`: StreamedTensor)."""

    def tofile(self, file: DataFile) -> None: ...  # noqa: D102


class TensorSink(Protocol):
    """Where `save_streamed` writes tensors.

    A `DataFile`, or one written by another process (`specx.export.weight_writer`).
    """

    def append(self, tensor: ir.TensorProtocol) -> ir.ExternalTensor: ...  # noqa: D102

    def close(self) -> str: ...  # noqa: D102

    def abort(self) -> None: ...  # noqa: D102


class DataFile:
    """An external data file being written: tensors appended, hashed on the way.

    Written under a temporary name; `close()` renames it into place and returns its
    sha256, `abort()` removes it. Each block is hashed on a second thread while it is
    written (both release the GIL): writing is disk-bound.
    """

    def __init__(self, directory: Path, name: str):
        self.directory, self.name = Path(directory), name
        self.temporary = self.directory / f".{name}.tmp"
        self._file = open(self.temporary, "wb")  # noqa: SIM115 (closed by close/abort)
        self._hasher = ThreadPoolExecutor(1)
        self._digest = hashlib.sha256()
        self.position = 0

    def write(self, data) -> int:
        """Appends bytes (the file protocol StreamedTensor.tofile writes through)."""
        hashed = self._hasher.submit(self._digest.update, data)
        written = self._file.write(data)
        hashed.result()  # `data` may be a reused buffer: done with it before returning
        self.position += written
        return written

    def append(self, tensor: ir.TensorProtocol) -> ir.ExternalTensor:
        """Writes `tensor` at the end; returns the reference that replaces it in a graph."""
        offset = self.position
        if getattr(tensor, "writes_blocks", False):
            # writes in row blocks through `self.write`
            cast(_WritesBlocks, tensor).tofile(self)
        else:
            self.write(tensor.tobytes())
        length = self.position - offset
        if length != tensor.nbytes:
            raise RuntimeError(f"{tensor.name}: wrote {length} bytes, expected {tensor.nbytes}")
        return ir.ExternalTensor(
            self.name,
            offset,
            length,
            tensor.dtype,
            shape=ir.Shape(tensor.shape.numpy()),  # a stored tensor's dims are ints
            name=tensor.name or "",
            base_dir=self.directory,
        )

    def close(self) -> str:
        """Renames the file into place; returns its sha256."""
        self._file.close()
        self._hasher.shutdown()
        os.replace(self.temporary, self.directory / self.name)
        return self._digest.hexdigest()

    def abort(self) -> None:
        """Removes the partial file."""
        self._file.close()
        self._hasher.shutdown()
        with contextlib.suppress(FileNotFoundError):
            self.temporary.unlink()


def save_streamed(
    model: ir.Model,
    path: Path,
    data_file: str | TensorSink,
    progress: Callable[[str], None] = lambda message: None,
    reuse: Reuse = lambda tensor: None,
) -> str:
    """Saves `path` with every initializer over `SIZE_THRESHOLD` bytes in a data file beside it.

    `data_file` is a name, or a sink already partly written, whose tensors `reuse` finds.
    The model's large initializers become references into the file.

    Returns:
        The sha256 of the data file.
    """
    path = Path(path)
    data = DataFile(path.parent, data_file) if isinstance(data_file, str) else data_file
    values = [
        (v, v.const_value)
        for v in model.graph.initializers.values()
        if v.const_value is not None and v.const_value.nbytes > SIZE_THRESHOLD
    ]
    try:
        for i, (value, tensor) in enumerate(values, 1):
            value.const_value = reuse(tensor) or data.append(tensor)
            if i == 1 or i % 20 == 0 or i == len(values):
                progress(f"  writing weights: {i}/{len(values)} tensors ({value.name})")
        digest = data.close()
    except BaseException:
        data.abort()
        raise
    ir.save(model, path)
    return digest
