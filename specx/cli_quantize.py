"""`specx quantize`: static INT8 quantization of the target, calibrated on real prompts."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specx.errors import BuildError

__all__ = ["quantize"]

_ARTIFACT = click.Path(exists=True, file_okay=False, path_type=Path)


def _progress(message: str) -> None:
    click.echo(message, err=True)


@click.command()
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
    "--max-prompts", default=32, show_default=True, help="Use the first N prompts of the file."
)
@click.option("--threads", type=int, default=None, help="ONNX Runtime threads (default: all).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def quantize(
    artifact_dir: Path,
    prompts_file: Path,
    mode: str,
    max_prompts: int,
    threads: int | None,
    as_json: bool,
) -> None:
    """Quantize the target graph of ARTIFACT_DIR and make it the default build (`ort-int8`).

    Weights per channel and activations per tensor, both symmetric int8, in QDQ form
    around every MatMul; activation ranges come from a prefill of each prompt. Attention,
    norms and the KV cache stay float32. Prints the teacher-forced accuracy against the
    float32 graph on the same prompts (next-token loss, top-1 agreement).
    """
    from specx.artifact import load_manifest
    from specx.calibration.quantization import check_mode, quantize_artifact
    from specx.cli import _read_prompts
    from specx.runtime.tokenizer import TextTokenizer

    check_mode(mode)
    if max_prompts < 1:
        raise BuildError(f"--max-prompts must be >= 1, got {max_prompts}")
    manifest = load_manifest(artifact_dir)
    tokenizer = TextTokenizer(manifest.tokenizer_file) if manifest.tokenizer_file else None
    prompts = _read_prompts(None, None, prompts_file, tokenizer)[:max_prompts]
    report = quantize_artifact(artifact_dir, prompts, mode, progress=_progress, threads=threads)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    matmuls, accuracy = report["quantized_matmuls"], report["accuracy"]
    click.echo(
        f"{report['build']} ({report['directory']}): {matmuls['quantized']}/{matmuls['total']} "
        f"MatMuls int8, calibrated on {report['calibration_prompts']} prompts "
        f"({report['calibration_tokens']} tokens)"
    )
    if accuracy["scored_tokens"]:
        click.echo(
            f"next-token loss: fp32 {accuracy['loss_fp32']:.4f}, int8 {accuracy['loss_int8']:.4f} "
            f"nats/token ({accuracy['loss_increase']:+.4f}) over {accuracy['scored_tokens']} tokens"
        )
    click.echo(
        f"top-1 agreement with fp32: {accuracy['top1_agreement']:.1%} of "
        f"{accuracy['positions']} positions"
    )
