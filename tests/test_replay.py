"""Replays: a deterministic drafter judged at plain steps, and the controllers that use them."""

from __future__ import annotations

import numpy as np
import pytest

from cost_curves import FixedCurve
from specx.artifact import load_manifest
from specx.runtime.controller import (
    AdaptiveController,
    ConfidenceController,
    Replay,
    RoundCosts,
    Schedule,
    Stretch,
    Trial,
    controller_for,
    replayed_guess,
)
from specx.runtime.drafters.ngram import NGramDrafter
from specx.runtime.drafters.suffix import SuffixDrafter, SuffixOptions
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.sampling import SamplingParams
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets.ort import OrtTarget
from specx.runtime.trees import DraftTree, followed
from specx.runtime.verification import RandomCoin, verify

ONE = np.array([True])


def test_followed_walks_the_tree_along_the_tokens():
    # root -> 7 (0) -> 8 (2) -> 9 (3); root -> 5 (1) -> 6 (4)
    tree = DraftTree(np.array([7, 5, 8, 9, 6]), np.array([-1, -1, 0, 2, 1]))
    assert followed(tree, [7, 8, 9, 1]) == [0, 2, 3]
    assert followed(tree, [5, 6]) == [1, 4]
    assert followed(tree, [5, 8]) == [1]
    assert followed(tree, [4]) == [] and followed(tree, []) == []


def test_a_replay_judges_only_the_levels_its_tokens_reach():
    chain = DraftTree.chain([3, 4, 5, 6])
    assert Replay.of(chain, [3, 4, 9, 9, 9]).judged == 3  # two held, the third judged
    assert Replay.of(chain, [3, 4]).judged == 2  # no token left to judge the third
    assert Replay.of(chain, [3, 4, 5, 6, 7]).judged == 4  # never deeper than the draft
    assert Replay.of(DraftTree.empty(), [3]).judged == 0


def _proposed(drafter, prompt, history) -> DraftTree:
    drafter.start([prompt], 0)
    (draft,) = drafter.propose([history], ONE, SamplingParams(), np.random.default_rng(0))
    return draft


@pytest.mark.parametrize(
    "make", [lambda: NGramDrafter(5, max_matches=2), lambda: SuffixDrafter(SuffixOptions(8))]
)
def test_a_replay_is_what_the_drafter_would_have_proposed_from_the_past_alone(make, rng):
    prompt = rng.integers(1, 9, 30).tolist()
    history = prompt + rng.integers(1, 9, 12).tolist()
    positions = list(range(len(prompt) + 2, len(history), 3))
    replayer = make()
    replayer.start([prompt], 0)
    replayed = replayer.replay(0, history, positions)
    assert [t for t, _ in replayed] == positions
    for t, draft in replayed:
        expected = _proposed(make(), prompt, history[:t])
        assert draft.tokens.tolist() == expected.tokens.tolist()
        assert draft.parents.tolist() == expected.parents.tolist()
    assert any(len(d) for _, d in replayed)  # the test compares drafts, not empties
    # The future never leaks: other tokens after the last position leave its draft alone.
    other = make()
    other.start([prompt], 0)
    changed = history[: positions[-1]] + [(t % 8) + 1 for t in history[positions[-1] :]]
    (_, draft), *_ = other.replay(0, changed, positions[-1:])
    assert draft.tokens.tolist() == replayed[-1][1].tokens.tolist()
    # What the drafter has seen is not replayed again.
    assert replayer.replay(0, history, positions[:1]) == []


def test_replays_have_the_law_of_verification_when_sampling():
    """A deterministic node is accepted with the target's probability of its token.

    So the child a sampled step runs through has the law of the child verification
    accepts; a replay learns acceptance as rounds would.
    """
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.ones(6))
    tree = DraftTree(np.array([2, 4]), np.array([-1, -1]))  # two deterministic siblings
    target = np.tile(probs, (3, 1))
    coin, n = RandomCoin(rng), 6000
    verified = [tuple(verify(target, tree, coin, False).accepted) for _ in range(n)]
    replayed = [tuple(followed(tree, [int(rng.choice(6, p=probs))])) for _ in range(n)]
    for outcome, p in (((0,), probs[2]), ((1,), probs[4]), ((), 1 - probs[2] - probs[4])):
        sigma = np.sqrt(p * (1 - p) / n)
        assert abs(verified.count(outcome) / n - p) < 4 * sigma
        assert abs(replayed.count(outcome) / n - p) < 4 * sigma


def _stretch(rounds: int, *replays: Replay) -> Stretch:
    return Stretch(rounds, rounds, 1.0, lambda row: replays)


def _known_costs() -> RoundCosts:
    costs = RoundCosts()
    costs.record_stretch(1.0)
    for width in (2, 3, 5):
        costs.record(width, 1.0 + 0.3 * (width - 1), 0.01)
    return costs


def test_an_idle_row_decides_from_its_replays_instead_of_probing():
    chain = DraftTree.chain([1, 2, 3, 4])
    held, missed = Replay.of(chain, [1, 2, 3, 4]), Replay.of(chain, [9, 9, 9, 9])
    for replays, expected in (((), 1), ((missed,) * 4, 0), ((held,) * 4, 4)):
        controller = AdaptiveController(costs=_known_costs(), schedule=Schedule(probe_every=8))
        controller.start(1, 4)
        controller.idled(_stretch(1))
        controller.next_probe[0] = 8  # idle until round 8, as after a draft that missed
        controller.idled(_stretch(controller.idle_rounds(ONE), *replays))
        # No replay: a one-node probe. Replays: the size the rule picks, no probe paid.
        assert controller.sizes(ONE)[0] == expected
    # Replays that missed keep the row idle, the wait doubled as after a probe that missed.
    controller.start(1, 4)
    controller.idled(_stretch(1, missed, missed, missed))
    controller.next_probe[0] = 8
    controller.idled(_stretch(controller.idle_rounds(ONE), missed))
    assert controller.sizes(ONE)[0] == 0 and controller.idle_rounds(ONE) > 0
    assert controller.interval[0] == 16


def test_a_window_of_asking_opens_only_where_its_replays_would_have_paid():
    sure = DraftTree(np.arange(4), np.arange(4) - 1, confidence=np.ones(4))
    held, missed = Replay.of(sure, [0, 1, 2, 3]), Replay.of(sure, [7, 7, 7, 7])
    for replays, asks in (((missed,) * 4, False), ((held,) * 4, True)):
        controller = ConfidenceController(costs=FixedCurve(0.1), schedule=Schedule(probe_every=4))
        controller.start(1, 4)
        controller.idled(_stretch(controller.idle_rounds(ONE), *replays))
        assert bool(controller.sizes(ONE)[0]) == asks
        # A window kept shut waits, doubled, for its next replays.
        assert (controller.idle_rounds(ONE) == 0) == asks
        assert controller.interval[0] == (4 if asks else 8)


def test_replays_decide_a_first_draft_at_a_dear_price_until_one_is_timed():
    """Replays that saw the first node accepted once in four: worth a round at the cheap guess
    (1.05 plain steps, which a head needs to try its first draft), not at the price a drafter
    that replays judge gets until a round with a draft is timed (1.5)."""
    chain = DraftTree.chain([1, 2, 3, 4])
    first, missed = Replay.of(chain, [1, 9, 9, 9]), Replay.of(chain, [9, 9, 9, 9])
    held = Replay.of(chain, [1, 2, 3, 4])
    chosen = []
    for shape, replays in ((None, (first, missed, missed, missed)),
                           (replayed_guess, (first, missed, missed, missed)),
                           (replayed_guess, (held,) * 4)):  # fmt: skip
        controller = AdaptiveController(costs=RoundCosts(shape=shape))
        controller.start(1, 4)
        controller.idled(_stretch(controller.idle_rounds(ONE), *replays))
        chosen.append(int(controller.sizes(ONE)[0]))
    # Drafts replays show paying are made at the dear price too (one node: a first draft).
    assert chosen == [1, 0, 1]


def test_replays_that_find_nothing_double_the_wait_taken():
    """At the dear untimed price a probe is affordable every 25 rounds: a lone row whose
    replays keep finding nothing waits 25, then 50, then 64 rounds (`max_probe_every`); an
    interval doubling beneath that floor kept the wait at 25, each stretch end costing the
    replays and the loop's re-entry (docs/decisions.md#backoff). Replays that hit a token
    bring the next probe back as soon as a probe that hit does."""
    chain = DraftTree.chain([1, 2, 3, 4])
    first, missed = Replay.of(chain, [1, 9, 9, 9]), Replay.of(chain, [9, 9, 9, 9])
    controller = AdaptiveController(costs=RoundCosts(shape=replayed_guess))
    controller.start(1, 4)
    waits = []
    for replays in [(missed,) * 4] * 4 + [(first, missed, missed, missed)]:
        controller.idled(_stretch(controller.idle_rounds(ONE), *replays))
        assert controller.sizes(ONE)[0] == 0
        waits.append(controller.idle_rounds(ONE) + 1)  # idle rounds, then the probe's
    assert waits == [25, 50, 64, 64, 25]


def test_replays_that_did_not_pay_wait_as_long_as_keeps_probes_affordable():
    """A stretch ended for replays, and the replays, cost about half a plain step: a lone
    suffix row whose replays did not pay waits as a probe would (25 rounds at 1.5 steps,
    within 2% of the time), not the doubled interval's 16, before its next replays."""
    sure = DraftTree(np.arange(4), np.arange(4) - 1, confidence=np.ones(4))
    missed = Replay.of(sure, [7, 7, 7, 7])
    waits = []
    for shape in (None, replayed_guess):
        controller = ConfidenceController(costs=RoundCosts(shape=shape))
        controller.start(1, 4)
        controller.idled(_stretch(controller.idle_rounds(ONE), missed, missed))
        assert controller.sizes(ONE)[0] == 0
        waits.append((controller.interval[0], controller.idle_rounds(ONE)))
    # Priced 1.05 steps, the doubled interval (16) is the longer; the wait taken is the
    # interval the next replays that do not pay double.
    assert waits == [(16, 15), (25, 24)]


def test_a_plain_step_costs_at_most_a_wider_round_or_an_ask():
    costs = RoundCosts()
    costs.record_stretch(2.0)  # priced while the request's first steps ran slow
    costs.record(3, 1.5, 0.1)
    assert costs.time(0) == 1.5
    costs.record_ask(1.2)
    assert costs.time(0) == 1.2
    costs.record_stretch(1.4)  # a stretch prices it again
    assert costs.time(0) == 1.4


def _replayed_rows(controller, rows: int, waits: list[int]) -> list[int]:
    """The rows `controller` has replayed after a stretch, its rows idle as `waits` say."""
    controller.start(rows, 4)
    if isinstance(controller, AdaptiveController):
        controller.next_probe[:] = waits
    else:
        controller.idle_until[:] = waits
    replayed: list[int] = []
    controller.idled(Stretch(1, rows, 1.0, lambda row: replayed.append(row) or ()))
    return replayed


def test_only_the_rows_that_decide_next_are_replayed():
    """A replay costs a proposal per step: rows idle past the next round are not replayed."""
    assert _replayed_rows(AdaptiveController(costs=_known_costs()), 2, [3, 40]) == [0]
    assert _replayed_rows(ConfidenceController(), 1, [0]) == [0]
    assert _replayed_rows(ConfidenceController(), 1, [40]) == []
    # Suffix drafting's rows in a batch are not replayed: reading every row's tokens into its
    # trie cost more than the asks it spared.
    assert _replayed_rows(ConfidenceController(), 2, [0, 0]) == []


class CountingReplays:
    """A drafter whose replays are counted (the default controllers ask for them)."""

    def __init__(self, drafter):
        self._drafter, self.replays = drafter, 0

    def __getattr__(self, name):
        return getattr(self._drafter, name)

    def replay(self, row, history, positions):
        replayed = self._drafter.replay(row, history, positions)
        self.replays += len(replayed)
        return replayed


@pytest.mark.parametrize(
    ("make", "batches"),
    [(lambda: NGramDrafter(5), (1, 3)), (lambda: SuffixDrafter(SuffixOptions(8)), (1,))],
    ids=["ngram", "suffix"],
)
def test_greedy_decoding_with_replays_equals_plain(make, batches, artifacts, rng):
    """The default controllers, fed by replays, change only sizes: greedy output is plain's."""
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    span = [rng.integers(1, target.vocab_size, 5).tolist() for _ in range(3)]
    prompts = [rng.integers(1, target.vocab_size, 4).tolist() + s * 3 for s in span]
    for batch in batches:
        drafter = CountingReplays(make())
        spec = generate_speculative(
            target, drafter, prompts[:batch], 80, controller=controller_for(drafter)
        )
        assert spec.tokens == generate_plain(target, prompts[:batch], 80).tokens
        # the controller learnt from replays (a batch's first, as its rows wait for a probe)
        assert drafter.replays > 0


def test_a_batchs_first_suffix_ask_priced_with_its_indexing_keeps_greedy_plain(artifacts, rng):
    """Pricing a batch's first ask with the indexing it forces moves when rows draft, never what
    is verified: greedy output is plain's whether the window opens (indexing priced cheap) or
    never does in the request (dear)."""
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    span = [rng.integers(1, target.vocab_size, 5).tolist() for _ in range(3)]
    prompts = [rng.integers(1, target.vocab_size, 4).tolist() + s * 3 for s in span]
    plain = generate_plain(target, prompts, 80).tokens
    drafted = []
    for index_s in (1e-9, 1.0):
        drafter = SuffixDrafter(SuffixOptions(8))
        trial = Trial(0.0, rounds=80, index_s=index_s, prompt_tokens=sum(map(len, prompts)))
        controller = ConfidenceController(trial=trial)
        spec = generate_speculative(target, drafter, prompts, 80, controller=controller)
        assert spec.tokens == plain
        drafted.append(controller.indexed)
    assert drafted == [True, False]
