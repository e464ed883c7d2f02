"""Medusa heads (FasterDecoding/Medusa `medusa_model.py`).

Head k predicts the token k + 2 positions ahead from the target's final post-norm hidden
state, `ResBlock(x) = x + SiLU(W x + b)`, in one of the two layouts the official training
writes (config.json `"version"`):
- "1" (or no version): `[ResBlock] * L + Linear(d, V, bias=False)` per head, keys
  `{head}.{layer}.linear.{weight,bias}` and `{head}.{L}.weight`;
- "2": `[ResBlock] * L` per head only, logits through the target's own `lm_head` (one
  weight shared by every head); keys `{head}.{layer}.linear.{weight,bias}`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specx.errors import CheckpointError
from specx.export.config import TargetConfig
from specx.export.heads.weights import check_state_dict, read_head

__all__ = ["MedusaHeads", "load_medusa"]

WEIGHT_NAMES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")


class ResBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """All heads at once: features [B, N, d] -> logits [B, N, heads, V].

    `shared_lm_head` (version 2): the heads end at their ResBlocks and share one lm_head.
    """

    kind = "medusa"
    taps = "last"

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int,
        num_layers: int,
        shared_lm_head: bool = False,
    ):
        super().__init__()
        self.hidden_size = hidden_size

        def head() -> nn.Sequential:
            blocks: list[nn.Module] = [ResBlock(hidden_size) for _ in range(num_layers)]
            if not shared_lm_head:  # each head's own lm_head (a new one per head)
                blocks.append(nn.Linear(hidden_size, vocab_size, bias=False))
            return nn.Sequential(*blocks)

        self.heads = nn.ModuleList(head() for _ in range(num_heads))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False) if shared_lm_head else None

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # noqa: D102
        outputs = [head(features) for head in self.heads]
        if self.lm_head is not None:
            outputs = [self.lm_head(h) for h in outputs]
        return torch.stack(outputs, dim=2)


VERSIONS = {"1": "per-head lm_head", "2": "ResBlocks only, the target's lm_head"}


def load_medusa(directory: str | Path, target: TargetConfig, target_weights) -> MedusaHeads:
    """Loads `medusa_lm_head.{safetensors,pt}` with `medusa_num_heads/_layers` from config.json.

    Raises:
        CheckpointError: config fields missing, an unknown `version`, or keys missing /
            mis-shaped (naming the head and layer, e.g. `2.1.linear.weight`).
    """
    ckpt = read_head(directory, WEIGHT_NAMES)
    where = ckpt.directory / "config.json"
    try:
        num_heads = int(ckpt.config["medusa_num_heads"])
        num_layers = int(ckpt.config["medusa_num_layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{where}: needs integer medusa_num_heads and medusa_num_layers"
        ) from e
    version = str(ckpt.config.get("version", "1"))
    if version not in VERSIONS:
        known = "; ".join(f'"{v}": {what}' for v, what in VERSIONS.items())
        raise CheckpointError(f"{where}: Medusa version {version!r} is unknown (known: {known})")
    shared = version == "2"
    head = MedusaHeads(target.hidden_size, target.vocab_size, num_heads, num_layers, shared)
    # Medusa saves the ModuleList's own state dict: keys "{head}.{layer}.linear.weight".
    expected = {
        k.removeprefix("heads."): tuple(v.shape)
        for k, v in head.state_dict().items()
        if k.startswith("heads.")
    }
    tensors = dict(ckpt.tensors)
    if not shared:
        _explain_version_2(tensors, num_heads, num_layers, where)
    state = {
        f"heads.{k}": v
        for k, v in check_state_dict("medusa", expected, tensors, ckpt.origin).items()
    }
    if shared:
        lm_head = target_weights["lm_head.weight"]
        if tuple(lm_head.shape) != (target.vocab_size, target.hidden_size):
            raise CheckpointError(
                f"the target's lm_head.weight is {tuple(lm_head.shape)}, expected "
                f"{(target.vocab_size, target.hidden_size)} for Medusa version 2"
            )
        state["lm_head.weight"] = lm_head.to(torch.float32)
    head.load_state_dict(state)
    return head.eval()


def _explain_version_2(tensors, num_heads: int, num_layers: int, where: Path) -> None:
    """A version-2 checkpoint (no per-head lm_head) whose config lacks "version": "2"."""
    lm_heads = [f"{h}.{num_layers}.weight" for h in range(num_heads)]
    blocks = [f"{h}.{layer}.linear.weight" for h in range(num_heads) for layer in range(num_layers)]
    if not any(k in tensors for k in lm_heads) and all(k in tensors for k in blocks):
        raise CheckpointError(
            f"{where}: the heads have ResBlocks but no lm_head ({lm_heads[0]!r} is missing): "
            'this is Medusa\'s version-2 layout; add "version": "2" to config.json to take the '
            "logits from the target's lm_head"
        )
