"""The fused Triton TreeAttention kernel equals `tree_attention_reference`.

On CUDA when there is a device; otherwise in Triton's interpreter on CPU tensors; skipped
when triton is not installed. The PTX test compiles for sm_90 without a GPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Triton reads this when a kernel is decorated: set it before triton or the kernel
    # module is imported (setdefault leaves an explicit choice alone).
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from specx.export.tree_attention_op import tree_attention_reference  # noqa: E402
from specx.tensorrt.triton_tree_attention import (  # noqa: E402
    KERNEL_DTYPES,
    KERNEL_SCALARS,
    SHARED_MEMORY_LIMIT,
    head_block,
    kernel_config,
    qk_scale,
    query_block,
    tree_attention,
    tree_attention_kernel,
)

DEVICE = "cuda" if CUDA else "cpu"
BATCH, HEAD_DIM, CAPACITY, KV_LEN = 2, 24, 96, 80  # D not a power of two; L < CAP
WRITE_POS = (37, 70)  # differs per row; L = 80 spans two 64-slot blocks, the last partial

# triton-lang/triton#11584: the interpreter's tl.dot multiplies bf16 bit patterns.
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(INTERPRET, reason="Triton's interpreter has no bf16 tl.dot"),
    id="bf16",
)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def tree_mask(write_pos, n, kv_len, generator):
    """Node i of each row's random tree sees the prefix [0, write_pos), its ancestors, itself.

    Slots past write_pos + N stay hidden: they hold stale entries of the cache.
    """
    mask = torch.zeros(len(write_pos), 1, n, kv_len, dtype=torch.bool)
    for b, start in enumerate(write_pos):
        mask[b, 0, :, :start] = True
        parents = [-1] + [int(torch.randint(-1, i, (), generator=generator)) for i in range(1, n)]
        for i in range(n):
            node = i
            while node != -1:
                mask[b, 0, i, start + node] = True
                node = parents[node]
    return mask


def make_inputs(dtype, heads, kv_heads, n, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    return dict(
        q=randn(BATCH, heads, n, HEAD_DIM),
        k=randn(BATCH, kv_heads, n, HEAD_DIM),
        v=randn(BATCH, kv_heads, n, HEAD_DIM),
        k_cache=randn(BATCH, kv_heads, CAPACITY, HEAD_DIM),
        v_cache=randn(BATCH, kv_heads, CAPACITY, HEAD_DIM),
        write_pos=torch.tensor(WRITE_POS, device=DEVICE),
        mask=tree_mask(WRITE_POS, n, KV_LEN, generator).to(DEVICE),
        num_heads=heads,
        num_kv_heads=kv_heads,
        scale=1 / math.sqrt(HEAD_DIM),
    )


def reference(inputs):
    """The reference on fp32 copies, so the tolerance measures the kernel alone."""
    upcast = {
        name: value.float() if torch.is_tensor(value) and value.is_floating_point() else value
        for name, value in inputs.items()
    }
    return tree_attention_reference(**upcast)[0]


def assert_caches_written(inputs, k_before, v_before):
    """Slots write_pos .. write_pos + N - 1 hold the new rows; every other slot is as it was."""
    n = inputs["k"].shape[2]
    pairs = [(inputs["k_cache"], k_before, inputs["k"]), (inputs["v_cache"], v_before, inputs["v"])]
    for cache, before, new in pairs:
        for b, start in enumerate(WRITE_POS):
            assert torch.equal(cache[b, :, start : start + n], new[b])
            assert torch.equal(cache[b, :, :start], before[b, :, :start])
            assert torch.equal(cache[b, :, start + n :], before[b, :, start + n :])


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"), BF16],
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("n", [1, 5])
def test_matches_reference(dtype, heads, kv_heads, n):
    inputs = make_inputs(dtype, heads, kv_heads, n)
    expected = reference(inputs)  # before the kernel updates the caches in place
    k_before, v_before = inputs["k_cache"].clone(), inputs["v_cache"].clone()

    out = tree_attention(**inputs)

    assert out.dtype == dtype and out.shape == inputs["q"].shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    assert_caches_written(inputs, k_before, v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_softcap_matches_reference(dtype):
    # Scores of unit-variance q, k at 1/sqrt(D) are ~N(0, 1): a cap of 0.5 bends most of them.
    inputs = make_inputs(dtype, 4, 2, 5) | {"softcap": 0.5}
    expected = reference(inputs)
    uncapped = reference(inputs | {"softcap": 0.0})
    assert (expected - uncapped).abs().max() > 0.1  # the cap matters at this size

    out = tree_attention(**inputs)

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_reads_only_slots_below_kv_len():
    """NaN in slots [L, CAP) cannot reach the output: the kernel never loads them."""
    clean = make_inputs(torch.float32, 4, 2, 5)
    poisoned = make_inputs(torch.float32, 4, 2, 5)
    poisoned["k_cache"][:, :, KV_LEN:] = float("nan")
    poisoned["v_cache"][:, :, KV_LEN:] = float("nan")

    out = tree_attention(**poisoned)

    assert torch.isfinite(out).all()
    assert torch.equal(out, tree_attention(**clean))
    assert poisoned["k_cache"][:, :, KV_LEN:].isnan().all()


def test_strided_inputs():
    """q/k/v as [B, N, H, D] projections and a [B, N, L] mask, transposed: copied, then run."""
    inputs = make_inputs(torch.float32, 4, 2, 5)
    expected = reference(inputs)
    strided = dict(inputs)
    for name in ("q", "k", "v"):
        strided[name] = inputs[name].transpose(1, 2).contiguous().transpose(1, 2)
    strided["mask"] = inputs["mask"][:, 0].transpose(1, 2).contiguous().transpose(1, 2)[:, None]
    assert not any(strided[name].is_contiguous() for name in ("q", "k", "v", "mask"))
    k_before, v_before = inputs["k_cache"].clone(), inputs["v_cache"].clone()

    out = tree_attention(**strided)

    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert_caches_written(strided, k_before, v_before)


@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_rejects_non_contiguous_caches(name):
    """An in-place update through a copy would copy the whole cache: refused, not hidden."""
    inputs = make_inputs(torch.float32, 4, 2, 5)
    inputs[name] = inputs[name].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match=f"{name} must be contiguous"):
        tree_attention(**inputs)


def test_new_rows_come_from_k_v_not_the_cache():
    """Slots [write_pos, write_pos + N) are read from k/v: the kernel never reads them from a cache.

    The kernel is launched with cache outputs separate from the cache inputs, and NaN in the
    inputs' write slots: they cannot reach the output, and only the new rows are written.
    """
    inputs = make_inputs(torch.float32, 4, 2, 5)
    expected = reference(inputs)
    q, k, v, k_cache, v_cache = (inputs[name] for name in ("q", "k", "v", "k_cache", "v_cache"))
    batch, heads, n, head_dim = q.shape
    for b, start in enumerate(WRITE_POS):
        k_cache[b, :, start : start + n] = float("nan")
        v_cache[b, :, start : start + n] = float("nan")
    k_out, v_out = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    out = torch.empty_like(q)
    config = kernel_config(KERNEL_DTYPES[q.dtype])

    tree_attention_kernel[(1, batch * heads)](
        q, k, v, k_cache, v_cache, inputs["write_pos"], inputs["mask"].view(torch.uint8),
        n, KV_LEN, CAPACITY,
        out, k_out, v_out,
        NUM_HEADS=heads, GROUP=heads // inputs["num_kv_heads"], HEAD_DIM=head_dim,
        QK_SCALE=qk_scale(inputs["scale"]), SOFTCAP=0.0,
        BLOCK_N=query_block(n), BLOCK_L=config.block_l, BLOCK_D=head_block(head_dim),
    )  # fmt: skip

    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    for cache, written, new in ((k_cache, k_out, k), (v_cache, v_out, v)):
        for b, start in enumerate(WRITE_POS):
            assert cache[b, :, start : start + n].isnan().all()  # inputs untouched
            assert torch.equal(written[b, :, start : start + n], new[b])
            assert not written[b, :, :start].any() and not written[b, :, start + n :].any()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_heads": 3, "num_kv_heads": 2}, "multiple of num_kv_heads"),
        ({"write_pos": torch.tensor(WRITE_POS, dtype=torch.int32)}, "write_pos must be int64"),
        ({"mask": torch.ones(BATCH, 1, 5, CAPACITY + 1, dtype=torch.bool)}, "exceeds capacity"),
        ({"v": torch.zeros(BATCH, 2, 5, HEAD_DIM, dtype=torch.float16)}, "v dtype"),
        ({"k": torch.zeros(BATCH, 2, 4, HEAD_DIM)}, "must both be"),
    ],
)
def test_rejects_bad_inputs(change, message):
    inputs = make_inputs(torch.float32, 4, 2, 5)
    for name, value in change.items():
        inputs[name] = value.to(DEVICE) if torch.is_tensor(value) else value
    with pytest.raises(ValueError, match=message):
        tree_attention(**inputs)


_COMPILE = textwrap.dedent(
    """
    import json, re
    from specx.tensorrt.triton_tree_attention import compile_kernel

    report = {}
    for dtype in ("fp16", "bf16", "fp32"):
        kernel = compile_kernel(dtype, num_heads=4, num_kv_heads=2, head_dim=128, scale=0.088)
        entry = re.search(r"\\.entry\\s+(\\w+)\\s*\\(([^)]*)\\)", kernel.asm["ptx"])
        metadata = kernel.metadata
        report[dtype] = {
            "name": metadata.name,
            "entry": entry.group(1),
            "params": re.findall(r"\\.param\\s+(\\.\\w+)", entry.group(2)),
            "shared": metadata.shared,
            "global_scratch_size": getattr(metadata, "global_scratch_size", 0),
            "profile_scratch_size": getattr(metadata, "profile_scratch_size", 0),
        }
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def ptx_report():
    """Compiles the kernel for sm_90 per dtype in a child without TRITON_INTERPRET.

    Triton's interpreter patches the language process-wide, so this process cannot compile.
    """
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("Triton's CUDA backend is not installed: cannot compile to PTX")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_compiles_to_ptx_for_the_tensorrt_abi(ptx_report, dtype):
    """One PTX entry: 7 input pointers, the int32 scalars, 3 output pointers, 2 scratch pointers.

    TensorRT's AOT plugin passes exactly the first 7 + len(KERNEL_SCALARS) + 3; Triton's two
    trailing scratch pointers must then be unused (scratch sizes 0). Shared memory stays
    within the 48 KiB a launch gets without an opt-in, at the largest head dim.
    """
    report = ptx_report[dtype]
    assert report["entry"] == report["name"]
    assert report["params"] == [".u64"] * 7 + [".u32"] * len(KERNEL_SCALARS) + [".u64"] * (3 + 2)
    assert report["global_scratch_size"] == 0
    assert report["profile_scratch_size"] == 0
    assert 0 < report["shared"] <= SHARED_MEMORY_LIMIT
