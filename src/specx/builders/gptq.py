"""GPTQ: block quantization that minimises the error a weight's real inputs see.

Frantar et al., 2022 ("GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"). For a MatMul y = x W with W [K, N], round-to-nearest rounds every row of W
on its own. GPTQ minimises ||X W - X Q||^2 over calibration inputs X [T, K]: with
H = X^T X + damp * mean(diag(H)) * I and U the upper Cholesky factor of H^-1, it rounds input
row k and moves that row's rounding error onto the rows not rounded yet,

    W[k+1:] -= outer(U[k, k+1:], (W[k] - Q[k]) / U[k, k]),

so later rows compensate for earlier ones. A block's scales (and zero points) are fixed
when its first row is reached, from the rows as updated so far, with the same rule as RTN
(`specx.graphs.weight_only.block_scales`): the result is an ordinary MatMulNBits weight.
Rows whose input is always zero (H[k, k] = 0) are zeroed. Updates are applied lazily in
batches of rows (the reference implementation's trick), so the work is GEMMs.

`collect_hessians` runs the float graph on calibration prompts and accumulates X^T X for the
input of every constant-weight MatMul; memory is K^2 floats per distinct input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from specx.graphs.weight_only import (
    BlockQuantized,
    Quantizer,
    block_codes,
    block_scales,
    quantize_rtn,
)
from specx.manifest_types import TensorSpec

__all__ = ["collect_hessians", "gptq_quantize", "gptq_quantizer"]

_LAZY_ROWS = 128


def gptq_quantize(
    weight: np.ndarray,  # [K, N] float32
    hessian: np.ndarray,  # [K, K] X^T X of the MatMul's inputs
    bits: int,
    block_size: int,
    symmetric: bool,
    damp: float = 0.01,
) -> BlockQuantized:
    """GPTQ codes and scales of `weight` (see the module docstring)."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    rows = blocks * block_size
    w = np.zeros((rows, n), dtype=np.float64)
    w[:k] = weight
    h = np.zeros((rows, rows), dtype=np.float64)
    h[:k, :k] = hessian
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[dead] = 0.0
    h[np.diag_indices(rows)] += damp * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: H^-1 = U^T U
    codes = np.empty((n, blocks, block_size), dtype=np.uint8)
    scales = np.empty((n, blocks), dtype=np.float32)
    zero_points = None if symmetric else np.empty((n, blocks), dtype=np.uint8)
    batch = max(_LAZY_ROWS // block_size, 1) * block_size
    for start in range(0, rows, batch):
        stop = min(start + batch, rows)
        errors = np.zeros((stop - start, n))
        for row in range(start, stop):
            b, j = divmod(row, block_size)
            if j == 0:
                scale, block_zeros = block_scales(w[row : row + block_size], bits, symmetric)
                scales[:, b] = scale
                if zero_points is not None:
                    zero_points[:, b] = block_zeros
            zero = 2 ** (bits - 1) if zero_points is None else zero_points[:, b]
            zeros = None if zero_points is None else zero_points[:, b]
            code = block_codes(w[row][None], scales[:, b], zeros, bits)[0]
            codes[:, b, j] = code
            error = (w[row] - (code.astype(np.float64) - zero) * scales[:, b]) / u[row, row]
            w[row + 1 : stop] -= np.outer(u[row, row + 1 : stop], error)
            errors[row - start] = error
        w[stop:] -= u[start:stop, stop:].T @ errors
    return BlockQuantized(codes, scales, zero_points, bits)


def gptq_quantizer(hessians: Mapping[str, np.ndarray], damp: float = 0.01) -> Quantizer:
    """A `WeightOnlyQuantizePass` quantizer: GPTQ where a Hessian was collected, else RTN."""

    def quantize(weight, bits, block_size, symmetric, input_name):
        hessian = hessians.get(input_name)
        if hessian is None:
            return quantize_rtn(weight, bits, block_size, symmetric)
        return gptq_quantize(weight, hessian, bits, block_size, symmetric, damp)

    return quantize


def collect_hessians(
    graph_path: Path,
    inputs: Sequence[TensorSpec],
    prompts: Sequence[Sequence[int]],
    threads: int | None = None,
) -> dict[str, np.ndarray]:
    """X^T X of the input of every constant-weight MatMul, over the prefill of each prompt.

    The graph is run as is with those inputs added as outputs (its weights stay where they
    are: the augmented graph is handed to ONNX Runtime with the artifact's directory for
    its external data).
    """
    import onnx_ir as ir
    import onnxruntime as ort

    from specx.builders.int8_static import prefill_inputs
    from specx.graphs.ir_values import input_at, name_of
    from specx.sessions import session_options

    model = ir.load(graph_path)
    names: list[str] = []
    for node in model.graph:
        weight = node.inputs[1] if len(node.inputs) > 1 else None
        if node.op_type == "MatMul" and weight is not None and weight.const_value is not None:
            source = input_at(node, 0)
            if source.name not in names:
                names.append(name_of(source))
                if source not in model.graph.outputs:
                    model.graph.outputs.append(source)
    options = session_options(threads)
    options.add_session_config_entry(
        "session.model_external_initializers_file_folder_path", str(graph_path.parent)
    )
    session = ort.InferenceSession(
        ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    hessians: dict[str, np.ndarray] = {}
    for prompt in prompts:
        outputs = session.run(names, prefill_inputs(inputs, prompt))
        for name, x in zip(names, outputs, strict=True):
            x = x.reshape(-1, x.shape[-1]).astype(np.float64)
            hessians[name] = hessians[name] + x.T @ x if name in hessians else x.T @ x
    return hessians
