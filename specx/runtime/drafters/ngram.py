"""`NGramDrafter`: prompt lookup; drafts continue earlier matches of the context tail."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specx.runtime.sampling import SamplingParams
from specx.runtime.trees import DraftTree

__all__ = ["NGramDrafter", "ngram_continuations"]


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
        found: list[np.ndarray] = []
        seen: set[tuple[int, ...]] = set()
        for start in starts[::-1]:
            continuation = history[start + n : start + n + length]
            key = tuple(continuation.tolist())
            if key not in seen:
                seen.add(key)
                found.append(continuation)
            if len(found) == max_matches:
                break
        if found:
            return found
    return []


def _trie(continuations: list[np.ndarray], max_nodes: int) -> DraftTree:
    """Merges continuations into one tree sharing common prefixes, up to max_nodes nodes."""
    index: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for continuation in continuations:
        parent = -1
        for token in continuation.tolist():
            key = (parent, token)
            if key not in index:
                if len(tokens) == max_nodes:
                    break
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = index[key]
    return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))


class NGramDrafter:
    """Prompt-lookup drafting; several matches form a tree (`max_matches` > 1)."""

    name = "ngram"
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
        self.drafts_chains = max_matches == 1
        self.min_n, self.max_n, self.max_matches = min_n, max_n, max_matches

    def start(self, prompts: Sequence[Sequence[int]], capacity: int, taps=None) -> None:  # noqa: D102
        pass

    def propose(self, histories, active, sampling: SamplingParams, rng, budget=None):  # noqa: D102
        nodes = self.max_nodes if budget is None else min(self.max_nodes, budget)
        drafts = []
        for history, is_active in zip(histories, active, strict=True):
            if not is_active:
                drafts.append(DraftTree.empty())
                continue
            found = ngram_continuations(
                np.asarray(history, dtype=np.int64),
                self.min_n,
                self.max_n,
                nodes,
                self.max_matches,
            )
            drafts.append(_trie(found, nodes))
        return drafts

    def accept(self, row: int, draft: DraftTree, accepted: list[int], taps=None) -> None:  # noqa: D102
        pass
