"""Continuous batching: sequences join a running batch between rounds and leave when done.

A `ContinuousBatch` owns one KV cache of `slots` sequences at the artifact's capacity.
`admit` prefills a request into a free slot (alone, through a view of that slot's rows)
and draws its first token; `step` runs one round for every running sequence: each one's
own drafter proposes (sized by its own controller), the target verifies every tree in
one forward, and each sequence is verified under its own sampling parameters and random
stream by the rule `generate_speculative` verifies a row with (`rounds.commit_row`, one home
for both loops). A sequence that finished (eos,
its token budget, or its sink said stop) frees its slot for the next `admit`. A sequence
drafts only while the batch runs at most its `max_batch_spec` sequences (the batch-size
switch of `generate_speculative`, per sequence).

Why per-sequence drafters: a joining request must not reset the others' draft state, and
the drafters keep per-batch state from `start`; so each sequence gets a drafter of its own
(batch 1; the caller pools them), and drafting is one call per sequence per round rather
than one per batch. Verification, the expensive part, stays batched.

With a `PrefixCache`, `admit` copies the longest cached prefix of the prompt into the slot
and prefills only the rest (`specx.runtime.prefix_cache`).

Chunked prefill (`admit(..., chunked=True)`): the slot is taken and the prompt waits;
`prefill(budget)` then feeds pending prompts `budget` tokens at a time, in arrival order,
and a prompt fully fed joins the batch with its first token. The server calls it between
rounds with a budget while sequences run, so a new request's prefill delays each running
stream's next tokens by one chunk at most rather than by whole prompts, and with none
while nothing runs (the oldest prompt whole: chunks only cost there; measured:
benchmarks/README.md#servingpy). A prompt's chunks are what a prefix-cache hit already
does (its cache filled in pieces), and on builds whose rows are exact alone (the CPU
kernels) the same bits as one prefill.

The forward covers slots [0, highest running slot]; free slots below it ride along at
length 0 (their rows are overwritten at the next admit), so new requests take the lowest
free slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specx.runtime.calibrated import row_exact
from specx.runtime.controller import Controller, truncated
from specx.runtime.drafters.base import Drafter, prepare_drafter
from specx.runtime.kv_cache import KVCache
from specx.runtime.metrics import AcceptanceStats
from specx.runtime.plain_decoding import TokenSink, check_prompts, prefill
from specx.runtime.prefix_cache import PrefixCache
from specx.runtime.rounds import EMPTY_DRAFT, VerifiedRow, commit_row, verify_inputs
from specx.runtime.sampling import SamplingParams, next_tokens
from specx.runtime.speculative_decoding import scratch_of
from specx.runtime.spine import Arranged, arrange
from specx.runtime.targets.base import DecoderBackend, StepOutput
from specx.runtime.trees import DraftTree
from specx.runtime.verification import RandomCoin, verify

__all__ = ["BatchSequence", "ContinuousBatch"]


@dataclass
class Pending:
    """A prompt being prefilled in chunks: its sequence, tokens fed, taps gathered."""

    sequence: BatchSequence
    needed: int  # the slots its drafter's start is told (`check`)
    fed: int  # prompt tokens in its cache so far
    taps: list[np.ndarray] | None = field(default_factory=list)  # None: a cached prefix had none


@dataclass(eq=False)  # compared by identity: the batch's rows are these objects
class BatchSequence:
    """One request in the batch: its prompt, budget, sampling, drafter and token sink."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    eos: frozenset[int]
    sink: TokenSink  # gets each round's tokens; returning False ends the sequence
    drafter: Drafter | None = None  # its own (batch 1); None decodes plainly
    controller: Controller | None = None  # sizes its drafts; None keeps them whole
    max_batch_spec: int | None = None  # drafts only while the batch runs at most this many
    emitted: list[int] = field(default_factory=list)
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    drafted: int = 0  # draft nodes the target verified
    finished: bool = False
    prepared: bool = False  # its drafter's deferred prefill ran (`Drafter.prepare`)
    carry: list[int] = field(default_factory=list)  # provisional tokens (`specx.runtime.spine`)

    def __post_init__(self) -> None:
        self.history = list(self.prompt)
        self.rng = np.random.default_rng(self.sampling.seed)
        self.coin = RandomCoin(self.rng)

    def emit(self, tokens: list[int]) -> int:
        """Appends tokens until eos or the budget, hands them to the sink; returns how many."""
        taken = []
        for token in tokens:
            taken.append(int(token))
            if token in self.eos or len(self.emitted) + len(taken) >= self.max_new_tokens:
                self.finished = True
                break
        self.emitted += taken
        self.history += taken
        if not self.sink(0, taken):
            self.finished = True
        return len(taken)


class ContinuousBatch:
    """The running batch (see the module docstring)."""

    def __init__(
        self, target: DecoderBackend, slots: int, prefix_cache: PrefixCache | None = None
    ) -> None:
        self.target, self.prefix_cache = target, prefix_cache
        self.cache: KVCache = target.allocate_cache(slots)
        self.rows: list[BatchSequence | None] = [None] * slots
        self.pending: dict[int, Pending] = {}  # slot -> a prompt prefilled in chunks
        self._views: dict[int, KVCache] = {}
        self.draft_s = self.verify_s = 0.0
        self.draft_prefill_s = 0.0  # drafters' deferred prompt prefills, apart from rounds
        self.rounds = 0
        # Greedy rows verify trees through their spine here (`specx.runtime.spine`).
        self.spine_only = row_exact(target.manifest)

    @property
    def running(self) -> int:
        """Sequences in the batch."""
        return sum(row is not None for row in self.rows)

    @property
    def free(self) -> int:
        """Slots a request could take now."""
        return len(self.rows) - self.running - len(self.pending)

    def check(self, prompt: list[int], max_new_tokens: int, scratch: int = 0) -> int:
        """Refuses a request that cannot fit a slot (GenerationError), before any work.

        `scratch`: its drafter's slots past the history (`scratch_of`). Returns the slots
        it needs.
        """
        capacity, vocab = self.cache.capacity, self.target.vocab_size
        return check_prompts([prompt], max_new_tokens, capacity, vocab, scratch)

    def admit(self, sequence: BatchSequence, chunked: bool = False) -> int:
        """Takes the lowest free slot for `sequence`; returns it.

        Prefills the prompt now and emits its first token, or with `chunked` leaves the
        prompt to `prefill`. If anything fails, the slot stays free.
        """
        needed = self.check(sequence.prompt, sequence.max_new_tokens, scratch_of(sequence.drafter))
        slot = next(i for i, r in enumerate(self.rows) if r is None and i not in self.pending)
        view = self.cache.row(slot)
        hit = self.prefix_cache.lookup(sequence.prompt) if self.prefix_cache is not None else None
        pending = Pending(sequence, needed, 0 if hit is None else hit.tokens)
        if hit is not None:
            PrefixCache.write(view, hit)
            pending.taps = None if hit.taps is None else [hit.taps]
        self.cache.lengths[slot] = pending.fed
        if chunked:
            self.pending[slot] = pending
            return slot
        self._start(slot, pending, *self._feed(view, pending, len(sequence.prompt)))
        return slot

    def prefill(self, budget: int | None = None) -> list[tuple[BatchSequence, Exception]]:
        """Feeds pending prompts up to `budget` tokens, in arrival order.

        `budget` None: the oldest prompt whole, in one forward (nothing runs that it would
        hold up). A prompt fully fed joins the batch with its first token. Returns the
        sequences that failed, each with its error; their slots are free again.
        """
        failed = []
        for slot, pending in list(self.pending.items()):
            left = len(pending.sequence.prompt) - pending.fed
            take = left if budget is None else min(left, budget)
            try:
                logits, taps = self._feed(self.cache.row(slot), pending, take)
                if pending.fed == len(pending.sequence.prompt):
                    del self.pending[slot]
                    self._start(slot, pending, logits, taps)
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the others
                self.evict(slot)
                failed.append((pending.sequence, e))
            if budget is None:
                break
            budget -= take
            if budget <= 0:
                break
        return failed

    @property
    def prefilling(self) -> int:
        """Prompts waiting for `prefill`."""
        return len(self.pending)

    def evict(self, slot: int) -> None:
        """Frees `slot` now, whatever it holds (the server's shutdown, a failed round)."""
        self.pending.pop(slot, None)
        self.rows[slot] = None
        self.cache.lengths[slot] = 0

    def _feed(
        self, view: KVCache, pending: Pending, count: int
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The next `count` prompt tokens into `view`: last logits [1, V], the prompt's taps.

        Taps are returned once the prompt is whole, and it is then stored in the prefix
        cache.
        """
        prompt = pending.sequence.prompt
        start = np.array([pending.fed], dtype=np.int64)
        logits, output = prefill(self.target, view, [prompt[pending.fed : pending.fed + count]],
                                 start)  # fmt: skip
        pending.fed += count
        if output.taps is None:
            pending.taps = None
        elif pending.taps is not None:
            pending.taps.append(output.taps[0, :count])
        if pending.fed < len(prompt):
            return logits, None
        taps = None if pending.taps is None else np.concatenate(pending.taps)
        if self.prefix_cache is not None:
            self.prefix_cache.store(prompt, view, taps)
        return logits, taps

    def _start(
        self, slot: int, pending: Pending, logits: np.ndarray, taps: np.ndarray | None
    ) -> None:
        """`pending`'s sequence joins the batch in `slot` and emits its first token."""
        sequence = pending.sequence
        if sequence.drafter is not None:
            row_taps = None
            if sequence.drafter.taps != "none":
                assert taps is not None  # such a drafter is only paired with a tapped target
                row_taps = [taps]
            sequence.drafter.start([sequence.prompt], pending.needed, row_taps)
        if sequence.drafter is None:
            sequence.controller = None  # nothing to size
        elif sequence.controller is not None:
            sequence.controller.start(1, sequence.drafter.max_nodes)
        first = _choose(logits[0], sequence.sampling, sequence.rng)
        self.rows[slot] = sequence
        try:
            sequence.emit([first])
        except BaseException:
            self.evict(slot)
            raise

    def step(self) -> list[BatchSequence]:
        """One round for every running sequence; returns those that finished (slots freed)."""
        done = self._release()
        if not self.running:
            return done
        high = max(i for i, row in enumerate(self.rows) if row is not None) + 1
        rows = self.rows[:high]
        tick = time.perf_counter()
        proposed, trees, prepare_s = self._draft(rows)
        tock = time.perf_counter()
        self.draft_prefill_s += prepare_s
        tick += prepare_s  # a drafter's deferred prefill is not this round's drafting cost
        cache = self._view(high)
        roots = np.array([r.history[-1] if r else 0 for r in rows], dtype=np.int64)
        # A prompt being prefilled rides along past what it has fed (the next chunk
        # overwrites what the round writes there); a free slot at 0.
        lengths = np.array([cache.lengths[i] if r or i in self.pending else 0
                            for i, r in enumerate(rows)])  # fmt: skip
        output, width = self._forward(cache, roots, [t.tree for t in trees], lengths)
        for b, row in enumerate(rows):
            if row is not None:
                self._commit(b, row, output, lengths[b], proposed[b], trees[b])
        verified = time.perf_counter()
        self.draft_s += tock - tick
        self.verify_s += verified - tock
        self.rounds += 1
        for row in rows:
            if row is not None and row.controller is not None:
                row.controller.timed(width, verified - tock, tock - tick)
        return done + self._release()

    def _forward(self, cache, roots, drafts, lengths) -> tuple[StepOutput, int]:
        """The round's target forward and its width.

        A verify forward over every row's tree or, when no row drafts, a decode step on the
        target's bound buffers (as `generate_speculative`'s plain rounds: a one-token verify
        costs more).
        """
        if not any(len(d) for d in drafts):
            return self.target.decode_step(cache, roots, lengths), 1
        input_ids, positions, mask = verify_inputs(roots, drafts, lengths, self.target.vocab_size)
        output = self.target.forward(cache, input_ids, positions, mask, lengths)
        return output, input_ids.shape[1]

    def _draft(
        self, rows: list[BatchSequence | None]
    ) -> tuple[list[DraftTree], list[Arranged], float]:
        """Each running sequence's proposal, the tree it verifies, and the prefills' seconds.

        The tree: the prefix of the proposal it keeps or, for a greedy row where only the
        spine is exact, that prefix spine first under the row's carried tokens.

        The seconds: drafters' deferred prefills (`Drafter.prepare`, once per sequence).

        The verify forward is as wide as the widest kept draft, and every row writes that
        many slots past its history (padding included), so no row keeps more nodes than
        the fullest row's cache has room for (requests with other drafters, or none,
        reserved only their own scratch).
        """
        proposed = [EMPTY_DRAFT] * len(rows)
        kept = [EMPTY_DRAFT] * len(rows)
        trees = [Arranged.as_drafted(EMPTY_DRAFT)] * len(rows)
        running = self.running
        lengths = [int(self.cache.lengths[b]) for b, row in enumerate(rows)
                   if row is not None or b in self.pending]  # fmt: skip
        room = self.cache.capacity - max(lengths) - 1  # nodes past the root that fit every row
        prepare_s = 0.0
        for b, row in enumerate(rows):
            if row is None or row.drafter is None or room < 1:
                continue
            if row.max_batch_spec is not None and running > row.max_batch_spec:
                row.carry = []  # a plain step moves past the point it was carried for
                continue
            active = np.ones(1, dtype=bool)
            size = min(row.drafter.max_nodes, room)
            if row.controller is not None:
                size = min(int(row.controller.sizes(active, peers=running - 1)[0]), size)
            if size:
                if not row.prepared:
                    prepare_s += prepare_drafter(row.drafter, [row.history])
                    row.prepared = True
                # Budgets only where the draft is cut (third-party drafters may not take one).
                cut = row.controller is not None or size < row.drafter.max_nodes
                budget = {"budget": size} if cut else {}
                proposed[b] = row.drafter.propose(
                    [row.history], active, row.sampling, row.rng, **budget
                )[0]
                kept[b] = truncated(proposed[b], size)
                if row.controller is not None:
                    kept[b] = row.controller.keep([kept[b]])[0]
            if self.spine_only and row.sampling.greedy:
                trees[b] = arrange(row.carry, kept[b], min(row.drafter.max_nodes, room))
            else:
                trees[b] = Arranged.as_drafted(kept[b])
        return proposed, trees, prepare_s

    def _commit(self, b, row: BatchSequence, output, length, proposed, tree: Arranged) -> None:
        """Row b's round after the forward (`commit_row`, as `generate_speculative`'s rows)."""
        spine_only = self.spine_only and row.sampling.greedy
        verified = VerifiedRow(
            row.sampling, row.coin, verify, spine_only, row.drafter, row.controller, 0,
            row.stats, row.emit,
        )  # fmt: skip
        row.carry = commit_row(verified, self.cache, b, int(length), output, tree, proposed).carry
        row.drafted += len(tree.draft)

    def _release(self) -> list[BatchSequence]:
        done = []
        for slot, row in enumerate(self.rows):
            if row is not None and row.finished:
                self.rows[slot] = None
                self.cache.lengths[slot] = 0
                done.append(row)
        return done

    def _view(self, high: int) -> KVCache:
        # One view object per width, so the target's binding is reused across rounds.
        if high not in self._views:
            self._views[high] = self.cache.rows(0, high)
        return self._views[high]


def _choose(logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator) -> int:
    return int(next_tokens(logits[None], sampling, rng)[0])
