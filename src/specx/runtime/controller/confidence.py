"""`ConfidenceController`: a confident drafter's whole draft, trimmed after drafting."""

from __future__ import annotations

import math
from collections import Counter
from itertools import accumulate

import numpy as np

from specx.runtime.controller.base import (
    UNTIMED_BATCH_PROBE,
    Replay,
    Schedule,
    Stretch,
    Trial,
    affordable_interval,
    rounds_all_idle,
    truncated,
)
from specx.runtime.controller.costs import RoundCosts
from specx.runtime.controller.memories import AskingMemory
from specx.runtime.metrics import ControllerSummary
from specx.runtime.trees import DraftTree

__all__ = ["ConfidenceController"]


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
    `AdaptiveController`, idle between matches, misses
    (docs/decisions.md#confidence-trimming).

    Each round's k is at most twice the widest forward timed so far: T(k) for a width
    never seen is a one-row guess, far too cheap for a forward of many rows.

    A row stops proposing until a probe where asking loses more than `loss_budget` plain
    steps (`timed`), or after `patience` rounds in a row that kept nothing in a batch: a
    probe is a round, after `schedule.probe_every` rounds (doubling while probes fail, and
    never so often that probes cost more than their share of the time: `Schedule`; in a
    request that has not paid, at least the engine's `AskingMemory` countdown), that keeps
    at least one node (see `_after_proposal`). Where the drafter was replayed
    since the row last asked, the window opens only if keeping what the rule would have
    kept of the replayed drafts earned tokens net of the wider forwards (`_replay_net`);
    else the row waits another interval, doubled.

    Lossless: a deterministic draft is a function of the history, so a prefix chosen from
    it is too. A sampled draft (`probs` set) is kept whole: dropping its nodes by their own
    tokens' probabilities would bias what survives.
    """

    def __init__(
        self,
        margin: float = 0.05,
        patience: int = 4,
        loss_budget: float = 0.5,
        costs: RoundCosts | None = None,
        memory: AskingMemory | None = None,
        schedule: Schedule | None = None,
        trial: Trial | None = None,
    ):
        self.margin, self.schedule = margin, schedule or Schedule()
        # What a batch's first ask costs beyond its forward: indexing every row's text
        # (`_first_batch_window`); None or no `index_s`: nothing.
        self.trial = trial
        self.patience = patience  # rounds keeping nothing before the row stops proposing
        self.loss_budget = loss_budget  # plain steps asking may lose before rows idle
        # T(k); tests pass a fixed curve so that what is kept does not depend on the host
        self.costs = costs or RoundCosts()
        self.memory = memory or AskingMemory()  # earlier requests' (an engine's), or none
        self._chosen: Counter = Counter()

    def start(self, batch: int, max_nodes: int) -> None:  # noqa: D102
        self.max_nodes = max_nodes
        # Moving averages per row and depth over the levels judged there: a child accepted,
        # and the children's summed confidence; g their ratio (see `_correct`).
        self.hits = [[1.0] * self.schedule.max_depth for _ in range(batch)]
        self.expected = [[1.0] * self.schedule.max_depth for _ in range(batch)]
        self.g = [[1.0] * self.schedule.max_depth for _ in range(batch)]
        self.kept: list[DraftTree | None] = [None] * batch  # this round's kept drafts
        self.misses = [0] * batch  # drafts in a row trimmed to nothing
        # The round each row proposes again (0: it proposes); the first as earlier learnt,
        # and in a batch not before probes are affordable (`_first_batch_window`).
        wait = self.memory.start()
        self.idle_until = [max(wait, self._first_batch_window(batch))] * batch
        self.indexed = False  # a row asked: the drafter indexed the rows' texts
        self.interval = [self.schedule.probe_every] * batch
        self.probing = [False] * batch
        self.asked = [False] * batch
        self.judged = [
            [0] * self.schedule.max_depth for _ in range(batch)
        ]  # levels judged per depth
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

    def _first_batch_window(self, batch: int) -> int:
        """The round a batch's rows first ask (0 alone), as `AdaptiveController`'s first probe.

        A batch's asking round proposes for every row and a kept node widens the forward for
        all of them: asking from the second round cost suffix's first requests 3-9% at
        batches 2 to 8 on pyref-7m, drafting in under 2% of their row-rounds
        (docs/decisions.md#suffix-batch-waits). The first ask also makes the drafter index
        every row's text (`trial.index_s` a token: suffix drafting builds each row's trie
        then, the prompts and every token emitted since; ~7 ms by round 50 at batch 6 on
        pyref-7m, about five plain steps, which cost 6 x 128-token requests 2-4% where the
        asks found nothing), and the text grows by a token a row each round. Once a plain
        step is timed that is priced too: the first round r whose probe, indexing included,
        costs at most `probe_budget` of the r rounds before it (without indexing,
        `affordable_interval`); never where the indexing grows faster than that budget.
        """
        if batch == 1:
            return 0
        timed = self.costs.plain_timed and self.costs.widest > 1
        probe = self.costs.verify(2) / self.costs.verify(1) if timed else UNTIMED_BATCH_PROBE
        trial = self.trial
        if trial is None or not trial.index_s or not self.costs.plain_timed:
            return max(self.schedule.probe_every, self._affordable(probe))
        step, budget = self.costs.verify(1), self.schedule.probe_budget
        growth = trial.index_s * batch / step  # plain steps of indexing a round adds
        fixed = probe - 1.0 + trial.index_s * trial.prompt_tokens / step
        first = trial.rounds + 1 if growth >= budget else math.ceil(fixed / (budget - growth))
        return max(self.schedule.probe_every, first)

    def _affordable(self, probe: float | None = None) -> int:
        """The fewest rounds between probes that keeps them within `probe_budget`.

        `probe`: a probe round over a plain step; by default the two-token forward's.
        """
        probe = probe or self.costs.verify(2) / self.costs.verify(1)
        return affordable_interval(probe, self.schedule.probe_budget)

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
        self.indexed = self.indexed or any(self.asked)
        return np.array(chosen, dtype=np.int64)

    def idle_rounds(self, active: np.ndarray) -> int:  # noqa: D102
        return rounds_all_idle(self.idle_until, active, self.round)

    def _replays_paid(self, b: int) -> bool:
        """Whether row b's replays since it last asked would have paid; if not, it idles on.

        Replays are probes that cost no round: a row whose replays earned nothing waits
        another interval (doubled, as after a probe that found nothing) for more of them,
        and at least as long as keeps probes affordable: the stretch they end and the
        replays themselves (a catch-up of the trie and four drafts, ~0.35 ms on pyref-7m)
        cost about half a plain step (docs/decisions.md#suffix-batch-waits).
        """
        paid = (self.replayed[b] or 0.0) > 0
        self.replayed[b] = None
        if not paid:
            doubled = min(2 * self.interval[b], self.schedule.max_probe_every)
            # The wait taken is what the next doubling doubles: an interval doubled under the
            # affordable floor left the wait where it was (docs/decisions.md#backoff).
            self.interval[b] = max(doubled, self._affordable())
            self.idle_until[b] = self.round + self.interval[b]
        return paid

    def idled(self, stretch: Stretch) -> None:
        """Counts the stretch's rounds and prices a plain step by it; learns from its replays.

        A replayed draft corrects g as a verified one does (`observe`), and adds to its
        row's replay earnings what the rule would have kept of it accepted, less the wider
        forward (`_replay_net`). A row of a batch is not replayed: replaying makes the
        drafter read every token the row emitted into its trie (~30 us a token at depth 32
        on pyref-7m's prompts), for every row, and in batches of 4 to 8 that cost more than
        the asks it spared (greedy, batch 8: 0.90x plain with replays, 1.00x without).
        """
        self.round += stretch.rounds
        self.memory.played(stretch.rounds)
        self._chosen[0] += stretch.row_rounds
        self.asked = [False] * len(self.asked)  # the last round that asked is accounted for
        self.costs.record_stretch(stretch.step_s)
        if len(self.idle_until) > 1:
            if not self.indexed:  # a plain step is timed now: the first ask priced in full
                first = self._first_batch_window(len(self.idle_until))
                self.idle_until = [max(wait, first) if wait else wait for wait in self.idle_until]
            return  # a batch's rows are not replayed
        if self.idle_until[0] > self.round + 1:
            return  # a row that does not decide next round
        replays = stretch.replay(0)
        for replay in replays:
            if replay.draft.confidence is not None:  # an empty draft teaches nothing
                self._learn(0, replay.draft, replay.accepted, replay.judged)
        if replays:
            net = sum(self._replay_net(0, replay) for replay in replays)
            self.replayed[0] = (self.replayed[0] or 0.0) + net

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
        g, last = self.g[row], self.schedule.max_depth - 1
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
        lost = self.loss / max(self._peers + self._active, 1)
        affordable = self._affordable(max(self.costs.verify(2) / self.costs.verify(1), 1.0 + lost))
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
        levels = _judged_levels(draft, accepted)[: min(judged, self.schedule.max_depth)]
        for d, level in enumerate(levels):
            judged_at[d] += 1
            # The counts' own word weighs one level, then the moving average takes over.
            s = max(self.schedule.smoothing, 1.0 / (judged_at[d] + 1))
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
                self.interval[b] = self.schedule.probe_every
            else:
                self.interval[b] = min(2 * self.interval[b], self.schedule.max_probe_every)
        if not self.request_paid:  # one request that paid keeps the next asking at once
            self.wait = self.memory.lost(min(self.interval[b] for b in asked))
        for b in asked:
            if not self.idle_until[b]:
                self._idle(b)
        self.loss, self.paid = 0.0, False

    def summary(self) -> ControllerSummary:  # noqa: D102
        return ControllerSummary("confidence", dict(sorted(self._chosen.items())))


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
