"""The controller protocol, what the loop tells a controller, and the helpers both rules share.

`FixedSizes` cycles given sizes (tests and fixed benchmarks); the two rules are
`adaptive.AdaptiveController` and `confidence.ConfidenceController` (the package docstring).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specx.runtime.metrics import ControllerSummary
from specx.runtime.trees import DraftTree, depth_of, followed

__all__ = [
    "FIRST_PLAIN_ROUNDS",
    "UNTIMED_BATCH_PROBE",
    "Controller",
    "FixedSizes",
    "Replay",
    "Schedule",
    "Stretch",
    "Trial",
    "affordable_interval",
    "rounds_all_idle",
    "learnt",
    "truncated",
]


@dataclass(frozen=True)
class Schedule:
    """How the two rules learn and when a row that stopped drafting tries again.

    A row's averages weigh each round's evidence by `smoothing` (once the prior's weight
    is passed) over its first `max_depth` levels. An idle row probes after `probe_every`
    rounds; the interval doubles after each probe that found nothing, up to
    `max_probe_every`, and is never so short that probes cost more than `probe_budget`
    of the time.
    """

    smoothing: float = 0.2
    max_depth: int = 16
    probe_every: int = 8
    max_probe_every: int = 64
    probe_budget: float = 0.02


class Controller(Protocol):
    """Chooses each round's draft size per sequence and learns from what was verified.

    The loop (`specx.runtime.speculative_decoding`) calls it in this order: `start` once
    per request; then each round `idle_rounds` first: N > 0 plays N plain steps and reports
    them to `idled` (no other call that round). Else `sizes` gives each row's budget (all 0
    and `idle_rounds` > 0: the round opens a stretch, as above); the drafter proposes for
    the budget; `keep` cuts each proposal to what is verified; after the verify forward
    (or a plain step where nothing was kept) `observe` hears each row's verdict (after a
    plain step, only the rows whose ask found nothing), and `timed` the round's costs.
    `summary` at the end, for the run's stats.
    """

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
        return cls(draft, accepted, min(len(accepted) + 1, len(emitted), depth_of(draft)))


@dataclass(frozen=True)
class Stretch:
    """Plain steps the loop played for a controller's idle rounds.

    `rounds` steps, `row_rounds` their sum over the rows; `step_s` a plain step's seconds
    (the median step past the stretch's first); `replay(b)`: row b's drafter replayed at the
    stretch's last steps, judged by what they emitted (() where the drafter cannot replay).
    A replay costs a proposal per step (suffix decoding's ~35 us, rows times that in a
    batch), so a controller asks only for the rows it decides for next, and only before
    the next round.
    """

    rounds: int
    row_rounds: int
    step_s: float
    replay: Callable[[int], tuple[Replay, ...]] = field(default=lambda row: ())


@dataclass(frozen=True)
class Trial:
    """What a request's first draft costs it however the draft fares: the drafter's prefill.

    A head's or a draft model's prefill of the prompts; none for model-free drafters. Suffix
    drafting's batch rows index their texts at their first ask instead (`index_s`).

    `prefill_s`: predicted (the engine's measure per prompt token times the request's);
    `rounds`: the request's rounds at most (its new tokens); `step_s`: one draft step of one
    sequence, as timed on a dummy (what a draft costs before one is timed in a round);
    `index_s`: a token of a row's text indexed at the first ask, as timed on a dummy (0: the
    drafter indexes nothing then); `prompt_tokens`: the request's, over its prompts.
    """

    prefill_s: float
    rounds: int
    step_s: float = 0.0
    index_s: float = 0.0
    prompt_tokens: int = 0


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


# A request's first rounds are plain steps that price a plain step (T(0)) unless earlier
# requests did: a stretch is priced by the median of its steps past the first (`idled`),
# and the steps right after a prefill run up to twice as slow (ONNX Runtime's first runs
# at the decode shapes). Two rounds priced T(0) by one such step, so dear on pyref-7m that
# n-gram drafts at T=1 looked profitable and first requests read 0.83x plain; four price
# it by a median of three.
FIRST_PLAIN_ROUNDS = 4


# A batch's probe round over a plain step, assumed before any was timed: every row of the
# batch drafts and the verify forward doubles its width (about 2x at batch 4 on pyref-7m,
# docs/decisions.md#probe-round-costs), so the first probe of a batch waits until it is
# affordable rather than landing on round `probe_every`.
UNTIMED_BATCH_PROBE = 2.0


def rounds_all_idle(until: list[int], active: np.ndarray, played: int) -> int:
    """Rounds after round `played` in which every active row idles.

    Row b idles until round `until[b]` (0: it drafts); a request's first rounds are plain.
    """
    after = played + 1  # the next round
    waits = [u - after if u else 0 for u, on in zip(until, active.tolist(), strict=True) if on]
    return max(min(waits, default=0), FIRST_PLAIN_ROUNDS if after == 1 else 0)


def learnt(estimate: float, judged: int, hit: bool, smoothing: float) -> float:
    """`estimate` after its `judged`-th verdict.

    The mean of a Beta prior of weight 2 (the estimate it started from) and the evidence,
    until the moving average's weight `smoothing` is reached; then that moving average.
    """
    step = max(smoothing, 1.0 / (judged + 2))
    return estimate + step * (float(hit) - estimate)


def affordable_interval(probe: float, budget: float) -> int:
    """Rounds between probes for them to cost at most `budget` of the time.

    `probe`: a probe round's time over a plain round's.
    """
    return max(1, math.ceil((probe - 1.0) / budget))
