"""Draft tree shapes: what a drafter grows each round, as `--tree` and the calibration name it.

`StaticTree` (chains, Medusa-style choice lists) and `DynamicTree` (EAGLE-2's total_token,
depth, top_k), `parse_tree_spec` for `--tree`, `describe` for the stats. The runtime's
drafters grow them (`drafters.tree_search.grow`); calibration picks and records them; the CLI
parses them: one home below all three.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specx.runtime.trees import TreeError, choices_parents

__all__ = ["DynamicTree", "StaticTree", "TreeShape", "describe", "parse_tree_spec", "within"]


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree: `parents[i]` (-1 = root) and the top-k `ranks[i]` of each node."""

    parents: np.ndarray
    ranks: np.ndarray
    is_chain: bool = False

    @classmethod
    def chain(cls, length: int) -> StaticTree:
        """A chain of `length` nodes, each the parent's most likely (or sampled) token."""
        if length < 1:
            raise TreeError(f"a chain needs at least 1 token, got {length}")
        return cls(np.arange(length) - 1, np.zeros(length, dtype=np.int64), is_chain=True)

    @classmethod
    def from_choices(cls, choices) -> StaticTree:
        """A Medusa-style choice list, e.g. [[0], [1], [0, 0]]."""
        parents, ranks = choices_parents(choices)
        return cls(parents, ranks)

    @property
    def max_nodes(self) -> int:  # noqa: D102
        return len(self.parents)

    @property
    def forwarded_nodes(self) -> int:
        """Nodes a drafter feeds its model while growing this tree: those with children."""
        return int(np.isin(np.arange(len(self.parents)), self.parents).sum())


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's tree parameters, meaning what the official EAGLE code means by them.

    `total_token` counts the root: the tree has `total_token - 1` draft nodes. `depth`
    counts expansions after the root's children: nodes sit on `depth + 1` levels. The
    defaults are the official defaults (total_token 60, depth 7, top_k 10: 59 nodes on
    up to 8 levels). `dynamic:60,7,10` on the command line is this tree.
    """

    total_token: int = 60
    depth: int = 7
    top_k: int = 10

    def __post_init__(self) -> None:
        if self.total_token < 2 or self.depth < 0 or self.top_k < 1:
            raise TreeError(
                f"dynamic tree parameters need total_token >= 2 (it counts the root), depth "
                f">= 0 and top_k >= 1, got {self.total_token},{self.depth},{self.top_k}"
            )

    @classmethod
    def of_nodes(cls, nodes: int, levels: int, top_k: int) -> DynamicTree:
        """The tree of `nodes` draft nodes on `levels` levels.

        How specx read `dynamic:` before it took the official meaning (calibrations recorded
        then are converted alike: `specx.manifest_types.DynamicChoice`).
        """
        return cls(nodes + 1, levels - 1, top_k)

    @property
    def nodes(self) -> int:
        """Draft nodes (the root excluded)."""
        return self.total_token - 1

    @property
    def levels(self) -> int:
        """Levels of draft nodes under the root."""
        return self.depth + 1

    @property
    def max_nodes(self) -> int:  # noqa: D102
        return self.nodes

    @property
    def forwarded_nodes(self) -> int:
        """Nodes a drafter feeds its model while growing this tree (every frontier but the last)."""
        return self.top_k * self.depth


TreeShape = StaticTree | DynamicTree


def within(shape: TreeShape, budget: int | None) -> TreeShape:
    """A chain shape cut to `budget` nodes (a prefix of the same chain); others unchanged."""
    if budget is None or not getattr(shape, "is_chain", False) or budget >= shape.max_nodes:
        return shape
    return StaticTree.chain(max(budget, 1))


def parse_tree_spec(spec: str) -> TreeShape:
    """`chain:K`, `dynamic:TOTAL,DEPTH,TOPK`, `static:FILE` or a JSON choice list.

    Parsed whole: a form with a number missing (`dynamic:60,7`, `chain:`) is an error naming
    the form, not a tree with defaults filled in.
    """
    import json
    from pathlib import Path

    kind, _, argument = spec.partition(":")
    try:
        if Path(spec).is_file():
            return StaticTree.from_choices(json.loads(Path(spec).read_text(encoding="utf-8")))
        if kind == "chain":
            return StaticTree.chain(int(argument))
        if kind == "dynamic":
            values = [int(v) for v in argument.split(",")]
            if len(values) != 3:
                raise ValueError(f"dynamic: takes 3 numbers, got {len(values)}")
            return DynamicTree(*values)
        if kind == "static":
            return StaticTree.from_choices(json.loads(Path(argument).read_text(encoding="utf-8")))
        return StaticTree.from_choices(json.loads(spec))
    except (ValueError, TypeError, OSError) as e:
        raise TreeError(
            f"bad tree {spec!r}: use chain:K, dynamic:TOTAL,DEPTH,TOPK (EAGLE-2's total_token, "
            f"depth, top_k), static:FILE or a JSON choice list ({e})"
        ) from e


def describe(shape: TreeShape) -> str:
    """The shape as `--tree` spells it (a choice list by its node count)."""
    if isinstance(shape, DynamicTree):
        return f"dynamic:{shape.total_token},{shape.depth},{shape.top_k}"
    if shape.is_chain:
        return f"chain:{shape.max_nodes}"
    return f"static ({shape.max_nodes} nodes)"
