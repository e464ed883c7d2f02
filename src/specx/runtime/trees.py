"""Draft trees: parent indices, and the masks, positions and paths derived from them.

A draft hangs off the *root*, the last emitted token (not yet in the KV cache). Draft
node i has `parents[i] = -1` when it is a child of the root, else the index of an
earlier node, so parents always precede children and there are no cycles. A chain
is the one-branch tree `parents = [-1, 0, 1, ...]`.

The target verifies root + draft in one forward of N = 1 + n tokens; in that forward
token 0 is the root and token k is draft node k - 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specx.errors import SpecxError

__all__ = [
    "DraftTree",
    "TreeError",
    "ancestor_mask",
    "chain_parents",
    "choices_parents",
    "depth_of",
    "depths",
    "followed",
    "validate_parents",
    "verify_parents",
]


class TreeError(SpecxError):
    """A tree or choice list is malformed (empty, cyclic, parent after child, too big)."""


def validate_parents(
    parents: Sequence[int] | np.ndarray, max_nodes: int | None = None
) -> np.ndarray:
    """Checks draft parent indices and returns them as int64.

    Raises:
        TreeError: a parent is not -1 or an earlier node (which also rules out cycles),
            or the tree has more than `max_nodes` nodes.
    """
    array = np.asarray(parents, dtype=np.int64).reshape(-1)
    for i, parent in enumerate(array.tolist()):
        if parent >= i:
            kind = "a cycle" if parent == i else "a parent after its child"
            raise TreeError(f"node {i} has parent {parent}: {kind}; parents must precede children")
        if parent < -1:
            raise TreeError(f"node {i} has parent {parent}; use -1 for a child of the root")
    if max_nodes is not None and len(array) > max_nodes:
        raise TreeError(f"the tree has {len(array)} nodes; this run allows at most {max_nodes}")
    return array


def chain_parents(n: int) -> np.ndarray:
    """Parents of a chain of n draft tokens: [-1, 0, 1, ..., n-2]."""
    return np.arange(n, dtype=np.int64) - 1


def choices_parents(choices: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """A static tree from a Medusa-style choice list.

    `[0, 1]` means: rank 0 at depth 1, then rank 1 among its children. Choices are sorted
    by (length, value), so parents precede children and each depth is contiguous.

    Returns:
        (parents [n], ranks [n]): ranks[i] is node i's top-k rank among its siblings.

    Raises:
        TreeError: empty list, a negative rank, a duplicate path, or a path whose
            prefix is not itself a choice.
    """
    if len(choices) == 0:
        raise TreeError("the choice list is empty")
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    if len(paths) != len(choices):
        raise TreeError("the choice list has duplicate paths")
    index = {path: i for i, path in enumerate(paths)}
    parents, ranks = [], []
    for path in paths:
        if len(path) == 0 or min(path) < 0:
            raise TreeError(f"choice {list(path)} must be a non-empty list of ranks >= 0")
        if len(path) > 1 and path[:-1] not in index:
            raise TreeError(f"choice {list(path)} has no parent {list(path[:-1])} in the list")
        parents.append(index[path[:-1]] if len(path) > 1 else -1)
        ranks.append(path[-1])
    return np.array(parents, dtype=np.int64), np.array(ranks, dtype=np.int64)


def verify_parents(draft_parents: np.ndarray) -> np.ndarray:
    """Parents over the verify tokens [root, draft...]: root -1, draft node i -> parent + 1."""
    return np.concatenate([[-1], np.asarray(draft_parents, dtype=np.int64) + 1])


def depths(parents: np.ndarray) -> np.ndarray:
    """Depth of each node: 0 for nodes whose parent is -1."""
    out = np.zeros(len(parents), dtype=np.int64)
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            out[i] = out[parent] + 1
    return out


def depth_of(draft: DraftTree) -> int:
    """Levels of a draft tree (0 for an empty draft)."""
    return int(depths(draft.parents).max()) + 1 if len(draft) else 0


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """[n, n] bool: row i is True at i's ancestors and at i itself (what node i may see)."""
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


@dataclass(frozen=True)
class DraftTree:
    """The draft a drafter proposes for one sequence.

    `probs[i]` is the distribution node i was sampled from (siblings sampled i.i.d.
    share it); None means the nodes were chosen deterministically (top-k, n-gram
    matches, greedy), which selects the matching lossless verification rule.
    `confidence[i]`, when the drafter knows it, is the draft probability of node i's
    token given its parent (calibration relates it to acceptance; verification ignores it).
    """

    tokens: np.ndarray  # [n] int64
    parents: np.ndarray  # [n] int64, -1 = child of the root
    probs: np.ndarray | None = None  # [n, V] float
    confidence: np.ndarray | None = None  # [n] float

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise TreeError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        if self.probs is not None and len(self.probs) != len(self.tokens):
            raise TreeError(f"{len(self.tokens)} tokens but {len(self.probs)} probability rows")

    @classmethod
    def empty(cls) -> DraftTree:
        """No draft: the round degenerates to one plain decoding step."""
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: np.ndarray | None = None) -> DraftTree:
        """A chain of draft tokens."""
        return cls(np.asarray(tokens, dtype=np.int64), chain_parents(len(tokens)), probs)

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """Draft nodes whose parent is `node` (-1 = the root), in index order."""
        return np.flatnonzero(self.parents == node).tolist()


def followed(draft: DraftTree, tokens: Sequence[int]) -> list[int]:
    """The nodes `tokens` run through from the root: the path emitting them would accept.

    Node of depth d + 1 on the path is the child whose token is `tokens[d]`; the path ends
    where no child matches or the tokens run out.
    """
    # (parent, token) -> node: a deterministic draft's siblings carry distinct tokens
    pairs = zip(draft.parents.tolist(), draft.tokens.tolist(), strict=True)
    nodes = {pair: i for i, pair in enumerate(pairs)}
    path: list[int] = []
    node = -1
    for token in tokens:
        node = nodes.get((node, token), -1)
        if node < 0:
            break
        path.append(node)
    return path
