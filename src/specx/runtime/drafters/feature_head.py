"""`FeatureHeadDrafter`: EAGLE-3, EAGLE-1/2 and MTP heads drafting from the target's features.

At position t the head reads the token x_{t+1} and a feature of x_t: the target's (taps,
projected for EAGLE-3) where the target has computed it, else the head's own output for
the parent node. So each round the head first catches up on the positions whose target
features arrived since (the root and the accepted tokens), then grows the tree from its
own outputs. Rows written while drafting are overwritten at the next catch-up, which is
why nothing of the head cache needs compacting.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specx.artifact import Manifest
from specx.drafter_name import FEATURE_HEADS
from specx.errors import ArtifactError
from specx.runtime.drafters.chain_graph import DraftChain, HeadChain, StepChain
from specx.runtime.drafters.node_slots import NodeSlots
from specx.runtime.drafters.tree_search import grow
from specx.runtime.sampling import SamplingParams
from specx.runtime.targets import graph_runtime, open_decoder, open_stateless
from specx.runtime.tree_shapes import DynamicTree, StaticTree, TreeShape, within
from specx.runtime.trees import DraftTree

__all__ = ["FeatureHeadDrafter"]


class FeatureHeadDrafter:
    """Drafts with the artifact's autoregressive head (`drafter.kind` eagle3, eagle or mtp)."""

    sizes_own_drafts = False
    learns_across_requests = False

    def __init__(
        self,
        manifest: Manifest,
        shape: TreeShape,
        threads: int | None = None,
        one_call: bool = True,
    ):
        spec = manifest.drafter
        if spec is None or spec.kind not in FEATURE_HEADS:
            raise ArtifactError(f"{manifest.root} has no EAGLE or MTP head")
        self.name, self.taps = spec.kind, spec.taps
        self.head = open_decoder(manifest, threads, graph="draft_head")
        self.projection = (
            None if spec.projection is None else open_stateless(manifest, spec.projection, threads)
        )
        self.to_target = None
        if spec.d2t:
            d2t = np.load(manifest.path(spec.d2t))
            self.to_target = np.arange(len(d2t)) + d2t
        self.target_vocab = manifest.model.vocab_size
        self.shape = shape
        self.max_nodes = shape.max_nodes
        self.scratch_slots = shape.forwarded_nodes
        if isinstance(shape, DynamicTree):
            self.pool_size = shape.top_k + shape.depth * shape.top_k**2
        else:
            self.pool_size = shape.max_nodes
        # Greedy chains of 2+ tokens run as one call where the artifact has the graph, as a
        # loop of forwards where the head is on specx's kernels; at a temperature chains are
        # sampled from q, per depth (the sampled-chain rule).
        chain = isinstance(shape, StaticTree) and shape.is_chain and shape.max_nodes >= 2
        self.chain: HeadChain | None = None
        if one_call and chain and DraftChain.available(manifest):
            self.chain = DraftChain(manifest, threads)
        elif one_call and chain and graph_runtime(manifest, "draft_head") == "cpu":
            self.chain = StepChain(self.head, self.to_target)
        self.chain_parents = np.arange(shape.max_nodes) - 1

    def _project(self, taps: np.ndarray) -> np.ndarray:
        return taps if self.projection is None else self.projection(taps[None])[0]

    def _to_target_logits(self, logits: np.ndarray) -> np.ndarray:
        """Draft-vocabulary logits -> target vocabulary (ids outside the draft vocab: -inf)."""
        if self.to_target is None:
            return logits
        full = np.full((*logits.shape[:-1], self.target_vocab), -np.inf, dtype=logits.dtype)
        full[..., self.to_target] = logits
        return full

    def start(self, prompts: Sequence[Sequence[int]], capacity: int, taps) -> None:  # noqa: D102
        batch = len(prompts)
        self.cache = self.head.allocate_cache(batch, capacity)
        self.features = np.zeros((batch, capacity, self.head.tap_width), dtype=np.float32)
        self.known = np.zeros(batch, dtype=np.int64)
        # Copied: a backend may reuse its prefill's output memory. The head's own prefill
        # waits for `prepare` (or the first proposal).
        self.unprojected: list[list[np.ndarray]] = [[np.array(t, np.float32)] for t in taps]

    def prepare(self, histories) -> None:
        """The head's prefill, up to the root's position: the proposal feeds that one."""
        self._catch_up([h[:-1] for h in histories])

    def _project_pending(self) -> None:
        """Projects the taps `accept` kept, every row's in one call, into `features`.

        Lazily, when the head next reads features: a request the controller keeps plain
        would otherwise pay EAGLE-3's projection at the end of every stretch, one call per
        row, for positions no draft may ever read (what that cost:
        docs/decisions.md#taps-projected-when-read).
        """
        rows = [b for b, taps in enumerate(self.unprojected) if taps]
        if not rows:
            return
        chunks = [np.concatenate(self.unprojected[b]) for b in rows]
        projected, offset = self._project(np.concatenate(chunks)), 0
        for b, chunk in zip(rows, chunks, strict=True):
            start, count = int(self.known[b]), len(chunk)
            self.features[b, start : start + count] = projected[offset : offset + count]
            self.known[b] += count
            offset += count
            self.unprojected[b] = []

    def _pending(self, histories):
        """Per row: the first unseen slot, how many positions, their tokens and features."""
        self._project_pending()
        starts = self.cache.lengths.copy()
        counts = np.maximum(np.array([len(h) - 1 for h in histories]) - starts, 0)
        tokens = [h[s + 1 : s + 1 + n] for h, s, n in zip(histories, starts, counts, strict=True)]
        features = [
            self.features[b, s : s + n] for b, (s, n) in enumerate(zip(starts, counts, strict=True))
        ]
        return starts, counts, tokens, features

    def _catch_up(self, histories) -> tuple[np.ndarray, np.ndarray]:
        """Feeds the positions whose target features the head has not seen.

        Returns:
            The last position's logits [B, V] and hidden output [B, d].
        """
        starts, counts, tokens, features = self._pending(histories)
        out, last = self.head.feed(self.cache, tokens, starts, features)
        self.cache.lengths[:] = starts + counts
        rows = np.arange(len(histories))
        assert out.taps is not None  # a draft head's graph always returns its hidden output
        return out.logits[rows, last], out.taps[rows, last]

    def _propose_chain(
        self, chain: HeadChain, histories, active, length: int
    ) -> list[DraftTree] | None:
        """The greedy chain in one call (`chain`); None when it would overflow the cache."""
        starts, counts, tokens, features = self._pending(histories)
        steps = max(length - 1, 1)  # the graph's Loop needs a step; a 1-node chain is cut below
        width = max(1, int(counts.max()))
        if not chain.fits(self.cache, starts, width, steps):
            return None
        ids, probs = chain(self.cache, tokens, features, starts, steps)
        self.cache.lengths[:] = starts + counts
        return [
            DraftTree(
                ids[b, :length],
                self.chain_parents[:length],
                None,
                probs[b, :length].astype(np.float64),
            )
            if is_active
            else DraftTree.empty()
            for b, is_active in enumerate(active)
        ]

    def _forward_nodes(self, nodes: np.ndarray, tokens: np.ndarray, parents: np.ndarray):
        write_pos, depth, mask = self.slots.place(nodes, parents)
        rows = np.arange(len(nodes))[:, None]
        features = np.where(
            (parents >= 0)[..., None],
            self.node_hidden[rows, np.maximum(parents, 0)],
            self.root_hidden[:, None],
        )
        out = self.head.forward(
            self.cache, tokens, self.slots.base[:, None] + depth, mask, write_pos, features
        )
        self.node_hidden[rows, nodes] = out.taps
        return self._to_target_logits(out.logits)

    def propose(self, histories, active, sampling: SamplingParams, rng, budget=None):  # noqa: D102
        shape = within(self.shape, budget)
        if self.chain is not None and sampling.greedy:
            trees = self._propose_chain(self.chain, histories, active, shape.max_nodes)
            if trees is not None:
                return trees
        root_logits, self.root_hidden = self._catch_up(histories)
        self.slots = NodeSlots(self.cache.lengths)
        self.node_hidden = np.zeros(
            (len(histories), self.pool_size, self.head.tap_width), dtype=np.float32
        )
        trees, _ = grow(
            shape,
            self._to_target_logits(root_logits),
            self._forward_nodes,
            sampling,
            rng,
            sample_chain=getattr(shape, "is_chain", False),
        )
        return [t if a else DraftTree.empty() for t, a in zip(trees, active, strict=True)]

    def accept(self, row: int, draft: DraftTree, accepted: list[int], taps) -> None:  # noqa: D102
        self.unprojected[row].append(taps)  # projected when the head next reads features
