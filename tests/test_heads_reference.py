"""Each head's torch module equals a reference written here from the published formulas,
and each head's ONNX graph equals its torch module."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import HEAD_VOCAB
from specx.artifact import load_manifest
from specx.export.checkpoint import load_checkpoint
from specx.export.heads import load_head
from specx.runtime.targets.ort import OrtGraph, OrtTarget


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta=10000.0):
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions[..., None].float() * inv
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos[:, None] + torch.cat([-second, first], -1) * sin[:, None]


def attention(x, t, p, heads, kv_heads, positions):
    """Causal GQA self-attention from the raw HF-named weights under prefix p."""
    b, n, _ = x.shape
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(b, n, heads, -1).transpose(1, 2)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(b, n, kv_heads, -1).transpose(1, 2)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(b, n, kv_heads, -1).transpose(1, 2)
    q, k = rope(q, positions), rope(k, positions)
    k = k.repeat_interleave(heads // kv_heads, 1)
    v = v.repeat_interleave(heads // kv_heads, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)
    return out @ t[p + "self_attn.o_proj.weight"].T


def mlp(x, t, p):
    gate = torch.nn.functional.silu(x @ t[p + "mlp.gate_proj.weight"].T)
    return (gate * (x @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T


def reference(name, t, target, ids, features, positions, cfg):
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    embed = target["model.embed_tokens.weight"][ids]
    if name.startswith("eagle3"):
        p = (
            "midlayer."
            if "midlayer.fc" not in t and "midlayer.hidden_norm.weight" in t
            else "layers.0."
        )
        h = features @ t["fc.weight"].T
        a = torch.cat(
            [rms(embed, t[p + "input_layernorm.weight"]), rms(h, t[p + "hidden_norm.weight"])], -1
        )
        h = h + attention(a, t, p, heads, kv, positions)
        h = h + mlp(rms(h, t[p + "post_attention_layernorm.weight"]), t, p)
        return rms(h, t["norm.weight"]) @ t["lm_head.weight"].T, h
    if name == "eagle":
        h = torch.cat([embed, features], -1) @ t["fc.weight"].T + t["fc.bias"]
        h = h + attention(h, t, "layers.0.", heads, kv, positions)
        h = h + mlp(rms(h, t["layers.0.post_attention_layernorm.weight"]), t, "layers.0.")
        return h @ target["lm_head.weight"].T, h
    if name.startswith("mtp"):
        n = cfg["num_hidden_layers"]
        names = {
            "mtp-deepseek": (
                f"model.layers.{n}.",
                "enorm",
                "hnorm",
                "eh_proj",
                "shared_head.norm",
                False,
            ),
            "mtp-qwen3_next": (
                "mtp.",
                "pre_fc_norm_embedding",
                "pre_fc_norm_hidden",
                "fc",
                "norm",
                False,
            ),
            "mtp-mimo": (
                "model.mtp_layers.0.",
                "token_layernorm",
                "hidden_layernorm",
                "input_proj",
                "final_layernorm",
                True,
            ),
        }[name]
        p, enorm, hnorm, proj, norm, hidden_first = names
        layer = {"mtp-qwen3_next": "mtp.layers.0."}.get(name, p)
        if name == "mtp-deepseek":
            embed = t[p + "embed_tokens.weight"][ids]
        e, f = rms(embed, t[p + enorm + ".weight"]), rms(features, t[p + hnorm + ".weight"])
        h = torch.cat([f, e] if hidden_first else [e, f], -1) @ t[p + proj + ".weight"].T
        h = h + attention(
            rms(h, t[layer + "input_layernorm.weight"]), t, layer, heads, kv, positions
        )
        h = h + mlp(rms(h, t[layer + "post_attention_layernorm.weight"]), t, layer)
        head = (
            t[p + "shared_head.head.weight"] if name == "mtp-deepseek" else target["lm_head.weight"]
        )
        return rms(h, t[p + norm + ".weight"]) @ head.T, h
    raise AssertionError(name)


AR_HEADS = ["eagle3", "eagle3-modelopt", "eagle", "mtp-deepseek", "mtp-qwen3_next", "mtp-mimo"]


def head_tensors(name, head_dirs, head_target):
    directory = head_target if name == "mtp-deepseek" else head_dirs[name]
    return load_file(directory / "model.safetensors")


def spec_for(name, head_dirs):
    from conftest import HEAD_SPECS

    return HEAD_SPECS[name].format(**{k: str(v) for k, v in head_dirs.items()})


@pytest.mark.parametrize("name", AR_HEADS)
def test_autoregressive_head_matches_reference(name, head_target, head_dirs):
    target_ckpt = load_checkpoint(head_target)
    head = load_head(spec_for(name, head_dirs), target_ckpt)
    cfg = json.loads((head_target / "config.json").read_text())
    tensors = head_tensors(name, head_dirs, head_target)
    target = load_file(head_target / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, HEAD_VOCAB, (2, 6), generator=g)
    width = 3 * cfg["hidden_size"] if name.startswith("eagle3") else cfg["hidden_size"]
    taps = torch.randn(2, 6, width, generator=g)
    positions = torch.arange(6).repeat(2, 1)
    expected_logits, expected_hidden = reference(name, tensors, target, ids, taps, positions, cfg)
    c = head.config
    cache = [torch.zeros(2, c.num_kv_heads, 6, c.head_dim) for _ in range(2)]
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    features = head.project(taps) if hasattr(head, "project") else taps
    with torch.no_grad():
        logits, hidden, _, _ = head(
            ids, features, positions, mask, torch.zeros(2, dtype=torch.int64), cache
        )
    torch.testing.assert_close(hidden, expected_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-5)


def test_medusa_matches_reference(head_target, head_dirs):
    head = load_head(spec_for("medusa", head_dirs), load_checkpoint(head_target))
    t = load_file(head_dirs["medusa"] / "medusa_lm_head.safetensors")
    features = torch.randn(2, 3, 32)
    with torch.no_grad():
        got = head(features)
    for k in range(4):
        x = features + torch.nn.functional.silu(
            features @ t[f"{k}.0.linear.weight"].T + t[f"{k}.0.linear.bias"]
        )
        torch.testing.assert_close(got[:, :, k], x @ t[f"{k}.1.weight"].T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", AR_HEADS)
def test_head_onnx_matches_torch(name, head_target, head_dirs, head_artifacts, rng):
    head = load_head(spec_for(name, head_dirs), load_checkpoint(head_target))
    manifest = load_manifest(head_artifacts[name])
    graph = OrtTarget(manifest, threads=2, graph="draft_head")
    c = head.config
    batch, n, capacity, prefix = 2, 4, 16, 5
    cache = [
        rng.standard_normal((batch, c.num_kv_heads, capacity, c.head_dim)).astype(np.float32)
        for _ in range(2)
    ]
    ids = rng.integers(0, HEAD_VOCAB, (batch, n))
    features = rng.standard_normal((batch, n, c.hidden_size)).astype(np.float32)
    positions = prefix + rng.integers(0, n, (batch, n))
    write_pos = np.array([prefix, prefix - 2])
    mask = rng.random((batch, 1, n, prefix + n)) < 0.6
    mask[..., 0] = True
    with torch.no_grad():
        expected = head(
            torch.from_numpy(ids),
            torch.from_numpy(features),
            torch.from_numpy(positions),
            torch.from_numpy(mask),
            torch.from_numpy(write_pos),
            [torch.from_numpy(x) for x in cache],
        )
    ort_cache = graph.allocate_cache(batch, capacity)
    ort_cache.keys[0][...], ort_cache.values[0][...] = cache
    got = graph.forward(ort_cache, ids, positions, mask, write_pos, features)
    np.testing.assert_allclose(got.logits, expected[0].numpy(), atol=1e-4)
    np.testing.assert_allclose(got.taps, expected[1].numpy(), atol=1e-4)
    np.testing.assert_allclose(ort_cache.keys[0], expected[2].numpy(), atol=1e-4)
    np.testing.assert_allclose(ort_cache.values[0], expected[3].numpy(), atol=1e-4)
    if hasattr(head, "project"):
        taps = rng.standard_normal((batch, n, head.fc.in_features)).astype(np.float32)
        projected = OrtGraph(manifest, "draft_projection")(taps)
        with torch.no_grad():
            np.testing.assert_allclose(
                projected, head.project(torch.from_numpy(taps)).numpy(), atol=1e-4
            )


def test_medusa_onnx_matches_torch(head_target, head_dirs, head_artifacts):
    head = load_head(spec_for("medusa", head_dirs), load_checkpoint(head_target))
    features = np.random.default_rng(0).standard_normal((3, 2, 32)).astype(np.float32)
    got = OrtGraph(load_manifest(head_artifacts["medusa"]), "draft_head")(features)
    with torch.no_grad():
        np.testing.assert_allclose(got, head(torch.from_numpy(features)).numpy(), atol=1e-4)
