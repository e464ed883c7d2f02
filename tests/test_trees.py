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
