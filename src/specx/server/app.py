"""`specx serve`: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

Endpoints (the route table, `specx.server.routes`, which the Ray gateway serves too): POST
/v1/completions and /v1/chat/completions (SSE streaming and not), GET /v1/models, /health
and /metrics (Prometheus text). Request handling is the `Service`'s
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
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from specx.runtime.engine import Engine
from specx.server.protocol import ApiError
from specx.server.routes import build_app, to_response
from specx.server.service import Reply, ServeOptions, Service

__all__ = ["DrainingServer", "ServeOptions", "create_app", "serve"]


def create_app(engine: Engine, options: ServeOptions | None = None) -> FastAPI:
    """The route table's app over `engine`; its lifespan starts and stops the scheduler thread."""
    service = Service(engine, options or ServeOptions())

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        service.close()

    app = build_app(_Local(service), "specx", lifespan)
    app.state.service = service
    return app


class _Local:
    """The routes' backend in this process: the service itself (its metrics count the edge)."""

    def __init__(self, service: Service):
        self.service, self.options, self.counts = service, service.options, service.metrics

    async def health(self) -> Reply:  # noqa: D102
        return self.service.health()

    async def models(self) -> dict:  # noqa: D102
        return self.service.models()

    async def metrics(self) -> str:  # noqa: D102
        return self.counts.render()

    async def generate(self, raw: bytes, chat: bool, http: Request) -> Response:
        """Queues the request; streams it, or answers when done (ended if the client leaves)."""
        try:
            opened = self.service.open(raw, chat)
        except ApiError as e:
            return to_response(self.service.error(e))
        if opened.request.stream:
            return StreamingResponse(self.service.sse(opened), media_type="text/event-stream")
        return to_response(await self.service.reply(opened, http.is_disconnected))


ANSWER_S = 2  # how long the requests cut at the drain's end have to get their answers


def serve(engine: Engine, options: ServeOptions, listening: socket.socket, drain_s: float) -> None:
    """Serves on `listening` until SIGINT (stops now) or SIGTERM (drains, then exits).

    On SIGTERM, what an orchestrator sends before it kills a container, new requests get
    503 with Retry-After (and /health 503) while the admitted ones run to their end, for
    at most `drain_s` seconds; then each one left gets an error (503; a stream: an error
    event, then [DONE]), the server stops and `serve` returns (exit status 0).
    """
    app = create_app(engine, options)
    # Past the drain every response has ended, so the connections close at once: the
    # bound only covers a client that stops reading.
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=ANSWER_S)
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
        scheduler = self.service.scheduler
        if not scheduler.wait_idle(self.drain_s):
            scheduler.abort()  # what is left ends at the round's end, each with its answer
            scheduler.wait_idle(ANSWER_S)
        self.should_exit = True
