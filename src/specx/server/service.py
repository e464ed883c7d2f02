"""Request handling shared by the local server and Ray replicas: bytes in, replies out.

A `Service` owns an engine's scheduler and metrics. `open` checks a raw request body and
queues its job (or raises `ApiError`); `reply` waits for a non-streamed result; `sse`
yields a streamed one as server-sent events. Both end the job if their caller goes away
(`disconnected`, or the coroutine/generator being cancelled or closed), which frees its
slot at the next round. The HTTP layers (the route table, `specx.server.routes`, served
by `specx.server.app` and `specx.server.ray_serve`) only move bytes and status codes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from specx.chat import ChatTemplate
from specx.drafter_name import LOOKUPS
from specx.errors import CapacityError, SpecxError
from specx.runtime.engine import Engine, Speculation
from specx.runtime.prefix_cache import PrefixCache
from specx.server.auth import Access
from specx.server.events import Finished, TokensEvent
from specx.server.metrics import Metrics
from specx.server.protocol import (
    ApiError,
    GenerateRequest,
    new_id,
    parse_request,
    response_body,
    stream_chunk,
)
from specx.server.scheduler import Job, QueueFull, Scheduler, Unavailable

__all__ = ["Opened", "Reply", "ServeOptions", "Service"]

FAILURES = ("error", "timeout", "shutdown")  # finish reasons answered with an error


@dataclass(frozen=True)
class ServeOptions:
    """How the server batches and what it accepts."""

    slots: int = 8  # sequences decoded together (KV cache rows)
    queue_size: int = 64  # requests waiting for a slot before 503
    drafter: str | None = None  # default drafting for requests that name none
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1
    chat_template: ChatTemplate | None = None  # instead of the artifact's (or its lack)
    access: Access = Access()  # API keys (none: open)
    request_timeout_s: float | None = None  # a request's deadline from its arrival
    prefix_cache_bytes: int = 512 << 20  # KV of earlier prompts kept for reuse (0: none)
    # Prompt tokens prefilled between two rounds while requests run (0: a whole prompt at
    # once); see specx.runtime.continuous on chunked prefill. 256 measured best on pyref-1b:
    # benchmarks/README.md#servingpy (64 cut the inter-token p99 more and the throughput too).
    prefill_chunk: int = 256
    build: str | None = None  # the artifact's build every replica runs (None: its default)


@dataclass(frozen=True)
class Reply:
    """A JSON response: status, body and extra headers."""

    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Opened:
    """A queued request: its checked form, job, event queue and response id."""

    request: GenerateRequest
    job: Job
    events: asyncio.Queue
    rid: str


class Service:
    """One engine behind the OpenAI API (see the module docstring)."""

    def __init__(self, engine: Engine, options: ServeOptions):
        """A service over `engine`; the HTTP edge counts its responses (`specx.server.routes`)."""
        self.engine, self.options = engine, options
        if options.chat_template is not None:
            engine.use_chat_template(options.chat_template)
        self.metrics = Metrics()
        self.metrics.build, self.metrics.build_reason = engine.build, engine.build_reason
        prefix = PrefixCache(options.prefix_cache_bytes) if options.prefix_cache_bytes else None
        self.scheduler = Scheduler(engine, options.slots, options.queue_size, self.metrics, prefix,
                                   options.prefill_chunk)  # fmt: skip
        self.draining = False

    def start(self) -> None:  # noqa: D102
        self.scheduler.start()

    def close(self) -> None:  # noqa: D102
        self.scheduler.close()

    def drain(self) -> None:
        """New requests get 503 (and /health says so); admitted ones run to their end."""
        self.draining = True
        self.scheduler.drain()

    def health(self) -> Reply:
        """/health: 200 while serving, 503 while draining or when decoding stopped."""
        if not self.scheduler.alive or self.draining:
            status = "draining" if self.draining else "unavailable"
            return Reply(503, {"status": status, "model": self.engine.name})
        return Reply(200, {"status": "ok", "model": self.engine.name})

    def models(self) -> dict:
        """The /v1/models body."""
        model = {"id": self.engine.name, "object": "model", "created": 0, "owned_by": "specx",
                 "max_model_len": self.engine.capacity}  # fmt: skip
        return {"object": "list", "data": [model]}

    def error(self, e: ApiError) -> Reply:
        """`e` as a reply (503s carry Retry-After)."""
        retry = {"Retry-After": str(self.options.retry_after_s)} if e.status == 503 else {}
        return Reply(e.status, e.body(), retry)

    def open(self, raw: bytes, chat: bool) -> Opened:
        """Checks and queues a request body; raises ApiError (4xx, or 503 when full)."""
        if len(raw) > self.options.max_body_bytes:
            raise ApiError(413, f"the request body is over {self.options.max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from e
        request = parse_request(body, chat, self.engine.name, self.options.drafter)
        job, events = self._job(request)
        try:
            self.scheduler.check(job)
            self.scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(503, str(e), kind="server_overloaded") from e
        except Unavailable as e:
            raise ApiError(503, str(e), kind="server_unavailable") from e
        except CapacityError as e:
            raise ApiError(400, _too_long(e), "max_tokens") from e
        except SpecxError as e:
            raise ApiError(400, str(e)) from e
        return Opened(request, job, events, new_id(chat))

    async def reply(self, opened: Opened, disconnected: Callable[[], Awaitable[bool]]) -> Reply:
        """The non-streamed response; the job ends early if `disconnected()` turns true."""
        loop = asyncio.get_running_loop()
        polled = loop.time()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(opened.events.get(), timeout=0.25)
                except TimeoutError:
                    event = None
                if isinstance(event, Finished):
                    break
                # Rounds deliver events all the time: poll on the clock, not on silence.
                if loop.time() - polled >= 0.25:
                    polled = loop.time()
                    if await disconnected():
                        return Reply(499, {})
        finally:
            opened.job.cancelled.set()  # a no-op once it finished
        if event.finish_reason in FAILURES:
            return self.error(self._failure(event))
        return Reply(200, response_body(opened.request, event, self.engine.name, opened.rid))

    async def sse(self, opened: Opened) -> AsyncIterator[str]:
        """Server-sent events: a chunk per round, the final one with stats, then [DONE]."""
        request, name, rid, first = opened.request, self.engine.name, opened.rid, True
        try:
            while True:
                event = await opened.events.get()
                if isinstance(event, TokensEvent):
                    if event.text or event.tokens:
                        chunk = stream_chunk(request, name, rid, event.text, event.tokens,
                                             first=first)  # fmt: skip
                        first = False
                        yield f"data: {json.dumps(chunk)}\n\n"
                    continue
                if event.finish_reason in FAILURES:
                    yield f"data: {json.dumps(self._failure(event).body())}\n\n"
                else:
                    chunk = stream_chunk(request, name, rid, event.tail, [], event, first=first)
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:  # also when the client disconnects: the request ends at the next round
            opened.job.cancelled.set()

    def _failure(self, event: Finished) -> ApiError:
        if event.finish_reason == "timeout":
            limit = self.options.request_timeout_s
            return ApiError(504, f"the request ran past the server's {limit:g} s limit",
                            kind="timeout")  # fmt: skip
        if event.finish_reason == "shutdown":
            message = ("the server shut down before this request finished (its drain time "
                       "ran out); retry on another instance")  # fmt: skip
            return ApiError(503, message, kind="server_unavailable")
        return ApiError(500, f"decoding failed: {event.error}")

    def _job(self, request: GenerateRequest) -> tuple[Job, asyncio.Queue]:
        engine = self.engine
        try:
            if request.chat:
                assert request.messages is not None  # parse_request: every chat request's
                prompt = engine.chat_prompt(request.messages)
            else:
                assert request.prompt is not None  # parse_request: every completion's
                prompt = engine.encode(request.prompt)
            if request.stop and engine.tokenizer is None:
                raise ApiError(400, "stop strings need the artifact's tokenizer", "stop")
            plan, scratch = None, 0
            if request.drafter is not None:
                self._check_allowed(request.drafter)
                plan = engine.plan(Speculation(request.drafter), request.sampling)
                scratch = engine.check_plan(plan)  # built once per plan, then pooled
        except SpecxError as e:
            raise ApiError(400, str(e)) from e
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        eos = frozenset(() if request.ignore_eos else engine.manifest.model.eos_token_ids)

        def deliver(event: TokensEvent | Finished) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        job = Job(
            prompt, request.max_tokens, request.sampling, request.stop, eos, plan, deliver, scratch,
            timeout_s=self.options.request_timeout_s,
        )  # fmt: skip
        return job, events

    def _check_allowed(self, drafter: str) -> None:
        """Refuses a request's drafter unless it is served here.

        Requests choose among the model-free drafters, the artifact's head and the server's
        default; never a path of their own (which draft model runs is the operator's call).
        """
        exported = self.engine.manifest.drafter
        head = None if exported is None else exported.kind
        allowed = [d for d in dict.fromkeys((*LOOKUPS, head, self.options.drafter)) if d]
        if drafter not in allowed:
            raise ApiError(
                400, f"drafter {drafter!r} is not served here; choose one of {allowed} or null",
                "drafter",
            )  # fmt: skip


def _too_long(e: CapacityError) -> str:
    """The capacity error in the request's words (max_tokens), not the CLI's flags."""
    drafting = e.needed - e.longest - e.new_tokens + 1
    scratch = f" and {drafting} for its drafter's tree" if drafting else ""
    return (
        f"the prompt has {e.longest} tokens; with max_tokens {e.new_tokens}{scratch} it needs "
        f"{e.needed} positions but this model serves {e.capacity}: shorten the prompt or "
        "lower max_tokens"
    )
