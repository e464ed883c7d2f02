"""`specx build --backend ort` (the CPU default): graphs ONNX Runtime runs fastest.

- fp32: TreeAttention as ONNX Runtime's GroupQueryAttention and RMSNorm fused with its
  residual add (`specx.graphs.ort_lowering`); what `specx export` builds. Without the
  lowering (`--lowering none`, or an ONNX Runtime without GroupQueryAttention) it records
  the exported graphs as they are.
- fp16: converted graphs (KV caches in fp16, logits in fp32).
- int4 / int8: every MatMul weight of every graph block-quantized (MatMulNBits,
  `specx.graphs.weight_only`), round-to-nearest or GPTQ (`specx.builders.gptq`), one weight
  at a time, so a model larger than memory builds; `--quantize draft` quantizes the draft
  head alone.
Each graph is checked to load in ONNX Runtime.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Collection, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from specx.artifact import Manifest
from specx.builders.registry import (
    WEIGHT_OPTIONS,
    BuildJob,
    BuildOptions,
    BuildOutput,
    Progress,
    check_precision,
)
from specx.builders.staging import exported_entries, load_graph, save_graph
from specx.errors import BuildError
from specx.graphs.draft_chain import save_draft_chain
from specx.graphs.ort_lowering import GroupQueryAttentionPass, SkipRmsNormPass, gqa_available
from specx.graphs.precision import FLOAT_DTYPES, ConvertPrecisionPass
from specx.graphs.row_invariance import PadRowPass, RowInvariantPass
from specx.graphs.weight_only import (
    Quantizer,
    WeightOnlyConfig,
    WeightOnlyQuantizePass,
    quantized_matmuls,
    rtn,
)
from specx.manifest_types import BuildEntry, GraphEntry, Quantization
from specx.precision import BF16, FP16, FP32, INT4, INT8, Precision

__all__ = [
    "BACKEND",
    "OnnxRuntime",
    "build_drafts",
    "matmulnbits_row_invariance",
    "weight_only_config",
]

log = logging.getLogger(__name__)


class OnnxRuntime:
    """ONNX Runtime CPU builds: lowered fp32, fp16, weight-only int4 / int8."""

    name = "ort"
    runtime = "ort"
    precisions: tuple[Precision, ...] = (FP32, FP16, INT4, INT8)
    options = frozenset(
        {*WEIGHT_OPTIONS, "accuracy_level", "lm_head_bits", "lm_head_rescore", "method",
         "prompts", "quantize", "lowering"}
    )  # fmt: skip

    def build_name(self, options: BuildOptions) -> str:
        """`ort-<precision>`, `-draft` for a build of the draft head alone."""
        return f"ort-{options.precision}" + ("-draft" if options.draft_only else "")

    def check(self, manifest: Manifest, options: BuildOptions, prompts: Sequence) -> None:
        """Refuses bf16 and unknown precisions, GPTQ without prompts, a draft-only build."""
        if options.precision == BF16:
            raise BuildError(
                "ONNX Runtime's CPU provider has no bfloat16 kernels (MatMul, Attention); "
                "use --precision fp16 on ORT, or bf16 with --backend trt"
            )
        check_precision(self, options.precision)
        method = options.weight_only.method if options.weight_only else "rtn"
        if method == "gptq" and not prompts:
            raise BuildError("a GPTQ build needs calibration prompts (--prompts FILE)")
        if options.draft_only and set(manifest.graphs) == {"target"}:
            raise BuildError(
                f"{manifest.root} has no draft head to quantize (--quantize draft); a draft "
                "model is an artifact of its own: build it with --quantize all"
            )

    def build(self, job: BuildJob) -> BuildEntry:
        """Converts, quantizes and lowers each graph; the draft chain is derived last."""
        return _build_ort(job.manifest, job.options, job.output, job.progress, job.prompts)


def build_drafts(job: BuildJob, skip: Collection[str] = ()) -> BuildEntry:
    """The ONNX Runtime build of every graph but the target (and `skip`).

    For a backend that builds the target (and maybe some drafts) its own way and runs the
    other drafts here (`specx.builders.openvino`, `specx.builders.cpu`).
    """
    return _build_ort(
        job.manifest, job.options, job.output, job.progress, job.prompts, skip={"target", *skip}
    )


def _build_ort(
    manifest: Manifest,
    options: BuildOptions,
    output: BuildOutput,
    progress: Progress,
    prompts: Sequence[Sequence[int]],
    skip: Collection[str] = (),
) -> BuildEntry:
    import onnxruntime as ort

    from specx.sessions import load_session

    quantization = Quantization()  # a weight-only build's record, completed per graph
    lowering: dict[str, str] = {}
    if options.precision.weight_only:
        config = weight_only_config(manifest, options)
        options = dataclasses.replace(options, weight_only=config)
        quantization = Quantization(details=config.record())
    lower = options.lowering == "gqa" and options.precision != FP16 and gqa_available()
    if options.lowering == "gqa" and not lower:
        progress("[ort] no GroupQueryAttention lowering (fp16, or this ONNX Runtime lacks it)")
    if options.precision == FP32 and not lower:
        graphs = exported_entries(manifest)  # the exported graphs are the fp32 ORT build
        graphs = {name: entry for name, entry in graphs.items() if name not in skip}
    else:
        graphs = {}
        for name in manifest.graphs:
            if name == "draft_chain" or name in skip:
                continue  # the chain: derived from the built head below
            progress(f"[ort] converting {name} to {options.precision}")
            quantizer = _quantizer(manifest, name, options, prompts, progress)
            model, quantization = _convert(
                load_graph(manifest, name), name, options, quantization, quantizer
            )
            padded = _needs_row_invariance(name, quantization)
            if lower and _lower(manifest, model, padded == "attention"):
                lowering[name] = "gqa"
            if padded == "graph":  # after the lowering, which reads the graph's own inputs
                PadRowPass()(model)
            entry = save_graph(model, output, name, progress)
            if padded == "graph" or (lower and padded == "attention"):
                entry = dataclasses.replace(entry, kv_spare_slots=1)  # the padding row's K, V
            graphs[name] = entry
        if "draft_chain" in manifest.graphs and "draft_head" in graphs:
            graphs["draft_chain"] = _derive_chain(manifest, graphs["draft_head"], output)
        for name in graphs:
            try:
                load_session(output.staging / f"{name}.onnx")
            except Exception as e:  # onnxruntime raises untyped errors
                raise BuildError(
                    f"ONNX Runtime cannot load the {options.precision} {name}: {e}"
                ) from e
    return BuildEntry(
        OnnxRuntime.runtime,
        options.precision.name,
        graphs=graphs,
        quantization=quantization,
        onnxruntime_version=ort.__version__,
        lowering=lowering,
    )


def _quantizer(
    manifest: Manifest,
    name: str,
    options: BuildOptions,
    prompts: Sequence[Sequence[int]],
    progress: Progress,
) -> Quantizer:
    """RTN, or GPTQ on the target with Hessians from the prompts' prefill (heads: RTN)."""
    if options.weight_only is None or options.weight_only.method != "gptq" or name != "target":
        return rtn
    from specx.builders.gptq import collect_hessians, gptq_quantizer

    progress(f"[ort] collecting GPTQ input statistics on {len(prompts)} prompts")
    entry = manifest.graph(name)
    hessians = collect_hessians(manifest.path(entry.file), entry.inputs, prompts)
    return gptq_quantizer(hessians)


def matmulnbits_row_invariance(config: WeightOnlyConfig, trials: int = 3) -> str | None:
    """How this machine's MatMulNBits kernels can compute a row alone as among others.

    "as is": each row's bits are the same alone and in chunks of 2..8 (measured at level 4:
    blocks of 16 and 32); "padded": the same once every chunk gets a copy of its last row,
    as `PadRowPass` gives the whole graph (blocks of 64 and 128: rows go in pairs); None:
    neither. Checked at build time because the kernel paths depend on the CPU and the ONNX
    Runtime version.
    """
    from specx.sessions import load_session

    block_size = config.block_size
    assert block_size is not None, "a build's config has its block size (weight_only_config)"
    rng = np.random.default_rng(0)
    sessions = []
    for bits in {config.bits, config.output_bits or 0} - {0}:  # output_bits: set, 0 = float
        k = 3 * block_size + 16  # whole blocks and a padded one
        model = _single_matmul(rng.standard_normal((k, 40)).astype(np.float32) * 0.05)
        WeightOnlyQuantizePass(
            WeightOnlyConfig(bits, block_size, config.symmetric, config.accuracy_level, bits)
        )(model)
        sessions.append(load_session(ir.to_proto(model).SerializeToString()))
    batches = [rng.standard_normal((8, k)).astype(np.float32) for _ in range(trials)]
    for mode, pad in (("as is", False), ("padded", True)):
        if all(_chunks_agree(session, rows, pad) for session in sessions for rows in batches):
            return mode
    return None


def _chunks_agree(session, rows: np.ndarray, pad: bool) -> bool:
    """Whether every row comes out the same in chunks of 1..8 (each padded with its last)."""

    def run(chunk: np.ndarray) -> np.ndarray:
        padded = np.concatenate([chunk, chunk[-1:]]) if pad else chunk
        return session.run(None, {"x": padded})[0][: len(chunk)]

    together = run(rows)
    for size in range(1, len(rows)):
        parts = [run(rows[i : i + size]) for i in range(0, len(rows), size)]
        if not np.array_equal(np.concatenate(parts), together):
            return False
    return True


def _single_matmul(weight: np.ndarray) -> ir.Model:
    x = ir.Value(
        name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["m", weight.shape[0]])
    )
    w = ir.Value(name="w", const_value=ir.tensor(weight))
    node = ir.node("MatMul", [x, w], name="mm")
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


def _derive_chain(manifest: Manifest, head: GraphEntry, output: BuildOutput) -> GraphEntry:
    """The one-call chain graph of the built head (`specx.graphs.draft_chain`)."""
    d2t = None if manifest.drafter is None else manifest.drafter.d2t
    to_target = None
    if d2t:
        offsets = np.load(manifest.path(d2t))
        to_target = np.arange(len(offsets)) + offsets
    entry = save_draft_chain(output.staging, head, to_target)
    return dataclasses.replace(
        entry,
        file=f"{output.directory}/{entry.file}",
        data_files=tuple(f"{output.directory}/{f}" for f in entry.data_files),
    )


def _lower(manifest: Manifest, model: ir.Model, pad_single_rows: bool) -> bool:
    """Runs the ONNX Runtime lowering (`specx.graphs.ort_lowering`); whether it applied.

    RoPE tables cover every position a step can reach (a draft head's run up to a tree's
    depth past the target's).
    """
    positions = manifest.model.kv_capacity + manifest.model.max_tree_tokens
    norms = SkipRmsNormPass()(model).modified
    attention = GroupQueryAttentionPass(positions, pad_single_rows)(model).modified
    return norms or attention


def _needs_row_invariance(name: str, quantization: Quantization) -> str | None:
    """Where a graph that keeps greedy identity by row invariance (int8 activations) pads.

    "graph": the whole graph already runs a padding row (`PadRowPass`); "attention": its
    GroupQueryAttention must get one, never to see a lone query row; None: no need.
    """
    if name != "target" or quantization.greedy_identity != "chains":
        return None
    return "graph" if quantization.padding_row else "attention"


# Targets with at least this many MatMul weights stream them from memory on any CPU (at 4
# bits, more than most last-level caches hold): blocks of 128 there, 32 below. Against
# onnxruntime-genai int4, blocks of 128 with their padding row made a 1.5B model faster and
# every small target (7M to 40M) slower: the padding row doubles rows that cost compute, not
# bytes, while their weights sit in cache (docs/decisions.md#streamed-weights-blocks-of-128).
STREAMED_WEIGHTS = 200_000_000


def weight_only_config(manifest: Manifest, options: BuildOptions) -> WeightOnlyConfig:
    """The build's weight-only configuration, its block size resolved (None: by size)."""
    config = options.weight_only or WeightOnlyConfig(bits=options.precision.bits)
    if config.block_size is not None:
        return config
    graph = onnx.load(manifest.path(manifest.graph("target").file), load_external_data=False)
    weights = sum(math.prod(t.dims) for t in graph.graph.initializer if len(t.dims) == 2)
    return dataclasses.replace(config, block_size=128 if weights >= STREAMED_WEIGHTS else 32)


def _convert(
    model: ir.Model,
    name: str,
    options: BuildOptions,
    quantization: Quantization,
    quantizer: Quantizer,
) -> tuple[ir.Model, Quantization]:
    """The graph at the build's precision, and the build's `quantization` with its part.

    A weight-only graph adds its count of quantized MatMuls; an int8-compute target, the
    row invariance its greedy identity rests on.
    """
    if options.precision == FP32:
        return model, quantization
    if options.precision.is_float:
        dtype = FLOAT_DTYPES[options.precision.name]
        return ConvertPrecisionPass(dtype)(model).model, quantization
    config = options.weight_only
    assert config is not None, "a weight-only precision has its config (weight_only_config)"
    if not config.quantizes(name):
        return model, quantization
    WeightOnlyQuantizePass(config, quantizer)(model)
    counts = {**quantization.details.get("quantized_matmuls", {}), name: quantized_matmuls(model)}
    quantization = quantization.with_details(quantized_matmuls=counts)
    if name == "target" and config.accuracy_level == 4:
        # int8 activations amplify last-bit differences, as static INT8 does: the same remedy
        # for attention, and MatMulNBits must itself treat a row alone as among others.
        RowInvariantPass()(model)
        invariance = matmulnbits_row_invariance(config)
        quantization = dataclasses.replace(
            quantization,
            greedy_identity="chains" if invariance else "none",
            padding_row=invariance == "padded",
        )
        if invariance is None:
            log.warning(
                "MatMulNBits at block size %d does not compute a row alone as among others "
                "on this CPU, even with a padding row: greedy speculation on this build may "
                "differ from its plain decoding (blocks of 32 do not)",
                config.block_size,
            )
    return model, quantization


BACKEND = OnnxRuntime()
