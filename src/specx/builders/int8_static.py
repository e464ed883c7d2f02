"""`specx quantize` (`--backend int8-static`): static INT8 quantization of the target graph.

`--mode int8` quantizes the exported float32 target graph with ONNX Runtime's static
quantizer in QDQ form (QuantizeLinear/DequantizeLinear pairs around each MatMul, the form
TensorRT's explicit-quantization path also parses): per-channel symmetric int8 weights,
per-tensor symmetric int8 activations whose ranges come from real activations, the
target's prefill of each calibration prompt. Only MatMul inputs are quantized; the
`specx::TreeAttention` nodes (and the model-local function behind them), RMSNormalization,
RoPE and the MatMul outputs (the logits among them) stay float32, and so does the KV cache.

The result is a build like any backend's (`specx.builders.staging`):
`builds/ort-int8-static.<id>/`, recorded in the manifest under `builds["ort-int8-static"]`
(named apart from `specx build --precision int8`'s weight-only `ort-int8`, which it once
shared a name with, each replacing the other; an older manifest's static `ort-int8` still
opens under that name) (with a `quantization` record: method,
calibration size, and the accuracy against the float32 graph) and made the
`default_build`; a failed quantization leaves the manifest untouched.

Calibration feeds prefills only: the target is causal, so position t's MatMul inputs in a
prefill are those of a decode step at t, and decode steps over the prompt would add no
new ranges.

FP8 and TensorRT INT8 calibration go through NVIDIA ModelOpt, which is not wired in.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from specx.artifact import Manifest, load_manifest
from specx.builders.registry import BuildJob, BuildOptions, BuildOutput, Progress
from specx.builders.staging import exported_entries, graph_entry
from specx.errors import BuildError
from specx.manifest_types import BuildEntry, Quantization, TensorSpec
from specx.masks import causal_mask
from specx.precision import STATIC_INT8, Precision

if TYPE_CHECKING:
    import onnx

__all__ = [
    "BACKEND",
    "BUILD_NAME",
    "Accuracy",
    "Int8Static",
    "METHOD",
    "MODES",
    "PrefillReader",
    "QuantizeReport",
    "check_mode",
    "prefill_inputs",
    "quantize_artifact",
    "teacher_forced_accuracy",
]

MODES = ("int8", "fp8", "trt-int8")
_MODELOPT_MODES = ("fp8", "trt-int8")
BUILD_NAME = "ort-int8-static"
METHOD = (
    "static QDQ (ONNX Runtime quantize_static, MinMax calibration): per-channel symmetric "
    "int8 weights, per-tensor symmetric int8 activations, MatMul inputs only; TreeAttention, "
    "RMSNormalization, RoPE, MatMul outputs and the KV cache stay float32"
)


@dataclass(frozen=True)
class Accuracy:
    """A quantized target against float32, teacher-forced on the prefill of each prompt.

    Losses are mean next-token cross-entropies in nats/token over the `scored_tokens`
    positions that have a next token (None when no prompt has two tokens);
    `top1_agreement` is the share of all `positions` where both graphs' argmax agree.
    """

    prompts: int
    positions: int
    scored_tokens: int
    loss_fp32: float | None
    loss_int8: float | None
    top1_agreement: float
    max_abs_logit_diff: float

    @property
    def loss_increase(self) -> float | None:
        """int8's loss over float32's, nats/token (None where no token is scored)."""
        if self.loss_fp32 is None or self.loss_int8 is None:
            return None
        return self.loss_int8 - self.loss_fp32

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Accuracy:
        """The record `to_json` wrote (its `loss_increase` is derived, not read)."""
        return cls(**{k: v for k, v in record.items() if k != "loss_increase"})

    def to_json(self) -> dict[str, Any]:
        """The manifest record's `accuracy`, in the order `specx quantize --json` prints."""
        keys = ("prompts", "positions", "scored_tokens", "loss_fp32", "loss_int8",
                "loss_increase", "top1_agreement", "max_abs_logit_diff")  # fmt: skip
        fields = asdict(self) | {"loss_increase": self.loss_increase}
        return {key: fields[key] for key in keys}


@dataclass(frozen=True)
class QuantizeReport:
    """What `quantize_artifact` made: the build, its manifest record and the time taken."""

    build: str
    directory: str | None
    quantization: Quantization  # the record stored in the manifest
    accuracy: Accuracy
    seconds: float

    @property
    def quantized_matmuls(self) -> dict[str, int]:
        """MatMuls quantized and in all (`quantized`, `total`)."""
        return dict(self.quantization.details["quantized_matmuls"])

    @property
    def calibration(self) -> tuple[int, int]:
        """The calibration's prompts and tokens."""
        details = self.quantization.details
        return int(details["calibration_prompts"]), int(details["calibration_tokens"])

    def to_json(self) -> dict[str, Any]:
        """`specx quantize --json`: build, directory, the record, seconds."""
        record = self.quantization.to_json()
        return {"build": self.build, "directory": self.directory, **record,
                "seconds": self.seconds}  # fmt: skip


class Int8Static:
    """Static INT8 (QDQ) of the target, activation ranges calibrated on prompts.

    `eval_prompts` (default: the calibration prompts) score the result against float32;
    `threads` sizes ONNX Runtime's pool for calibration and scoring.
    """

    name = "int8-static"
    runtime = "ort"
    precisions: tuple[Precision, ...] = (STATIC_INT8,)
    options = frozenset({"prompts"})

    def __init__(
        self,
        mode: str = "int8",
        eval_prompts: Sequence[Sequence[int]] | None = None,
        threads: int | None = None,
    ):
        self.mode, self.eval_prompts, self.threads = mode, eval_prompts, threads

    def build_name(self, options: BuildOptions) -> str:
        """Always `ort-int8-static`."""
        return BUILD_NAME

    def check(self, manifest: Manifest, options: BuildOptions, prompts: Sequence) -> None:
        """A mode this installation can quantize to, and usable prompts."""
        if options.precision != STATIC_INT8 or options.weight_only is not None:
            raise BuildError(
                "--backend int8-static quantizes the float32 export to INT8 itself: "
                "--precision and the weight-only options do not apply"
            )
        check_mode(self.mode)
        _check_prompts(prompts, manifest, "calibration")
        if self.eval_prompts is not None:
            _check_prompts(self.eval_prompts, manifest, "evaluation")

    def build(self, job: BuildJob) -> BuildEntry:
        """Calibrates, quantizes and scores the target; the other graphs stay as exported."""
        manifest, staging, prompts = job.manifest, job.output.staging, job.prompts
        eval_prompts = prompts if self.eval_prompts is None else self.eval_prompts
        source = _stage_source(manifest, staging / ".source")
        output = staging / "target.onnx"
        tokens = sum(len(p) for p in prompts)
        job.progress(f"[int8] calibrating the target on {len(prompts)} prompts ({tokens} tokens)")
        inputs = manifest.graph("target").inputs
        quantized = staging / ".source" / "quantized.onnx"
        _quantize_static(source, quantized, inputs, prompts, self.threads)
        _save_row_invariant(quantized, output)
        shutil.rmtree(staging / ".source")
        job.progress(
            f"[int8] comparing with float32 on {len(eval_prompts)} prompts, teacher-forced"
        )
        accuracy = teacher_forced_accuracy(
            _source_path(manifest), output, inputs, eval_prompts, self.threads
        )
        loss = (
            f"loss {accuracy.loss_fp32:.4f} -> {accuracy.loss_int8:.4f} nats/token, "
            if accuracy.scored_tokens
            else ""
        )
        job.progress(f"[int8] {loss}top-1 agreement {accuracy.top1_agreement:.3f}")
        details = {
            "mode": self.mode,
            "method": METHOD,
            "source": manifest.graph("target").file,
            "quantized_matmuls": _count_quantized_matmuls(output),
            "calibration_prompts": len(prompts),
            "calibration_tokens": tokens,
            "accuracy": accuracy.to_json(),
        }
        # Greedy speculation is bit-identical to plain decoding of this build for chain
        # drafts (specx.graphs.row_invariance); trees are not covered.
        return _entry(manifest, job.output, Quantization("chains", details=details))


BACKEND = Int8Static()


def quantize_artifact(
    artifact_dir: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    mode: str = "int8",
    progress: Progress = lambda message: None,
    eval_prompts: Sequence[Sequence[int]] | None = None,
    threads: int | None = None,
) -> QuantizeReport:
    """Quantizes the artifact's target graph and makes the result the default build.

    Args:
        artifact_dir: the artifact (`specx export`).
        prompts: calibration prompts, token ids; each is fed as one prefill.
        mode: `int8` (ONNX Runtime, QDQ); `fp8` and `trt-int8` need NVIDIA ModelOpt.
        progress: called with one line per step.
        eval_prompts: prompts for the accuracy report (default: the calibration prompts).
        threads: ONNX Runtime threads for calibration and the accuracy sessions (default:
            all; the process-wide pool is sized once, by the first specx session).

    Returns:
        The report: the build, its manifest record (mode, method, calibration size, the
        MatMuls quantized, the accuracy against float32) and the seconds taken.

    Raises:
        BuildError: unknown mode, a ModelOpt mode, empty or invalid prompts, a prompt
            longer than the KV capacity, or a quantized graph ONNX Runtime cannot run.
        ArtifactError: the artifact does not verify.
    """
    from specx.builders import build_artifact

    started = time.perf_counter()
    builder = Int8Static(mode, eval_prompts, threads)
    options = BuildOptions(backend=builder.name, precision=STATIC_INT8)
    name = build_artifact(artifact_dir, options, progress, prompts, builder)
    build = load_manifest(artifact_dir, verify_hashes=False).builds[name]
    accuracy = Accuracy.from_json(build.quantization.details["accuracy"])
    return QuantizeReport(name, build.directory, build.quantization, accuracy,
                          time.perf_counter() - started)  # fmt: skip


def check_mode(mode: str) -> None:
    """Refuses a mode this installation cannot quantize to, before any work is done.

    Raises:
        BuildError: an unknown mode, or FP8 / TensorRT INT8 (NVIDIA ModelOpt's path).
    """
    if mode not in MODES:
        raise BuildError(f"--mode must be one of {MODES}, got {mode!r}")
    if mode not in _MODELOPT_MODES:
        return
    what = "FP8" if mode == "fp8" else "TensorRT INT8"
    if not _modelopt_installed():
        raise BuildError(
            f"{what} quantization goes through NVIDIA ModelOpt (pip package nvidia-modelopt, "
            "module `modelopt`), which is not installed here; --mode int8 is the ONNX Runtime "
            "QDQ path that runs without it"
        )
    raise BuildError(
        f"{what} quantization through NVIDIA ModelOpt is not implemented in specx yet "
        "(ModelOpt is installed, but no specx code drives it); use --mode int8"
    )


def _modelopt_installed() -> bool:
    return importlib.util.find_spec("modelopt") is not None


def _check_prompts(prompts: Sequence[Sequence[int]], manifest: Manifest, kind: str) -> None:
    if len(prompts) == 0:
        raise BuildError(f"no {kind} prompts given: quantization needs at least one")
    capacity, vocab = manifest.model.kv_capacity, manifest.model.vocab_size
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise BuildError(f"{kind} prompt {i} is empty")
        if len(prompt) > capacity:
            raise BuildError(
                f"{kind} prompt {i} has {len(prompt)} tokens, more than the artifact's KV "
                f"capacity of {capacity}: shorten it or re-export with a larger --max-context"
            )
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BuildError(f"{kind} prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")


def _source_path(manifest: Manifest) -> Path:
    """The exported float32 target graph: what is quantized, whatever the default build."""
    return manifest.path(manifest.graph("target").file)


def prefill_inputs(inputs: Sequence[TensorSpec], prompt: Sequence[int]) -> dict[str, np.ndarray]:
    """The target graph's inputs for one prefill of `prompt` (batch 1) into an empty cache.

    The caches are zero buffers of exactly the prompt's length; names, head counts, head
    size and dtypes come from the graph signature `inputs` (as the manifest records it).

    Raises:
        BuildError: the graph has an input this prefill does not know how to fill.
    """
    n = len(prompt)
    start = np.zeros(1, dtype=np.int64)
    feed = {}
    for spec in inputs:
        name = spec.name
        if name == "input_ids":
            feed[name] = np.array([prompt], dtype=np.int64)
        elif name == "position_ids":
            feed[name] = np.arange(n, dtype=np.int64)[None]
        elif name == "attention_mask":
            feed[name] = causal_mask(start, n, n)
        elif name == "write_pos":
            feed[name] = start
        elif name.startswith(("past_key_", "past_value_")):
            _, heads, _, head_dim = spec.shape
            feed[name] = np.zeros((1, int(heads), n, int(head_dim)), dtype=spec.dtype)
        else:
            raise BuildError(f"the target graph has an input {name!r} a prefill cannot fill")
    return feed


class PrefillReader(CalibrationDataReader):
    """ONNX Runtime calibration data: the target's inputs for a prefill of each prompt."""

    def __init__(self, inputs: Sequence[TensorSpec], prompts: Sequence[Sequence[int]]):
        self._feeds = (prefill_inputs(inputs, prompt) for prompt in prompts)

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next prompt's feed, None after the last."""
        return next(self._feeds, None)


def _stage_source(manifest: Manifest, directory: Path) -> Path:
    """Copies the exported target and its data into `directory`.

    ONNX Runtime's quantizer writes a shape-inferred copy next to the model it reads; this
    keeps that copy out of the artifact, inside the hidden staging directory. (A hard link
    would save the copy, but onnx refuses external data with several links.)
    """
    directory.mkdir()
    entry = manifest.graph("target")
    for name in [entry.file, *entry.data_files]:
        path = manifest.path(name)
        shutil.copyfile(path, directory / path.name)
    return directory / manifest.path(entry.file).name


def _quantize_static(
    source: Path,
    output: Path,
    inputs: Sequence[TensorSpec],
    prompts: Sequence[Sequence[int]],
    threads: int | None,
) -> None:
    """Calibrates on a prefill of each prompt, then writes the QDQ graph to `output`.

    Calibration runs ONNX Runtime's MinMax calibrator, but on a session made with specx's
    options: the calibrator's own session wants per-session threads, which ONNX Runtime
    refuses once the process has a global thread pool (any specx session opened before).
    The ranges go to `quantize_static` through its calibration cache.
    """
    import onnxruntime as ort
    from onnxruntime.quantization import (
        CalibrationMethod,
        MinMaxCalibrater,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    try:
        from onnxruntime.quantization import save_tensors_data
    except ImportError as e:
        raise BuildError(
            f"onnxruntime {ort.__version__} lacks the calibration-cache API specx quantize "
            "uses (save_tensors_data); install a newer onnxruntime (tested with 1.32)"
        ) from e

    from specx.sessions import session_options

    workdir = source.parent
    try:
        calibrator = MinMaxCalibrater(
            source,
            ["MatMul"],
            str(workdir / "augmented.onnx"),
            use_external_data_format=True,
        )
        calibrator.augment_graph()
        options = session_options(threads)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        calibrator.infer_session = ort.InferenceSession(
            str(workdir / "augmented.onnx"), options, providers=["CPUExecutionProvider"]
        )
        calibrator.collect_data(PrefillReader(inputs, prompts))
        cache = workdir / "calibration.json"
        save_tensors_data(calibrator.compute_data(), cache)
        del calibrator
        with _without_pre_processing_advice():
            quantize_static(
                source,
                output,
                None,
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=["MatMul"],
                per_channel=True,
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
                use_external_data_format=True,
                calibrate_method=CalibrationMethod.MinMax,
                calibration_cache_path=cache,
                extra_options={
                    "ActivationSymmetric": True,  # zero point 0: what TensorRT requires
                    "WeightSymmetric": True,
                    # Keep MatMul outputs, the logits among them, in float32.
                    "OpTypesToExcludeOutputQuantization": ["MatMul"],
                    # One Q/DQ pair per MatMul (q/k/v, gate/up share an input): ONNX Runtime
                    # fuses DQ -> MatMul into an integer MatMul only when the DQ has one
                    # consumer (see _private_qdq_parameters).
                    "DedicatedQDQPair": True,
                },
            )
    except BuildError:
        raise
    except Exception as e:  # the quantizer raises whatever its steps raise
        raise BuildError(f"ONNX Runtime could not quantize {source.name}: {e}") from e


@contextlib.contextmanager
def _without_pre_processing_advice() -> Iterator[None]:
    """Drops the quantizer's logged advice to pre-process the model first.

    Its pre-processing (ONNX Runtime graph optimization) would inline TreeAttention, which
    must stay a node, and shape inference is all the quantizer needs here.
    """

    class _Filter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "pre-process" not in record.getMessage()

    log_filter = _Filter()
    logging.getLogger().addFilter(log_filter)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(log_filter)


def teacher_forced_accuracy(
    reference: Path,
    candidate: Path,
    inputs: Sequence[TensorSpec],
    prompts: Sequence[Sequence[int]],
    threads: int | None = None,
) -> Accuracy:
    """Compares two target graphs on the prefill of each prompt (teacher-forced).

    Raises:
        BuildError: a graph does not load, or the candidate returns non-finite logits.
    """
    sessions = [_session(path, threads) for path in (reference, candidate)]
    losses = np.zeros(2)
    scored = positions = agree = 0
    max_diff = 0.0
    for prompt in prompts:
        feed = prefill_inputs(inputs, prompt)
        logits = [s.run(["logits"], feed)[0][0].astype(np.float64) for s in sessions]
        if not np.isfinite(logits[1]).all():
            raise BuildError(f"the quantized graph {candidate} returns non-finite logits")
        targets = np.asarray(prompt[1:], dtype=np.int64)
        for k, values in enumerate(logits):
            shifted = values[:-1] - values[:-1].max(-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
            losses[k] -= log_probs[np.arange(len(targets)), targets].sum()
        scored += len(targets)
        positions += len(prompt)
        agree += int((logits[0].argmax(-1) == logits[1].argmax(-1)).sum())
        max_diff = max(max_diff, float(np.abs(logits[0] - logits[1]).max()))
    loss_fp32, loss_int8 = (float(x / scored) if scored else None for x in losses)
    return Accuracy(len(prompts), positions, scored, loss_fp32, loss_int8, agree / positions,
                    max_diff)  # fmt: skip


def _session(path: Path, threads: int | None):
    from specx.sessions import load_session

    try:
        return load_session(path, threads)
    except Exception as e:  # onnxruntime raises untyped errors
        raise BuildError(f"ONNX Runtime cannot load {path}: {e}") from e


def _save_row_invariant(source: Path, output: Path) -> None:
    """Saves the quantized graph with private Q/DQ parameters and row-invariant kernels.

    Row invariance (`specx.graphs.row_invariance`) keeps speculative decoding of the INT8
    target identical to its plain decoding: without it a token's int8 activations can
    differ by a quantization step between a one-token step and a verify chunk.
    """
    import onnx
    import onnx_ir as ir

    from specx.graphs.row_invariance import RowInvariantPass

    model = onnx.load(str(source))
    _private_qdq_parameters(model)
    model = ir.to_proto(RowInvariantPass()(ir.from_proto(model)).model)
    onnx.save(
        model,
        str(output),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=f"{output.name}.data",
    )


def _private_qdq_parameters(model: onnx.ModelProto) -> None:
    """Gives every Q/DQ pair its own scale and zero point (in place).

    The quantizer writes one Q/DQ pair per MatMul (`DedicatedQDQPair`) but lets pairs of
    the same tensor share their scale and zero-point initializers. ONNX Runtime's
    common-subexpression elimination then merges those pairs back into one DQ feeding
    q/k/v (or gate/up), and it fuses DQ -> MatMul into an integer MatMul only when the DQ
    has one consumer: on pyref-7m most MatMuls stayed float, dequantizing their weights on
    every call, and a decode step ran many times slower (docs/decisions.md#int8-private-qdq).
    Private copies of the (scalar) parameters keep the
    pairs apart; the graph computes the same values.
    """
    import onnx

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    copies = []
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or len(node.input) < 3:
            continue
        scale, zero_point = node.input[1], node.input[2]
        sharing = [n for n in consumers.get(scale, []) if n.op_type == "QuantizeLinear"]
        if len(sharing) < 2 or scale not in initializers or zero_point not in initializers:
            continue
        private = []
        for name in (scale, zero_point):
            tensor = onnx.TensorProto()
            tensor.CopyFrom(initializers[name])
            tensor.name = f"{name}__{node.output[0]}"
            copies.append(tensor)
            private.append(tensor.name)
        node.input[1], node.input[2] = private
        for dq in consumers.get(node.output[0], []):
            if dq.op_type == "DequantizeLinear" and list(dq.input[1:3]) == [scale, zero_point]:
                dq.input[1], dq.input[2] = private
    graph.initializer.extend(copies)


def _count_quantized_matmuls(path: Path) -> dict[str, int]:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    producers = {out: node.op_type for node in graph.node for out in node.output}
    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    quantized = [n for n in matmuls if all(producers.get(i) == "DequantizeLinear" for i in n.input)]
    return {"quantized": len(quantized), "total": len(matmuls)}


def _entry(manifest: Manifest, output: BuildOutput, quantization: Quantization) -> BuildEntry:
    """The build's manifest entry: the quantized target, every other graph as exported."""
    import onnxruntime as ort

    return BuildEntry(
        Int8Static.runtime,
        STATIC_INT8.name,
        graphs={**exported_entries(manifest), "target": graph_entry(output, "target")},
        quantization=quantization,
        onnxruntime_version=ort.__version__,
    )
