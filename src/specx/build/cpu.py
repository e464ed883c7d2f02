"""`specx build --backend cpu`: the target for specx's own CPU kernels (`specx.runtime.kernels`).

Why a third CPU backend: ONNX Runtime's int4 kernel streams the weights again for every pair
of a verify's rows and OpenVINO's is slow at one row, so neither makes N tokens cost what one
does (docs/decisions.md#cpu-kernels). The kernels' forward reads each weight tile once for all
rows, and its rows are independent by construction, so trees are exact on it with no pad row
and no spine rule (`greedy_identity: all`).

The build reads the exported target's weights and its few constants (norm epsilon, softmax
scale, RoPE frequencies) from the ONNX graph, rounds every MatMul weight to nearest at the
build's width in blocks of 128 inputs (32 on a small target; symmetric; the output projection
at 8 bits, as the OpenVINO build keeps it) and writes them in the kernels' layout to one file,
`target.bin`, indexed by `target.json`. Only a Llama-form target is built (pre-norm, SwiGLU,
RoPE on every layer, no biases, q/k norms, sliding windows or soft caps); anything else is
refused before any work, naming what differs. The draft graphs are built as the ONNX Runtime
backend builds them and run there, as an OpenVINO build's do.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from specx.artifact import Manifest
from specx.build.ort import STREAMED_WEIGHTS, build_drafts
from specx.build.registry import BuildJob, BuildOptions
from specx.build.staging import load_graph
from specx.errors import BuildError
from specx.graphs.weight_only import WeightOnlyConfig, quantize_rtn
from specx.manifest_types import BuildEntry, GraphEntry, Quantization
from specx.runtime import kernels

__all__ = ["BACKEND", "Cpu", "TargetWeights", "read_target"]

PRECISIONS = ("int4", "int8")
OUTPUT_BITS = 8  # the lm_head's width at either precision
FORMAT = 1  # target.json's layout (specx.runtime.cpu_target reads it)


@dataclass(frozen=True)
class TargetWeights:
    """A Llama-form target as the kernels take it: constants and float weights by name.

    Linear weights are [n_out, k_in] (HF's orientation); `qkv` packs q | k | v and `gate_up`
    gate | up along the outputs, as the exported graph does.
    """

    constants: dict[str, float | int]
    norms: dict[str, np.ndarray]  # input_norm.{i}, post_norm.{i}, final_norm
    linears: dict[str, np.ndarray]  # qkv.{i}, o.{i}, gate_up.{i}, down.{i}, lm_head
    embed: np.ndarray  # [V, d]
    inv_freq: np.ndarray  # [rotary dims / 2]


def _refuse(manifest: Manifest, what: str) -> BuildError:
    return BuildError(
        f"{manifest.root}: --backend cpu builds Llama-form targets only; this one {what}"
    )


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def _single_consumer(value: ir.Value, op_type: str) -> ir.Node | None:
    uses = [use.node for use in value.uses() if use.node.op_type == op_type]
    return uses[0] if len(uses) == 1 else None


def read_target(manifest: Manifest) -> TargetWeights:
    """The exported target's weights and constants, or a `BuildError` naming what is not Llama's.

    Layers are found by their norms' HF names; each norm's output feeds one MatMul (the packed
    q/k/v, or gate/up) whose weight is read. o_proj and down_proj keep their HF names.
    """
    model = manifest.model
    family = model.family or "unknown"
    if family not in ("llama",):
        raise _refuse(manifest, f"is of family {family!r}")
    graph = load_graph(manifest, "target").graph
    norms_by_scale = {
        node.inputs[1].name: node
        for node in graph
        if node.op_type == "RMSNormalization" and node.inputs[1] is not None
    }
    ops = {node.op_type for node in graph}
    for op in ("Tanh", "Softplus", "Gelu", "Erf"):
        if op in ops:
            raise _refuse(manifest, f"computes {op} (a soft cap or another activation)")
    attention = [node for node in graph if node.op_type == "TreeAttention"]
    if len(attention) != model.num_layers:
        raise _refuse(manifest, f"has {len(attention)} attentions for {model.num_layers} layers")
    scales = {a.attributes["scale"].as_float() for a in attention}
    norms: dict[str, np.ndarray] = {}
    linears: dict[str, np.ndarray] = {}
    eps: set[float] = set()

    def norm_then_matmul(scale_name: str, key: str, linear: str | None) -> None:
        node = norms_by_scale.get(scale_name)
        weight = None if node is None else _const(node.inputs[1])
        if node is None or weight is None:
            raise _refuse(manifest, f"has no RMS norm {scale_name}")
        eps.add(node.attributes["epsilon"].as_float())
        norms[key] = weight.astype(np.float32)
        if linear is None:
            return
        matmul = _single_consumer(node.outputs[0], "MatMul")
        packed = None if matmul is None else _const(matmul.inputs[1])
        if packed is None or matmul is None or _single_consumer(matmul.outputs[0], "Add"):
            raise _refuse(manifest, f"does not feed {scale_name}'s output to one bias-free MatMul")
        linears[linear] = np.ascontiguousarray(packed.T, dtype=np.float32)

    for i in range(model.num_layers):
        prefix = f"model.layers.{i}."
        norm_then_matmul(prefix + "input_layernorm.weight", f"input_norm.{i}", f"qkv.{i}")
        norm_then_matmul(
            prefix + "post_attention_layernorm.weight", f"post_norm.{i}", f"gate_up.{i}"
        )
        for name, key in (("self_attn.o_proj", "o"), ("mlp.down_proj", "down")):
            value = graph.initializers.get(prefix + name + ".weight.T")
            if value is None or value.const_value is None:
                raise _refuse(manifest, f"has no {prefix}{name} weight")
            linears[f"{key}.{i}"] = np.ascontiguousarray(value.const_value.numpy().T, np.float32)
    norm_then_matmul("model.norm.weight", "final_norm", "lm_head")
    embed = graph.initializers.get("model.embed_tokens.weight")
    inv_freq = graph.initializers.get("rotary.inv_freq")
    if (
        embed is None
        or inv_freq is None
        or embed.const_value is None
        or inv_freq.const_value is None
    ):
        raise _refuse(manifest, "has no model.embed_tokens.weight or rotary.inv_freq")
    d, heads, kv_heads, head_dim = (
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
    )
    qkv_width = (heads + 2 * kv_heads) * head_dim
    if linears["qkv.0"].shape != (qkv_width, d) or len(eps) != 1 or len(scales) != 1:
        raise _refuse(
            manifest, "is not shaped as its manifest says (q/k/v, norms or scales differ)"
        )
    constants: dict[str, float | int] = {
        "hidden": d,
        "layers": model.num_layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "inter": linears["gate_up.0"].shape[0] // 2,
        "vocab": model.vocab_size,
        "eps": eps.pop(),
        "attn_scale": scales.pop(),
    }
    return TargetWeights(
        constants,
        norms,
        linears,
        np.ascontiguousarray(embed.const_value.numpy(), np.float32),
        np.ascontiguousarray(inv_freq.const_value.numpy(), np.float32),
    )


def check_shapes(manifest: Manifest) -> None:
    """Refuses widths the kernels do not block: every MatMul's inputs in whole blocks of 32."""
    model = manifest.model
    widths = {
        "hidden size": model.hidden_size,
        "heads x head size": model.num_heads * model.head_dim,
    }
    odd = [f"{name} {width}" for name, width in widths.items() if width % kernels.QBLOCK]
    if odd:
        raise BuildError(
            f"{manifest.root}: --backend cpu needs MatMul inputs in whole blocks of "
            f"{kernels.QBLOCK}; this target's {', '.join(odd)}"
        )


class _Writer:
    """Tensors appended to one file at 64-byte offsets; the index records where each is."""

    def __init__(self, path):
        self.file = open(path, "wb")  # noqa: SIM115 (closed by `close`)
        self.index: dict[str, dict] = {}

    def add(self, name: str, array: np.ndarray) -> None:
        offset = -(-self.file.tell() // 64) * 64
        self.file.write(b"\0" * (offset - self.file.tell()))
        self.file.write(np.ascontiguousarray(array).tobytes())
        self.index[name] = {"offset": offset, "dtype": array.dtype.str, "shape": list(array.shape)}

    def close(self) -> None:
        self.file.close()


def block_size(weights: TargetWeights) -> int:
    """The block: 128 inputs on a target whose weights stream from memory, else 32.

    ONNX Runtime's int4 builds' rule (specx.build.ort.STREAMED_WEIGHTS): a large block
    quarters the per-block work of the kernels' inner loop (docs/decisions.md#cpu-kernels),
    and a large target's accuracy holds at it. Every MatMul's inputs must be whole blocks.
    """
    total = sum(w.size for w in weights.linears.values())
    inputs = {w.shape[1] for w in weights.linears.values()}
    if total >= STREAMED_WEIGHTS and all(k % 128 == 0 for k in inputs):
        return 128
    return kernels.QBLOCK


def _packed(weight: np.ndarray, bits: int, block: int) -> np.ndarray:
    """`weight` [n, k] rounded to nearest in symmetric blocks, in the kernels' layout."""
    quantized = quantize_rtn(weight.T, bits, block, symmetric=True)
    n = weight.shape[0]
    codes = quantized.codes.reshape(n, -1)
    if bits == 8:  # the kernels' int8 paths take codes 1..255 (|q| <= 127)
        codes = np.maximum(codes, 1)
    return kernels.pack_codes(codes, quantized.scales, bits)


class Cpu:
    """The target in the kernels' layout; the draft graphs as ONNX Runtime's."""

    name = "cpu"
    runtime = "cpu"
    passes = ()

    def build_name(self, options: BuildOptions) -> str:
        """`cpu-<precision>`."""
        return f"cpu-{options.precision}"

    def check(self, manifest: Manifest, options: BuildOptions, prompts: Sequence) -> None:
        """int4 / int8 of a Llama-form target, round to nearest, with the kernels built here."""
        if options.precision not in PRECISIONS:
            raise BuildError(f"--precision must be one of {list(PRECISIONS)} for --backend cpu")
        config = options.weight_only
        if config is not None and config != WeightOnlyConfig(bits=config.bits):
            raise BuildError(
                "--backend cpu rounds every weight to nearest in blocks of 32 (lm_head at 8 "
                "bits): leave the weight-only settings at their defaults"
            )
        reason = kernels.unavailable()
        if reason is not None:
            raise BuildError(reason)
        if manifest.model.family not in ("llama",):
            raise _refuse(manifest, f"is of family {manifest.model.family!r}")
        check_shapes(manifest)

    def build(self, job: BuildJob) -> BuildEntry:
        """target.bin + target.json for the kernels; the drafts on ONNX Runtime."""
        bits = 4 if job.options.precision == "int4" else 8
        graphs: dict[str, GraphEntry] = {}
        drafts = None
        if set(job.manifest.graphs) != {"target"}:
            job.progress("[cpu] the draft graphs, on ONNX Runtime")
            config = WeightOnlyConfig(bits=bits)
            options = dataclasses.replace(job.options, backend="ort", weight_only=config)
            drafts = build_drafts(dataclasses.replace(job, options=options))
            graphs = {n: dataclasses.replace(e, runtime="ort") for n, e in drafts.graphs.items()}
        job.progress("[cpu] reading the target's weights")
        weights = read_target(job.manifest)
        block = block_size(weights)
        graphs["target"] = self._write(job, weights, bits, block)
        details: dict[str, object] = {
            "bits": bits,
            "block": block,
            "symmetric": True,
            "output_bits": OUTPUT_BITS,
        }
        if drafts is not None:
            details["drafts"] = drafts.quantization.to_json()
        return BuildEntry(
            self.runtime,
            job.options.precision,
            graphs=graphs,
            quantization=Quantization("all", details=details),
            onnxruntime_version=None if drafts is None else drafts.onnxruntime_version,
        )

    def _write(self, job: BuildJob, weights: TargetWeights, bits: int, block: int) -> GraphEntry:
        staging, directory = job.output.staging, job.output.directory
        writer = _Writer(staging / "target.bin")
        try:
            writer.add("embed", weights.embed)
            writer.add("inv_freq", weights.inv_freq)
            for name, norm in weights.norms.items():
                writer.add(name, norm)
            total = len(weights.linears)
            for i, (name, weight) in enumerate(weights.linears.items()):
                width = OUTPUT_BITS if name == "lm_head" else bits
                writer.add(name, _packed(weight, width, block))
                shape = {"k": weight.shape[1], "n": weight.shape[0]}
                writer.index[name].update(bits=width, block=block, **shape)
                if i % 8 == 7 or i == total - 1:
                    job.progress(f"[cpu] packed {i + 1}/{total} weights")
        finally:
            writer.close()
        index = {"format": FORMAT, "constants": weights.constants, "tensors": writer.index}
        (staging / "target.json").write_text(json.dumps(index, indent=1))
        exported = job.manifest.graph("target")
        return GraphEntry(
            f"{directory}/target.json",
            exported.inputs,
            exported.outputs,
            (f"{directory}/target.bin",),
        )


BACKEND = Cpu()
