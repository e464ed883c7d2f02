"""`torch.ops.specx.tree_attention`: the torch side of the TreeAttention op.

The eager implementation is the reference semantics (see `specx.graphs.tree_attention`);
the ONNX translation emits one `specx::TreeAttention` node whose function body is
attached after export, because `torch.onnx.export` would otherwise inline it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from onnx.defs import OpSchema
from onnxscript.values import Op, Opset

from specx.graphs import tree_attention as graph_op

__all__ = ["ONNX_TRANSLATIONS", "tree_attention", "tree_attention_reference"]


def tree_attention_reference(
    q: torch.Tensor,  # [B, H, N, D]
    k: torch.Tensor,  # [B, Hkv, N, D]
    v: torch.Tensor,  # [B, Hkv, N, D]
    k_cache: torch.Tensor,  # [B, Hkv, CAP, D]
    v_cache: torch.Tensor,  # [B, Hkv, CAP, D]
    write_pos: torch.Tensor,  # [B] int64
    mask: torch.Tensor,  # [B, 1, N, L] bool
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Writes k/v at `write_pos`, then attends over cache slots [0, L) under `mask`.

    Scores are capped at softcap * tanh(s / softcap) before the mask when `softcap` > 0.
    Plain differentiable torch: training calls it directly; the custom op wraps it.
    """
    _check_shapes(q, k, v, k_cache, write_pos, mask, num_heads, num_kv_heads)
    batch, kv_heads, n, head_dim = k.shape
    slots = write_pos[:, None] + torch.arange(n, device=k.device)  # [B, N]
    index = slots[:, None, :, None].expand(batch, kv_heads, n, head_dim)
    # Under bf16 autocast (training) RoPE's fp32 tables promote k; the cache keeps one dtype.
    k_cache = k_cache.scatter(2, index, k.to(k_cache.dtype))
    v_cache = v_cache.scatter(2, index, v.to(v_cache.dtype))
    kv_len = mask.shape[-1]
    keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
    if softcap > 0:
        out = _capped_attention(q, keys, values, mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    return out, k_cache, v_cache


def _capped_attention(q, keys, values, mask, scale: float, softcap: float) -> torch.Tensor:
    """Attention with scores softcap * tanh(scale * q.k / softcap), masked after capping."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.tanh(q @ keys.transpose(-1, -2) * scale / softcap) * softcap  # [B, H, N, L]
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return weights @ values


@torch.library.custom_op("specx::tree_attention", mutates_args=())
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exportable op (see `tree_attention_reference` for the rule)."""
    out, k_cache, v_cache = tree_attention_reference(
        q, k, v, k_cache, v_cache, write_pos, mask, num_heads, num_kv_heads, scale, softcap
    )
    return out, k_cache, v_cache


@tree_attention.register_fake
def _(q, k, v, k_cache, v_cache, write_pos, mask, num_heads, num_kv_heads, scale, softcap=0.0):
    return torch.empty_like(q), torch.empty_like(k_cache), torch.empty_like(v_cache)


def _check_shapes(q, k, v, k_cache, write_pos, mask, num_heads, num_kv_heads) -> None:
    batch, heads, n, head_dim = q.shape
    assert heads == num_heads and heads % num_kv_heads == 0, (heads, num_heads, num_kv_heads)
    assert k.shape == v.shape == (batch, num_kv_heads, n, head_dim), (k.shape, v.shape)
    assert k_cache.shape[:2] == (batch, num_kv_heads) and k_cache.shape[3] == head_dim
    assert write_pos.shape == (batch,), write_pos.shape
    assert mask.shape[:3] == (batch, 1, n) and mask.shape[3] <= k_cache.shape[2], mask.shape


def _schema() -> OpSchema:
    param = OpSchema.FormalParameter
    attr = OpSchema.Attribute
    types = {"write_pos": "tensor(int64)", "mask": "tensor(bool)"}
    return OpSchema(
        graph_op.OP_TYPE,
        graph_op.DOMAIN,
        1,
        inputs=[param(name, types.get(name, "T")) for name in graph_op.INPUTS],
        outputs=[param(name, "T") for name in graph_op.OUTPUTS],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[
            attr("num_heads", OpSchema.AttrType.INT),
            attr("num_kv_heads", OpSchema.AttrType.INT),
            attr("scale", OpSchema.AttrType.FLOAT),
            attr(graph_op.SOFTCAP, OpSchema.AttrType.FLOAT, "", required=False),
            attr("plugin_namespace", OpSchema.AttrType.STRING),
            attr("plugin_version", OpSchema.AttrType.STRING),
        ],
    )


_TREE_ATTENTION = Op(Opset(graph_op.DOMAIN, 1), graph_op.OP_TYPE, _schema())


def _translate(
    q, k, v, k_cache, v_cache, write_pos, mask, num_heads, num_kv_heads, scale, softcap=0.0
):
    return _TREE_ATTENTION(
        q,
        k,
        v,
        k_cache,
        v_cache,
        write_pos,
        mask,
        **graph_op.node_attributes(num_heads, num_kv_heads, scale, softcap),
    )


# torch.onnx.export's custom_translation_table type: an op overload is one such callable.
ONNX_TRANSLATIONS: dict[Callable[..., Any], Callable[..., Any]] = {
    torch.ops.specx.tree_attention.default: _translate
}
