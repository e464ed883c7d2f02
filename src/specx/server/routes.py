"""The HTTP API as one table, from which both servers are built.

`ROUTES` declares every endpoint once: its method and path, the `Backend` call that
answers it, and who may call it when the server has keys (`Guard`). `build_app` turns the
table into a FastAPI app over a backend: the local server's answers from a `Service` in
its own process (`specx.server.app`), the Ray gateway's from replicas behind a deployment
handle (`specx.server.ray_serve`). So a route added here exists in both, with the same
bodies, the same key check and the same counting: /metrics counts every response (401s,
404s and GETs too) by its route's path, and a path that is no route as "other", so a scan
of made-up paths cannot grow the label set. A path that is no route gets 404, and a route
asked with another method 405 (with Allow), both in OpenAI's error shape and before the key
check: which paths exist is public (this table), whether a key is good is not.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from specx.server.auth import Access, Guard
from specx.server.metrics import Metrics
from specx.server.protocol import ApiError
from specx.server.service import Reply, ServeOptions

__all__ = ["ROUTES", "Backend", "Route", "build_app", "to_response"]

PROMETHEUS_TEXT = "text/plain; version=0.0.4"


class Backend(Protocol):
    """What answers the routes; the table does the HTTP around it (body, keys, counting)."""

    options: ServeOptions
    counts: Metrics  # where the edge counts responses by route and status

    async def health(self) -> Reply:
        """/health: 200 with {"status": "ok", "model"} while serving, 503 otherwise."""
        ...

    async def models(self) -> dict:
        """The /v1/models body."""
        ...

    async def metrics(self) -> str:
        """The Prometheus text, request counts from `counts`."""
        ...

    async def generate(self, raw: bytes, chat: bool, http: Request) -> Response:
        """The response to a completion request whose body (`raw`) was read within bounds."""
        ...


Handler = Callable[[Backend, Request], Awaitable[Response]]


@dataclass(frozen=True)
class Route:
    """One endpoint: its method and path, what answers it, and whom it lets in."""

    method: str
    path: str
    handler: Handler
    guard: Guard = Guard.KEY


async def _health(backend: Backend, http: Request) -> Response:
    return to_response(await backend.health())


async def _models(backend: Backend, http: Request) -> Response:
    return JSONResponse(await backend.models())


async def _metrics(backend: Backend, http: Request) -> Response:
    return PlainTextResponse(await backend.metrics(), media_type=PROMETHEUS_TEXT)


def _generate(chat: bool) -> Handler:
    async def generate(backend: Backend, http: Request) -> Response:
        try:
            raw = await _read_body(http, backend.options.max_body_bytes)
        except ApiError as e:
            return to_response(Reply(e.status, e.body()))
        return await backend.generate(raw, chat, http)

    return generate


ROUTES = (
    Route("POST", "/v1/completions", _generate(chat=False)),
    Route("POST", "/v1/chat/completions", _generate(chat=True)),
    Route("GET", "/v1/models", _models),
    Route("GET", "/health", _health, Guard.OPEN),
    Route("GET", "/metrics", _metrics, Guard.METRICS),
)
_BY_PATH = {route.path: route for route in ROUTES}


def build_app(
    backend: Backend,
    title: str,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """The table's routes over `backend`, behind the key check and the response counter."""
    # No /docs or /openapi.json: the table is the API, and OpenAI's clients are its docs.
    app = FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    for route in ROUTES:
        app.add_api_route(route.path, _endpoint(route, backend), methods=[route.method])
    # Plain ASGI middlewares: Starlette's BaseHTTPMiddleware (`@app.middleware`) wraps the
    # request's receive channel so that `Request.is_disconnected` no longer sees a client
    # leave, and a non-streamed request whose client left would run to its end.
    if backend.options.access.required:
        app.add_middleware(_RequireKeys, access=backend.options.access)
    app.add_middleware(_KnownRoutes)  # outside the key check: a made-up path is 404 to all
    # Added last, so outermost: it sees the key check's 401s too.
    app.add_middleware(_CountResponses, metrics=backend.counts)
    return app


def _endpoint(route: Route, backend: Backend) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(http: Request) -> Response:
        return await route.handler(backend, http)

    return endpoint


class _KnownRoutes:
    """Answers 404 for a path that is no route and 405 for a route's path asked another way."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            route = _BY_PATH.get(path)
            if route is None or route.method != method:
                await _misrouted(method, path, route)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _misrouted(method: str, path: str, route: Route | None) -> JSONResponse:
    if route is None:
        e = ApiError(404, f"no such endpoint: {method} {path}", code="unknown_url")
        return JSONResponse(e.body(), status_code=404)
    e = ApiError(405, f"{path} takes {route.method}, not {method}", code="method_not_allowed")
    return JSONResponse(e.body(), status_code=405, headers={"Allow": route.method})


class _RequireKeys:
    """Answers 401 unless the request's route lets it in (`Guard`)."""

    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            route = _BY_PATH.get(scope["path"])
            header = dict(scope["headers"]).get(b"authorization")
            try:
                self.access.check(
                    Guard.KEY if route is None else route.guard,
                    header.decode("latin-1") if header else None,
                )
            except ApiError as e:
                refusal = JSONResponse(
                    e.body(), status_code=e.status, headers={"WWW-Authenticate": "Bearer"}
                )
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _CountResponses:
    """Counts every response the app sends by route and status ("other": no route's path).

    (An unhandled exception's 500 comes from Starlette's own outermost layer, past this one.)
    """

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in _BY_PATH else "other"

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.request(route, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


async def _read_body(http: Request, limit: int) -> bytes:
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
