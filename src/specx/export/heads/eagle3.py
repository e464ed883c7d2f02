"""EAGLE-3 head: one decoder layer over [embedding, hidden] with a reduced draft vocabulary.

Formats (SafeAILab/EAGLE `cnets.py`; vLLM/SGLang `llama_eagle3.py`):
- official (also SpecForge/SGLang): `midlayer.*` keys with `d2t`/`t2d`, a LlamaConfig-like
  config.json with `draft_vocab_size`;
- NVIDIA ModelOpt: `layers.0.*` (or `midlayer.*`), an `eagle_config` block whose
  `eagle_aux_hidden_state_layer_ids` name layer OUTPUTS (k - 1 for the state entering k;
  OpenVINO's `hidden_layers_list` too), no `t2d`;
- vllm-project/speculators: config.json with `speculators_model_type: "eagle3"`, the draft
  layer's LlamaConfig in `transformer_layer_config`, `draft_vocab_size`,
  `target_hidden_size` and `eagle_aux_hidden_state_layer_ids` (the states ENTERING those
  layers, vLLM's convention) at the top level, and `layers.0.*` keys (the official keys
  with `midlayer.` -> `layers.0.`; `d2t`/`t2d` only with a reduced vocabulary). Its
  variants that change the layer (`norm_before_residual`, `norm_before_fc`, `fc_norm`,
  `norm_output`) and Qwen3 draft layers are refused by name.
Target id of draft id i is `i + d2t[i]`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specx.errors import CheckpointError, ExportError
from specx.export.config import TargetConfig
from specx.export.decoder import MLP, Attention, RMSNorm, RotaryEmbedding, tap_layers
from specx.export.heads.weights import check_state_dict, head_attention_config, read_head

__all__ = ["Eagle3Head", "load_eagle3"]

WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "model.pt")


class Eagle3Layer(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.self_attn = Attention(config, input_size=2 * d)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.mlp = MLP(config)


class Eagle3Head(nn.Module):
    """EAGLE-3 draft head.

    h = fc(taps) on the first step (the draft's own pre-norm output later);
    a = [input_layernorm(embed(tok)), hidden_norm(h)]; h += attn(a); h += mlp(norm(h));
    logits = lm_head(norm(h)) over the draft vocabulary.
    """

    kind = "eagle3"
    taps = "eagle3"
    d2t: torch.Tensor  # a buffer (register_buffer), typed for Module's __getattr__

    def __init__(self, config: TargetConfig, target_hidden: int, vocab_size: int, draft_vocab: int):
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(vocab_size, d)
        self.fc = nn.Linear(3 * target_hidden, d, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = nn.Linear(d, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.rotary = RotaryEmbedding(config)
        # The states entering these target layers, when the head names its own (None:
        # EAGLE-3's 2, N//2, N-3; `specx.export.decoder.tap_layers`).
        self.tap_layers: tuple[int, ...] | None = None
        # Training only: a fixed per-channel scale of the taps, folded into `fc` before the
        # head is saved (`fold_tap_scale`), so the public format never sees it.
        self.tap_scale: torch.Tensor | None = None

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """Target taps [B, N, 3d] -> first-step features [B, N, d]."""
        return self.fc(taps if self.tap_scale is None else taps * self.tap_scale)

    @torch.no_grad()
    def fold_tap_scale(self) -> None:
        """Folds `tap_scale` into `fc` in place: fc(taps * s) == (W * s)(taps)."""
        if self.tap_scale is not None:
            self.fc.weight.mul_(self.tap_scale)
            self.tap_scale = None

    def forward(self, input_ids, features, position_ids, attention_mask, write_pos, kv_cache):
        """(logits [B, N, draft_vocab], hidden [B, N, d], key, value)."""
        layer = self.midlayer
        cos, sin = self.rotary(position_ids)
        embedded = layer.input_layernorm(self.embed_tokens(input_ids))
        combined = torch.cat([embedded, layer.hidden_norm(features)], dim=-1)
        attn, k_cache, v_cache = layer.self_attn(
            combined, cos, sin, kv_cache[0], kv_cache[1], write_pos, attention_mask
        )
        h = features + attn
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)), h, k_cache, v_cache


def load_eagle3(directory: str | Path, target: TargetConfig, target_weights) -> Eagle3Head:
    """Loads an EAGLE-3 head in the official or ModelOpt layout, checked against the target.

    Raises:
        CheckpointError: missing or mis-shaped keys, hidden size or vocabulary mismatch,
            `d2t` out of range or inconsistent with `t2d`, tap layers outside the target.
    """
    ckpt = read_head(directory, WEIGHT_NAMES)
    where = ckpt.directory / "config.json"
    raw = dict(ckpt.config)
    if "speculators_model_type" in raw:
        raw, layers = _speculators_config(raw, where)
    else:  # ModelOpt / SGLang name layer outputs: the state entering layer i + 1
        layers = (raw.pop("eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        layers = None if layers is None else [i + 1 for i in layers]
    try:
        taps = tap_layers("eagle3", target.num_layers, layers)
    except ExportError as e:
        raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids: {e}") from None
    tensors, origin = dict(ckpt.tensors), dict(ckpt.origin)
    if any(k.startswith("layers.1.") for k in tensors):
        raise CheckpointError(
            f"{ckpt.directory}: more than one draft layer (layers.1.*): only one-layer "
            "EAGLE-3 heads load"
        )
    for key in [k for k in tensors if k.startswith("layers.0.")]:  # ModelOpt, speculators
        new = "midlayer." + key[len("layers.0.") :]
        tensors[new], origin[new] = tensors.pop(key), origin.pop(key)
    config = head_attention_config(raw, target, where)
    vocab = raw.get("vocab_size", target.vocab_size)
    if vocab != target.vocab_size:
        raise CheckpointError(
            f"{where}: vocab_size {vocab} differs from the target's {target.vocab_size}"
        )
    draft_vocab = raw.get("draft_vocab_size", vocab)
    target_hidden = raw.get("target_hidden_size") or target.hidden_size
    if target_hidden != target.hidden_size:
        raise CheckpointError(
            f"{where}: target_hidden_size {target_hidden} != the target's {target.hidden_size}"
        )
    if "embed_tokens.weight" not in tensors:
        if config.hidden_size != target.hidden_size:
            raise CheckpointError(
                f"{where}: head hidden_size {config.hidden_size} differs from the target's "
                f"{target.hidden_size} and the head has no embed_tokens of its own"
            )
        tensors["embed_tokens.weight"] = target_weights["model.embed_tokens.weight"]
        origin["embed_tokens.weight"] = Path("<target>")
    d2t = _d2t(tensors, origin, draft_vocab, vocab)
    with torch.device("meta"):
        head = Eagle3Head(config, target_hidden, vocab, draft_vocab)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items() if k != "d2t"}
    state = check_state_dict("eagle3", expected, tensors, origin)
    state["d2t"] = d2t
    head.load_state_dict(state, strict=True, assign=True)
    head.rotary = RotaryEmbedding(config)
    head.tap_layers = taps if layers is not None else None
    return head.eval()


SPECULATORS_VARIANTS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _speculators_config(raw: dict, where: Path) -> tuple[dict, list[int] | None]:
    """A speculators config.json as the official flat config, and its tap layer ids."""
    kind = raw["speculators_model_type"]
    if kind != "eagle3":
        raise CheckpointError(
            f"{where}: speculators_model_type {kind!r} is not an EAGLE-3 head; specx loads "
            "speculators' 'eagle3' checkpoints (its eagle, peagle, dflash, dspark and mtp "
            "types are other drafters)"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError(f"{where}: transformer_layer_config must be an object")
    if layer.get("model_type", "llama") != "llama":
        raise CheckpointError(
            f"{where}: transformer_layer_config.model_type {layer['model_type']!r} is not "
            "supported: specx's EAGLE-3 draft layer is a Llama layer"
        )
    if layer.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(
            f"{where}: transformer_layer_config.num_hidden_layers "
            f"{layer['num_hidden_layers']}: only one-layer EAGLE-3 heads load"
        )
    for variant in SPECULATORS_VARIANTS:
        if raw.get(variant):
            raise CheckpointError(
                f"{where}: {variant}: true changes the EAGLE-3 layer and is not supported "
                "(specx's layer is the official one)"
            )
    flat = dict(layer)
    for key in ("draft_vocab_size", "target_hidden_size"):
        if raw.get(key) is not None:
            flat[key] = raw[key]
    return flat, raw.get("eagle_aux_hidden_state_layer_ids")


def _d2t(tensors, origin, draft_vocab: int, vocab: int) -> torch.Tensor:
    if "d2t" not in tensors:
        if draft_vocab != vocab:
            raise CheckpointError(
                f"the eagle3 head has a draft vocabulary of {draft_vocab} < {vocab} but no d2t"
            )
        return torch.zeros(draft_vocab, dtype=torch.int64)
    d2t = tensors["d2t"]
    if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
        raise CheckpointError(
            f"{origin['d2t']}: d2t must be integer [{draft_vocab}], got {d2t.dtype} "
            f"{tuple(d2t.shape)}"
        )
    d2t = d2t.to(torch.int64)
    target_ids = torch.arange(draft_vocab) + d2t
    if target_ids.min() < 0 or target_ids.max() >= vocab:
        bad = int(torch.nonzero((target_ids < 0) | (target_ids >= vocab))[0])
        raise CheckpointError(
            f"{origin['d2t']}: d2t maps draft id {bad} to target id {int(target_ids[bad])}, "
            f"outside [0, {vocab})"
        )
    if len(torch.unique(target_ids)) != draft_vocab:
        raise CheckpointError(
            f"{origin['d2t']}: d2t maps two draft ids to the same target id (i + d2t[i] must be "
            "distinct)"
        )
    if "t2d" in tensors:
        t2d = tensors["t2d"].to(torch.bool)
        if (
            tuple(t2d.shape) != (vocab,)
            or int(t2d.sum()) != draft_vocab
            or not bool(t2d[target_ids].all())
        ):
            raise CheckpointError(
                f"{origin['t2d']}: t2d is inconsistent with d2t (it must be a bool [{vocab}] "
                f"marking exactly the {draft_vocab} target ids i + d2t[i])"
            )
    return d2t
