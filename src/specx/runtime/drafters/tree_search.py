"""Growing draft trees with a model that scores the children of the nodes it is fed.

Two strategies over one `NodeForward` callback (the drafter's model):
- static shapes (chains, Medusa-style choice lists): depth by depth, node of rank r takes
  the parent's r-th most likely token, or a sample from q for sampled chains;
- EAGLE-2 dynamic trees, with the official code's parameters (`DynamicTree`): the root's
  `top_k` children are the first level; then `depth` times, expand the `top_k` best nodes
  of the last level (score = cumulative log-probability) by their `top_k` children; of all
  `top_k + depth * top_k**2` candidates keep the best `total_token - 1` (the official
  `total_token` counts the root), parents before children.

Nodes live in a per-batch *pool* in creation order (parents before children). The
callback forwards a set of pool nodes (the same count per row) and returns their logits;
the drafter behind it keeps whatever per-node state its model needs (KV slots, hiddens).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specx.runtime.sampling import SamplingParams, sample, sampling_probs
from specx.runtime.tree_shapes import DynamicTree, TreeShape
from specx.runtime.trees import DraftTree, TreeError, depths

__all__ = ["NodeForward", "grow"]

# forward(nodes [B, n] pool ids, tokens [B, n], parents [B, n] pool ids or -1) -> logits [B, n, V]
NodeForward = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def grow(
    shape: TreeShape,
    root_logits: np.ndarray,  # [B, V] the drafter's logits for the root's children
    forward: NodeForward,
    sampling: SamplingParams,
    rng: np.random.Generator,
    sample_chain: bool,
) -> tuple[list[DraftTree], list[np.ndarray]]:
    """Grows one draft tree per sequence.

    Returns:
        The trees, and per tree the pool id of each of its nodes (for the drafter's state).
    """
    if isinstance(shape, DynamicTree):
        return _grow_dynamic(shape, root_logits, forward)
    return _grow_static(shape, root_logits, forward, sampling, rng, sample_chain)


def _grow_static(shape, root_logits, forward, sampling, rng, sample_chain):
    batch, n = len(root_logits), shape.max_nodes
    if int(shape.ranks.max()) >= root_logits.shape[-1]:
        raise TreeError(
            f"the tree asks for rank {int(shape.ranks.max())} but the vocabulary has only "
            f"{root_logits.shape[-1]} tokens"
        )
    level_of = depths(shape.parents)
    has_children = np.isin(np.arange(n), shape.parents)
    sampled = sample_chain and not sampling.greedy
    tokens = np.zeros((batch, n), dtype=np.int64)
    confidence = np.zeros((batch, n))
    probs = None
    logits_of = {-1: root_logits}
    ranked: dict[int, np.ndarray] = {}
    normalizer: dict[int, np.ndarray] = {}
    for level in range(int(level_of.max()) + 1):
        nodes = np.flatnonzero(level_of == level)
        for node in nodes:
            parent_logits = logits_of[int(shape.parents[node])]
            if sampled:
                q = sampling_probs(parent_logits, sampling)
                tokens[:, node] = sample(q, rng)
                probs = np.zeros((batch, n, q.shape[-1])) if probs is None else probs
                probs[:, node] = q
                confidence[:, node] = q[np.arange(batch), tokens[:, node]]
            else:
                parent = int(shape.parents[node])
                if parent not in ranked:  # one sort per parent, not per child
                    ranked[parent] = np.argsort(-parent_logits, axis=-1, kind="stable")
                    normalizer[parent] = _logsumexp(parent_logits)
                tokens[:, node] = ranked[parent][:, shape.ranks[node]]
                chosen = parent_logits[np.arange(batch), tokens[:, node]]
                confidence[:, node] = np.exp(chosen - normalizer[parent])
        expand = nodes[has_children[nodes]]
        if expand.size:
            ids = np.broadcast_to(expand, (batch, len(expand)))
            parents = np.broadcast_to(shape.parents[expand], (batch, len(expand)))
            logits = forward(ids, tokens[:, expand], parents)
            logits_of.update({int(node): logits[:, k] for k, node in enumerate(expand)})
    trees = [
        DraftTree(tokens[b], shape.parents, None if probs is None else probs[b], confidence[b])
        for b in range(batch)
    ]
    return trees, [np.arange(n)] * batch


def _top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values along the last axis, largest first (O(V), not a sort)."""
    part = np.argpartition(-values, k - 1, axis=-1)[..., :k]
    order = np.argsort(-np.take_along_axis(values, part, -1), axis=-1, kind="stable")
    return np.take_along_axis(part, order, -1)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    return logits - _logsumexp(logits)[..., None]


def _logsumexp(logits: np.ndarray) -> np.ndarray:
    top = logits.max(-1)
    return top + np.log(np.exp(logits - top[..., None]).sum(-1))


def _grow_dynamic(shape: DynamicTree, root_logits, forward):
    batch, k = len(root_logits), min(shape.top_k, root_logits.shape[-1])
    pool_tokens: list[np.ndarray] = []
    pool_parents: list[np.ndarray] = []
    pool_scores: list[np.ndarray] = []
    pool_depth: list[np.ndarray] = []

    def add(tokens, parents, scores, depth):
        start = sum(t.shape[1] for t in pool_tokens)
        pool_tokens.append(tokens)
        pool_parents.append(parents)
        pool_scores.append(scores)
        pool_depth.append(np.full(tokens.shape, depth))
        return start + np.arange(tokens.shape[1])

    logp = _log_softmax(root_logits)
    top = _top_k(logp, k)
    frontier_scores = np.take_along_axis(logp, top, -1)
    frontier = np.broadcast_to(add(top, np.full(top.shape, -1), frontier_scores, 0), top.shape)
    frontier_tokens = top
    for level in range(1, shape.levels):
        logits = forward(frontier, frontier_tokens, _gather(pool_parents, frontier))
        logp = _log_softmax(logits)  # [B, k, V]
        children = _top_k(logp, k)  # [B, k, k]
        scores = frontier_scores[:, :, None] + np.take_along_axis(logp, children, -1)
        parents = np.repeat(frontier, k, axis=1)
        ids = add(children.reshape(batch, -1), parents, scores.reshape(batch, -1), level)
        best = np.argsort(-scores.reshape(batch, -1), axis=-1, kind="stable")[:, :k]
        frontier = ids[best]
        frontier_tokens = np.take_along_axis(children.reshape(batch, -1), best, -1)
        frontier_scores = np.take_along_axis(scores.reshape(batch, -1), best, -1)
    tokens = np.concatenate(pool_tokens, 1)
    parents = np.concatenate(pool_parents, 1)
    scores = np.concatenate(pool_scores, 1)
    level_of = np.concatenate(pool_depth, 1)
    trees, pool_ids = [], []
    for b in range(batch):
        # Best scores first; ties go to shallower nodes, so a parent is never dropped
        # for its child (a child's score is at most its parent's).
        order = np.lexsort((np.arange(scores.shape[1]), level_of[b], -scores[b]))
        keep = np.sort(order[: shape.nodes])
        index = {int(p): i for i, p in enumerate(keep)}
        tree_parents = np.array([index[int(p)] if p >= 0 else -1 for p in parents[b, keep]])
        parent_scores = np.where(parents[b, keep] >= 0, scores[b, parents[b, keep]], 0.0)
        confidence = np.exp(scores[b, keep] - parent_scores)
        trees.append(DraftTree(tokens[b, keep], tree_parents, confidence=confidence))
        pool_ids.append(keep)
    return trees, pool_ids


def _gather(pool_parents: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    return np.take_along_axis(np.concatenate(pool_parents, 1), ids, -1)
