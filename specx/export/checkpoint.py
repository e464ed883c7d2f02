"""Safe loading of HF checkpoint weights, checked against the shapes the config implies.

Checkpoints are untrusted input. Safetensors files are preferred; `.bin`/`.pt` files are
read only through `torch.load(weights_only=True)`, which refuses any pickle that would
construct objects other than tensors and plain containers (i.e. run code).
"""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specx.errors import CheckpointError
from specx.export.config import TargetConfig, load_target_config
from specx.export.decoder import TargetDecoder

__all__ = ["Checkpoint", "load_checkpoint", "load_tensor_file", "weight_files"]

log = logging.getLogger(__name__)

# Keys some checkpoints carry that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE_NAMES = ("model.safetensors", "pytorch_model.bin", "model.pt")


@dataclass(frozen=True)
class Checkpoint:
    """A loaded target checkpoint: parsed config, raw config.json, fp32 weights, source files."""

    directory: Path
    config: TargetConfig
    raw_config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
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
    """Reads one weight file into a dict of tensors without running any code from it.

    Raises:
        CheckpointError: the file is unreadable, not a tensor dict, or a pickle that
            tries to construct arbitrary objects.
    """
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from e
    if path.suffix not in (".bin", ".pt", ".pth"):
        raise CheckpointError(f"{path}: unknown weight file type {path.suffix!r}")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=False)
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


def load_checkpoint(checkpoint_dir: str | Path) -> Checkpoint:
    """Loads and checks a supported HF target checkpoint; weights come back as fp32.

    Raises:
        CheckpointError: unsupported config, missing files, or a tensor that is missing,
            mis-shaped or not floating point (naming the file and key).
    """
    checkpoint_dir = Path(checkpoint_dir)
    config, raw_config = load_target_config(checkpoint_dir)
    files = weight_files(checkpoint_dir)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in files:
        for key, tensor in load_tensor_file(path).items():
            tensors[key] = tensor
            origin[key] = path
    if config.tie_word_embeddings and "lm_head.weight" not in tensors:
        key = "model.embed_tokens.weight"
        if key in tensors:
            tensors["lm_head.weight"], origin["lm_head.weight"] = tensors[key], origin[key]
    expected = TargetDecoder.parameter_shapes(config)
    missing = [key for key in expected if key not in tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(
            f"{checkpoint_dir}: missing tensors {shown} (read {', '.join(p.name for p in files)})"
        )
    state_dict = {}
    for key, shape in expected.items():
        tensor = tensors[key]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{origin[key]}: tensor {key} has shape {tuple(tensor.shape)}, expected {shape} "
                "from config.json"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"{origin[key]}: tensor {key} has dtype {tensor.dtype}")
        state_dict[key] = tensor.to(torch.float32)
    unused = [k for k in tensors if k not in expected and not k.endswith(_IGNORED_SUFFIXES)]
    if unused:
        log.warning(
            "%s: ignoring %d unused tensors, e.g. %s", checkpoint_dir, len(unused), unused[0]
        )
    return Checkpoint(checkpoint_dir, config, raw_config, state_dict, tuple(files))
