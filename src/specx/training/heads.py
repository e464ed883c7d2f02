"""New heads to train (initialised from the target) and writers of their public formats.

Embeddings and output projections shared with the target are copied from it and frozen,
as EAGLE, Medusa and DeepSeek's MTP do; everything else starts from torch's default init.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from specx.export.checkpoint import Checkpoint
from specx.export.config import TargetConfig
from specx.export.heads.eagle import EagleHead
from specx.export.heads.eagle3 import Eagle3Head
from specx.export.heads.medusa import MedusaHeads
from specx.export.heads.mtp import MTPHead

__all__ = ["HEAD_KINDS", "new_head", "save_head", "trainable_head"]

HEAD_KINDS = ("eagle3", "eagle", "medusa", "mtp")
# The tensors each head shares with the target: copied from it and never trained.
FROZEN = {
    "eagle3": ("embed_tokens.weight",),
    "eagle": ("embed_tokens.weight", "lm_head.weight"),
    "medusa": (),
    "mtp": ("embed_tokens.weight", "head.weight"),
}


def _freeze_shared(kind: str, head: torch.nn.Module) -> torch.nn.Module:
    """`head` with the tensors it shares with the target (FROZEN) out of training."""
    for name, param in head.named_parameters():
        param.requires_grad_(name not in FROZEN[kind])
    return head


def _one_layer(config: TargetConfig) -> TargetConfig:
    return dataclasses.replace(config.llama_layers(), num_layers=1)


def new_head(
    kind: str,
    config: TargetConfig,
    target: dict[str, torch.Tensor],
    draft_ids: np.ndarray | None = None,
    medusa_heads: int = 4,
    tap_layers: tuple[int, ...] | None = None,
) -> torch.nn.Module:
    """A freshly initialised head of `kind` for the target.

    EAGLE-3: `draft_ids` is its vocabulary, `tap_layers` the states it reads (None: 2, N//2,
    N-3).
    """
    embed, lm_head = target["model.embed_tokens.weight"], target["lm_head.weight"]
    head: torch.nn.Module
    if kind == "eagle3":
        ids = np.arange(config.vocab_size) if draft_ids is None else np.sort(draft_ids)
        head = Eagle3Head(_one_layer(config), config.hidden_size, config.vocab_size, len(ids))
        head.tap_layers = tap_layers
        # Its output meets the target's lm_head, so its final norm starts as the target's
        # (pyref-7m's scale is ~2: from ones, Adam at lr 2e-3 needs ~500 steps to get there).
        head.norm.weight.data.copy_(target["model.norm.weight"])
        head.embed_tokens.weight.data.copy_(embed)
        head.lm_head.weight.data.copy_(lm_head[torch.from_numpy(ids)])
        head.d2t.copy_(torch.from_numpy(ids) - torch.arange(len(ids)))
    elif kind == "eagle":
        head = EagleHead(_one_layer(config), fc_bias=True)
        head.embed_tokens.weight.data.copy_(embed)
        head.lm_head.weight.data.copy_(lm_head)
    elif kind == "medusa":
        head = MedusaHeads(config.hidden_size, config.vocab_size, medusa_heads, 1)
        # torch types ModuleList items as plain Modules; each head is an nn.Sequential.
        for block in head.heads:  # Medusa starts each head as the target's lm_head
            torch.nn.init.zeros_(block[0].linear.weight)  # type: ignore[index]
            block[-1].weight.data.copy_(lm_head)  # type: ignore[index]
    elif kind == "mtp":
        head = MTPHead(_one_layer(config), hidden_first=False)
        head.embed_tokens.weight.data.copy_(embed)
        head.head.weight.data.copy_(lm_head)
        head.norm.weight.data.copy_(target["model.norm.weight"])  # as EAGLE-3's, above
    else:
        raise ValueError(f"unknown head {kind!r}; choose one of {', '.join(HEAD_KINDS)}")
    return _freeze_shared(kind, head)


def trainable_head(kind: str, directory: Path, target: Checkpoint) -> torch.nn.Module:
    """A published head of `kind` to train further, checked against the target.

    fp32, with the tensors it shares with the target frozen as in a new head.

    Raises:
        CheckpointError: the head is malformed or does not fit the target.
    """
    from specx.export.heads import load_head

    head = load_head(f"{kind}:{directory}", target).float()
    return _freeze_shared(kind, head)


def _layer_tensors(layer: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}{k}": v for k, v in layer.state_dict().items()}


_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def _llama_config(config: TargetConfig, target_raw: dict[str, Any], **extra: Any) -> dict:
    rope = {k: target_raw[k] for k in _ROPE_KEYS if target_raw.get(k) is not None}
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        **rope,
        **extra,
    }


def save_head(head: torch.nn.Module, directory: Path, target_raw: dict[str, Any]) -> Path:
    """Writes a head in its public format (what `specx export --drafter KIND:DIR` reads).

    An EAGLE-3 head trained on scaled taps has the scale folded into its `fc` first.

    `target_raw` is the target's config.json (RoPE settings, layer count).
    """
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(head, Eagle3Head):
        head.fold_tap_scale()  # the saved head and this one then read the same raw taps
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    if isinstance(head, Eagle3Head):
        tensors = {k: v for k, v in state.items() if not k.startswith("embed_tokens")}
        t2d = torch.zeros(head.embed_tokens.num_embeddings, dtype=torch.bool)
        t2d[torch.arange(len(head.d2t)) + head.d2t] = True
        tensors["t2d"] = t2d
        config = _llama_config(
            head.config,
            target_raw,
            architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=len(head.d2t),
            target_hidden_size=head.fc.in_features // 3,
        )
        if head.tap_layers is not None:  # ModelOpt / SGLang numbering: layer outputs
            layers = [t - 1 for t in head.tap_layers]
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
        files = {"model.safetensors": tensors}
    elif isinstance(head, EagleHead):
        tensors = {k: v for k, v in state.items() if not k.startswith(("embed_tokens", "lm_head"))}
        config = _llama_config(head.config, target_raw, bias=True)
        files = {"model.safetensors": tensors}
    elif isinstance(head, MedusaHeads):
        tensors = {k.removeprefix("heads."): v for k, v in state.items()}
        depth = len(head.heads[0]) - 1  # type: ignore[arg-type]  # an nn.Sequential, typed Module
        config = {"medusa_num_heads": len(head.heads), "medusa_num_layers": depth}
        files = {"medusa_lm_head.safetensors": tensors}
    elif isinstance(head, MTPHead):  # DeepSeek-V3 layout: model.layers.{N}.*
        p = f"model.layers.{target_raw['num_hidden_layers']}."
        names = {
            "enorm.weight": "enorm.weight",
            "hnorm.weight": "hnorm.weight",
            "proj.weight": "eh_proj.weight",
            "norm.weight": "shared_head.norm.weight",
            "head.weight": "shared_head.head.weight",
            "embed_tokens.weight": "embed_tokens.weight",
        }
        tensors = {p + theirs: state[ours] for ours, theirs in names.items()}
        tensors.update(
            {p + k.removeprefix("layer."): v for k, v in state.items() if k.startswith("layer.")}
        )
        config = {"num_nextn_predict_layers": 1}
        files = {"model.safetensors": tensors}
    else:
        raise TypeError(f"cannot save {type(head).__name__}")
    for name, tensors in files.items():
        save_file(tensors, directory / name, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
