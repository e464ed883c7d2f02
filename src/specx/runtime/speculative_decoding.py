"""The speculative loop: propose, verify the whole tree in one target forward, compact, emit.

For every sequence of the batch, each round:
1. the drafter proposes a tree hanging off the root (the last emitted token);
2. the target runs [root, draft nodes] in one forward with a tree mask, writing their
   KV rows right after the sequence's prefix;
3. verification (`specx.runtime.verification`) accepts a root-to-leaf path and draws
   one more token, so the output distribution is exactly the target's;
4. the accepted path's KV rows are moved next to the prefix (rejected rows become
   stale slots past the sequence length) and the drafter is told what was accepted.

Greedy decoding on a build whose identity rests on row invariance (quantized builds) verifies
every tree spine first and decides only on exact logits (`specx.runtime.spine`): tokens a
round accepted off the spine are carried into the next round's tree and verified there.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from specx.errors import GenerationError
from specx.runtime.calibrated import row_exact
from specx.runtime.controller import Controller, Replay, Stretch
from specx.runtime.decoder_backend import DecoderBackend
from specx.runtime.drafters.base import Drafter, prepare_drafter
from specx.runtime.kv_cache import KVCache
from specx.runtime.metrics import AcceptanceStats, RunStats, SpeculativeStats
from specx.runtime.plain_decoding import (
    GenerationResult,
    Progress,
    TokenSink,
    check_prompts,
    generate_plain,
    prefill,
)
from specx.runtime.sampling import SamplingParams, next_tokens, sampling_probs
from specx.runtime.spine import Arranged, Settled, arrange, settle
from specx.runtime.trees import (
    DraftTree,
    TreeError,
    ancestor_mask,
    depths,
    validate_parents,
    verify_parents,
)
from specx.runtime.verification import Coin, RandomCoin, Verdict, verify

__all__ = [
    "EMPTY_DRAFT",
    "accept",
    "RoundObserver",
    "Verifier",
    "depth_of",
    "generate_speculative",
    "scratch_of",
    "verify_inputs",
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


def generate_speculative(
    target: DecoderBackend,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_ids: Sequence[int] = (),
    max_batch_spec: int | None = None,
    verifier: Verifier = verify,
    observer: RoundObserver | None = None,
    progress: Progress | None = None,
    controller: Controller | None = None,
    sink: TokenSink | None = None,
) -> GenerationResult:
    """Decodes speculatively; output equals `generate_plain`'s (greedy: token for token).

    Batches larger than `max_batch_spec` fall back to plain decoding, where verifying
    trees no longer pays off. `observer(row, draft, verdict)` sees every verified draft
    (calibration records which nodes were accepted); a round where no row has a draft is a
    plain step and verifies none. A `controller` (`specx.runtime.controller`) sizes each
    row's draft each round, down to none; without one every row keeps its whole draft.
    `sink` gets each row's tokens per round as they are verified (streaming) and may end a
    row.
    """
    sampling = sampling or SamplingParams()
    if max_batch_spec is not None and len(prompts) > max_batch_spec:
        result = generate_plain(
            target, prompts, max_new_tokens, sampling, eos_token_ids, progress, sink
        )
        off = f"off: batch {len(prompts)} > max_batch_spec {max_batch_spec}"
        return replace(result, stats=replace(result.stats, speculation_off=off))
    if drafter.max_nodes + 1 > target.max_tree_tokens:
        raise TreeError(
            f"the {drafter.name} drafter proposes up to {drafter.max_nodes} nodes; with the root "
            f"that exceeds the {target.max_tree_tokens} verify tokens the artifact was exported "
            "for (--max-tree-tokens)"
        )
    scratch = scratch_of(drafter)
    needed = check_prompts(prompts, max_new_tokens, target.capacity, target.vocab_size, scratch)
    rng = np.random.default_rng(sampling.seed)
    coin = RandomCoin(rng)
    eos = set(eos_token_ids)
    batch = len(prompts)
    cache = target.allocate_cache(batch, needed)
    if drafter.taps != "none" and target.taps != drafter.taps:
        raise GenerationError(
            f"the {drafter.name} drafter reads the target's {drafter.taps!r} hidden states, but "
            f"{target.manifest.root} was exported with --taps {target.taps}"
        )
    stats = [AcceptanceStats() for _ in range(batch)]

    started = time.perf_counter()
    logits, output = prefill(target, cache, prompts)
    prompt_taps = None
    if drafter.taps != "none":
        prompt_taps = [output.taps[b, : len(p)] for b, p in enumerate(prompts)]
    drafter.start(prompts, needed, prompt_taps)
    first = next_tokens(logits, sampling, rng)
    prefill_s = time.perf_counter() - started
    emitted = [[int(t)] for t in first]
    histories = [list(p) + e for p, e in zip(prompts, emitted, strict=True)]
    active = np.array([not (e[-1] in eos or max_new_tokens <= 1) for e in emitted])
    if sink is not None:
        active &= [sink(b, list(e)) for b, e in enumerate(emitted)]
    # Rows' provisional tokens (`specx.runtime.spine`), where only the spine is exact.
    carries: list[list[int]] | None = None
    if sampling.greedy and row_exact(target.manifest):
        carries = [[] for _ in range(batch)]
    loop = _Loop(target, drafter, cache, histories, emitted, active, sampling, rng, coin, eos,
                 max_new_tokens, stats, sink, verifier, observer, controller, carries)  # fmt: skip
    draft_s = draft_prefill_s = verify_s = 0.0
    forwards = 0
    prepared = False  # the drafter's deferred prefill ran (`prepare_drafter`)
    if controller is not None:
        controller.start(batch, drafter.max_nodes)
    while active.any():
        tick = time.perf_counter()
        idle = 0 if controller is None else controller.idle_rounds(active)
        if idle:
            assert controller is not None  # idle rounds are a controller's choice
            forwards += _idle_stretch(loop, controller, idle, progress)
            verify_s += time.perf_counter() - tick
            continue
        sizes = None if controller is None else controller.sizes(active)
        drafting = active if sizes is None else active & (sizes > 0)
        if controller is not None and not drafting.any():
            # Every row chose not to draft: where they idle on, this round opens the stretch.
            idle = controller.idle_rounds(active)
            if idle:
                forwards += _idle_stretch(loop, controller, 1 + idle, progress, sized=True)
                verify_s += time.perf_counter() - tick
                continue
        proposed = drafts = None
        if drafting.any():
            if not prepared:  # once, and not this round's drafting cost
                spent, prepared = prepare_drafter(drafter, histories), True
                draft_prefill_s += spent
                tick += spent
            if controller is None or sizes is None:  # no controller: a drafter may take no budget
                proposed = drafts = drafter.propose(histories, drafting, sampling, rng)
            else:
                budget = int(sizes.max())
                proposed = drafter.propose(histories, drafting, sampling, rng, budget=budget)
                drafts = controller.keep(proposed)
        arranged = _arranged(loop, drafts)
        tock = time.perf_counter()
        if arranged is None:
            # No row drafts (the controller's choice, or no n-gram match anywhere): a decode
            # step, through the target's bound buffers rather than a one-token verify.
            width = 1
            _plain_round(loop, tried=drafting if drafts is not None else None)
        else:
            width = _verify_round(loop, proposed or [EMPTY_DRAFT] * batch, arranged)
        verified = time.perf_counter()
        draft_s += tock - tick
        verify_s += verified - tock
        forwards += 1
        if controller is not None:
            controller.timed(width, verified - tock, tock - tick)
        if progress is not None:
            progress(sum(len(e) for e in emitted), int((~active).sum()))
    total_s = time.perf_counter() - started
    tokens_out = [e[:max_new_tokens] for e in emitted]
    speculative = SpeculativeStats(
        drafter=drafter.name,
        draft_s=draft_s,
        draft_prefill_s=draft_prefill_s,
        verify_s=verify_s,
        acceptance=AcceptanceStats.merge(stats).summary(),
        # the controller's summary, typed at the loop's boundary
        controller=None if controller is None else controller.summary(),
        per_request=tuple(s.summary() for s in stats),
    )
    run = RunStats.measure(prompts, tokens_out, prefill_s, total_s, forwards, speculative)
    return GenerationResult(tokens_out, run)


def scratch_of(drafter: Drafter | None) -> int:
    """KV slots a drafter needs past a sequence's history (0 without one).

    The verify forward's root + nodes, or the drafter's own tree rows; + 1 because a
    finished sequence's history holds its last token too while its row still rides along
    in the drafter's batch.
    """
    if drafter is None:
        return 0
    return max(drafter.max_nodes + 1, drafter.scratch_slots + 1)


@dataclass(frozen=True)
class _Loop:
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


def _arranged(loop: _Loop, drafts: list[DraftTree] | None) -> list[Arranged] | None:
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


def _verify_round(loop: _Loop, proposed: list[DraftTree], arranged: list[Arranged]) -> int:
    """Verifies every row's tree in one target forward; returns the forward's width."""
    target, cache, active = loop.target, loop.cache, loop.active
    roots = np.array([h[-1] for h in loop.histories], dtype=np.int64)
    # Finished sequences still ride along in the batch; their rows go to slot 0 on.
    lengths = np.where(active, cache.lengths, 0)
    trees = [a.tree for a in arranged]
    input_ids, positions, mask = verify_inputs(roots, trees, lengths, target.vocab_size)
    output = target.forward(cache, input_ids, positions, mask, lengths)
    greedy = loop.sampling.greedy
    for b in np.flatnonzero(active).tolist():
        tree, draft = trees[b], arranged[b].draft
        logits = output.logits[b, : 1 + len(tree)]
        # Only the verify tokens of this row, never the padding, go through the transform.
        probs = logits if greedy else sampling_probs(logits, loop.sampling)
        settled = settle(
            loop.verifier(probs, tree, loop.coin, greedy), arranged[b], loop.carries is not None
        )
        verdict = settled.verdict
        if loop.observer is not None:  # what the drafter's own draft achieved
            loop.observer(int(b), draft, Verdict(settled.judged, verdict.next_token))
        if loop.carries is not None:
            loop.carries[b] = settled.carry
        path = np.array([0] + [i + 1 for i in verdict.accepted])
        cache.keep_path(b, int(lengths[b]), path)
        cache.lengths[b] = lengths[b] + len(path)
        path_taps = None if output.taps is None else output.taps[b, path]
        accept(loop.drafter, b, proposed[b], settled, path_taps)
        count = loop.emit(b, verdict.emitted(tree))
        # Accepted tokens cut off by eos or the token budget are not counted.
        loop.stats[b].record(depth_of(tree), min(len(verdict.accepted), count - 1))
        if loop.controller is not None:
            loop.controller.observe(int(b), depth_of(draft), settled.judged)
    return input_ids.shape[1]


# A probe's cost is paid at once (a wider forward, and the slower step after it) and all it
# can buy is the rounds left: a stretch that would end with fewer tokens left than this runs
# to the request's end instead (benchmarks/README.md, controller.py).
PROBE_TAIL = 8


def _past_a_late_probe(loop: _Loop, idle: int) -> int:
    """The stretch's rounds: `idle`, or to the end where the round after it comes too late."""
    left = loop.max_new_tokens - min(len(loop.emitted[b]) for b in np.flatnonzero(loop.active))
    return left if left - idle < PROBE_TAIL else idle


def _idle_stretch(
    loop: _Loop,
    controller: Controller,
    rounds: int,
    progress: Progress | None,
    sized: bool = False,
) -> int:
    """Plays `rounds` rounds in which no row drafts (`_plain_stretch`); returns the steps.

    The controller hears of them (`idled`); `sized`: its `sizes` counted the first already.
    """
    counted = int(sized)
    starts = {b: len(loop.histories[b]) for b in np.flatnonzero(loop.active).tolist()}
    steps, row_steps, step_s = _plain_stretch(loop, _past_a_late_probe(loop, rounds), progress)
    replay = _replayer(loop, starts)
    controller.idled(Stretch(steps - counted, row_steps - counted * len(starts), step_s, replay))
    return steps


# Steps of a stretch at which the drafter is replayed, per row: the last ones, nearest the
# next decision. A replay costs a proposal (suffix drafting ~35 us, n-gram ~5 us, against a
# plain step of ~700 us on pyref-7m); stretches grow while drafts do not pay.
REPLAYS = 4


def _replayer(loop: _Loop, starts: dict[int, int]) -> Callable[[int], tuple[Replay, ...]]:
    """Replays a row's drafter at the last steps of a stretch, judged by what followed.

    `starts[b]`: row b's history length when the stretch began (rows absent did not play
    it). () where the drafter cannot replay (`Drafter.replay`) or no row decodes on.
    """
    replay = getattr(loop.drafter, "replay", None)

    def replayed(b: int) -> tuple[Replay, ...]:
        if replay is None or b not in starts or not loop.active.any():
            return ()
        history = loop.histories[b]
        positions = range(max(starts[b], len(history) - REPLAYS), len(history))
        return tuple(Replay.of(d, history[t:]) for t, d in replay(b, history, positions))

    return replayed


def _plain_round(loop: _Loop, tried: np.ndarray | None = None) -> None:
    """One decoding step for every row, drafts left out.

    Emits what an empty draft's verification would (the target's argmax, or a token drawn
    from its distribution) without the verification machinery. `tried` [B]: rows whose
    drafter was asked and found nothing; their controller learns that, as from a verify.
    """
    _plain_stretch(loop, 1, None)
    if tried is not None and loop.controller is not None:
        for b in np.flatnonzero(tried).tolist():
            loop.controller.observe(int(b), 0, [])


def _plain_stretch(loop: _Loop, rounds: int, progress: Progress | None) -> tuple[int, int, float]:
    """Up to `rounds` decoding steps in which no row drafts.

    Plain decoding's own loop (`generate_plain`): a request or batch that does not
    speculate must not pay for the speculative round's bookkeeping (what that cost:
    benchmarks/README.md, controller.py). The drafter hears of the stretch once, at its
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
    rows = np.array(started, dtype=np.int64)
    roots = np.array([h[-1] for h in loop.histories], dtype=np.int64)
    taps: np.ndarray | None = None  # [B, rounds, W], when the target exports taps
    steps, step_s, last_s = 0, [], time.perf_counter()
    while steps < rounds and rows.size:
        output = target.decode_step(cache, roots, np.where(active, cache.lengths, 0))
        roots = next_tokens(output.logits[:, 0], sampling, loop.rng)
        if output.taps is not None:
            if taps is None:
                taps = np.empty((len(active), rounds, output.taps.shape[-1]), np.float32)
            taps[:, steps] = output.taps[:, 0]  # the next step overwrites the bound output
        cache.lengths[rows] += 1
        for b in rows.tolist():
            loop.emit(b, [int(roots[b])])
        steps += 1
        now = time.perf_counter()
        step_s.append(now - last_s)
        last_s = now
        if progress is not None:
            progress(sum(len(e) for e in loop.emitted), int((~active).sum()))
        rows = np.flatnonzero(active)
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


def depth_of(draft: DraftTree) -> int:
    """Levels of a draft tree (0 for an empty draft)."""
    return int(depths(draft.parents).max()) + 1 if len(draft) else 0
