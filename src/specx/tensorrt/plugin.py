"""The TensorRT plugin `specx::TreeAttention`: one fused Triton kernel, compiled ahead of time.

`register_tree_attention_plugin()` defines the plugin through TensorRT's Quickly Deployable
Plugins (`tensorrt.plugin`): a shape/dtype function, the supported type combinations and an
AOT implementation. The ONNX parser then maps each `specx::TreeAttention` node (it carries
`plugin_namespace="specx"`, `plugin_version="1"`) to this plugin instead of inlining the
node's standard-op function; call it before `OnnxParser.parse`.

* AOT: at build time the plugin compiles `tree_attention_kernel` to PTX for the build GPU
  (one PTX per dtype and head configuration, cached) and hands TensorRT the kernel, its
  launch grid and its int32 scalars as shape expressions. The engine embeds the PTX and
  runs without Python (trtexec can run it).
* In place: the outputs `k_cache_out`/`v_cache_out` alias the inputs `k_cache`/`v_cache`.
  That needs the builder preview feature::

      config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)

  and the same device address bound to each cache input and its output.
* Versions: the QDP AOT path needs TensorRT >= 10.9 (checked here); specx graphs need
  >= 10.15 anyway, for the parser's TensorScatter and Attention (the function body that
  stands in where the plugin is not registered).

Importing this module imports tensorrt and triton; nothing else in specx imports it.
"""

# No `from __future__ import annotations`: tensorrt.plugin reads the annotations of the
# decorated functions as classes (issubclass), so they must not be strings.

import functools
import threading

import numpy as np
import numpy.typing as npt
import tensorrt as trt
import tensorrt.plugin as trtp

from specx.graphs.tree_attention import DOMAIN, OP_TYPE
from specx.tensorrt.ptx import device_arch, driver_ptx_version
from specx.tensorrt.triton_tree_attention import (
    KERNEL_SCALARS,
    MAX_HEAD_DIM,
    SHARED_MEMORY_LIMIT,
    compile_kernel,
)

__all__ = ["BLOCK_N", "PLUGIN_ID", "register_tree_attention_plugin"]

PLUGIN_ID = f"{DOMAIN}::{OP_TYPE}"
BLOCK_N = 16  # queries per program; N is dynamic at build time, and trees are small
_MIN_TENSORRT = (10, 9)
_KERNEL_DTYPES = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}
_FLOATS = "FP32|FP16|BF16"  # '|': every float I/O takes the same one of these
# Numeric attributes are declared as 1-element arrays, not int/float: the parser hands each
# over as a 1-D array field, and tensorrt.plugin converts an `int`/`float` attribute with
# int(array)/float(array), which recent NumPy (2.4 here) refuses ("only 0-dimensional
# arrays can be converted to Python scalars"); an array attribute is just `astype`d.
_Int32 = npt.NDArray[np.int32]
_Float32 = npt.NDArray[np.float32]
_lock = threading.Lock()


def register_tree_attention_plugin() -> None:
    """Registers `specx::TreeAttention` with TensorRT's plugin registry (idempotent).

    Raises:
        RuntimeError: When TensorRT is older than 10.9 (no AOT Python plugins).
    """
    with _lock:
        if _registered():
            return
        version = tuple(int(part) for part in trt.__version__.split(".")[:2])
        if version < _MIN_TENSORRT or not hasattr(trtp, "aot_impl"):
            raise RuntimeError(
                f"TensorRT {trt.__version__} has no AOT Python plugins; TreeAttention needs "
                f">= {'.'.join(map(str, _MIN_TENSORRT))} (10.15 for specx graphs)"
            )
        _define()


def _registered() -> bool:
    # tensorrt.plugin binds each registered plugin as `trtp.op.<namespace>.<name>`.
    return hasattr(getattr(trtp.op, DOMAIN, None), OP_TYPE)


def _define() -> None:
    # Every specx node also carries plugin_namespace/plugin_version, the parser's plugin
    # look-up keys. The research notes say the parser passes every node attribute as a field
    # and tensorrt.plugin's creator rejects names it was not registered with (onnx-tensorrt
    # 10.1's loadFields passes only the creator's declared fields; newer parsers unread), so
    # they are registered too, unused: right under either behaviour.
    @trtp.register(PLUGIN_ID)
    def _shapes(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        k_cache: trtp.TensorDesc,
        v_cache: trtp.TensorDesc,
        write_pos: trtp.TensorDesc,
        mask: trtp.TensorDesc,
        num_heads: _Int32,
        num_kv_heads: _Int32,
        scale: _Float32,
        softcap: _Float32,
        plugin_namespace: str,
        plugin_version: str,
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return q.like(), k_cache.aliased(), v_cache.aliased()

    @trtp.autotune(PLUGIN_ID)
    def _types(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        k_cache: trtp.TensorDesc,
        v_cache: trtp.TensorDesc,
        write_pos: trtp.TensorDesc,
        mask: trtp.TensorDesc,
        outputs: tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc],
    ) -> list[trtp.AutoTuneCombination]:
        # I/O order: q, k, v, k_cache, v_cache, write_pos, mask, out, k_cache_out, v_cache_out.
        io_types = [_FLOATS] * 5 + ["INT64", "BOOL"] + [_FLOATS] * 3
        return [trtp.AutoTuneCombination(", ".join(io_types), "LINEAR")]

    # TensorRT (10.9 .. 11.1 sources) calls aot_impl with every attribute, positionally, in
    # registration order, so all of them are parameters here.
    @trtp.aot_impl(PLUGIN_ID)
    def _kernel(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        k_cache: trtp.TensorDesc,
        v_cache: trtp.TensorDesc,
        write_pos: trtp.TensorDesc,
        mask: trtp.TensorDesc,
        num_heads: _Int32,
        num_kv_heads: _Int32,
        scale: _Float32,
        softcap: _Float32,
        plugin_namespace: str,
        plugin_version: str,
        outputs: tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc],
        tactic: int,
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        heads, kv_heads = _scalar(num_heads, np.int32), _scalar(num_kv_heads, np.int32)
        scale_, softcap_ = _scalar(scale, np.float32), _scalar(softcap, np.float32)
        head_dim = q.shape[3]  # the build-time dims; -1 where dynamic
        _check(q, heads, kv_heads, head_dim)
        kernel = _compile(
            _KERNEL_DTYPES[q.dtype],
            int(heads),
            int(kv_heads),
            head_dim,
            float(scale_),
            float(softcap_),
            device_arch(),
        )

        n = q.shape_expr[2]
        params = trtp.KernelLaunchParams()
        params.grid_x = trtp.cdiv(n, BLOCK_N)
        params.grid_y = q.shape_expr[0] * q.shape_expr[1]  # B * H
        params.block_x = kernel.metadata.num_warps * 32
        # Over 48 KiB needs a per-kernel opt-in; whether TensorRT makes it is unverified.
        if kernel.metadata.shared > SHARED_MEMORY_LIMIT:
            raise RuntimeError(f"TreeAttention kernel needs {kernel.metadata.shared} B shared")
        params.shared_mem = kernel.metadata.shared
        # The int32 scalars, in the kernel's order (N, L, CAP), as shape expressions that
        # TensorRT evaluates per launch.
        scalars = {"N": n, "L": mask.shape_expr[3], "CAP": k_cache.shape_expr[2]}
        extra_args = trtp.SymIntExprs.from_tuple(
            [trtp.SymInt32(scalars[name]) for name in KERNEL_SCALARS]
        )
        return kernel.metadata.name.encode(), kernel.asm["ptx"].encode(), params, extra_args


def _scalar(attribute: np.ndarray, dtype: type) -> np.generic:
    """The value of a 1-element array attribute of `dtype`."""
    if not isinstance(attribute, np.ndarray) or attribute.shape != (1,) or attribute.dtype != dtype:
        # Attributes arrive positionally: anything else means an unexpected order.
        raise TypeError(f"expected a 1-element {dtype.__name__} array attribute, got {attribute!r}")
    return attribute[0]


def _check(q, num_heads, num_kv_heads, head_dim) -> None:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if q.shape[1] not in (-1, num_heads):
        raise ValueError(f"q has {q.shape[1]} heads but num_heads={num_heads}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"TreeAttention needs a static head dim in [1, {MAX_HEAD_DIM}], got {head_dim}"
        )
    if q.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}")


@functools.cache
def _compile(
    dtype: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    softcap: float,
    arch: int,
):
    return compile_kernel(
        dtype,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        scale=scale,
        softcap=softcap,
        block_n=BLOCK_N,
        arch=arch,
        ptx_version=driver_ptx_version(arch),
    )
