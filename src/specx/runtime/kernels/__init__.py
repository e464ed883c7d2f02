"""specx's compiled CPU kernels: a Llama-family target forward over int4 / int8 weights.

`forward.c` is compiled at install (setup.py), once per instruction set; `library()` loads the
one this CPU runs (AVX-512 VNNI, else AVX2 + FMA + F16C) through ctypes, or returns None with
`unavailable()` saying why, and the runtime then runs the other builds. The C side's contract
(weight layout, row independence) is in forward.c's header; this module holds its Python
half: the ctypes structures, the packing of quantized codes into that layout and the GEMM
alone for tests and benchmarks. numpy and the standard library only.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "QBLOCK",
    "TILE",
    "Library",
    "Linear",
    "cpu_flags",
    "library",
    "linear_forward",
    "pack_codes",
    "unavailable",
]

TILE = 16  # output columns a tile (forward.c)
QBLOCK = 32  # inputs a register pass covers (forward.c); a block is 1 to 8 of them
BLOCKS = (32, 64, 128, 256)  # the block sizes the kernels take
_ZERO = {4: 8, 8: 128}  # the code of 0.0 at each width
_ISA_FLAGS = {
    "vnni": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "avx2": ("avx2", "fma", "f16c"),
}
_HERE = Path(__file__).parent


class Linear(ctypes.Structure):
    """forward.c's `spx_linear`: one packed weight (and its bias)."""

    _fields_ = [
        ("weight", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("bits", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("block", ctypes.c_int32),
        ("zero_points", ctypes.c_int32),
    ]


class Layer(ctypes.Structure):
    """forward.c's `spx_layer`."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", Linear),
        ("o", Linear),
        ("gate_up", Linear),
        ("down", Linear),
    ]


class Model(ctypes.Structure):
    """forward.c's `spx_model`."""

    _fields_ = [
        ("hidden", ctypes.c_int32),
        ("layers", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("inter", ctypes.c_int32),
        ("vocab", ctypes.c_int32),
        ("rotary_half", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("attn_scale", ctypes.c_float),
        ("rope_scaling", ctypes.c_float),
        ("embed_scale", ctypes.c_float),
        ("embed", ctypes.c_void_p),
        ("inv_freq", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("lm_head", Linear),
        ("layer", ctypes.POINTER(Layer)),
        ("tap_kind", ctypes.c_int32),
        ("n_taps", ctypes.c_int32),
        ("tap_layers", ctypes.c_int32 * 8),
        ("threads", ctypes.c_int32),
        ("hidden_norm", ctypes.c_void_p),  # an EAGLE-3 head's; None for a target
    ]


@dataclass(frozen=True)
class Library:
    """The loaded kernels and the instruction set they were compiled for."""

    handle: ctypes.CDLL
    isa: str  # "vnni" or "avx2"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def _candidates() -> list[tuple[str, Path]]:
    """(isa, library file) this CPU runs, best first; SPECX_KERNELS_ISA narrows them (tests)."""
    flags, wanted = cpu_flags(), os.environ.get("SPECX_KERNELS_ISA")
    found = []
    for isa, needs in _ISA_FLAGS.items():
        if wanted and isa != wanted or not set(needs) <= flags:
            continue
        found += [(isa, path) for path in sorted(_HERE.glob(f"_forward_{isa}.*so"))]
    return found


@functools.cache
def library() -> Library | None:
    """The kernels this CPU runs, loaded once; None where none was built or none runs here."""
    for isa, path in _candidates():
        try:
            handle = ctypes.CDLL(str(path))
        except OSError:
            continue
        handle.spx_forward.restype = ctypes.c_int
        handle.spx_workspace_bytes.restype = ctypes.c_size_t
        handle.spx_workspace_bytes.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int]
        return Library(handle, isa)
    return None


def unavailable() -> str | None:
    """Why `library()` is None (one line), or None when the kernels run here."""
    if library() is not None:
        return None
    if not any(_HERE.glob("_forward_*.so")):
        return (
            "specx's CPU kernels were not compiled at install (a C compiler with OpenMP, "
            "Linux on x86-64): the ONNX Runtime and OpenVINO builds run instead"
        )
    return (
        "this CPU has neither AVX-512 VNNI nor AVX2 + FMA + F16C, which specx's CPU kernels "
        "need: the ONNX Runtime and OpenVINO builds run instead"
    )


def pack_codes(
    codes: np.ndarray, scales: np.ndarray, bits: int, zero_points: np.ndarray | None = None
) -> np.ndarray:
    """Codes [n, k] (uint8) and scales [n, k / block] in forward.c's layout.

    A weight is (code - zero) x scale, zero the block's entry of `zero_points` [n, k / block]
    (int4 only) or, without them, 8 at int4 and 128 at int8. The block is k over the scales'
    count. Columns are padded to whole tiles with zero weights. Returns uint8 [tiles * blocks
    * tile bytes]: per tile and block, for each pass of 32 inputs the codes as the kernel's
    registers read them (register p holds inputs 4p..4p+3 of each of the tile's 16 columns;
    at 4 bits registers 2p and 2p+1 share bytes, low and high nibble), then the tile's 16
    scales in fp16, then its 16 zero points (one byte each) where there are any.
    """
    n, k = codes.shape
    blocks = scales.shape[1] if scales.ndim == 2 else 0
    block = k // blocks if blocks else 0
    if scales.shape[0] != n or block not in BLOCKS or block * blocks != k or bits not in _ZERO:
        raise ValueError(f"codes {codes.shape}, scales {scales.shape}, bits {bits}: not packable")
    if zero_points is not None and (bits != 4 or zero_points.shape != scales.shape):
        raise ValueError(f"zero points {zero_points.shape} at {bits} bits: not packable")
    tiles, passes = -(-n // TILE), block // QBLOCK
    padded = np.full((tiles * TILE, k), _ZERO[bits], dtype=np.uint8)
    padded[:n] = codes
    padded_scales = np.zeros((tiles * TILE, blocks), dtype=np.float16)
    padded_scales[:n] = scales
    # [tiles, columns, blocks, passes, registers, 4] -> [tiles, blocks, passes, registers, ...]
    grouped = padded.reshape(tiles, TILE, blocks, passes, 8, 4).transpose(0, 2, 3, 4, 1, 5)
    registers = grouped.reshape(tiles, blocks, passes, 8, TILE * 4)
    if bits == 4:
        registers = registers[:, :, :, 0::2] | (registers[:, :, :, 1::2] << 4)
    scale_bytes = padded_scales.reshape(tiles, TILE, blocks).transpose(0, 2, 1).copy()
    parts = [registers.reshape(tiles, blocks, -1), scale_bytes.view(np.uint8)]
    if zero_points is not None:
        padded_zeros = np.full((tiles * TILE, blocks), _ZERO[bits], dtype=np.uint8)
        padded_zeros[:n] = zero_points
        parts.append(padded_zeros.reshape(tiles, TILE, blocks).transpose(0, 2, 1))
    packed = np.concatenate(parts, axis=2)
    return np.ascontiguousarray(packed).reshape(-1)


def linear_forward(lib: Library, weight: Linear, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """`x` [rows, k] float32 times one packed weight, activations quantized as in forward."""
    rows = x.shape[0]
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((rows, weight.n), dtype=np.float32)
    workspace = np.empty(rows * (weight.k // QBLOCK * 8 + weight.k) + 64, dtype=np.uint8)
    lib.handle.spx_linear_forward(
        ctypes.byref(weight),
        ctypes.c_int(rows),
        x.ctypes.data_as(ctypes.c_void_p),
        out.ctypes.data_as(ctypes.c_void_p),
        workspace.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_int(threads),
    )
    return out
