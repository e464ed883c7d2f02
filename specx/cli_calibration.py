"""`specx calibrate`: measured acceptance and costs choose the tree, chain and batch threshold."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import click

__all__ = ["calibrate"]


def _progress(message: str) -> None:
    click.echo(message, err=True)


@click.command()
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL prompts ({'prompt': text} or {'prompt_ids': [...]}) [default: 12 built-in "
    "code and text prompts, which need the artifact's tokenizer].",
)
@click.option("--drafter", help="ngram | draft-model:ARTIFACT [default: the artifact's head].")
@click.option("--max-prompts", default=16, show_default=True)
@click.option(
    "--max-new-tokens",
    default=48,
    show_default=True,
    help="Tokens per prompt: calibrate with the generation length you deploy with.",
)
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    help="Paired plain/speculative runs per prompt and candidate; the fastest counts.",
)
@click.option("--probe-top-k", default=4, show_default=True, help="Ranks measured per depth.")
@click.option("--probe-depth", default=6, show_default=True, help="Depths measured.")
@click.option("--threads", type=int, default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the calibration entry as JSON.")
def calibrate(
    artifact_dir: Path,
    prompts_file: Path | None,
    drafter: str | None,
    max_prompts: int,
    max_new_tokens: int,
    repeats: int,
    probe_top_k: int,
    probe_depth: int,
    threads: int | None,
    as_json: bool,
) -> None:
    """Measure the drafter of ARTIFACT_DIR on prompts and record the best tree in its manifest.

    Records acceptance by depth, draft rank and confidence, the draft cost and the verify
    curve t(N) on this machine and backend; chooses the static tree per node budget, the
    chain length, EAGLE-2 parameters and the largest batch where speculation pays off,
    by predicted speedup. `specx generate` uses the choice by default.
    """
    from specx.artifact import load_manifest
    from specx.calibration.calibrate import CalibrationOptions, calibrate_artifact
    from specx.cli import _read_prompts
    from specx.errors import CalibrationError, GenerationError
    from specx.runtime.tokenizer import TextTokenizer

    manifest = load_manifest(artifact_dir)
    tokenizer = TextTokenizer(manifest.tokenizer_file) if manifest.tokenizer_file else None
    if prompts_file is None:
        if tokenizer is None:
            raise CalibrationError(
                f"{artifact_dir} has no tokenizer for the built-in prompts: pass --prompts "
                "with {'prompt_ids': [...]} lines"
            )
        with resources.as_file(
            resources.files("specx.calibration") / "default_prompts.jsonl"
        ) as default:
            prompts = _read_prompts(None, None, default, tokenizer)
    else:
        try:
            prompts = _read_prompts(None, None, prompts_file, tokenizer)
        except GenerationError as e:
            raise CalibrationError(str(e)) from e
    options = CalibrationOptions(
        drafter=drafter,
        probe_top_k=probe_top_k,
        probe_depth=probe_depth,
        max_new_tokens=max_new_tokens,
        threads=threads,
        repeats=repeats,
    )
    entry = calibrate_artifact(artifact_dir, prompts[:max_prompts], options, _progress)
    if as_json:
        click.echo(json.dumps(entry, indent=2))
