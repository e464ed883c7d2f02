"""Safe loading of HF checkpoint weights, checked against the shapes the config implies.

Checkpoints are untrusted input. Safetensors files are preferred; `.bin`/`.pt` files are
read only through `torch.load(weights_only=True)`, which refuses any pickle that would
construct objects other than tensors and plain containers (i.e. run code).

Opening a checkpoint reads its indexes only: every expected tensor is checked by name,
shape and dtype, and no weight is read until it is used (`CheckpointTensors`), so an
export can stream a model larger than memory one tensor at a time.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specx.errors import CheckpointError
from specx.export.config import TargetConfig, load_target_config
from specx.export.decoder import TargetDecoder
from specx.export.tensor_files import RawTensor, TensorFile, open_tensor_file

__all__ = [
    "Checkpoint",
    "CheckpointTensors",
    "load_checkpoint",
    "load_tensor_file",
    "weight_files",
]

log = logging.getLogger(__name__)

# Keys some checkpoints carry that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE_NAMES = ("model.safetensors", "pytorch_model.bin", "model.pt")


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """The checked weights of a checkpoint, read from disk when used.

    As a mapping it gives float32 torch tensors (what training and the torch modules
    use); `raw(key)` gives the stored values, which exports convert piece by piece.
    `aliases` maps a key to the stored tensor it shares (a tied lm_head).
    """

    def __init__(self, files: dict[str, TensorFile], aliases: dict[str, str] | None = None):
        self._files = files  # key -> the file holding it
        self._aliases = aliases or {}

    def source_key(self, key: str) -> str:
        """The stored tensor behind `key`."""
        return self._aliases.get(key, key)

    def raw(self, key: str, buffer: bytearray | memoryview | None = None) -> RawTensor:
        """The tensor in its stored dtype (read into `buffer`, if given, which it must fit)."""
        stored = self.source_key(key)
        return self._files[stored].read(stored, buffer)

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of the stored tensor, without reading it."""
        stored = self.source_key(key)
        return self._files[stored].shape(stored)

    def nbytes(self, key: str) -> int:
        """Bytes of the stored tensor, without reading it."""
        stored = self.source_key(key)
        source = self._files[stored]
        itemsize = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}[source.dtype(stored)]
        return itemsize * math.prod(source.shape(stored))

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self:
            raise KeyError(key)
        return torch.from_numpy(self.raw(key).float32())

    def __contains__(self, key: object) -> bool:
        return key in self._files or key in self._aliases

    def __iter__(self) -> Iterator[str]:
        yield from self._files
        yield from self._aliases

    def __len__(self) -> int:
        return len(self._files) + len(self._aliases)


class _RowSlice:
    """Rows [start, stop) of a stored tensor, as a `TensorFile` of that one tensor.

    Phi-3's fused q/k/v and gate/up projections are read this way.
    """

    def __init__(self, file: TensorFile, key: str, start: int, stop: int):
        self.file, self.key, self.start, self.stop = file, key, start, stop

    @property
    def path(self) -> Path:  # noqa: D102
        return self.file.path

    def shape(self, key: str) -> tuple[int, ...]:  # noqa: D102
        return (self.stop - self.start, *self.file.shape(self.key)[1:])

    def dtype(self, key: str) -> str:  # noqa: D102
        return self.file.dtype(self.key)

    def read(self, key: str, buffer: bytearray | memoryview | None = None) -> RawTensor:  # noqa: D102
        return self.file.read(self.key).map(lambda a: a[self.start : self.stop])


class _Offset:
    """A stored tensor plus a constant, in float32, as a `TensorFile` of that one tensor.

    Gemma's RMSNorm scales by 1 + w: its norm weights are read as 1 + w, so every graph and
    module holds the scale itself. Float32, as transformers adds the 1 (`1.0 + w.float()`).
    """

    def __init__(self, file: TensorFile, key: str, offset: float):
        self.file, self.key, self.offset = file, key, offset

    @property
    def path(self) -> Path:  # noqa: D102
        return self.file.path

    def shape(self, key: str) -> tuple[int, ...]:  # noqa: D102
        return self.file.shape(self.key)

    def dtype(self, key: str) -> str:  # noqa: D102
        return "F32"

    def read(self, key: str, buffer: bytearray | memoryview | None = None) -> RawTensor:  # noqa: D102
        return RawTensor(self.file.read(self.key).float32() + np.float32(self.offset), "F32")


def _offset_norms(holder: dict, config: TargetConfig) -> None:
    for key in [k for k in holder if k.endswith("norm.weight")]:
        holder[key] = _Offset(holder[key], key, config.norm_offset)


def _split_fused(holder: dict, config: TargetConfig) -> set[str]:
    """Phi-3's `qkv_proj` and `gate_up_proj` as the decoder's q/k/v and gate/up tensors.

    The fused weights stack them by rows in that order. Returns the fused keys so used.
    """
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    parts = {
        "self_attn.qkv_proj": [("self_attn.q_proj", 0, q), ("self_attn.k_proj", q, q + kv),
                               ("self_attn.v_proj", q + kv, q + 2 * kv)],
        "mlp.gate_up_proj": [("mlp.gate_proj", 0, config.intermediate_size),
                             ("mlp.up_proj", config.intermediate_size,
                              2 * config.intermediate_size)],
    }  # fmt: skip
    used = set()
    for layer in range(config.num_layers):
        for fused, pieces in parts.items():
            key = f"model.layers.{layer}.{fused}.weight"
            if key not in holder:
                continue
            if holder[key].shape(key)[0] != pieces[-1][2]:
                raise CheckpointError(
                    f"{holder[key].path}: tensor {key} has {holder[key].shape(key)[0]} rows, "
                    f"expected {pieces[-1][2]} from config.json"
                )
            for name, start, stop in pieces:
                holder[f"model.layers.{layer}.{name}.weight"] = _RowSlice(
                    holder[key], key, start, stop
                )
            used.add(key)
    return used


@dataclass(frozen=True)
class Checkpoint:
    """An opened target checkpoint: parsed config, raw config.json, lazy weights, files."""

    directory: Path
    config: TargetConfig
    raw_config: dict[str, Any]
    state_dict: CheckpointTensors
    files: tuple[Path, ...]


def weight_files(checkpoint_dir: Path) -> list[Path]:
    """The weight files of a checkpoint: from a shard index, a single file, or a glob."""
    for index_name in _INDEX_NAMES:
        index_path = checkpoint_dir / index_name
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path} is not a valid shard index: {e}") from e
            shards = [checkpoint_dir / name for name in dict.fromkeys(weight_map.values())]
            for shard in shards:
                if not shard.is_file():
                    raise CheckpointError(f"{index_path} lists {shard.name}, which is missing")
            return shards
    for name in _SINGLE_NAMES:
        if (checkpoint_dir / name).is_file():
            return [checkpoint_dir / name]
    found = sorted(checkpoint_dir.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(
        f"{checkpoint_dir}: no weights found (looked for *.safetensors, a shard index, "
        f"{', '.join(_SINGLE_NAMES)})"
    )


def load_tensor_file(path: Path) -> dict[str, torch.Tensor]:
    """Reads one (small) weight file into a dict of tensors of their stored dtypes.

    Raises:
        CheckpointError: the file is unreadable, not a tensor dict, or a pickle that
            tries to construct arbitrary objects.
    """
    tensors = open_tensor_file(path)
    return {key: tensors.read(key).torch() for key in tensors.keys()}


def load_checkpoint(checkpoint_dir: str | Path) -> Checkpoint:
    """Opens and checks a supported HF target checkpoint; weights are read when used.

    Raises:
        CheckpointError: unsupported config, missing files, or a tensor that is missing,
            mis-shaped or not floating point (naming the file and key).
    """
    checkpoint_dir = Path(checkpoint_dir)
    config, raw_config = load_target_config(checkpoint_dir)
    files = weight_files(checkpoint_dir)
    holder: dict[str, TensorFile] = {}
    for path in files:
        opened = open_tensor_file(path)
        holder.update(dict.fromkeys(opened.keys(), opened))
    fused = _split_fused(holder, config) if config.family == "phi3" else set()
    if config.norm_offset:
        _offset_norms(holder, config)
    aliases = {}
    if config.tie_word_embeddings and "lm_head.weight" not in holder:
        if "model.embed_tokens.weight" in holder:
            aliases["lm_head.weight"] = "model.embed_tokens.weight"
    expected = TargetDecoder.parameter_shapes(config)
    missing = [key for key in expected if key not in holder and key not in aliases]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(
            f"{checkpoint_dir}: missing tensors {shown} (read {', '.join(p.name for p in files)})"
        )
    for key, shape in expected.items():
        stored = aliases.get(key, key)
        source = holder[stored]
        if source.shape(stored) != shape:
            raise CheckpointError(
                f"{source.path}: tensor {stored} has shape {source.shape(stored)}, expected "
                f"{shape} from config.json"
            )
        if source.dtype(stored) not in ("F16", "BF16", "F32", "F64"):
            raise CheckpointError(
                f"{source.path}: tensor {stored} has dtype {source.dtype(stored)}"
            )
    unused = [
        k
        for k in holder
        if k not in expected and k not in fused and not k.endswith(_IGNORED_SUFFIXES)
    ]
    if unused:
        log.warning(
            "%s: ignoring %d unused tensors, e.g. %s", checkpoint_dir, len(unused), unused[0]
        )
    tensors = CheckpointTensors({k: holder[k] for k in expected if k in holder}, aliases)
    return Checkpoint(checkpoint_dir, config, raw_config, tensors, tuple(files))
