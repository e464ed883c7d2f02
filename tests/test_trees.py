"""Tree helpers on hand-made trees."""

from __future__ import annotations

import numpy as np
import pytest

from specx.runtime.trees import (
    DraftTree,
    TreeError,
    ancestor_mask,
    chain_parents,
    choices_parents,
    depths,
    validate_parents,
    verify_parents,
)

#        root
#       /    \
#      0      1
#     / \     |
#    2   3    4
#    |
#    5
PARENTS = np.array([-1, -1, 0, 0, 1, 2])


def test_depths_and_ancestors():
    assert depths(PARENTS).tolist() == [0, 0, 1, 1, 1, 2]
    mask = ancestor_mask(PARENTS)
    assert np.flatnonzero(mask[5]).tolist() == [0, 2, 5]
    assert np.flatnonzero(mask[4]).tolist() == [1, 4]
    assert mask.sum() == 6 + 4 + 1


def test_verify_parents_prepend_the_root():
    parents = verify_parents(PARENTS)
    assert parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert depths(parents).tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert np.flatnonzero(ancestor_mask(parents)[6]).tolist() == [0, 1, 3, 6]


def test_chain_is_one_branch():
    assert chain_parents(4).tolist() == [-1, 0, 1, 2]
    tree = DraftTree.chain([7, 8, 9])
    assert tree.children(-1) == [0] and tree.children(1) == [2] and tree.children(2) == []


def test_choices_build_a_sorted_static_tree():
    parents, ranks = choices_parents([[1], [0, 0], [0], [0, 1], [1, 0], [0, 0, 0]])
    # sorted: [0], [1], [0,0], [0,1], [1,0], [0,0,0]
    assert parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert ranks.tolist() == [0, 1, 0, 1, 0, 0]


@pytest.mark.parametrize(
    ("choices", "message"),
    [
        ([], "empty"),
        ([[0], [0]], "duplicate"),
        ([[0], [1, 0]], r"no parent \[1\]"),
        ([[0], [-1]], "ranks >= 0"),
        ([[0], []], "non-empty"),
    ],
)
def test_bad_choices(choices, message):
    with pytest.raises(TreeError, match=message):
        choices_parents(choices)


@pytest.mark.parametrize(
    ("parents", "message"),
    [
        ([-1, 1], "a cycle"),
        ([-1, 2, 0], "a parent after its child"),
        ([-2], "use -1"),
    ],
)
def test_bad_parents(parents, message):
    with pytest.raises(TreeError, match=message):
        validate_parents(parents)


def test_tree_over_budget():
    with pytest.raises(TreeError, match="at most 4"):
        validate_parents(chain_parents(5), max_nodes=4)


def test_draft_tree_checks_lengths():
    with pytest.raises(TreeError, match="2 tokens but 1 parents"):
        DraftTree(np.array([1, 2]), np.array([-1]))


def _path_logits(vocab: int, peak: float):
    """Deterministic logits for any token path (a stand-in draft model), `peak` on token 0."""

    def logits_of(path: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng(abs(hash(path)) % 2**32)
        logits = rng.normal(size=vocab)
        logits[rng.integers(vocab)] += peak
        return logits

    return logits_of


def _official_eagle2_paths(total_token, depth, top_k, logits_of) -> set[tuple[int, ...]]:
    """EAGLE-2's tree as the official code describes it, by brute force over token paths."""

    def logp(path):
        logits = logits_of(path)
        return logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()

    def children(score, path):
        scores = logp(path)
        return [(score + scores[t], (*path, int(t))) for t in np.argsort(-scores)[:top_k]]

    level = children(0.0, ())
    candidates = list(level)
    for _ in range(depth):
        frontier = sorted(level, key=lambda c: -c[0])[:top_k]
        level = [child for score, path in frontier for child in children(score, path)]
        candidates += level
    return {path for _, path in sorted(candidates, key=lambda c: -c[0])[: total_token - 1]}


@pytest.mark.parametrize("peak", [0.0, 6.0])
def test_dynamic_defaults_build_the_official_eagle2_default_tree(peak):
    from specx.runtime.drafters.tree_search import grow
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.tree_shapes import DynamicTree, parse_tree_spec

    shape = parse_tree_spec("dynamic:60,7,10")
    assert shape == DynamicTree() and (shape.nodes, shape.levels) == (59, 8)
    logits_of = _path_logits(vocab=32, peak=peak)
    paths: dict[int, tuple[int, ...]] = {}

    def forward(nodes, tokens, parents):
        out = []
        for node, token, parent in zip(nodes[0], tokens[0], parents[0], strict=True):
            paths[int(node)] = (*paths.get(int(parent), ()), int(token))
            out.append(logits_of(paths[int(node)]))
        return np.array(out)[None]

    root = logits_of(())[None]
    (tree,), _ = grow(shape, root, forward, SamplingParams(), np.random.default_rng(0), False)
    grown = set()
    for i in range(len(tree)):
        path, node = [], i
        while node >= 0:
            path.insert(0, int(tree.tokens[node]))
            node = int(tree.parents[node])
        grown.add(tuple(path))
    assert len(tree) == 59 and grown == _official_eagle2_paths(60, 7, 10, logits_of)
    assert max(len(p) for p in grown) <= 8
    if peak:  # a confident model: the kept tree reaches every one of the 8 levels
        assert max(len(p) for p in grown) == 8


def test_dynamic_parameters_are_checked_with_their_meaning():
    from specx.runtime.tree_shapes import DynamicTree, parse_tree_spec

    assert DynamicTree.of_nodes(8, 4, 2) == DynamicTree(9, 3, 2)
    assert parse_tree_spec("dynamic:2,0,3").max_nodes == 1
    with pytest.raises(TreeError, match="total_token >= 2 \\(it counts the root\\)"):
        parse_tree_spec("dynamic:1,3,2")


@pytest.mark.parametrize("spec", ["dynamic:60,7", "dynamic:60", "dynamic:", "dynamic", "chain:"])
def test_a_tree_spec_with_a_number_missing_is_refused_naming_the_forms(spec):
    """Parsed whole: defaults are never filled in for a number left out."""
    from specx.runtime.tree_shapes import parse_tree_spec

    with pytest.raises(TreeError, match="use chain:K, dynamic:TOTAL,DEPTH,TOPK"):
        parse_tree_spec(spec)
