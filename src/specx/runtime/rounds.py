"""A speculative request's rounds: the state they share, verify rounds, plain rounds, stretches.

`specx.runtime.speculative_decoding.generate_speculative` plays them: each round a verify
round (`verify_round`: every row's tree in one target forward) or, where no row drafts, a
plain round (`plain_round`); a run of rounds in which the controller knows no row will
draft is a stretch on plain decoding's own loop (`idle_stretch`), after which the drafter
may be replayed over its last steps (`Replay`).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specx.runtime.controller import Controller, Replay, Stretch
from specx.runtime.drafters.base import Drafter, Replays
from specx.runtime.kv_cache import KVCache
from specx.runtime.metrics import AcceptanceStats
from specx.runtime.plain_decoding import Progress, TokenSink
from specx.runtime.sampling import SamplingParams, next_tokens, sampling_probs
from specx.runtime.spine import Arranged, Settled, arrange, settle
from specx.runtime.targets.base import DecoderBackend, StepOutput
from specx.runtime.trees import (
    DraftTree,
    TreeError,
    ancestor_mask,
    depth_of,
    depths,
    validate_parents,
    verify_parents,
)
from specx.runtime.verification import Coin, Verdict

__all__ = [
    "EMPTY_DRAFT",
    "PROBE_TAIL",
    "LoopState",
    "RoundObserver",
    "Verifier",
    "VerifiedRow",
    "accept",
    "arranged",
    "commit_row",
    "idle_stretch",
    "plain_round",
    "verify_inputs",
    "verify_round",
]


Verifier = Callable[[np.ndarray, DraftTree, Coin, bool], Verdict]


RoundObserver = Callable[[int, DraftTree, Verdict], None]


def verify_inputs(
    roots: np.ndarray, drafts: Sequence[DraftTree], lengths: np.ndarray, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Target inputs for one verify forward over [root, draft...] per sequence.

    Sequences with smaller drafts are padded with tokens that only see themselves;
    their outputs are ignored and their KV rows land past the sequence length. Drafts are
    validated first (parents before children, tokens in the vocabulary), so a faulty
    drafter fails loudly instead of producing a wrong mask.

    Returns:
        input_ids [B, N], position_ids [B, N] (prefix length + depth), mask [B, 1, N, L].
    """
    batch = len(drafts)
    n = 1 + max(len(d) for d in drafts)
    kv_len = int(lengths.max()) + n
    input_ids = np.zeros((batch, n), dtype=np.int64)
    positions = np.repeat(lengths[:, None], n, axis=1)
    mask = np.zeros((batch, 1, n, kv_len), dtype=bool)
    for b, draft in enumerate(drafts):
        size, start = 1 + len(draft), int(lengths[b])
        depth, ancestors = _verify_geometry(np.asarray(draft.parents, np.int64).tobytes())
        if len(draft) and not 0 <= int(draft.tokens.min()) <= int(draft.tokens.max()) < vocab_size:
            raise TreeError(f"sequence {b}: a draft token is outside [0, {vocab_size})")
        input_ids[b, 0], input_ids[b, 1:size] = roots[b], draft.tokens
        positions[b, :size] += depth
        mask[b, 0, :, :start] = True
        mask[b, 0, :size, start : start + size] = ancestors
        pad = np.arange(size, n)
        mask[b, 0, pad, start + pad] = True
    return input_ids, positions, mask


@functools.lru_cache(maxsize=4096)
def _verify_geometry(draft_parents: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Depths [n + 1] and ancestor mask [n + 1, n + 1] of [root, draft] (parents as int64 bytes).

    Validated once per tree shape: drafters repeat shapes (every chain of a length, a
    static tree), and per round these cost ~40 us of Python for a 16-node tree.
    """
    parents = verify_parents(validate_parents(np.frombuffer(draft_parents, np.int64)))
    depth, ancestors = depths(parents), ancestor_mask(parents)
    depth.flags.writeable = ancestors.flags.writeable = False  # shared by every caller
    return depth, ancestors


@dataclass(frozen=True)
class LoopState:
    """A request's decoding state, shared by its rounds (the arrays and lists change)."""

    target: DecoderBackend
    drafter: Drafter
    cache: KVCache  # the target's
    histories: list[list[int]]  # prompt + emitted, per row
    emitted: list[list[int]]
    active: np.ndarray  # [B] bool
    sampling: SamplingParams
    rng: np.random.Generator
    coin: Coin
    eos: set[int]
    max_new_tokens: int
    stats: list[AcceptanceStats]
    sink: TokenSink | None
    verifier: Verifier
    observer: RoundObserver | None
    controller: Controller | None
    carries: list[list[int]] | None  # provisional tokens per row; None: every logit is exact

    def emit(self, row: int, tokens: Sequence[int]) -> int:
        """Appends a round's tokens to a row until eos or the budget; returns how many."""
        emitted, count = self.emitted[row], 0
        for token in tokens:
            emitted.append(token)
            self.histories[row].append(token)
            count += 1
            if token in self.eos or len(emitted) >= self.max_new_tokens:
                self.active[row] = False
                break
        if self.sink is not None and not self.sink(int(row), emitted[-count:]):
            self.active[row] = False
        return count


def arranged(loop: LoopState, drafts: list[DraftTree] | None) -> list[Arranged] | None:
    """What each row verifies this round; None for a plain round (no draft, nothing carried).

    Where only the spine is exact, each row's tree spine first under its carried tokens
    (`specx.runtime.spine`); elsewhere the drafts as they are.
    """
    carries = loop.carries
    drafts = drafts or [EMPTY_DRAFT] * len(loop.active)
    rows = set(np.flatnonzero(loop.active).tolist())
    if not any(len(drafts[b]) or (carries is not None and carries[b]) for b in rows):
        return None
    if carries is None:
        return [Arranged.as_drafted(d) for d in drafts]
    limit = loop.drafter.max_nodes
    return [
        arrange(carries[b], drafts[b], limit) if b in rows else Arranged.as_drafted(EMPTY_DRAFT)
        for b in range(len(drafts))
    ]


def verify_round(loop: LoopState, proposed: list[DraftTree], arranged: list[Arranged]) -> int:
    """Verifies every row's tree in one target forward; returns the forward's width."""
    target, cache, active = loop.target, loop.cache, loop.active
    roots = np.array([h[-1] for h in loop.histories], dtype=np.int64)
    # Finished sequences still ride along in the batch; their rows go to slot 0 on.
    lengths = np.where(active, cache.lengths, 0)
    trees = [a.tree for a in arranged]
    input_ids, positions, mask = verify_inputs(roots, trees, lengths, target.vocab_size)
    output = target.forward(cache, input_ids, positions, mask, lengths)
    spine_only = loop.carries is not None
    for b in np.flatnonzero(active).tolist():
        row = VerifiedRow(
            loop.sampling, loop.coin, loop.verifier, spine_only, loop.drafter, loop.controller,
            b, loop.stats[b], functools.partial(loop.emit, b),
        )  # fmt: skip
        settled = commit_row(row, cache, b, int(lengths[b]), output, arranged[b], proposed[b])
        if loop.observer is not None:  # what the drafter's own draft achieved
            verdict = Verdict(settled.judged, settled.verdict.next_token)
            loop.observer(b, arranged[b].draft, verdict)
        if loop.carries is not None:
            loop.carries[b] = settled.carry
    return input_ids.shape[1]


@dataclass(frozen=True)
class VerifiedRow:
    """A row of a verify forward as `commit_row` judges and commits it.

    `index`: the row its drafter and controller know it by (the request's row in
    `generate_speculative`; 0 for a continuous batch's sequence, whose drafter and
    controller are its own). `spine_only`: greedy on a build where only a tree's spine is
    exact (`specx.runtime.spine`). `emit` appends the round's tokens and returns how many
    it took (eos, the budget or the sink may cut them).
    """

    sampling: SamplingParams
    coin: Coin
    verifier: Verifier
    spine_only: bool
    drafter: Drafter | None
    controller: Controller | None
    index: int
    stats: AcceptanceStats
    emit: Callable[[list[int]], int]


def commit_row(
    row: VerifiedRow,
    cache: KVCache,
    slot: int,
    length: int,
    output: StepOutput,
    arranged: Arranged,
    proposed: DraftTree,
) -> Settled:
    """One row's round after the verify forward, the same in both loops.

    Verifies the row's tree on its logits (only its own tokens, never the padding, go through
    the sampling transform), settles the spine rule, keeps the accepted path's KV rows at
    `slot` past `length`, tells the drafter what it kept, emits the tokens, and records them
    in the row's stats and controller. Returns the settled verdict (its carry is the
    caller's to keep).
    """
    tree, greedy = arranged.tree, row.sampling.greedy
    logits = output.logits[slot, : 1 + len(tree)]
    probs = logits if greedy else sampling_probs(logits, row.sampling)
    settled = settle(row.verifier(probs, tree, row.coin, greedy), arranged, row.spine_only)
    verdict = settled.verdict
    path = np.array([0] + [i + 1 for i in verdict.accepted])
    cache.keep_path(slot, length, path)
    cache.lengths[slot] = length + len(path)
    if row.drafter is not None:
        taps = None if output.taps is None else output.taps[slot, path]
        accept(row.drafter, row.index, proposed, settled, taps)
    count = row.emit(verdict.emitted(tree))
    # Accepted tokens cut off by eos or the token budget are not counted.
    row.stats.record(depth_of(tree), min(len(verdict.accepted), count - 1))
    if row.controller is not None:
        row.controller.observe(row.index, depth_of(arranged.draft), settled.judged)
    return settled


# A probe's cost is paid at once (a wider forward, and the slower step after it) and all it
# can buy is the rounds left: a stretch that would end with fewer tokens left than this, a
# row, runs to the request's end instead (docs/decisions.md#probe-tail). A row: a batch's
# probe widens every row's forward and asks every row's drafter (suffix drafting catching
# each row's trie up first), so it costs more the more rows it holds
# (docs/decisions.md#batch-probe-tail).
PROBE_TAIL = 8


def _past_a_late_probe(loop: LoopState, idle: int) -> int:
    """The stretch's rounds: `idle`, or to the end where the round after it comes too late."""
    rows = np.flatnonzero(loop.active)
    left = loop.max_new_tokens - min(len(loop.emitted[b]) for b in rows)
    return left if left - idle < PROBE_TAIL * len(rows) else idle


def idle_stretch(
    loop: LoopState,
    controller: Controller,
    rounds: int,
    progress: Progress | None,
    sized: bool = False,
) -> int:
    """Plays `rounds` rounds in which no row drafts (`plain_stretch`); returns the steps.

    The controller hears of them (`idled`); `sized`: its `sizes` counted the first already.
    """
    counted = int(sized)
    starts = {b: len(loop.histories[b]) for b in np.flatnonzero(loop.active).tolist()}
    steps, row_steps, step_s = plain_stretch(loop, _past_a_late_probe(loop, rounds), progress)
    replay = _replayer(loop, starts)
    controller.idled(Stretch(steps - counted, row_steps - counted * len(starts), step_s, replay))
    return steps


# Steps of a stretch at which the drafter is replayed, per row: the last ones, nearest the
# next decision. A replay costs a proposal (suffix drafting ~35 us, n-gram ~5 us, against a
# plain step of ~700 us on pyref-7m); stretches grow while drafts do not pay.
REPLAYS = 4


def _replayer(loop: LoopState, starts: dict[int, int]) -> Callable[[int], tuple[Replay, ...]]:
    """Replays a row's drafter at the last steps of a stretch, judged by what followed.

    `starts[b]`: row b's history length when the stretch began (rows absent did not play
    it). () where the drafter cannot replay (`Drafter.replay`) or no row decodes on.
    """
    drafter = loop.drafter

    def replayed(b: int) -> tuple[Replay, ...]:
        if not isinstance(drafter, Replays) or b not in starts or not loop.active.any():
            return ()
        history = loop.histories[b]
        positions = range(max(starts[b], len(history) - REPLAYS), len(history))
        return tuple(Replay.of(d, history[t:]) for t, d in drafter.replay(b, history, positions))

    return replayed


def plain_round(loop: LoopState, tried: np.ndarray | None = None) -> None:
    """One decoding step for every row, drafts left out.

    Emits what an empty draft's verification would (the target's argmax, or a token drawn
    from its distribution) without the verification machinery. `tried` [B]: rows whose
    drafter was asked and found nothing; their controller learns that, as from a verify.
    """
    plain_stretch(loop, 1, None)
    if tried is not None and loop.controller is not None:
        for b in np.flatnonzero(tried).tolist():
            loop.controller.observe(int(b), 0, [])


def plain_stretch(
    loop: LoopState, rounds: int, progress: Progress | None
) -> tuple[int, int, float]:
    """Up to `rounds` decoding steps in which no row drafts.

    Plain decoding's own loop (`generate_plain`): a request or batch that does not
    speculate must not pay for the speculative round's bookkeeping (what that cost:
    docs/decisions.md#idle-rounds-in-plain-loop). The drafter hears of the stretch once, at its
    end: each row's taps of every step.

    Returns:
        The steps taken, their sum over the rows (a row that ends stops counting), and a
        plain step's seconds: the median step past the first (the first after a prefill
        or a verify forward runs up to twice as slow; a median, not a mean, so that one
        stall does not price the steps after it), or the one step's.
    """
    cache, active, target, sampling = loop.cache, loop.active, loop.target, loop.sampling
    started = np.flatnonzero(active).tolist()
    before = [len(loop.emitted[b]) for b in started]
    rounds = min(rounds, loop.max_new_tokens - min(before))  # no row outlives its budget
    roots = np.array([h[-1] for h in loop.histories], dtype=np.int64)
    taps: np.ndarray | None = None  # [B, rounds, W], when the target exports taps
    # The step is plain decoding's, and so is its Python: per-step numpy calls (the rows'
    # write positions, fancy indexing) made a stretch's step ~13 us dearer than
    # `generate_plain`'s on pyref-7m at batch 1 (docs/decisions.md#lean-stretch-steps).
    live, parked = started, len(started) < len(active)  # finished rows write at slot 0
    steps, step_s, last_s = 0, [], time.perf_counter()
    while steps < rounds and live:
        output = target.decode_step(
            cache, roots, np.where(active, cache.lengths, 0) if parked else None
        )
        roots = next_tokens(output.logits[:, 0], sampling, loop.rng)
        if output.taps is not None:
            if taps is None:
                taps = np.empty((len(active), rounds, output.taps.shape[-1]), np.float32)
            taps[:, steps] = output.taps[:, 0]  # the next step overwrites the bound output
        if parked:
            cache.lengths[live] += 1
        else:
            cache.lengths += 1
        tokens = roots.tolist()
        for b in live:
            loop.emit(b, (tokens[b],))
        steps += 1
        now = time.perf_counter()
        step_s.append(now - last_s)
        last_s = now
        if progress is not None:
            progress(sum(len(e) for e in loop.emitted), int((~active).sum()))
        if not all(active[live].tolist()):
            live, parked = [b for b in live if active[b]], True
    if loop.carries is not None:  # provisional tokens of a point the stretch moved past
        for b in started:
            loop.carries[b] = []
    row_steps = 0
    for b, emitted in zip(started, before, strict=True):
        count = len(loop.emitted[b]) - emitted
        loop.drafter.accept(b, EMPTY_DRAFT, [], None if taps is None else taps[b, :count])
        loop.stats[b].record_plain(count)
        row_steps += count
    return steps, row_steps, statistics.median(step_s[1:] or step_s)


EMPTY_DRAFT = DraftTree.empty()


def accept(
    drafter: Drafter, row: int, proposed: DraftTree, settled: Settled, taps: np.ndarray | None
) -> None:
    """Tells the drafter what its row kept.

    Nodes of its own tree (a kept prefix has the same indices) or, where the path ran through
    carried tokens it did not draft, only the taps (its catch-up, as after a plain stretch).
    """
    if settled.drafted is None:
        drafter.accept(row, EMPTY_DRAFT, [], taps)
    else:
        drafter.accept(row, proposed, settled.drafted, taps)
