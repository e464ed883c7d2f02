"""Acceptance statistics by depth and draft rank, and acceptance vs draft confidence.

Measured by running the drafter on a *probe tree*: at every depth d = 1..D, the K
top-ranked candidates under the rank-0 path (`probe_choices(K, D)`, K*D nodes). Greedy
verification accepts the node whose token is the target's, so one round tells, for each
depth the rank-0 path reached, which rank (if any, below K) the target's token had:

    p(d, k) = P(the target's token at depth d is the draft's rank-k candidate
                | the draft's top-1 tokens at depths 1..d-1 were all accepted)

These are Medusa's per-head, per-rank accuracies, generalised to autoregressive drafters
by conditioning on the top-1 path. Treating depths as independent, a tree's expected
number of accepted tokens is the sum over its nodes of the product of p along the
node's path (`specx.calibration.tree_selection`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specx.runtime.trees import DraftTree, depths
from specx.runtime.verification import Verdict

__all__ = ["CONFIDENCE_BINS", "AcceptanceCounts", "probe_choices"]

CONFIDENCE_BINS = np.linspace(0.0, 1.0, 11)


def probe_choices(top_k: int, depth: int) -> list[list[int]]:
    """Medusa-style choices of the probe tree: K ranks at each depth under the rank-0 path."""
    return [[0] * d + [k] for d in range(depth) for k in range(top_k)]


@dataclass
class AcceptanceCounts:
    """Counts from probe-tree rounds (see the module docstring)."""

    top_k: int
    depth: int
    reached: np.ndarray = field(init=False)  # [D] rounds whose top-1 path reached depth d-1
    hits: np.ndarray = field(init=False)  # [D, K] of those, target token = rank-k candidate
    confidence_tried: np.ndarray = field(init=False)  # [bins] nodes tried, by confidence
    confidence_accepted: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.reached = np.zeros(self.depth, dtype=np.int64)
        self.hits = np.zeros((self.depth, self.top_k), dtype=np.int64)
        self.confidence_tried = np.zeros(len(CONFIDENCE_BINS) - 1, dtype=np.int64)
        self.confidence_accepted = np.zeros(len(CONFIDENCE_BINS) - 1, dtype=np.int64)

    def record(self, draft: DraftTree, ranks: np.ndarray, verdict: Verdict) -> None:
        """Adds one verified probe tree; `ranks[i]` is node i's rank among its siblings."""
        if not len(draft):
            return
        level = depths(draft.parents)
        accepted = set(verdict.accepted)
        on_path = {-1}  # nodes whose whole path was accepted (the root always is)
        on_path.update(verdict.accepted)
        for d in range(min(self.depth, int(level.max()) + 1)):
            at_depth = np.flatnonzero(level == d)
            tried = [n for n in at_depth if int(draft.parents[n]) in on_path]
            if not tried:
                break
            self.reached[d] += 1
            for node in tried:
                if node in accepted and ranks[node] < self.top_k:
                    self.hits[d, ranks[node]] += 1
            if draft.confidence is not None:
                bins = np.clip(np.digitize(draft.confidence[tried], CONFIDENCE_BINS) - 1, 0, 9)
                np.add.at(self.confidence_tried, bins, 1)
                np.add.at(self.confidence_accepted, bins, [n in accepted for n in tried])

    def probabilities(self) -> np.ndarray:
        """p[d, k] (see the module docstring); 0 where depth d was never reached."""
        return self.hits / np.maximum(self.reached, 1)[:, None]

    def summary(self) -> dict[str, Any]:
        """JSON-ready: p by depth and rank, rounds per depth, acceptance by confidence."""
        by_confidence = [
            {
                "confidence": [float(lo), float(hi)],
                "tried": int(t),
                "acceptance": float(a / t) if t else None,
            }
            for lo, hi, t, a in zip(
                CONFIDENCE_BINS[:-1],
                CONFIDENCE_BINS[1:],
                self.confidence_tried,
                self.confidence_accepted,
                strict=True,
            )
        ]
        return {
            "top_k": self.top_k,
            "depth": self.depth,
            "rounds_reaching_depth": self.reached.tolist(),
            "acceptance_by_depth_and_rank": self.probabilities().round(4).tolist(),
            "acceptance_by_confidence": by_confidence,
        }
