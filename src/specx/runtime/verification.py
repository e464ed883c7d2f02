"""Lossless verification of a draft tree against the target, one sequence at a time.

Terms. The *root* is the last emitted token; `target_probs[k]` is the target's
distribution (after the shared sampling transform) for the token that follows verify
token k (k = 0 the root, k = i + 1 draft node i). Walking down from the root, draft
nodes are *accepted* while the rule says so; at the first node where no child is
accepted (or at a leaf) one more token is drawn from the (residual) target
distribution: the *correction* after a rejection or the *bonus* after a leaf. A round
emits accepted tokens + that one, so its acceptance length counts the bonus.

Rules (all keep the output distribution equal to the target's):
- greedy: accept the child whose token is argmax p; emit argmax p at the stop.
- sampled siblings, i.i.d. from q (SpecInfer, Miao et al. 2023; a chain is the
  one-child case, Leviathan et al. 2023 / Chen et al. 2023): for each child x, accept
  with probability min(1, p(x)/q(x)); on rejection p <- norm(max(0, p - q)); if all
  are rejected, sample from the residual p.
- deterministic siblings (top-k, n-gram, as EAGLE-2/3 and Medusa trees): q is one-hot,
  so for each distinct child c, accept with probability p(c) under the current
  renormalised p; on rejection p(c) <- 0 and renormalise; then sample the residual.

Random decisions go through a `Coin`, so tests can replace it with one that
enumerates every outcome and computes emitted-token distributions exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specx.runtime.trees import DraftTree

__all__ = [
    "Coin",
    "RandomCoin",
    "Verdict",
    "verify",
    "verify_deterministic",
    "verify_greedy",
    "verify_sampled",
]


class Coin(Protocol):
    """The source of randomness of verification."""

    def bernoulli(self, p: float) -> bool:
        """True with probability p."""
        ...

    def categorical(self, probs: np.ndarray) -> int:
        """An index drawn from probs [V] (sums to 1)."""
        ...


class RandomCoin:
    """A `Coin` backed by a numpy Generator."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def bernoulli(self, p: float) -> bool:  # noqa: D102
        return bool(self.rng.random() < p)

    def categorical(self, probs: np.ndarray) -> int:  # noqa: D102
        cdf = np.cumsum(probs)
        return int(
            min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"), len(probs) - 1)
        )


@dataclass(frozen=True)
class Verdict:
    """Accepted draft nodes (root-to-leaf order) and the token drawn at the stop."""

    accepted: list[int]
    next_token: int

    def emitted(self, draft: DraftTree) -> list[int]:
        """Tokens this round emits: the accepted draft tokens, then the next token."""
        return [int(draft.tokens[i]) for i in self.accepted] + [self.next_token]


def verify_greedy(target_argmax: np.ndarray, draft: DraftTree) -> Verdict:
    """Greedy rule. target_argmax: [1 + n] argmax of the target at each verify token."""
    accepted: list[int] = []
    node = -1
    while True:
        want = int(target_argmax[node + 1])
        match = next((c for c in draft.children(node) if draft.tokens[c] == want), None)
        if match is None:
            return Verdict(accepted, want)
        accepted.append(match)
        node = match


def verify_deterministic(target_probs: np.ndarray, draft: DraftTree, coin: Coin) -> Verdict:
    """Deterministic-siblings rule. target_probs: [1 + n, V]."""
    accepted: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1].astype(np.float64)
        tried: set[int] = set()
        for child in draft.children(node):
            token = int(draft.tokens[child])
            if token in tried:
                continue
            if coin.bernoulli(p[token]):
                accepted.append(child)
                node = child
                break
            tried.add(token)
            p[token] = 0.0
            p = p / p.sum()
        else:
            return Verdict(accepted, coin.categorical(p))


def verify_sampled(target_probs: np.ndarray, draft: DraftTree, coin: Coin) -> Verdict:
    """Sampled-siblings rule (SpecInfer; chains as the one-child case). target_probs: [1 + n, V].

    `draft.probs[i]` is the q that node i was drawn from; siblings share it.
    """
    assert draft.probs is not None, "sampled verification needs the draft probabilities"
    accepted: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1].astype(np.float64)
        for child in draft.children(node):
            token = int(draft.tokens[child])
            q = draft.probs[child].astype(np.float64)
            if coin.bernoulli(min(1.0, p[token] / q[token])):
                accepted.append(child)
                node = child
                break
            residual = np.maximum(p - q, 0.0)
            # p <= q everywhere means p == q, and then x is never rejected.
            p = residual / residual.sum() if residual.sum() > 0 else p
        else:
            return Verdict(accepted, coin.categorical(p))


def verify(target_probs: np.ndarray, draft: DraftTree, coin: Coin, greedy: bool) -> Verdict:
    """Applies the rule that matches how the draft was made (see the module docstring)."""
    if greedy:
        return verify_greedy(target_probs.argmax(-1), draft)
    if draft.probs is None:
        return verify_deterministic(target_probs, draft, coin)
    return verify_sampled(target_probs, draft, coin)
