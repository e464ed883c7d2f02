"""Tree attention is right: each node of a tree, in one forward, equals its path run alone."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import FAMILIES
from specx.artifact import load_manifest
from specx.masks import causal_mask
from specx.runtime.plain_decoding import prefill
from specx.runtime.targets.ort import OrtTarget


def random_tree(rng, size):
    """Parent index per node (-1 = child of the prefix); parents precede children."""
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, size)]


def path_to(parents, node):
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_nodes_equal_their_paths(family, artifacts, rng):
    target = OrtTarget(load_manifest(artifacts[family]), threads=2)
    vocab = target.vocab_size
    prompt = rng.integers(0, vocab, 11).tolist()
    size = 12
    parents = random_tree(rng, size)
    tokens = rng.integers(0, vocab, size)
    depth = np.array([len(path_to(parents, i)) - 1 for i in range(size)])

    cache = target.allocate_cache(1, 64)
    prefill(target, cache, [prompt])
    prefix = len(prompt)
    mask = np.zeros((1, 1, size, prefix + size), dtype=bool)
    mask[..., :prefix] = True
    for i in range(size):
        mask[0, 0, i, [prefix + j for j in path_to(parents, i)]] = True
    write_pos = np.array([prefix])
    tree = target.forward(cache, tokens[None], (prefix + depth)[None], mask, write_pos).logits[0]

    for node in range(size):
        sequence = prompt + tokens[path_to(parents, node)].tolist()
        fresh = target.allocate_cache(1, 64)
        zeros = np.zeros(1, dtype=np.int64)
        n = len(sequence)
        alone = target.forward(
            fresh, np.array([sequence]), np.arange(n)[None], causal_mask(zeros, n, n), zeros
        ).logits[0, -1]
        np.testing.assert_allclose(tree[node], alone, atol=1e-4, err_msg=f"node {node}")
