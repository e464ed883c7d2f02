"""`DraftModelDrafter`: an independent small model (same vocabulary) drafts a chain or tree."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specx.errors import SpecxError
from specx.runtime.kv_cache import KVCache
from specx.runtime.masks import causal_mask
from specx.runtime.ort_target import OrtTarget
from specx.runtime.sampling import SamplingParams, sample, sampling_probs
from specx.runtime.trees import DraftTree, ancestor_mask, chain_parents, choices_parents, depths

__all__ = ["DraftModelDrafter", "VocabMismatchError", "check_same_vocabulary"]


class VocabMismatchError(SpecxError):
    """Draft and target do not share a vocabulary."""


def check_same_vocabulary(target: OrtTarget, draft: OrtTarget) -> None:
    """Refuses a draft model whose token ids cannot mean the same as the target's.

    Raises:
        VocabMismatchError: different vocabulary sizes, or different tokenizer files.
    """
    if target.vocab_size != draft.vocab_size:
        raise VocabMismatchError(
            f"draft model {draft.manifest.root} has vocabulary {draft.vocab_size}, the target "
            f"{target.manifest.root} has {target.vocab_size}; a draft model must share the "
            "target's vocabulary"
        )
    ours, theirs = target.manifest.data["files"], draft.manifest.data["files"]
    if "tokenizer.json" in ours and "tokenizer.json" in theirs:
        if ours["tokenizer.json"] != theirs["tokenizer.json"]:
            raise VocabMismatchError(
                f"draft model {draft.manifest.root} has a different tokenizer.json than the "
                f"target {target.manifest.root} (sha256 differs)"
            )


class DraftModelDrafter:
    """Drafts with its own ONNX model and KV cache, one forward per tree depth.

    Shape: a chain of `num_draft_tokens`, or a static tree from Medusa-style `choices`
    (child of rank r = the draft's r-th most likely token). Chains at temperature > 0,
    and trees with `iid_siblings`, sample their tokens from the draft's q (recorded for
    the sampled verification rule); otherwise tokens are chosen deterministically.
    """

    name = "draft-model"

    def __init__(
        self,
        model: OrtTarget,
        num_draft_tokens: int = 4,
        choices: Sequence[Sequence[int]] | None = None,
        iid_siblings: bool = False,
    ):
        if choices is None:
            if num_draft_tokens < 1:
                raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
            self.parents, self.ranks = (
                chain_parents(num_draft_tokens),
                np.zeros(num_draft_tokens, int),
            )
        else:
            self.parents, self.ranks = choices_parents(choices)
        self.model = model
        self.is_chain = choices is None
        self.iid_siblings = iid_siblings
        self.max_nodes = len(self.parents)
        self.depth = depths(self.parents)
        self.visible = ancestor_mask(self.parents)
        self.has_children = np.isin(np.arange(self.max_nodes), self.parents)
        # A depth is forwarded (and its nodes get KV rows) when any node on it has children.
        self.forwarded = np.isin(self.depth, self.depth[self.has_children])
        self.cache: KVCache | None = None
        self.base = np.zeros(0, dtype=np.int64)

    def start(self, prompts: Sequence[Sequence[int]], capacity: int) -> None:  # noqa: D102
        self.cache = self.model.allocate_cache(len(prompts), capacity)
        self.base = np.zeros(len(prompts), dtype=np.int64)

    def _catch_up(self, histories: Sequence[Sequence[int]]) -> np.ndarray:
        """Feeds each sequence's tokens the draft has not seen; returns last-token logits."""
        cache = self.cache
        pending = [list(h[start:]) for h, start in zip(histories, cache.lengths, strict=True)]
        width = max(1, max(len(p) for p in pending))
        ids = np.zeros((len(pending), width), dtype=np.int64)
        for b, tokens in enumerate(pending):
            ids[b, : len(tokens)] = tokens
        write_pos = cache.lengths.copy()
        positions = write_pos[:, None] + np.arange(width)
        mask = causal_mask(write_pos, width, int(write_pos.max()) + width)
        logits = self.model.forward(cache, ids, positions, mask, write_pos).logits
        last = np.array([max(len(p) - 1, 0) for p in pending])
        cache.lengths[:] = [len(h) for h in histories]
        return logits[np.arange(len(pending)), last]

    def _choose(
        self, logits: np.ndarray, rank: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens [B] for one node given its parent's logits [B, V], and q when sampled."""
        sampled = not sampling.greedy and (self.is_chain or self.iid_siblings)
        if sampled:
            q = sampling_probs(logits, sampling)
            return sample(q, rng), q
        order = np.argsort(-logits, axis=-1, kind="stable")
        return order[:, rank], None

    def propose(self, histories, active, sampling: SamplingParams, rng) -> list[DraftTree]:  # noqa: D102
        batch, n = len(histories), self.max_nodes
        parent_logits = {-1: self._catch_up(histories)}
        self.base = self.cache.lengths.copy()
        tokens = np.zeros((batch, n), dtype=np.int64)
        probs = None
        for d in range(int(self.depth.max()) + 1):
            nodes = np.flatnonzero(self.depth == d)
            for node in nodes:
                tokens[:, node], q = self._choose(
                    parent_logits[int(self.parents[node])], int(self.ranks[node]), sampling, rng
                )
                if q is not None:
                    probs = np.zeros((batch, n, q.shape[-1])) if probs is None else probs
                    probs[:, node] = q
            if self.forwarded[nodes[0]]:
                logits = self._forward_nodes(nodes, tokens[:, nodes], d)
                parent_logits.update({int(node): logits[:, k] for k, node in enumerate(nodes)})
        return [
            DraftTree(tokens[b], self.parents, None if probs is None else probs[b])
            if active[b]
            else DraftTree.empty()
            for b in range(batch)
        ]

    def _forward_nodes(self, nodes: np.ndarray, node_tokens: np.ndarray, depth: int) -> np.ndarray:
        """One draft forward over the nodes of one depth; they see the prefix and ancestors."""
        base, first = self.base, int(nodes[0])
        kv_len = int(base.max()) + first + len(nodes)
        mask = np.zeros((len(base), 1, len(nodes), kv_len), dtype=bool)
        for b, start in enumerate(base.tolist()):
            mask[b, 0, :, :start] = True
            mask[b, 0, :, start : start + first + len(nodes)] = self.visible[
                nodes, : first + len(nodes)
            ]
        positions = np.broadcast_to((base + depth)[:, None], node_tokens.shape)
        return self.model.forward(self.cache, node_tokens, positions, mask, base + first).logits

    def accept(self, row: int, draft: DraftTree, accepted: list[int]) -> None:  # noqa: D102
        kept = 0
        while kept < len(accepted) and self.forwarded[accepted[kept]]:
            kept += 1
        self.cache.keep_path(row, int(self.base[row]), np.array(accepted[:kept]))
        self.cache.lengths[row] = self.base[row] + kept
