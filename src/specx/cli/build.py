"""`specx lint`, `build`, `pack`, `verify` and `unpack`: between export and a registry."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specx.cli.common import POSITIVE, IntRange, only_applies, passed, progress, require_extra
from specx.errors import BuildError
from specx.precision import PRECISIONS, Precision

__all__ = ["COMMANDS", "build", "lint", "pack", "verify"]

_ARTIFACT = click.Path(exists=True, file_okay=False, path_type=Path)
_PRECISION = click.Choice(["fp32", "fp16", "bf16"])  # what lint lowers to
_WEIGHT_OPTIONS = (
    "block_size",
    "symmetric",
    "accuracy_level",
    "lm_head_bits",
    "lm_head_rescore",
    "method",
    "quantize",
)
# The options a backend declares it takes (`Backend.options`), and those of --backend auto.
_BACKEND_OPTIONS = (
    *_WEIGHT_OPTIONS, "prompts", "lowering", "context", "max_batch", "optimization_level",
    "timing_cache",
)  # fmt: skip
_AUTO_OPTIONS = frozenset({"block_size", "symmetric", "context"})


@click.command(short_help="Check every graph against TensorRT's ONNX rules.")
@click.argument("artifact_dir", type=_ARTIFACT)
@click.option(
    "--target", "lint_target", type=click.Choice(["trt"]), default="trt", show_default=True
)
@click.option("--precision", type=_PRECISION, default="fp32", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the issues as JSON.")
def lint(artifact_dir: Path, lint_target: str, precision: str, as_json: bool) -> None:
    """Check every graph of ARTIFACT_DIR against the TensorRT ONNX parser's operator table.

    Each graph is lowered to the form `specx build --backend trt` parses (at --precision)
    and checked twice: with the TreeAttention plugin registered, and with its standard-op
    fallback inlined. Exits 1 when any node would be rejected.
    """
    require_extra("lint")
    import onnx_ir as ir

    from specx.artifact import load_manifest
    from specx.graphs.trt_lint import lint_for_tensorrt
    from specx.graphs.trt_lowering import lower_for_tensorrt

    manifest = load_manifest(artifact_dir)
    capacity = manifest.model.kv_capacity
    # The draft chain is built for ONNX Runtime only (an ONNX Loop): TensorRT drafts per depth.
    graphs = {name: e for name, e in manifest.graphs.items() if not e.ort_only}
    issues, nodes = [], 0
    for name, entry in graphs.items():
        model = lower_for_tensorrt(ir.load(manifest.path(entry.file)), capacity, precision)
        nodes += sum(1 for _ in model.graph)
        issues += lint_for_tensorrt(model, name)
    if as_json:
        click.echo(json.dumps([vars(i) for i in issues], indent=2))
    for issue in issues:
        click.echo(str(issue), err=True)
    click.echo(
        f"{lint_target} lint ({precision}): {len(graphs)} graphs, {nodes} nodes, "
        f"{len(issues)} issues",
        err=True,
    )
    if issues:
        raise SystemExit(1)


@click.command(short_help="Build an artifact for a backend (ort, openvino, cpu, trt or auto).")
@click.argument("artifact_dir", type=_ARTIFACT)
@click.option(
    "--backend",
    default="ort",
    show_default=True,
    help="A registered build backend (specx.builders): ort (CPU), trt (TensorRT engines), "
    "int8-static (static INT8 QDQ calibrated on --prompts, as specx quantize), openvino "
    "(OpenVINO IR for its CPU plugin: fp32, int4, int8; needs specx[openvino]), cpu (specx's "
    "own compiled CPU kernels: int4, int8, Llama-form targets); or auto: every CPU backend "
    "installed, each build timed here, the fastest made the default.",
)
@click.option(
    "--precision",
    type=click.Choice(list(PRECISIONS)),
    default="fp32",
    show_default=True,
    help="int4/int8: weight-only (integer weights, float activations). Each backend builds its "
    "own set (ort: fp32, fp16, int4, int8; trt: fp32, fp16, bf16; openvino: fp32, int4, int8; "
    "cpu: int4, int8); one that builds no fp32 builds its first without --precision.",
)
@click.option(
    "--block-size",
    type=click.Choice(["auto", "16", "32", "64", "128", "256"]),
    default="auto",
    show_default=True,
    help="int4/int8: weights per quantization block (along the input dimension). 128 streams "
    "about 15% fewer bytes per token than 32 (a float scale per block); its int8 kernels "
    "compute rows in pairs, so the target runs one padding row to keep greedy speculation "
    "identical to plain decoding "
    "(the build measures which remedy this CPU needs and records it). auto: 128 for targets "
    "of 200M MatMul weights or more (memory-bound), else 32.",
)
@click.option(
    "--method",
    type=click.Choice(["rtn", "gptq"]),
    default="rtn",
    show_default=True,
    help="int4/int8: round-to-nearest, or GPTQ (error-compensating; needs --prompts).",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL calibration prompts ('prompt' or 'prompt_ids') for --method gptq and "
    "--backend int8-static.",
)
@click.option(
    "--symmetric/--asymmetric",
    default=None,
    help="int4/int8: blocks without / with a zero point. Default: asymmetric for int4, "
    "symmetric for int8.",
)
@click.option(
    "--accuracy-level",
    type=click.Choice(["0", "4"]),
    default="4",
    show_default=True,
    help="int4/int8: MatMulNBits compute; 4 = int8 activations (fast; greedy identity for "
    "chains only, as INT8), 0 = float.",
)
@click.option(
    "--lm-head-bits",
    type=click.Choice(["0", "4", "8"]),
    default=None,
    help="int4/int8: bits of the output projection (lm_head, head logits); 0 = float32. "
    "Default: 4 for int4 (its top 16 logits rescored in 8 bits), 8 for int8.",
)
@click.option(
    "--lm-head-rescore",
    type=IntRange(0, 256),
    default=None,
    help="int4/int8 with a 4-bit lm_head: recompute its top K logits from 8-bit weights "
    "(an 8-bit lm_head's top-1 at a 4-bit one's speed); 0 = off. Default: 16.",
)
@click.option(
    "--quantize",
    type=click.Choice(["all", "draft"]),
    default="all",
    show_default=True,
    help="int4/int8: which graphs; draft = the draft head's only, the target stays float32 "
    "(a head's step streams its weights; the target's verify cost and greedy identity stay "
    "those of fp32). Builds as ort-int4-draft / ort-int8-draft.",
)
@click.option(
    "--lowering",
    type=click.Choice(["gqa", "none"]),
    default="gqa",
    show_default=True,
    help="ort: run TreeAttention as ONNX Runtime's GroupQueryAttention (fp32, int4, int8; not "
    "on a target whose int8 activations need row invariance).",
)
@click.option(
    "--context",
    type=POSITIVE,
    default=256,
    show_default=True,
    help="auto: the cached tokens each build is timed over (the prompt and output your requests "
    "hold; attention's cost grows with it, and backends differ in how fast).",
)
@click.option(
    "--max-batch", type=POSITIVE, default=8, show_default=True, help="TensorRT: largest batch."
)
@click.option(
    "--optimization-level",
    type=IntRange(0, 5),
    default=3,
    show_default=True,
    help="TensorRT builder effort (0-5).",
)
@click.option(
    "--timing-cache",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TensorRT timing cache file, reused and updated across builds.",
)
@click.pass_context
def build(
    ctx: click.Context,
    artifact_dir: Path,
    backend: str,
    precision: str,
    block_size: str,
    symmetric: bool | None,
    accuracy_level: str,
    lm_head_bits: str | None,
    lm_head_rescore: int | None,
    method: str,
    prompts_file: Path | None,
    quantize: str,
    lowering: str,
    context: int,
    max_batch: int,
    optimization_level: int,
    timing_cache: Path | None,
) -> None:
    """Build ARTIFACT_DIR for a backend and make that build the one the runtime uses.

    ort (CPU default; what export builds): fp32 lowers TreeAttention to ONNX Runtime's
    GroupQueryAttention, fp16 writes converted graphs, int4/int8 store every MatMul weight
    block-quantized (MatMulNBits).
    trt: lowers, lints and builds one TensorRT engine per graph (needs TensorRT and a GPU).
    openvino: OpenVINO IR, int4/int8 weights in OpenVINO's compressed form (--block-size and
    --symmetric/--asymmetric apply; the lm_head is stored at 8 bits).
    cpu: the target (and an EAGLE-3 head) on specx's own kernels (compiled at install): each
    weight read once for all of a verify's tokens, rows exact by construction (trees need no
    spine).
    auto: builds ort, openvino and cpu where each is installed and applies, times each build
    on this machine over --context cached tokens (plain step, verify curve, head step, prompt
    forward) and makes the fastest the default; the timings are recorded in the manifest
    (build_choice) and the stats name the reason.
    """
    require_extra("build")
    from specx.builders import BuildOptions, build_artifact

    chosen = _precision(ctx, backend, precision)
    calibrated = "--method gptq" if method == "gptq" else None
    calibrated = "--backend int8-static" if backend == "int8-static" else calibrated
    if calibrated and prompts_file is None:
        raise BuildError(f"{calibrated} needs --prompts FILE (calibration prompts)")
    if prompts_file is not None and not calibrated:
        raise BuildError("--prompts serves only --method gptq and --backend int8-static")
    weight_only = None
    if chosen.weight_only:
        from specx.graphs.weight_only import WeightOnlyConfig

        try:  # the configuration's own rules (defaults, which options combine)
            weight_only = WeightOnlyConfig(
                bits=chosen.bits,
                block_size=None if block_size == "auto" else int(block_size),
                symmetric=symmetric,
                accuracy_level=int(accuracy_level),
                output_bits=int(lm_head_bits) if lm_head_bits else None,
                method=method,
                output_rescore=lm_head_rescore,
                scope=quantize,
            )
        except ValueError as e:
            raise BuildError(str(e)) from e
    options = BuildOptions(
        backend, chosen, max_batch, optimization_level, timing_cache, weight_only, lowering
    )
    if backend == "auto":
        from specx.artifact import load_manifest
        from specx.builders import build_each, cpu_backends
        from specx.calibration.build_choice import build_fastest

        backends = cpu_backends(load_manifest(artifact_dir, verify_hashes=False), options, progress)
        build = lambda: build_each(artifact_dir, options, backends, progress)  # noqa: E731
        build_fastest(artifact_dir, build, context, progress=progress)
        return
    prompts = _calibration_prompts(artifact_dir, prompts_file) if prompts_file else ()
    build_artifact(artifact_dir, options, progress=progress, prompts=prompts)


def _precision(ctx: click.Context, backend: str, name: str) -> Precision:
    """--precision's value for --backend, after refusing what that backend does not take.

    The backend's registry entry says which precisions it builds and which options it takes
    (`specx.builders.registry`); `auto` takes what its CPU builds share. Without --precision, a
    backend that builds no fp32 builds its first precision (cpu: int4).
    """
    from specx.builders.registry import backend as registered
    from specx.builders.registry import check_precision, taking

    chosen_backend = None if backend == "auto" else registered(backend)
    takes = _AUTO_OPTIONS if chosen_backend is None else chosen_backend.options
    for option in _BACKEND_OPTIONS:
        flags = passed(ctx, "prompts_file" if option == "prompts" else option)
        if flags and option not in takes:
            where = taking(option) + (["auto"] if option in _AUTO_OPTIONS else [])
            named = ", ".join(where[:-1]) + " or " + where[-1] if len(where) > 1 else where[0]
            raise BuildError(only_applies(flags, f"--backend {named}"))
    chosen = Precision.named(name)
    if chosen_backend is not None:
        built = chosen_backend.precisions
        if not passed(ctx, "precision") and chosen not in built:
            chosen = built[0]
        check_precision(chosen_backend, chosen)
    weight_options = passed(ctx, *_WEIGHT_OPTIONS)
    if not chosen.weight_only and weight_options:
        raise BuildError(only_applies(weight_options, "--precision int4 and int8"))
    return chosen


def _calibration_prompts(artifact_dir: Path, prompts_file: Path) -> list[list[int]]:
    from specx.artifact import load_manifest
    from specx.runtime.prompts import read_prompts
    from specx.runtime.tokenizer import TextTokenizer

    manifest = load_manifest(artifact_dir, verify_hashes=False)
    tokenizer = TextTokenizer(manifest.tokenizer_file) if manifest.tokenizer_file else None
    return read_prompts(None, None, prompts_file, tokenizer.encode if tokenizer else None)


@click.command(short_help="Verify an artifact and write it as one tar.")
@click.argument("artifact_dir", type=_ARTIFACT)
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path))
@click.option(
    "--overwrite", is_flag=True, help="Replace an existing tar written by specx pack (only that)."
)
def pack(artifact_dir: Path, output: Path, overwrite: bool) -> None:
    """Verify ARTIFACT_DIR and write it as one tar (manifest + every pinned file)."""
    from specx.publish import pack_artifact

    path = pack_artifact(artifact_dir, output, overwrite)
    progress(f"packed {artifact_dir} -> {path} ({path.stat().st_size / 1e6:.1f} MB)")


@click.command(short_help="Check a tar or an artifact directory: hashes, format, engines.")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(source: Path, as_json: bool) -> None:
    """Check a packed tar or an artifact directory: hashes, format, engine compatibility."""
    from specx.publish import verify_artifact

    report = verify_artifact(source)
    if as_json:
        click.echo(json.dumps(vars(report), indent=2))
        return
    builds = ", ".join(f"{k} ({v})" for k, v in report.builds.items()) or "none"
    click.echo(f"ok: {report.source}: {report.files} files verified; builds: {builds}")
    for note in report.notes:
        click.echo(f"note: {note}")


@click.command(short_help="Write a tar from specx pack out as an artifact directory.")
@click.argument("archive", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="The artifact directory to write. Default: the tar's, beside the tar.",
)
@click.option(
    "--overwrite", is_flag=True, help="Replace an existing artifact directory (only that)."
)
def unpack(archive: Path, output: Path | None, overwrite: bool) -> None:
    """Write a tar from `specx pack` out as an artifact directory, every file checked."""
    from specx.publish import unpack_artifact

    path = unpack_artifact(archive, output, overwrite, progress)
    progress(f"unpacked {archive} -> {path}")


COMMANDS = (lint, build, pack, verify, unpack)
