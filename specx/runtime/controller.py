"""Per-round draft sizes: speculation that backs off where it does not pay, and comes back.

A drafter proposes up to `max_nodes` nodes per sequence; a controller decides, before each
round, how many of them each sequence keeps: 0 (no draft: the sequence takes one plain step
inside the round's verify forward) up to all. The kept nodes are a prefix of the draft
(parents precede children, so a prefix is a tree, and a chain's prefix is a shorter chain).

Lossless whatever the sizes: a size depends only on rounds already verified and on the
draft's shape (never on what the target will say about it), verification is unchanged, and
dropping nodes chosen independently of their tokens leaves the rest drafted as the rule
assumes. `tests/test_controller.py` forces a switch every round and checks greedy identity
and the sampled distribution.

`AdaptiveController`, per sequence b and round: with p_d the running acceptance at depth d
given depth d - 1 accepted (an exponential moving average over b's own rounds) and a round
cost model T(k) learnt from the loop's own timings,

    k* = argmax_k (1 + sum_{d <= k} p_1 ... p_d) / T(k),   T(0) = a plain step,

over k in {0, 1, 2, 4, ...} up to the drafter's budget. A sequence at k = 0 is probed with the
full budget every `probe_every` rounds, so one that becomes predictable gets speculation back.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specx.runtime.trees import DraftTree

__all__ = ["AdaptiveController", "Controller", "FixedSizes", "truncated"]


class Controller(Protocol):
    """Chooses each round's draft size per sequence and learns from what was verified."""

    def start(self, batch: int, max_nodes: int) -> None:
        """Resets per-sequence state for a new batch."""
        ...

    def sizes(self, active: np.ndarray) -> np.ndarray:
        """[B] nodes each sequence keeps this round (0: no draft); 0 for inactive rows."""
        ...

    def observe(self, row: int, depth: int, accepted: int) -> None:
        """Row `row` drafted to `depth` this round and the target accepted `accepted`."""
        ...

    def timed(self, width: int, verify_s: float, draft_s: float) -> None:
        """Times of the round: its verify over `width` tokens per row and its drafting.

        `verify_s` includes the loop's work around the forward; `draft_s` is 0 when no row
        drafted.
        """
        ...

    def summary(self) -> dict:
        """How often each size was chosen, for the run's stats."""
        ...


def truncated(draft: DraftTree, size: int) -> DraftTree:
    """The draft's first `size` nodes (a tree: parents precede children)."""
    if size >= len(draft):
        return draft
    return DraftTree(
        draft.tokens[:size],
        draft.parents[:size],
        None if draft.probs is None else draft.probs[:size],
        None if draft.confidence is None else draft.confidence[:size],
    )


@dataclass
class FixedSizes:
    """Cycles through given sizes, every row alike: for tests and fixed benchmarks."""

    cycle: list[int]
    _round: int = 0
    _chosen: Counter = field(default_factory=Counter)

    def start(self, batch: int, max_nodes: int) -> None:  # noqa: D102
        self._round = 0

    def sizes(self, active: np.ndarray) -> np.ndarray:  # noqa: D102
        size = self.cycle[self._round % len(self.cycle)]
        self._round += 1
        self._chosen[size] += int(active.sum())
        return np.where(active, size, 0)

    def observe(self, row: int, depth: int, accepted: int) -> None:  # noqa: D102
        pass

    def timed(self, width: int, verify_s: float, draft_s: float) -> None:  # noqa: D102
        pass

    def summary(self) -> dict:  # noqa: D102
        return {"controller": "fixed", "sizes_chosen": dict(sorted(self._chosen.items()))}


class AdaptiveController:
    """The rule in the module docstring."""

    def __init__(
        self, prior: float = 0.6, smoothing: float = 0.3, probe_every: int = 8, max_depth: int = 16
    ):
        self.prior, self.smoothing, self.probe_every = prior, smoothing, probe_every
        self.max_depth = max_depth
        self.costs = _RoundCosts()
        self._chosen: Counter = Counter()

    def start(self, batch: int, max_nodes: int) -> None:  # noqa: D102
        self.max_nodes = max_nodes
        self.candidates = sorted({0, max_nodes, *(2**i for i in range(8) if 2**i < max_nodes)})
        self.accept = np.full((batch, self.max_depth), self.prior)  # p_d per row
        self.idle = np.zeros(batch, dtype=int)  # rounds since the row last drafted

    def sizes(self, active: np.ndarray) -> np.ndarray:  # noqa: D102
        chosen = np.zeros(len(active), dtype=np.int64)
        for b in np.flatnonzero(active):
            size = self._best(b)
            if size == 0 and self.idle[b] >= self.probe_every:
                size = self.max_nodes  # probe: the sequence may have become predictable
            self.idle[b] = self.idle[b] + 1 if size == 0 else 0
            chosen[b] = size
            self._chosen[int(size)] += 1
        return chosen

    def _best(self, row: int) -> int:
        reach = np.concatenate([[1.0], np.cumprod(self.accept[row])])  # P(accept depth d)
        best, best_rate = 0, 1.0 / self.costs.time(0)
        for size in self.candidates[1:]:
            expected = reach[: min(size, self.max_depth) + 1].sum()  # 1 + sum of P(depth d)
            rate = expected / self.costs.time(size)
            if rate > best_rate:
                best, best_rate = size, rate
        return best

    def observe(self, row: int, depth: int, accepted: int) -> None:  # noqa: D102
        for d in range(min(depth, accepted + 1, self.max_depth)):  # depths the target judged
            hit = float(d < accepted)
            self.accept[row, d] += self.smoothing * (hit - self.accept[row, d])

    def timed(self, width: int, verify_s: float, draft_s: float) -> None:  # noqa: D102
        self.costs.record(width, verify_s, draft_s)

    def summary(self) -> dict:  # noqa: D102
        return {"controller": "adaptive", "sizes_chosen": dict(sorted(self._chosen.items()))}


class _RoundCosts:
    """Round time as a function of the draft size k, learnt from the loop's own rounds.

    T(k) = verify(1 + k) + draft [k > 0], each a smoothed measurement: verify(n) at the
    widths seen, a line through the narrowest and widest seen in between, and f(n) = 1 +
    0.05 (n - 1) scaled to the nearest seen width outside them (in units of a plain step
    until anything is timed); `draft` the smoothed drafting time of rounds that drafted.
    """

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.verify: dict[int, float] = {}
        self.draft = 0.0

    def record(self, width: int, verify_s: float, draft_s: float) -> None:
        old = self.verify.get(width, verify_s)
        self.verify[width] = old + self.smoothing * (verify_s - old)
        if draft_s > 0:
            self.draft = (
                draft_s if not self.draft else self.draft + self.smoothing * (draft_s - self.draft)
            )

    def time(self, size: int) -> float:
        return self._verify(1 + size) + (self.draft if size else 0.0)

    def _verify(self, width: int) -> float:
        if width in self.verify:
            return self.verify[width]
        if not self.verify:
            return _guess(width)
        seen = sorted(self.verify)
        low, high = seen[0], seen[-1]
        if width < low or low == high:
            near = low if width < low else high
            return self.verify[near] * _guess(width) / _guess(near)
        if width > high:
            return self.verify[high] * _guess(width) / _guess(high)
        slope = (self.verify[high] - self.verify[low]) / (high - low)
        return self.verify[low] + slope * (width - low)


def _guess(width: int) -> float:
    return 1.0 + 0.05 * (width - 1)
