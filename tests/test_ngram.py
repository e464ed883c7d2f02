"""Prompt lookup on hand-made contexts."""

from __future__ import annotations

import numpy as np

from specx.runtime.drafters.ngram import NGramDrafter, NGramIndex, ngram_continuations
from specx.runtime.sampling import SamplingParams


def continuations(history, min_n=1, max_n=3, length=3, matches=1):
    found = ngram_continuations(np.array(history), min_n, max_n, length, matches)
    return [c.tolist() for c in found]


def test_longest_ngram_wins():
    # Tail [2, 3]: the bigram match at 1 continues with 4; unigram [3] also matches at 6 -> 9.
    history = [1, 2, 3, 4, 5, 9, 3, 9, 2, 3]
    assert continuations(history) == [[4, 5, 9]]


def test_most_recent_match_first_and_distinct():
    # Tail [7] matches at 4, 2 and 0; the match at 0 repeats the continuation of 4.
    history = [7, 1, 7, 2, 7, 1, 7]
    assert continuations(history, max_n=1, length=2, matches=3) == [[1, 7], [2, 7]]


def test_no_match_gives_no_draft():
    assert continuations([1, 2, 3, 4]) == []
    drafter = NGramDrafter(4)
    (draft,) = drafter.propose([[1, 2, 3, 4]], np.array([True]), SamplingParams(), None)
    assert len(draft) == 0


def test_matches_merge_into_a_trie():
    drafter = NGramDrafter(num_draft_tokens=5, max_n=1, max_matches=3)
    (draft,) = drafter.propose([[7, 1, 7, 2, 7, 1, 7]], np.array([True]), SamplingParams(), None)
    # Continuations [1, 7], [2, 7, 1, 7], [1, 7, 2, 7, 1]: the third shares [1, 7] with the
    # first, and the budget of 5 nodes runs out before its third token.
    assert draft.tokens.tolist() == [1, 7, 2, 7, 1]
    assert draft.parents.tolist() == [-1, 0, -1, 2, 3]


def test_inactive_rows_get_empty_drafts():
    drafter = NGramDrafter(3)
    drafts = drafter.propose(
        [[1, 1, 1], [1, 1, 1]], np.array([True, False]), SamplingParams(), None
    )
    assert drafts[0].tokens.tolist() == [1] and len(drafts[1]) == 0


def test_the_index_follows_the_rule_as_a_history_grows():
    # A small vocabulary repeats n-grams often; histories grow by rounds of 1-4 tokens, as
    # the loop's do, and one switches to an unrelated history (a new request) midway.
    rng = np.random.default_rng(0)
    for min_n, max_n, matches in [(1, 3, 1), (2, 4, 3), (1, 1, 2)]:
        index = NGramIndex(min_n, max_n)
        history = rng.integers(0, 5, size=3).tolist()
        for round_ in range(120):
            if round_ == 60:
                history = rng.integers(0, 5, size=2).tolist()
            history += rng.integers(0, 5, size=rng.integers(1, 5)).tolist()
            length = int(rng.integers(1, 6))
            expected = ngram_continuations(np.array(history), min_n, max_n, length, matches)
            found = index.continuations(history, length, matches)
            assert found == [c.tolist() for c in expected], (min_n, max_n, round_)
