"""`specx serve`: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

Endpoints: POST /v1/completions and /v1/chat/completions (SSE streaming and not), GET
/v1/models, /health and /metrics (Prometheus text). Request handling is the `Service`'s
(`specx.server.service`); decoding runs on its scheduler's thread (continuous batching).
With API keys set (`ServeOptions.access`, `specx.server.auth`) every path but /health (and
/metrics if opened) needs one: 401 otherwise. Bodies over `max_body_bytes` get 413 (before
they are read whole), malformed JSON 400, a full queue 503 with Retry-After; every error is
OpenAI's error object; /metrics counts every response by route and status. A client that
disconnects cancels its request, which frees its slot at the next round. (This module needs
the serve extra.)
"""

from __future__ import annotations

import signal
import socket
import threading
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from specx.runtime.engine import Engine
from specx.server.auth import Access
from specx.server.protocol import ApiError
from specx.server.service import Reply, ServeOptions, Service

__all__ = [
    "DrainingServer",
    "ServeOptions",
    "create_app",
    "read_body",
    "require_keys",
    "serve",
    "to_response",
]


def create_app(engine: Engine, options: ServeOptions | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the scheduler thread."""
    options = options or ServeOptions()
    service = Service(engine, options, count_requests=False)  # counted at the edge, below

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        service.close()

    app = FastAPI(title="specx", lifespan=lifespan)
    app.state.service = service
    require_keys(app, options.access)
    # Added last, so outermost: it sees the key check's 401s too.
    app.add_middleware(_CountResponses, metrics=service.metrics)

    @app.get("/health")
    async def health():
        return to_response(service.health())

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4")

    async def generate(http: Request, chat: bool):
        try:
            opened = service.open(await read_body(http, options.max_body_bytes), chat)
        except ApiError as e:
            return to_response(service.error(e, chat))
        if opened.request.stream:
            return StreamingResponse(service.sse(opened), media_type="text/event-stream")
        return to_response(await service.reply(opened, http.is_disconnected))

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await generate(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        return await generate(http, chat=True)

    return app


def require_keys(app: FastAPI, access: Access) -> None:
    """Every request to `app` passes `access.check` first (401 otherwise); no-op without keys.

    A plain ASGI middleware: Starlette's BaseHTTPMiddleware (`@app.middleware`) wraps the
    request's receive channel so that `Request.is_disconnected` no longer sees a client
    leave, and a non-streamed request whose client left would run to its end.
    """
    if access.required:
        app.add_middleware(_RequireKeys, access=access)


class _RequireKeys:
    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization")
            try:
                self.access.check(scope["path"], header.decode("latin-1") if header else None)
            except ApiError as e:
                refusal = JSONResponse(
                    e.body(), status_code=e.status, headers={"WWW-Authenticate": "Bearer"}
                )
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class _CountResponses:
    """Counts every response the app sends by route and status, 401s to 503s and GETs too.

    (An unhandled exception's 500 comes from Starlette's own outermost layer, past this one.)

    A path that is no route counts as "other": a scan of made-up paths cannot grow the
    label set.
    """

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.request(route, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


async def read_body(http: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it is over `limit` bytes."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes")
    body = b""
    async for part in http.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes")
    return body


def to_response(reply: Reply) -> JSONResponse:  # noqa: D103
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers or None)


def serve(engine: Engine, options: ServeOptions, listening: socket.socket, drain_s: float) -> None:
    """Serves on `listening` until SIGINT (stops now) or SIGTERM (drains, then exits).

    On SIGTERM, what an orchestrator sends before it kills a container, new requests get
    503 with Retry-After (and /health 503) while the admitted ones run to their end, for
    at most `drain_s` seconds; then the server stops and cancels whatever is left, and
    `serve` returns (exit status 0).
    """
    app = create_app(engine, options)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    DrainingServer(config, app.state.service, drain_s).run(sockets=[listening])


class DrainingServer(uvicorn.Server):
    """uvicorn's Server whose first SIGTERM drains `service` before it exits (see `serve`)."""

    def __init__(self, config: uvicorn.Config, service: Service, drain_s: float):
        super().__init__(config)
        self.service, self.drain_s = service, drain_s

    def handle_exit(self, sig, frame) -> None:  # noqa: D102
        if sig != signal.SIGTERM or self.service.draining:
            return super().handle_exit(sig, frame)
        self.service.drain()  # not recorded as captured: uvicorn re-raises those at exit
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def _exit_when_idle(self) -> None:
        self.service.scheduler.wait_idle(self.drain_s)
        self.should_exit = True
