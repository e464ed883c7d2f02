"""Verification rules against exact distributions, by enumerating every random decision.

For a tiny vocabulary, a coin that branches on every Bernoulli and categorical draw
gives the exact probability of each emitted sequence (and, for sampled drafts, every
draw of the draft is enumerated too). Lossless means: for each emitted prefix s that
continues, the next emitted token is distributed as the target's p(. | s). Broken
verifiers kept here show that this check has power.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest

from broken_verifiers import accept_without_zeroing, resample_from_p
from specx.runtime.trees import DraftTree
from specx.runtime.verification import (
    Verdict,
    verify,
    verify_deterministic,
    verify_greedy,
    verify_sampled,
)

V = 4


class _Branch(Exception):
    def __init__(self, options):
        self.options = options


class ScriptedCoin:
    """Replays a fixed list of decisions; at the first new decision, asks to branch."""

    def __init__(self, script):
        self.script, self.step, self.prob = script, 0, 1.0

    def _decide(self, options):
        options = [(value, p) for value, p in options if p > 0]
        if self.step == len(self.script):
            raise _Branch(options)
        value = self.script[self.step]
        self.step += 1
        self.prob *= dict(options)[value]
        return value

    def bernoulli(self, p):
        return self._decide([(True, min(p, 1.0)), (False, 1.0 - min(p, 1.0))])

    def categorical(self, probs):
        probs = probs / probs.sum()
        return self._decide(list(enumerate(probs)))


def exact_outcomes(run):
    """[(probability, result)] over every decision branch of run(coin)."""
    outcomes, pending = [], [[]]
    while pending:
        script = pending.pop()
        coin = ScriptedCoin(script)
        try:
            result = run(coin)
        except _Branch as branch:
            pending += [script + [value] for value, _ in branch.options]
            continue
        outcomes.append((coin.prob, result))
    return outcomes


class Target:
    """A target whose next-token distribution depends on the context (token path)."""

    def __init__(self, rng, sparse=True):
        self.rng, self.sparse, self.table = rng, sparse, {}

    def p(self, context):
        if context not in self.table:
            logits = self.rng.standard_normal(V) * 1.5
            if self.sparse and self.rng.random() < 0.5:
                logits[self.rng.integers(V)] = -np.inf  # support mismatch with the draft
            probs = np.exp(logits - logits.max())
            self.table[context] = probs / probs.sum()
        return self.table[context]

    def probs_for(self, draft):
        """target_probs [1 + n, V] for a draft: row 0 the root, row i + 1 node i."""
        contexts = [()]
        for i in range(len(draft)):
            parent = contexts[draft.parents[i] + 1]
            contexts.append(parent + (int(draft.tokens[i]),))
        return np.stack([self.p(c) for c in contexts])


def emitted_distribution(weighted_runs):
    """Joint distribution of emitted sequences from [(weight, draft, outcomes)]."""
    joint = defaultdict(float)
    for weight, draft, outcomes in weighted_runs:
        for prob, verdict in outcomes:
            joint[tuple(verdict.emitted(draft))] += weight * prob
    return joint


def assert_lossless(joint, target):
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-12)
    longest = max(len(s) for s in joint)
    for k in range(longest):
        # next-token mass after each prefix of length k, among sequences that continue
        following = defaultdict(lambda: np.zeros(V))
        for sequence, prob in joint.items():
            if len(sequence) > k:
                following[sequence[:k]][sequence[k]] += prob
        for prefix, mass in following.items():
            np.testing.assert_allclose(
                mass / mass.sum(),
                target.p(prefix),
                atol=1e-9,
                err_msg=f"next-token distribution after {prefix}",
            )


TREE_PARENTS = np.array([-1, -1, -1, 0, 0, 1, 3])  # three root children, depth up to 3


def deterministic_drafts(rng, parents, count=6):
    """Drafts with distinct sibling tokens (as top-k or n-gram trees have)."""
    drafts = []
    for _ in range(count):
        tokens = np.zeros(len(parents), dtype=np.int64)
        for node in range(-1, len(parents)):
            children = np.flatnonzero(parents == node)
            tokens[children] = rng.permutation(V)[: len(children)]
        drafts.append(DraftTree(tokens, parents))
    return drafts


@pytest.mark.parametrize("parents", [np.array([-1, 0, 1]), TREE_PARENTS])
def test_deterministic_rule_is_lossless(parents):
    rng = np.random.default_rng(0)
    target = Target(rng)
    for draft in deterministic_drafts(rng, parents):
        probs = target.probs_for(draft)
        outcomes = exact_outcomes(lambda coin, p=probs, d=draft: verify_deterministic(p, d, coin))
        assert_lossless(emitted_distribution([(1.0, draft, outcomes)]), target)


def sampled_drafts(parents, q_of):
    """Every draw of a tree whose nodes are sampled i.i.d. from q(parent context)."""
    n = len(parents)
    for tokens in itertools.product(range(V), repeat=n):
        contexts, weight = [()], 1.0
        for i, token in enumerate(tokens):
            parent = contexts[parents[i] + 1]
            weight *= q_of(parent)[token]
            contexts.append(parent + (token,))
        if weight > 0:
            probs = np.stack([q_of(contexts[parents[i] + 1]) for i in range(n)])
            yield weight, DraftTree(np.array(tokens), parents, probs)


def run_sampled(verifier, parents, seed):
    rng = np.random.default_rng(seed)
    target, draft_model = Target(rng), Target(rng)
    runs = []
    for weight, draft in sampled_drafts(parents, draft_model.p):
        probs = target.probs_for(draft)
        runs.append(
            (weight, draft, exact_outcomes(lambda coin, p=probs, d=draft: verifier(p, d, coin)))
        )
    return emitted_distribution(runs), target


@pytest.mark.parametrize(
    "parents",
    [np.array([-1, 0, 1]), np.array([-1, -1, 0]), np.array([-1, -1, -1, 1])],
    ids=["chain3", "two-siblings", "three-siblings"],
)
def test_sampled_rule_is_lossless(parents):
    joint, target = run_sampled(verify_sampled, parents, seed=1)
    assert_lossless(joint, target)


def test_greedy_rule_follows_argmax():
    draft = DraftTree(np.array([2, 1, 3, 0]), np.array([-1, -1, 1, 2]))
    # argmax per verify token: root -> 1 (node 1), node 1 -> 3 (node 2), node 2 -> 2 (no child 2)
    argmax = np.array([1, 0, 3, 2, 0])
    assert verify_greedy(argmax, draft) == Verdict([1, 2], 2)
    assert verify_greedy(np.array([1, 0, 3, 0, 1]), draft) == Verdict([1, 2, 3], 1)
    assert verify_greedy(np.array([3, 0, 0, 0, 0]), draft) == Verdict([], 3)
    assert verify_greedy(np.array([1, 0, 3, 0, 0]), DraftTree.empty()) == Verdict([], 1)


def test_one_hot_target_makes_every_rule_greedy():
    rng = np.random.default_rng(3)
    draft = deterministic_drafts(rng, TREE_PARENTS, 1)[0]
    logits = rng.standard_normal((1 + len(draft), V))
    one_hot = np.eye(V)[logits.argmax(-1)]
    expected = verify_greedy(logits.argmax(-1), draft)
    outcomes = exact_outcomes(lambda coin: verify(one_hot, draft, coin, greedy=False))
    assert outcomes == [(1.0, expected)]


def test_broken_sampled_verifier_is_caught():
    joint, target = run_sampled(resample_from_p, np.array([-1, 0]), seed=1)
    with pytest.raises(AssertionError):
        assert_lossless(joint, target)


def test_broken_deterministic_verifier_is_caught():
    rng = np.random.default_rng(0)
    target = Target(rng)
    draft = deterministic_drafts(rng, TREE_PARENTS, 1)[0]
    probs = target.probs_for(draft)
    outcomes = exact_outcomes(lambda coin: accept_without_zeroing(probs, draft, coin))
    with pytest.raises(AssertionError):
        assert_lossless(emitted_distribution([(1.0, draft, outcomes)]), target)
