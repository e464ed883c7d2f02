"""Acceptance statistics of a speculative run, in the units users compare across systems."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["AcceptanceStats"]


@dataclass
class AcceptanceStats:
    """Per round: the draft's depth and how many draft tokens the target accepted.

    acceptance length (tau) = mean tokens emitted per round = mean(accepted) + 1, the
    bonus/correction token counted, so plain decoding has tau = 1.
    acceptance_by_position[d-1] = P(accepted >= d | the draft reached depth d).
    conditional_acceptance_by_position[d-1] = P(accepted >= d | accepted >= d-1, depth >= d).
    """

    depths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def record(self, draft_depth: int, accepted: int) -> None:
        """Adds one round."""
        self.depths.append(draft_depth)
        self.accepted.append(accepted)

    def record_plain(self, rounds: int) -> None:
        """Adds `rounds` rounds without a draft."""
        self.depths += [0] * rounds
        self.accepted += [0] * rounds

    @classmethod
    def merge(cls, parts: Iterable[AcceptanceStats]) -> AcceptanceStats:
        """All rounds of several sequences."""
        merged = cls()
        for part in parts:
            merged.depths += part.depths
            merged.accepted += part.accepted
        return merged

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers."""
        depths, accepted = np.array(self.depths, int), np.array(self.accepted, int)
        rounds = len(depths)
        max_depth = int(depths.max()) if rounds else 0
        by_position, conditional = [], []
        for d in range(1, max_depth + 1):
            reached = depths >= d
            by_position.append(float((accepted[reached] >= d).mean()))
            tried = reached & (accepted >= d - 1)
            conditional.append(float((accepted[tried] >= d).mean()) if tried.any() else 0.0)
        return {
            "rounds": rounds,
            "rounds_with_draft": int((depths > 0).sum()),
            "acceptance_length": float(accepted.mean() + 1) if rounds else 0.0,
            "accepted_tokens": int(accepted.sum()),
            "acceptance_by_position": by_position,
            "conditional_acceptance_by_position": conditional,
        }
