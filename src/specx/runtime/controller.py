"""Per-round draft sizes: speculation that backs off where it does not pay, and comes back.

A drafter proposes up to `max_nodes` nodes per sequence; a controller decides each round
how many of them each sequence keeps: 0 (no draft: the sequence takes a plain step) up to
all. The kept nodes are a prefix of the draft (parents precede children, so a prefix is a
tree, and a chain's prefix is a shorter chain). `controller_for` picks one of two rules by
the drafter: a drafter that costs a forward per depth is sized before it drafts
(`AdaptiveController`); one that drafts in microseconds with confidences (suffix decoding,
`sizes_own_drafts`) drafts whole and is trimmed after (`ConfidenceController`).

Lossless whatever the sizes: a size depends only on rounds already verified, the draft's
shape and, for a deterministic draft (itself a function of the history), its confidences;
never on what the target will say about it. Verification is unchanged, and dropping nodes
chosen independently of their tokens' draws leaves the rest drafted as the rule assumes.
`tests/test_controller.py` forces a switch every round and checks greedy identity;
`tests/test_distribution.py` the sampled distribution, with switching and with trimming.

`AdaptiveController`, per sequence b and round: with p_d the running acceptance at depth d
given depth d - 1 accepted (an exponential moving average over b's own rounds) and a round
cost model T(k) learnt from the loop's own timings (an engine's requests share one),

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

__all__ = [
    "AdaptiveController",
    "ConfidenceController",
    "Controller",
    "FixedSizes",
    "RoundCosts",
    "controller_for",
    "truncated",
]


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

    def keep(self, proposed: list[DraftTree]) -> list[DraftTree]:
        """The prefix of each row's proposal it verifies this round (empty: a plain step).

        `proposed[b]`: what the drafter gave for the budget `sizes` asked.
        """
        ...

    def observe(self, row: int, depth: int, accepted: list[int]) -> None:
        """Row `row` drafted to `depth` this round; the target accepted these nodes of it."""
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
    _sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def start(self, batch: int, max_nodes: int) -> None:  # noqa: D102
        self._round = 0

    def sizes(self, active: np.ndarray, peers: int = 0) -> np.ndarray:  # noqa: D102
        size = self.cycle[self._round % len(self.cycle)]
        self._round += 1
        self._chosen[size] += int(active.sum())
        self._sizes = np.where(active, size, 0)
        return self._sizes

    def keep(self, proposed: list[DraftTree]) -> list[DraftTree]:  # noqa: D102
        return list(map(truncated, proposed, self._sizes.tolist()))

    def observe(self, row: int, depth: int, accepted: list[int]) -> None:  # noqa: D102
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
    - given `costs` that earlier requests timed (`Engine` keeps one per drafting plan and
      batch size: costs are the machine's, not the request's), neither of the two above
      happens: the first round drafts at the size the rule picks (pyref-deep, batch 1, 8
      prompts x 64 tokens, one process, fastest of 3: EAGLE-1 with the calibrated chain 5
      99% of the fixed chain 4's speedup vs 95% learning the costs per request, EAGLE-3
      with chain 3 99% vs 97%; `RoundCosts` says how shared costs stay fresh);
    - a row that stopped drafting is not re-evaluated until its probe; the interval doubles
      after each probe that found nothing (`probe_every` up to `max_probe_every` rounds)
      and is never shorter than keeps probes within `probe_budget` of the time;
    - probes fall on multiples of the interval, so the idle rows of a batch probe together
      and the rounds between stay plain for all of them (such a round is a decode step);
    - a row alone stops drafting only where a draft no longer beats a plain step: stopping
      leaves it blind until its probe. With a 5% margin the moving average's dips idled
      rows whose drafts paid (pyref-deep EAGLE-3, chain 3, batch 1, 8 prompts x 64 tokens,
      one process, fastest of 3: 92% and 97% of the fixed chain's speedup in two runs, 98%
      without the margin; at T = 1, 1.03x vs 1.08x plain decoding).
    """

    def __init__(
        self,
        prior: float = 0.6,
        smoothing: float = 0.2,
        probe_every: int = 8,
        max_probe_every: int = 64,
        max_depth: int = 16,
        batch_margin: float = 0.5,
        probe_budget: float = 0.03,
        costs: RoundCosts | None = None,
    ):
        self.prior, self.smoothing, self.max_depth = prior, smoothing, max_depth
        # In a batch a draft must beat a plain step by this many tokens a row: the rows'
        # uneven progress, which no per-depth average sees. A row alone stops at a tie, not
        # before: stopping leaves it blind until its probe.
        self.batch_margin = batch_margin
        self.probe_budget = probe_budget  # the share of time probes may cost
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.costs = costs or RoundCosts()
        self._chosen: Counter = Counter()

    def start(self, batch: int, max_nodes: int) -> None:  # noqa: D102
        self.max_nodes = max_nodes
        self.candidates = sorted({0, max_nodes, *(2**i for i in range(8) if 2**i < max_nodes)})
        self.accept = np.full((batch, self.max_depth), self.prior)  # p_d per row
        self.judged = np.zeros((batch, self.max_depth), dtype=np.int64)  # rounds that tested d
        self.round = int(self.costs.known)  # known costs: no plain first round to time them
        # 0: the row drafts; else the round of its next probe (a batch waits for its first).
        self.next_probe = np.full(batch, 0 if batch == 1 else self.probe_every, dtype=np.int64)
        self.interval = np.full(batch, self.probe_every)
        self.probing = np.zeros(batch, dtype=bool)
        self.hit = np.zeros(batch, dtype=bool)  # the row's last round accepted a draft token
        self._floor: list[float] | None = None
        self._peers = 0
        self._sizes = np.zeros(batch, dtype=np.int64)

    def sizes(self, active: np.ndarray, peers: int = 0) -> np.ndarray:  # noqa: D102
        self.round += 1
        self._peers = peers
        if len(active) == 1:  # batch 1, and every row of a continuous batch: kept cheap
            size = self._size(0) if active[0] and self.round > 1 else 0
            self._chosen[size] += int(active[0])
            self._sizes = np.array([size], dtype=np.int64)
            return self._sizes
        chosen = np.zeros(len(active), dtype=np.int64)
        rows = np.flatnonzero(active)
        waiting = (self.next_probe[rows] > 0) & (self.round < self.next_probe[rows])
        if self.round > 1 and not waiting.all():  # else every row waits: no estimate needed
            # A batch ends with its slowest row: rows of a batch size by the lowest acceptance.
            estimates = [self._estimates(b) for b in rows.tolist()]
            self._floor = [min(p) for p in zip(*estimates, strict=True)] if len(rows) > 1 else None
            for b in rows.tolist():
                chosen[b] = self._size(b)
        self._chosen.update(chosen[active].tolist())
        self._sizes = chosen
        return chosen

    def keep(self, proposed: list[DraftTree]) -> list[DraftTree]:  # noqa: D102
        return list(map(truncated, proposed, self._sizes.tolist()))

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
            probe = self.costs.time(self.candidates[1]) / self.costs.time(0)
            step = max(int(self.interval[b]), _affordable_interval(probe, self.probe_budget))
            self.next_probe[b] = (self.round // step + 1) * step
        self.probing[b] = False
        return size

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
        margin = 0.0 if self._floor is None else self.batch_margin
        # Peers emit one token a round whatever this row does, and wait for its draft: the
        # draft must raise the whole forward's tokens per second, not just this row's.
        peers = self._peers
        best, best_rate = 0, (peers + 1.0 + margin) / self.costs.time(0)
        for size in self.candidates[1:]:
            rate = (peers + expected[min(size, self.max_depth)]) / self.costs.time(size)
            if rate > best_rate:
                best, best_rate = size, rate
        return best

    def observe(self, row: int, depth: int, accepted: list[int]) -> None:  # noqa: D102
        count = len(accepted)
        self.hit[row] = count > 0
        for d in range(min(depth, count + 1, self.max_depth)):  # depths the target judged
            hit = float(d < count)
            self.accept[row, d] += self.smoothing * (hit - self.accept[row, d])
            self.judged[row, d] += 1

    def timed(self, width: int, verify_s: float, draft_s: float) -> None:  # noqa: D102
        self.costs.record(width, verify_s, draft_s)

    def summary(self) -> dict:  # noqa: D102
        return {"controller": "adaptive", "sizes_chosen": dict(sorted(self._chosen.items()))}


class ConfidenceController:
    """Trims each round's draft by its own confidence (drafters with `sizes_own_drafts`).

    Such a drafter (suffix decoding) proposes in microseconds a deterministic tree, best
    first, with each node's probability given its parent under the drafter's counts
    (`DraftTree.confidence`, c_i). Each round every row's whole draft is proposed; row b
    expects node i accepted with π_{b,i}, the product over i and its ancestors j of
    min(1, g_{b,d(j)} c_j), and the batch keeps the first k nodes of each row, the k
    maximizing

        (P + B + Σ_b Σ_{i <= k} π_{b,i}) / T(k),   T(0) = a plain step,

    if that beats a plain step's (P + B) / T(0) by `margin` (B active rows; one k for the
    batch, since its verify forward is as wide as its widest row; P peers as in
    `AdaptiveController`; T(k) the verify forward's time at width 1 + k, learnt from the
    loop's rounds, the proposal being spent either way). g_{b,d} corrects counts learnt
    on other text to what this target accepts at this temperature, per depth d: over the
    levels at depth d the target judged in b's drafts (the children of the root or of an
    accepted node), a moving average of whether a child was accepted over one of their
    summed c (from 1 over 1). Per depth, because acceptance is not independent: where the
    first node of a copied span holds, the rest mostly do (a revision with one moving
    average over every level judged made deep nodes look as unsure as first ones: 91% of
    the whole drafts' speed at greedy in the run below's setting).
    The first round is a plain step, so T(0) is measured.

    Measured (pyref-7m, batch 1, 16 prompts x 128 tokens, fastest of 3, one run per
    temperature; time modeled as each round's width at the run's median time per width
    plus the drafting time measured, which takes the host's noise out of comparing
    decisions): at greedy this rule ran at 98% of the whole 16-node drafts' speed (96%
    measured; 1.85x vs 1.93x plain decoding), `AdaptiveController` (sized before drafting:
    between matches it went idle and missed the next) at 86% (1.63x); at T = 1, where
    whole drafts lose (0.85x, measured), this rule 0.87x and `AdaptiveController` 0.91x
    (a calibration at that temperature turns drafting off).

    Each round's k is at most twice the widest forward timed so far: T(k) for a width
    never seen is a one-row guess, far too cheap for a forward of many rows.

    A row that kept nothing `patience` rounds in a row stops proposing until a probe: a
    round, after `probe_every` rounds (doubling up to `max_probe_every` while probes fail,
    and never so often that probes cost more than `probe_budget` of the time), that keeps
    at least one node (see `_after_proposal`).

    Lossless: a deterministic draft is a function of the history, so a prefix chosen from
    it is too. A sampled draft (`probs` set) is kept whole: dropping its nodes by their own
    tokens' probabilities would bias what survives.
    """

    def __init__(
        self,
        smoothing: float = 0.2,
        margin: float = 0.05,
        patience: int = 4,
        probe_every: int = 8,
        max_probe_every: int = 64,
        max_depth: int = 16,
        probe_budget: float = 0.03,
        costs: RoundCosts | None = None,
    ):
        self.smoothing, self.margin, self.max_depth = smoothing, margin, max_depth
        self.patience = patience  # rounds keeping nothing before the row stops proposing
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.probe_budget = probe_budget  # the share of time probes may cost
        # T(k); tests pass a fixed curve so that what is kept does not depend on the host
        self.costs = costs or RoundCosts()
        self._chosen: Counter = Counter()

    def start(self, batch: int, max_nodes: int) -> None:  # noqa: D102
        self.max_nodes = max_nodes
        # Moving averages per row and depth over the levels judged there: a child accepted,
        # and the children's summed confidence; g their ratio (see `_correct`).
        self.hits = [[1.0] * self.max_depth for _ in range(batch)]
        self.expected = [[1.0] * self.max_depth for _ in range(batch)]
        self.g = [[1.0] * self.max_depth for _ in range(batch)]
        self.kept: list[DraftTree | None] = [None] * batch  # this round's kept drafts
        self.misses = [0] * batch  # drafts in a row trimmed to nothing
        self.idle_until = [0] * batch  # the round the row proposes again (0: it proposes)
        self.interval = [self.probe_every] * batch
        self.probing = [False] * batch
        self.asked = [False] * batch
        self.round = 0
        self._peers = self._active = 0

    def sizes(self, active: np.ndarray, peers: int = 0) -> np.ndarray:  # noqa: D102
        # Python lists, not numpy: per-round work here is what the loop adds to a step.
        self.round += 1
        self._peers, self._active = peers, int(active.sum())
        chosen = []
        for b, on in enumerate(active.tolist()):
            asked = on and self.round > 1  # the first round is a plain step: T(0) measured
            if asked and self.idle_until[b]:
                asked = self.round >= self.idle_until[b]
                self.probing[b] = asked
                if asked:
                    self.idle_until[b] = 0
            self.asked[b] = asked
            chosen.append(self.max_nodes if asked else 0)
        self._chosen[0] += self._active - sum(self.asked)
        return np.array(chosen, dtype=np.int64)

    def keep(self, proposed: list[DraftTree]) -> list[DraftTree]:  # noqa: D102
        paths = [
            self._path_probabilities(b, d) if self.asked[b] else None
            for b, d in enumerate(proposed)
        ]
        size = self._best(paths)
        kept = []
        for b, (draft, path) in enumerate(zip(proposed, paths, strict=True)):
            keep = len(draft)
            if path:
                keep = min(max(size, int(self.probing[b])), keep)  # a probe keeps a node
            if self.asked[b]:
                self._chosen[keep] += 1
                self._after_proposal(b, keep, len(draft))
            kept.append(truncated(draft, keep))
            self.kept[b] = kept[-1]
        return kept

    def _path_probabilities(self, row: int, draft: DraftTree) -> list[float] | None:
        """π_i per node of a deterministic draft with confidences; None for any other."""
        if draft.probs is not None or draft.confidence is None:
            return None
        g, last = self.g[row], self.max_depth - 1
        path: list[float] = []
        depths: list[int] = []
        for c, parent in zip(draft.confidence.tolist(), draft.parents.tolist(), strict=True):
            if parent < 0:
                depths.append(0)
                path.append(min(1.0, g[0] * c))
            else:
                d = min(depths[parent] + 1, last)
                depths.append(d)
                path.append(min(1.0, g[d] * c) * path[parent])
        return path

    def _best(self, paths: list[list[float] | None]) -> int:
        """The k of the rule; a row without a trimmable draft adds its one token."""
        gains: list[float] = []  # gains[k - 1]: Σ_b π_{b,k}, what the k-th nodes add
        for path in paths:
            for k, p in enumerate(path or ()):
                if k < len(gains):
                    gains[k] += p
                else:
                    gains.append(p)
        tokens: float = self._peers + self._active  # plus the expected accepted tokens
        verify = self.costs.verify
        best, best_rate = 0, tokens * (1.0 + self.margin) / verify(1)
        # At most twice the widest draft timed: the cost of a width never seen is a guess,
        # made for one row; a forward of many rows (continuous batching) pays far more.
        reach = max(1, 2 * (self.costs.widest - 1))
        for k, gain in enumerate(gains[:reach], start=1):
            tokens += gain
            rate = tokens / verify(1 + k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _after_proposal(self, b: int, kept: int, proposed: int) -> None:
        """After `patience` rounds in a row that kept nothing the row stops proposing.

        Nothing kept: a draft trimmed to nothing or, where the forward carries other rows,
        no draft at all. Alone, a row keeps looking while it finds nothing: a proposal
        costs a few percent of its step, a match missed while idle a few tokens (idling
        on no-match streaks too cost 5% at greedy, batch 1). With 15 peers, 16 rows'
        proposals cost ~10% of the forward (0.72x vs 0.88x under `AdaptiveController`
        at 16 streams, before this and the reach limit in `_best`; 0.97x vs 1.03x after).
        A probe that finds no draft failed like one the target rejects (`observe`).
        """
        if kept:
            self.misses[b] = 0
        elif proposed or self._peers + self._active > 1:
            self.misses[b] += 1
        if self.probing[b] and not kept:
            self.probing[b] = False
            self.interval[b] = min(2 * self.interval[b], self.max_probe_every)
            self._idle(b)
        elif self.misses[b] >= self.patience:
            self._idle(b)

    def _idle(self, b: int) -> None:
        """Row b proposes again in `interval` rounds, or as many as keep probes affordable."""
        self.misses[b] = 0
        # A probe widens the forward by a node for every row in it, peers included.
        probe = self.costs.verify(2) / self.costs.verify(1)
        affordable = _affordable_interval(probe, self.probe_budget)
        self.idle_until[b] = self.round + max(self.interval[b], affordable)

    def observe(self, row: int, depth: int, accepted: list[int]) -> None:  # noqa: D102
        draft = self.kept[row]
        if depth == 0 or draft is None or draft.confidence is None:
            return  # nothing kept: nothing learnt about the drafter's confidence
        if self.probing[row]:  # a probe that failed waits twice as long for the next
            self.probing[row] = False
            if accepted:
                self.interval[row] = self.probe_every
            else:
                self.interval[row] = min(2 * self.interval[row], self.max_probe_every)
                self._idle(row)
        hits, expected, s = self.hits[row], self.expected[row], self.smoothing
        for d, level in enumerate(_judged_levels(draft, accepted)[: self.max_depth]):
            hits[d] += s * (float(d < len(accepted)) - hits[d])
            expected[d] += s * (level - expected[d])
        self._correct(row)

    def _correct(self, row: int) -> None:
        """The row's g per depth: its hits over its expected.

        Unlike `AdaptiveController`'s p_d, a depth seldom judged is not capped by the one
        before: g starts from trusting the drafter's counts, and the cap cut greedy drafts
        short (96% of the whole drafts' speed, against 98% uncapped, in one run).
        """
        self.g[row][:] = [h / e for h, e in zip(self.hits[row], self.expected[row], strict=True)]

    def timed(self, width: int, verify_s: float, draft_s: float) -> None:  # noqa: D102
        self.costs.record(width, verify_s, draft_s)

    def summary(self) -> dict:  # noqa: D102
        return {"controller": "confidence", "sizes_chosen": dict(sorted(self._chosen.items()))}


def _affordable_interval(probe: float, budget: float) -> int:
    """Rounds between probes for them to cost at most `budget` of the time.

    `probe`: a probe round's time over a plain round's.
    """
    return max(1, math.ceil((probe - 1.0) / budget))


def _judged_levels(draft: DraftTree, accepted: list[int]) -> list[float]:
    """Per level of `draft` the target judged, its children's summed confidence (at most 1).

    A level: the children of the root, then of each accepted node; `accepted` holds a child
    of every level but the last, which the target judged only if that node has children.
    """
    assert draft.confidence is not None  # observe() learns from confident drafts only
    sums: dict[int, float] = {}  # parent -> its children's summed confidence
    for c, parent in zip(draft.confidence.tolist(), draft.parents.tolist(), strict=True):
        sums[parent] = sums.get(parent, 0.0) + c
    return [min(1.0, sums[p]) for p in (-1, *accepted) if p in sums]


def controller_for(drafter, costs: RoundCosts | None = None) -> Controller:
    """A fresh per-round controller suited to `drafter` (see the two rules above).

    `costs`: round costs earlier requests timed, which `AdaptiveController` starts from and
    goes on updating (suffix drafting's rule learns its own).
    """
    if getattr(drafter, "sizes_own_drafts", False):  # absent on drafters written before it
        return ConfidenceController()
    return AdaptiveController(costs=costs)


class RoundCosts:
    """Round time as a function of the draft size k, learnt from the loop's own rounds.

    T(k) = verify(1 + k) + draft [k > 0], each a smoothed measurement: verify(n) at the
    widths timed, a line through the narrowest and widest timed in between, and f(n) = 1 +
    0.05 (n - 1) scaled to the nearest timed width outside them (in units of a plain step
    until anything is timed); `draft` the smoothed drafting time of rounds that drafted.

    An engine's requests share one (costs are the machine's), so an estimate may live far
    longer than a request, and the rule only re-times a width it picks: a width priced too
    high is never picked again. Shared as first landed (4de2b3d), pyref-deep EAGLE-3 chose
    1-node drafts in all 303 rounds of a benchmark cell (80% of the fixed chain's speedup;
    100% with the guards, `benchmarks/controller.py`). Two guards, both erring cheap (a
    width priced too low is picked, so re-timed at once):
    - a timing counts at most `rise` x the width's estimate (for a width not yet timed, what
      the other widths predict): one slow outlier moves an estimate a little, never out of
      the rule. The first two timings of a width replace its estimate (the first is capped,
      the second confirms it), later ones are smoothed;
    - a width not timed for `horizon` rounds is forgotten and priced from the others until
      it is timed again (a forgotten plain step makes the next request start plain).
    """

    def __init__(self, smoothing: float = 0.2, rise: float = 1.5, horizon: int = 128):
        self.smoothing, self.rise, self.horizon = smoothing, rise, horizon
        self.by_width: dict[int, float] = {}
        self._seen: list[int] = []  # the widths timed, sorted
        self._timed: dict[int, tuple[int, int]] = {}  # width -> (times timed, last round)
        self._round = 0
        self.draft = 0.0

    def record(self, width: int, verify_s: float, draft_s: float) -> None:
        """A round's verify time at `width` tokens per row and its drafting time."""
        self._round += 1
        old = self.by_width.get(width)
        if old is None:
            old = self.verify(width) if self.by_width else verify_s
            self._seen = sorted((*self.by_width, width))
        verify_s = min(verify_s, self.rise * old)
        timings = self._timed.get(width, (0, 0))[0] + 1
        step = 1.0 if timings <= 2 else self.smoothing
        self.by_width[width] = old + step * (verify_s - old)
        self._timed[width] = timings, self._round
        self._forget(self._round - self.horizon)
        if width > 1:  # a round that drafted (a plain round's "draft" is the controller's own)
            step = 1.0 if not self.draft else self.smoothing
            self.draft += step * (draft_s - self.draft)

    def _forget(self, before: int) -> None:
        stale = [w for w, (_, last) in self._timed.items() if last <= before]
        for width in stale:
            del self.by_width[width], self._timed[width]
        if stale:
            self._seen = sorted(self.by_width)

    @property
    def widest(self) -> int:
        """The widest verify forward timed (0: none yet)."""
        return self._seen[-1] if self._seen else 0

    @property
    def drafted(self) -> bool:
        """Whether a round with a draft has been timed."""
        return self.draft > 0

    @property
    def known(self) -> bool:
        """Whether both a plain step and a round with a draft have been timed."""
        return 1 in self.by_width and self.drafted

    def time(self, size: int) -> float:
        """T(k): a round keeping `size` draft nodes per row (0: a plain step)."""
        return self.verify(1 + size) + (self.draft if size else 0.0)

    def verify(self, width: int) -> float:
        """A verify forward's time at `width` tokens per row (1: a plain step)."""
        if width in self.by_width:
            return self.by_width[width]
        if not self.by_width:
            return _guess(width)
        low, high = self._seen[0], self._seen[-1]
        if width < low or low == high:
            near = low if width < low else high
            return self.by_width[near] * _guess(width) / _guess(near)
        if width > high:
            return self.by_width[high] * _guess(width) / _guess(high)
        slope = (self.by_width[high] - self.by_width[low]) / (high - low)
        return self.by_width[low] + slope * (width - low)


def _guess(width: int) -> float:
    return 1.0 + 0.05 * (width - 1)
