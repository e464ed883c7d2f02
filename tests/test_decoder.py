"""The torch decoder specx exports equals transformers on the same checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import FAMILIES
from specx.export.checkpoint import load_checkpoint
from specx.export.decoder import TargetDecoder
from specx.masks import causal_mask


def run_decoder(decoder, ids):
    batch, n = ids.shape
    c = decoder.config
    cache = [torch.zeros(batch, c.num_kv_heads, n, c.head_dim) for _ in range(2 * c.num_layers)]
    zeros = torch.zeros(batch, dtype=torch.int64)
    mask = torch.from_numpy(causal_mask(np.zeros(batch), n, n))
    with torch.no_grad():
        return decoder(ids, torch.arange(n).repeat(batch, 1), mask, zeros, cache)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("taps", ["last", "eagle3"])
def test_decoder_matches_transformers(family, taps, checkpoints, hf_models):
    checkpoint = load_checkpoint(checkpoints[family])
    decoder = TargetDecoder.from_state_dict(checkpoint.config, checkpoint.state_dict, taps)
    ids = torch.randint(
        0, checkpoint.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    logits, tapped = run_decoder(decoder, ids)[:2]
    with torch.no_grad():
        hf = hf_models[family](ids, output_hidden_states=True)
    torch.testing.assert_close(logits, hf.logits, atol=1e-4, rtol=1e-4)
    states = hf.hidden_states
    n = checkpoint.config.num_layers
    if taps == "last":
        expected = states[-1]  # HF's last hidden state is after the final norm
    else:
        expected = torch.cat([states[2], states[n // 2], states[n - 3]], dim=-1)
    torch.testing.assert_close(tapped, expected, atol=1e-4, rtol=1e-4)


def test_half_precision_checkpoints_load_as_fp32(tmp_path):
    from transformers import AutoModelForCausalLM

    from specx.export.random_checkpoint import write_random_checkpoint

    for dtype in ("float16", "bfloat16"):
        path = write_random_checkpoint(
            tmp_path / dtype, "llama", "tiny", dtype=dtype, tokenizer=False
        )
        checkpoint = load_checkpoint(path)
        assert all(t.dtype == torch.float32 for t in checkpoint.state_dict.values())
        decoder = TargetDecoder.from_state_dict(checkpoint.config, checkpoint.state_dict)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        with torch.no_grad():
            torch.testing.assert_close(
                run_decoder(decoder, ids)[0], hf(ids).logits, atol=1e-4, rtol=1e-4
            )
