"""The server's decoding thread: a bounded queue in front of the engine's continuous batch.

Requests are admitted into free KV slots between rounds (continuous batching, see
`specx.runtime.continuous`); when every slot is taken they wait in a queue of bounded
length, and past it `submit` raises `QueueFull` (the HTTP layer answers 503 with
Retry-After). Each job's events (tokens with their text, then its end) are handed to its
`deliver` callback from this thread; a cancelled job (the client went away) ends at the
next round and frees its slot. The scheduler reaches the engine only through its API
(`Engine.continuous_batch`: admit, prefill, step, evict, release), which gives each running
request a drafter of its own from the engine's pool for its plan and takes it back at its end.

A job may carry a deadline: past it, a waiting job ends at once and a running one at the
next round, both with finish reason "timeout" (its slot freed). `drain` stops admitting
new jobs (`submit` raises `Unavailable`) while the queued and running ones finish;
`wait_idle` waits for that, and `abort` ends whatever is left (finish reason "shutdown")
when the drain's time is up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specx.errors import SpecxError
from specx.runtime.continuous import BatchSequence
from specx.runtime.detokenize import TextStream
from specx.runtime.engine import Engine
from specx.runtime.plans import DraftPlan
from specx.runtime.prefix_cache import PrefixCache
from specx.runtime.sampling import SamplingParams
from specx.server.events import Finished, TokensEvent
from specx.server.metrics import Metrics

__all__ = ["Job", "QueueFull", "Scheduler", "Unavailable"]

logger = logging.getLogger("specx")


class QueueFull(SpecxError):
    """Every slot is busy and the queue is at its bound: retry later."""


class Unavailable(SpecxError):
    """The decoding thread stopped (the server is closing, or it failed)."""


@dataclass
class Job:
    """One request: what to decode and where its events go."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    eos: frozenset[int]
    plan: DraftPlan | None
    deliver: Callable[[TokensEvent | Finished], None]  # called from the scheduler thread
    scratch: int = 0  # the plan's drafter's slots past the history (`scratch_of`)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    timeout_s: float | None = None  # from `submitted`; None: no deadline
    expired: bool = False  # set by the scheduler once past the deadline

    def overdue(self, now: float) -> bool:  # noqa: D102
        return self.timeout_s is not None and now - self.submitted > self.timeout_s


class Scheduler:
    """Owns the engine's target while serving (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        slots: int,
        queue_size: int,
        metrics: Metrics,
        prefix_cache: PrefixCache | None = None,
        prefill_chunk: int = 0,
    ):
        self.engine, self.queue_size, self.metrics = engine, queue_size, metrics
        self.prefill_chunk = prefill_chunk  # prompt tokens prefilled between rounds (0: whole)
        self.batch = engine.continuous_batch(slots, prefix_cache)
        metrics.prefix_cache = prefix_cache
        self._waiting: deque[Job] = deque()
        self._running: dict[int, tuple[Job, BatchSequence, TextStream]] = {}
        self._cond = threading.Condition()
        self._closing = self._draining = self._aborting = False
        self._thread = threading.Thread(target=self._run, name="specx-scheduler", daemon=True)
        metrics.slots = slots

    def start(self) -> None:  # noqa: D102
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the decoding thread runs (health checks)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stops the thread after its current round; running and waiting jobs end cancelled."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()

    def drain(self) -> None:
        """Admits no new job from now on; queued and running ones go on to their end."""
        with self._cond:
            self._draining = True

    def abort(self) -> None:
        """Ends every queued and running job now (finish reason "shutdown"); admits no more.

        Running jobs end between rounds, on the decoding thread, so each one's client gets
        its answer (an error) rather than a cut connection; `wait_idle` sees them gone.
        """
        with self._cond:
            self._draining = self._aborting = True
            while self._waiting:
                job = self._waiting.popleft()
                self._finish(job, _ended(job, "shutdown"))
            self.metrics.queue_depth = 0
            self._cond.notify()

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no job is queued or running; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                if not (self._waiting or self._running):
                    return True
            if time.monotonic() >= deadline or not self.alive:
                return False
            time.sleep(0.05)

    def check(self, job: Job) -> None:
        """Refuses a job that cannot fit a slot (GenerationError), before it is queued."""
        self.batch.check(job.prompt, job.max_new_tokens, job.scratch)

    def submit(self, job: Job) -> None:
        """Queues `job`.

        Raises:
            QueueFull: the queue is at its bound.
            Unavailable: the decoding thread is not running.
        """
        with self._cond:
            if self._closing or not self.alive:
                raise Unavailable("the server's decoding thread is not running")
            if self._draining:
                raise Unavailable("the server is shutting down; retry on another instance")
            self._drop_cancelled()  # a client that left gives its place back at once
            if len(self._waiting) >= self.queue_size:
                raise QueueFull(f"{len(self._waiting)} requests are waiting; retry later")
            self._waiting.append(job)
            self.metrics.queue_depth = len(self._waiting)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self.batch.running or self.batch.prefilling
                           or self._closing):  # fmt: skip
                    self._cond.wait()
                if self._closing:
                    break
                if self._aborting:  # between rounds: each row is whole
                    for slot, (_, sequence, _) in list(self._running.items()):
                        self.batch.evict(slot, sequence)
                        self._end(slot, "shutdown")
                    continue
                self._expire(time.perf_counter())
                self._drop_cancelled()
                admit: list[Job] = []
                while self._waiting and self.batch.free - len(admit) > 0:
                    admit.append(self._waiting.popleft())
                self.metrics.queue_depth = len(self._waiting)
            for job in admit:
                self._admit(job)
            self._prefill()
            try:
                self._round()
            except Exception as e:  # noqa: BLE001 - the server must keep serving
                logger.exception("decoding round failed")
                for slot in list(self._running):
                    self._end(slot, "error", str(e))
        with self._cond:  # closing: nobody is left without an answer
            for slot in list(self._running):
                self._end(slot, "cancelled")
            while self._waiting:
                self._finish(self._waiting.popleft(), None)

    def _expire(self, now: float) -> None:
        """Ends waiting jobs past their deadline; running ones end at this round's end."""
        for job in [j for j in self._waiting if j.overdue(now)]:
            self._waiting.remove(job)
            self._finish(job, _ended(job, "timeout"))
        for job, _, _ in self._running.values():
            if job.overdue(now):
                job.expired = True
                job.cancelled.set()

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.cancelled.is_set()]:
            self._waiting.remove(job)
            self._finish(job, _cancelled(job))
        self.metrics.queue_depth = len(self._waiting)

    def _finish(self, job: Job, done: Finished | None) -> None:
        done = done or _cancelled(job)
        self.metrics.finished(done)
        try:
            job.deliver(done)
        except RuntimeError:  # the client's event loop is gone (server shutting down)
            pass

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._finish(job, _cancelled(job))
            return
        text = self.engine.text_stream(job.stop)

        def sink(_row: int, tokens: list[int]) -> bool:
            before = len(text.tokens)
            delta = text.push(tokens)
            job.deliver(TokensEvent(text.tokens[before:], delta))
            return not (text.stopped or job.cancelled.is_set())

        try:  # a failure leaves the slot free
            slot, sequence = self.batch.admit(
                job.prompt, job.max_new_tokens, job.sampling, job.eos, sink, job.plan,
                chunked=self.prefill_chunk > 0,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the others
            if not isinstance(e, SpecxError):
                logger.exception("admitting a request failed")
            self._finish(job, _failed(job, str(e)))
            return
        self._running[slot] = (job, sequence, text)
        self.metrics.admitted(time.perf_counter() - job.submitted)

    def _prefill(self) -> None:
        """One chunk of the waiting prompts (`prefill_chunk` tokens) between two rounds.

        Where no sequence runs, the oldest prompt whole: chunks would only cost there.
        """
        if not self.batch.prefilling:
            return
        budget = self.prefill_chunk if self.batch.running else None
        for sequence, error in self.batch.prefill(budget):
            slot = next(s for s, (_, seq, _) in self._running.items() if seq is sequence)
            job, _, _ = self._running.pop(slot)
            if not isinstance(error, SpecxError):
                logger.error("prefilling a request failed: %s", error)
            self._finish(job, _failed(job, str(error)))

    def _round(self) -> None:
        if not self.batch.running:  # only prompts being prefilled
            return
        started = time.perf_counter()
        before = self.batch.seconds
        finished = self.batch.step()
        for slot in [s for s, (_, seq, _) in self._running.items() if seq in finished]:
            job, _, text = self._running[slot]
            reason = None
            if job.cancelled.is_set() and not text.stopped:
                reason = "timeout" if job.expired else "cancelled"
            self._end(slot, reason)
        spent = (b - a for a, b in zip(before, self.batch.seconds, strict=True))
        self.metrics.round(self.batch.running, time.perf_counter() - started, *spent)

    def _end(self, slot: int, reason: str | None, error: str | None = None) -> None:
        job, sequence, text = self._running.pop(slot)
        if error is not None:  # the batch is in an unknown state for this row: free it
            self.batch.evict(slot, sequence)
        tokens = sequence.emitted[: len(text.tokens)] if text.stopped else sequence.emitted
        if reason is None:
            stopped = text.stopped or (tokens and tokens[-1] in job.eos)
            reason = "stop" if stopped else "length"
        acceptance = sequence.stats.summary()
        done = Finished(
            tokens=list(tokens),
            text=text.text,
            tail=text.finish(),
            finish_reason=reason,
            prompt_tokens=len(job.prompt),
            rounds=acceptance.rounds,
            drafted=sequence.drafted,
            accepted=acceptance.accepted_tokens,
            acceptance_length=acceptance.acceptance_length,
            acceptance_by_position=list(acceptance.acceptance_by_position),
            error=error,
        )
        self.batch.release(sequence)
        self._finish(job, done)


def _cancelled(job: Job) -> Finished:
    return _ended(job, "cancelled")


def _ended(job: Job, reason: str) -> Finished:
    return Finished([], "", "", reason, len(job.prompt), 0, 0, 0, 0.0, [])


def _failed(job: Job, error: str) -> Finished:
    return Finished([], "", "", "error", len(job.prompt), 0, 0, 0, 0.0, [], error)
