"""Tiny random draft heads written in each public checkpoint layout (no specx code involved)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

G = torch.Generator().manual_seed(0)


def _rand(*shape, scale=0.1):
    return torch.randn(*shape, generator=G) * scale


def _norm(d):
    return 1.0 + _rand(d)


def _layer(prefix, d, heads, kv_heads, head_dim, inter, d_in=None, input_norm=True):
    d_in = d_in or d
    t = {
        f"{prefix}self_attn.q_proj.weight": _rand(heads * head_dim, d_in),
        f"{prefix}self_attn.k_proj.weight": _rand(kv_heads * head_dim, d_in),
        f"{prefix}self_attn.v_proj.weight": _rand(kv_heads * head_dim, d_in),
        f"{prefix}self_attn.o_proj.weight": _rand(d, heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": _rand(inter, d),
        f"{prefix}mlp.up_proj.weight": _rand(inter, d),
        f"{prefix}mlp.down_proj.weight": _rand(d, inter),
        f"{prefix}post_attention_layernorm.weight": _norm(d),
    }
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = _norm(d)
    return t


def llama_config(target: dict, **extra) -> dict:
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "rms_norm_eps",
        "max_position_embeddings",
    )
    config = {k: target[k] for k in keys}
    rope = target.get("rope_parameters") or {"rope_theta": target.get("rope_theta", 10000.0)}
    config.update(model_type="llama", num_hidden_layers=1, rope_theta=rope["rope_theta"], **extra)
    return config


def write_eagle3(
    directory: Path, target: dict, draft_vocab: int, layout: str = "official", seed: int = 0
) -> Path:
    """EAGLE-3 head: `midlayer.*` + d2t/t2d (official) or `layers.0.*` + eagle_config (ModelOpt)."""
    G.manual_seed(seed)
    d, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim, inter = d // heads, target["intermediate_size"]
    prefix = "midlayer." if layout == "official" else "layers.0."
    tensors = {
        "fc.weight": _rand(d, 3 * d),
        "norm.weight": _norm(d),
        "lm_head.weight": _rand(draft_vocab, d, scale=1.0),
        f"{prefix}hidden_norm.weight": _norm(d),
        **_layer(prefix, d, heads, kv, head_dim, inter, d_in=2 * d),
    }
    ids = torch.sort(torch.randperm(vocab, generator=G)[:draft_vocab]).values
    tensors["d2t"] = ids - torch.arange(draft_vocab)
    config = llama_config(
        target, draft_vocab_size=draft_vocab, architectures=["LlamaForCausalLMEagle3"]
    )
    if layout == "official":
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    else:
        n = target["num_hidden_layers"]
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [1, n // 2 - 1, n - 4],
            "use_aux_hidden_state": True,
        }
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "model.safetensors")
    return directory


def write_eagle(directory: Path, target: dict, bias: bool = True, as_bin: bool = False) -> Path:
    """EAGLE-1/2 head: `fc` on [embedding, feature], `layers.0.*` without input_layernorm."""
    d = target["hidden_size"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    tensors = {
        "fc.weight": _rand(d, 2 * d),
        **_layer(
            "layers.0.", d, heads, kv, d // heads, target["intermediate_size"], input_norm=False
        ),
    }
    if bias:
        tensors["fc.bias"] = _rand(d)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(llama_config(target, bias=bias)))
    if as_bin:
        torch.save(tensors, directory / "pytorch_model.bin")
    else:
        save_file(tensors, directory / "model.safetensors")
    return directory


def write_medusa(
    directory: Path, target: dict, num_heads: int = 3, num_layers: int = 1, as_pt: bool = False
) -> Path:
    """Medusa: `medusa_lm_head.{safetensors,pt}` with `{h}.{l}.linear.*` and `{h}.{L}.weight`."""
    d, vocab = target["hidden_size"], target["vocab_size"]
    tensors = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            tensors[f"{h}.{layer}.linear.weight"] = _rand(d, d)
            tensors[f"{h}.{layer}.linear.bias"] = _rand(d)
        tensors[f"{h}.{num_layers}.weight"] = _rand(vocab, d, scale=1.0)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(
        json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers})
    )
    if as_pt:
        torch.save(tensors, directory / "medusa_lm_head.pt")
    else:
        save_file(tensors, directory / "medusa_lm_head.safetensors")
    return directory


def mtp_tensors(layout: str, target: dict) -> dict[str, torch.Tensor]:
    """The MTP module's tensors in one public layout."""
    d, vocab, n = target["hidden_size"], target["vocab_size"], target["num_hidden_layers"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    if layout == "deepseek":
        p = f"model.layers.{n}."
        names = {
            "enorm": p + "enorm",
            "hnorm": p + "hnorm",
            "proj": p + "eh_proj",
            "norm": p + "shared_head.norm",
        }
        extra = {
            p + "shared_head.head.weight": _rand(vocab, d, scale=1.0),
            p + "embed_tokens.weight": _rand(vocab, d, scale=1.0),
        }
        layer_prefix = p
    elif layout == "qwen3_next":
        names = {
            "enorm": "mtp.pre_fc_norm_embedding",
            "hnorm": "mtp.pre_fc_norm_hidden",
            "proj": "mtp.fc",
            "norm": "mtp.norm",
        }
        extra, layer_prefix = {}, "mtp.layers.0."
    else:
        p = "model.mtp_layers.0."
        names = {
            "enorm": p + "token_layernorm",
            "hnorm": p + "hidden_layernorm",
            "proj": p + "input_proj",
            "norm": p + "final_layernorm",
        }
        extra, layer_prefix = {}, p
    tensors = {
        names["enorm"] + ".weight": _norm(d),
        names["hnorm"] + ".weight": _norm(d),
        names["proj"] + ".weight": _rand(d, 2 * d),
        names["norm"] + ".weight": _norm(d),
        **extra,
        **_layer(layer_prefix, d, heads, kv, d // heads, target["intermediate_size"]),
    }
    return tensors
