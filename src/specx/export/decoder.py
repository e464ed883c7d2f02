"""`TargetDecoder`: the exported form of a Llama-family decoder, with tree attention.

Parameter names mirror Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, ...),
so an HF state dict loads as is. The forward takes the graph contract directly:

    input_ids       [B, N] int64   new tokens (a chain or the flattened nodes of a tree)
    position_ids    [B, N] int64   prefix length + depth in the tree
    attention_mask  [B, 1, N, L]   bool, True where token i may see cache slot j (L <= CAP)
    write_pos       [B] int64      cache slot of the first new token
    kv_cache        2 * layers x [B, Hkv, CAP, D], key then value per layer

and returns `logits [B, N, V]`, the hidden-state taps `[B, N, k*d]` when the decoder was
built with taps, and the updated caches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specx.errors import ExportError
from specx.export.config import TargetConfig
from specx.export.tree_attention_op import tree_attention, tree_attention_reference

__all__ = [
    "MLP",
    "TAP_KINDS",
    "Attention",
    "DecoderLayer",
    "RMSNorm",
    "RotaryEmbedding",
    "TargetDecoder",
    "tap_layers",
]

TAP_KINDS = ("none", "last", "eagle3")


def tap_layers(kind: str, num_layers: int, layers: Sequence[int] | None = None) -> tuple[int, ...]:
    """The layers whose INPUT hidden states a tap kind captures; () for none and last.

    `eagle3` = the states entering layers 2, N//2 and N-3 (HF `hidden_states[2]`,
    `[N//2]`, `[N-3]`), pre final norm, concatenated in that order; or the three `layers`
    a head names (vLLM's `eagle_aux_hidden_state_layer_ids`), each in [1, N], where N is
    the last layer's output before the final norm (HF `hidden_states[N]` is after it).
    On a shallow target EAGLE-3's defaults coincide (2, 2, 2 for 5 layers) and miss the
    last layers, which is what a head's own taps are for.
    """
    if kind not in TAP_KINDS:
        raise ExportError(f"unknown taps {kind!r}; choose one of {', '.join(TAP_KINDS)}")
    if kind != "eagle3":
        return ()
    if layers is not None:
        if len(layers) != 3 or not all(1 <= t <= num_layers for t in layers):
            raise ExportError(
                f"EAGLE-3 taps {list(layers)} must be three layers in [1, {num_layers}] (the "
                f"states entering them; {num_layers} = the last layer's output)"
            )
        return tuple(layers)
    defaults = (2, num_layers // 2, num_layers - 3)
    if num_layers < 3 or min(defaults) < 0:
        raise ExportError(f"--taps eagle3 needs at least 3 layers; the target has {num_layers}")
    return defaults


class RMSNorm(nn.Module):
    """RMS norm with a learned scale (exported as RMSNormalization).

    The scale is the weight as loaded: Gemma's stored w comes as 1 + w (`specx.export.
    checkpoint`), so the graph holds the scale itself and adds nothing per step.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(config: TargetConfig, dim: int | None = None) -> RMSNorm:
    return RMSNorm(dim or config.hidden_size, config.rms_norm_eps)


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's position; positions come from the tree, not from arange."""

    inv_freq: torch.Tensor  # a buffer (register_buffer), typed for Module's __getattr__

    def __init__(self, config: TargetConfig, inv_freq: tuple[float, ...] | None = None):
        super().__init__()
        table = torch.tensor(inv_freq or config.inv_freq)
        self.register_buffer("inv_freq", table, persistent=False)
        self.scaling = config.rope_attention_scaling

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, N, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * self.scaling, angles.sin() * self.scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:  # partial rotary: the first dims turn, the rest pass
        turned, passed = x[..., :rotary], x[..., rotary:]
        return torch.cat((turned * cos + _rotate_half(turned) * sin, passed), dim=-1)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Self-attention through one TreeAttention op; `input_size` defaults to hidden_size.

    `rope=False`: q and k are not rotated (SmolLM3's NoPE layers).
    """

    def __init__(self, config: TargetConfig, input_size: int | None = None, rope: bool = True):
        super().__init__()
        self.config, self.rope = config, rope
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        d, d_in = config.hidden_size, input_size or config.hidden_size
        self.q_proj = nn.Linear(d_in, heads * head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d_in, kv_heads * head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d_in, kv_heads * head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm, self.k_norm = _norm(config, head_dim), _norm(config, head_dim)

    def forward(self, x, cos, sin, k_cache, v_cache, write_pos, mask):  # noqa: D102
        c = self.config
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(batch, n, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(batch, n, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.rope:
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        # Training needs gradients, which the exportable custom op does not define.
        attend = tree_attention_reference if self.training else tree_attention
        out, k_cache, v_cache = attend(
            q,
            k,
            v.transpose(1, 2),
            k_cache,
            v_cache,
            write_pos,
            mask,
            c.num_heads,
            c.num_kv_heads,
            c.attention_scale,
            c.attn_softcap,
        )
        out = out.transpose(1, 2).reshape(batch, n, c.num_heads * c.head_dim)
        return self.o_proj(out), k_cache, v_cache


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (tanh GELU, Gemma)."""

    def __init__(self, config: TargetConfig):
        super().__init__()
        d, hidden, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, hidden, bias=bias)
        self.up_proj = nn.Linear(d, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d, bias=bias)
        self.act = _ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; EAGLE-1's first layer has no input norm (`input_norm=False`).

    With `config.sandwich_norms` (Gemma) the attention and MLP outputs are normed too before
    they join the residual; `post_attention_layernorm` is then the attention output's norm
    and `pre_feedforward_layernorm` the MLP input's (HF's names for both layouts).
    """

    def __init__(self, config: TargetConfig, input_norm: bool = True, rope: bool = True):
        super().__init__()
        self.sandwich = config.sandwich_norms
        self.input_layernorm = _norm(config) if input_norm else nn.Identity()
        self.self_attn = Attention(config, rope=rope)
        self.post_attention_layernorm = _norm(config)
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(config)
            self.post_feedforward_layernorm = _norm(config)
        self.mlp = MLP(config)

    def forward(self, h, cos, sin, k_cache, v_cache, write_pos, mask):  # noqa: D102
        attn, k_cache, v_cache = self.self_attn(
            self.input_layernorm(h), cos, sin, k_cache, v_cache, write_pos, mask
        )
        if self.sandwich:
            h = h + self.post_attention_layernorm(attn)
            h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        else:
            h = h + attn
            h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k_cache, v_cache


class _Backbone(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rope=config.uses_rope(i)) for i in range(config.num_layers)
        )
        self.norm = _norm(config)


def _window(mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """The mask of a sliding-window layer: slot j only within `window` of the query's position.

    The window is a second mask, computed once per step and given to those layers'
    TreeAttention, so the op, its ONNX body, the Triton kernel, the TensorRT plugin and the ORT
    lowering need nothing of their own. Slot j holds position j: the cache is compacted after
    every round, and a chain's tokens (prefill, decode, chain drafts) sit at their positions.
    A tree node sits at a slot past its position, which only its descendants see, all within
    the tree's depth of it; so the rule is exact while a tree is shallower than the window
    (`specx.export.target_export` refuses --max-tree-tokens beyond the window).
    """
    slots = torch.arange(mask.shape[-1], device=mask.device)  # [L]
    near = position_ids[:, :, None] - slots[None, None, :] < window  # [B, N, L]
    return mask & near[:, None]


class TargetDecoder(nn.Module):
    """A supported HF decoder whose attention is one `specx::tree_attention` per layer."""

    def __init__(
        self, config: TargetConfig, taps: str = "none", layers: Sequence[int] | None = None
    ):
        super().__init__()
        self.config = config
        self.taps = taps
        self.tap_layers = tap_layers(taps, config.num_layers, layers)
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.compute_rope_tables()

    def compute_rope_tables(self) -> None:
        """RoPE's frequencies, from the config (not weights: after a meta-device build)."""
        self.rotary = RotaryEmbedding(self.config)
        local = self.config.local_inv_freq
        self.local_rotary = RotaryEmbedding(self.config, local) if local else None

    @classmethod
    def from_state_dict(
        cls,
        config: TargetConfig,
        state_dict: Mapping[str, torch.Tensor],
        taps: str = "none",
        layers: Sequence[int] | None = None,
    ) -> TargetDecoder:
        """Builds the decoder around checked HF weights without a second copy of them."""
        with torch.device("meta"):
            decoder = cls(config, taps, layers)
        decoder.load_state_dict(state_dict, strict=True, assign=True)
        decoder.compute_rope_tables()
        return decoder.eval()

    @staticmethod
    def parameter_shapes(config: TargetConfig) -> dict[str, tuple[int, ...]]:
        """The HF key -> shape every checkpoint of this config must provide."""
        with torch.device("meta"):
            decoder = TargetDecoder(config)
        return {name: tuple(t.shape) for name, t in decoder.state_dict().items()}

    @staticmethod
    def parameter_count(config: TargetConfig) -> int:
        """Parameters as the checkpoint holds them: a tied lm_head is the embedding, once."""
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        shapes = TargetDecoder.parameter_shapes(config)
        return sum(math.prod(shape) for name, shape in shapes.items() if name not in tied)

    @property
    def tap_width(self) -> int:
        """Width of the taps output: d for `last`, 3d for `eagle3`, 0 for none."""
        d = self.config.hidden_size
        return {"none": 0, "last": d, "eagle3": d * len(self.tap_layers)}[self.taps]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        write_pos: torch.Tensor,
        kv_cache: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        """Returns (logits, [taps,] key_0, value_0, key_1, ...) per the module docstring."""
        c = self.config
        rope = self.rotary(position_ids)
        # local_rotary exists exactly when the config has local_inv_freq
        local_rope = self.local_rotary(position_ids) if self.local_rotary is not None else rope
        h = self.model.embed_tokens(input_ids)
        if c.embedding_scale != 1.0:
            h = h * c.embedding_scale
        windowed, window = c.windowed_layers, c.sliding_window  # windowed: () without a window
        local_mask = (
            _window(attention_mask, position_ids, window)
            if window is not None and any(windowed)
            else None
        )
        captured: dict[int, torch.Tensor] = {}
        new_cache: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            if i in self.tap_layers:
                captured[i] = h
            cos, sin = local_rope if c.uses_local_rope(i) else rope
            mask = local_mask if windowed and windowed[i] else attention_mask
            h, k_cache, v_cache = layer(
                h, cos, sin, kv_cache[2 * i], kv_cache[2 * i + 1], write_pos, mask
            )
            new_cache += [k_cache, v_cache]
        captured[len(self.model.layers)] = h
        h = self.model.norm(h)
        logits = self.lm_head(h)
        if c.logit_softcap:  # Gemma 2: the logits transformers returns are capped
            logits = torch.tanh(logits / c.logit_softcap) * c.logit_softcap
        if self.taps == "last":
            return logits, h, *new_cache
        if self.taps == "eagle3":
            return logits, torch.cat([captured[i] for i in self.tap_layers], dim=-1), *new_cache
        return logits, *new_cache
