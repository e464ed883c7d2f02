"""`NGramDrafter`: prompt lookup; drafts continue earlier matches of the context tail."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specx.runtime.sampling import SamplingParams
from specx.runtime.trees import DraftTree

__all__ = ["NGramDrafter", "NGramIndex", "ngram_continuations"]


def ngram_continuations(
    history: np.ndarray, min_n: int, max_n: int, length: int, max_matches: int
) -> list[np.ndarray]:
    """Continuations of the most recent earlier occurrences of the history's last n tokens.

    Rule: try n = max_n down to min_n and stop at the first n with a match; a match at
    position i (i + n < len(history), so it is not the tail itself) yields
    `history[i + n : i + n + length]`. Most recent matches first; at most `max_matches`
    distinct continuations.
    """
    size = len(history)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(history[: size - 1], n)
        starts = np.flatnonzero((windows == history[size - n :]).all(axis=1))
        if len(starts):
            return _distinct(history, starts[::-1], n, length, max_matches)
    return []


def _distinct(history, starts, n: int, length: int, max_matches: int) -> list:
    """The continuations after the n-grams at `starts` (most recent first), repeats dropped.

    Slices of `history`: arrays for an array, lists for a list.
    """
    found, seen = [], set()
    for start in starts:
        continuation = history[start + n : start + n + length]
        key = tuple(continuation)  # numpy ints hash as Python ints
        if key not in seen:
            seen.add(key)
            found.append(continuation)
        if len(found) == max_matches:
            break
    return found


def _trie(continuations: list[list[int]], max_nodes: int) -> DraftTree:
    """Merges continuations into one tree sharing common prefixes, up to max_nodes nodes."""
    index: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for continuation in continuations:
        parent = -1
        for token in continuation:
            key = (parent, token)
            if key not in index:
                if len(tokens) == max_nodes:
                    break
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = index[key]
    return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))


class NGramIndex:
    """`ngram_continuations` over one growing history, at O(new tokens) a round.

    Every n-gram (min_n <= n <= max_n) not ending at the last token maps to its start
    positions, ascending; each call first indexes what the history gained since the last one.
    The rescan it replaces (three sliding-window compares over the whole history) grew with
    the history until it was a sizeable share of a pyref-7m verify round
    (docs/decisions.md#ngram-index); a lookup is a dict access. A history
    that is not an extension of the indexed one is indexed afresh.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._reset()

    def _reset(self) -> None:
        self._starts: dict[tuple[int, ...], list[int]] = {}
        self._ends = 1  # n-grams ending (exclusive) below this are indexed
        self._last: int | None = None  # history[_ends - 1] when indexed: a cheap identity check

    def continuations(
        self, history: Sequence[int], length: int, max_matches: int
    ) -> list[list[int]]:
        """`ngram_continuations(history, ...)`, as lists."""
        self.index(history)
        size = len(history)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            starts = self._starts.get(tuple(history[size - n :]))
            if starts:
                return _distinct(history, reversed(starts), n, length, max_matches)
        return []

    @property
    def indexed(self) -> int:
        """The length of the history indexed: a longer one extends it at its new tokens."""
        return self._ends

    def index(self, history: Sequence[int]) -> None:
        """Indexes what `history` gained since the last call (all of it if it is another)."""
        size = len(history)
        if self._last is not None and (size < self._ends or history[self._ends - 1] != self._last):
            self._reset()  # another history: start over
        for end in range(self._ends, size):  # an n-gram may not end at the last token
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._starts.setdefault(tuple(history[end - n : end]), []).append(end - n)
        if size >= self._ends:
            self._ends, self._last = size, history[size - 1]


class NGramDrafter:
    """Prompt-lookup drafting; several matches form a tree (`max_matches` > 1)."""

    name = "ngram"
    sizes_own_drafts = False
    learns_across_requests = False
    taps = "none"
    scratch_slots = 0

    def __init__(
        self, num_draft_tokens: int = 5, min_n: int = 1, max_n: int = 3, max_matches: int = 1
    ):
        if num_draft_tokens < 1 or not 1 <= min_n <= max_n or max_matches < 1:
            raise ValueError(
                f"ngram needs num_draft_tokens >= 1, 1 <= min_n <= max_n, max_matches >= 1; got "
                f"{num_draft_tokens}, {min_n}, {max_n}, {max_matches}"
            )
        self.max_nodes = num_draft_tokens
        self.min_n, self.max_n, self.max_matches = min_n, max_n, max_matches
        self._indexes: list[NGramIndex] = []

    def start(self, prompts: Sequence[Sequence[int]], capacity: int, taps=None) -> None:
        """Indexes the prompts: prompt work, done with the prefill rather than in a round.

        A first round that indexed its prompt cost several later rounds' drafting, and the
        controller, timing it, priced every draft as dear as that one.
        """
        self._indexes = [NGramIndex(self.min_n, self.max_n) for _ in prompts]
        for index, prompt in zip(self._indexes, prompts, strict=True):
            index.index(prompt)

    def propose(self, histories, active, sampling: SamplingParams, rng, budget=None):  # noqa: D102
        nodes = self.max_nodes if budget is None else min(self.max_nodes, budget)
        if len(self._indexes) != len(histories):  # proposing without `start` (tests, tools)
            self.start(histories, 0)
        drafts = []
        for history, index, is_active in zip(histories, self._indexes, active, strict=True):
            found = index.continuations(history, nodes, self.max_matches) if is_active else []
            drafts.append(_trie(found, nodes))
        return drafts

    def replay(
        self, row: int, history: Sequence[int], positions: Sequence[int]
    ) -> list[tuple[int, DraftTree]]:
        """What `propose` would have drafted before each position (`Drafter.replay`)."""
        if row >= len(self._indexes):
            return []
        index, nodes = self._indexes[row], self.max_nodes
        return [
            (t, _trie(index.continuations(history[:t], nodes, self.max_matches), nodes))
            for t in positions
            if t >= index.indexed
        ]

    def accept(self, row: int, draft: DraftTree, accepted: list[int], taps=None) -> None:  # noqa: D102
        pass
