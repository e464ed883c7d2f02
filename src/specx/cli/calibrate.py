"""`specx calibrate` and `specx quantize`: measurements on real prompts, recorded in the artifact.

`calibrate` chooses the tree, chain and batch threshold from measured acceptance and costs;
`quantize` builds a static INT8 target calibrated on the prompts.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import click

from specx.cli.common import POSITIVE, progress, require_extra
from specx.errors import CalibrationError, GenerationError

__all__ = ["COMMANDS", "calibrate", "quantize"]

_ARTIFACT = click.Path(exists=True, file_okay=False, path_type=Path)


def _prompts(artifact_dir: Path, prompts_file: Path | None, builtin: bool) -> list[list[int]]:
    """Token ids of the prompts file, or of the built-in prompts when `builtin` allows."""
    from specx.artifact import load_manifest
    from specx.runtime.prompts import read_prompts
    from specx.runtime.tokenizer import TextTokenizer

    manifest = load_manifest(artifact_dir)
    tokenizer = TextTokenizer(manifest.tokenizer_file) if manifest.tokenizer_file else None
    encode = tokenizer.encode if tokenizer else None
    if prompts_file is not None or not builtin:
        return read_prompts(None, None, prompts_file, encode)
    if tokenizer is None:
        raise CalibrationError(
            f"{artifact_dir} has no tokenizer for the built-in prompts: pass --prompts "
            "with {'prompt_ids': [...]} lines"
        )
    with resources.as_file(resources.files("specx.calibration") / "default_prompts.jsonl") as f:
        return read_prompts(None, None, f, encode)


@click.command(short_help="Time the drafter on prompts and record what pays.")
@click.argument("artifact_dir", type=_ARTIFACT)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL prompts ({'prompt': text} or {'prompt_ids': [...]}) [default: 12 built-in "
    "code and text prompts, which need the artifact's tokenizer].",
)
@click.option(
    "--drafter",
    help="ngram | suffix | skip (chooses the layers it leaves out) | skip:LAYERS | "
    "draft-model:ARTIFACT [default: the artifact's head].",
)
@click.option("--max-prompts", type=POSITIVE, default=16, show_default=True)
@click.option(
    "--max-new-tokens",
    type=POSITIVE,
    default=48,
    show_default=True,
    help="Tokens per prompt: calibrate with the generation length you deploy with.",
)
@click.option(
    "--repeats",
    type=POSITIVE,
    default=3,
    show_default=True,
    help="Paired plain/speculative runs per prompt and candidate; the fastest counts.",
)
@click.option(
    "--probe-top-k", type=POSITIVE, default=4, show_default=True, help="Ranks measured per depth."
)
@click.option("--probe-depth", type=POSITIVE, default=6, show_default=True, help="Depths measured.")
@click.option(
    "--temperature",
    type=float,
    default=0.0,
    show_default=True,
    help="Calibrate at the sampling temperature you deploy with (0: greedy). Each setting "
    "is recorded apart; generate uses the nearest one.",
)
@click.option(
    "--top-p", type=float, default=1.0, show_default=True, help="With --temperature: nucleus p."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Of the sampled runs.")
@click.option("--threads", type=POSITIVE, default=None, help="ONNX Runtime threads.")
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
    temperature: float,
    top_p: float,
    seed: int,
    threads: int | None,
    as_json: bool,
) -> None:
    """Measure the drafter of ARTIFACT_DIR on prompts and record the best tree in its manifest.

    Records acceptance by depth, draft rank and confidence, the draft cost and the verify
    curve t(N) on this machine and backend; chooses the static tree per node budget, the
    chain length, EAGLE-2 parameters and the largest batch where speculation measured at
    least 1.05x plain decoding, by predicted then measured speedup. `specx generate` uses
    the choice by default. With --temperature, every run samples (seeded) and acceptance is
    what the sampled rules accept.
    """
    from specx.calibration.calibrate import CalibrationOptions, calibrate_artifact

    options = CalibrationOptions(
        drafter=drafter,
        probe_top_k=probe_top_k,
        probe_depth=probe_depth,
        max_new_tokens=max_new_tokens,
        threads=threads,
        repeats=repeats,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
    )
    options.sampling()  # a bad setting is refused before the prompts are read
    try:
        prompts = _prompts(artifact_dir, prompts_file, builtin=True)
    except GenerationError as e:
        raise CalibrationError(str(e)) from e
    entry = calibrate_artifact(artifact_dir, prompts[:max_prompts], options, progress)
    if as_json:
        click.echo(json.dumps(entry.to_json(), indent=2))


@click.command(short_help="Quantize the target to static INT8 (build ort-int8-static).")
@click.argument("artifact_dir", type=_ARTIFACT)
@click.option(
    "--prompts",
    "prompts_file",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL calibration prompts: one object per line with 'prompt' (text, needs the "
    "artifact's tokenizer) or 'prompt_ids'.",
)
@click.option(
    "--mode",
    type=click.Choice(["int8", "fp8", "trt-int8"]),
    default="int8",
    show_default=True,
    help="int8: ONNX Runtime static QDQ (CPU); fp8 / trt-int8 need NVIDIA ModelOpt.",
)
@click.option(
    "--max-prompts",
    type=POSITIVE,
    default=32,
    show_default=True,
    help="Use the first N prompts of the file.",
)
@click.option("--threads", type=POSITIVE, default=None, help="ONNX Runtime threads.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def quantize(
    artifact_dir: Path,
    prompts_file: Path,
    mode: str,
    max_prompts: int,
    threads: int | None,
    as_json: bool,
) -> None:
    """Quantize the target graph of ARTIFACT_DIR and make it the default build (`ort-int8-static`).

    Weights per channel and activations per tensor, both symmetric int8, in QDQ form
    around every MatMul; activation ranges come from a prefill of each prompt. Attention,
    norms and the KV cache stay float32. Prints the teacher-forced accuracy against the
    float32 graph on the same prompts (next-token loss, top-1 agreement).
    """
    require_extra("quantize")
    from specx.builders.int8_static import check_mode, quantize_artifact

    check_mode(mode)
    prompts = _prompts(artifact_dir, prompts_file, builtin=False)[:max_prompts]
    report = quantize_artifact(artifact_dir, prompts, mode, progress=progress, threads=threads)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
        return
    matmuls, accuracy = report.quantized_matmuls, report.accuracy
    prompt_count, tokens = report.calibration
    click.echo(
        f"{report.build} ({report.directory}): {matmuls['quantized']}/{matmuls['total']} "
        f"MatMuls int8, calibrated on {prompt_count} prompts ({tokens} tokens)"
    )
    if accuracy.scored_tokens:
        click.echo(
            f"next-token loss: fp32 {accuracy.loss_fp32:.4f}, int8 {accuracy.loss_int8:.4f} "
            f"nats/token ({accuracy.loss_increase:+.4f}) over {accuracy.scored_tokens} tokens"
        )
    click.echo(
        f"top-1 agreement with fp32: {accuracy.top1_agreement:.1%} of "
        f"{accuracy.positions} positions"
    )


COMMANDS = (calibrate, quantize)
