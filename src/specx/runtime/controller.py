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
given depth d - 1 accepted (over b's own rounds: the mean of a weak prior and the evidence
at first, then an exponential moving average) and a round cost model T(k) learnt from the
loop's own timings (an engine's requests share one),

    k* = argmax_k (1 + q sum_{d <= k} p_1 ... p_d) / (q T(k) + (1 - q) T_ask),
    T(0) = a plain step, q the share of b's asks that found a draft (1 for a model),
    T_ask a round whose ask found none,

over k in {0, 1, 2, 4, ...} up to the drafter's budget. In a batch every row uses the
lowest p_d among the active rows: the batch finishes with its slowest row, so a draft
size pays only if it pays for that one. With P peers (sequences of the same forward that
have controllers of their own, as in continuous batching), the rate is the forward's:
(P + 1 + sum ...) / T(k) against (P + 1) / T(0), since every peer waits for this draft.
A sequence at k = 0 is probed with a one-node draft now and then, so one that becomes
predictable gets speculation back.

A drafter whose drafts are functions of the history alone (n-gram, suffix decoding) is
replayed instead at the last plain steps of each stretch (`Replay`, `Drafter.replay`): its
draft there, judged by the tokens the steps emitted, is learnt from as a verified round
(greedily the same verdict; when sampling, the same law), and its rows decide at their
probe without paying for one. What it bought on pyref-7m's first requests at T = 1 (24
prompts x 64 tokens, batch 1, paired, 3 repeats): n-gram 0.82x -> 0.95x plain, suffix
0.86x -> 0.96x, where most asks had found nothing or been rejected.

Never losing without calibration is the controllers' job, from a request's first round:
what they assume before measuring is cheap to be wrong about (plain first rounds, one-node
first drafts, a weak prior that the first misses overrule, a batch's first probe only once
it is affordable, a drafter's prefill paid only where the request's rest is expected to
repay it twice: `Trial`), and rounds in which no row drafts are played by plain decoding's
own loop (`idle_rounds`), so an idle speculative request costs what a plain one does. Both
rules remember across an engine's requests at one setting: the sized rule the acceptance
its rows start from (`AcceptanceMemory`), suffix drafting's rule when asking last paid
(`AskingMemory`), so that a setting where drafts lose stops paying for them.
Calibration adds the batch threshold and the tree. Starting from a calibration's recorded
acceptance and costs instead was measured worse (benchmarks/README.md, controller.py): its
prompts misjudge a given request more than a measured plain round and a one-node probe.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

import numpy as np

from specx.runtime.metrics import ControllerSummary
from specx.runtime.trees import DraftTree, depths, followed

__all__ = [
    "AcceptanceMemory",
    "AdaptiveController",
    "AskingMemory",
    "ConfidenceController",
    "Controller",
    "FixedSizes",
    "Replay",
    "RoundCosts",
    "Stretch",
    "Trial",
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

    def idle_rounds(self, active: np.ndarray) -> int:
        """Rounds from the next on in which no active row drafts, whatever the rows emit.

        The loop plays up to that many as plain decoding's own steps, without asking
        `sizes` (a round that will not draft must not cost more than a plain step), and
        reports them to `idled`. 0: ask `sizes` for the next round.
        """
        ...

    def idled(self, stretch: Stretch) -> None:
        """The loop played a stretch of plain steps (and replayed the drafter over some)."""
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
        drafted. A round of width 1 prices a plain step only where no stretch of them has
        (`RoundCosts.record`).
        """
        ...

    def summary(self) -> ControllerSummary:
        """How often each size was chosen, for the run's stats."""
        ...


@dataclass(frozen=True)
class Replay:
    """A draft the drafter would have proposed before a plain step, judged by what followed.

    `accepted`: the nodes the emitted tokens ran through from the root (`trees.followed`),
    which is what verifying the draft would have accepted: greedily the same path; when
    sampling, a deterministic node is accepted with the target's probability of its token,
    the probability that the step drew it, so the path has the law of the verdict's.
    `judged`: the levels the tokens judged (the children of the root, then of each
    accepted node while a token was left to judge them).
    """

    draft: DraftTree
    accepted: list[int]
    judged: int

    @classmethod
    def of(cls, draft: DraftTree, emitted: Sequence[int]) -> Replay:
        """`draft` judged by the tokens emitted after it (`emitted`, in order)."""
        accepted = followed(draft, emitted)
        levels = int(depths(draft.parents).max()) + 1 if len(draft) else 0
        return cls(draft, accepted, min(len(accepted) + 1, len(emitted), levels))


@dataclass(frozen=True)
class Stretch:
    """Plain steps the loop played for a controller's idle rounds.

    `rounds` steps, `row_rounds` their sum over the rows; `step_s` a plain step's seconds
    (the median step past the stretch's first); `replays[b]`: row b's drafter replayed at
    some of the steps (empty where the drafter cannot replay).
    """

    rounds: int
    row_rounds: int
    step_s: float
    replays: tuple[tuple[Replay, ...], ...] = ()


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

    def idle_rounds(self, active: np.ndarray) -> int:  # noqa: D102
        idle = 0
        while idle < len(self.cycle) and not self.cycle[(self._round + idle) % len(self.cycle)]:
            idle += 1
        return idle if idle < len(self.cycle) else 1  # all zeros: one round at a time

    def idled(self, stretch: Stretch) -> None:  # noqa: D102
        self._round += stretch.rounds
        self._chosen[0] += stretch.row_rounds

    def keep(self, proposed: list[DraftTree]) -> list[DraftTree]:  # noqa: D102
        return list(map(truncated, proposed, self._sizes.tolist()))

    def observe(self, row: int, depth: int, accepted: list[int]) -> None:  # noqa: D102
        pass

    def timed(self, width: int, verify_s: float, draft_s: float) -> None:  # noqa: D102
        pass

    def summary(self) -> ControllerSummary:  # noqa: D102
        return ControllerSummary("fixed", dict(sorted(self._chosen.items())))


@dataclass(frozen=True)
class Trial:
    """What a request's first draft costs it however the draft fares: the drafter's prefill.

    A head's or a draft model's prefill of the prompts; none for model-free drafters.

    `prefill_s`: predicted (the engine's measure per prompt token times the request's);
    `rounds`: the request's rounds at most (its new tokens); `step_s`: one draft step of one
    sequence, as timed on a dummy (what a draft costs before one is timed in a round).
    """

    prefill_s: float
    rounds: int
    step_s: float = 0.0


class AdaptiveController:
    """The rule in the module docstring.

    Scheduling details, each for the cost of rounds that do not draft (what each was
    measured to buy: benchmarks/README.md, controller.py):
    - the first round of a batch is a plain step, so the cost every draft is weighed
      against is measured, not guessed; a batch then waits for its first probe until
      probes are affordable (its rows all draft in a probe round, which costs about two
      plain steps before anything is timed: `UNTIMED_BATCH_PROBE`);
    - the first draft and every probe use the smallest size (one node); a row whose
      drafter was replayed over the stretch before its probe decides by the rule instead
      (`idled`);
    - a drafter with a prefill (`trial`) drafts the request's first draft only where the
      rest of the request is expected to save `trial_margin` times that prefill; else the
      request is plain to its end (`_first_draft`);
    - a drafter that finds no draft in some rounds (n-gram) is priced for them: the share
      of asks that found one (q) and what an ask that found none cost (`RoundCosts.ask`);
    - given `costs` that earlier requests timed (`Engine` keeps one per drafting plan and
      batch size: costs are the machine's, not the request's), neither of the two above
      happens: the first round drafts at the size the rule picks (`RoundCosts` says how
      shared costs stay fresh);
    - p_d starts as the mean of a Beta prior of weight 2 and the evidence, so the first
      misses count fully (a drafter the target rejects stops within a few rounds) until
      the moving average's weight `smoothing` is reached; a row alone takes for prior what
      the engine's earlier requests at this setting found (`acceptance`), a batch `prior`;
    - a row that stopped drafting is not re-evaluated until its probe; the interval doubles
      after each probe that found nothing (`probe_every` up to `max_probe_every` rounds)
      and is never shorter than keeps probes within `probe_budget` of the time;
    - probes fall on multiples of the interval, so the idle rows of a batch probe together
      and the rounds between are plain decoding's steps for all of them (`idle_rounds`);
    - a row alone stops drafting only where a draft no longer beats a plain step: stopping
      leaves it blind until its probe, and a margin made the moving average's dips idle
      rows whose drafts paid.
    """

    def __init__(
        self,
        prior: float = 0.5,
        smoothing: float = 0.2,
        probe_every: int = 8,
        max_probe_every: int = 64,
        max_depth: int = 16,
        batch_margin: float = 0.5,
        probe_budget: float = 0.02,
        costs: RoundCosts | None = None,
        acceptance: AcceptanceMemory | None = None,
        trial: Trial | None = None,
        trial_margin: float = 2.0,
    ):
        self.prior, self.smoothing, self.max_depth = prior, smoothing, max_depth
        # What the request's first draft costs it, and how many times over the expected
        # saving must pay for it (`_worth_a_trial`); None: nothing to pay.
        self.trial, self.trial_margin = trial, trial_margin
        # In a batch a draft must beat a plain step by this many tokens a row: the rows'
        # uneven progress, which no per-depth average sees. A row alone stops at a tie, not
        # before: stopping leaves it blind until its probe.
        self.batch_margin = batch_margin
        self.probe_budget = probe_budget  # the share of time probes may cost
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.costs = costs or RoundCosts()
        # p_d where a request's rows start: earlier requests' (an engine's), or the prior
        self.acceptance = acceptance or AcceptanceMemory(prior, max_depth)
        self._chosen: Counter = Counter()

    def start(self, batch: int, max_nodes: int) -> None:  # noqa: D102
        self.max_nodes = max_nodes
        self.candidates = sorted({0, max_nodes, *(2**i for i in range(8) if 2**i < max_nodes)})
        # A batch is paid by its least lucky row, and a mean over earlier sequences
        # overstates it: a batch's rows start from the prior (benchmarks/README.md).
        start = self.acceptance.accept[: self.max_depth] if batch == 1 else []
        start += [self.prior] * (self.max_depth - len(start))
        self.accept = np.tile(start, (batch, 1))  # p_d per row
        self.judged = np.zeros((batch, self.max_depth), dtype=np.int64)  # rounds that tested d
        self.round = int(self.costs.known)  # known costs: no plain first round to time them
        # 0: the row drafts; else the round of its next probe (a batch waits for its first).
        first = 0 if batch == 1 else max(self.probe_every, self._affordable(batch))
        self.next_probe = np.full(batch, first, dtype=np.int64)
        self.interval = np.full(batch, self.probe_every)
        self.probing = np.zeros(batch, dtype=bool)
        self.hit = np.zeros(batch, dtype=bool)  # the row's last round accepted a draft token
        # Replays judged the row's drafter since its last decision: its probe is free.
        self.replayed = np.zeros(batch, dtype=bool)
        # How often asking the drafter found a draft for the row (n-gram finds no match in
        # many rounds; a model always drafts), and how many asks that is over.
        self.found = np.ones(batch)
        self.asks = np.zeros(batch, dtype=np.int64)
        self._floor: list[float] | None = None
        self._peers = 0
        self._sizes = np.zeros(batch, dtype=np.int64)
        self._tried = self.trial is None or self.trial.prefill_s <= 0  # nothing to pay first

    def sizes(self, active: np.ndarray, peers: int = 0) -> np.ndarray:  # noqa: D102
        self.round += 1
        self._peers = peers
        if len(active) == 1:  # batch 1, and every row of a continuous batch: kept cheap
            size = self._size(0) if active[0] and self.round > 1 else 0
            chosen = np.array([size], dtype=np.int64)
        else:
            chosen = np.zeros(len(active), dtype=np.int64)
            rows = np.flatnonzero(active)
            waiting = (self.next_probe[rows] > 0) & (self.round < self.next_probe[rows])
            if self.round > 1 and not waiting.all():  # else every row waits: no estimate
                # A batch ends with its slowest row: its rows size by the lowest acceptance.
                estimates = [self._estimates(b) for b in rows.tolist()]
                floor = [min(p) for p in zip(*estimates, strict=True)]
                self._floor = floor if len(rows) > 1 else None
                for b in rows.tolist():
                    chosen[b] = self._size(b)
        if not self._tried and chosen.any():
            chosen = self._first_draft(chosen)
        self._chosen.update(chosen[active].tolist())
        self._sizes = chosen
        return chosen

    def _first_draft(self, chosen: np.ndarray) -> np.ndarray:
        """`chosen` if the request's first draft is worth its prefill, else no draft at all.

        Without one, the request's rows idle to its end: plain decoding's loop.
        """
        assert self.trial is not None  # `_tried` is set without one
        if self._worth_a_trial(self.trial, int(np.flatnonzero(chosen)[0])):
            self._tried = True
            return chosen
        self.next_probe[:] = self.trial.rounds + 1
        return np.zeros_like(chosen)

    def _worth_a_trial(self, trial: Trial, row: int) -> bool:
        """Whether drafting the rest of the request saves `trial_margin` times its prefill.

        Expected from p_d as the rows start (earlier requests' verdicts at this setting,
        else the prior), a draft step as timed on the dummy until a round is timed (one per
        row and node: it errs dear), and T(0) as measured.
        """
        left = max(trial.rounds - self.round, 0)
        expected = self._expected(row)
        step = self.costs.time(0)
        rows = len(self.next_probe)
        per_token = step
        for size in self.candidates[1:]:
            draft = self.costs.draft if self.costs.drafted else trial.step_s * rows * size
            time = self.costs.verify(1 + size) + draft
            per_token = min(per_token, time / expected[min(size, self.max_depth)])
        return left * (step - per_token) >= self.trial_margin * trial.prefill_s

    def idle_rounds(self, active: np.ndarray) -> int:  # noqa: D102
        return _idle_rounds(self.next_probe.tolist(), active, self.round)

    def idled(self, stretch: Stretch) -> None:
        """Counts the stretch's rounds and prices a plain step by it; learns from its replays.

        A replayed draft is learnt from as a verified one (an ask that found a draft or
        not, the depths its tokens judged), and a row with replays decides at its next
        probe as in any round instead of paying for a one-node draft.
        """
        self.round += stretch.rounds
        self._chosen[0] += stretch.row_rounds
        self.costs.record_stretch(stretch.step_s)
        for row, replays in enumerate(stretch.replays):
            for replay in replays:
                self._asked(row, len(replay.draft) > 0)
                self._learn(row, len(replay.accepted), replay.judged)
            if replays:
                self.replayed[row] = True
                self.hit[row] = any(replay.accepted for replay in replays)

    def keep(self, proposed: list[DraftTree]) -> list[DraftTree]:  # noqa: D102
        return list(map(truncated, proposed, self._sizes.tolist()))

    def _size(self, b: int) -> int:
        if self.next_probe[b] and self.round < self.next_probe[b]:
            return 0  # idle until its probe
        if self.next_probe[b]:  # probe: the sequence may have become predictable
            self.next_probe[b], self.probing[b] = 0, True
            if not self.replayed[b]:
                return self.candidates[1]  # a small draft: cheap, and it tests the first depths
            # replays judged the drafter over the stretch: decided as in any round, for free
        self.replayed[b] = False
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
            step = max(int(self.interval[b]), self._affordable(len(self.interval)))
            # On a multiple of the step, so a batch's idle rows probe together, and at least
            # half a step away: the next multiple can be the next round (n-gram at T = 1
            # probed 11 rounds after a window at an affordable step of 18).
            probe = (self.round // step + 1) * step
            self.next_probe[b] = probe + step if probe - self.round < step // 2 else probe
        self.probing[b] = False
        return size

    def _affordable(self, batch: int) -> int:
        """The fewest rounds between probes that keeps them within `probe_budget`."""
        if self.costs.known:
            probe = self.costs.time(self.candidates[1]) / self.costs.time(0)
        else:  # nothing timed: a batch's probe is dear (its rows all draft), a row's cheap
            probe = UNTIMED_BATCH_PROBE if batch > 1 else self.costs.time(1) / self.costs.time(0)
        return _affordable_interval(probe, self.probe_budget)

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

    def _expected(self, row: int) -> list[float]:
        """[k]: tokens a chain of k emits, 1 + the sum of P(depth d accepted) for d <= k.

        With the row's p_d, or in a batch the lowest of its rows' (`_floor`).
        """
        accept = self._estimates(row) if self._floor is None else self._floor
        expected, reach = [1.0], 1.0
        for p in accept[: min(self.max_nodes, self.max_depth)]:
            reach *= p
            expected.append(expected[-1] + reach)
        return expected

    def _best(self, row: int) -> int:
        expected = self._expected(row)
        margin = 0.0 if self._floor is None else self.batch_margin
        # Peers emit one token a round whatever this row does, and wait for its draft: the
        # draft must raise the whole forward's tokens per second, not just this row's. An
        # ask that finds nothing (with probability 1 - q) emits a token in `ask` seconds.
        peers, q = self._peers, float(self.found[row] if self._floor is None else self.found.min())
        best, best_rate = 0, (peers + 1.0 + margin) / self.costs.time(0)
        # An ask is a plain step and a proposal: one timed cheaper is a plain step timed dear.
        ask = max(self.costs.ask, self.costs.time(0))
        for size in self.candidates[1:]:
            tokens = peers + 1.0 + q * (expected[min(size, self.max_depth)] - 1.0)
            rate = tokens / (q * self.costs.time(size) + (1.0 - q) * ask)
            if rate > best_rate:
                best, best_rate = size, rate
        return best

    def observe(self, row: int, depth: int, accepted: list[int]) -> None:  # noqa: D102
        count = len(accepted)
        self.hit[row] = count > 0
        if self._sizes[row]:  # asked: whether the drafter found anything to draft
            self._asked(row, depth > 0)
        self._learn(row, count, min(depth, count + 1))

    def _asked(self, row: int, found: bool) -> None:
        """The row's drafter was asked (or replayed) and found a draft or not."""
        self.asks[row] += 1
        self.found[row] = _learnt(self.found[row], self.asks[row], found, self.smoothing)

    def _learn(self, row: int, count: int, judged: int) -> None:
        """The target judged the row's first `judged` depths and accepted `count` of them."""
        for d in range(min(judged, self.max_depth)):
            hit = d < count
            self.acceptance.learn(d, hit)
            self.judged[row, d] += 1
            # The first misses count fully: a drafter the target rejects stops within a
            # few rounds, not a dozen.
            self.accept[row, d] = _learnt(
                self.accept[row, d], self.judged[row, d], hit, self.smoothing
            )

    def timed(self, width: int, verify_s: float, draft_s: float) -> None:  # noqa: D102
        if width == 1 and self._sizes.any():  # asked, and no row found a draft
            self.costs.record_ask(verify_s + draft_s)
        else:
            self.costs.record(width, verify_s, draft_s)

    def summary(self) -> ControllerSummary:  # noqa: D102
        return ControllerSummary("adaptive", dict(sorted(self._chosen.items())))


@dataclass
class AcceptanceMemory:
    """p_d over an engine's requests with one drafter and sampling setting: where rows start.

    `Engine.acceptance_memory` keeps one per drafting plan and sampling setting. Every
    verdict an `AdaptiveController` learns from moves it too (per depth, the mean of the
    prior and the evidence, then a moving average slower than a row's own), and a
    sequence decoded alone (a request of one, or a row of a continuous batch) starts from
    it rather than from the flat prior: where drafts mostly miss (n-gram at T = 1) a
    request that started at the prior spent its first round on a draft and its next on
    the slower step after it; where they mostly hold it drafts at once, as deep as they
    held. The rows of a batch start from the prior (benchmarks/README.md, controller.py).
    """

    prior: float = 0.5
    depths: int = 16
    smoothing: float = 0.05
    accept: list[float] = field(init=False)  # p_d per depth (index 0: the first)
    judged: list[int] = field(init=False)  # verdicts at each depth

    def __post_init__(self) -> None:
        # Fixed length: requests decoding in other threads update it in place.
        self.accept = [self.prior] * self.depths
        self.judged = [0] * self.depths

    def learn(self, depth: int, hit: bool) -> None:
        """The target judged a node at `depth` (0: the first) and accepted it or not."""
        if depth < self.depths:
            self.judged[depth] += 1
            self.accept[depth] = _learnt(
                self.accept[depth], self.judged[depth], hit, self.smoothing
            )


@dataclass
class AskingMemory:
    """When the next window of asking opens, counted in rounds across an engine's requests.

    An engine keeps one per drafting plan, batch size and sampling setting
    (`Engine.asking_memory`). Where drafts do not pay (suffix drafting at T > 0 on a small
    target), each window of asking costs a few plain steps: the probe round, wider than a
    plain step, and the slower first step after it (benchmarks/README.md, controller.py).
    So the wait between windows is one countdown that goes on from request to request:
    a window that ended in a request without a round that paid doubles `interval` (up to
    `max_interval`, past one request's `max_probe_every`) and sets the next probe that many
    rounds on, whichever request plays them; a round whose accepted tokens beat its time
    sets both back to 0, and the next request asks after its first plain rounds. Short
    requests that end before the probe bring it nearer for the next ones; one that ends
    inside a window leaves the next request the interval from the window's opening.
    """

    max_interval: int = 256
    rounds: int = 0  # rounds played by the requests of this memory
    probe_at: int = 0  # the value of `rounds` at which the next window opens (0: now)
    interval: int = 0  # rounds between windows that did not pay (0: the last one paid)

    def start(self) -> int:
        """A request starts: rounds before its first window of asking (0: none to wait)."""
        return max(0, self.probe_at - self.rounds)

    def played(self, rounds: int) -> None:
        """A request played `rounds` more rounds."""
        self.rounds += rounds

    def opened(self) -> None:
        """A window opened: a request that starts before it closes waits out the interval."""
        self.probe_at = max(self.probe_at, self.rounds + self.interval)

    def paid(self) -> None:
        """A round of asking paid: the next request asks at once."""
        self.probe_at = self.interval = 0

    def lost(self, interval: int) -> int:
        """A window that paid nothing ended: the rounds until the next (at least `interval`)."""
        self.interval = min(max(2 * self.interval, interval), self.max_interval)
        self.probe_at = self.rounds + self.interval
        return self.interval


class ConfidenceController:
    """Trims each round's draft by its own confidence (drafters with `sizes_own_drafts`).

    Such a drafter (suffix decoding) proposes in microseconds a deterministic tree, best
    first, with each node's probability given its parent under the drafter's counts
    (`DraftTree.confidence`, c_i). Each round every row's whole draft is proposed; row b
    expects node i accepted with π_{b,i}, the product over i and its ancestors j of
    min(1, g_{b,d(j)} c_j), and the batch keeps the first k nodes of each row, the k
    maximizing

        (P + B (1 + min_b Σ_{i <= k} π_{b,i})) / T(k),   T(0) = a plain step,

    if that beats a plain step's (P + B) / T(0) by `margin` (B active rows, and a batch
    ends with its slowest row, so each counts what the least hopeful one expects; one k
    for the batch, since its verify forward is as wide as its widest row; P peers as in
    `AdaptiveController`; T(k) the verify forward's time at width 1 + k, learnt from the
    loop's rounds, the proposal being spent either way). g_{b,d} corrects counts learnt
    on other text to what this target accepts at this temperature, per depth d: over the
    levels at depth d the target judged in b's drafts (the children of the root or of an
    accepted node), a moving average of whether a child was accepted over one of their
    summed c (from 1 over 1). Per depth, because acceptance is not independent: where the
    first node of a copied span holds, the rest mostly do (one moving average over every
    level judged made deep nodes look as unsure as first ones, and cut greedy drafts short).
    The counts' own word weighs one level, then the moving average takes over.
    The first round is a plain step, so T(0) is measured.

    Trimming after drafting rather than sizing before it keeps matches that
    `AdaptiveController`, idle between matches, misses (benchmarks/README.md,
    controller.py).

    Each round's k is at most twice the widest forward timed so far: T(k) for a width
    never seen is a one-row guess, far too cheap for a forward of many rows.

    A row stops proposing until a probe where asking loses more than `loss_budget` plain
    steps (`timed`), or after `patience` rounds in a row that kept nothing in a batch: a
    probe is a round, after `probe_every` rounds (doubling up to `max_probe_every` while
    probes fail, and never so often that probes cost more than `probe_budget` of the
    time; in a request that has not paid, at least the engine's `AskingMemory` countdown),
    that keeps at least one node (see `_after_proposal`). Where the drafter was replayed
    since the row last asked, the window opens only if keeping what the rule would have
    kept of the replayed drafts earned tokens net of the wider forwards (`_replay_net`);
    else the row waits another interval, doubled.

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
        probe_budget: float = 0.02,
        loss_budget: float = 0.5,
        costs: RoundCosts | None = None,
        memory: AskingMemory | None = None,
    ):
        self.smoothing, self.margin, self.max_depth = smoothing, margin, max_depth
        self.patience = patience  # rounds keeping nothing before the row stops proposing
        self.loss_budget = loss_budget  # plain steps asking may lose before rows idle
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.probe_budget = probe_budget  # the share of time probes may cost
        # T(k); tests pass a fixed curve so that what is kept does not depend on the host
        self.costs = costs or RoundCosts()
        self.memory = memory or AskingMemory()  # earlier requests' (an engine's), or none
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
        # The round each row proposes again (0: it proposes); the first as earlier learnt.
        wait = self.memory.start()
        self.idle_until = [wait] * batch
        self.interval = [self.probe_every] * batch
        self.probing = [False] * batch
        self.asked = [False] * batch
        self.judged = [[0] * self.max_depth for _ in range(batch)]  # levels judged per depth
        # What asking lost since it last paid (`timed`); a request whose predecessors'
        # windows did not pay goes on doubling their wait.
        self.loss, self.paid = 0.0, self.memory.interval == 0
        self.request_paid = False
        self.wait = 0  # rounds the last window that paid nothing set (`AskingMemory.lost`)
        self._gained = [0] * batch  # draft tokens each row accepted this round
        # Net tokens asking would have earned at the replays since the row last asked
        # (None: no replay); a row with replays asks only where they would have paid.
        self.replayed: list[float | None] = [None] * batch
        self._rows = [False] * batch  # the rows decoding this round
        self.round = 0
        self._peers = self._active = 0

    def sizes(self, active: np.ndarray, peers: int = 0) -> np.ndarray:  # noqa: D102
        # Python lists, not numpy: per-round work here is what the loop adds to a step.
        self.round += 1
        self.memory.played(1)
        self._peers, self._active = peers, int(active.sum())
        self._rows = active.tolist()
        chosen = []
        for b, on in enumerate(active.tolist()):
            asked = on and self.round > 1  # the first round is a plain step: T(0) measured
            if asked and self.idle_until[b]:
                asked = self.round >= self.idle_until[b]
            if asked and self.replayed[b] is not None:
                asked = self._replays_paid(b)
            if asked and self.idle_until[b]:  # a window of asking opens with a probe
                self.probing[b], self.idle_until[b] = True, 0
                if not self.request_paid:
                    self.memory.opened()
            self.asked[b] = asked
            chosen.append(self.max_nodes if asked else 0)
        self._chosen[0] += self._active - sum(self.asked)
        return np.array(chosen, dtype=np.int64)

    def idle_rounds(self, active: np.ndarray) -> int:  # noqa: D102
        return _idle_rounds(self.idle_until, active, self.round)

    def _replays_paid(self, b: int) -> bool:
        """Whether row b's replays since it last asked would have paid; if not, it idles on.

        Replays are probes that cost no round: a row whose replays earned nothing waits
        another interval (doubled, as after a probe that found nothing) for more of them.
        """
        paid = (self.replayed[b] or 0.0) > 0
        self.replayed[b] = None
        if not paid:
            self.interval[b] = min(2 * self.interval[b], self.max_probe_every)
            self.idle_until[b] = self.round + self.interval[b]
        return paid

    def idled(self, stretch: Stretch) -> None:
        """Counts the stretch's rounds and prices a plain step by it; learns from its replays.

        A replayed draft corrects g as a verified one does (`observe`), and adds to its
        row's replay earnings what the rule would have kept of it accepted, less the wider
        forward (`_replay_net`).
        """
        self.round += stretch.rounds
        self.memory.played(stretch.rounds)
        self._chosen[0] += stretch.row_rounds
        self.asked = [False] * len(self.asked)  # the last round that asked is accounted for
        self.costs.record_stretch(stretch.step_s)
        for row, replays in enumerate(stretch.replays):
            for replay in replays:
                if replay.draft.confidence is not None:  # an empty draft teaches nothing
                    self._learn(row, replay.draft, replay.accepted, replay.judged)
            if replays:
                net = sum(self._replay_net(row, replay) for replay in replays)
                self.replayed[row] = (self.replayed[row] or 0.0) + net

    def _replay_net(self, row: int, replay: Replay) -> float:
        """Tokens keeping the rule's prefix of a replayed draft would have earned, net.

        The accepted nodes of the kept prefix, less the verify forward's width over a plain
        step's, as if the row were alone.
        """
        path = self._path_probabilities(row, replay.draft)
        keep = self._keep_size([[0.0, *accumulate(path or ())]], self._peers + 1)
        if not keep:
            return 0.0
        gained = sum(node < keep for node in replay.accepted)
        return gained - (self.costs.verify(1 + keep) / self.costs.verify(1) - 1.0)

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
        self.probing = [False] * len(proposed)
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
        # sums[b][k]: Σ_{i <= k} π_{b,i}, row b's expected accepted tokens if k are kept
        sums = [[0.0, *accumulate(p or ())] for p, on in zip(paths, self._rows, strict=True) if on]
        return self._keep_size(sums, self._peers + self._active)

    def _keep_size(self, sums: list[list[float]], tokens: int) -> int:
        """The k maximizing the rate of a forward emitting `tokens` plus the rows' gains.

        `sums[b][k]`: row b's expected accepted tokens if k nodes are kept.
        """
        width = max(map(len, sums), default=1) - 1
        verify = self.costs.verify
        best, best_rate = 0, tokens * (1.0 + self.margin) / verify(1)
        # At most twice the widest draft timed: the cost of a width never seen is a guess,
        # made for one row; a forward of many rows (continuous batching) pays far more.
        for k in range(1, min(width, max(1, 2 * (self.costs.widest - 1))) + 1):
            gain = min(s[min(k, len(s) - 1)] for s in sums)
            rate = (tokens + len(sums) * gain) / verify(1 + k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _after_proposal(self, b: int, kept: int, proposed: int) -> None:
        """After `patience` rounds in a row that kept nothing the row stops proposing.

        Nothing kept: a draft trimmed to nothing or, where the forward carries other rows,
        no draft at all: many rows' proposals are a share of the forward worth saving.
        Alone, a row that finds nothing keeps looking while its proposals' cost stays
        within the loss budget (`timed`): a match missed while idle costs tokens.
        """
        if kept:
            self.misses[b] = 0
        elif proposed or self._peers + self._active > 1:
            self.misses[b] += 1
        if self.misses[b] >= self.patience:
            self._idle(b)

    def _idle(self, b: int) -> None:
        """Row b proposes again in `interval` rounds, or as many as keep probes affordable.

        Affordable: what the window of asking that ends lost (the loss since asking last
        paid, in plain steps a row), and a probe's wider forward, within `probe_budget` of
        the rounds until the next. In a request that has not paid, at least as many as the
        engine's memory says.
        """
        self.misses[b] = 0
        # A probe widens the forward by a node for every row in it, peers included.
        probe = self.costs.verify(2) / self.costs.verify(1)
        lost = self.loss / max(self._peers + self._active, 1)
        affordable = _affordable_interval(max(probe, 1.0 + lost), self.probe_budget)
        wait = 0 if self.request_paid else self.wait
        self.idle_until[b] = self.round + max(self.interval[b], affordable, wait)

    def observe(self, row: int, depth: int, accepted: list[int]) -> None:  # noqa: D102
        draft = self.kept[row]
        if depth == 0 or draft is None or draft.confidence is None:
            return  # nothing kept: nothing learnt about the drafter's confidence
        self._gained[row] += len(accepted)
        self._learn(row, draft, accepted, len(accepted) + 1)

    def _learn(self, row: int, draft: DraftTree, accepted: list[int], judged: int) -> None:
        """Learns g from the first `judged` levels of a confident draft the target judged."""
        hits, expected, judged_at = self.hits[row], self.expected[row], self.judged[row]
        levels = _judged_levels(draft, accepted)[: min(judged, self.max_depth)]
        for d, level in enumerate(levels):
            judged_at[d] += 1
            # The counts' own word weighs one level, then the moving average takes over.
            s = max(self.smoothing, 1.0 / (judged_at[d] + 1))
            hits[d] += s * (float(d < len(accepted)) - hits[d])
            expected[d] += s * (level - expected[d])
        self._correct(row)

    def _correct(self, row: int) -> None:
        """The row's g per depth: its hits over its expected.

        Unlike `AdaptiveController`'s p_d, a depth seldom judged is not capped by the one
        before: g starts from trusting the drafter's counts, and the cap cut greedy drafts
        short.
        """
        self.g[row][:] = [h / e for h, e in zip(self.hits[row], self.expected[row], strict=True)]

    def timed(self, width: int, verify_s: float, draft_s: float) -> None:
        """Learns the round's costs, and idles the asking rows once asking has cost too much.

        A round in which rows proposed earned, in tokens of the forward's R rows (peers
        included) over what plain steps emit in the same time,

            net = accepted draft tokens + R (1 - (draft + verify) / T(0)),

        the proposal's time counted whether anything was kept or not (a proposal that
        finds no match costs it too). The loss since asking last paid, L = max(0, L - net),
        may reach `loss_budget` plain steps of the forward (R x `loss_budget` tokens):
        past it every asking row goes idle until its probe, which opens the next window
        of asking; the interval doubles while no round of a window paid, and is back to
        `probe_every` after one that did. Alone, a no-match proposal costs a few percent
        of a step and the row keeps looking a while; a wide round of a batch that loses
        several steps idles it at once.
        """
        asked = [b for b, a in enumerate(self.asked) if a]
        plain = self.costs.verify(1) if self.costs.plain_timed else None
        self.costs.record(width, verify_s, draft_s)
        # As in `_best`: a batch gains the tokens its least lucky row accepted, each row.
        row_gains = [g for g, on in zip(self._gained, self._rows, strict=True) if on]
        gained = len(row_gains) * min(row_gains, default=0)
        self._gained = [0] * len(self._gained)
        if not asked or plain is None:
            return
        rows = self._peers + self._active
        net = gained + rows * (1.0 - (draft_s + verify_s) / plain)
        if gained > 0 and net >= 0:  # a lone round timed fast by chance is no pay
            self.paid = self.request_paid = True
            self.memory.paid()
        self.loss = max(0.0, self.loss - net)
        if self.loss <= self.loss_budget * rows:
            return
        for b in asked:
            if self.paid:
                self.interval[b] = self.probe_every
            else:
                self.interval[b] = min(2 * self.interval[b], self.max_probe_every)
        if not self.request_paid:  # one request that paid keeps the next asking at once
            self.wait = self.memory.lost(min(self.interval[b] for b in asked))
        for b in asked:
            if not self.idle_until[b]:
                self._idle(b)
        self.loss, self.paid = 0.0, False

    def summary(self) -> ControllerSummary:  # noqa: D102
        return ControllerSummary("confidence", dict(sorted(self._chosen.items())))


# A request's first rounds are plain steps that price a plain step (T(0)) unless earlier
# requests did: a stretch is priced by the median of its steps past the first (`idled`),
# and the steps right after a prefill run up to twice as slow (ONNX Runtime's first runs
# at the decode shapes). Two rounds priced T(0) by one such step, so dear on pyref-7m that
# n-gram drafts at T=1 looked profitable and first requests read 0.83x plain; four price
# it by a median of three.
FIRST_PLAIN_ROUNDS = 4

# A batch's probe round over a plain step, assumed before any was timed: every row of the
# batch drafts and the verify forward doubles its width (about 2x at batch 4 on pyref-7m,
# benchmarks/README.md#controllerpy), so the first probe of a batch waits until it is
# affordable rather than landing on round `probe_every`.
UNTIMED_BATCH_PROBE = 2.0


def _idle_rounds(until: list[int], active: np.ndarray, played: int) -> int:
    """Rounds after round `played` in which every active row idles.

    Row b idles until round `until[b]` (0: it drafts); a request's first rounds are plain.
    """
    after = played + 1  # the next round
    waits = [u - after if u else 0 for u, on in zip(until, active.tolist(), strict=True) if on]
    return max(min(waits, default=0), FIRST_PLAIN_ROUNDS if after == 1 else 0)


def _learnt(estimate: float, judged: int, hit: bool, smoothing: float) -> float:
    """`estimate` after its `judged`-th verdict.

    The mean of a Beta prior of weight 2 (the estimate it started from) and the evidence,
    until the moving average's weight `smoothing` is reached; then that moving average.
    """
    step = max(smoothing, 1.0 / (judged + 2))
    return estimate + step * (float(hit) - estimate)


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


def controller_for(
    drafter,
    costs: RoundCosts | None = None,
    memory: AskingMemory | None = None,
    acceptance: AcceptanceMemory | None = None,
    trial: Trial | None = None,
) -> Controller:
    """A fresh per-round controller suited to `drafter` (see the two rules above).

    `costs`: round costs earlier requests timed, which `AdaptiveController` starts from and
    goes on updating (suffix drafting's rule learns its own). `memory`: when earlier
    requests' windows of asking last paid, for suffix drafting's rule only
    (`AdaptiveController` with it lost n-gram's greedy gains: benchmarks/README.md).
    `acceptance`: the p_d earlier requests found, where `AdaptiveController`'s lone rows start.
    `trial`: what the request's first draft costs it (a drafter that sizes its own drafts has
    no prefill).
    """
    if getattr(drafter, "sizes_own_drafts", False):  # absent on drafters written before it
        return ConfidenceController(memory=memory)
    return AdaptiveController(costs=costs, acceptance=acceptance, trial=trial)


class RoundCosts:
    """Round time as a function of the draft size k, learnt from the loop's own rounds.

    T(k) = verify(1 + k) + draft [k > 0], each a smoothed measurement: verify(n) at the
    widths timed, a line through the narrowest and widest timed in between, and the build's
    curve f(n) = t(n) / t(1) scaled to the nearest timed width outside them (in units of a
    plain step until anything is timed); `draft` the smoothed drafting time of rounds that
    drafted. f is `shape`, the curve a calibration measured on the build (`Engine` passes
    it at batch 1, where it was measured), else 1 + 0.05 (n - 1).

    An engine's requests share one (costs are the machine's), so an estimate may live far
    longer than a request, and the rule only re-times a width it picks: a width priced too
    high is never picked again (shared without guards, one stall kept a benchmark cell on
    1-node drafts throughout: benchmarks/README.md, controller.py). Two guards, both erring
    cheap (a width priced too low is picked, so re-timed at once):
    - a timing counts at most `rise` x the width's estimate (for a width not yet timed, what
      the other widths predict): one slow outlier moves an estimate a little, never out of
      the rule. The first two timings of a width replace its estimate (the first is capped,
      the second confirms it), later ones are smoothed;
    - a width not timed for `horizon` rounds is forgotten and priced from the others until
      it is timed again (a forgotten plain step makes the next request start plain).
    """

    def __init__(
        self,
        smoothing: float = 0.2,
        rise: float = 1.5,
        horizon: int = 128,
        shape: Callable[[int], float] | None = None,
    ):
        self.smoothing, self.rise, self.horizon = smoothing, rise, horizon
        self.shape = shape or _guess  # t(n) / t(1) where nothing timed says otherwise
        self.by_width: dict[int, float] = {}
        self._seen: list[int] = []  # the widths timed, sorted
        self._timed: dict[int, tuple[int, int]] = {}  # width -> (times timed, last round)
        self._round = 0
        self._stretched = False  # a plain step was priced from a stretch (`record_stretch`)
        self.draft = 0.0
        self.ask = 0.0  # a round whose drafter found nothing to draft (0: none timed)

    def record(self, width: int, verify_s: float, draft_s: float) -> None:
        """A round's verify time at `width` tokens per row and its drafting time.

        A round of width 1 prices a plain step only until a stretch of them has
        (`record_stretch`): such a round follows a verify forward or a proposal that found
        nothing, and costs more than plain decoding's steps.
        """
        if width == 1 and self._stretched:
            return
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
            self._cap_plain(verify_s)

    def _cap_plain(self, seconds: float) -> None:
        """A plain step costs at most what a wider forward or an ask just cost.

        A request's steps run up to twice as slow for its first ten or so (pyref-7m, ONNX
        Runtime: 2.0 ms falling to 0.7), so a plain step priced then, and not re-priced
        while the row drafts or asks, made later rounds look cheaper than plain steps.
        """
        if 1 in self.by_width:
            self.by_width[1] = min(self.by_width[1], seconds)

    def record_stretch(self, step_s: float) -> None:
        """A plain step's time, from a stretch of them: from now on the plain step's price.

        The latest stretch replaces the price rather than moving an average: a request's
        steps grow faster over its first few dozen, so an earlier stretch overprices a step,
        and rounds that ask a drafter for nothing would look free against it
        (benchmarks/README.md, controller.py).
        """
        self._stretched = False
        if 1 in self._timed:  # timed before: this timing replaces it, as a first one would
            self._timed[1] = (0, self._timed[1][1])
        self.record(1, step_s, 0.0)
        self._stretched = True

    def record_ask(self, seconds: float) -> None:
        """A round that asked the drafter and found no draft, the proposal included.

        A plain step through the speculative loop: dearer than a stretch's step.
        """
        step = 1.0 if not self.ask else self.smoothing
        self.ask += step * (seconds - self.ask)
        self._cap_plain(seconds)

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
    def plain_timed(self) -> bool:
        """Whether a plain step has been timed."""
        return 1 in self.by_width

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
            return self.shape(width)
        low, high = self._seen[0], self._seen[-1]
        if width < low or low == high:
            near = low if width < low else high
            return self.by_width[near] * self.shape(width) / self.shape(near)
        if width > high:
            return self.by_width[high] * self.shape(width) / self.shape(high)
        slope = (self.by_width[high] - self.by_width[low]) / (high - low)
        return self.by_width[low] + slope * (width - low)


def _guess(width: int) -> float:
    """t(n) / t(1) before anything is timed, where no calibration measured the build's."""
    return 1.0 + 0.05 * (width - 1)
