"""Deliberately wrong verifiers, kept to prove that the distribution tests have power."""

from __future__ import annotations

from specx.runtime.verification import Verdict, verify


def resample_from_p(target_probs, draft, coin):
    """Bug: after a rejection, sample from p instead of the residual max(0, p - q)."""
    node = -1
    accepted = []
    while True:
        p = target_probs[node + 1]
        children = draft.children(node)
        for child in children:
            token = int(draft.tokens[child])
            if coin.bernoulli(min(1.0, p[token] / draft.probs[child][token])):
                accepted.append(child)
                node = child
                break
        else:
            return Verdict(accepted, coin.categorical(p))


def accept_without_zeroing(target_probs, draft, coin):
    """Bug: deterministic rule that does not remove a rejected child from p."""
    node, accepted = -1, []
    while True:
        p = target_probs[node + 1]
        for child in draft.children(node):
            if coin.bernoulli(p[int(draft.tokens[child])]):
                accepted.append(child)
                node = child
                break
        else:
            return Verdict(accepted, coin.categorical(p))


def broken_verify(target_probs, draft, coin, greedy):
    """`verify` with the bug matching the draft kind (greedy left intact)."""
    if greedy:
        return verify(target_probs, draft, coin, greedy)
    if draft.probs is None:
        return accept_without_zeroing(target_probs, draft, coin)
    return resample_from_p(target_probs, draft, coin)
