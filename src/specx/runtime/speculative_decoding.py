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
from dataclasses import replace

import numpy as np

from specx.errors import GenerationError
from specx.runtime.calibrated import row_exact
from specx.runtime.controller import Controller
from specx.runtime.decoder_backend import DecoderBackend
from specx.runtime.drafters.base import Drafter, prepare_drafter
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
from specx.runtime.trees import TreeError
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
    loop = LoopState(target, drafter, cache, histories, emitted, active, sampling, rng, coin,
                     eos, max_new_tokens, stats, sink, verifier, observer, controller,
                     carries)  # fmt: skip
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
            forwards += idle_stretch(loop, controller, idle, progress)
            verify_s += time.perf_counter() - tick
            continue
        sizes = None if controller is None else controller.sizes(active)
        drafting = active if sizes is None else active & (sizes > 0)
        if controller is not None and not drafting.any():
            # Every row chose not to draft: where they idle on, this round opens the stretch.
            idle = controller.idle_rounds(active)
            if idle:
                forwards += idle_stretch(loop, controller, 1 + idle, progress, sized=True)
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
        trees = arranged(loop, drafts)
        tock = time.perf_counter()
        if trees is None:
            # No row drafts (the controller's choice, or no n-gram match anywhere): a decode
            # step, through the target's bound buffers rather than a one-token verify.
            width = 1
            plain_round(loop, tried=drafting if drafts is not None else None)
        else:
            width = verify_round(loop, proposed or [EMPTY_DRAFT] * batch, trees)
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
