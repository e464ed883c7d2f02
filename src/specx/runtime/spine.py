"""Exact greedy trees on row-invariant builds: decide only on the spine, carry the rest.

The rule. A quantized build (static INT8, weight-only int4/int8 computing in int8, OpenVINO at
int4/int8; `greedy_identity: "chains"` in its manifest) computes a token's logits bit for bit
as plain decoding does when the token's row sees its keys where plain decoding puts them:
the prefix in the cache, then its ancestors at verify slots 0 .. depth - 1. Keys past a row's
own slot are masked and do not matter (chains rest on that; `specx.graphs.row_invariance`).
A tree node whose path leaves that layout sees the same keys at other slots: attention's sums
run in another order, change in a last bit, and an int8 activation on a rounding boundary
turns that into a whole quantization step, so its logits are not plain decoding's.

The *spine* is the draft's leading run of nodes that form a chain from the root (node i's
parent is i - 1): verify slots 0 .. s. The root's and the spine's logits are exact, so a
greedy walk is exact up to and including the first accepted node off the spine (accepted on
its parent's exact logits). That node ends the round in the next token's place (its KV row
is not kept); what the walk accepted past it, and the token it drew there, are *provisional*
(`settle`). The next round verifies them again at the head of its tree (`arrange`), in slots
1 .. k of a chain from the root, where they are exact. Every emitted token is then decided on
exact logits, and a tree's acceptance is not lost: what it accepted off the spine is resolved
one round late, in the same forward as the next draft.

`arrange` also puts every tree in spine-first order: depth-first, each node's earliest child
(the carried token, else the drafter's first, its best) before its others, so the spine runs
down the drafter's best path rather than stopping at the first branch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specx.runtime.trees import DraftTree
from specx.runtime.verification import Verdict

__all__ = ["Arranged", "Settled", "arrange", "settle", "spine_length"]


def spine_length(parents: np.ndarray) -> int:
    """Leading draft nodes that form a chain from the root (node i's parent is i - 1)."""
    off = np.flatnonzero(np.asarray(parents) != np.arange(len(parents)) - 1)
    return int(off[0]) if off.size else len(parents)


@dataclass(frozen=True)
class Arranged:
    """The tree the target verifies and where its nodes came from."""

    tree: DraftTree
    draft: DraftTree  # what the drafter proposed (and a controller kept)
    # [n] int64: the draft node each node is, -1 for a carried token; None: `tree` is `draft`
    origin: np.ndarray | None = None

    @classmethod
    def as_drafted(cls, draft: DraftTree) -> Arranged:
        """The draft verified as it is."""
        return cls(draft, draft)

    def drafted(self, accepted: Sequence[int]) -> tuple[list[int], bool]:
        """The longest prefix of the `accepted` path that is the drafter's, as its nodes.

        And whether that is the whole path (a carried token the drafter did not draft ends it).
        """
        if self.origin is None:
            return list(accepted), True
        nodes = self.origin[np.asarray(accepted, dtype=np.int64)].tolist()
        whole = next((k for k, node in enumerate(nodes) if node < 0), len(nodes))
        return nodes[:whole], whole == len(nodes)


def arrange(carry: Sequence[int], draft: DraftTree, limit: int) -> Arranged:
    """`draft` merged under a chain of `carry` tokens, spine first, at most `limit` nodes.

    A draft node whose path of tokens from the root is a prefix of `carry` is that carried
    node; the others hang where their parents are. Draft nodes past `limit` are dropped in
    the draft's own order (with their descendants), as a controller trims a draft.
    """
    if not carry:
        order = _spine_first(draft.parents.tobytes())
        if order is None:  # chains, and trees drafted depth first
            return Arranged.as_drafted(draft)
        tree = DraftTree(draft.tokens[order], _reindexed(draft.parents, order))
        return Arranged(tree, draft, order)
    tokens, parents = list(carry[:limit]), list(range(-1, min(len(carry), limit) - 1))
    origin = [-1] * len(tokens)
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True))}
    merged: list[int | None] = []  # draft node -> merged node (None: dropped)
    for token, parent in zip(draft.tokens.tolist(), draft.parents.tolist(), strict=True):
        at = -1 if parent < 0 else merged[parent]
        node = None if at is None else child.get((at, token))
        if node is None and at is not None and len(tokens) < limit:
            node = child[at, token] = len(tokens)
            tokens.append(token)
            parents.append(at)
            origin.append(-1)
        if node is not None and origin[node] < 0:
            origin[node] = len(merged)
        merged.append(node)
    order = _spine_first(np.array(parents, dtype=np.int64).tobytes())
    if order is None:
        order = np.arange(len(tokens))
    tree = DraftTree(np.array(tokens, np.int64)[order], _reindexed(np.array(parents), order))
    return Arranged(tree, draft, np.array(origin, dtype=np.int64)[order])


@functools.lru_cache(maxsize=4096)
def _spine_first(parents: bytes) -> np.ndarray | None:
    """The nodes in depth-first order, each node's children by index (parents as int64).

    None where that is their order already: a round's tree costs no copy then.
    """
    parent_of = np.frombuffer(parents, np.int64)
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parent_of.tolist()):
        children.setdefault(parent, []).append(node)
    order, stack = [], list(reversed(children.get(-1, [])))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children.get(node, [])))
    if order == list(range(len(order))):
        return None
    result = np.array(order, dtype=np.int64)
    result.flags.writeable = False  # shared by every caller
    return result


def _reindexed(parents: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Parents of the nodes taken in `order`, as indices into that order (-1 stays)."""
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    old = np.asarray(parents, dtype=np.int64)[order]
    return np.where(old < 0, -1, position[np.maximum(old, 0)])


@dataclass(frozen=True)
class Settled:
    """A row's verdict on an arranged tree, in the terms each of its readers needs."""

    verdict: Verdict  # what the round keeps and emits
    judged: list[int]  # the drafter's nodes the target's walk accepted (controllers, observers)
    drafted: list[int] | None  # `verdict`'s path as the drafter's nodes; None: through a carry
    carry: list[int]  # provisional tokens, verified at the head of the row's next tree


def settle(verdict: Verdict, arranged: Arranged, spine_only: bool) -> Settled:
    """`verdict` on `arranged.tree`; where `spine_only`, cut to what exact logits decided.

    The cut ends after the first accepted node off the spine, whose token becomes the next
    token; the tokens the walk accepted past it, then its next token, are the carry. A walk
    that stays on the spine is exact as it is.
    """
    judged, _ = arranged.drafted(verdict.accepted)
    carry: list[int] = []
    if spine_only:
        tree, spine = arranged.tree, spine_length(arranged.tree.parents)
        off = next((k for k, node in enumerate(verdict.accepted) if node >= spine), None)
        if off is not None:
            past = verdict.accepted[off + 1 :]
            carry = [int(tree.tokens[n]) for n in past] + [verdict.next_token]
            node = verdict.accepted[off]
            verdict = Verdict(verdict.accepted[:off], int(tree.tokens[node]))
    kept, whole = arranged.drafted(verdict.accepted)
    return Settled(verdict, judged, kept if whole else None, carry)
