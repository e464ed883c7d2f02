"""`specx serve`: the OpenAI-compatible HTTP server (needs the serve extra)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from specx.cli.common import (
    BUILD_HELP,
    CHAT_TEMPLATE_HELP,
    POSITIVE,
    only_applies,
    passed,
    progress,
    require_extra,
)
from specx.errors import SpecxError

__all__ = ["COMMANDS", "serve"]


@click.command(short_help="Serve an artifact over an OpenAI-compatible HTTP API.")
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--slots",
    type=POSITIVE,
    default=8,
    show_default=True,
    help="Sequences decoded together (continuous batching); each holds a KV cache row.",
)
@click.option(
    "--queue-size",
    type=click.IntRange(0),
    default=64,
    show_default=True,
    help="Requests that may wait for a slot; beyond it the server answers 503.",
)
@click.option(
    "--drafter",
    default=None,
    help="Default drafting for requests that name none (a request's 'drafter' overrides "
    "it; null decodes plainly): ngram | suffix | skip[:LAYERS] | draft-model:ARTIFACT | the "
    "artifact's head.",
)
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help=CHAT_TEMPLATE_HELP + " [default: the artifact's, if any].",
)
@click.option(
    "--max-body-bytes", type=POSITIVE, default=1 << 20, show_default=True, help="413 beyond."
)
@click.option("--threads", type=POSITIVE, default=None, help="ONNX Runtime threads.")
@click.option("--build", "build_name", default=None, help=BUILD_HELP)
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    help="A key clients must send as 'Authorization: Bearer KEY' (repeatable; also "
    "--api-key-file and the SPECX_API_KEY variable, comma-separated). /health stays open.",
)
@click.option(
    "--api-key-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A file of API keys, one per line (kept out of the process list, unlike --api-key).",
)
@click.option(
    "--metrics-without-key", is_flag=True, help="Serve /metrics to callers without a key."
)
@click.option(
    "--insecure-no-api-key",
    is_flag=True,
    help="Serve a non-loopback --host without any API key (refused otherwise).",
)
@click.option(
    "--prefix-cache-mb",
    type=click.IntRange(0),
    default=512,
    show_default=True,
    help="Memory for the KV of earlier prompts, reused by prompts that start the same.",
)
@click.option("--no-prefix-cache", is_flag=True, help="Prefill every prompt whole.")
@click.option(
    "--prefill-chunk",
    type=click.IntRange(0),
    default=256,
    show_default=True,
    help="Prompt tokens prefilled between two decoding rounds, so running streams wait for "
    "one chunk at most while a new prompt goes in (0: whole prompts).",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Seconds a request may take from arrival; past it, 504 and its slot is freed.",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="On SIGTERM: new requests get 503 while running ones finish, for at most this "
    "long; then each one left gets a 503 error and the server exits.",
)
@click.option(
    "--ray",
    "on_ray",
    is_flag=True,
    help="Deploy on Ray Serve: --replicas replicas behind one HTTP gateway (needs ray[serve]).",
)
@click.option("--replicas", type=POSITIVE, default=2, show_default=True, help="With --ray.")
@click.option(
    "--address",
    default=None,
    help="With --ray: the Ray cluster to join ('auto' or HOST:PORT) [default: start a local one].",
)
@click.option(
    "--cpus-per-replica", type=click.FloatRange(0), default=1.0, show_default=True,
    help="With --ray: CPUs Ray reserves for each replica.",
)  # fmt: skip
@click.pass_context
def serve(
    ctx: click.Context,
    artifact_dir: Path,
    host: str,
    port: int,
    slots: int,
    queue_size: int,
    drafter: str | None,
    chat_template: Path | None,
    max_body_bytes: int,
    threads: int | None,
    build_name: str | None,
    api_keys: tuple[str, ...],
    api_key_file: Path | None,
    metrics_without_key: bool,
    insecure_no_api_key: bool,
    prefix_cache_mb: int,
    no_prefix_cache: bool,
    prefill_chunk: int,
    request_timeout: float | None,
    drain_timeout: float,
    on_ray: bool,
    replicas: int,
    address: str | None,
    cpus_per_replica: float,
) -> None:
    """Serve ARTIFACT_DIR over an OpenAI-compatible HTTP API.

    /v1/completions, /v1/chat/completions (SSE streaming and not), /v1/models, /health and
    /metrics; concurrent requests are decoded together (continuous batching).
    """
    require_extra("serve", "serve")

    from specx.server.auth import Access, check_bind, collect_keys

    access = Access(collect_keys(api_keys, api_key_file, os.environ), metrics_without_key)
    check_bind(host, access, insecure_no_api_key)
    ray_only = passed(ctx, "replicas", "address", "cpus_per_replica")
    if ray_only and not on_ray:
        raise SpecxError(only_applies(ray_only, "--ray"))
    if on_ray:
        require_extra("serve --ray", "ray")
    from specx.chat import ChatTemplate
    from specx.runtime.engine import Speculation, load
    from specx.runtime.sampling import SamplingParams
    from specx.server.service import ServeOptions

    template = ChatTemplate.from_file(chat_template) if chat_template else None

    engine = load(artifact_dir, threads, build_name, rows=slots)  # before any replica starts
    if drafter is not None:  # a bad default is refused now, not on the first request
        engine.check_plan(engine.plan(Speculation(drafter), SamplingParams()))
    options = ServeOptions(
        slots, queue_size, drafter, max_body_bytes, chat_template=template, access=access,
        request_timeout_s=request_timeout,
        prefix_cache_bytes=0 if no_prefix_cache else prefix_cache_mb << 20, build=build_name,
        prefill_chunk=prefill_chunk,
    )  # fmt: skip
    if on_ray:
        _serve_on_ray(artifact_dir, threads, options, replicas, address, cpus_per_replica,
                      host, port)  # fmt: skip
        return
    from specx.server.app import serve as serve_http

    listening = _listen(host, port)  # before saying "serving": a busy port is one clear error
    default = f"default drafter {drafter}" if drafter else "no default drafter"
    keys = f"{len(access.keys)} API keys" if access.required else "no API key"
    progress(f"serving {engine.name} on http://{host}:{port} ({slots} slots, {default}, {keys})")
    progress(f"build {engine.build}: {engine.build_reason}")
    serve_http(engine, options, listening, drain_timeout)
    progress("stopped")


def _listen(host: str, port: int):
    """A socket listening on host:port.

    Raises:
        SpecxError: the address is in use or cannot be bound, with the reason.
    """
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise SpecxError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _serve_on_ray(artifact_dir, threads, options, replicas, address, cpus, host, port) -> None:
    import signal
    import threading

    from specx.server.ray_serve import RayOptions, deploy

    url = deploy(artifact_dir, threads, options, RayOptions(replicas, address, cpus, host, port))
    progress(f"serving on Ray Serve at {url} ({replicas} replicas); Ctrl-C stops it")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    from ray import serve as ray_serve

    ray_serve.shutdown()


COMMANDS = (serve,)
