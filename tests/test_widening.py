"""Widening: a wider checkpoint (and wider heads) computing the same function."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_heads_reference import head_tensors, reference

from conftest import HEAD_VOCAB
from specx.graphs.weight_only import quantize_rtn
from specx.training.widening import (
    NarrowShape,
    Widening,
    narrow_tensors,
    twin_tensors,
    widen_checkpoint,
    widen_tensors,
)

# Tiny shapes: 4 query / 2 KV heads widen to 12 / 6 (two queries per KV head, as before).
WIDE = Widening(factor=3, heads=12, kv_heads=6, intermediate=200, seed=1)


def test_widened_checkpoint_has_the_same_logits_and_greedy_output(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    wide_dir = widen_checkpoint(checkpoints["llama"], tmp_path / "wide", WIDE)
    config = json.loads((wide_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"]) == (3 * 64, 12)
    assert config["tie_word_embeddings"] is False
    narrow = AutoModelForCausalLM.from_pretrained(checkpoints["llama"]).eval()
    wide = AutoModelForCausalLM.from_pretrained(wide_dir).eval()
    prompt = torch.tensor([[5, 17, 300, 2, 41, 99, 7]])
    with torch.no_grad():
        torch.testing.assert_close(wide(prompt).logits, narrow(prompt).logits, atol=1e-4, rtol=0)
        greedy = [
            m.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
            for m in (narrow, wide)
        ]
    assert greedy[0].tolist() == greedy[1].tolist()


def _llama_tensors(directory) -> dict[str, np.ndarray]:
    tensors = load_file(directory / "model.safetensors")
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])  # untied
    return tensors


def test_narrowing_inverts_widening(checkpoints, head_target, head_dirs):
    cfg = json.loads((checkpoints["llama"] / "config.json").read_text())
    tensors = _llama_tensors(checkpoints["llama"])
    back = narrow_tensors(
        widen_tensors(tensors, NarrowShape.of(cfg), WIDE), NarrowShape.of(cfg), WIDE
    )
    for name, value in tensors.items():
        np.testing.assert_allclose(back[name], value, atol=1e-6, err_msg=name)
    shape = NarrowShape.of(json.loads((head_target / "config.json").read_text()))
    widening = Widening(factor=3, heads=8, kv_heads=4, intermediate=150)
    for name in ("eagle3", "eagle", "mtp-deepseek"):
        head = {k: v.numpy() for k, v in head_tensors(name, head_dirs, head_target).items()}
        back = narrow_tensors(widen_tensors(head, shape, widening), shape, widening)
        for key, value in head.items():
            np.testing.assert_allclose(back[key], value, atol=1e-6, err_msg=f"{name} {key}")


def _int4(name: str, wide: np.ndarray) -> np.ndarray:
    """What a weight-only int4 build holds for a MatMul weight (HF [out, in]; blocks of 16)."""
    if wide.ndim != 2 or "embed_tokens" in name:
        return wide
    k = wide.shape[1]
    weight = quantize_rtn(np.ascontiguousarray(wide.T), 4, 16, True).dequantize()[:k]
    return np.ascontiguousarray(weight.T)  # safetensors writes a transposed view's raw bytes


def test_a_wide_int4_model_has_a_narrow_twin(checkpoints, tmp_path):
    """Quantizing the wide model's weights per row keeps a narrow model computing the same."""
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    narrow_dir = checkpoints["llama"]
    cfg = json.loads((narrow_dir / "config.json").read_text())
    wide_dir = widen_checkpoint(narrow_dir, tmp_path / "wide", WIDE)
    wide = load_file(wide_dir / "model.safetensors")
    save_file({k: _int4(k, v) for k, v in wide.items()}, wide_dir / "model.safetensors")
    twin = twin_tensors(_llama_tensors(narrow_dir), NarrowShape.of(cfg), WIDE, _int4)
    twin_dir = tmp_path / "twin"
    twin_dir.mkdir()
    save_file(twin, twin_dir / "model.safetensors")
    (twin_dir / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    models = [
        AutoModelForCausalLM.from_pretrained(d).eval() for d in (narrow_dir, wide_dir, twin_dir)
    ]
    prompt = torch.tensor([[5, 17, 300, 2, 41, 99, 7]])
    with torch.no_grad():
        original, quantized, narrow_twin = (m(prompt).logits for m in models)
    torch.testing.assert_close(narrow_twin, quantized, atol=1e-4, rtol=0)
    assert float((quantized - original).abs().max()) > 1e-2  # int4 moved the logits


@pytest.mark.parametrize("name", ["eagle3", "eagle", "mtp-deepseek"])
def test_widened_head_drafts_what_it_drafted(name, head_target, head_dirs):
    """A head widened with its target: the same logits from the repeated features."""
    cfg = json.loads((head_target / "config.json").read_text())
    narrow_shape = NarrowShape.of(cfg)
    widening = Widening(factor=3, heads=8, kv_heads=4, intermediate=150)
    target = {
        k: torch.from_numpy(v) for k, v in load_file(head_target / "model.safetensors").items()
    }
    wide_target = {
        k: torch.from_numpy(v)
        for k, v in widen_tensors(
            {k: v.numpy() for k, v in target.items()}, narrow_shape, widening
        ).items()
    }
    head = head_tensors(name, head_dirs, head_target)
    wide_head = {
        k: torch.from_numpy(v)
        for k, v in widen_tensors(
            {k: v.numpy() for k, v in head.items()}, narrow_shape, widening
        ).items()
    }
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, HEAD_VOCAB, (2, 6), generator=g)
    taps = torch.randn(2, 6, (3 if name == "eagle3" else 1) * cfg["hidden_size"], generator=g)
    wide_taps = (
        taps.reshape(2, 6, -1, cfg["hidden_size"]).repeat_interleave(3, -1).reshape(2, 6, -1)
    )
    positions = torch.arange(6).repeat(2, 1)
    wide_cfg = {**cfg, "num_attention_heads": 8, "num_key_value_heads": 4}
    logits, hidden = reference(name, head, target, ids, taps, positions, cfg)
    wide_logits, wide_hidden = reference(
        name, wide_head, wide_target, ids, wide_taps, positions, wide_cfg
    )
    torch.testing.assert_close(wide_logits, logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(wide_hidden, hidden.repeat_interleave(3, -1), atol=1e-5, rtol=0)


def test_widened_medusa_block_commutes_with_the_repeat(head_dirs, rng):
    t = load_file(head_dirs["medusa"] / "medusa_lm_head.safetensors")
    shape = NarrowShape(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64)
    w = widen_tensors(t, shape, Widening(factor=2, heads=4, kv_heads=2, intermediate=64))
    x = rng.standard_normal((3, 32)).astype(np.float32)
    for k in range(4):
        narrow = x + _silu(x @ t[f"{k}.0.linear.weight"].T + t[f"{k}.0.linear.bias"])
        xw = np.repeat(x, 2, axis=1)
        wide = xw + _silu(xw @ w[f"{k}.0.linear.weight"].T + w[f"{k}.0.linear.bias"])
        np.testing.assert_allclose(wide, np.repeat(narrow, 2, axis=1), atol=1e-5)
        np.testing.assert_allclose(
            wide @ w[f"{k}.1.weight"].T, narrow @ t[f"{k}.1.weight"].T, atol=1e-4
        )


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def test_a_tensor_without_a_rule_or_too_few_heads_is_refused():
    shape = NarrowShape(hidden=8, heads=4, kv_heads=2, head_dim=2, intermediate=16)
    with pytest.raises(ValueError, match="no widening rule for tensor 'rotary.inv_freq'"):
        widen_tensors({"rotary.inv_freq": np.ones(4, np.float32)}, shape, WIDE)
    with pytest.raises(ValueError, match="query heads per KV head"):
        widen_tensors({}, shape, Widening(factor=2, heads=4, kv_heads=4, intermediate=16))
    with pytest.raises(ValueError, match="intermediate 8 <"):
        widen_tensors({}, shape, Widening(factor=2, heads=4, kv_heads=2, intermediate=8))
