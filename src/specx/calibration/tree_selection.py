"""Choosing draft trees from acceptance statistics (pure functions).

With `p[d, k]` the probability that the target's token at depth d+1 is the draft's rank-k
candidate (given the path so far was accepted; `specx.calibration.acceptance`), a node
reached by ranks (k_1, ..., k_m) is accepted with probability prod_i p[i-1, k_i] under
the independence assumption Medusa makes, and a tree's expected number of accepted draft
tokens is the sum of that over its nodes:

    E[accepted | tree] = sum over nodes v of prod over (depth, rank) on v's path of p

A child's probability is at most its parent's, so the N most probable nodes of the
infinite rank tree always form a tree: taking them greedily (best frontier node first,
Medusa's construction) is optimal for every budget N. Speedup is then predicted from
measured costs (`specx.calibration.costs`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

__all__ = ["RankedTree", "best_trees", "chain_expected", "expected_accepted"]


@dataclass(frozen=True)
class RankedTree:
    """A tree as Medusa-style choices (rank paths, parents first) and its expected gain."""

    choices: tuple[tuple[int, ...], ...]
    expected_accepted: float

    @property
    def nodes(self) -> int:  # noqa: D102
        return len(self.choices)

    @property
    def depth(self) -> int:  # noqa: D102
        return max((len(c) for c in self.choices), default=0)


def _path_probability(p: np.ndarray, path: tuple[int, ...]) -> float:
    depth, top_k = p.shape
    if len(path) > depth or any(k >= top_k for k in path):
        return 0.0
    return float(np.prod([p[d, k] for d, k in enumerate(path)]))


def expected_accepted(p: np.ndarray, choices) -> float:
    """E[accepted draft tokens] of the tree given by `choices` (rank paths)."""
    return sum(_path_probability(p, tuple(c)) for c in choices)


def chain_expected(p: np.ndarray, length: int) -> float:
    """E[accepted] of a chain of `length` top-1 drafts: sum_m prod_{d<m} p[d, 0]."""
    return expected_accepted(p, [(0,) * m for m in range(1, length + 1)])


def best_trees(p: np.ndarray, max_nodes: int) -> list[RankedTree]:
    """The optimal tree for every budget 1..max_nodes (element N-1 has N nodes).

    Greedy: repeatedly add the most probable node whose parent is in the tree; ties go to
    the shallower, then lower-rank node, so the result is deterministic. Nodes of zero
    probability are never added: the list stops early when no node can gain anything.
    """
    p = np.asarray(p, dtype=float)
    frontier: list[tuple[float, int, tuple[int, ...]]] = [
        (-_path_probability(p, (k,)), 1, (k,)) for k in range(p.shape[1])
    ]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    total = 0.0
    trees = []
    while frontier and len(chosen) < max_nodes:
        negative, _, path = heapq.heappop(frontier)
        if negative >= 0:
            break
        chosen.append(path)
        total -= negative
        trees.append(RankedTree(tuple(chosen), total))
        for k in range(p.shape[1]):
            child = (*path, k)
            heapq.heappush(frontier, (-_path_probability(p, child), len(child), child))
    return trees
