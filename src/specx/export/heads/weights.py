"""Reading and checking draft-head checkpoints (public formats, untrusted input)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from specx.errors import CheckpointError
from specx.export.checkpoint import load_tensor_file
from specx.export.config import TargetConfig, _rope

__all__ = ["HeadCheckpoint", "check_state_dict", "head_attention_config", "read_head"]


@dataclasses.dataclass(frozen=True)
class HeadCheckpoint:
    """A head's raw config (may be empty) and tensors, with the file each came from."""

    directory: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    origin: dict[str, Path]
    files: tuple[Path, ...]


def read_head(directory: str | Path, weight_names: tuple[str, ...]) -> HeadCheckpoint:
    """Reads `config.json` (if any) and the first existing weight file among `weight_names`.

    Raises:
        CheckpointError: no weight file, an unreadable one, or a pickle that runs code.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    config_path = directory / "config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config_path} is not valid JSON: {e}") from e
    files = [directory / name for name in weight_names if (directory / name).is_file()]
    if not files:
        raise CheckpointError(
            f"{directory}: no head weights (looked for {', '.join(weight_names)})"
        )
    tensors = load_tensor_file(files[0])
    return HeadCheckpoint(directory, config, tensors, dict.fromkeys(tensors, files[0]), (files[0],))


def check_state_dict(
    head: str,
    expected: dict[str, tuple[int, ...]],
    tensors: dict[str, torch.Tensor],
    origin: dict[str, Path],
) -> dict[str, torch.Tensor]:
    """fp32 state dict with exactly the expected keys and shapes.

    Raises:
        CheckpointError: a key is missing or has the wrong shape (naming file, key and
            expected vs actual shape).
    """
    state = {}
    for key, shape in expected.items():
        if key not in tensors:
            where = ", ".join(sorted({str(p) for p in origin.values()})) or "the checkpoint"
            raise CheckpointError(f"{where}: missing tensor {key!r} for the {head} head")
        tensor = tensors[key]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{origin[key]}: tensor {key!r} of the {head} head has shape "
                f"{tuple(tensor.shape)}, expected {shape}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"{origin[key]}: tensor {key!r} has dtype {tensor.dtype}")
        state[key] = tensor.to(torch.float32)
    return state


def head_attention_config(raw: dict[str, Any], target: TargetConfig, where: Path) -> TargetConfig:
    """The attention/MLP sizes of a one-layer head from its Llama-style config.json."""
    from transformers import LlamaConfig

    known = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    try:
        hf = LlamaConfig(**known)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: not a Llama-style head config: {e}") from e
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    inv_freq, scaling, _ = _rope(where, hf, head_dim, hf.rope_parameters or {})
    return dataclasses.replace(
        target.llama_layers(),
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=1,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        o_bias=bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        inv_freq=inv_freq,
        rope_attention_scaling=scaling,
    )
