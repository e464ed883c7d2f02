"""Greedy speculative output equals plain greedy output, token for token."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import FAMILIES
from specx.artifact import load_manifest
from specx.errors import GenerationError
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.drafters.draft_model import (
    DraftModelDrafter,
    VocabMismatchError,
    check_same_vocabulary,
)
from specx.runtime.drafters.ngram import NGramDrafter
from specx.runtime.drafters.suffix import SuffixDrafter, SuffixOptions
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets.ort import OrtTarget
from specx.runtime.tree_shapes import DynamicTree, StaticTree
from specx.runtime.trees import TreeError

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def loopy_prompts(rng, vocab, count):
    """Random prompts with a repeated span, so prompt lookup has something to find."""
    prompts = []
    for _ in range(count):
        span = rng.integers(1, vocab, rng.integers(3, 8)).tolist()
        prompts.append(rng.integers(1, vocab, rng.integers(2, 10)).tolist() + span * 3)
    return prompts


def assert_equals_plain(target, drafter, prompts, new_tokens=40, batch=3):
    accepted = 0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        plain = generate_plain(target, chunk, new_tokens, eos_token_ids=(0,))
        spec = generate_speculative(target, drafter, chunk, new_tokens, eos_token_ids=(0,))
        assert spec.tokens == plain.tokens, f"{drafter.name} batch {chunk}"
        accepted += spec.stats.speculative.acceptance.accepted_tokens
    return accepted


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_ngram_chain_and_tree(family, batch, artifacts, rng):
    target = OrtTarget(load_manifest(artifacts[family]), threads=2)
    prompts = loopy_prompts(rng, target.vocab_size, 6)
    accepted = assert_equals_plain(target, NGramDrafter(5), prompts, batch=batch)
    accepted += assert_equals_plain(target, NGramDrafter(8, max_matches=3), prompts, batch=batch)
    assert accepted > 0, "no draft was ever accepted: the test would not exercise verification"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_suffix_trees(family, batch, artifacts, rng):
    target = OrtTarget(load_manifest(artifacts[family]), threads=2)
    prompts = loopy_prompts(rng, target.vocab_size, 6)
    # One drafter for every chunk: later chunks also draft from the earlier ones' text.
    drafter = SuffixDrafter(SuffixOptions(max_nodes=12, min_prob=0.0))
    accepted = assert_equals_plain(target, drafter, prompts, batch=batch)
    assert accepted > 0 and drafter.shared.counts[0] == 0 and len(drafter.shared) > 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_draft_model_chain_and_tree(family, batch, artifacts, draft_artifacts, rng):
    target = OrtTarget(load_manifest(artifacts[family]), threads=2)
    draft = OrtTarget(load_manifest(draft_artifacts[family]), threads=2)
    prompts = [rng.integers(1, target.vocab_size, n).tolist() for n in (4, 9, 13, 6, 21, 2)]
    accepted = assert_equals_plain(
        target, DraftModelDrafter(draft, StaticTree.chain(4)), prompts, batch=batch
    )
    tree = DraftModelDrafter(draft, StaticTree.from_choices(TREE))
    accepted += assert_equals_plain(target, tree, prompts, batch=batch)
    dynamic = DraftModelDrafter(draft, DynamicTree.of_nodes(12, 4, 3))
    accepted += assert_equals_plain(target, dynamic, prompts, batch=batch)
    assert accepted > 0


def test_trained_target_pyref(pyref_artifact):
    from specx.runtime.tokenizer import TextTokenizer

    target = OrtTarget(load_manifest(pyref_artifact), threads=2)
    tokenizer = TextTokenizer(pyref_artifact / "tokenizer.json")
    prompts = [
        tokenizer.encode(text)
        for text in (
            "import os\nimport sys\n\n",
            "def parse(self, data):\n",
            "class Node:\n    def __init__",
        )
    ]
    accepted = assert_equals_plain(target, NGramDrafter(6, max_matches=2), prompts, 64)
    self_draft = DraftModelDrafter(
        OrtTarget(load_manifest(pyref_artifact), threads=2), StaticTree.chain(3)
    )
    accepted += assert_equals_plain(target, self_draft, prompts, 64)
    assert accepted > 0


def test_speculation_off_above_max_batch(artifacts):
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    prompts = [[1, 2, 3]] * 3
    result = generate_speculative(target, NGramDrafter(4), prompts, 8, max_batch_spec=2)
    assert result.stats.mode == "plain" and result.stats.speculative is None
    assert result.stats.speculation_off == "off: batch 3 > max_batch_spec 2"
    assert result.tokens == generate_plain(target, prompts, 8).tokens


def test_tree_over_exported_size_is_refused(artifacts):
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    with pytest.raises(TreeError, match="exceeds the 64 verify tokens"):
        generate_speculative(target, NGramDrafter(64), [[1, 2]], 4)


def test_prompt_over_capacity_with_tree_scratch(artifacts):
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    with pytest.raises(GenerationError, match="KV slots"):
        generate_speculative(target, NGramDrafter(8), [[1] * 120], 8)


def test_vocab_mismatch_is_refused(artifacts, tmp_path):
    from specx.export.random_checkpoint import CheckpointPreset, write_random_checkpoint
    from specx.export.target_export import export_target

    other = write_random_checkpoint(
        tmp_path / "ckpt", "llama", CheckpointPreset(32, 64, 1, 2, 1, 300), tokenizer=False
    )
    draft = OrtTarget(load_manifest(export_target(other, tmp_path / "art", max_context=64)))
    target = OrtTarget(load_manifest(artifacts["llama"]))
    with pytest.raises(VocabMismatchError, match="vocabulary 300, the target .* has 512"):
        check_same_vocabulary(target, draft)
    with pytest.raises(VocabMismatchError):
        make_drafter(f"draft-model:{tmp_path / 'art'}", target, DrafterOptions())


class _BrokenDrafter(NGramDrafter):
    def __init__(self, tree):
        super().__init__(2)
        self.tree = tree

    def propose(self, histories, active, sampling, rng):
        return [self.tree for _ in histories]


def test_malformed_drafts_fail_loudly(artifacts):
    from specx.runtime.trees import DraftTree

    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    cyclic = DraftTree(np.array([3, 4]), np.array([-1, 1]))
    with pytest.raises(TreeError, match="node 1 has parent 1: a cycle"):
        generate_speculative(target, _BrokenDrafter(cyclic), [[1, 2]], 4)
    outside = DraftTree.chain([3, 10_000])
    with pytest.raises(TreeError, match="outside"):
        generate_speculative(target, _BrokenDrafter(outside), [[1, 2]], 4)


def test_tree_ranks_beyond_the_vocabulary(head_artifacts):
    from specx.runtime.tree_shapes import StaticTree

    target = OrtTarget(load_manifest(head_artifacts["medusa"]), threads=2)
    drafter = make_drafter("medusa", target, DrafterOptions(tree=StaticTree.from_choices([[40]])))
    with pytest.raises(TreeError, match="rank 40 but the vocabulary has only 32"):
        generate_speculative(target, drafter, [[1, 2]], 4)


def test_draft_model_batch_filling_the_cache_equals_plain(artifacts, draft_artifacts, monkeypatch):
    """Rows of different lengths decoding up to the KV capacity: the draft model's catch-up
    of a short row must not pad past the end of the cache for the longest one."""
    from specx.runtime.targets.base import DecoderBackend

    row_by_row = []
    feed_rows = DecoderBackend._feed_rows

    def spy(self, *args):
        row_by_row.append(1)
        return feed_rows(self, *args)

    monkeypatch.setattr(DecoderBackend, "_feed_rows", spy)
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    draft = OrtTarget(load_manifest(draft_artifacts["llama"]), threads=2)

    # The long row is one the draft agrees with, so it finishes first and then sits at the
    # last slots while the others still catch up two tokens at a time.
    def tokens(seed: int, repeats: int) -> list[int]:
        return [int(x) for x in np.random.default_rng(seed).integers(1, 500, 6)] * repeats

    prompts = [tokens(1, 10), tokens(100, 2), tokens(101, 1)]
    new_tokens = target.capacity - 60 + 1 - 2  # the longest row fills the cache (scratch 2)
    plain = generate_plain(target, prompts, new_tokens)
    drafter = DraftModelDrafter(draft, StaticTree.chain(1))
    spec = generate_speculative(target, drafter, prompts, new_tokens)
    assert spec.tokens == plain.tokens
    assert spec.stats.speculative.acceptance.accepted_tokens > 0 and row_by_row
