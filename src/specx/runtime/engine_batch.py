"""An engine's continuous batch, as a server drives it: the door a scheduler goes through.

`Engine.continuous_batch(slots)` opens one. It owns what a request's drafting needs from the
engine, so a caller never reaches into the engine's target, lock or plans: `admit` takes a
pooled drafter for the request's plan and the plan's controller (as `Engine.generate` does
for a request) and builds the sequence; a sequence that finishes, fails or is evicted gives
its drafter back; every call that runs the target holds the engine's lock, so requests
through `Engine.generate` and the batch take turns.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from specx.runtime.continuous import BatchSequence, ContinuousBatch
from specx.runtime.drafters.base import Drafter
from specx.runtime.plain_decoding import TokenSink
from specx.runtime.plans import DraftPlan, Plans
from specx.runtime.sampling import SamplingParams

__all__ = ["EngineBatch"]


class EngineBatch:
    """A `ContinuousBatch` over an engine's target, with its plans' drafters (see above)."""

    def __init__(self, batch: ContinuousBatch, plans: Plans, lock: threading.Lock) -> None:
        self._batch, self._plans, self._lock = batch, plans, lock
        self._plans_of: dict[BatchSequence, DraftPlan] = {}  # drafting sequences, by identity

    @property
    def running(self) -> int:
        """Sequences decoding."""
        return self._batch.running

    @property
    def free(self) -> int:
        """Slots a request could take now."""
        return self._batch.free

    @property
    def prefilling(self) -> int:
        """Prompts waiting for `prefill`."""
        return self._batch.prefilling

    @property
    def seconds(self) -> tuple[float, float, float]:
        """Drafting, drafters' deferred prefills and verifying, summed over every round."""
        return self._batch.draft_s, self._batch.draft_prefill_s, self._batch.verify_s

    def check(self, prompt: list[int], max_new_tokens: int, scratch: int = 0) -> None:
        """Refuses a request that cannot fit a slot (GenerationError), before any work."""
        self._batch.check(prompt, max_new_tokens, scratch)

    def admit(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        eos: frozenset[int],
        sink: TokenSink,
        plan: DraftPlan | None,
        chunked: bool = False,
    ) -> tuple[int, BatchSequence]:
        """A request into the lowest free slot: the slot and its sequence.

        `plan` None decodes plainly. `chunked` leaves the prompt to `prefill`; otherwise it
        is prefilled now and its first token emitted. If anything fails the slot stays free,
        the drafter goes back to its pool, and the error propagates.
        """
        drafter: Drafter | None = None
        controller = None
        if plan is not None:
            self._plans.warn_inexact(plan, sampling)
            drafter = self._plans.take(plan)
            # each sequence of the batch is sized as a batch of 1
            controller = self._plans.controller(
                plan, drafter, sampling, [prompt], max_new_tokens, batch=None
            )
        sequence = BatchSequence(
            prompt, max_new_tokens, sampling, eos, sink, drafter, controller,
            None if plan is None else plan.max_batch_spec,
        )  # fmt: skip
        if plan is not None:
            self._plans_of[sequence] = plan
        try:
            with self._lock:
                slot = self._batch.admit(sequence, chunked)
        except BaseException:
            self.release(sequence)
            raise
        return slot, sequence

    def prefill(self, budget: int | None) -> list[tuple[BatchSequence, Exception]]:
        """Feeds waiting prompts (`ContinuousBatch.prefill`); the failed ones are released."""
        with self._lock:
            failed = self._batch.prefill(budget)
        self._release(sequence for sequence, _ in failed)
        return failed

    def step(self) -> list[BatchSequence]:
        """One round for every running sequence; the finished ones, released."""
        with self._lock:
            finished = self._batch.step()
        self._release(finished)
        return finished

    def evict(self, slot: int, sequence: BatchSequence) -> None:
        """Frees `slot` now, whatever it holds, and releases `sequence` (its occupant)."""
        with self._lock:
            self._batch.evict(slot)
        self.release(sequence)

    def release(self, sequence: BatchSequence) -> None:
        """Gives `sequence`'s drafter back to its plan's pool (once; later calls do nothing)."""
        plan = self._plans_of.pop(sequence, None)
        if plan is not None and sequence.drafter is not None:
            self._plans.give_back(plan, sequence.drafter)

    def _release(self, sequences: Iterable[BatchSequence]) -> None:
        for sequence in sequences:
            self.release(sequence)
