"""Medusa heads (FasterDecoding/Medusa `medusa_model.py`).

Head k predicts the token k + 2 positions ahead from the target's final post-norm hidden
state:
`[ResBlock] * L + Linear(d, V, bias=False)`, `ResBlock(x) = x + SiLU(W x + b)`.
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
    """All heads at once: features [B, N, d] -> logits [B, N, heads, V]."""

    kind = "medusa"
    taps = "last"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int):
        super().__init__()
        self.heads = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(hidden_size) for _ in range(num_layers)],
                nn.Linear(hidden_size, vocab_size, bias=False),
            )
            for _ in range(num_heads)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return torch.stack([head(features) for head in self.heads], dim=2)


def load_medusa(directory: str | Path, target: TargetConfig, target_weights=None) -> MedusaHeads:
    """Loads `medusa_lm_head.{safetensors,pt}` with `medusa_num_heads/_layers` from config.json.

    Raises:
        CheckpointError: config fields missing, or keys missing / mis-shaped (naming the
            head and layer, e.g. `2.1.linear.weight`).
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
    head = MedusaHeads(target.hidden_size, target.vocab_size, num_heads, num_layers)
    # Medusa saves the ModuleList's own state dict: keys "{head}.{layer}.linear.weight".
    expected = {k.removeprefix("heads."): tuple(v.shape) for k, v in head.state_dict().items()}
    state = check_state_dict("medusa", expected, ckpt.tensors, ckpt.origin)
    head.load_state_dict({f"heads.{k}": v for k, v in state.items()})
    return head.eval()
