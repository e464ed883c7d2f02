"""Per-round draft sizes: lossless whatever they are, and chosen from acceptance and cost."""

from __future__ import annotations

import itertools
import math
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from conftest import HEAD_VOCAB
from cost_curves import FixedCurve
from no_replay import NoReplay
from specx.artifact import load_manifest, manifest_body, write_manifest
from specx.manifest_types import CalibratedSampling, CalibrationEntry, TreeChoice, VerifyShape
from specx.runtime.controller import (
    AcceptanceMemory,
    AdaptiveController,
    AskingMemory,
    ConfidenceController,
    FixedSizes,
    RoundCosts,
    Schedule,
    Stretch,
    Trial,
    controller_for,
    replayed_guess,
    replays,
    truncated,
)
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.drafters.draft_model import DraftModelDrafter
from specx.runtime.drafters.ngram import NGramDrafter
from specx.runtime.drafters.suffix import SuffixDrafter, SuffixOptions
from specx.runtime.engine import Speculation, load
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.plans import ASKING_SETTINGS, PlanState, time_drafter
from specx.runtime.rounds import PROBE_TAIL
from specx.runtime.sampling import SamplingParams
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets import build_name
from specx.runtime.targets.ort import OrtTarget
from specx.runtime.tree_shapes import DynamicTree, StaticTree, parse_tree_spec
from specx.runtime.trees import DraftTree

SWITCHING = [0, 3, 1, 0, 0, 0, 5, 2, 8]  # sizes change every round; none, and idle stretches


def loopy(rng, vocab, count):
    span = [rng.integers(1, vocab, 5).tolist() for _ in range(count)]
    return [rng.integers(1, vocab, 4).tolist() + s * 3 for s in span]


def assert_switching_equals_plain(target, make, prompts, batches=(1, 3), tokens=30):
    for batch in batches:
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            controller = FixedSizes(SWITCHING)
            spec = generate_speculative(target, make(), chunk, tokens, controller=controller)
            assert spec.tokens == generate_plain(target, chunk, tokens).tokens
            assert spec.stats.speculative.controller.sizes_chosen.keys() >= {0, 3}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_model_free_drafters_switching_sizes_equal_plain(family, artifacts, rng):
    target = OrtTarget(load_manifest(artifacts[family]), threads=2)
    prompts = loopy(rng, target.vocab_size, 3)
    assert_switching_equals_plain(target, lambda: NGramDrafter(8, max_matches=3), prompts)
    assert_switching_equals_plain(target, lambda: SuffixDrafter(SuffixOptions(8)), prompts)


def test_a_row_that_ends_inside_a_stretch_leaves_the_others_decoding_as_plain(artifacts, rng):
    """A sink ends row 1 at its 7th token, inside the stretch: the rows left decode on."""
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    prompts = loopy(rng, target.vocab_size, 3)

    def ending_row_1() -> Callable[[int, list[int]], bool]:
        seen: Counter = Counter()

        def sink(row: int, tokens: list[int]) -> bool:
            seen[row] += len(tokens)
            return not (row == 1 and seen[row] >= 7)

        return sink

    plain = generate_plain(target, prompts, 40, sink=ending_row_1())
    idle_first = FixedSizes([0] * 12 + [3])  # a stretch of 12 rounds, then drafts of 3
    spec = generate_speculative(
        target, NGramDrafter(5), prompts, 40, controller=idle_first, sink=ending_row_1()
    )
    assert spec.tokens == plain.tokens and len(spec.tokens[1]) == 7 < len(spec.tokens[0])


def test_a_stretch_that_would_end_just_before_the_budget_runs_to_it(artifacts, rng):
    """A probe that late cannot pay for itself: the request plays out plainly."""
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    for rows in (1, 2):  # a batch's probe costs every row: it needs a row's tail per row
        prompts, tail = loopy(rng, target.vocab_size, rows), PROBE_TAIL * rows
        for tokens, late in ((1 + 12 + tail - 1, True), (1 + 12 + tail, False)):
            controller = FixedSizes([0] * 12 + [4] * 40)  # 12 rounds idle, then drafts of 4
            spec = generate_speculative(
                target, NGramDrafter(8), prompts, tokens, controller=controller
            )
            assert spec.tokens == generate_plain(target, prompts, tokens).tokens
            assert (4 not in spec.stats.speculative.controller.sizes_chosen) == late


def test_a_draft_model_switching_sizes_equals_plain(artifacts, draft_artifacts, rng):
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    draft = OrtTarget(load_manifest(draft_artifacts["llama"]), threads=2)
    prompts = [rng.integers(1, target.vocab_size, n).tolist() for n in (5, 9, 3)]
    for shape in (StaticTree.chain(5), StaticTree.from_choices([[0], [1], [0, 0], [1, 0]])):
        assert_switching_equals_plain(target, lambda s=shape: DraftModelDrafter(draft, s), prompts)
    assert_switching_equals_plain(
        target,
        lambda: DraftModelDrafter(draft, DynamicTree.of_nodes(8, 3, 2)),
        prompts,
        batches=(3,),
    )


@pytest.mark.parametrize("name", ["eagle3", "eagle", "mtp-deepseek", "medusa"])
def test_heads_switching_sizes_equal_plain(name, head_artifacts, rng):
    target = OrtTarget(load_manifest(head_artifacts[name]), threads=2)
    prompts = [rng.integers(1, HEAD_VOCAB, n).tolist() for n in (3, 8, 5)]
    trees = ["chain:4"] if name == "medusa" else ["chain:4", "dynamic:9,2,3"]
    for tree in trees:
        options = DrafterOptions(tree=parse_tree_spec(tree))
        make = lambda options=options: make_drafter(name.split("-")[0], target, options)  # noqa: E731
        assert_switching_equals_plain(target, make, prompts)


def test_a_kept_prefix_is_a_tree_with_its_rows():
    probs = np.eye(4)[[1, 2, 3, 0, 1]]
    draft = DraftTree(np.arange(5), np.array([-1, 0, -1, 1, 2]), probs, np.linspace(0, 1, 5))
    kept = truncated(draft, 3)
    assert kept.parents.tolist() == [-1, 0, -1] and kept.tokens.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(kept.probs, probs[:3])
    assert truncated(draft, 9) is draft and len(truncated(draft, 0)) == 0


def rounds(controller, accepted_at, count: int, width_cost=0.1) -> list[int]:
    """Runs `count` rounds of one sequence; `accepted_at()` is how deep its drafts hold."""
    chosen = []
    for _ in range(count):
        (size,) = controller.sizes(np.array([True]))
        chosen.append(int(size))
        depth = accepted_at() if callable(accepted_at) else accepted_at
        controller.observe(0, size, list(range(min(depth, size))))
        controller.timed(1 + size, 1.0 + width_cost * size, 0.2 if size else 0.0)
    return chosen


def test_the_controller_backs_off_probes_and_comes_back():
    controller = AdaptiveController(schedule=Schedule(probe_every=4, max_probe_every=16))
    controller.start(1, 8)
    chosen = rounds(controller, accepted_at=0, count=60)
    assert chosen[0] == 0 and chosen[1] > 0  # a plain step first, then the prior's draft
    first_off = chosen.index(0, 1)
    probes = [i for i, size in enumerate(chosen) if size and i > first_off]
    gaps = np.diff(probes).tolist()
    # A probe's round, then `max_probe_every` idle rounds (a row alone: not on a multiple).
    assert chosen[-10:].count(0) >= 9 and min(gaps) >= 4 and gaps[-1] == 1 + 16
    # The sequence becomes predictable: the next probe finds it and speculation returns.
    chosen = rounds(controller, accepted_at=8, count=40)
    assert chosen[-4:] == [8] * 4


def test_a_request_pays_a_drafters_prefill_only_where_its_rest_repays_it_twice():
    """A head's prefill is paid before its first draft, however that draft fares."""

    def first(prefill_s: float) -> tuple[AdaptiveController, list[int]]:
        controller = AdaptiveController(trial=Trial(prefill_s, rounds=64, step_s=0.1))
        controller.start(1, 4)
        one = np.array([True])
        controller.idled(
            Stretch(controller.idle_rounds(one), 4, 1.0)
        )  # the plain first rounds: T(0) 1 s
        return controller, [int(controller.sizes(one)[0]) for _ in range(3)]

    # Chains of 2 at the prior's 0.5 emit 1.75 tokens in 1.3 s (a one-row draft step 0.1 s
    # a node): ~15 s saved over the 59 rounds left, worth a prefill of 7.6 s at most.
    cheap, sizes = first(7.0)
    assert sizes[0] == 1  # the first draft: one node, as without a prefill
    dear, sizes = first(8.0)
    assert sizes == [0, 0, 0]
    assert dear.idle_rounds(np.array([True])) == 64 + 1 - (dear.round + 1)  # plain to the end
    free = AdaptiveController(trial=Trial(0.0, rounds=64))  # model-free: nothing to pay
    free.start(1, 4)
    free.idled(Stretch(free.idle_rounds(np.array([True])), 4, 1.0))
    assert free.sizes(np.array([True]))[0] == 1


def test_asks_that_find_no_draft_are_priced():
    """n-gram finds no match in most rounds at T = 1: each such ask is a plain step through the
    speculative loop, dearer than a stretch's, and the rule counts it."""

    def run(finds) -> list[int]:
        controller = AdaptiveController()
        controller.start(1, 4)
        chosen = []
        for r in range(48):
            (size,) = controller.sizes(np.array([True]))
            chosen.append(int(size))
            if size and finds(r):
                controller.observe(0, size, [0])  # the first node holds, the next does not
                controller.timed(1 + size, 1.2, 0.1)
            elif size:
                controller.observe(0, 0, [])  # asked: nothing found
                controller.timed(1, 1.6, 0.1)
            else:
                controller.timed(1, 1.0, 0.0)
        return chosen

    always, seldom = run(lambda r: True), run(lambda r: r % 4 == 0)
    assert all(always[-16:])  # 2 tokens for 1.3 s beat 1 a second
    assert seldom[-16:].count(0) >= 14  # 1.25 tokens for ~1.6 s do not: it probes now and then


def test_the_controller_weighs_acceptance_against_cost():
    cheap, dear = AdaptiveController(), AdaptiveController()
    for controller in (cheap, dear):
        controller.start(1, 16)
    # Each depth holds with probability 0.7: long drafts pay only where verifying is cheap.
    rng = np.random.default_rng(0)
    depth = lambda: int(rng.geometric(0.3)) - 1  # noqa: E731
    cheap_sizes = rounds(cheap, depth, count=40, width_cost=0.01)
    dear_sizes = rounds(dear, depth, count=40, width_cost=0.6)
    usual = lambda sizes: max(set(sizes[-20:]), key=sizes[-20:].count)  # noqa: E731
    assert usual(cheap_sizes) >= 4 and usual(dear_sizes) <= 2
    assert cheap.summary().sizes_chosen and dear.summary().name == "adaptive"


def test_a_row_alone_drafts_until_a_draft_stops_paying():
    """Stopping leaves a row blind until its probe: it stops at a tie, not at a small loss."""
    controller = AdaptiveController()
    controller.start(1, 1)
    chosen = []
    for _ in range(6):
        (size,) = controller.sizes(np.array([True]))
        chosen.append(int(size))
        controller.observe(0, size, [])  # every draft rejected
        controller.timed(1 + size, 1.1 if size else 1.0, 0.2 if size else 0.0)
    # p_1 falls 0.5 -> 1/3 -> 1/4 (the prior weighs two rounds) and a one-node round costs
    # 1.3 plain steps: a draft pays while 1 + p_1 > 1.3 (at 1.33, 2.5% better, it still
    # drafts; a 5% margin would have stopped it there).
    assert chosen == [0, 1, 1, 0, 0, 0]


def test_costs_an_earlier_request_timed_spare_the_plain_first_round():
    first = AdaptiveController()
    first.start(1, 8)
    assert rounds(first, accepted_at=8, count=6)[:2] == [0, 1]  # timing a step, then a draft
    shared = AdaptiveController(costs=first.costs)
    shared.start(1, 8)
    assert rounds(shared, accepted_at=8, count=1)[0] > 1  # drafts at once, past one node
    fresh = AdaptiveController(costs=RoundCosts())
    fresh.start(1, 8)
    assert rounds(fresh, accepted_at=8, count=1) == [0]


def test_a_request_starts_from_the_acceptance_earlier_requests_found():
    """An engine's requests share what the target accepted: a request starts from it."""
    timing = AdaptiveController()
    timing.start(1, 8)
    rounds(timing, accepted_at=8, count=6)  # costs known: no plain first round from here on
    missed = AcceptanceMemory()
    first = AdaptiveController(costs=timing.costs, acceptance=missed)
    first.start(1, 8)
    rounds(first, accepted_at=0, count=12)  # every draft rejected
    # Its misses, as a row counts its first ones: the mean of the prior (0.5, weight 2) and them.
    assert missed.judged[0] >= 2 and missed.accept[0] == pytest.approx(1 / (missed.judged[0] + 2))
    second = AdaptiveController(costs=timing.costs, acceptance=missed)
    second.start(1, 8)
    assert rounds(second, accepted_at=0, count=1) == [0]  # plain from its first round
    held = AcceptanceMemory()
    for depth in itertools.chain.from_iterable(itertools.repeat(range(8), 20)):
        held.learn(depth, True)
    deep = AdaptiveController(costs=timing.costs, acceptance=held)
    deep.start(1, 8)
    assert rounds(deep, accepted_at=8, count=1) == [8]  # as deep as drafts held
    flat = AdaptiveController(costs=timing.costs)  # nothing learnt: the prior's one draft
    flat.start(1, 8)
    assert 0 < rounds(flat, accepted_at=8, count=1)[0] < 8


def test_a_batch_starts_from_the_prior_whatever_earlier_requests_found():
    """A batch is paid by its least lucky row: a mean over earlier sequences overstates it."""
    timing = AdaptiveController()
    timing.start(2, 8)
    both = np.array([True, True])
    for size in (0, 1, 2, 4):  # costs known: a plain step and drafts of 1-4 nodes timed
        timing.timed(1 + size, 1.0 + 0.1 * size, 0.2 if size else 0.0)
    held = AcceptanceMemory()
    for depth in itertools.chain.from_iterable(itertools.repeat(range(8), 20)):
        held.learn(depth, True)
    chosen = []
    for acceptance in (held, AcceptanceMemory()):
        batch = AdaptiveController(costs=timing.costs, acceptance=acceptance)
        batch.start(2, 8)
        sizes = []
        for _ in range(40):  # to the first probe and past it: drafts of 2 held, every row
            sizes.append(batch.sizes(both).tolist())
            for row in range(2):
                batch.observe(row, int(sizes[-1][row]), list(range(min(2, sizes[-1][row]))))
        chosen.append(sizes)
    assert chosen[0] == chosen[1] and any(max(s) for s in chosen[0])


def test_acceptance_memory_counts_the_first_verdicts_fully_then_moves_slowly():
    memory = AcceptanceMemory(prior=0.5, smoothing=0.05)
    memory.learn(0, False)
    assert memory.accept[0] == pytest.approx(0.5 * 2 / 3)  # a prior of weight 2
    for _ in range(40):
        memory.learn(0, False)
    low = memory.accept[0]
    memory.learn(0, True)
    assert memory.accept[0] == pytest.approx(low + 0.05 * (1 - low))
    assert memory.accept[1:] == [0.5] * 15 and memory.judged[:2] == [41 + 1, 0]
    memory.learn(16, True)  # deeper than it keeps: ignored
    assert len(memory.accept) == 16


def test_one_slow_round_does_not_price_a_width_out_for_good():
    """Shared costs outlive requests, and the rule only re-times widths it picks."""
    for rise, later_chose in ((1.5, [4] * 7 + [8] * 5), (math.inf, [4] * 12)):
        first = AdaptiveController(costs=RoundCosts(rise=rise))
        first.start(1, 8)
        assert rounds(first, accepted_at=8, count=12, width_cost=0.02)[-3:] == [8, 8, 8]
        first.costs.record(9, 20.0, 0.2)  # a stall: 17x the width's estimate
        later = AdaptiveController(costs=first.costs)
        later.start(1, 8)  # a prior 0.5 past depth 4: 8 nodes pay once depths 1-4 hold
        assert rounds(later, accepted_at=8, count=12, width_cost=0.02) == later_chose
    assert first.costs.verify(9) > 4  # unguarded (as first shared, 4de2b3d): 4x dearer
    guarded = RoundCosts()
    guarded.record(1, 1.0, 0.0)
    guarded.record(9, 20.0, 0.2)  # the stall on a width's first timing
    assert guarded.verify(9) == pytest.approx(1.5 * 1.4)  # rise x what the plain step predicts


def test_a_width_is_confirmed_by_its_second_timing_and_forgotten_when_not_timed():
    costs = RoundCosts(horizon=10)
    costs.record(1, 1.0, 0.0)
    costs.record(5, 3.0, 0.2)  # dearer than the 1.2 predicted: capped to 1.8 ...
    assert costs.verify(5) == pytest.approx(1.8)
    costs.record(5, 3.0, 0.2)  # ... the second timing replaces it, capped at 1.5x again
    assert costs.verify(5) == pytest.approx(2.7)
    costs.record(5, 2.0, 0.2)  # from the third on, smoothed
    assert costs.verify(5) == pytest.approx(2.56)
    for _ in range(6):
        costs.record(5, 2.8, 0.2)
    assert costs.known
    costs.record(5, 2.8, 0.2)  # the plain step was last timed 10 rounds ago
    assert not costs.known and costs.verify(1) == pytest.approx(costs.verify(5) / 1.2)


def test_a_stretch_of_plain_steps_prices_the_plain_step_from_then_on():
    """A lone width-1 round (after a verify, or a proposal that found nothing) costs more."""
    costs = RoundCosts()
    costs.record(1, 1.4, 0.0)  # no stretch yet: a lone plain round prices the step
    assert costs.verify(1) == pytest.approx(1.4)
    costs.record_stretch(1.0)
    costs.record(1, 1.4, 0.0)
    assert costs.verify(1) == pytest.approx(1.0)
    # Steps grow faster over a request: the latest stretch is the price, not an average.
    costs.record_stretch(0.9)
    costs.record_stretch(0.7)
    assert costs.verify(1) == pytest.approx(0.7)


def test_widths_not_timed_are_priced_on_the_builds_calibrated_curve():
    """A steep build (ONNX Runtime int4 on 2 cores) prices a wide verify dear before timing it."""
    steep = VerifyShape("ort-int4", (1, 2, 4, 8), (1.0, 1.2, 1.5, 2.3))
    costs, guessed = RoundCosts(shape=steep), RoundCosts()
    for each in (costs, guessed):
        each.record(1, 1.0, 0.0)
    assert costs.verify(8) == pytest.approx(2.3) and guessed.verify(8) == pytest.approx(1.35)
    costs.record(4, 1.8, 0.1)  # timed widths still win, the curve only extends them
    assert costs.verify(4) == 1.8 and costs.verify(8) == pytest.approx(1.8 * 2.3 / 1.5)


def test_an_engine_prices_batch_1_on_a_calibration_of_its_own_build(artifacts, tmp_path):
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "artifact")
    manifest = load_manifest(artifact)
    entry = CalibrationEntry(
        TreeChoice("chain 3", "chain", chain_length=3), 1, 1.3, CalibratedSampling()
    )
    own = build_name(manifest)
    for build, expected in (("ort-int4", None), (own, (1, 4))):
        shape = VerifyShape(build, (1, 4), (1.0, 1.6))
        calibrated = manifest.with_calibration("ngram", replace(entry, verify_shape=shape))
        write_manifest(artifact, manifest_body(calibrated))
        engine = load(artifact, threads=2)
        plan = engine.plan(Speculation("ngram"), SamplingParams())
        priced = engine.plans.round_costs(plan, 1, replayed=True).shape
        assert getattr(priced, "tokens", None) == expected, build  # another build's: not used
        wider = engine.plans.round_costs(plan, 2, replayed=True).shape
        assert wider is replayed_guess  # measured at batch 1 only: n-gram's dear guess


def test_an_engine_shares_round_costs_per_plan_and_batch(artifacts):
    engine = load(artifacts["llama"], threads=2)
    prompt = [5, 9, 5, 9, 5, 9, 13]
    plain = engine.generate(prompt, max_new_tokens=24, ignore_eos=True).tokens
    plan = engine.plan(Speculation("ngram"), SamplingParams())
    costs = engine.plans.round_costs(plan, 1, replayed=True)
    assert not costs.known
    done = [engine.generate(prompt, max_new_tokens=24, ignore_eos=True, speculation="ngram")]
    assert costs.known and engine.plans.round_costs(plan, 1, replayed=True) is costs
    wider = engine.plans.round_costs(plan, 2, replayed=True)
    assert wider is not costs  # a wider batch times other forwards
    engine.reset_drafters()  # drops what drafters learnt, not what the machine costs
    done.append(engine.generate(prompt, max_new_tokens=24, ignore_eos=True, speculation="ngram"))
    assert engine.plans.round_costs(plan, 1, replayed=True) is costs
    assert [d.tokens for d in done] == [plain, plain]


def test_reset_drafters_drops_only_drafters_that_learn_across_requests(artifacts):
    """Suffix drafting's shared trie is dropped; an n-gram drafter, whose proposals depend on
    its request alone, stays pooled (the same object serves the next request)."""
    engine = load(artifacts["llama"], threads=2)
    prompt = [5, 9, 5, 9, 5, 9, 13]
    plans = {d: engine.plan(Speculation(d), SamplingParams()) for d in ("ngram", "suffix")}
    for drafter in [*plans, *plans]:  # suffix remembers a text at its next request's start
        engine.generate(prompt, max_new_tokens=12, ignore_eos=True, speculation=drafter)
    pooled = {d: engine.plans.take(plan) for d, plan in plans.items()}
    for d, plan in plans.items():
        engine.plans.give_back(plan, pooled[d])
    assert len(pooled["suffix"].shared) > 1  # nodes past the root: it learnt a text
    engine.reset_drafters()
    assert engine.plans.take(plans["ngram"]) is pooled["ngram"]
    fresh = engine.plans.take(plans["suffix"])
    assert fresh is not pooled["suffix"] and len(fresh.shared) == 1  # the root alone


def test_an_engine_remembers_when_asking_pays_per_plan_batch_and_setting(artifacts):
    engine = load(artifacts["llama"], threads=2)
    plan = engine.plan(Speculation("suffix"), SamplingParams())
    state = engine.plans.state(plan)
    hot = state.asking_memory(1, SamplingParams(1.0, seed=1))
    assert hot is state.asking_memory(1, SamplingParams(1.0, seed=2))  # seeds aside
    assert hot is not state.asking_memory(1, SamplingParams(0.0))
    assert hot is not state.asking_memory(4, SamplingParams(1.0))
    hot.probe_at = 64  # earlier requests at T = 1 found that asking lost
    engine.reset_drafters()  # learnt from the target's verdicts: it stays
    options = {"max_new_tokens": 24, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    done = engine.generate([5, 9, 5, 9, 5, 9, 13], **options, speculation="suffix")
    speculative = done.stats.run.speculative
    assert speculative.controller.sizes_chosen == {0: 23} and speculative.draft_s == 0  # unasked
    assert done.tokens == engine.generate([5, 9, 5, 9, 5, 9, 13], **options).tokens
    # Greedy, a remembered wait of 8: plain rounds, then a probe and drafts; plain's tokens.
    engine.plans.state(plan).asking_memory(1, SamplingParams()).probe_at = 8
    greedy = {"max_new_tokens": 40, "ignore_eos": True}
    done = engine.generate([5, 9, 5, 9, 5, 9, 13], **greedy, speculation="suffix")
    chosen = done.stats.run.speculative.controller.sizes_chosen
    assert chosen[0] >= 7 and max(chosen) > 0  # its probe keeps a node of the match
    assert done.tokens == engine.generate([5, 9, 5, 9, 5, 9, 13], **greedy).tokens
    for i in range(ASKING_SETTINGS):  # as many other settings as it keeps: it starts over
        engine.plans.state(plan).asking_memory(1, SamplingParams(0.5 + i / 1000))
    assert engine.plans.state(plan).asking_memory(1, SamplingParams(1.0)).probe_at == 0


def test_an_engine_remembers_acceptance_per_plan_and_setting(artifacts):
    """Where a request starts from it: `test_a_request_starts_from_the_acceptance_...`."""
    engine = load(artifacts["llama"], threads=2)
    plan = engine.plan(Speculation("ngram"), SamplingParams())
    state = engine.plans.state(plan)
    hot = state.acceptance_memory(SamplingParams(1.0, seed=1))
    assert hot is state.acceptance_memory(SamplingParams(1.0, seed=2))  # seeds aside
    greedy = state.acceptance_memory(SamplingParams())
    assert hot is not greedy
    prompt, options = [5, 9, 5, 9, 5, 9, 13], {"max_new_tokens": 40, "ignore_eos": True}
    plain = engine.generate(prompt, **options).tokens
    assert engine.generate(prompt, **options, speculation="ngram").tokens == plain
    assert greedy.judged[0] > 0 and hot.judged == [0] * 16  # the request's verdicts, there
    engine.reset_drafters()  # learnt from the target's verdicts: it stays
    assert engine.plans.state(plan).acceptance_memory(SamplingParams()) is greedy


def test_forget_requests_starts_the_next_request_as_a_fresh_engines_first(artifacts):
    """Round costs, asking and acceptance memories and learning drafters are all dropped."""
    engine = load(artifacts["llama"], threads=2)
    prompt, options = [5, 9, 5, 9, 5, 9, 13], {"max_new_tokens": 24, "ignore_eos": True}
    plans = {d: engine.plan(Speculation(d), SamplingParams()) for d in ("ngram", "suffix")}
    for drafter in plans:
        engine.generate(prompt, **options, speculation=drafter)
    costs = engine.plans.round_costs(plans["ngram"], 1, replayed=True)
    assert costs.shape is replayed_guess  # made by the request, for a drafter replays judge
    accepted = engine.plans.state(plans["ngram"]).acceptance_memory(SamplingParams())
    asking = engine.plans.state(plans["suffix"]).asking_memory(1, SamplingParams())
    assert costs.known and accepted.judged[0] > 0 and asking.rounds > 0
    suffix = engine.plans.take(plans["suffix"])
    engine.plans.give_back(plans["suffix"], suffix)
    engine.forget_requests()
    assert not engine.plans.round_costs(plans["ngram"], 1, replayed=True).known
    assert engine.plans.state(plans["ngram"]).acceptance_memory(SamplingParams()).judged == [0] * 16
    assert engine.plans.state(plans["suffix"]).asking_memory(1, SamplingParams()).rounds == 0
    assert engine.plans.take(plans["suffix"]) is not suffix


def test_an_engine_prices_a_drafters_prefill_and_pays_it_only_where_it_pays(head_artifacts):
    """A head's prefill is timed when the plan first builds it, then as each request paid it;
    a request whose rest cannot repay it decodes plainly to its end, never prefilling."""
    engine = load(head_artifacts["eagle3"], threads=2)
    head, ngram = (engine.plan(Speculation(d), SamplingParams()) for d in ("eagle3", "ngram"))
    prompt, options = list(range(1, 30)), {"max_new_tokens": 24, "ignore_eos": True}
    assert engine.plans.state(head).trial([prompt], 24) is None  # not built: nothing timed
    for plan in (head, ngram):
        engine.plans.check(plan)
    trial = engine.plans.state(head).trial([prompt, prompt], 24)
    assert trial is not None and trial.prefill_s > 0 and trial.step_s > 0 and trial.rounds == 24
    # model-free: no prefill
    assert engine.plans.state(ngram).trial([prompt], 24) == Trial(0.0, 24, 0.0, 0.0, len(prompt))
    plain = engine.generate(prompt, **options).tokens
    engine.plans.prefilled(head, seconds=60.0, tokens=1)  # a minute a prompt token: never repaid
    done = engine.generate(prompt, **options, speculation="eagle3")
    speculative = done.stats.run.speculative
    assert done.tokens == plain
    assert set(speculative.controller.sizes_chosen) == {0} and speculative.draft_prefill_s == 0
    # Drafting every round (no controller), a request prefills: its price is the next one's.
    fixed = Speculation("eagle3", adaptive=False)
    assert engine.plan(fixed, SamplingParams()).key == head.key
    done = engine.generate(prompt, **options, speculation=fixed)
    speculative = done.stats.run.speculative
    assert done.tokens == plain and speculative.draft_prefill_s > 0
    trial = engine.plans.state(head).trial([prompt], 24)
    assert trial.prefill_s == pytest.approx(speculative.draft_prefill_s)


def test_peers_that_wait_for_a_draft_raise_the_bar_for_it():
    """In a continuous batch a row's draft delays every peer: it must pay for the forward."""
    alone, crowded = AdaptiveController(), AdaptiveController()
    for controller in (alone, crowded):  # the same history: drafts of 2 accepted every round
        controller.start(1, 8)
        rounds(controller, accepted_at=2, count=12, width_cost=0.1)
    assert alone.sizes(np.array([True]))[0] > 0  # ~3 tokens for 1.4 steps beats 1 per step
    assert crowded.sizes(np.array([True]), peers=15)[0] == 0  # not at 16 rows a forward


def chain(confidences) -> DraftTree:
    n = len(confidences)
    return DraftTree(np.arange(n), np.arange(n) - 1, confidence=np.array(confidences, float))


def random_tree(rng, n: int) -> DraftTree:
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    return DraftTree(np.arange(n), np.array(parents), confidence=rng.uniform(0.05, 1.0, n))


@pytest.mark.parametrize("replays", [True, False])
def test_suffix_drafts_trimmed_by_confidence_equal_plain(artifacts, rng, replays, monkeypatch):
    # No probe tail (a cost rule that only lengthens stretches): a batch of 3 in 30 tokens
    # would otherwise play its probes' rounds plainly to the end.
    monkeypatch.setattr("specx.runtime.rounds.PROBE_TAIL", 0)
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    prompts = loopy(rng, target.vocab_size, 3)
    for batch in (1, 3):
        # Steep costs, a short patience and quick probes: trims, idle rows and probes mix.
        controller = ConfidenceController(
            costs=FixedCurve(0.3), patience=1, schedule=Schedule(probe_every=2, probe_budget=0.5)
        )
        drafter = SuffixDrafter(SuffixOptions(8, min_prob=0.0))
        if not replays:
            drafter = NoReplay(drafter)
        spec = generate_speculative(target, drafter, prompts[:batch], 30, controller=controller)
        assert spec.tokens == generate_plain(target, prompts[:batch], 30).tokens
        controller_stats = spec.stats.speculative.controller
        assert controller_stats.name == "confidence"
        # Replays keep a row from asking where they would not have paid: fewer sizes mix.
        assert len(controller_stats.sizes_chosen) >= (2 if replays else 3)


def test_confidence_trimming_keeps_the_prefix_that_pays_most():
    """keep() against the rule written out: (1 + sum of path probabilities) / T(k)."""
    rng = np.random.default_rng(3)
    for slope in (0.02, 0.15, 0.5):
        controller = ConfidenceController(costs=FixedCurve(slope), margin=0.05)
        controller.start(1, 16)
        controller.sizes(np.array([True]))  # the first round is a plain step
        for _ in range(20):
            draft = random_tree(rng, int(rng.integers(1, 17)))
            path = []
            for c, parent in zip(draft.confidence, draft.parents, strict=True):
                path.append(c * (path[parent] if parent >= 0 else 1.0))
            rates = [1.05] + [(1 + sum(path[:k])) / (1 + slope * k) for k in range(1, 17)]
            assert controller.sizes(np.array([True]))[0] == 16
            (kept,) = controller.keep([draft])
            assert len(kept) == min(int(np.argmax(rates)), len(draft))
            assert kept.parents.tolist() == draft.parents[: len(kept)].tolist()
        # A draft that beats a plain step by less than the margin is not worth its risk.
        controller.sizes(np.array([True]))
        barely = chain([1.02 * (1 + slope) - 1])  # (1 + p) / (1 + slope): 1.02 plain steps
        assert len(controller.keep([barely])[0]) == 0


def test_confidence_learns_what_the_target_accepts_idles_and_comes_back():
    controller = ConfidenceController(schedule=Schedule(probe_every=4, max_probe_every=16))
    controller.start(1, 8)
    sure = chain([1.0] * 8)

    def rounds(count, accepted):
        return play(controller, count, lambda r: sure, accepted, draft_s=0.02)

    # Four plain steps, then the drafter is trusted, as wide as the widths timed allow.
    assert rounds(7, 8) == [None] * 4 + [1, 2, 4]
    # The target stops agreeing: a whole draft rejected loses over half a step, so the row
    # idles, and probes no oftener than keeps what a window lost within 2% of the rounds
    # between (past `max_probe_every`, 16 here).
    kept = rounds(60, 0)
    windows = [i for i in range(1, 60) if kept[i] is not None and kept[i - 1] is None]
    assert kept[-20:].count(None) >= 18 and np.diff(windows).tolist() == [26]
    # It agrees again: the next probe finds it and whole drafts return.
    assert rounds(40, 8)[-5:] == [8] * 5


def play(
    controller, rounds: int, draft, accepted: int, draft_s: float, lone=lambda r: 1.0
) -> list[int | None]:
    """Rounds of one row played as the loop plays them; per round the nodes kept (None: idle).

    `draft(r)`: the proposal of round r (from 1); the target accepts its first `accepted`
    nodes. Times in plain steps: a proposal costs `draft_s`, verifying k > 0 nodes 1 + k / 16,
    a round that kept none `lone(r)`; idle rounds go through `idle_rounds` and `idled`.
    """
    kept: list[int | None] = []
    while len(kept) < rounds:
        idle = min(controller.idle_rounds(np.array([True])), rounds - len(kept))
        if idle:  # as the loop, no further than the request's budget
            kept += [None] * idle
            controller.idled(Stretch(idle, idle, 1.0))
            continue
        if not controller.sizes(np.array([True]))[0]:
            kept.append(None)
            controller.timed(1, 1.0, 0.0)
            continue
        (draft_kept,) = controller.keep([draft(len(kept) + 1)])
        kept.append(len(draft_kept))
        controller.observe(0, len(draft_kept), list(range(min(accepted, len(draft_kept)))))
        verify_s = 1.0 + len(draft_kept) / 16 if draft_kept else lone(len(kept))
        controller.timed(1 + len(draft_kept), verify_s, draft_s)
    return kept[:rounds]


def proposals(controller, rounds: int, found, lone=lambda r: 1.0) -> list[bool]:
    """Per round, whether the row proposed; `found(r)`: its proposal in round r matches.

    A proposal costs 0.12 of a plain step (`play`); a match is accepted whole.
    """
    controller.start(1, 8)
    sure = chain([1.0] * 8)
    draft = lambda r: sure if found(r) else DraftTree.empty()  # noqa: E731
    return [k is not None for k in play(controller, rounds, draft, 8, 0.12, lone)]


def test_confidence_stops_proposing_where_proposals_cost_more_than_they_earn():
    never = proposals(ConfidenceController(), 120, found=lambda r: False)
    # Four plain steps, then proposals lose 0.12 of a step each: past half a step (the loss
    # budget), the row idles until what the window lost (0.6 steps) is 2% of the rounds
    # since (30), or the wait that doubles while windows pay nothing (7, 15, 31), if longer.
    assert never[:12] == [False] * 4 + [True] * 5 + [False] * 3
    asking = [i for i in range(1, 120) if never[i] and not never[i - 1]]
    assert np.diff(asking).tolist() == [35, 35, 36]  # windows of 5 asks, idle 30, 30, 31
    # Rounds that found nothing but ran fast by chance did not pay: the row idles as long.
    noisy = proposals(ConfidenceController(), 120, lambda r: False, lambda r: 0.8 + 0.5 * (r % 2))
    idle = [len(list(run)) for asked, run in itertools.groupby(noisy[4:]) if not asked]
    assert min(idle[:3]) >= 30
    # A match every fourth round earns up to 7.4 plain steps, the misses 0.36: it keeps asking.
    often = proposals(ConfidenceController(), 60, found=lambda r: r % 4 == 0)
    assert all(often[4:])


def test_the_wait_between_windows_of_asking_goes_on_across_requests_until_one_pays():
    memory = AskingMemory(max_interval=64)  # an engine's, shared by its requests of one plan
    nothing = lambda r: False  # noqa: E731
    asked: list[bool] = []  # every request's rounds, one after the other
    for rounds in (60, 60, 20, 20, 20, 60, 60):  # short requests end before their window
        asked += proposals(ConfidenceController(memory=memory), rounds, nothing)
    windows = [i for i in range(1, len(asked)) if asked[i] and not asked[i - 1]]
    # Windows of 5 asks; each that paid nothing doubles the memory's wait, whichever
    # request plays it, up to its most (64 here); within a request a window also waits
    # until what it lost is 2% of the rounds since (30 rounds past its 5 asks): the second
    # request, whose memory wait had passed, asks after its plain rounds (64, 25 after 39).
    assert windows[0] == 4 and np.diff(windows).tolist() == [35, 25, 36, 68, 68]
    assert memory.interval == 64
    # A window that pays: the next request asks after its first four plain rounds.
    paying = proposals(ConfidenceController(memory=memory), 60, found=lambda r: True)
    assert not any(paying[:4]) and any(paying) and memory.interval == memory.probe_at == 0
    assert proposals(ConfidenceController(memory=memory), 10, nothing)[4]
    # Without an engine's memory every request starts afresh.
    assert proposals(ConfidenceController(), 60, nothing)[4]
    # A request that paid keeps the next one asking at once, whatever its later windows did.
    memory = AskingMemory()
    early = proposals(ConfidenceController(memory=memory), 60, found=lambda r: r < 10)
    assert early[4] and not all(early[10:]) and memory.probe_at == 0
    assert proposals(ConfidenceController(memory=memory), 10, nothing)[4]


def test_a_batch_asks_first_once_a_probe_is_affordable():
    """A batch's asking round proposes for every row and widens every row's forward: its first
    window waits as `AdaptiveController`'s first probe does; a row alone asks at once."""

    def first_ask(batch: int, costs=None) -> int:
        controller = ConfidenceController(costs=costs)
        controller.start(batch, 8)
        rows = np.ones(batch, dtype=bool)
        return next(r for r in range(1, 200) if controller.sizes(rows).any())

    assert first_ask(1) == 2  # after the request's plain first round
    assert first_ask(4) == 50  # nothing timed: a probe round priced 2 steps, 2% of the time
    assert first_ask(4, FixedCurve(0.2)) == 10  # a two-token forward timed at 1.2 steps


def test_a_batchs_first_ask_waits_until_indexing_its_rows_texts_is_affordable():
    """Suffix drafting indexes a batch's texts at its first ask (prompts and every token since):
    that ask is priced with the indexing, which grows by a token a row each round, so it comes
    when the whole probe is within 2% of the rounds before it, or never in the request."""
    six = np.ones(6, dtype=bool)

    def first_ask(index_s: float) -> int:
        trial = Trial(0.0, rounds=128, index_s=index_s, prompt_tokens=600)
        controller = ConfidenceController(trial=trial)
        controller.start(6, 16)
        controller.idled(Stretch(controller.idle_rounds(six), 6 * 49, 1.0))  # a step: 1 s
        return next(r for r in range(controller.round + 1, 200) if controller.sizes(six).any())

    assert first_ask(0.0) == 50  # indexing free: the probe's two steps, as without a trial
    assert first_ask(0.001) == 115  # (2 - 1 + 600 x 0.001) / (0.02 - 6 x 0.001)
    assert first_ask(0.004) == 129  # 6 x 0.004 a round > 2%: plain to the request's end


def test_suffix_drafting_times_its_indexing_for_a_batchs_first_ask():
    costs = time_drafter(SuffixDrafter(), tap_width=0)
    assert 0 < costs.index_s_per_token < 1e-3 and costs.prefill_s_per_token == 0
    assert time_drafter(NGramDrafter(), tap_width=0).index_s_per_token == 0
    trial = PlanState(drafter_costs=costs).trial([[1] * 30, [2] * 20], max_new_tokens=64)
    assert trial is not None and (trial.index_s, trial.prompt_tokens) == (
        costs.index_s_per_token,
        50,
    )


def test_a_batch_keeps_one_width_and_peers_raise_the_bar():
    curve = FixedCurve(0.2)
    controller = ConfidenceController(costs=curve, schedule=Schedule(probe_every=2, probe_budget=1))
    controller.start(2, 8)
    controller.sizes(np.array([True, True]))
    controller.sizes(np.array([True, True]))
    short, long = controller.keep([chain([1.0] * 2), chain([1.0] * 6)])
    # A batch ends with its slowest row: nodes past what the short draft offers would widen
    # every row's forward and not end the batch sooner.
    assert (len(short), len(long)) == (2, 2)
    controller.sizes(np.array([True, True]))
    assert [len(d) for d in controller.keep([chain([1.0] * 6)] * 2)] == [6, 6]
    alone, crowded = ConfidenceController(costs=curve), ConfidenceController(costs=curve)
    for c, peers in ((alone, 0), (crowded, 15)):
        c.start(1, 8)
        c.sizes(np.array([True]), peers=peers)
        c.sizes(np.array([True]), peers=peers)
    assert len(alone.keep([chain([0.8] * 4)])[0]) == 4
    assert len(crowded.keep([chain([0.8] * 4)])[0]) == 0  # 16 rows wait for its draft


@pytest.mark.parametrize("accepted", [(1, 0), (1, 1)])
def test_a_batch_is_paid_by_the_tokens_its_least_lucky_row_accepted(accepted):
    controller = ConfidenceController()
    controller.start(2, 8)
    both = np.array([True, True])
    idle = controller.idle_rounds(both)  # until the batch's first window
    controller.idled(Stretch(idle, 2 * idle, 1.0))
    controller.sizes(both)
    kept = controller.keep([chain([1.0] * 8)] * 2)
    assert [len(d) for d in kept] == [1, 1]  # no wider than the widths timed allow
    for row, count in enumerate(accepted):
        controller.observe(row, 1, list(range(count)))
    # The two-row forward costs 1.6 plain steps: one row's token does not pay for it (the
    # other row still needs its next round), both rows' do.
    controller.timed(2, 1.6, 0.02)
    assert (controller.idle_rounds(both) > 0) == (min(accepted) == 0)


def test_a_sampled_draft_is_never_trimmed_by_its_own_tokens():
    controller = ConfidenceController(costs=FixedCurve(5.0))  # any draft would be cut
    controller.start(1, 4)
    controller.sizes(np.array([True]))
    controller.sizes(np.array([True]))
    sampled = DraftTree(np.arange(3), np.array([-1, 0, 1]), np.eye(4)[:3], np.full(3, 0.1))
    assert controller.keep([sampled])[0] is sampled


def test_each_drafter_gets_its_controller(artifacts):
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    suffix = controller_for(SuffixDrafter())
    assert isinstance(suffix, ConfidenceController)
    # Drafters that plain steps judge for free price an untimed round dear; others (a head,
    # a draft model, a third-party drafter without `replay`) learn only by drafting.
    assert suffix.costs.shape is replayed_guess and replays(NGramDrafter(4))
    assert not replays(object()) and not hasattr(DraftModelDrafter, "replay")
    assert isinstance(controller_for(NGramDrafter(4)), AdaptiveController)
    assert isinstance(controller_for(make_drafter("ngram", target, DrafterOptions())),
                      AdaptiveController)  # fmt: skip
    assert isinstance(controller_for(object()), AdaptiveController)  # a third-party drafter


def test_drafts_grow_only_as_far_as_widths_were_timed():
    """A width never timed is priced by a one-row guess: k reaches twice the widest timed."""
    controller = ConfidenceController()  # its own cost model, fed flat timings
    controller.start(1, 16)
    kept = []
    for _ in range(6):
        if controller.sizes(np.array([True]))[0] == 0:
            controller.timed(1, 1e-3, 0.0)
            continue
        (draft,) = controller.keep([chain([1.0] * 16)])
        kept.append(len(draft))
        controller.observe(0, len(draft), list(range(len(draft))))
        controller.timed(1 + len(draft), 1e-3, 1e-4)
    assert kept == [1, 2, 4, 8, 16]


def test_a_row_alone_keeps_looking_a_row_with_peers_idles_on_empty_rounds():
    """Finding nothing costs a lone row little; with peers, every row's search adds up."""
    for peers, idles in ((0, False), (3, True)):
        controller = ConfidenceController(costs=FixedCurve(0.1), patience=2)
        controller.start(1, 8)
        asked = []
        for _ in range(12):
            asked.append(bool(controller.sizes(np.array([True]), peers=peers)[0]))
            if asked[-1]:
                controller.keep([DraftTree.empty()])  # no match
        assert (False in asked[1:]) == idles, asked
