"""`specx serve --ray`: the same service scaled out as a Ray Serve application.

Two deployments, composed the way Ray Serve composes models:
- `SpecxModel`, N replicas (Ray actors): each loads and verifies the artifact
  (`specx.load`) and runs a `Service` (its own scheduler, continuous batching). Ray's
  router spreads requests over the replicas and restarts one that dies.
- `SpecxGateway`, the HTTP ingress: the local server's route table
  (`specx.server.routes`: the same endpoints, bodies, key check and response counts),
  forwarding each request to a replica through a deployment handle. When a replica dies mid-request,
  Ray raises `RayActorError` in the gateway, which answers 503 with Retry-After and an
  OpenAI error of type "replica_unavailable" (streams that already started get that error
  as their last event): only the dead replica's in-flight requests fail, and a retry
  lands on a live replica. (Without the gateway, Ray's proxy answers such requests with
  a bare "500 Internal Server Error".)

On a multi-node Ray cluster the same code runs unchanged: `--address` names the cluster
(`ray start --head` on one node, `ray start --address HEAD:6379` on the others), replicas
are placed on any node with a free CPU, and the artifact must be readable at the same
path on every node (a shared filesystem, or the same directory copied to each).
/metrics on the gateway counts its every response by route and status (all replicas'
requests, as they pass through it), with one replica's other families (Ray routes the
scrape like any request); Ray's own metrics cover the deployment as a whole.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from ray import serve
from ray.exceptions import RayActorError

from specx.server.metrics import Metrics
from specx.server.protocol import ApiError
from specx.server.routes import build_app, to_response
from specx.server.service import Reply, ServeOptions

__all__ = ["RayOptions", "SpecxGateway", "SpecxModel", "deploy"]


@dataclass(frozen=True)
class RayOptions:
    """Where and how many replicas run."""

    replicas: int = 2
    address: str | None = None  # None: a local Ray instance; "auto" or HOST:PORT: a cluster
    cpus_per_replica: float = 1.0
    host: str = "127.0.0.1"
    port: int = 8000


class SpecxModel:
    """One replica: an engine and its service (no HTTP of its own)."""

    def __init__(self, artifact: str, threads: int | None, options: ServeOptions):
        import ray

        from specx.runtime.engine import load
        from specx.server.service import Service

        engine = load(artifact, threads=threads, build=options.build, rows=options.slots)
        self.service = Service(engine, options)
        self.service.start()
        # Every reply names its replica (the Ray actor), for operators and for tests.
        self.header = {"x-specx-replica": ray.get_runtime_context().get_actor_name() or ""}

    def health(self) -> Reply:  # noqa: D102
        return self.service.health()

    def models(self) -> dict:  # noqa: D102
        return self.service.models()

    def metrics(self, requests: dict[tuple[str, int], int]) -> str:
        """This replica's families, with the gateway's request counts (`requests`)."""
        return self.service.metrics.render(requests)

    async def complete(self, raw: bytes, chat: bool) -> Reply:
        """A non-streamed reply; a cancelled call (the client left) ends the job."""
        try:
            opened = self.service.open(raw, chat)
        except ApiError as e:
            return self.service.error(e)
        reply = await self.service.reply(opened, _connected)
        return Reply(reply.status, reply.body, reply.headers | self.header)

    async def stream(self, raw: bytes, chat: bool) -> AsyncIterator[Reply | str]:
        """First a Reply (200, or the error), then the SSE lines."""
        try:
            opened = self.service.open(raw, chat)
        except ApiError as e:
            yield self.service.error(e)
            return
        yield Reply(200, {}, self.header)
        async for line in self.service.sse(opened):
            yield line

    def check_health(self) -> None:
        """Ray's health probe: a replica whose decoding thread died is restarted."""
        if not self.service.scheduler.alive:
            raise RuntimeError("the specx scheduler thread is not running")


@serve.ingress()
class SpecxGateway:
    """The HTTP ingress: forwards to `SpecxModel` replicas (see the module docstring)."""

    def __init__(self, model, options: ServeOptions):
        self.model, self.options = model, options

    def __serve_build_asgi_app__(self) -> FastAPI:  # noqa: D105 - Ray's hook
        return gateway_app(self.model, self.options)


def gateway_app(model, options: ServeOptions) -> FastAPI:
    """The route table's app over the replicas; `model` is a deployment handle to them."""
    return build_app(_Replicas(model, options), "specx (Ray Serve)")


class _Replicas:
    """The routes' backend in the gateway: calls to replicas; the gateway counts responses."""

    def __init__(self, model, options: ServeOptions):
        self.model, self.options, self.counts = model, options, Metrics()

    async def health(self) -> Reply:  # noqa: D102
        return await self.model.health.remote()

    async def models(self) -> dict:  # noqa: D102
        return await self.model.models.remote()

    async def metrics(self) -> str:  # noqa: D102
        return await self.model.metrics.remote(self.counts.request_counts())

    async def generate(self, raw: bytes, chat: bool, http: Request) -> Response:
        """A replica's reply; 503 "replica_unavailable" if it dies before the reply starts."""
        if not _streaming(raw):
            try:
                return to_response(await self.model.complete.remote(raw, chat))
            except RayActorError as e:
                return to_response(_replica_died(e, self.options))
        stream = self.model.options(stream=True).stream.remote(raw, chat)
        try:
            head = await stream.__anext__()
        except RayActorError as e:
            return to_response(_replica_died(e, self.options))
        if head.status != 200:
            return to_response(head)
        return StreamingResponse(
            _relay(stream, self.options), media_type="text/event-stream", headers=head.headers
        )


async def _relay(stream, options: ServeOptions) -> AsyncIterator[str]:
    try:
        async for line in stream:
            yield line
    except RayActorError as e:
        yield f"data: {json.dumps(_replica_died(e, options).body)}\n\n"


def _replica_died(error: RayActorError, options: ServeOptions) -> Reply:
    message = (
        "the replica serving this request died before it finished; retry the request "
        f"(another replica will take it): {type(error).__name__}"
    )
    body = ApiError(503, message, kind="replica_unavailable").body()
    return Reply(503, body, {"Retry-After": str(options.retry_after_s)})


def _streaming(raw: bytes) -> bool:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False  # the replica answers it with the parse error
    return isinstance(body, dict) and body.get("stream") is True


async def _connected() -> bool:
    return False  # a replica learns of a disconnect by its call being cancelled


def deploy(
    artifact: Path, threads: int | None, options: ServeOptions, ray_options: RayOptions
) -> str:
    """Starts Ray (or joins `address`), deploys the replicas and the gateway; the base URL."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_options.address, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": ray_options.host, "port": ray_options.port})
    # The decorator form: Ray's overloads type deployment(cls, **options) as the decorator.
    replicas = serve.deployment(
        name="specx-model",
        num_replicas=ray_options.replicas,
        ray_actor_options={"num_cpus": ray_options.cpus_per_replica},
        # Ray's own per-replica bound; the replica's queue answers 503 past its slots.
        max_ongoing_requests=options.slots + options.queue_size + 1,
        health_check_period_s=2,
    )(SpecxModel)
    gateway = serve.deployment(
        name="specx-gateway", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000,
    )(SpecxGateway)  # fmt: skip
    model = replicas.bind(str(Path(artifact).absolute()), threads, options)
    serve.run(gateway.bind(model, options), name="specx", route_prefix="/")
    return f"http://{ray_options.host}:{ray_options.port}"
