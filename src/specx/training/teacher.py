"""The frozen target as teacher: next-token probabilities and hidden-state taps per window."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from specx.export.config import TargetConfig
from specx.export.decoder import TargetDecoder

__all__ = ["Teacher", "TeacherOutput"]


@dataclass(frozen=True)
class TeacherOutput:
    """For windows [B, T]: probs[:, t] is the target's distribution of token t + 1."""

    probs: torch.Tensor  # [B, T, V]
    last: torch.Tensor  # [B, T, d] final post-norm hidden state
    eagle3: torch.Tensor | None  # [B, T, 3d] states entering the tap layers


class Teacher:
    """Runs the target once per batch under no_grad, capturing both tap kinds."""

    def __init__(
        self,
        config: TargetConfig,
        state_dict: Mapping[str, torch.Tensor],
        tap_layers: tuple[int, ...] | None = None,
    ):
        self.config = config
        taps = "eagle3" if config.num_layers >= 3 else "none"
        # `tap_layers`: the head's own taps, or those of a deployment target whose streams
        # equal this teacher's (pyref-7m's 2, 3, 5 are pyref-deep's 2, 16, 32).
        self.decoder = TargetDecoder.from_state_dict(config, state_dict, taps, tap_layers)
        self._last: list[torch.Tensor] = []
        # The lm_head's input is the final post-norm hidden state (the `last` taps).
        self.decoder.lm_head.register_forward_hook(lambda m, args, out: self._last.append(args[0]))

    @torch.no_grad()
    def __call__(self, windows: torch.Tensor) -> TeacherOutput:
        """Teacher outputs for windows [B, T]."""
        batch, n = windows.shape
        c = self.config
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(batch, 1, n, n)
        cache = [torch.zeros(batch, c.num_kv_heads, n, c.head_dim) for _ in range(2 * c.num_layers)]
        self._last.clear()
        outputs = self.decoder(
            windows,
            torch.arange(n).expand(batch, n),
            mask,
            torch.zeros(batch, dtype=torch.int64),
            cache,
        )
        eagle3 = outputs[1] if self.decoder.taps == "eagle3" else None
        return TeacherOutput(torch.softmax(outputs[0], -1), self._last[0], eagle3)
