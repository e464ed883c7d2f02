"""Weight files read one tensor at a time: safetensors by its header, torch files mmap'd.

Exports of real-size checkpoints must not hold the weights in memory, and a memory-mapped
read counts every page it touches as resident, so safetensors files are read here with
plain positioned reads (the format is an 8-byte header length, a JSON header of dtype,
shape and byte offsets per tensor, then the raw bytes). The header is untrusted input and
checked field by field. `.bin`/`.pt` files go through `torch.load(weights_only=True,
mmap=True)`, which refuses pickles that would run code.

A tensor comes back as a `RawTensor`: the bytes in the file's dtype (bfloat16 as uint16),
converted to float32 only where the caller asks, in whatever pieces it asks for.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specx.errors import CheckpointError

__all__ = ["RawTensor", "TensorFile", "open_tensor_file"]

# safetensors dtype -> (numpy storage dtype, floating).
_SAFETENSORS_DTYPES: dict[str, tuple[np.dtype, bool]] = {
    "F64": (np.dtype("<f8"), True),
    "F32": (np.dtype("<f4"), True),
    "F16": (np.dtype("<f2"), True),
    "BF16": (np.dtype("<u2"), True),  # converted by bit shift
    "I64": (np.dtype("<i8"), False),
    "I32": (np.dtype("<i4"), False),
    "I16": (np.dtype("<i2"), False),
    "I8": (np.dtype("i1"), False),
    "U8": (np.dtype("u1"), False),
    "BOOL": (np.dtype("?"), False),
}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class RawTensor:
    """A tensor's values in its stored dtype; `dtype` names it ("BF16", "F32", ...)."""

    array: np.ndarray
    dtype: str

    @property
    def floating(self) -> bool:
        """True for F16/BF16/F32/F64."""
        return self.dtype in ("F16", "BF16", "F32", "F64")

    def float32(self) -> np.ndarray:
        """The values as a new float32 array (bfloat16 widened exactly)."""
        if self.dtype == "BF16":
            widened = self.array.astype(np.uint32) << 16
            return widened.view(np.float32)
        return self.array.astype(np.float32)

    def torch(self):
        """The values as a torch tensor of the stored dtype (shares memory)."""
        import torch

        if self.dtype == "BF16":
            return torch.from_numpy(self.array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(self.array)

    def map(self, function) -> RawTensor:
        """The same dtype, `function` applied to the stored array (a transpose, a slice)."""
        return RawTensor(function(self.array), self.dtype)


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class TensorFile:
    """The tensors of one weight file, read on demand."""

    def __init__(self, path: Path):
        self.path = path
        self._entries: dict[str, _Entry] = {}
        self._torch: dict[str, Any] | None = None
        if path.suffix == ".safetensors":
            self._entries = _read_header(path)
        elif path.suffix in (".bin", ".pt", ".pth"):
            self._torch = _torch_load(path)
        else:
            raise CheckpointError(f"{path}: unknown weight file type {path.suffix!r}")

    def __reduce__(self):
        # Opened again where unpickled (the export's weight writer process): the header is
        # read again, a torch file mapped again, rather than its tensors copied.
        return (TensorFile, (self.path,))

    def keys(self) -> list[str]:
        """Tensor names, in file order."""
        return list(self._entries) if self._torch is None else list(self._torch)

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of `key`, without reading it."""
        if self._torch is not None:
            return tuple(self._torch[key].shape)
        return self._entries[key].shape

    def dtype(self, key: str) -> str:
        """The stored dtype of `key` in safetensors' names, without reading it."""
        if self._torch is not None:
            return _TORCH_NAMES.get(str(self._torch[key].dtype), str(self._torch[key].dtype))
        return self._entries[key].dtype

    def read(self, key: str, buffer: bytearray | memoryview | None = None) -> RawTensor:
        """The whole tensor in its stored dtype, in `buffer` when one is given (reused).

        A reused buffer saves the page faults of a fresh allocation per tensor, which cost
        more than the read itself on large weights.
        """
        if self._torch is not None:
            return _from_torch(self._torch[key])
        entry = self._entries[key]
        storage, _ = _SAFETENSORS_DTYPES[entry.dtype]
        if buffer is None:
            array = np.empty(entry.shape, dtype=storage)
        else:
            array = np.frombuffer(buffer, dtype=storage, count=int(np.prod(entry.shape)))
            array = array.reshape(entry.shape)
        with open(self.path, "rb") as f:
            f.seek(entry.begin)
            if f.readinto(array.data.cast("B")) != entry.end - entry.begin:
                raise CheckpointError(f"{self.path}: tensor {key} is truncated")
        return RawTensor(array, entry.dtype)


def open_tensor_file(path: str | os.PathLike[str]) -> TensorFile:
    """Opens a weight file and checks its index (header); reads no tensor data.

    Raises:
        CheckpointError: unreadable file, malformed header, or a code-running pickle.
    """
    return TensorFile(Path(path))


def _read_header(path: Path) -> dict[str, _Entry]:
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= _MAX_HEADER:
                raise CheckpointError(f"{path}: not a safetensors file (header size {size})")
            header = json.loads(f.read(size).decode("utf-8"))
        file_size = path.stat().st_size
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not an object")
    start = 8 + size
    entries = {}
    for key, value in header.items():
        if key == "__metadata__":
            continue
        entries[key] = _entry(path, key, value, start, file_size)
    return entries


def _entry(path: Path, key: str, value: Any, start: int, file_size: int) -> _Entry:
    try:
        dtype, shape, (begin, end) = value["dtype"], value["shape"], value["data_offsets"]
        storage, _ = _SAFETENSORS_DTYPES[dtype]
        shape = tuple(int(d) for d in shape if isinstance(d, int) and d >= 0)
        if len(shape) != len(value["shape"]) or not (
            isinstance(begin, int) and isinstance(end, int)
        ):
            raise ValueError("bad shape or offsets")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed safetensors entry for {key!r}: {e!r}") from e
    nbytes = int(np.prod(shape, dtype=np.int64)) * storage.itemsize
    if not 0 <= begin <= end or end - begin != nbytes or start + end > file_size:
        raise CheckpointError(
            f"{path}: tensor {key} claims bytes [{begin}, {end}) for shape {shape} {dtype}, "
            "which do not fit the file (truncated or corrupt)"
        )
    return _Entry(dtype, shape, start + begin, start + end)


_TORCH_NAMES = {
    "torch.float64": "F64",
    "torch.float32": "F32",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
}


def _torch_load(path: Path) -> dict[str, Any]:
    import torch

    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            loaded = torch.load(path, map_location="cpu", weights_only=True)  # legacy format
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refused to load {path}: it is a pickle that constructs objects other than "
            f"tensors (it could run code). Convert it to safetensors. Detail: {e}"
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable torch weight file: {e}") from e
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise CheckpointError(f"{path}: expected a dict of name -> tensor")
    return loaded


def _from_torch(tensor) -> RawTensor:
    import torch

    name = _TORCH_NAMES.get(str(tensor.dtype))
    if name == "BF16":
        return RawTensor(tensor.contiguous().view(torch.int16).numpy().view(np.uint16), name)
    if name is not None:
        return RawTensor(tensor.contiguous().numpy(), name)
    # Integer and bool tensors (EAGLE-3's d2t/t2d) keep numpy's name for their dtype.
    return RawTensor(tensor.contiguous().numpy(), str(tensor.dtype))
