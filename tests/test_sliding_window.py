"""Sliding-window attention (Mistral: every layer; Gemma 2/3: local layers) past the window.

A window of 16 on tiny random checkpoints, prompts of 20-40 tokens and 64 new tokens, so
most keys a late token could see are outside its window: specx's greedy output equals
transformers' `generate`, the ORT lowering equals the exported graph, and greedy
speculation with chains and trees equals plain decoding.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specx.artifact import load_manifest
from specx.builders import BuildOptions, build_artifact
from specx.errors import ExportError
from specx.export.random_checkpoint import write_random_checkpoint
from specx.export.target_export import export_target
from specx.runtime.drafters.ngram import NGramDrafter
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets.ort import OrtTarget

WINDOW, NEW_TOKENS = 16, 64
FAMILIES = ("gemma2", "gemma3_text", "mistral")


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> dict[str, tuple]:
    from transformers import AutoModelForCausalLM

    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        path = write_random_checkpoint(root / "checkpoint", family, "tiny", tokenizer=False)
        config = json.loads((path / "config.json").read_text())
        config["sliding_window"] = WINDOW
        (path / "config.json").write_text(json.dumps(config))
        artifact = export_target(path, root / "artifact", max_context=128, max_tree_tokens=8)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        out[family] = (path, artifact, model)
    return out


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    span = rng.integers(1, vocab, 6).tolist()
    return [
        rng.integers(1, vocab, 20).tolist(),
        rng.integers(1, vocab, 14).tolist() + span * 4,  # repeats: n-gram drafts get accepted
        rng.integers(1, vocab, 33).tolist(),
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_past_the_window(family, windowed):
    _, artifact, model = windowed[family]
    target = OrtTarget(load_manifest(artifact), threads=2)
    prompts = _prompts(target.vocab_size)
    got = generate_plain(target, prompts, NEW_TOKENS).tokens
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert tokens == expected, family


@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_and_the_ort_lowering_past_the_window(family, windowed, tmp_path):
    _, artifact, _ = windowed[family]
    lowered = shutil.copytree(artifact, tmp_path / "artifact")
    build_artifact(lowered, BuildOptions("ort", "fp32"))
    assert load_manifest(lowered).data["builds"]["ort-fp32"]["lowering"] == {"target": "gqa"}
    exported = OrtTarget(load_manifest(artifact), threads=2)
    prompts = _prompts(exported.vocab_size, seed=1)
    plain = generate_plain(exported, prompts, NEW_TOKENS)
    for target in (exported, OrtTarget(load_manifest(lowered), threads=2)):
        assert generate_plain(target, prompts, NEW_TOKENS).tokens == plain.tokens
        accepted = 0
        for drafter in (NGramDrafter(4), NGramDrafter(7, max_matches=3)):  # chain, tree
            for batch in ([p] for p in prompts):
                spec = generate_speculative(target, drafter, batch, NEW_TOKENS)
                assert spec.tokens == generate_plain(target, batch, NEW_TOKENS).tokens
                accepted += spec.stats.speculative.acceptance.accepted_tokens
        assert accepted > 0


def test_a_tree_wider_than_the_window_is_refused(windowed, tmp_path):
    path, _, _ = windowed["gemma3_text"]
    with pytest.raises(ExportError, match="--max-tree-tokens 32 exceeds the target's sliding"):
        export_target(path, tmp_path / "out", max_context=64, max_tree_tokens=32)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_window_mask_lints_clean_for_tensorrt(family, windowed):
    import onnx_ir as ir

    from specx.graphs.trt_lint import lint_for_tensorrt
    from specx.graphs.trt_lowering import lower_for_tensorrt

    manifest = load_manifest(windowed[family][1])
    model = ir.load(manifest.path(manifest.graph("target").file))
    ops = {n.op_type for n in model.graph}
    assert {"Range", "Less", "And"} <= ops  # the second mask is in the graph
    lowered = lower_for_tensorrt(model, manifest.model.kv_capacity, "fp16")
    assert lint_for_tensorrt(lowered, "target") == []
