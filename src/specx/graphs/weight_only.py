"""Weight-only block quantization: each constant-weight MatMul becomes com.microsoft MatMulNBits.

A CPU decode step is bound by the bytes of weights it streams (a 1.5B model decodes
several times faster from onnxruntime-genai's int4 build than from fp32), so the weights
are stored in 4 or 8 bits while activations stay float. Rule, per MatMul weight W
[K, N]: each column is cut into blocks of `block_size` along K; a block's values are
stored as integers q times one float scale, value = (q - z) * scale. Symmetric: z = 2^(bits-1)
and scale = v / -2^(bits-1) for the block's value v of largest magnitude, so v is exactly
representable (ONNX Runtime's own quantizer's rule; `tests/test_weight_only.py` checks our
bytes equal its `quantize_matmul_4bits/8bits`). Asymmetric: scale = (max - min) / (2^bits - 1)
and a per-block zero point, so a block's 16 levels span its range rather than twice its
largest magnitude. Asymmetric is the 4-bit default: a draft head's acceptance follows how
closely the int4 target keeps the float target's predictions, and on a real-size target the
asymmetric rule kept noticeably more of it at no measured cost in speed
(docs/decisions.md#asymmetric-int4); 8 bits stay symmetric, whose rounding error is
already small. The integers come
from round-to-nearest (RTN) or, given the Hessian of a MatMul's inputs on calibration
prompts, from GPTQ (`specx.builders.gptq`), which rounds one input row at a time and
pushes each row's error onto the rows not yet rounded.

`accuracy_level` is MatMulNBits' compute type: 0 leaves it unset (float compute), 4 quantizes
each activation block to int8 on the fly and multiplies in int8 (fastest on AVX-512 VNNI /
AVX2 CPUs, and a last-bit change in an activation can then move a whole int8 step, as in
static INT8 builds: `specx.graphs.row_invariance`).

The output projection (the MatMul whose result is a graph output: the target's lm_head, a
head's logits) has its own bit width: top-1 agreement is most sensitive there. A 4-bit one
can have its top `output_rescore` logits recomputed from an 8-bit copy of the weight
(`_rescore_top_k`): on a 1B model the 4-bit lm_head streams half the bytes of an 8-bit one,
a large share of a step, while TopK, gathering k rows of the 8-bit table and k dot products
cost little next to it, and the top-1 token is the 8-bit one's whenever that token is among
the 4-bit top k.

Quantized weights are computed when the graph is saved, one MatMul at a time, and the source
weight's memory map is released after it, so building a model larger than memory works.

Kept rather than onnxruntime's `MatMulNBitsQuantizer` (docs/decisions.md#own-weight-only-pass):
its default (C++) RTN writes the same scales and the same codes but for a handful (one step
apart, where w / scale is within 1e-6 of a half), but it loads the whole float model first
(`onnx.load`), so its peak memory grows with the model and it takes longer, where this pass
holds one weight at a time. Its RTN config (the Neural Compressor port) is another rule,
with a larger weight error and more memory still. Neither has the rescored 4-bit lm_head
above. The figures behind these choices: docs/decisions.md#weights-in-4-or-8-bits,
#rescored-4-bit-lm-head, #asymmetric-int4, #own-weight-only-pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from specx.graphs.ir_values import const_tensor, input_at, name_of

__all__ = [
    "BlockQuantized",
    "Quantizer",
    "WeightOnlyConfig",
    "WeightOnlyQuantizePass",
    "block_codes",
    "block_scales",
    "quantize_rtn",
    "quantized_matmuls",
    "rtn",
]

MS_DOMAIN = "com.microsoft"
# What a build quantizes. "draft": a head's step streams its weights (a one-layer head plus a
# vocabulary-wide output projection, a real cost per depth on pyref-deep:
# docs/decisions.md#draft-scope) while the target stays float, so its verify
# cost curve stays flat and trees keep greedy identity.
SCOPES = ("all", "draft")


@dataclass(frozen=True)
class WeightOnlyConfig:
    """How MatMul weights are stored: bits, block size, zero points, compute type."""

    bits: int = 4
    block_size: int | None = None  # None: by model size at build time (specx.builders)
    symmetric: bool | None = None  # None: asymmetric at 4 bits, symmetric at 8 (docstring)
    accuracy_level: int = 4  # 0: float compute; 4: int8 activations (see module docstring)
    output_bits: int | None = None  # the output projection; None: 4 (8 for int8); 0: float32
    method: str = "rtn"  # or "gptq" (needs calibration prompts)
    output_rescore: int | None = None  # top k logits recomputed in 8 bits; None: 16 if 4-bit
    scope: str = "all"  # or "draft": the draft head's graphs only, the target stays float

    def __post_init__(self) -> None:
        if self.output_bits is None:
            object.__setattr__(self, "output_bits", 4 if self.bits == 4 else 8)
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", self.bits == 8)
        if self.output_rescore is None:
            object.__setattr__(self, "output_rescore", 16 if self.output_bits == 4 else 0)
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.output_bits not in (0, 4, 8):
            raise ValueError(f"output_bits must be 0, 4 or 8, got {self.output_bits}")
        if self.block_size not in (None, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be 16, 32, 64, 128 or 256, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be in 0..4, got {self.accuracy_level}")
        if self.method not in ("rtn", "gptq"):
            raise ValueError(f"method must be rtn or gptq, got {self.method!r}")
        if self.output_rescore and self.output_bits != 4:
            raise ValueError(
                f"rescoring the lm_head's top {self.output_rescore} logits needs a 4-bit lm_head, "
                f"got {self.output_bits or 'float32'} bits"
            )
        if not 0 <= (self.output_rescore or 0) <= 256:
            raise ValueError(f"output_rescore must be in 0..256, got {self.output_rescore}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.scope == "draft" and self.method == "gptq":
            raise ValueError(
                "GPTQ calibrates the target's weights; a draft-only build rounds to nearest"
            )

    @property
    def block(self) -> int:
        """The block size, once resolved (`specx.builders.ort.weight_only_config`)."""
        if self.block_size is None:
            raise ValueError("the block size is resolved by the build (None: by model size)")
        return self.block_size

    @property
    def is_symmetric(self) -> bool:
        """Whether blocks have no zero points (`symmetric`, its default resolved by bits)."""
        return bool(self.symmetric)

    def record(self) -> dict:
        """The manifest's description of the build's quantization."""
        return {
            "method": self.method,
            "bits": self.bits,
            "block_size": self.block_size,
            "symmetric": self.symmetric,
            "accuracy_level": self.accuracy_level,
            "output_projection_bits": self.output_bits or "float32",
            "output_projection_rescored_top_k": self.output_rescore,
            "scope": self.scope,
        }

    def quantizes(self, graph: str) -> bool:
        """Whether the build quantizes the artifact's graph named `graph`."""
        return self.scope == "all" or graph != "target"


@dataclass(frozen=True)
class BlockQuantized:
    """A weight [K, N] in MatMulNBits' layout: value = (code - zero) * scale per block.

    codes [N, blocks, block_size] uint8 in [0, 2^bits); scales [N, blocks] float32;
    zero_points [N, blocks] uint8, or None for symmetric (zero = 2^(bits-1)).
    """

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    bits: int

    def dequantize(self) -> np.ndarray:
        """The float32 weight [blocks * block_size, N] (padded rows included) it stands for."""
        zero = 2 ** (self.bits - 1) if self.zero_points is None else self.zero_points[..., None]
        values = (self.codes.astype(np.float32) - zero) * self.scales[..., None]
        return values.reshape(values.shape[0], -1).T

    def packed(self) -> np.ndarray:
        """B [N, blocks, block_size * bits / 8]: 4-bit codes two per byte, low nibble first."""
        if self.bits == 8:
            return self.codes
        return (self.codes[..., 0::2] | (self.codes[..., 1::2] << 4)).astype(np.uint8)

    def packed_zero_points(self) -> np.ndarray:
        """zero_points [N, ceil(blocks * bits / 8)]: 4-bit ones two per byte along blocks."""
        zeros = self.zero_points
        if zeros is None:
            raise ValueError("a symmetric weight has no zero points to pack")
        if self.bits == 8:
            return zeros
        if zeros.shape[1] % 2:
            zeros = np.pad(zeros, ((0, 0), (0, 1)), constant_values=8)
        return (zeros[:, 0::2] | (zeros[:, 1::2] << 4)).astype(np.uint8)


def block_scales(
    block: np.ndarray, bits: int, symmetric: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """Scale (and zero point) per column of `block` [rows, N] (see the module docstring)."""
    if symmetric:
        largest = np.take_along_axis(block, np.abs(block).argmax(0)[None], 0)[0]
        scales = largest / -(2 ** (bits - 1))
        return np.where(scales == 0, 1.0, scales).astype(np.float32), None
    low, high = np.minimum(block.min(0), 0), np.maximum(block.max(0), 0)
    scales = (high - low) / (2**bits - 1)
    scales = np.where(scales == 0, 1.0, scales).astype(np.float32)
    zeros = np.clip(np.round(-low / scales), 0, 2**bits - 1).astype(np.uint8)
    return scales, zeros


def block_codes(
    rows: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, bits: int
) -> np.ndarray:
    """Round-to-nearest codes of `rows` [r, N] under per-column scales and zero points."""
    zero = 2 ** (bits - 1) if zeros is None else zeros
    codes = np.round(rows / scales) + zero
    return np.clip(codes, 0, 2**bits - 1).astype(np.uint8)


def quantize_rtn(weight: np.ndarray, bits: int, block_size: int, symmetric: bool) -> BlockQuantized:
    """Round-to-nearest block quantization of `weight` [K, N] (K padded to whole blocks)."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), dtype=np.float32)
    padded[:k] = weight
    codes = np.empty((n, blocks, block_size), dtype=np.uint8)
    scales = np.empty((n, blocks), dtype=np.float32)
    zero_points = None if symmetric else np.empty((n, blocks), dtype=np.uint8)
    for b in range(blocks):
        rows = padded[b * block_size : (b + 1) * block_size]
        scale, zeros = block_scales(rows, bits, symmetric)
        codes[:, b] = block_codes(rows, scale, zeros, bits).T
        scales[:, b] = scale
        if zero_points is not None:
            zero_points[:, b] = zeros
    return BlockQuantized(codes, scales, zero_points, bits)


# quantize(weight [K, N] float32, bits, block_size, symmetric, input name) -> BlockQuantized
Quantizer = Callable[[np.ndarray, int, int, bool, str], BlockQuantized]


def rtn(weight: np.ndarray, bits: int, block_size: int, symmetric: bool, name: str):
    """The `Quantizer` of round-to-nearest (the input is not needed)."""
    return quantize_rtn(weight, bits, block_size, symmetric)


class _Quantized:
    """One weight's MatMulNBits tensors, computed on first use and dropped once all are taken."""

    def __init__(
        self,
        source: ir.TensorProtocol,
        bits: int,
        config: WeightOnlyConfig,
        quantizer: Quantizer,
        input_name: str,
    ):
        self.source, self.bits, self.config = source, bits, config
        self.quantizer, self.input_name = quantizer, input_name
        k, n = source.shape.numpy()
        self.k, self.n = int(k), int(n)
        self.blocks = -(-self.k // config.block)
        self._parts: list[np.ndarray | None] | None = None

    def shapes(self) -> tuple[tuple[int, ...], ...]:
        per_byte = 8 // self.bits
        blob = self.config.block * self.bits // 8
        zero_bytes = -(-self.blocks // per_byte)
        return (self.n, self.blocks, blob), (self.n, self.blocks), (self.n, zero_bytes)

    def part(self, index: int) -> np.ndarray:
        if self._parts is None or self._parts[index] is None:
            self._parts = list(self._compute())
        value = self._parts[index]
        self._parts[index] = None
        if all(p is None for p in self._parts):
            self._parts = None
        if value is None:  # asymmetric only: a symmetric weight has no zero points
            raise ValueError("this weight has no zero points (symmetric)")
        return value

    def _compute(self) -> tuple[np.ndarray | None, ...]:
        weight = np.asarray(self.source.numpy(), dtype=np.float32)
        config = self.config
        quantized = self.quantizer(
            weight, self.bits, config.block, config.is_symmetric, self.input_name
        )
        del weight  # a view of the source's memory map, which release() closes
        release = getattr(self.source, "release", None)
        if release is not None:
            with contextlib.suppress(BufferError):  # another view is alive: keep the map
                release()  # an external tensor's memory map: its pages no longer count
        zeros = None if quantized.zero_points is None else quantized.packed_zero_points()
        return quantized.packed(), quantized.scales, zeros


def _lazy(quantized: _Quantized, index: int, dtype: ir.DataType, name: str) -> ir.Value:
    tensor = ir.LazyTensor(
        lambda: ir.tensor(quantized.part(index), name=name),
        dtype=dtype,
        shape=ir.Shape(list(quantized.shapes()[index])),
        name=name,
    )
    value = ir.Value(name=name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(dtype))
    return value


class WeightOnlyQuantizePass(InPlacePass):
    """Replaces every MatMul with a constant 2D float32 weight by MatMulNBits.

    `quantizer` computes each weight's codes when the graph is saved (default: RTN; a GPTQ
    quantizer looks its input's Hessian up by the MatMul input's name).
    """

    def __init__(self, config: WeightOnlyConfig, quantizer: Quantizer = rtn):
        super().__init__()
        self.config, self.quantizer = config, quantizer

    def call(self, model: ir.Model) -> PassResult:  # noqa: D102
        graph, outputs = model.graph, set(map(id, model.graph.outputs))
        changed = 0
        for node in list(graph):
            weight = node.inputs[1] if len(node.inputs) > 1 else None
            if not _quantizable(node, weight):
                continue
            is_output = _feeds_output(node.outputs[0], outputs)
            bits = self.config.output_bits if is_output else self.config.bits
            if bits:
                source, matrix = input_at(node, 0), input_at(node, 1)
                k = self.config.output_rescore if is_output else 0
                replacement = _replace(graph, node, matrix, bits, self.config, self.quantizer)
                if k:
                    _rescore_top_k(graph, replacement, source, matrix, self.config, k)
                changed += 1
        if changed:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            for name in [n for n, v in graph.initializers.items() if not v.uses()]:
                if not graph.initializers[name].is_graph_output():
                    graph.initializers.pop(name)
        return PassResult(model, modified=bool(changed))


def _quantizable(node: ir.Node, weight: ir.Value | None) -> bool:
    return (
        (node.domain, node.op_type) == ("", "MatMul")
        and weight is not None
        and weight.const_value is not None
        and weight.const_value.dtype == ir.DataType.FLOAT
        and len(weight.const_value.shape) == 2
    )


def _replace(
    graph: ir.Graph,
    node: ir.Node,
    weight: ir.Value,
    bits: int,
    config: WeightOnlyConfig,
    quantizer: Quantizer,
) -> ir.Node:
    source = input_at(node, 0)
    quantized = _Quantized(const_tensor(weight), bits, config, quantizer, name_of(source))
    base = weight.name or node.name
    inputs = [
        source,
        _lazy(quantized, 0, ir.DataType.UINT8, f"{base}_q{bits}"),
        _lazy(quantized, 1, ir.DataType.FLOAT, f"{base}_scales"),
    ]
    if not config.is_symmetric:
        inputs.append(_lazy(quantized, 2, ir.DataType.UINT8, f"{base}_zero_points"))
    for value in inputs[1:]:
        graph.register_initializer(value)
    attributes = {"K": quantized.k, "N": quantized.n, "bits": bits, "block_size": config.block}
    if config.accuracy_level:
        attributes["accuracy_level"] = config.accuracy_level
    replacement = ir.node(
        "MatMulNBits", inputs, attributes, domain=MS_DOMAIN, name=f"{node.name}_q{bits}"
    )
    graph.insert_before(node, replacement)
    output, original = replacement.outputs[0], node.outputs[0]
    output.shape, output.type = original.shape, original.type
    ir.convenience.replace_all_uses_with(original, output, replace_graph_outputs=True)
    name = original.name
    original.name = f"{name}_float"
    output.name = name
    graph.remove(node, safe=True)
    return replacement


def _rescore_top_k(
    graph: ir.Graph,
    matmul: ir.Node,
    source: ir.Value,
    weight: ir.Value,
    config: WeightOnlyConfig,
    k: int,
) -> None:
    """Replaces the top `k` logits of `matmul` (x @ W in 4 bits) by x @ W in 8 bits.

    Logits [..., V] -> TopK ids [..., k] -> the ids' rows of W's 8-bit codes and scales
    (RTN, symmetric, the build's block size) -> dequantized rows [..., k, K] -> one dot
    product with x per id -> ScatterElements into the logits. Every step is row by row, so
    row invariance is what the 4-bit MatMul has.
    """
    tensor = const_tensor(weight)
    k = min(k, int(tensor.shape.numpy()[1]))
    table = _Quantized(tensor, 8, dataclasses.replace(config, symmetric=True), rtn, "")
    base = weight.name or matmul.name
    codes = _lazy(table, 0, ir.DataType.UINT8, f"{base}_rescore_q8")  # [V, blocks, block]
    scales = _lazy(table, 1, ir.DataType.FLOAT, f"{base}_rescore_scales")  # [V, blocks]
    for value in (codes, scales):
        graph.register_initializer(value)

    def const(name: str, array: np.ndarray) -> ir.Value:
        tensor = ir.tensor(array)
        value = ir.Value(name=f"{base}_rescore_{name}", const_value=tensor)
        value.shape, value.type = ir.Shape(array.shape), ir.TensorType(tensor.dtype)
        graph.register_initializer(value)
        return value

    last = const("last_axis", np.array([-1], np.int64))
    logits = matmul.outputs[0]
    uses = list(logits.uses())
    outputs = [i for i, v in enumerate(graph.outputs) if v is logits]
    nodes: list[ir.Node] = []

    def add(op: str, inputs: list, **attributes) -> ir.Value:
        node = ir.node(op, inputs, attributes, name=f"{base}_rescore_{op.lower()}{len(nodes)}")
        nodes.append(node)
        return node.outputs[0]

    ids = ir.node("TopK", [logits, const("k", np.array([k], np.int64))], {"axis": -1},
                  num_outputs=2, name=f"{base}_rescore_topk")  # fmt: skip
    nodes.append(ids)
    rows = add("Cast", [add("Gather", [codes, ids.outputs[1]])], to=ir.DataType.FLOAT)
    rows = add("Sub", [rows, const("zero", np.array(2.0**7, np.float32))])  # symmetric 8-bit
    rows = add("Mul", [rows, add("Unsqueeze", [add("Gather", [scales, ids.outputs[1]]), last])])
    flat = add("Concat", [add("Shape", [ids.outputs[1]]), last], axis=0)  # [..., k, -1]
    rows = add("Reshape", [rows, flat])
    if table.k % config.block:  # the last block's padding
        rows = add("Slice", [rows, const("zero_start", np.array([0], np.int64)),
                             const("width", np.array([table.k], np.int64)), last])  # fmt: skip
    exact = add("Squeeze", [add("MatMul", [rows, add("Unsqueeze", [source, last])]), last])
    rescored = add("ScatterElements", [logits, ids.outputs[1], exact], axis=-1)
    graph.insert_after(matmul, nodes)
    rescored.shape, rescored.type = logits.shape, logits.type
    for use in uses:
        use.node.replace_input_with(use.idx, rescored)
    for index in outputs:
        name = logits.name
        logits.name, rescored.name = f"{name}_4bit", name
        graph.outputs[index] = rescored


# What may sit between the output projection and the logits: Gemma 2's final cap,
# c * tanh(x / c), which keeps the order of the logits (so the rescored top k too).
_OUTPUT_CAP_OPS = ("Div", "Tanh", "Mul")


def _feeds_output(value: ir.Value, outputs: set[int]) -> bool:
    """Whether `value` is a graph output, or becomes one through the final-logit cap alone."""
    while id(value) not in outputs:
        uses = list(value.uses())
        if len(uses) != 1 or uses[0].node.op_type not in _OUTPUT_CAP_OPS:
            return False
        value = uses[0].node.outputs[0]
    return True


def quantized_matmuls(model: ir.Model) -> dict[int, int]:
    """How many MatMulNBits of each bit width the graph has."""
    counts: dict[int, int] = {}
    for node in model.graph:
        if (node.domain, node.op_type) == (MS_DOMAIN, "MatMulNBits"):
            bits = node.attributes.get_int("bits", 4)
            counts[bits] = counts.get(bits, 0) + 1
    return counts
