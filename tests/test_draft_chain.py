"""The one-call draft chain (`draft_chain` graph) drafts what the per-depth path drafts."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import HEAD_VOCAB
from specx.artifact import load_manifest
from specx.runtime.drafters.chain_graph import DraftChain
from specx.runtime.drafters.feature_head import FeatureHeadDrafter
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.sampling import SamplingParams
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets.ort import OrtTarget
from specx.runtime.tree_shapes import StaticTree

HEADS = ["eagle3", "eagle", "mtp-deepseek"]


def drafts(target, drafter, prompts, new_tokens=24):
    seen = []
    result = generate_speculative(
        target, drafter, prompts, new_tokens,
        observer=lambda row, draft, verdict: seen.append((row, draft)),
    )  # fmt: skip
    return result, seen


@pytest.mark.parametrize("name", HEADS)
@pytest.mark.parametrize("batch", [1, 3])
def test_one_call_chain_equals_the_per_depth_chain(name, batch, head_artifacts, rng):
    manifest = load_manifest(head_artifacts[name])
    target = OrtTarget(manifest, threads=2)
    prompts = [rng.integers(1, HEAD_VOCAB, n).tolist() for n in (3, 9, 5)][:batch]
    one_call = FeatureHeadDrafter(manifest, StaticTree.chain(4), threads=2)
    per_depth = FeatureHeadDrafter(manifest, StaticTree.chain(4), threads=2, one_call=False)
    assert one_call.chain is not None and per_depth.chain is None
    fast, fast_drafts = drafts(target, one_call, prompts)
    slow, slow_drafts = drafts(target, per_depth, prompts)
    assert fast.tokens == slow.tokens == generate_plain(target, prompts, 24).tokens
    assert len(fast_drafts) == len(slow_drafts) > 0
    for (row_a, a), (row_b, b) in zip(fast_drafts, slow_drafts, strict=True):
        assert row_a == row_b
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.parents, b.parents)
        np.testing.assert_allclose(a.confidence, b.confidence, rtol=1e-4, atol=1e-6)


def test_chain_graph_is_in_every_ort_build_and_not_in_trt_lint(head_artifacts):
    manifest = load_manifest(head_artifacts["eagle"])
    entry = manifest.graph("draft_chain")
    assert entry.ort_only and entry.data_files == manifest.graph("draft_head").data_files
    names = {i.name for i in entry.inputs}
    assert {"last_index", "steps"} <= names


def test_sampling_keeps_the_per_depth_sampled_chain(head_artifacts, monkeypatch):
    """At a temperature a chain is drawn from q per depth; the one-call graph is greedy only."""
    manifest = load_manifest(head_artifacts["eagle"])
    target = OrtTarget(manifest, threads=2)
    drafter = FeatureHeadDrafter(manifest, StaticTree.chain(3), threads=2)
    calls = []
    original = DraftChain.__call__
    monkeypatch.setattr(
        DraftChain, "__call__", lambda self, *a: calls.append(1) or original(self, *a)
    )
    seen = []
    generate_speculative(
        target, drafter, [[1, 2, 3]], 8, SamplingParams(temperature=0.7, seed=0),
        observer=lambda row, draft, verdict: seen.append(draft),
    )  # fmt: skip
    assert not calls and all(d.probs is not None for d in seen if len(d))
    generate_speculative(target, drafter, [[1, 2, 3]], 8)
    assert calls
