"""Saving onnx-ir models with their weights in one external data file, one tensor at a time.

Lazy initializers (weights streamed from a checkpoint, quantized weights) are computed as
they are written, one at a time, so peak memory does not grow with the model. The data
file's sha256 is computed on a second thread while it is written, so the manifest need not
read it back (measured: 4.3 s of a 1.5B export). Hand-written rather than
`onnx_ir.save(external_data=...)` for that digest; the graph itself is then saved by
`onnx_ir.save`, which keeps external tensors as references.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import onnx_ir as ir

__all__ = ["SIZE_THRESHOLD", "save_streamed"]

SIZE_THRESHOLD = 1024  # initializers of more bytes go to the data file


class _HashingWriter:
    """A binary file that hashes what it is given and knows how much it has written.

    Each block is hashed on a second thread while it is written (both release the GIL), so
    the digest costs no time on a machine with two cores: writing is disk-bound.
    """

    def __init__(self, file, digest, hasher: ThreadPoolExecutor) -> None:
        self.file, self.digest, self.hasher, self.position = file, digest, hasher, 0

    def write(self, data) -> int:
        hashed = self.hasher.submit(self.digest.update, data)
        written = self.file.write(data)
        hashed.result()  # `data` may be a reused buffer: done with it before returning
        self.position += written
        return written


def save_streamed(
    model: ir.Model,
    path: Path,
    data_file: str,
    progress: Callable[[str], None] = lambda message: None,
) -> str:
    """Saves `path` with every initializer over `SIZE_THRESHOLD` bytes in `data_file` beside it.

    The model's large initializers become references into the new file.

    Returns:
        The sha256 of the data file.
    """
    path = Path(path)
    values = [
        v
        for v in model.graph.initializers.values()
        if v.const_value is not None and v.const_value.nbytes > SIZE_THRESHOLD
    ]
    digest = hashlib.sha256()
    temporary = path.parent / f".{data_file}.tmp"
    try:
        with open(temporary, "wb") as raw, ThreadPoolExecutor(1) as hasher:
            writer = _HashingWriter(raw, digest, hasher)
            for i, value in enumerate(values, 1):
                value.const_value = _write(writer, value.const_value, data_file, path.parent)
                if i == 1 or i % 20 == 0 or i == len(values):
                    progress(f"  writing weights: {i}/{len(values)} tensors ({value.name})")
        os.replace(temporary, path.parent / data_file)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        raise
    ir.save(model, path)
    return digest.hexdigest()


def _write(
    writer: _HashingWriter, tensor: ir.TensorProtocol, data_file: str, base_dir: Path
) -> ir.ExternalTensor:
    offset = writer.position
    if getattr(tensor, "writes_blocks", False):
        tensor.tofile(writer)  # writes in row blocks through `writer`
    else:
        writer.write(tensor.tobytes())
    length = writer.position - offset
    if length != tensor.nbytes:
        raise RuntimeError(f"{tensor.name}: wrote {length} bytes, expected {tensor.nbytes}")
    return ir.ExternalTensor(
        data_file,
        offset,
        length,
        tensor.dtype,
        shape=tensor.shape,
        name=tensor.name or "",
        base_dir=base_dir,
    )
