"""`specx export` and `demo`: the commands that need the export extra (torch)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specx.cli.common import (
    CHAT_TEMPLATE_HELP,
    POSITIVE,
    IntRange,
    progress,
    require_extra,
)
from specx.cli.generate import print_stats
from specx.errors import GenerationError, SpecxError

if TYPE_CHECKING:
    from specx.runtime.results import Completion

__all__ = ["COMMANDS", "demo", "export"]


@click.command(short_help="Export an HF checkpoint or a GGUF file to an artifact.")
@click.argument("target_dir", type=click.Path(exists=True, path_type=Path))
@click.option(
    "-o",
    "--output",
    "output_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Artifact directory to create.",
)
@click.option(
    "--max-context",
    type=IntRange(min=2),
    default=None,
    help="KV-cache capacity in tokens (prompt + generated + tree scratch) [default: 2048, or "
    "the positions the checkpoint was trained for if fewer].",
)
@click.option(
    "--beyond-trained-positions",
    is_flag=True,
    help="Allow a --max-context past the checkpoint's max_position_embeddings.",
)
@click.option(
    "--taps",
    type=click.Choice(["none", "last", "eagle3"]),
    default=None,
    help="Hidden states to output: last = final post-norm state (Medusa/EAGLE-1/MTP); "
    "eagle3 = states entering layers 2, N//2, N-3 [default: what --drafter reads, else none].",
)
@click.option(
    "--drafter",
    help="Export a draft head with the target: eagle3:DIR | eagle:DIR | medusa:DIR | mtp[:DIR] "
    "(mtp alone reads the MTP layer from the target checkpoint).",
)
@click.option(
    "--max-tree-tokens",
    type=POSITIVE,
    default=None,
    help="Most tokens one verify forward takes (root + draft tree nodes) [default: 64].",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace an existing specx artifact at --output (never anything else).",
)
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help=CHAT_TEMPLATE_HELP + " [default: the checkpoint's own, if any].",
)
@click.option(
    "--no-build",
    is_flag=True,
    help="Leave the exported graphs as they are; by default export ends with `specx build`'s "
    "CPU default (ort-fp32: attention lowered for ONNX Runtime), the build generate runs.",
)
def export(
    target_dir: Path,
    output_dir: Path,
    max_context: int | None,
    beyond_trained_positions: bool,
    taps: str | None,
    drafter: str | None,
    max_tree_tokens: int | None,
    overwrite: bool,
    chat_template: Path | None,
    no_build: bool,
) -> None:
    """Export the HF checkpoint in TARGET_DIR (or a GGUF file) to a specx artifact.

    TARGET_DIR is a Hugging Face checkpoint directory, or llama.cpp's GGUF file (or a
    directory holding one): Llama, Mistral and Qwen families; a Q4_0 / Q8_0 file's codes and
    scales are kept by `specx build --backend cpu` at int4 / int8.

    Then builds it for ONNX Runtime on the CPU (ort-fp32, the fastest CPU build of the
    exported precision), unless --no-build; the exported graphs stay in the artifact and
    run with `specx generate --build exported`.
    """
    from specx.chat import ChatTemplate

    template = ChatTemplate.from_file(chat_template) if chat_template else None
    require_extra("export")
    from specx.export.gguf import find_gguf
    from specx.export.target_export import export_gguf, export_target

    export_from = export_gguf if find_gguf(target_dir) else export_target
    artifact = export_from(
        target_dir,
        output_dir,
        max_context=max_context,
        beyond_trained_positions=beyond_trained_positions,
        taps=taps,
        drafter=drafter,
        max_tree_tokens=max_tree_tokens,
        overwrite=overwrite,
        chat_template=template,
        progress=progress,
    )
    if not no_build:
        _build_default(artifact)


def _build_default(artifact: Path) -> str:
    """The CPU build a fresh artifact runs: `specx build`'s defaults (ort-fp32, lowered)."""
    from specx.builders import BuildOptions, build_artifact

    return build_artifact(artifact, BuildOptions(), progress=progress)


@click.command(short_help="Export, build and run a tiny model end to end (no downloads).")
@click.option(
    "--target",
    "target_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="HF checkpoint to use instead of a random-weight demo model.",
)
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=None,
    help="A new or empty directory that keeps the checkpoint and artifact "
    "[default: a temporary directory, removed afterwards].",
)
@click.option("--prompt", default="def fibonacci(n):\n", show_default=True)
@click.option("--max-new-tokens", type=POSITIVE, default=64, show_default=True)
@click.option("--threads", type=POSITIVE, default=None, help="ONNX Runtime threads.")
def demo(
    target_dir: Path | None,
    workdir: Path | None,
    prompt: str,
    max_new_tokens: int,
    threads: int | None,
) -> None:
    """Run the whole pipeline with no downloads: export, then plain and speculative decoding.

    Prints a JSON report: the texts, plain and n-gram speculative stats (acceptance
    length, per-position acceptance, ms/token), the speedup, and whether the greedy
    outputs are identical (they must be).
    """
    if not prompt:
        raise GenerationError("--prompt is empty")
    if workdir is not None and workdir.exists():
        if not workdir.is_dir() or any(workdir.iterdir()):
            raise SpecxError(
                f"--workdir {workdir} exists and is not an empty directory: give a new one"
            )
    require_extra("demo")
    if workdir is not None:
        report, plain, spec = _demo(workdir, target_dir, prompt, max_new_tokens, threads)
    else:
        with tempfile.TemporaryDirectory(prefix="specx-demo-") as scratch:
            report, plain, spec = _demo(Path(scratch), target_dir, prompt, max_new_tokens, threads)
            report["artifact"] = None  # removed with the temporary directory
    json.dump(report, sys.stdout, indent=2)
    click.echo()
    print_stats(plain.stats)
    print_stats(spec.stats)
    if spec.tokens != plain.tokens:
        raise GenerationError("speculative output differs from plain decoding: please report")


def _demo(
    workdir: Path, target_dir: Path | None, prompt: str, max_new_tokens: int, threads: int | None
) -> tuple[dict, Completion, Completion]:
    """The report, and the plain and speculative completions it sums up.

    Decoded as a user's code decodes: `specx.load(...)`, then `Engine.generate` plainly and
    with `speculation="ngram"` (the default path: the artifact's calibration where it has one,
    the per-round controller).
    """
    from specx.export.random_checkpoint import write_random_checkpoint
    from specx.export.target_export import export_target
    from specx.runtime.engine import load

    if target_dir is None:
        target_dir = workdir / "checkpoint"
        progress(f"writing a random-weight Llama checkpoint to {target_dir}")
        write_random_checkpoint(target_dir, "llama", "small", seed=0)
    artifact = export_target(target_dir, workdir / "artifact", max_context=1024, progress=progress)
    _build_default(artifact)
    engine = load(artifact, threads)
    text_or_ids = prompt if engine.tokenizer is not None else [1, 2, 3, 4]
    progress("decoding: plain, then speculative with the n-gram drafter")
    # Both run to max_new_tokens: a random-weight model may end its text at any token.
    plain = engine.generate(text_or_ids, max_new_tokens=max_new_tokens, ignore_eos=True)
    spec = engine.generate(
        text_or_ids, max_new_tokens=max_new_tokens, ignore_eos=True, speculation="ngram"
    )
    speculative = spec.stats.to_json()
    speculative.pop("per_request", None)  # the one prompt's: the totals already
    run = spec.stats.run.speculative
    drafted = run is not None and run.acceptance.rounds_with_draft > 0
    report = {
        "artifact": str(artifact),
        "prompt": prompt,
        "text": spec.text,
        "tokens": spec.tokens,
        "identical_to_plain": spec.tokens == plain.tokens,
        # Where nothing was drafted both runs decoded plainly: their ratio is noise.
        "speedup": plain.stats.ms_per_token / spec.stats.ms_per_token if drafted else None,
        "plain": plain.stats.to_json(),
        "speculative": speculative,
    }
    return report, plain, spec


COMMANDS = (export, demo)
