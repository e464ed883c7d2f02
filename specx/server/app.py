"""`specx serve`: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

Endpoints: POST /v1/completions and /v1/chat/completions (SSE streaming and not), GET
/v1/models, /health and /metrics (Prometheus text). Decoding runs on the scheduler's
thread (continuous batching, `specx.server.scheduler`); each handler waits for its
request's events on the event loop. A client that disconnects (mid-stream, or while a
non-streamed request is decoding) cancels its request, which frees its slot at the next
round. Bodies over `max_body_bytes` get 413, malformed JSON 400, a full queue 503 with
Retry-After; every error is OpenAI's error object. (This module needs the serve extra.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from specx.errors import SpecxError
from specx.runtime.engine import Engine, Speculation
from specx.server.metrics import Metrics
from specx.server.protocol import (
    ApiError,
    GenerateRequest,
    new_id,
    parse_request,
    response_body,
    stream_chunk,
)
from specx.server.scheduler import Finished, Job, QueueFull, Scheduler, TokensEvent

__all__ = ["ServeOptions", "create_app"]


@dataclass(frozen=True)
class ServeOptions:
    """How the server batches and what it accepts."""

    slots: int = 8  # sequences decoded together (KV cache rows)
    queue_size: int = 64  # requests waiting for a slot before 503
    drafter: str | None = None  # default drafting for requests that name none
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1


def create_app(engine: Engine, options: ServeOptions = ServeOptions()):
    """The FastAPI app; its lifespan starts and stops the scheduler thread."""
    metrics = Metrics()
    scheduler = Scheduler(engine, options.slots, options.queue_size, metrics)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.close()

    app = FastAPI(title="specx", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    def error(e: ApiError, endpoint: str) -> JSONResponse:
        metrics.request(endpoint, e.status)
        headers = {"Retry-After": str(options.retry_after_s)} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.name}

    @app.get("/v1/models")
    async def models():
        model = {"id": engine.name, "object": "model", "created": 0, "owned_by": "specx",
                 "max_model_len": engine.capacity}  # fmt: skip
        return {"object": "list", "data": [model]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    async def generate(http: Request, chat: bool):
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            body = await _read_json(http, options.max_body_bytes)
            request = parse_request(body, chat, engine.name, options.drafter)
            job, events = _job(engine, scheduler, request)
            scheduler.check(job)
            scheduler.submit(job)
        except ApiError as e:
            return error(e, endpoint)
        except QueueFull as e:
            return error(ApiError(503, str(e), kind="server_overloaded"), endpoint)
        except SpecxError as e:
            return error(ApiError(400, str(e)), endpoint)
        metrics.request(endpoint, 200)
        rid = new_id(chat)
        if request.stream:
            stream = _sse(request, job, events, engine.name, rid)
            return StreamingResponse(stream, media_type="text/event-stream")
        done = await _wait(http, job, events)
        if done is None:  # the client went away
            return JSONResponse({}, status_code=499)
        if done.finish_reason == "error":
            return error(ApiError(500, f"decoding failed: {done.error}"), endpoint)
        return response_body(request, done, engine.name, rid)

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await generate(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        return await generate(http, chat=True)

    return app


async def _read_json(http, limit: int):
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes")
    body = b""
    async for part in http.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e


def _job(engine: Engine, scheduler: Scheduler, request: GenerateRequest):
    """The scheduler job for `request` and the asyncio queue its events arrive on."""
    try:
        if request.chat:
            prompt = engine.chat_prompt(request.messages)
        else:
            prompt = engine.encode(request.prompt)
        if request.stop and engine.tokenizer is None:
            raise ApiError(400, "stop strings need the artifact's tokenizer", "stop")
        plan = None
        if request.drafter is not None:
            plan = engine.plan(Speculation(request.drafter), request.sampling)
            engine.check_drafter(plan)
    except SpecxError as e:
        raise ApiError(400, str(e)) from e
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    eos = frozenset(() if request.ignore_eos else engine.manifest.model["eos_token_ids"])

    def deliver(event: TokensEvent | Finished) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    job = Job(prompt, request.max_tokens, request.sampling, request.stop, eos, plan, deliver)
    return job, events


async def _wait(http, job: Job, events: asyncio.Queue) -> Finished | None:
    """The request's end, or None when the client disconnected first (the job cancelled)."""
    while True:
        try:
            event = await asyncio.wait_for(events.get(), timeout=0.25)
        except TimeoutError:
            if await http.is_disconnected():
                job.cancelled.set()
                return None
            continue
        if isinstance(event, Finished):
            return event


async def _sse(
    request: GenerateRequest, job: Job, events: asyncio.Queue, model: str, rid: str
) -> AsyncIterator[str]:
    first = True
    try:
        while True:
            event = await events.get()
            if isinstance(event, TokensEvent):
                if event.text or event.tokens:
                    chunk = stream_chunk(request, model, rid, event.text, event.tokens, first=first)
                    first = False
                    yield f"data: {json.dumps(chunk)}\n\n"
                continue
            if event.finish_reason == "error":
                yield f"data: {json.dumps(ApiError(500, str(event.error)).body())}\n\n"
            else:
                chunk = stream_chunk(request, model, rid, event.tail, [], event, first=first)
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
            return
    finally:  # also when the client disconnects: the request ends at the next round
        job.cancelled.set()
