"""`TargetConfig`: the architecture of a supported HF decoder, read from `config.json`.

Supported families are Llama, Qwen2, Qwen3 (per-head q/k RMSNorm), Mistral, SmolLM3
(layers without RoPE, `no_rope_layers`), Phi-3 (fused `qkv_proj`/`gate_up_proj`, read as
q/k/v and gate/up by `specx.export.checkpoint`; `longrope`), Gemma 2 and Gemma 3 text
(`gemma2`, `gemma3_text`: RMSNorm scaled by 1 + w, norms before and after attention and MLP,
GeGLU with tanh GELU, embeddings times sqrt(hidden), softmax scale `query_pre_attn_scalar`^-1/2;
Gemma 2 caps attention scores and final logits at c * tanh(x / c), Gemma 3 has q/k norms and a
RoPE table of its own for the sliding-window layers): one decoder shape (RoPE, grouped-query
attention, gated MLP) that differs in biases, norms, activation, head size and which layers
rotate how. Everything else is refused here, by name, before any weight is read.

Sliding windows: Mistral's (every layer) and Gemma's (their local layers) are a second mask
(`specx.export.decoder`); other families' (Qwen2/Qwen3/SmolLM3 `use_sliding_window`) are refused
past the window (`specx.export.target_export`).

`longrope` (Phi-3 long-context checkpoints) is a fixed table only up to the checkpoint's
`original_max_position_embeddings`: transformers rotates with the short factors while a
sequence is no longer than that and switches to the long ones for every new token past it,
mid-sequence, which no fixed graph reproduces. So a longrope export uses the short factors
(and the checkpoint's attention factor) and is refused beyond that context
(`rope_max_context`); within it the output is transformers' exactly.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specx.errors import CheckpointError

__all__ = ["SUPPORTED_FAMILIES", "TargetConfig", "load_target_config"]

SUPPORTED_FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "smollm3",
    "phi3",
    "gemma2",
    "gemma3_text",
)
_GEMMA = ("gemma2", "gemma3_text")
# model_type -> why it is refused (families users try that share a name with a supported one).
_REFUSED = {
    "gemma3": "Gemma 3 with its vision tower (Gemma3ForConditionalGeneration); export the text "
    "model (model_type gemma3_text, Gemma3ForCausalLM)",
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Rope types whose frequencies do not depend on the sequence length, so one graph serves all.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class TargetConfig:
    """The shapes and options of one supported decoder-only target."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    inv_freq: tuple[float, ...]  # RoPE inverse frequencies, rotary dims // 2 of them
    rope_attention_scaling: float
    sliding_window: int | None
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_layers: tuple[bool, ...] = ()  # per layer: applies RoPE (SmolLM3); () = every layer
    rope_max_context: int | None = None  # longest context the RoPE tables are exact for
    activation: str = "silu"  # the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU)
    norm_offset: float = 0.0  # RMSNorm scale = offset + stored weight (Gemma: 1 + w; on load)
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma)
    embedding_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # softmax scale = this^-1/2 (Gemma)
    local_inv_freq: tuple[float, ...] = ()  # RoPE of the sliding-window layers, if their own
    local_layers: tuple[bool, ...] = ()  # per layer: a sliding-window layer (Gemma)
    attn_softcap: float = 0.0  # attention scores capped at c * tanh(s / c); 0: none (Gemma 2)
    logit_softcap: float = 0.0  # final logits capped the same way; 0: none (Gemma 2)

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates q and k (SmolLM3's NoPE layers do not)."""
        return not self.rope_layers or self.rope_layers[layer]

    def llama_layers(self) -> TargetConfig:
        """These sizes with Llama's layer form (draft heads' layers, whatever the target's)."""
        return dataclasses.replace(
            self,
            qk_norm=False,
            activation="silu",
            norm_offset=0.0,
            sandwich_norms=False,
            embedding_scale=1.0,
            query_pre_attn_scalar=None,
            local_inv_freq=(),
            local_layers=(),
            attn_softcap=0.0,
            logit_softcap=0.0,
        )

    @property
    def windowed_layers(self) -> tuple[bool, ...]:
        """Per layer: attends through `sliding_window`; () for none.

        specx implements Mistral's (every layer) and Gemma's (their local layers); other
        families' windows are refused past the window.
        """
        if self.sliding_window is None or self.family not in ("mistral", *_GEMMA):
            return ()
        return self.local_layers or (True,) * self.num_layers

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates with the sliding-window layers' table (Gemma 3)."""
        return bool(self.local_inv_freq) and self.local_layers[layer]

    @property
    def attention_scale(self) -> float:
        """Softmax scale of q.k: 1/sqrt(head_dim), or Gemma's 1/sqrt(query_pre_attn_scalar)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def load_target_config(checkpoint_dir: str | Path) -> tuple[TargetConfig, dict[str, Any]]:
    """Reads `config.json` (and `generation_config.json` if present) of an HF checkpoint.

    Returns:
        The parsed config and the raw `config.json` dictionary.

    Raises:
        CheckpointError: the file is missing or invalid, or the architecture, activation,
            rope type or attention variant is not supported (the message names which).
    """
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{checkpoint_dir} is not an HF checkpoint: config.json is missing")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path} is not valid JSON: {e}") from e
    family = raw.get("model_type")
    if family in _REFUSED:
        raise CheckpointError(
            f"{config_path}: model_type {family!r}: {_REFUSED[family]} is not supported"
        )
    if family not in SUPPORTED_FAMILIES:
        raise CheckpointError(
            f"{config_path}: model_type {family!r} (architectures {raw.get('architectures')}) "
            f"is not supported; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    hf = _hf_config(config_path, family)
    gemma = family in _GEMMA
    act_field = "hidden_activation" if gemma else "hidden_act"
    activation = getattr(hf, act_field, None)
    if activation not in _ACTIVATIONS:
        raise CheckpointError(f"{config_path}: {act_field} {activation!r} is not supported")
    softcaps = _softcaps(config_path, hf, family)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope_params = hf.rope_parameters or {}
    if family == "gemma3_text":
        rope_params = rope_params.get("full_attention", {})
    inv_freq, attention_scaling, rope_max_context = _rope(config_path, hf, head_dim, rope_params)
    attention_bias = bool(getattr(hf, "attention_bias", False))
    qkv_bias = {"qwen2": True, "mistral": False}.get(family, attention_bias)
    o_bias = {"qwen2": False, "mistral": False}.get(family, attention_bias)
    config = TargetConfig(
        family=family,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=family in ("qwen3", "gemma3_text"),
        inv_freq=inv_freq,
        rope_attention_scaling=attention_scaling,
        sliding_window=_sliding_window(hf, family),
        max_position_embeddings=hf.max_position_embeddings,
        bos_token_id=hf.bos_token_id,
        eos_token_ids=_eos_token_ids(checkpoint_dir, hf.eos_token_id),
        rope_layers=_rope_layers(config_path, hf, family),
        rope_max_context=rope_max_context,
        activation=_ACTIVATIONS[activation],
        **softcaps,
        **(_gemma(config_path, hf, head_dim, attention_scaling) if gemma else {}),
    )
    if config.num_heads % config.num_kv_heads:
        raise CheckpointError(
            f"{config_path}: num_attention_heads {config.num_heads} is not a multiple of "
            f"num_key_value_heads {config.num_kv_heads}"
        )
    return config, raw


def _hf_config(config_path: Path, family: str):
    # transformers' config classes normalise legacy fields (rope_scaling -> rope_parameters).
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(config_path.parent, trust_remote_code=False)
    except Exception as e:  # transformers' validators raise classes of their own too
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{config_path}: not a valid {family} config: {e}") from e


def _softcaps(config_path: Path, hf, family: str) -> dict[str, Any]:
    """Gemma 2's attention and final-logit caps (absent or null: none); refused elsewhere."""
    caps: dict[str, Any] = {}  # fields of TargetConfig, floats
    for field, name in (
        ("attn_logit_softcapping", "attn_softcap"),
        ("final_logit_softcapping", "logit_softcap"),
    ):
        value = getattr(hf, field, None)
        if value is None:
            continue
        if family != "gemma2":
            raise CheckpointError(f"{config_path}: {field} {value} is not supported for {family}")
        if not (isinstance(value, int | float) and value > 0):
            raise CheckpointError(
                f"{config_path}: {field} must be a positive number, got {value!r}"
            )
        caps[name] = float(value)
    return caps


def _gemma(config_path: Path, hf, head_dim: int, attention_scaling: float) -> dict[str, Any]:
    """Gemma's fields of TargetConfig; Gemma 3's local layers' RoPE table from their params."""
    layer_types = list(hf.layer_types or [])
    kinds = ("sliding_attention", "full_attention")
    if len(layer_types) != hf.num_hidden_layers or any(t not in kinds for t in layer_types):
        raise CheckpointError(
            f"{config_path}: layer_types must name {kinds[0]!r} or {kinds[1]!r} for each of "
            f"the {hf.num_hidden_layers} layers, got {layer_types}"
        )
    fields = {
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embedding_scale": hf.hidden_size**0.5,
        "query_pre_attn_scalar": float(hf.query_pre_attn_scalar),
        "local_layers": tuple(t == "sliding_attention" for t in layer_types),
    }
    if "sliding_attention" not in hf.rope_parameters:
        return fields  # Gemma 2: one RoPE table for every layer
    local = hf.rope_parameters["sliding_attention"]
    local_inv_freq, local_scaling, _ = _rope(config_path, hf, head_dim, local, "sliding_attention")
    if local_scaling != attention_scaling:
        raise CheckpointError(
            f"{config_path}: rope_parameters give the sliding and full layers different "
            f"attention scalings ({local_scaling}, {attention_scaling}); not supported"
        )
    return fields | {"local_inv_freq": local_inv_freq}


def _rope(
    config_path: Path, hf, head_dim: int, params: Mapping[str, Any], layer_type: str | None = None
) -> tuple[tuple[float, ...], float, int | None]:
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = params.get("rope_type", "default")
    # Partial rotary (Phi-4-mini: 0.75): the first head_dim * factor dims of each head turn,
    # the rest pass; transformers' init functions size inv_freq by the factor themselves.
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise CheckpointError(
            f"{config_path}: partial_rotary_factor {factor} gives {rotary_dim} rotary dims of "
            f"{head_dim}; it must be an even number in 2..{head_dim}"
        )
    if rope_type == "longrope":  # the short factors: see the module docstring
        inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")  # seq_len None: short
        original = getattr(hf, "original_max_position_embeddings", None) or params.get(
            "original_max_position_embeddings", hf.max_position_embeddings
        )
        return tuple(float(f) for f in inv_freq), float(scaling), int(original)
    if rope_type not in _STATIC_ROPE_TYPES:
        raise CheckpointError(
            f"{config_path}: rope type {rope_type!r} depends on the sequence length and is not "
            f"supported; supported: {', '.join(_STATIC_ROPE_TYPES)}, and longrope up to "
            "original_max_position_embeddings"
        )
    if rope_type == "default":
        theta = params["rope_theta"]
        dims = torch.arange(0, rotary_dim, 2, dtype=torch.float)
        inv_freq = 1.0 / (theta ** (dims / rotary_dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", layer_type=layer_type)
    return tuple(float(f) for f in inv_freq), float(scaling), None


def _rope_layers(config_path: Path, hf, family: str) -> tuple[bool, ...]:
    if family != "smollm3":
        return ()
    flags = list(getattr(hf, "no_rope_layers", None) or [])
    if len(flags) != hf.num_hidden_layers or any(f not in (0, 1) for f in flags):
        raise CheckpointError(
            f"{config_path}: no_rope_layers must hold a 0 or 1 for each of the "
            f"{hf.num_hidden_layers} layers, got {flags}"
        )
    return tuple(bool(f) for f in flags)  # 1: the layer applies RoPE


def _sliding_window(hf, family: str) -> int | None:
    window = getattr(hf, "sliding_window", None)
    if family in ("qwen2", "qwen3", "smollm3") and not getattr(hf, "use_sliding_window", False):
        return None
    return int(window) if window else None


def _eos_token_ids(checkpoint_dir: Path, config_eos: int | list[int] | None) -> tuple[int, ...]:
    eos = config_eos
    generation_path = checkpoint_dir / "generation_config.json"
    if generation_path.is_file():
        try:
            eos = json.loads(generation_path.read_text(encoding="utf-8")).get("eos_token_id", eos)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{generation_path} is not valid JSON: {e}") from e
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
