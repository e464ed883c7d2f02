"""Suffix decoding on hand-made contexts: counts, matches, tree growth, shared memory."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from specx.runtime.drafters.suffix import SuffixDrafter, SuffixOptions, SuffixTrie
from specx.runtime.sampling import SamplingParams


def draft_of(drafter: SuffixDrafter, history: list[int]):
    drafter.start([history], 64)
    (draft,) = drafter.propose([history], np.array([True]), SamplingParams(), None)
    return draft


def substring_counts(text: list[int], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        if j - i <= depth:
            counts[tuple(text[i:j])] = counts.get(tuple(text[i:j]), 0) + 1
    return counts


def trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    found, stack = {}, [(0, ())]
    while stack:
        place, path = stack.pop()
        for token, child, count in trie.continuations(place, len(path)):
            found[path + (token,)] = count
            stack.append((child, path + (token,)))
    return found


def test_the_trie_counts_every_short_substring():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 3, 40).tolist()
    trie = SuffixTrie(depth=5)
    trie.extend(text[:17])
    trie.extend(text[17:])  # fed in two pieces: the same as at once
    assert trie_counts(trie) == substring_counts(text, 5)
    # A second document adds its substrings but none spanning the boundary.
    trie.new_document()
    trie.extend([2, 2])
    expected = substring_counts(text, 5)
    for key, n in substring_counts([2, 2], 5).items():
        expected[key] = expected.get(key, 0) + n
    assert trie_counts(trie) == expected


def test_the_trie_keeps_every_count_and_first_seen_order_while_storing_once_seen_text_as_text():
    rng = np.random.default_rng(1)
    for depth in (2, 3, 5, 8):
        for _ in range(12):
            documents = [rng.integers(0, rng.integers(2, 5), rng.integers(0, 30)).tolist()
                         for _ in range(rng.integers(1, 4))]  # fmt: skip
            trie, expected = SuffixTrie(depth), {}
            for document in documents:
                trie.new_document()
                cut = int(rng.integers(0, len(document) + 1))
                trie.extend(document[:cut])
                trie.extend(document[cut:])
                for key, n in substring_counts(document, depth).items():
                    expected[key] = expected.get(key, 0) + n
            assert trie_counts(trie) == expected
            # Continuations come in the order their strings were first seen (grow's ties).
            for key in expected:
                if len(key) < depth:
                    assert continuation_order(trie, key) == first_seen(documents, key)
            # Following another text finds its longest present suffix at every token.
            query, places = rng.integers(0, 4, 20).tolist(), []
            for end in range(1, len(query) + 1):
                places = trie.follow(places, query[end - 1])
                present = [n for n in range(1, min(end, depth - 1) + 1)
                           if tuple(query[end - n : end]) in expected]  # fmt: skip
                assert len(places) == max(present, default=0)
    # A once-seen string is text, not nodes: 200 new tokens make 200 nodes, not 200 x 31.
    trie = SuffixTrie(32)
    trie.extend(range(200))
    assert len(trie.counts) == 201


def continuation_order(trie: SuffixTrie, key: tuple[int, ...]) -> list[int]:
    place = 0
    for length, token in enumerate(key):
        place = next(c for t, c, _ in trie.continuations(place, length) if t == token)
    return [token for token, _, _ in trie.continuations(place, len(key))]


def first_seen(documents: list[list[int]], key: tuple[int, ...]) -> list[int]:
    order: list[int] = []
    for document in documents:
        for i in range(len(document) - len(key)):
            if tuple(document[i : i + len(key)]) == key and document[i + len(key)] not in order:
                order.append(document[i + len(key)])
    return order


def test_the_most_frequent_continuation_leads_the_tree():
    # After [5, 6]: 7 followed twice, 8 once. The chain 7 -> 1 comes first, then 8.
    history = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 1, 9, 5, 6]
    drafter = SuffixDrafter(SuffixOptions(max_nodes=3, alpha=4, min_prob=0.0))
    draft = draft_of(drafter, history)
    assert draft.tokens.tolist() == [7, 1, 8] and draft.parents.tolist() == [-1, 0, -1]
    np.testing.assert_allclose(draft.confidence, [2 / 3, 1.0, 1 / 3])


def test_the_tree_grows_with_the_match_length():
    # A match of 1 token earns ceil(alpha * 1) nodes, one of 3 tokens three times that.
    short = [4, 1, 2, 3, 9, 9, 4]
    long = [7, 8, 4, 1, 2, 3, 9, 9, 7, 8, 4]
    options = SuffixOptions(max_nodes=16, alpha=1.0, min_prob=0.0)
    assert len(draft_of(SuffixDrafter(options), short)) == 1
    assert len(draft_of(SuffixDrafter(options), long)) == 3


def test_unlikely_branches_are_cut_and_no_match_gives_no_draft():
    history = [3, 1, 3, 1, 3, 1, 3, 2, 3]  # after 3: 1 three times, 2 once
    for min_prob, first_tokens in ((0.3, [1]), (0.0, [1, 2])):
        draft = draft_of(SuffixDrafter(SuffixOptions(8, alpha=8, min_prob=min_prob)), history)
        assert draft.tokens[draft.parents == -1].tolist() == first_tokens
    assert len(draft_of(SuffixDrafter(), [1, 2, 3, 4])) == 0


def test_earlier_requests_feed_later_drafts():
    drafter = SuffixDrafter(SuffixOptions(max_nodes=4, alpha=4))
    first = [10, 11, 12, 13, 14, 15]
    drafter.start([first], 64)
    drafter.propose([first], np.array([True]), SamplingParams(), None)
    # The next batch remembers the first request: its text now drafts for a new one.
    draft = draft_of(drafter, [20, 11, 12])
    assert draft.tokens.tolist() == [13, 14, 15]


def test_inactive_rows_get_empty_drafts_and_options_are_checked():
    drafter = SuffixDrafter()
    rows = [[1, 1, 1], [1, 1, 1]]
    drafter.start(rows, 64)
    drafts = drafter.propose(rows, np.array([True, False]), SamplingParams(), None)
    assert len(drafts[0]) > 0 and len(drafts[1]) == 0
    with pytest.raises(ValueError, match="depth > max_match"):
        SuffixOptions(max_match=8, depth=8)


def test_a_budget_drafts_the_prefix_of_the_full_tree():
    history = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 1, 9, 5, 6, 7, 3, 5, 6]
    full = draft_of(SuffixDrafter(SuffixOptions(max_nodes=8, alpha=8, min_prob=0.0)), history)
    drafter = SuffixDrafter(SuffixOptions(max_nodes=8, alpha=8, min_prob=0.0))
    drafter.start([history], 64)
    (cut,) = drafter.propose([history], np.array([True]), SamplingParams(), None, budget=3)
    assert len(full) > 3 and cut.tokens.tolist() == full.tokens[:3].tolist()
    assert cut.parents.tolist() == full.parents[:3].tolist()


def test_a_batch_indexes_its_prompts_at_the_first_ask_and_drafts_the_same():
    prompts = [[5, 6, 7, 1, 5, 6, 7, 2, 5, 6], [3, 4, 3, 4, 3]]
    batch = SuffixDrafter(SuffixOptions(max_nodes=8, alpha=8, min_prob=0.0))
    batch.start(prompts, 64)
    # Nothing indexed with the prefill: a batch's rows ask late, if at all.
    assert all(len(row.trie) == len(SuffixTrie(row.trie.depth)) for row in batch._rows)
    drafts = batch.propose(prompts, np.array([True, True]), SamplingParams(), None)
    for prompt, draft in zip(prompts, drafts, strict=True):
        alone = draft_of(SuffixDrafter(SuffixOptions(max_nodes=8, alpha=8, min_prob=0.0)), prompt)
        assert len(draft) > 0 and draft.tokens.tolist() == alone.tokens.tolist()
        assert draft.parents.tolist() == alone.parents.tolist()


def test_a_batch_that_never_asked_still_feeds_its_prompts_to_later_requests():
    drafter = SuffixDrafter(SuffixOptions(max_nodes=4, alpha=4))
    drafter.start([[10, 11, 12, 13, 14, 15], [30, 31, 32]], 64)  # no row asks
    draft = draft_of(drafter, [20, 11, 12])
    assert draft.tokens.tolist() == [13, 14, 15]
