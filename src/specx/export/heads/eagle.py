"""EAGLE-1/2 head (SafeAILab/EAGLE `cnets1.py`).

h = fc([embed(tok), feature]), one decoder layer without input norm, logits from the
TARGET's lm_head. The feature is the target's final post-norm hidden state on the first
step, the head's own output afterwards.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specx.errors import CheckpointError
from specx.export.config import TargetConfig
from specx.export.decoder import DecoderLayer, RotaryEmbedding
from specx.export.heads.weights import check_state_dict, head_attention_config, read_head

__all__ = ["EagleHead", "load_eagle"]

WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "model.pt")


class EagleHead(nn.Module):
    """EAGLE-1/2 draft head."""

    kind = "eagle"
    taps = "last"

    def __init__(self, config: TargetConfig, fc_bias: bool):
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.fc = nn.Linear(2 * d, d, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(config, input_norm=False)])
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids, features, position_ids, attention_mask, write_pos, kv_cache):
        """(logits [B, N, V], hidden [B, N, d], key, value)."""
        cos, sin = self.rotary(position_ids)
        h = self.fc(torch.cat([self.embed_tokens(input_ids), features], dim=-1))
        h, k_cache, v_cache = self.layers[0](
            h, cos, sin, kv_cache[0], kv_cache[1], write_pos, attention_mask
        )
        return self.lm_head(h), h, k_cache, v_cache


def load_eagle(directory: str | Path, target: TargetConfig, target_weights) -> EagleHead:
    """Loads an EAGLE-1/2 head; embeddings and lm_head come from the target.

    Raises:
        CheckpointError: missing or mis-shaped keys, more than one layer, or a hidden
            size different from the target's.
    """
    ckpt = read_head(directory, WEIGHT_NAMES)
    where = ckpt.directory / "config.json"
    config = head_attention_config(ckpt.config, target, where)
    if config.hidden_size != target.hidden_size:
        raise CheckpointError(
            f"{where}: hidden_size {config.hidden_size} differs from the target's "
            f"{target.hidden_size}"
        )
    if ckpt.config.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"{where}: only one-layer EAGLE heads are supported")
    tensors, origin = dict(ckpt.tensors), dict(ckpt.origin)
    for key, source in (
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ):
        if key not in tensors:
            tensors[key], origin[key] = target_weights[source], Path("<target>")
    with torch.device("meta"):
        head = EagleHead(config, fc_bias=bool(ckpt.config.get("bias", True)))
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    head.load_state_dict(check_state_dict("eagle", expected, tensors, origin), assign=True)
    head.rotary = RotaryEmbedding(config)
    return head.eval()
