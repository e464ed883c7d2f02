"""`MedusaDrafter`: Medusa heads propose a static tree from the target's last hidden state.

Head k gives the distribution of the token k + 1 places after the root, from the target's
feature of the token before the root. Heads are independent of the path, so a tree node of
depth k and rank r is the r-th most likely token of head k whatever its parent.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specx.artifact import Manifest
from specx.errors import ArtifactError
from specx.runtime.drafters.tree_search import grow
from specx.runtime.sampling import SamplingParams
from specx.runtime.targets import open_stateless
from specx.runtime.tree_shapes import StaticTree, TreeShape
from specx.runtime.trees import DraftTree, TreeError, depths

__all__ = ["MEDUSA_DEFAULT_TREE", "MedusaDrafter"]

# `mc_sim_7b_63`, the default tree published with Medusa (medusa/model/medusa_choices.py).
MEDUSA_DEFAULT_TREE = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4],
    [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8],
    [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0],
    [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0],
    [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0],
    [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]  # fmt: skip


class MedusaDrafter:
    """Static trees (default `mc_sim_7b_63`) or chains from the artifact's Medusa heads."""

    name = "medusa"
    sizes_own_drafts = False
    learns_across_requests = False
    taps = "last"
    scratch_slots = 0

    def __init__(
        self, manifest: Manifest, shape: TreeShape | None = None, threads: int | None = None
    ):
        spec = manifest.drafter
        if spec is None or spec.kind != "medusa" or spec.medusa_heads is None:
            raise ArtifactError(f"{manifest.root} has no Medusa heads")
        shape = shape or StaticTree.from_choices(MEDUSA_DEFAULT_TREE)
        if not isinstance(shape, StaticTree):
            raise TreeError("Medusa drafts static trees or chains, not dynamic trees")
        num_heads = spec.medusa_heads
        if int(depths(shape.parents).max()) + 1 > num_heads:
            raise TreeError(
                f"the tree is {int(depths(shape.parents).max()) + 1} deep but the artifact has "
                f"{num_heads} Medusa heads"
            )
        self.heads = open_stateless(manifest, spec.graph, threads)
        self.shape = shape
        self.max_nodes = shape.max_nodes

    def start(self, prompts: Sequence[Sequence[int]], capacity: int, taps) -> None:  # noqa: D102
        self.last_feature = np.stack([t[-1] for t in taps])

    def propose(self, histories, active, sampling: SamplingParams, rng, budget=None):  # noqa: D102
        logits = self.heads(self.last_feature[:, None])[:, 0]  # [B, heads, V]
        node_depth = depths(self.shape.parents)

        def children_logits(nodes, tokens, parents):  # every node of a level: the next head
            head = logits[:, node_depth[nodes[0, 0]] + 1]
            return np.repeat(head[:, None], nodes.shape[1], axis=1)

        trees, _ = grow(
            self.shape,
            logits[:, 0],
            children_logits,
            sampling,
            rng,
            sample_chain=self.shape.is_chain,
        )
        return [t if a else DraftTree.empty() for t, a in zip(trees, active, strict=True)]

    def accept(self, row: int, draft: DraftTree, accepted: list[int], taps) -> None:  # noqa: D102
        self.last_feature[row] = taps[-1]
