"""`AdaptiveController`: draft sizes chosen before drafting, from acceptance and round costs."""

from __future__ import annotations

from collections import Counter

import numpy as np

from specx.runtime.controller.base import (
    UNTIMED_BATCH_PROBE,
    Schedule,
    Stretch,
    Trial,
    affordable_interval,
    learnt,
    rounds_all_idle,
    truncated,
)
from specx.runtime.controller.costs import RoundCosts
from specx.runtime.controller.memories import AcceptanceMemory
from specx.runtime.metrics import ControllerSummary
from specx.runtime.trees import DraftTree

__all__ = ["AdaptiveController"]


class AdaptiveController:
    """The rule in the module docstring.

    Scheduling details, each for the cost of rounds that do not draft (what each was
    measured to buy: docs/decisions.md#controller):
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
      the moving average's weight `schedule.smoothing` is reached; a row alone takes for prior what
      the engine's earlier requests at this setting found (`acceptance`), a batch `prior`;
    - a row that stopped drafting is not re-evaluated until its probe; the interval doubles
      after each probe that found nothing, and is never shorter than keeps probes within
      their share of the time (`Schedule`);
    - probes fall on multiples of the interval, so the idle rows of a batch probe together
      and the rounds between are plain decoding's steps for all of them (`idle_rounds`);
    - a row alone stops drafting only where a draft no longer beats a plain step: stopping
      leaves it blind until its probe, and a margin made the moving average's dips idle
      rows whose drafts paid.
    """

    def __init__(
        self,
        prior: float = 0.5,
        batch_margin: float = 0.5,
        costs: RoundCosts | None = None,
        acceptance: AcceptanceMemory | None = None,
        trial: Trial | None = None,
        trial_margin: float = 2.0,
        schedule: Schedule | None = None,
    ):
        self.prior, self.schedule = prior, schedule or Schedule()
        # What the request's first draft costs it, and how many times over the expected
        # saving must pay for it (`_worth_a_trial`); None: nothing to pay.
        self.trial, self.trial_margin = trial, trial_margin
        # In a batch a draft must beat a plain step by this many tokens a row: the rows'
        # uneven progress, which no per-depth average sees. A row alone stops at a tie, not
        # before: stopping leaves it blind until its probe.
        self.batch_margin = batch_margin
        self.costs = costs or RoundCosts()
        # p_d where a request's rows start: earlier requests' (an engine's), or the prior
        self.acceptance = acceptance or AcceptanceMemory(prior, self.schedule.max_depth)
        self._chosen: Counter = Counter()

    def start(self, batch: int, max_nodes: int) -> None:  # noqa: D102
        self.max_nodes = max_nodes
        self.candidates = sorted({0, max_nodes, *(2**i for i in range(8) if 2**i < max_nodes)})
        # A batch is paid by its least lucky row, and a mean over earlier sequences
        # overstates it: a batch's rows start from the prior (docs/decisions.md#acceptance-memory).
        start = self.acceptance.accept[: self.schedule.max_depth] if batch == 1 else []
        start += [self.prior] * (self.schedule.max_depth - len(start))
        self.accept = np.tile(start, (batch, 1))  # p_d per row
        self.judged = np.zeros(
            (batch, self.schedule.max_depth), dtype=np.int64
        )  # rounds that tested d
        self.round = int(self.costs.known)  # known costs: no plain first round to time them
        # 0: the row drafts; else the round of its next probe (a batch waits for its first).
        first = 0 if batch == 1 else max(self.schedule.probe_every, self._affordable(batch))
        self.next_probe = np.full(batch, first, dtype=np.int64)
        self.interval = np.full(batch, self.schedule.probe_every)
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
            per_token = min(per_token, time / expected[min(size, self.schedule.max_depth)])
        return left * (step - per_token) >= self.trial_margin * trial.prefill_s

    def idle_rounds(self, active: np.ndarray) -> int:  # noqa: D102
        return rounds_all_idle(self.next_probe.tolist(), active, self.round)

    def idled(self, stretch: Stretch) -> None:
        """Counts the stretch's rounds and prices a plain step by it; learns from its replays.

        A replayed draft is learnt from as a verified one (an ask that found a draft or
        not, the depths its tokens judged), and a row with replays decides at its next
        probe as in any round instead of paying for a one-node draft.
        """
        self.round += stretch.rounds
        self._chosen[0] += stretch.row_rounds
        self.costs.record_stretch(stretch.step_s)
        for row in np.flatnonzero(self.next_probe <= self.round + 1).tolist():  # deciding next
            replays = stretch.replay(row)
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
            self.interval[b] = self.schedule.probe_every  # the probe brought speculation back
        elif not size:
            if self.probing[b] and not self.hit[b]:  # a probe that found nothing: wait longer
                self.interval[b] = min(2 * self.interval[b], self.schedule.max_probe_every)
            elif self.probing[b]:  # it found something: probe again soon
                self.interval[b] = self.schedule.probe_every
            step = max(int(self.interval[b]), self._affordable(len(self.interval)))
            # The wait taken is what the next failed probe doubles: an interval doubled under
            # the affordable floor left the wait where it was (docs/decisions.md#backoff).
            self.interval[b] = step
            self.next_probe[b] = self._probe_round(step)
        self.probing[b] = False
        return size

    def _probe_round(self, step: int) -> int:
        """The round of an idle row's next probe, `step` rounds or so from now.

        A row alone: `step` rounds away. In a batch, on a multiple of the step, so that its
        idle rows probe together, and at least half a step away: the next multiple can be
        the next round (n-gram at T = 1 probed 11 rounds after a window at an affordable
        step of 18).
        """
        if len(self.next_probe) == 1:
            return self.round + step
        probe = (self.round // step + 1) * step
        return probe + step if probe - self.round < step // 2 else probe

    def _affordable(self, batch: int) -> int:
        """The fewest rounds between probes that keeps them within `probe_budget`."""
        if self.costs.known:
            probe = self.costs.time(self.candidates[1]) / self.costs.time(0)
        else:  # nothing timed: a batch's probe is dear (its rows all draft), a row's cheap
            probe = UNTIMED_BATCH_PROBE if batch > 1 else self.costs.time(1) / self.costs.time(0)
        return affordable_interval(probe, self.schedule.probe_budget)

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
        for p in accept[: min(self.max_nodes, self.schedule.max_depth)]:
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
            tokens = peers + 1.0 + q * (expected[min(size, self.schedule.max_depth)] - 1.0)
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
        self.found[row] = learnt(self.found[row], self.asks[row], found, self.schedule.smoothing)

    def _learn(self, row: int, count: int, judged: int) -> None:
        """The target judged the row's first `judged` depths and accepted `count` of them."""
        for d in range(min(judged, self.schedule.max_depth)):
            hit = d < count
            self.acceptance.learn(d, hit)
            self.judged[row, d] += 1
            # The first misses count fully: a drafter the target rejects stops within a
            # few rounds, not a dozen.
            self.accept[row, d] = learnt(
                self.accept[row, d], self.judged[row, d], hit, self.schedule.smoothing
            )

    def timed(self, width: int, verify_s: float, draft_s: float) -> None:  # noqa: D102
        if width == 1 and self._sizes.any():  # asked, and no row found a draft
            self.costs.record_ask(verify_s + draft_s)
        else:
            self.costs.record(width, verify_s, draft_s)

    def summary(self) -> ControllerSummary:  # noqa: D102
        return ControllerSummary("adaptive", dict(sorted(self._chosen.items())))
