"""Per-round draft sizes: lossless whatever they are, and chosen from acceptance and cost."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import HEAD_VOCAB
from specx.artifact import load_manifest
from specx.runtime.controller import AdaptiveController, FixedSizes, truncated
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.drafters.draft_model import DraftModelDrafter
from specx.runtime.drafters.ngram import NGramDrafter
from specx.runtime.drafters.suffix import SuffixDrafter, SuffixOptions
from specx.runtime.drafters.tree_search import DynamicTree, StaticTree, parse_tree_spec
from specx.runtime.ort_target import OrtTarget
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.trees import DraftTree

SWITCHING = [0, 3, 1, 0, 5, 2, 8]  # a different size every round, none included


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
            assert spec.stats["sizes_chosen"].keys() >= {0, 3}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_model_free_drafters_switching_sizes_equal_plain(family, artifacts, rng):
    target = OrtTarget(load_manifest(artifacts[family]), threads=2)
    prompts = loopy(rng, target.vocab_size, 3)
    assert_switching_equals_plain(target, lambda: NGramDrafter(8, max_matches=3), prompts)
    assert_switching_equals_plain(target, lambda: SuffixDrafter(SuffixOptions(8)), prompts)


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
        controller.observe(0, size, min(depth, size))
        controller.timed(1 + size, 1.0 + width_cost * size, 0.2 if size else 0.0)
    return chosen


def test_the_controller_backs_off_probes_and_comes_back():
    controller = AdaptiveController(probe_every=4, max_probe_every=16)
    controller.start(1, 8)
    chosen = rounds(controller, accepted_at=0, count=60)
    assert chosen[0] == 0 and chosen[1] > 0  # a plain step first, then the prior's draft
    first_off = chosen.index(0, 1)
    probes = [i for i, size in enumerate(chosen) if size and i > first_off]
    gaps = np.diff(probes).tolist()
    assert chosen[-10:].count(0) >= 9 and min(gaps) >= 4 and gaps[-1] == 16
    # The sequence becomes predictable: the next probe finds it and speculation returns.
    chosen = rounds(controller, accepted_at=8, count=40)
    assert chosen[-4:] == [8] * 4


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
    assert cheap.summary()["sizes_chosen"] and dear.summary()["controller"] == "adaptive"


def test_peers_that_wait_for_a_draft_raise_the_bar_for_it():
    """In a continuous batch a row's draft delays every peer: it must pay for the forward."""
    alone, crowded = AdaptiveController(), AdaptiveController()
    for controller in (alone, crowded):  # the same history: drafts of 2 accepted every round
        controller.start(1, 8)
        rounds(controller, accepted_at=2, count=12, width_cost=0.1)
    assert alone.sizes(np.array([True]))[0] > 0  # ~3 tokens for 1.4 steps beats 1 per step
    assert crowded.sizes(np.array([True]), peers=15)[0] == 0  # not at 16 rows a forward
