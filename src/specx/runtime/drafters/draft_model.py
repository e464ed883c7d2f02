"""`DraftModelDrafter`: an independent small model (same vocabulary) drafts a chain or tree."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specx.errors import SpecxError
from specx.runtime.drafters.node_slots import NodeSlots
from specx.runtime.drafters.tree_search import grow
from specx.runtime.kv_cache import KVCache
from specx.runtime.sampling import SamplingParams
from specx.runtime.targets.base import DecoderBackend
from specx.runtime.tree_shapes import TreeShape, within
from specx.runtime.trees import DraftTree

__all__ = ["DraftModelDrafter", "VocabMismatchError", "check_same_vocabulary"]


class VocabMismatchError(SpecxError):
    """Draft and target do not share a vocabulary."""


def check_same_vocabulary(target: DecoderBackend, draft: DecoderBackend) -> None:
    """Refuses a draft model whose token ids cannot mean the same as the target's.

    Raises:
        VocabMismatchError: different vocabulary sizes, different tokenizer files, or a
            tokenizer on one side only.
    """
    if target.vocab_size != draft.vocab_size:
        raise VocabMismatchError(
            f"draft model {draft.manifest.root} has vocabulary {draft.vocab_size}, the target "
            f"{target.manifest.root} has {target.vocab_size}; a draft model must share the "
            "target's vocabulary"
        )
    ours, theirs = target.manifest.files, draft.manifest.files
    if ("tokenizer.json" in ours) != ("tokenizer.json" in theirs):
        has, lacks = (target, draft) if "tokenizer.json" in ours else (draft, target)
        raise VocabMismatchError(
            f"{has.manifest.root} has a tokenizer.json and {lacks.manifest.root} has none, so "
            "specx cannot check that draft and target ids mean the same tokens: export both "
            "from checkpoints with their tokenizer.json"
        )
    if ours.get("tokenizer.json") != theirs.get("tokenizer.json"):
        raise VocabMismatchError(
            f"draft model {draft.manifest.root} has a different tokenizer.json than the "
            f"target {target.manifest.root} (sha256 differs)"
        )


class DraftModelDrafter:
    """Drafts with its own ONNX model and KV cache, one forward per tree depth.

    Tree shapes: a chain (at temperature > 0 its tokens are sampled from the draft's q,
    recorded for the sampled verification rule), a static choice tree (`iid_siblings`
    samples siblings from q instead of taking the top ranks), or an EAGLE-2 dynamic
    tree. The cache rows of accepted draft tokens are kept (compacted), so only the
    tokens the draft has not seen are fed at the next round.
    """

    name = "draft-model"
    sizes_own_drafts = False
    learns_across_requests = False
    taps = "none"

    def __init__(self, model: DecoderBackend, shape: TreeShape, iid_siblings: bool = False):
        self.model = model
        self.shape = shape
        self.iid_siblings = iid_siblings
        self.max_nodes = shape.max_nodes
        self.scratch_slots = shape.forwarded_nodes
        self.cache: KVCache | None = None
        self.slots = NodeSlots(np.zeros(0))
        self.pool_ids: list[np.ndarray] = []

    def start(self, prompts: Sequence[Sequence[int]], capacity: int, taps=None) -> None:
        """An empty cache for the batch: the prompts go in at `prepare` (or a catch-up)."""
        self.cache = self.model.allocate_cache(len(prompts), capacity)

    def prepare(self, histories: Sequence[Sequence[int]]) -> None:
        """The draft model's prefill, the roots left out: the proposal feeds them."""
        self._catch_up([h[:-1] for h in histories])

    def _live_cache(self) -> KVCache:
        """The batch's cache, which `start` made."""
        if self.cache is None:
            raise RuntimeError("the draft model's drafter was used before start()")
        return self.cache

    def _catch_up(self, histories: Sequence[Sequence[int]]) -> np.ndarray:
        """Feeds each sequence's tokens the draft has not seen; returns last-token logits."""
        cache = self._live_cache()
        # A finished row may have kept more accepted rows than it emitted tokens.
        cache.lengths[:] = np.minimum(cache.lengths, [len(h) for h in histories])
        pending = [list(h[start:]) for h, start in zip(histories, cache.lengths, strict=True)]
        output, last = self.model.feed(cache, pending, cache.lengths.copy())
        cache.lengths[:] = [len(h) for h in histories]
        return output.logits[np.arange(len(pending)), last]

    def _forward_nodes(self, nodes: np.ndarray, tokens: np.ndarray, parents: np.ndarray):
        write_pos, depth, mask = self.slots.place(nodes, parents)
        positions = self.slots.base[:, None] + depth
        return self.model.forward(self._live_cache(), tokens, positions, mask, write_pos).logits

    def propose(self, histories, active, sampling: SamplingParams, rng, budget=None):  # noqa: D102
        root_logits = self._catch_up(histories)
        self.slots = NodeSlots(self._live_cache().lengths)
        shape = within(self.shape, budget)
        sample_chain = getattr(shape, "is_chain", False) or self.iid_siblings
        trees, self.pool_ids = grow(
            shape, root_logits, self._forward_nodes, sampling, rng, sample_chain
        )
        return [
            tree if is_active else DraftTree.empty()
            for tree, is_active in zip(trees, active, strict=True)
        ]

    def accept(self, row: int, draft: DraftTree, accepted: list[int], taps=None) -> None:  # noqa: D102
        if not len(draft):
            return  # nothing drafted for the row (or no propose this round): catch-up feeds it
        offsets = self.slots.forwarded_prefix(row, self.pool_ids[row][accepted])
        cache = self._live_cache()
        cache.keep_path(row, int(self.slots.base[row]), offsets)
        cache.lengths[row] = self.slots.base[row] + len(offsets)
