"""`specx build --backend openvino`: the target as OpenVINO IR for OpenVINO's CPU plugin.

Why a second CPU backend: a verify of N tokens costs more per extra token on ONNX Runtime's
4-bit MatMul kernel than on OpenVINO's, and a verify's cost is what speculation pays
(docs/decisions.md#ov-backend: the target per call inside each runtime's loop).

The target is lowered (`specx.graphs.ov_lowering`: TreeAttention from primitives, the new
cache rows as outputs), read by OpenVINO's ONNX frontend and saved as IR (`target.xml` +
`.bin`). The draft graphs are built as the ONNX Runtime backend builds them and run there
(their entries say `runtime: "ort"`): drafting is many small calls, which ONNX Runtime's
one-call chain graph serves best, and OpenVINO prepares its nodes again on every new shape.

At int4 / int8 each large constant-weight MatMul of the target gets its weight in the form
OpenVINO's CPU plugin keeps compressed and multiplies from directly, the form NNCF writes (u4
/ u8 codes, Convert and Subtract of the zero point in fp16, Multiply by the block's fp16
scale, Reshape, Convert to fp32, MatMul with the weight transposed), from the same
round-to-nearest codes and zero points as the ONNX Runtime build
(`specx.graphs.weight_only.quantize_rtn`; the scales rounded to fp16: the form OpenVINO's own
exports use; fp32 scales profiled no faster on pyref-1b). OpenVINO's
frontend also reads MatMulNBits, but as a pattern its plugin folds back into float weights,
so the ONNX Runtime build's graph is no starting point. The output projection is stored at 8
bits (no top-k rescoring here). `openvino` is imported only by this backend and its opener.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_ir as ir

from specx.artifact import Manifest
from specx.builders.ort import build_drafts, weight_only_config
from specx.builders.registry import (
    WEIGHT_OPTIONS,
    BuildJob,
    BuildOptions,
    Progress,
    check_precision,
)
from specx.builders.staging import load_graph
from specx.errors import BuildError
from specx.graphs.ov_lowering import lower_for_openvino
from specx.graphs.signature import graph_signature
from specx.graphs.weight_only import BlockQuantized, WeightOnlyConfig, quantize_rtn
from specx.manifest_types import BuildEntry, GraphEntry, Quantization
from specx.precision import FP32, INT4, INT8, Precision

if TYPE_CHECKING:
    import openvino as ov

__all__ = ["BACKEND", "OpenVino", "compress_weights"]

MIN_WEIGHT = 1 << 16  # smaller MatMul weights stay float: too small to matter
DECOMPRESSION = "f16"  # the decompression's type, NNCF's (module docstring)


def _openvino():
    try:
        import openvino
    except ImportError as e:
        raise BuildError(
            "--backend openvino needs OpenVINO: pip install openvino (or specx[openvino])"
        ) from e
    return openvino


@dataclass(frozen=True)
class _Compression:
    """How the OpenVINO build stores MatMul weights (None: float)."""

    bits: int
    block: int
    symmetric: bool
    # The group over which OpenVINO's CPU plugin quantizes a compressed MatMul's activations
    # to int8 (DYNAMIC_QUANTIZATION_GROUP_SIZE; the runtime compiles with it). The weight
    # block: with the plugin's default of 32 a verify's cost grows with its rows several
    # times faster (docs/decisions.md#ov-activation-group).
    activation_group: int
    output_bits: int = 8  # no top-k rescoring here, so the lm_head keeps 8 bits at int4 too

    @classmethod
    def of(cls, config: WeightOnlyConfig | None) -> _Compression | None:
        if config is None:
            return None
        return cls(config.bits, config.block, config.is_symmetric, activation_group=config.block)

    def record(self) -> Quantization:
        """The build's quantization: its weights' form, the activation group to compile with.

        Chains only, as ONNX Runtime's int8-compute builds: a tree's accepted path sits at
        other cache slots than plain decoding's, and int8 activations can flip on a last bit.
        """
        weights = dataclasses.asdict(self)
        del weights["activation_group"]
        return Quantization("chains", activation_group=self.activation_group, details=weights)


def _onnx_runtime_only(config: WeightOnlyConfig | None) -> list[str]:
    """The fields of `config` set away from their defaults that only ONNX Runtime reads."""
    if config is None:
        return []
    default = WeightOnlyConfig(config.bits, config.block_size, config.symmetric)
    # output_rescore's default follows output_bits: name only what was set itself
    rescore = dataclasses.replace(default, output_bits=config.output_bits, output_rescore=None)
    differs = {
        "accuracy_level": config.accuracy_level != default.accuracy_level,
        "output_bits": config.output_bits != default.output_bits,
        "output_rescore": config.output_rescore != rescore.output_rescore,
    }
    return [name for name, changed in differs.items() if changed]


class OpenVino:
    """The target as OpenVINO IR (weights compressed), the draft graphs as ONNX Runtime's."""

    name = "openvino"
    runtime = "openvino"
    precisions: tuple[Precision, ...] = (FP32, INT4, INT8)
    options = frozenset(WEIGHT_OPTIONS)

    def build_name(self, options: BuildOptions) -> str:
        """`openvino-<precision>`."""
        return f"openvino-{options.precision}"

    def check(self, manifest: Manifest, options: BuildOptions, prompts: Sequence) -> None:
        """fp32 graphs, weights in float or int4 / int8, and OpenVINO installed."""
        check_precision(self, options.precision)
        config = options.weight_only
        if config is not None and (config.method != "rtn" or config.scope != "all"):
            raise BuildError("an OpenVINO build rounds every graph to nearest (no GPTQ, no scope)")
        ignored = _onnx_runtime_only(config)
        if ignored:
            raise BuildError(
                f"{', '.join(ignored)}: ONNX Runtime's int4 settings; an OpenVINO build computes "
                "in its own way and keeps the lm_head at 8 bits (leave them at their defaults)"
            )
        _openvino()

    def build(self, job: BuildJob) -> BuildEntry:
        """The target as OpenVINO IR; the draft graphs as ONNX Runtime builds them."""
        ov = _openvino()
        weight_only = job.options.precision.weight_only
        config = weight_only_config(job.manifest, job.options) if weight_only else None
        compression = _Compression.of(config)
        graphs: dict[str, GraphEntry] = {}
        drafts = None
        if set(job.manifest.graphs) != {"target"}:
            job.progress("[openvino] the draft graphs, on ONNX Runtime")
            drafts = build_drafts(
                dataclasses.replace(job, options=_for_drafts(job.options, config))
            )
            graphs = {
                name: dataclasses.replace(e, runtime="ort") for name, e in drafts.graphs.items()
            }
        job.progress("[openvino] lowering the target and reading it")
        graphs["target"] = self._graph(ov, job, "target", compression)
        quantization = Quantization() if compression is None else compression.record()
        drafts_record = {} if drafts is None else drafts.quantization.to_json()
        if drafts_record:
            quantization = quantization.with_details(drafts=drafts_record)
        return BuildEntry(
            self.runtime,
            job.options.precision.name,
            graphs=graphs,
            quantization=quantization,
            onnxruntime_version=None if drafts is None else drafts.onnxruntime_version,
            lowering=dict(drafts.lowering) if drafts is not None else {},
        )

    def _graph(self, ov, job: BuildJob, name: str, compression) -> GraphEntry:
        output = job.output
        exported = job.manifest.path(job.manifest.graph(name).file)
        # Beside the exported graph, whose weights it references: OpenVINO refuses external
        # data outside the model's own directory, and a copy of 1B weights costs gigabytes.
        lowered = exported.with_name(f".{name}.openvino-{output.staging.name}.onnx")
        try:
            ir.save(lower_for_openvino(load_graph(job.manifest, name)), lowered)
            read = ov.Core().read_model(str(lowered))
            if compression is not None:
                compress_weights(read, compression, job.progress)
            ov.save_model(read, str(output.staging / f"{name}.xml"), compress_to_fp16=False)
            inputs, outputs = graph_signature(onnx.load(lowered, load_external_data=False))
        finally:
            lowered.unlink(missing_ok=True)
        data = (f"{output.directory}/{name}.bin",)
        return GraphEntry(f"{output.directory}/{name}.xml", inputs, outputs, data)


def _for_drafts(options: BuildOptions, config: WeightOnlyConfig | None) -> BuildOptions:
    """The ONNX Runtime options for the draft graphs: the same weights rule, its kernels'."""
    return dataclasses.replace(options, backend="ort", weight_only=config)


def compress_weights(model: ov.Model, compression: _Compression, progress: Progress) -> int:
    """Replaces each large constant MatMul weight by its compressed form; returns how many.

    The output projection (the MatMul feeding the `logits` result) gets `output_bits`.
    """
    import openvino as ov

    matmuls = [
        (op, weight)
        for op in model.get_ordered_ops()
        if op.get_type_name() == "MatMul" and (weight := _float_weight(op)) is not None
    ]
    for i, (op, weight) in enumerate(matmuls):
        bits = compression.output_bits if _feeds_logits(op) else compression.bits
        quantized = quantize_rtn(weight, bits, compression.block, compression.symmetric)
        decompressed = _decompression(ov, quantized, weight.shape[0])
        new = ov.opset13.matmul(op.input_value(0), decompressed, op.get_transpose_a(), True)
        new.set_friendly_name(op.get_friendly_name())
        op.output(0).replace(new.output(0))
        if i % 10 == 9 or i == len(matmuls) - 1:
            progress(f"[openvino] compressed {i + 1}/{len(matmuls)} MatMul weights")
    return len(matmuls)


def _float_weight(op) -> np.ndarray | None:
    """The [K, N] float32 weight of a MatMul x @ W with W constant and large, else None."""
    source = op.input_value(1).get_node()
    if source.get_type_name() != "Constant" or op.get_transpose_b():
        return None
    if str(source.get_element_type()) != "<Type: 'float32'>" or len(source.shape) != 2:
        return None
    weight = source.get_data()
    return weight if weight.size >= MIN_WEIGHT else None


def _feeds_logits(op) -> bool:
    """Whether the MatMul's output reaches the `logits` result through shape-only ops."""
    frontier = [op]
    while frontier:
        node = frontier.pop()
        for output in node.outputs():
            for target in output.get_target_inputs():
                consumer = target.get_node()
                if consumer.get_type_name() == "Result":
                    if "logits" in consumer.input_value(0).get_names():
                        return True
                elif consumer.get_type_name() in ("Reshape", "Add", "Convert"):
                    frontier.append(consumer)
    return False


def _decompression(ov, quantized: BlockQuantized, rows: int):
    """W^T [N, K] as OpenVINO's compressed-weight pattern over codes [N, blocks, block]."""
    ops = ov.opset13
    n, blocks, block = quantized.codes.shape
    kind = ov.Type.u4 if quantized.bits == 4 else ov.Type.u8
    # Constants copy the packed bytes (shared_memory=False): the arrays die with this call.
    codes = ov.op.Constant(ov.Tensor(quantized.packed(), ov.Shape([n, blocks, block]), kind), False)
    values = ops.convert(codes, DECOMPRESSION)
    if quantized.zero_points is None:
        zero: object = ops.constant(np.float16(2 ** (quantized.bits - 1)))
    else:
        zeros = quantized.zero_points.reshape(-1)
        if quantized.bits == 4:  # packed like the codes: pairs of the flat array, low first
            zeros = np.pad(zeros, (0, zeros.size % 2))
            zeros = (zeros[0::2] | (zeros[1::2] << 4)).astype(np.uint8)
        packed_zeros = ov.op.Constant(ov.Tensor(zeros, ov.Shape([n, blocks, 1]), kind), False)
        zero = ops.convert(packed_zeros, DECOMPRESSION)
    # Contiguous: OpenVINO 2026.4's binding reads a non-contiguous float16 array as int16.
    scales = ov.op.Constant(np.ascontiguousarray(quantized.scales[..., None], np.float16))
    scaled = ops.multiply(ops.subtract(values, zero), scales)
    weight = ops.reshape(scaled, ops.constant(np.array([n, blocks * block], np.int64)), False)
    if blocks * block != rows:  # K padded to whole blocks: drop the padding columns
        weight = ops.slice(weight, [0], [rows], [1], [1])
    return ops.convert(weight, "f32")


BACKEND = OpenVino()
