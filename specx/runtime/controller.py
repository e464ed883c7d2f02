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

over k in {0, 1, 2, 4, ...} up to the drafter's budget. In a batch every row uses the
lowest p_d among the active rows: the batch finishes with its slowest row, so a draft
size pays only if it pays for that one. With P peers (sequences of the same forward that
have controllers of their own, as in continuous batching), the rate is the forward's:
(P + 1 + sum ...) / T(k) against (P + 1) / T(0), since every peer waits for this draft.
A sequence at k = 0 is probed with a one-node draft now and then (`AdaptiveController`), so
one that becomes predictable gets speculation back.

Starting from a calibration's recorded costs and acceptance instead (so a sequence would
draft from its first round) was tried and measured worse on pyref-deep at batch 1 (EAGLE-1
1.22x vs 1.39x, EAGLE-3 1.06x vs 1.22x, n-gram 1.42x vs 1.47x): the calibration's per-round
overhead and its prompts' acceptance misjudge a given request more than a measured plain
round and a one-node probe cost. The calibration's part is the batch threshold and the tree.
"""

from __future__ import annotations

import math
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

    def sizes(self, active: np.ndarray, peers: int = 0) -> np.ndarray:
        """[B] nodes each sequence keeps this round (0: no draft); 0 for inactive rows.

        `peers`: sequences outside this controller decoded in the same forward (continuous
        batching gives each sequence a controller of its own), who wait for its draft too.
        """
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

    def sizes(self, active: np.ndarray, peers: int = 0) -> np.ndarray:  # noqa: D102
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
    """The rule in the module docstring.

    Scheduling details, each for the cost of rounds that do not draft:
    - the first round of a batch is a plain step, so the cost every draft is weighed
      against is measured, not guessed; a batch then waits for its first probe (its
      drafting rounds cost several plain steps: a probe at batch 4 ~2x one, measured);
    - the first draft and every probe use the smallest size (one node);
    - a row that stopped drafting is not re-evaluated until its probe; the interval doubles
      after each probe that found nothing (`probe_every` up to `max_probe_every` rounds)
      and is never shorter than keeps probes within `probe_budget` of the time;
    - probes fall on multiples of the interval, so the idle rows of a batch probe together
      and the rounds between stay plain for all of them (such a round is a decode step).
    """

    def __init__(
        self,
        prior: float = 0.6,
        smoothing: float = 0.2,
        probe_every: int = 8,
        max_probe_every: int = 64,
        max_depth: int = 16,
        margin: float = 0.05,
        batch_margin: float = 0.5,
        probe_budget: float = 0.03,
    ):
        self.prior, self.smoothing, self.max_depth = prior, smoothing, max_depth
        # A draft must beat a plain step by this much: the model's error, and in a batch
        # the rows' uneven progress, which no per-depth average sees.
        self.margin, self.batch_margin = margin, batch_margin
        self.probe_budget = probe_budget  # the share of time probes may cost
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.costs = _RoundCosts()
        self._chosen: Counter = Counter()

    def start(self, batch: int, max_nodes: int) -> None:  # noqa: D102
        self.max_nodes = max_nodes
        self.candidates = sorted({0, max_nodes, *(2**i for i in range(8) if 2**i < max_nodes)})
        self.accept = np.full((batch, self.max_depth), self.prior)  # p_d per row
        self.judged = np.zeros((batch, self.max_depth), dtype=np.int64)  # rounds that tested d
        self.round = 0
        # 0: the row drafts; else the round of its next probe (a batch waits for its first).
        self.next_probe = np.full(batch, 0 if batch == 1 else self.probe_every, dtype=np.int64)
        self.interval = np.full(batch, self.probe_every)
        self.probing = np.zeros(batch, dtype=bool)
        self.hit = np.zeros(batch, dtype=bool)  # the row's last round accepted a draft token
        self._floor: list[float] | None = None
        self._peers = 0

    def sizes(self, active: np.ndarray, peers: int = 0) -> np.ndarray:  # noqa: D102
        self.round += 1
        self._peers = peers
        if len(active) == 1:  # batch 1, and every row of a continuous batch: kept cheap
            size = self._size(0) if active[0] and self.round > 1 else 0
            self._chosen[size] += int(active[0])
            return np.array([size], dtype=np.int64)
        chosen = np.zeros(len(active), dtype=np.int64)
        rows = np.flatnonzero(active)
        waiting = (self.next_probe[rows] > 0) & (self.round < self.next_probe[rows])
        if self.round > 1 and not waiting.all():  # else every row waits: no estimate needed
            # A batch ends with its slowest row: rows of a batch size by the lowest acceptance.
            estimates = [self._estimates(b) for b in rows]
            self._floor = [min(p) for p in zip(*estimates, strict=True)] if len(rows) > 1 else None
            for b in rows:
                chosen[b] = self._size(b)
        self._chosen.update(chosen[active].tolist())
        return chosen

    def _size(self, b: int) -> int:
        if self.next_probe[b] and self.round < self.next_probe[b]:
            return 0  # idle until its probe
        if self.next_probe[b]:  # probe: the sequence may have become predictable
            self.next_probe[b], self.probing[b] = 0, True
            return self.candidates[1]  # a small draft: cheap, and it tests the first depths
        size = self._best(b)
        if size and not self.costs.drafted:
            size = self.candidates[1]  # what a draft costs is unknown: learn it cheaply first
        if size and self.probing[b]:
            self.interval[b] = self.probe_every  # the probe brought speculation back
        elif not size:
            if self.probing[b] and not self.hit[b]:  # a probe that found nothing: wait longer
                self.interval[b] = min(2 * self.interval[b], self.max_probe_every)
            elif self.probing[b]:  # it found something: probe again soon
                self.interval[b] = self.probe_every
            step = max(int(self.interval[b]), self._affordable_interval())
            self.next_probe[b] = (self.round // step + 1) * step
        self.probing[b] = False
        return size

    def _affordable_interval(self) -> int:
        """Rounds between probes for them to cost at most `probe_budget` of the time."""
        extra = self.costs.time(self.candidates[1]) / self.costs.time(0) - 1.0
        return max(1, math.ceil(extra / self.probe_budget))

    def _estimates(self, row: int) -> list[float]:
        """The row's p_d, each depth tested fewer than 3 times capped by the one before.

        The prior alone would make deep drafts look good on shallow evidence. Python floats,
        not numpy: on a few depths per row and round, numpy's call overhead was most of the
        controller's ~45 us a round.
        """
        accept, judged = self.accept[row].tolist(), self.judged[row].tolist()
        for d in range(1, len(accept)):
            if judged[d] < 3:
                accept[d] = min(accept[d], accept[d - 1])
        return accept

    def _best(self, row: int) -> int:
        accept = self._estimates(row) if self._floor is None else self._floor
        # expected[k]: 1 + the sum of P(depth d accepted) for d <= k, a chain of k's tokens
        expected, reach = [1.0], 1.0
        for p in accept[: min(self.max_nodes, self.max_depth)]:
            reach *= p
            expected.append(expected[-1] + reach)
        margin = self.margin if self._floor is None else self.batch_margin
        # Peers emit one token a round whatever this row does, and wait for its draft: the
        # draft must raise the whole forward's tokens per second, not just this row's.
        peers = self._peers
        best, best_rate = 0, (peers + 1.0 + margin) / self.costs.time(0)
        for size in self.candidates[1:]:
            rate = (peers + expected[min(size, self.max_depth)]) / self.costs.time(size)
            if rate > best_rate:
                best, best_rate = size, rate
        return best

    def observe(self, row: int, depth: int, accepted: int) -> None:  # noqa: D102
        self.hit[row] = accepted > 0
        for d in range(min(depth, accepted + 1, self.max_depth)):  # depths the target judged
            hit = float(d < accepted)
            self.accept[row, d] += self.smoothing * (hit - self.accept[row, d])
            self.judged[row, d] += 1

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
        if width > 1:  # a round that drafted (a plain round's "draft" is the controller's own)
            step = 1.0 if not self.draft else self.smoothing
            self.draft += step * (draft_s - self.draft)

    @property
    def drafted(self) -> bool:
        """Whether a round with a draft has been timed."""
        return self.draft > 0

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
