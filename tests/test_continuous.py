"""Continuous batching: sequences joining and leaving a running batch between rounds."""

from __future__ import annotations

import numpy as np

from specx.artifact import load_manifest
from specx.runtime.continuous import BatchSequence, ContinuousBatch
from specx.runtime.controller import controller_for
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.sampling import SamplingParams
from specx.runtime.targets.ort import OrtTarget


def _sequence(prompt, tokens, drafter=None, controller=None):
    return BatchSequence(
        prompt, tokens, SamplingParams(), frozenset(), lambda _r, _t: True, drafter, controller
    )


def test_joining_sequences_decode_as_alone(artifacts):
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    prompts = [[5, 9, 5, 9, 5, 9, 13], [7, 3, 11], [2, 4, 6, 8, 2, 4], [1, 2, 3], [9, 9, 9]]
    expected = [generate_plain(target, [p], 20).tokens[0] for p in prompts]
    batch = ContinuousBatch(target, 3)
    options = DrafterOptions()
    drafters = [make_drafter(d, target, options) for d in ["ngram", "suffix"] * 2 + ["ngram"]]
    waiting = [  # suffix trimmed by its confidence (row 1), n-gram sized ahead (row 4)
        _sequence(p, 20, drafter, controller_for(drafter) if i in (1, 4) else None)
        for i, (p, drafter) in enumerate(zip(prompts, drafters, strict=True))
    ]
    waiting[3].drafter = waiting[3].controller = None  # a plain sequence among them
    sequences = list(waiting)
    while waiting or batch.running:
        while waiting and batch.free:
            batch.admit(waiting.pop(0))
        batch.step()
    assert [s.emitted for s in sequences] == expected


def test_a_wide_draft_never_pushes_a_full_row_past_its_cache(artifacts):
    """A plain row near its cache's end rides along with a 16-node suffix draft."""
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    capacity = target.capacity
    prompt = list(range(1, 11))
    tokens = capacity - len(prompt) + 1  # fills the cache exactly: no scratch reserved
    batch = ContinuousBatch(target, 2)
    full = _sequence(prompt, tokens)
    batch.admit(full)
    while int(batch.cache.lengths[0]) < capacity - 8:
        batch.step()
    suffix = make_drafter("suffix", target, DrafterOptions())
    wide = _sequence([5, 9] * 8, 20, suffix)  # repetitive: suffix drafts wide trees
    batch.admit(wide)
    while batch.running:
        batch.step()  # before the cap: "overflows the KV cache"
    assert full.emitted == generate_plain(target, [prompt], tokens).tokens[0]
    assert wide.emitted == generate_plain(target, [[5, 9] * 8], 20).tokens[0]


def test_a_prompt_prefilled_in_chunks_joins_between_rounds_and_decodes_as_alone(artifacts):
    """A 40-token prompt fed 8 tokens between rounds, in the lowest slot: the rows above it
    keep emitting while it is fed (their rounds ride over its slot without spoiling what it
    has fed), and every sequence decodes what it decodes alone."""
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    long = np.random.default_rng(5).integers(1, 400, 40).tolist()
    prompts = [long, [5, 9, 5, 9, 5, 9, 13], [7, 3, 11, 7, 3]]
    expected = [generate_plain(target, [p], 24).tokens[0] for p in prompts]
    batch = ContinuousBatch(target, 3)
    late = _sequence(long, 24, make_drafter("ngram", target, DrafterOptions()))
    first = _sequence(prompts[1], 24)  # plain: one token a round
    second = _sequence(prompts[2], 24, make_drafter("suffix", target, DrafterOptions()))
    assert batch.admit(late, chunked=True) == 0
    assert batch.prefilling == 1 and batch.free == 2 and not late.emitted
    batch.admit(first)
    batch.admit(second, chunked=True)  # waits for the long one: prompts go in arrival order
    emitted_while_fed = []
    while batch.prefilling:
        before = len(first.emitted)
        assert batch.prefill(8) == []
        batch.step()
        emitted_while_fed.append(len(first.emitted) - before)
    assert emitted_while_fed == [1] * 6  # 5 chunks of the long prompt, then the short one
    while batch.running:
        batch.step()
    assert [s.emitted for s in (late, first, second)] == expected


def test_an_engine_batch_pools_each_drafter_back_whatever_ends_its_sequence(artifacts):
    """The server's door (`Engine.continuous_batch`): drafters come from the plan's pool and
    go back when a sequence finishes, fails to fit, or is evicted; outputs stay plain's."""
    import specx
    from specx.errors import GenerationError
    from specx.runtime.speculation import Speculation

    engine = specx.load(artifacts["llama"], threads=2)
    plan = engine.plan(Speculation("ngram"), SamplingParams())
    idle = engine.plans.state(plan).idle
    batch = engine.continuous_batch(2)
    prompts = [[5, 9, 5, 9, 5, 9, 13], [7, 3, 11]]
    expected = [generate_plain(engine.target, [p], 12).tokens[0] for p in prompts]
    admitted = [batch.admit(p, 12, SamplingParams(), frozenset(), lambda _r, _t: True, plan)
                for p in prompts]  # fmt: skip
    assert not idle  # both drafters in use
    while batch.running:
        batch.step()
    assert [s.emitted for _, s in admitted] == expected
    assert len(idle) == 2  # both back, one per sequence

    too_long = list(range(1, engine.capacity + 1))
    try:
        batch.admit(too_long, 8, SamplingParams(), frozenset(), lambda _r, _t: True, plan)
    except GenerationError:
        pass
    else:
        raise AssertionError("a prompt past the cache was admitted")
    assert len(idle) == 2  # the refused request's drafter went back

    slot, sequence = batch.admit(prompts[0], 12, SamplingParams(), frozenset(),
                                 lambda _r, _t: True, plan)  # fmt: skip
    assert len(idle) == 1
    batch.evict(slot, sequence)
    batch.release(sequence)  # a second release gives nothing back twice
    assert len(idle) == 2 and batch.running == 0
