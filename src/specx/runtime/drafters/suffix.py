"""`SuffixDrafter`: suffix decoding, a tree of the most frequent continuations of a match.

After SuffixDecoding (Oliaro et al., 2024): model-free like prompt lookup, but it keeps
counts, so it proposes a *tree* of what most often followed the context's tail, not one
earlier continuation, and it also learns from earlier requests.

Rule, per sequence and round:
1. Match: the longest suffix s of the history, at most `max_match` tokens, that occurred
   before with a next token, in the sequence's own trie (its prompt and output so far) or
   in the shared trie (every earlier request this drafter decoded); m = len(s).
2. Grow: best first over the continuations of s by path probability, a child's probability
   being its count over its siblings' total; keep nodes whose path probability is at least
   `min_prob`, at most min(`max_nodes`, ceil(`alpha` * m)): a longer match continues more
   reliably, so it earns a bigger tree.
3. Of the two tries' trees, the one with the larger expected accepted length (the sum of
   its path probabilities) is proposed.

Nodes are chosen deterministically (`probs` None), so verification uses the deterministic-
siblings rule and the output keeps the target's distribution at any temperature.

The trie is hand-written (no maintained Python suffix-tree package does incremental
counts): every substring of up to `depth` tokens of the text fed to it, with its count,
a string seen once kept as its place in the text. Feeding a token extends the repeated
suffixes ending at the previous token by it, and those are also the match candidates of
step 1 (a suffix seen once has no continuation yet).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from specx.runtime.sampling import SamplingParams
from specx.runtime.trees import DraftTree

__all__ = ["SuffixDrafter", "SuffixOptions", "SuffixTrie"]

# Tokens of the text suffix drafting times its indexing on (`time_indexing`).
TIMED_INDEX_TOKENS = 256
END = -1  # closes a document in a trie's text: no token follows it


@dataclass(frozen=True)
class SuffixOptions:
    """Knobs of suffix drafting (the rule is in the module docstring)."""

    max_nodes: int = 16
    alpha: float = 4.0  # best of 1, 2, 4 on pyref-7m's HumanEval and mt_bench prompts
    # best of 0.1, 0.2, 0.3, 0.4, 0.5 (0.3-0.5 within noise, all ahead of 0.1) on the same
    # prompts, pyref-7m's lowered build: a node below 0.3 adds less than its verify cost
    # (docs/decisions.md#suffix-min-prob).
    min_prob: float = 0.3
    max_match: int = 12
    depth: int = 32  # longest substring kept; a match of m leaves depth - m to continue
    shared_nodes: int = 2_000_000  # the shared trie is cleared when it would pass this size

    def __post_init__(self) -> None:
        if self.max_nodes < 1 or self.max_match < 1 or self.depth <= self.max_match:
            raise ValueError(
                f"suffix drafting needs max_nodes >= 1, max_match >= 1 and depth > max_match; "
                f"got {self.max_nodes}, {self.max_match}, {self.depth}"
            )
        if not (self.alpha > 0 and 0 <= self.min_prob <= 1):
            raise ValueError(f"alpha must be > 0, min_prob in [0, 1]; got {self.alpha}, "
                             f"{self.min_prob}")  # fmt: skip


class SuffixTrie:
    """Every substring of up to `depth` tokens of the documents fed, with occurrence counts.

    Kept as a suffix tree keeps its leaves: a string that occurred once is not a chain of
    nodes but a place in the text, its one occurrence continuing there. Only repeated
    strings, and the once-seen children of repeated ones, are nodes. A token fed therefore
    touches the repeated suffixes ending before it (1.6 a token on pyref-7m's HumanEval
    prompts) rather than all `depth` of them: 10-12 us a token fell to 1-1.5 us; the prompt's
    indexing had been 1.7 ms of a 12 ms prefill (docs/decisions.md#suffix-trie-leaves).

    A *place* is a node (>= 0) or ~j for a string seen once whose occurrence continues at
    `text[j]`. Node 0 is the empty string; `children[n]` maps a token to the node of n's
    string plus it, `counts[n]` is how often n's string occurred, and `tails[n]` is j for a
    node seen once (its children are then the text's) or -1.
    """

    def __init__(self, depth: int):
        self.depth = depth
        self.text: list[int] = []  # the documents fed, each closed by END
        self.children: list[dict[int, int]] = [{}]
        self.counts: list[int] = [0]
        self.tails: list[int] = [-1]
        self.open: list[int] = []  # nodes of the repeated suffixes ending at the last token

    def __len__(self) -> int:
        """Its size: nodes and text tokens."""
        return len(self.counts) + len(self.text)

    def new_document(self) -> None:
        """Starts a document: no substring spans the previous one's end."""
        if self.text and self.text[-1] != END:
            self.text.append(END)
        self.open = []

    def extend(self, tokens: Iterable[int]) -> None:
        """Feeds tokens at the end of the current document.

        A suffix whose extension is new is seen once from here on: its node gets a tail at
        the text's end, and it leaves the open suffixes (every longer one is new too).
        """
        text, children, counts, tails = self.text, self.children, self.counts, self.tails
        for token in tokens:
            text.append(token)
            extended: list[int] = []  # found children: a prefix of the suffixes, by length
            for node in (0, *self.open):
                child = children[node].get(token)
                if child is None:
                    children[node][token] = self._node(1, len(text))
                    continue
                counts[child] += 1
                if tails[child] >= 0:  # seen once before, now twice
                    self._split(child, len(extended) + 1)
                extended.append(child)
            self.open = extended[: self.depth - 1]

    def follow(self, open_places: list[int], token: int) -> list[int]:
        """The places of the suffixes after `token`, given those before it (no insertion).

        A suffix absent from the trie has no longer suffix present either, so the result
        is again every present suffix, shortest first.
        """
        extended: list[int] = []
        for place in (0, *open_places):
            child = self._step(place, len(extended), token)
            if child is None:
                break
            extended.append(child)
        return extended[: self.depth - 1]

    def continuations(self, place: int, length: int) -> list[tuple[int, int, int]]:
        """(token, place, count) of each string one token longer than `place`'s, `length` long."""
        if length >= self.depth:
            return []
        j = self._tail(place)
        if j < 0:
            return [(token, child, self.counts[child]) for token, child in
                    self.children[place].items()]  # fmt: skip
        if j < len(self.text) and self.text[j] != END:
            return [(self.text[j], ~(j + 1), 1)]
        return []

    def best_match(self, open_places: list[int], max_match: int) -> tuple[int, int]:
        """The longest open suffix of at most `max_match` tokens with a continuation.

        Returns (place, length); (0, 0) when none has one.
        """
        for length in range(min(len(open_places), max_match), 0, -1):
            place = open_places[length - 1]
            if self.continuations(place, length):
                return place, length
        return 0, 0

    def grow(
        self, place: int, length: int, budget: int, min_prob: float
    ) -> tuple[DraftTree, float]:
        """The best-first tree of `place`'s continuations and its expected accepted length."""
        tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        heap: list[tuple[float, int, int, int, int, int, float]] = []
        order = itertools.count()  # ties go to the earlier-found node
        self._push(heap, order, place, length, -1, 1.0, min_prob)
        expected = 0.0
        while heap and len(tokens) < budget:
            negative, _, token, child, child_length, parent, conditional = heapq.heappop(heap)
            index = len(tokens)
            tokens.append(token)
            parents.append(parent)
            confidence.append(conditional)
            expected -= negative
            self._push(heap, order, child, child_length, index, -negative, min_prob)
        tree = DraftTree(
            np.array(tokens, dtype=np.int64),
            np.array(parents, dtype=np.int64),
            confidence=np.array(confidence, dtype=np.float64),
        )
        return tree, expected

    def _push(self, heap, order, place: int, length: int, index: int, path: float, min_prob):
        kids = self.continuations(place, length)
        total = sum(count for _, _, count in kids)
        for token, child, count in kids:
            conditional = count / total
            if path * conditional >= min_prob:
                # (-path probability, tie-break, token, place, its length, tree parent, p)
                entry = (-path * conditional, next(order), token, child, length + 1, index,
                         conditional)  # fmt: skip
                heapq.heappush(heap, entry)

    def _step(self, place: int, length: int, token: int) -> int | None:
        """The place of `place`'s string plus `token`, None where that never occurred."""
        if length >= self.depth:
            return None
        j = self._tail(place)
        if j < 0:
            return self.children[place].get(token)
        return ~(j + 1) if j < len(self.text) and self.text[j] == token else None

    def _tail(self, place: int) -> int:
        """Where `place`'s string, seen once, continues in the text; -1 for a repeated one."""
        return ~place if place < 0 else self.tails[place]

    def _node(self, count: int, tail: int) -> int:
        self.children.append({})
        self.counts.append(count)
        self.tails.append(tail)
        return len(self.counts) - 1

    def _split(self, node: int, length: int) -> None:
        """Makes a node seen once a repeated one: its first occurrence's next token a child."""
        j, self.tails[node] = self.tails[node], -1
        if length < self.depth and self.text[j] != END:
            self.children[node][self.text[j]] = self._node(1, j + 1)


class SuffixDrafter:
    """Suffix decoding over each sequence's own text and every earlier request's."""

    name = "suffix"
    taps = "none"
    scratch_slots = 0
    sizes_own_drafts = True
    learns_across_requests = True  # the shared trie

    def __init__(self, options: SuffixOptions | None = None, shared: SuffixTrie | None = None):
        self.options = options or SuffixOptions()
        self.max_nodes = self.options.max_nodes
        self.shared = shared if shared is not None else SuffixTrie(self.options.depth)
        self._rows: list[_Row] = []

    def start(self, prompts: Sequence[Sequence[int]], capacity: int, taps=None) -> None:
        """Remembers the previous batch's texts and indexes a lone prompt.

        A lone row's prompt is indexed with the prefill, not in a round: its replays and
        first asks come early, and deferred it cost the decode of every request that asked
        at all more than it saved those that never did. A batch's rows ask late, if at all
        (`ConfidenceController`'s first batch window), and the first ask catches them up:
        indexed with the prefill, it cost 3-4% of a 64-token batch request's total time
        that no draft repaid (docs/decisions.md#suffix-indexes-prompts-with-prefill).
        """
        self.remember(row.text for row in self._rows)
        self._rows = [_Row(self.options.depth, prompt) for prompt in prompts]
        if len(prompts) == 1:
            self._rows[0].catch_up(prompts[0], self.shared)

    def remember(self, documents: Iterable[Sequence[int]]) -> None:
        """Adds finished texts (prompt + output) to the shared trie."""
        for document in documents:
            if len(self.shared) + len(document) * self.options.depth > self.options.shared_nodes:
                self.shared = SuffixTrie(self.options.depth)  # bounded memory: start over
            self.shared.new_document()
            self.shared.extend(int(t) for t in document)

    def propose(self, histories, active, sampling: SamplingParams, rng, budget=None):  # noqa: D102
        nodes = self.max_nodes if budget is None else min(self.max_nodes, budget)
        drafts = []
        for row, history, is_active in zip(self._rows, histories, active, strict=True):
            row.catch_up(history, self.shared)
            drafts.append(self._draft(row, nodes) if is_active else DraftTree.empty())
        return drafts

    def _draft(self, row: _Row, nodes: int) -> DraftTree:
        options = self.options
        best, best_expected = DraftTree.empty(), 0.0
        for trie, open_places in ((row.trie, row.trie.open), (self.shared, row.shared_open)):
            place, length = trie.best_match(open_places, options.max_match)
            if length == 0:
                continue
            budget = min(nodes, math.ceil(options.alpha * length))
            tree, expected = trie.grow(place, length, budget, options.min_prob)
            if expected > best_expected:
                best, best_expected = tree, expected
        return best

    def replay(
        self, row: int, history: Sequence[int], positions: Sequence[int]
    ) -> list[tuple[int, DraftTree]]:
        """What `propose` would have drafted before each position (`Drafter.replay`)."""
        if row >= len(self._rows):
            return []
        state, drafts = self._rows[row], []
        for t in positions:
            if t >= len(state.history):
                state.catch_up(history[:t], self.shared)
                drafts.append((t, self._draft(state, self.max_nodes)))
        return drafts

    def accept(self, row: int, draft: DraftTree, accepted: list[int], taps=None) -> None:  # noqa: D102
        pass

    def time_indexing(self) -> float:
        """Seconds a token of a row's text costs to index (`Drafter.time_indexing`).

        Timed on a text that repeats a 16-token phrase: every suffix is a repeated one, so
        every one is touched, the dearest text for the trie (5 us a token against a
        HumanEval prompt's 1-2 us here; the estimate errs dear); the faster of two, as the
        first run of a process can take twice as long.
        """
        phrase = np.random.default_rng(0).integers(0, 1 << 15, 16).tolist()
        text = phrase * (TIMED_INDEX_TOKENS // len(phrase))
        seconds = []
        for _ in range(2):
            row = _Row(self.options.depth, ())
            started = time.perf_counter()
            row.catch_up(text, SuffixTrie(self.options.depth))
            seconds.append(time.perf_counter() - started)
        return min(seconds) / TIMED_INDEX_TOKENS


class _Row:
    """One sequence: its own trie, and where its tail stands in the shared trie."""

    def __init__(self, depth: int, prompt: Sequence[int]):
        self.trie = SuffixTrie(depth)
        self.prompt = prompt  # what the shared trie learns where the row never asked
        self.shared_open: list[int] = []

    @property
    def history(self) -> list[int]:
        """The tokens fed to the matchers: the row's trie's one document."""
        return self.trie.text

    @property
    def text(self) -> Sequence[int]:
        """The row's text as far as the drafter saw it: its prompt at least."""
        return self.history if len(self.history) >= len(self.prompt) else self.prompt

    def catch_up(self, history: Sequence[int], shared: SuffixTrie) -> None:
        """Feeds the tokens emitted since the last round to both matchers."""
        new = [int(t) for t in history[len(self.history) :]]
        self.trie.extend(new)
        for token in new:
            self.shared_open = shared.follow(self.shared_open, token)
