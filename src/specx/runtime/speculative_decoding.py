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

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from specx.errors import GenerationError
from specx.runtime.calibrated import row_exact
from specx.runtime.controller import Controller
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
from specx.runtime.rounds import (
    EMPTY_DRAFT,
    LoopState,
    RoundObserver,
    Verifier,
    arranged,
    idle_stretch,
    plain_round,
    verify_round,
)
from specx.runtime.sampling import SamplingParams, next_tokens
from specx.runtime.targets.base import DecoderBackend
from specx.runtime.trees import DraftTree, TreeError
from specx.runtime.verification import RandomCoin, verify

__all__ = ["RoundObserver", "Verifier", "generate_speculative", "scratch_of"]


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
    _check_drafter(target, drafter)
    needed = check_prompts(
        prompts, max_new_tokens, target.capacity, target.vocab_size, scratch_of(drafter)
    )
    rng = np.random.default_rng(sampling.seed)
    cache = target.allocate_cache(len(prompts), needed)
    started = time.perf_counter()
    first = _prefill(target, drafter, cache, prompts, needed, sampling, rng)
    prefill_s = time.perf_counter() - started
    emitted = [[int(t)] for t in first]
    loop = LoopState(
        target, drafter, cache, [list(p) + e for p, e in zip(prompts, emitted, strict=True)],
        emitted, _first_active(emitted, set(eos_token_ids), max_new_tokens, sink), sampling,
        rng, RandomCoin(rng), set(eos_token_ids), max_new_tokens,
        [AcceptanceStats() for _ in prompts], sink, verifier, observer, controller,
        # Rows' provisional tokens (`specx.runtime.spine`), where only the spine is exact.
        [[] for _ in prompts] if sampling.greedy and row_exact(target.manifest) else None,
    )  # fmt: skip
    clock = _Clock()
    if controller is not None:
        controller.start(len(prompts), drafter.max_nodes)
    while loop.active.any():
        _play_round(loop, clock, progress)
    return _result(loop, clock, prompts, prefill_s, time.perf_counter() - started)


@dataclass
class _Clock:
    """Where a request's decoding time went (its stats, and the controller's prices)."""

    draft_s: float = 0.0
    draft_prefill_s: float = 0.0  # the drafter's deferred prefill (`prepare_drafter`)
    verify_s: float = 0.0  # verify forwards, plain steps and stretches
    forwards: int = 0
    prepared: bool = False  # the deferred prefill ran


def _check_drafter(target: DecoderBackend, drafter: Drafter) -> None:
    """The drafter fits the artifact: its trees in the verify width, its taps exported."""
    if drafter.max_nodes + 1 > target.max_tree_tokens:
        raise TreeError(
            f"the {drafter.name} drafter proposes up to {drafter.max_nodes} nodes; with the root "
            f"that exceeds the {target.max_tree_tokens} verify tokens the artifact was exported "
            "for (--max-tree-tokens)"
        )
    if drafter.taps != "none" and target.taps != drafter.taps:
        raise GenerationError(
            f"the {drafter.name} drafter reads the target's {drafter.taps!r} hidden states, but "
            f"{target.manifest.root} was exported with --taps {target.taps}"
        )


def _prefill(
    target: DecoderBackend,
    drafter: Drafter,
    cache: KVCache,
    prompts: Sequence[Sequence[int]],
    needed: int,
    sampling: SamplingParams,
    rng: np.random.Generator,
) -> np.ndarray:
    """Runs the prompts, starts the drafter on them (with their taps); the first tokens [B]."""
    logits, output = prefill(target, cache, prompts)
    prompt_taps = None
    if drafter.taps != "none":
        prompt_taps = [output.taps[b, : len(p)] for b, p in enumerate(prompts)]
    drafter.start(prompts, needed, prompt_taps)
    return next_tokens(logits, sampling, rng)


def _first_active(
    emitted: list[list[int]], eos: set[int], max_new_tokens: int, sink: TokenSink | None
) -> np.ndarray:
    """Rows [B] that decode on after their first token (not eos, budget left, the sink agrees)."""
    active = np.array([not (e[-1] in eos or max_new_tokens <= 1) for e in emitted])
    if sink is not None:
        active &= [sink(b, list(e)) for b, e in enumerate(emitted)]
    return active


def _play_round(loop: LoopState, clock: _Clock, progress: Progress | None) -> None:
    """Plays one round: a stretch, a verify forward or a plain step.

    A stretch where the controller knows no row will draft; else every row's draft verified
    in one forward, or a plain step where no row drafted (or the drafter found nothing).
    """
    tick = time.perf_counter()
    controller, sizes = loop.controller, None
    if controller is not None:
        idle, sized = controller.idle_rounds(loop.active), False
        if not idle:
            sizes = controller.sizes(loop.active)
            if not (loop.active & (sizes > 0)).any():
                # Every row chose not to draft: where they idle on, this round opens the stretch.
                more = controller.idle_rounds(loop.active)
                idle, sized = (1 + more, True) if more else (0, False)
        if idle:
            clock.forwards += idle_stretch(loop, controller, idle, progress, sized=sized)
            clock.verify_s += time.perf_counter() - tick
            return
    drafting = loop.active if sizes is None else loop.active & (sizes > 0)
    if drafting.any() and not clock.prepared:  # once, and not this round's drafting cost
        spent, clock.prepared = prepare_drafter(loop.drafter, loop.histories), True
        clock.draft_prefill_s += spent
        tick += spent
    proposed, drafts = _propose(loop, drafting, sizes)
    trees = arranged(loop, drafts)
    tock = time.perf_counter()
    if trees is None:
        # No row drafts (the controller's choice, or no n-gram match anywhere): a decode
        # step, through the target's bound buffers rather than a one-token verify.
        width = 1
        plain_round(loop, tried=drafting if drafts is not None else None)
    else:
        width = verify_round(loop, proposed or [EMPTY_DRAFT] * len(loop.active), trees)
    verified = time.perf_counter()
    clock.draft_s += tock - tick
    clock.verify_s += verified - tock
    clock.forwards += 1
    if controller is not None:
        controller.timed(width, verified - tock, tock - tick)
    if progress is not None:
        progress(sum(len(e) for e in loop.emitted), int((~loop.active).sum()))


def _propose(
    loop: LoopState, drafting: np.ndarray, sizes: np.ndarray | None
) -> tuple[list[DraftTree] | None, list[DraftTree] | None]:
    """The drafter's trees for the `drafting` rows [B], and what the controller kept of them.

    Both None where no row drafts; without a controller a drafter may take no budget.
    """
    if not drafting.any():
        return None, None
    drafter, controller = loop.drafter, loop.controller
    if controller is None or sizes is None:
        proposed = drafter.propose(loop.histories, drafting, loop.sampling, loop.rng)
        return proposed, proposed
    budget = int(sizes.max())
    proposed = drafter.propose(loop.histories, drafting, loop.sampling, loop.rng, budget=budget)
    return proposed, controller.keep(proposed)


def _result(
    loop: LoopState,
    clock: _Clock,
    prompts: Sequence[Sequence[int]],
    prefill_s: float,
    total_s: float,
) -> GenerationResult:
    """The tokens (each row's budget at most) and the run's stats."""
    tokens_out = [e[: loop.max_new_tokens] for e in loop.emitted]
    controller = loop.controller
    speculative = SpeculativeStats(
        drafter=loop.drafter.name,
        draft_s=clock.draft_s,
        draft_prefill_s=clock.draft_prefill_s,
        verify_s=clock.verify_s,
        acceptance=AcceptanceStats.merge(loop.stats).summary(),
        # the controller's summary, typed at the loop's boundary
        controller=None if controller is None else controller.summary(),
        per_request=tuple(s.summary() for s in loop.stats),
    )
    run = RunStats.measure(prompts, tokens_out, prefill_s, total_s, clock.forwards, speculative)
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
