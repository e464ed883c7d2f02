"""A fused Triton kernel for the `specx::TreeAttention` op (semantics: `tree_attention_reference`).

Rule, per sequence b: the N new key/value rows are written in place to cache slots
``write_pos[b] .. write_pos[b] + N - 1``; then query i of head h attends over cache slots
``[0, L)`` of kv head ``h // (H // Hkv)`` (grouped-query attention) where
``mask[b, 0, i, j]`` is True: ``out = softmax(cap(q . k * scale)) @ v``, accumulated in fp32
and returned in q's dtype (fp32, fp16 or bf16); ``cap(s) = softcap * tanh(s / softcap)`` when
``softcap > 0`` (Gemma 2), else ``s``.

One launch, grid ``(cdiv(N, BLOCK_N), B * H)``: a program owns BLOCK_N queries of one (b, h)
and streams slots ``[0, L)`` in blocks of BLOCK_L with an online softmax (flash attention).

* Slots ``[write_pos[b], write_pos[b] + N)`` are read from the new ``k``/``v`` inputs, never
  from the cache: other programs of the same launch may be writing them. Every other slot
  below L comes from the cache. Slots ``>= L`` are never loaded, so the cost and the result
  do not depend on the capacity CAP.
* The programs of the first query head of each kv group (``h % (H // Hkv) == 0``) also copy
  their BLOCK_N new k/v rows into ``k_cache_out``/``v_cache_out`` at ``write_pos[b]``. Those
  outputs alias ``k_cache``/``v_cache`` (in-place update); no program reads a slot another
  one writes, so the launch has no race.

The parameter order is TensorRT's AOT plugin ABI (`specx.tensorrt.plugin`): the 7 input
pointers, the int32 scalars ``N, L, CAP``, the 3 output pointers, then compile-time
constants. Tensors are contiguous; strides follow from the dims (int64 offsets).
The head dim (at most 128) is a constant, padded to a power of two of at least 16 (the
smallest ``tl.dot`` tile on GPU needs K >= 8) and masked. `compile_kernel` compiles the
kernel ahead of time to PTX without a GPU (TensorRT's plugin uses it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "KERNEL_DTYPES",
    "KERNEL_SCALARS",
    "MAX_HEAD_DIM",
    "SHARED_MEMORY_LIMIT",
    "KernelConfig",
    "check_no_scratch",
    "compile_kernel",
    "head_block",
    "kernel_config",
    "qk_scale",
    "query_block",
    "tree_attention",
    "tree_attention_kernel",
]

MAX_HEAD_DIM = 128
# The int32 scalars between the input and the output pointers, in kernel order.
KERNEL_SCALARS = ("N", "L", "CAP")
# Triton's name of each supported dtype, as `compile_kernel` takes it.
KERNEL_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_DTYPES = tuple(KERNEL_DTYPES)
# The largest static shared memory a CUDA kernel gets without an explicit opt-in.
SHARED_MEMORY_LIMIT = 48 * 1024


@triton.jit
def tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, write_pos_ptr, mask_ptr,
    N, L, CAP,
    out_ptr, k_cache_out_ptr, v_cache_out_ptr,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    QK_SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (query block, b, h): attention over slots [0, L), plus the cache write if h leads."""
    # int64 batch/head indices: every offset below is int64 (b * H * N * D overflows int32).
    bh = tl.program_id(1).to(tl.int64)
    b = bh // NUM_HEADS
    h = bh % NUM_HEADS
    kv_bh = b * (NUM_HEADS // GROUP) + h // GROUP  # row of the [B, Hkv] kv planes
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_n < N
    d_ok = offs_d < HEAD_DIM

    wp = tl.load(write_pos_ptr + b)  # int64
    new_k_base = k_ptr + kv_bh * N * HEAD_DIM
    new_v_base = v_ptr + kv_bh * N * HEAD_DIM
    cache_off = kv_bh * CAP * HEAD_DIM

    if h % GROUP == 0:
        # This block's new rows go to their slots. The reference raises on a slot outside the
        # cache; a kernel cannot, and writing there would corrupt memory it does not own, so
        # such a row is dropped instead.
        dst = wp + offs_n
        tile = (row_ok & (dst >= 0) & (dst < CAP))[:, None] & d_ok[None, :]
        rows = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        dst_off = cache_off + dst[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(k_cache_out_ptr + dst_off, tl.load(new_k_base + rows, mask=tile), mask=tile)
        tl.store(v_cache_out_ptr + dst_off, tl.load(new_v_base + rows, mask=tile), mask=tile)

    q_tile = row_ok[:, None] & d_ok[None, :]
    q_off = (bh * N + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_tile, other=0.0)
    mask_base = mask_ptr + (b * N + offs_n[:, None]) * L

    # Online softmax state per query row, in fp32 whatever the input dtype.
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start in range(0, L, BLOCK_L):
        slots = start + offs_l
        slot_ok = slots < L  # never load slots >= L: they may hold anything
        rel = slots - wp  # row of the new k/v that this slot receives
        from_new = slot_ok & (rel >= 0) & (rel < N)
        from_cache = slot_ok & ~from_new
        new_tile = from_new[:, None] & d_ok[None, :]
        cache_tile = from_cache[:, None] & d_ok[None, :]
        new_off = rel[:, None] * HEAD_DIM + offs_d[None, :]
        slot_off = cache_off + slots[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.where(
            new_tile,
            tl.load(new_k_base + new_off, mask=new_tile, other=0.0),
            tl.load(k_cache_ptr + slot_off, mask=cache_tile, other=0.0),
        )
        v = tl.where(
            new_tile,
            tl.load(new_v_base + new_off, mask=new_tile, other=0.0),
            tl.load(v_cache_ptr + slot_off, mask=cache_tile, other=0.0),
        )
        visible = tl.load(
            mask_base + slots[None, :], mask=row_ok[:, None] & slot_ok[None, :], other=0
        )
        # "ieee" keeps fp32 inputs out of TF32 (10-bit mantissa); half inputs ignore it.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * QK_SCALE
        if SOFTCAP > 0:  # SOFTCAP in log2 units too: cap(s) * log2(e) = SOFTCAP * tanh(s / SOFTCAP)
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp overflows to inf -> 1).
            s = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFTCAP) + 1.0))
        s = tl.where(visible != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen nothing yet keeps m = -inf; shifting by 0 instead makes its
        # exp2(-inf) = 0 rather than exp2(-inf - -inf) = nan.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # Real rows see at least themselves (l > 0); only padding rows past N have l = 0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=q_tile)


@dataclass(frozen=True)
class KernelConfig:
    """Per-dtype tiling: slots per loop step, software-pipelining stages, warps."""

    block_l: int
    num_stages: int
    num_warps: int = 4


def kernel_config(dtype: str) -> KernelConfig:
    """The tiling for a Triton dtype name ("fp32", "fp16" or "bf16").

    fp32's exact ("ieee") `tl.dot` runs on FMA units and stages both operands through shared
    memory: 32 slots a step and no pipelining keep it at 40 KiB for D = 128 (64 slots and 3
    stages need 328 KiB), under the 48 KiB a kernel gets without an opt-in. fp16/bf16 use
    tensor cores and about 37 KiB at D = 128 and 64 slots.
    """
    if dtype == "fp32":
        return KernelConfig(block_l=32, num_stages=1)
    if dtype in ("fp16", "bf16"):
        return KernelConfig(block_l=64, num_stages=2)
    raise ValueError(f"unsupported kernel dtype {dtype!r}; expected fp32, fp16 or bf16")


def head_block(head_dim: int) -> int:
    """BLOCK_D for a head dim: the next power of two, at least 16 (a `tl.dot` K >= 8)."""
    return max(16, triton.next_power_of_2(head_dim))


def query_block(n: int) -> int:
    """BLOCK_N for N queries: 16 .. 64 (`tl.dot` needs M >= 16 on GPU)."""
    return min(64, max(16, triton.next_power_of_2(n)))


def qk_scale(scale: float) -> float:
    """The kernel's QK_SCALE (and SOFTCAP): `scale` in log2 units, as the kernel uses exp2."""
    return float(scale) * math.log2(math.e)


def compile_kernel(
    dtype: str,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    softcap: float = 0.0,
    block_n: int = 16,
    arch: int = 90,
    ptx_version: int | None = None,
):
    """Compiles `tree_attention_kernel` for CUDA ahead of time; no GPU needed.

    Args:
        dtype: "fp32", "fp16" or "bf16": q, k, v, the caches and out.
        num_heads: H.
        num_kv_heads: Hkv.
        head_dim: D.
        scale: Multiplier of q . k before the softmax.
        softcap: Cap of the scaled scores (softcap * tanh(s / softcap)); 0 for none.
        block_n: BLOCK_N, queries per program (the grid's x is cdiv(N, BLOCK_N)).
        arch: CUDA compute capability, e.g. 90 for sm_90.
        ptx_version: PTX ISA version to emit, e.g. 84 for a CUDA 12.4 driver; None for the
            version of Triton's bundled ptxas.

    Returns:
        Triton's `CompiledKernel`: `.asm["ptx"]`, `.metadata.name`, `.metadata.shared`,
        `.metadata.num_warps`. The PTX entry takes the 13 kernel arguments, then Triton's
        two scratch pointers (unused when the metadata's scratch sizes are 0).

    Raises:
        RuntimeError: Under TRITON_INTERPRET=1.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    config = kernel_config(dtype)
    constexprs = {
        "NUM_HEADS": num_heads,
        "GROUP": num_heads // num_kv_heads,
        "HEAD_DIM": head_dim,
        "QK_SCALE": qk_scale(scale),
        "SOFTCAP": qk_scale(softcap),
        "BLOCK_N": block_n,
        "BLOCK_L": config.block_l,
        "BLOCK_D": head_block(head_dim),
    }
    types = dict.fromkeys(constexprs, "constexpr") | dict.fromkeys(KERNEL_SCALARS, "i32")
    types |= {"write_pos_ptr": "*i64", "mask_ptr": "*u8"}  # bool is one byte
    # No "tt.divisibility" hints on the pointers: TensorRT may hand a plugin a pointer into
    # a larger buffer, and a wrong alignment promise would fault.
    kernel = tree_attention_kernel
    if not isinstance(kernel, triton.runtime.JITFunction):
        # Triton 3.9's interpreter patches the language globally; compiling fails under it.
        raise RuntimeError("compile_kernel cannot run with TRITON_INTERPRET=1 set; unset it")
    signature = {name: types.get(name, f"*{dtype}") for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if ptx_version is not None:
        options["ptx_version"] = ptx_version
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    check_no_scratch(kernel.metadata)
    return kernel


def check_no_scratch(metadata) -> None:
    """Refuses a kernel that needs Triton's scratch buffers.

    Triton >= 3.3 appends global_scratch / profile_scratch pointers to every kernel's
    parameters; TensorRT's AOT launch passes only the declared arguments (null for the
    extra ones), which is safe only while both scratch sizes are 0.

    Raises:
        RuntimeError: naming the scratch that is not empty.
    """
    for name in ("global_scratch_size", "profile_scratch_size"):
        size = getattr(metadata, name, 0)
        if size:
            raise RuntimeError(
                f"the TreeAttention kernel needs {size} bytes of Triton {name.split('_size')[0]}, "
                "which TensorRT's AOT launch does not provide"
            )


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_pos: torch.Tensor,
    mask: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Runs TreeAttention: writes k/v into the caches in place and attends over [0, L).

    Args:
        q: Queries [B, H, N, D], fp32, fp16 or bf16. Any layout (copied if not contiguous).
        k: New keys [B, Hkv, N, D], q's dtype. Any layout.
        v: New values [B, Hkv, N, D], q's dtype. Any layout.
        k_cache: Key cache [B, Hkv, CAP, D], q's dtype, contiguous; updated in place.
        v_cache: Value cache [B, Hkv, CAP, D], q's dtype, contiguous; updated in place.
        write_pos: Int64 [B], first slot of the new rows per sequence. Rows that would land
            outside [0, CAP) are not written (no host sync to check it).
        mask: Bool [B, 1, N, L], L <= CAP; True where query i may see slot j.
        num_heads: H.
        num_kv_heads: Hkv; H must be a multiple of it.
        scale: Multiplier of q . k before the softmax.
        softcap: Cap of the scaled scores (softcap * tanh(s / softcap)); 0 for none.

    Returns:
        The attention output [B, H, N, D] in q's dtype.

    Raises:
        ValueError: On inconsistent shapes, dtypes or devices, or non-contiguous caches
            (an in-place update through a copy would cost a full cache copy per call).
    """
    _validate(q, k, v, k_cache, v_cache, write_pos, mask, num_heads, num_kv_heads)
    batch, _, n, head_dim = q.shape
    capacity, kv_len = k_cache.shape[2], mask.shape[3]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0 or n == 0:
        return out
    q, k, v, write_pos, mask = (t.contiguous() for t in (q, k, v, write_pos, mask))
    mask = mask.view(torch.uint8)  # same bytes; a plain integer pointer type for the kernel

    bn = query_block(n)
    config = kernel_config(KERNEL_DTYPES[q.dtype])
    grid = (triton.cdiv(n, bn), batch * num_heads)
    tree_attention_kernel[grid](
        q, k, v, k_cache, v_cache, write_pos, mask,
        n, kv_len, capacity,
        out, k_cache, v_cache,  # the cache outputs alias the cache inputs
        NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        QK_SCALE=qk_scale(scale), SOFTCAP=qk_scale(softcap),
        BLOCK_N=bn, BLOCK_L=config.block_l, BLOCK_D=head_block(head_dim),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def _validate(q, k, v, k_cache, v_cache, write_pos, mask, num_heads, num_kv_heads) -> None:
    named = {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "mask": mask}
    for name, tensor in named.items():
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(tensor.shape)}")
    batch, heads, n, head_dim = q.shape
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if heads != num_heads:
        raise ValueError(f"q has {heads} heads but num_heads={num_heads}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is outside [1, {MAX_HEAD_DIM}]")
    kv_shape = (batch, num_kv_heads, n, head_dim)
    if k.shape != kv_shape or v.shape != kv_shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be {kv_shape}")
    if k_cache.shape != v_cache.shape or k_cache.shape[:2] != (batch, num_kv_heads):
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            f"[{batch}, {num_kv_heads}, CAP, {head_dim}]"
        )
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head dim {k_cache.shape[3]} != q's {head_dim}")
    if write_pos.shape != (batch,) or write_pos.dtype != torch.int64:
        raise ValueError(f"write_pos must be int64 [{batch}], got {_describe(write_pos)}")
    if mask.dtype != torch.bool or mask.shape[:3] != (batch, 1, n):
        raise ValueError(f"mask must be bool [{batch}, 1, {n}, L], got {_describe(mask)}")
    if mask.shape[3] > k_cache.shape[2]:
        raise ValueError(f"mask length L={mask.shape[3]} exceeds capacity {k_cache.shape[2]}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not one of {_DTYPES}")
    for name, tensor in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.dtype != q.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} != q dtype {q.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous (strides {cache.stride()}): the kernel updates it "
                "in place as a dense [B, Hkv, CAP, D] buffer"
            )
    devices = {t.device for t in (q, k, v, k_cache, v_cache, write_pos, mask)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def _describe(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} {list(tensor.shape)}"
