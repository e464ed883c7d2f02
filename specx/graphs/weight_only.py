"""Weight-only block quantization: each constant-weight MatMul becomes com.microsoft MatMulNBits.

A CPU decode step is bound by the bytes of weights it streams (design notes, section 10:
a 1.5B model decodes 4.3x faster from onnxruntime-genai's int4 build than from fp32), so the
weights are stored in 4 or 8 bits while activations stay float. Rule, per MatMul weight W
[K, N]: each column is cut into blocks of `block_size` along K; a block's values are
stored as round-to-nearest integers times one float scale (symmetric: zero point 2^(bits-1);
otherwise a per-block zero point too). The integers, scales and zero points are computed by
ONNX Runtime's own kernels (`quantize_matmul_4bits` / `quantize_matmul_8bits`, what its
`MatMulNBitsQuantizer` RTN mode calls), so the graph means what ORT's quantizer would write.

`accuracy_level` is MatMulNBits' compute type: 0 leaves it unset (float compute), 4 quantizes
each activation block to int8 on the fly and multiplies in int8 (fastest on AVX-512 VNNI /
AVX2 CPUs, and a last-bit change in an activation can then move a whole int8 step, as in
static INT8 builds: `specx.graphs.row_invariance`).

The output projection (the MatMul whose result is a graph output: the target's lm_head, a
head's logits) has its own bit width: top-1 agreement is most sensitive there.

Quantized weights are computed when the graph is saved, one MatMul at a time, and the source
weight's memory map is released after it, so building a model larger than memory works.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

__all__ = ["WeightOnlyConfig", "WeightOnlyQuantizePass", "quantized_matmuls"]

MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class WeightOnlyConfig:
    """How MatMul weights are stored: bits, block size, zero points, compute type."""

    bits: int = 4
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4  # 0: float compute; 4: int8 activations (see module docstring)
    output_bits: int = 8  # the output projection (lm_head); 0 keeps it float32

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.output_bits not in (0, 4, 8):
            raise ValueError(f"output_bits must be 0, 4 or 8, got {self.output_bits}")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be 16, 32, 64, 128 or 256, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be in 0..4, got {self.accuracy_level}")

    def record(self) -> dict:
        """The manifest's description of the build's quantization."""
        return {
            "method": "rtn",
            "bits": self.bits,
            "block_size": self.block_size,
            "symmetric": self.symmetric,
            "accuracy_level": self.accuracy_level,
            "output_projection_bits": self.output_bits or "float32",
        }


class _Quantized:
    """One weight's (packed, scales, zero points), computed on first use, dropped when taken."""

    def __init__(self, source: ir.TensorProtocol, bits: int, block_size: int, symmetric: bool):
        self.source, self.bits, self.block_size, self.symmetric = (
            source,
            bits,
            block_size,
            symmetric,
        )
        k, n = source.shape
        self.k, self.n = int(k), int(n)
        self.blocks = -(-self.k // block_size)
        self.blob = block_size * bits // 8
        self._parts: list[np.ndarray | None] | None = None

    def shapes(self) -> tuple[tuple[int, ...], ...]:
        per_byte = 8 // self.bits
        return (
            (self.n, self.blocks, self.blob),
            (self.n, self.blocks),
            (
                self.n,
                -(-self.blocks // per_byte),
            ),
        )

    def part(self, index: int) -> np.ndarray:
        if self._parts is None or self._parts[index] is None:
            self._parts = list(self._compute())
        value = self._parts[index]
        self._parts[index] = None
        if all(p is None for p in self._parts):
            self._parts = None
        return value

    def _compute(self) -> tuple[np.ndarray, ...]:
        from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

        weight = np.asarray(self.source.numpy(), dtype=np.float32)
        padded = self.blocks * self.block_size
        if padded != self.k:
            weight = np.pad(weight, ((0, padded - self.k), (0, 0)))
        weight = np.ascontiguousarray(weight)
        packed, scales, zeros = (
            np.zeros(s, dtype=d)
            for s, d in zip(self.shapes(), (np.uint8, np.float32, np.uint8), strict=True)
        )
        quantize = quantize_matmul_4bits if self.bits == 4 else quantize_matmul_8bits
        quantize(packed, weight, scales, zeros, self.block_size, self.n, padded, self.symmetric)
        del weight  # a view of the source's memory map, which release() closes
        release = getattr(self.source, "release", None)
        if release is not None:
            with contextlib.suppress(BufferError):  # another view is alive: keep the map
                release()  # an external tensor's memory map: its pages no longer count
        return packed, scales, zeros


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
    """Replaces every MatMul with a constant 2D float32 weight by MatMulNBits."""

    def __init__(self, config: WeightOnlyConfig):
        super().__init__()
        self.config = config

    def call(self, model: ir.Model) -> PassResult:  # noqa: D102
        graph, outputs = model.graph, set(map(id, model.graph.outputs))
        changed = 0
        for node in list(graph):
            weight = node.inputs[1] if len(node.inputs) > 1 else None
            if not _quantizable(node, weight):
                continue
            is_output = any(id(v) in outputs for v in node.outputs)
            bits = self.config.output_bits if is_output else self.config.bits
            if bits:
                _replace(graph, node, weight, bits, self.config)
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
    graph: ir.Graph, node: ir.Node, weight: ir.Value, bits: int, config: WeightOnlyConfig
) -> None:
    quantized = _Quantized(weight.const_value, bits, config.block_size, config.symmetric)
    base = weight.name or node.name
    inputs = [
        node.inputs[0],
        _lazy(quantized, 0, ir.DataType.UINT8, f"{base}_q{bits}"),
        _lazy(quantized, 1, ir.DataType.FLOAT, f"{base}_scales"),
    ]
    if not config.symmetric:
        inputs.append(_lazy(quantized, 2, ir.DataType.UINT8, f"{base}_zero_points"))
    for value in inputs[1:]:
        graph.register_initializer(value)
    attributes = {"K": quantized.k, "N": quantized.n, "bits": bits, "block_size": config.block_size}
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


def quantized_matmuls(model: ir.Model) -> dict[int, int]:
    """How many MatMulNBits of each bit width the graph has."""
    counts: dict[int, int] = {}
    for node in model.graph:
        if (node.domain, node.op_type) == (MS_DOMAIN, "MatMulNBits"):
            bits = node.attributes.get_int("bits", 4)
            counts[bits] = counts.get(bits, 0) + 1
    return counts
