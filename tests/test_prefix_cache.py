"""Prefix caching: reused prefixes change no output, for every drafter; memory stays bounded."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import HEAD_VOCAB
from specx.artifact import load_manifest
from specx.runtime.continuous import BatchSequence, ContinuousBatch
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.drafters.medusa import MEDUSA_DEFAULT_TREE
from specx.runtime.kv_cache import KVCache
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.prefix_cache import PrefixCache
from specx.runtime.sampling import SamplingParams
from specx.runtime.targets.ort import OrtTarget
from specx.runtime.tree_shapes import parse_tree_spec


def _decode(target, prompts, tokens, drafter_spec, prefix_cache, slots):
    """Every prompt through one ContinuousBatch (joining as slots free up)."""
    batch = ContinuousBatch(target, slots, prefix_cache)
    options = DrafterOptions()
    if drafter_spec == "medusa":  # its default tree needs more scratch than the capacity
        options = DrafterOptions(tree=parse_tree_spec(json.dumps(MEDUSA_DEFAULT_TREE[:8])))
    waiting = [
        BatchSequence(
            p, tokens, SamplingParams(), frozenset(), lambda _r, _t: True,
            None if drafter_spec is None else make_drafter(drafter_spec, target, options),
        )
        for p in prompts
    ]  # fmt: skip
    sequences = list(waiting)
    while waiting or batch.running:
        while waiting and batch.free:
            batch.admit(waiting.pop(0))
        batch.step()
    return [s.emitted for s in sequences], [s.stats.summary() for s in sequences]


@pytest.mark.parametrize(
    "name", ["plain", "ngram", "eagle3", "eagle", "mtp-deepseek", "medusa", "draft-model"]
)
def test_reused_prefixes_change_no_output(name, head_artifacts):
    """Prompts sharing a 40-token prefix: hits after the first, outputs as without a cache.

    Drafts too: a head drafts from the reused prefix's taps as from freshly computed ones
    (wrong taps would keep the output, verification sees to that, but change acceptance).
    """
    artifact = head_artifacts["eagle3" if name in ("plain", "ngram", "draft-model") else name]
    target = OrtTarget(load_manifest(artifact), threads=2)
    spec = {"plain": None, "mtp-deepseek": "mtp"}.get(name, name)
    if name == "draft-model":
        spec = f"draft-model:{head_artifacts['eagle']}"  # the same target as a draft model
    rng = np.random.default_rng(0)
    shared = rng.integers(1, HEAD_VOCAB, 40).tolist()
    prompts = [shared + rng.integers(1, HEAD_VOCAB, n).tolist() for n in (3, 7, 1, 12)]
    prompts.append(shared[:37])  # shorter than the cached prefix
    uncached = _decode(target, prompts, 16, spec, None, slots=3)
    assert uncached[0] == [generate_plain(target, [p], 16).tokens[0] for p in prompts]
    for slots in (1, 3):  # alone, and joining a running batch
        cache = PrefixCache(max_bytes=1 << 24, block_tokens=8)
        assert _decode(target, prompts, 16, spec, cache, slots) == uncached
        assert cache.hits == 4 and cache.reused_tokens == 4 * 40 - 8  # the last: 4 blocks


def _row(tokens: int, fill: float) -> KVCache:
    row = KVCache.allocate(num_layers=2, batch=1, num_kv_heads=1, capacity=64, head_dim=4)
    row.stacked[:, 0, :, :tokens] = fill
    return row


def test_lookup_returns_the_longest_cached_prefix_up_to_the_last_token():
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    cache.store(prompt, _row(13, 1.0), None)
    assert cache.lookup([99, *prompt]) is None  # a different first block
    hit = cache.lookup(prompt[:9] + [77, 78, 79])
    assert hit.tokens == 8 and hit.kv.shape == (4, 1, 8, 4) and np.all(hit.kv == 1.0)
    assert cache.lookup(prompt[:12]).tokens == 8  # all but the last token at most
    assert cache.lookup(prompt).tokens == 12
    row = _row(0, 0.0)
    PrefixCache.write(row, hit)
    assert np.all(row.stacked[:, 0, :, :8] == 1.0) and np.all(row.stacked[:, 0, :, 8:] == 0)


def test_memory_stays_bounded_and_leaves_go_before_their_prefixes():
    block_bytes = 2 * 2 * 1 * 4 * 4 * 4  # [2 * layers, Hkv, block, D] float32
    cache = PrefixCache(max_bytes=5 * block_bytes, block_tokens=4)
    first = list(range(1, 17))  # 4 blocks
    cache.store(first, _row(16, 1.0), None)
    assert cache.bytes == 4 * block_bytes and cache.evictions == 0
    second = first[:8] + list(range(50, 62))  # shares 2 blocks, adds 3
    cache.store(second, _row(20, 2.0), None)
    assert cache.bytes <= 5 * block_bytes and cache.evictions == 2
    # The shared prefix (most recent with its parents) survives; the first prompt's leaves
    # (its blocks 3 and 4, least recently used) were evicted.
    assert cache.lookup(first + [0]).tokens == 8
    assert cache.lookup(second + [0]).tokens == 20
    for _ in range(20):  # many distinct prompts: never past the bound
        cache.store(np.random.default_rng(_).integers(100, 200, 24).tolist(), _row(24, 3.0), None)
        assert cache.bytes <= 5 * block_bytes
