"""Multi-token-prediction (MTP) head, reused autoregressively as a draft.

`h' = proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)])`, a full decoder layer, then the head's
final norm and output projection. h_i is the target's final post-norm hidden state on the
first step, the MTP layer's own output afterwards. Public layouts, mapped to one module:
- DeepSeek-V3 / GLM-4.5: `model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.{norm,head},
  embed_tokens}` + the layer's weights, N = the target's layer count;
- Qwen3-Next: `mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}`, `mtp.layers.0.*`;
  embeddings and lm_head from the target;
- MiMo: `model.mtp_layers.0.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}`
  + layer weights, concatenated [hidden, embedding] (reversed); target lm_head.
Only dense decoder layers (standard attention + SwiGLU MLP) are supported: DeepSeek's MLA
attention and MoE layers are refused with a clear error.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specx.errors import CheckpointError
from specx.export.checkpoint import load_tensor_file, weight_files
from specx.export.config import TargetConfig
from specx.export.decoder import DecoderLayer, RMSNorm, RotaryEmbedding
from specx.export.heads.weights import check_state_dict

__all__ = ["MTP_LAYOUTS", "MTPHead", "load_mtp"]

_LAYER_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


def _layouts(num_layers: int) -> dict[str, dict]:
    deepseek = f"model.layers.{num_layers}."
    return {
        "deepseek": {
            "names": {
                "enorm": deepseek + "enorm",
                "hnorm": deepseek + "hnorm",
                "proj": deepseek + "eh_proj",
                "norm": deepseek + "shared_head.norm",
                "head": deepseek + "shared_head.head",
                "embed_tokens": deepseek + "embed_tokens",
            },
            "layer": deepseek,
            "hidden_first": False,
        },
        "qwen3_next": {
            "names": {
                "enorm": "mtp.pre_fc_norm_embedding",
                "hnorm": "mtp.pre_fc_norm_hidden",
                "proj": "mtp.fc",
                "norm": "mtp.norm",
            },
            "layer": "mtp.layers.0.",
            "hidden_first": False,
        },
        "mimo": {
            "names": {
                "enorm": "model.mtp_layers.0.token_layernorm",
                "hnorm": "model.mtp_layers.0.hidden_layernorm",
                "proj": "model.mtp_layers.0.input_proj",
                "norm": "model.mtp_layers.0.final_layernorm",
            },
            "layer": "model.mtp_layers.0.",
            "hidden_first": True,
        },
    }


MTP_LAYOUTS = ("deepseek", "qwen3_next", "mimo")


class MTPHead(nn.Module):
    """One MTP module as a draft head: (logits [B, N, V], hidden [B, N, d], key, value)."""

    kind = "mtp"
    taps = "last"

    def __init__(self, config: TargetConfig, hidden_first: bool):
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.hidden_first = hidden_first
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.layer = DecoderLayer(config)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.head = nn.Linear(d, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids, features, position_ids, attention_mask, write_pos, kv_cache):
        """(logits [B, N, V], hidden [B, N, d], key, value)."""
        cos, sin = self.rotary(position_ids)
        parts = [self.enorm(self.embed_tokens(input_ids)), self.hnorm(features)]
        h = self.proj(torch.cat(parts[::-1] if self.hidden_first else parts, dim=-1))
        h, k_cache, v_cache = self.layer(
            h, cos, sin, kv_cache[0], kv_cache[1], write_pos, attention_mask
        )
        return self.head(self.norm(h)), h, k_cache, v_cache


def load_mtp(
    directory: str | Path | None, target: TargetConfig, target_weights, target_dir: Path
) -> MTPHead:
    """Loads the MTP module from the target checkpoint (`directory` None) or from `directory`.

    Raises:
        CheckpointError: no known layout found, MLA/MoE layers, missing or mis-shaped keys.
    """
    source = Path(directory) if directory else target_dir
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in weight_files(source):
        for key, tensor in load_tensor_file(path).items():
            tensors[key], origin[key] = tensor, path
    layouts = _layouts(target.num_layers)
    found = [
        name for name, layout in layouts.items() if layout["names"]["proj"] + ".weight" in tensors
    ]
    if not found:
        keys = ", ".join(f"{layouts[n]['names']['proj']}.weight" for n in MTP_LAYOUTS)
        raise CheckpointError(f"{source}: no MTP weights found (looked for {keys})")
    layout = layouts[found[0]]
    prefix = layout["layer"]
    if any(
        k.startswith(prefix + "mlp.experts") or k.startswith(prefix + "mlp.gate.") for k in tensors
    ):
        raise CheckpointError(
            f"{source}: the {found[0]} MTP layer is MoE; only dense MLPs are supported"
        )
    if any(k.startswith(prefix + "self_attn.kv_a_proj") or "q_a_proj" in k for k in tensors):
        raise CheckpointError(
            f"{source}: the {found[0]} MTP layer uses MLA attention; not supported"
        )
    names = {f"{ours}.weight": f"{theirs}.weight" for ours, theirs in layout["names"].items()}
    names.update(
        {
            f"layer.{k[len(prefix) :]}": k
            for k in tensors
            if k.startswith(prefix) and k[len(prefix) :].startswith(_LAYER_PARTS)
        }
    )
    state, state_origin = {}, {}
    for ours, theirs in names.items():
        if theirs in tensors:
            state[ours], state_origin[ours] = tensors[theirs], origin[theirs]
    for ours, fallback in (
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("head.weight", "lm_head.weight"),
    ):
        if ours not in state:
            state[ours], state_origin[ours] = target_weights[fallback], Path("<target>")
    with torch.device("meta"):
        head = MTPHead(target, layout["hidden_first"])
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    checked = check_state_dict(
        f"mtp ({found[0]} layout)", expected, {k: state[k] for k in state}, state_origin
    )
    head.load_state_dict(checked, strict=True, assign=True)
    head.rotary = RotaryEmbedding(target)
    return head.eval()
