"""`specx serve`: the OpenAI-compatible HTTP server (needs the serve extra)."""

from __future__ import annotations

from pathlib import Path

import click

from specx.cli.common import POSITIVE, progress, require_extra

__all__ = ["COMMANDS", "serve"]


@click.command()
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
    "it; null decodes plainly): ngram | suffix | draft-model:ARTIFACT | the artifact's head.",
)
@click.option(
    "--max-body-bytes", type=POSITIVE, default=1 << 20, show_default=True, help="413 beyond."
)
@click.option("--threads", type=POSITIVE, default=None, help="ONNX Runtime threads.")
def serve(
    artifact_dir: Path,
    host: str,
    port: int,
    slots: int,
    queue_size: int,
    drafter: str | None,
    max_body_bytes: int,
    threads: int | None,
) -> None:
    """Serve ARTIFACT_DIR over an OpenAI-compatible HTTP API.

    /v1/completions, /v1/chat/completions (SSE streaming and not), /v1/models, /health and
    /metrics; concurrent requests are decoded together (continuous batching).
    """
    require_extra("serve", "serve")
    import uvicorn

    from specx.runtime.engine import Speculation, load
    from specx.runtime.sampling import SamplingParams
    from specx.server.app import ServeOptions, create_app

    engine = load(artifact_dir, threads=threads)
    if drafter is not None:  # a bad default is refused now, not on the first request
        engine.check_drafter(engine.plan(Speculation(drafter), SamplingParams()))
    options = ServeOptions(slots, queue_size, drafter, max_body_bytes)
    progress(f"serving {engine.name} on http://{host}:{port} ({slots} slots, drafter {drafter})")
    uvicorn.run(create_app(engine, options), host=host, port=port, log_level="warning")


COMMANDS = (serve,)
