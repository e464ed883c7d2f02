"""The ONNX Runtime lowering: TreeAttention as GroupQueryAttention, same results, lossless."""

from __future__ import annotations

import shutil

import numpy as np
import onnx_ir as ir
import pytest

import specx.builders.ort
from conftest import FAMILIES, HEAD_VOCAB
from specx.artifact import load_manifest
from specx.builders import BuildOptions, build_artifact
from specx.graphs.ort_lowering import GroupQueryAttentionPass, gqa_available
from specx.graphs.weight_only import WeightOnlyConfig
from specx.masks import causal_mask
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets.ort import OrtTarget
from specx.runtime.tree_shapes import StaticTree, parse_tree_spec

pytestmark = pytest.mark.skipif(not gqa_available(), reason="no GroupQueryAttention in this ORT")


def steps(target: OrtTarget, batch: int, rng) -> list[np.ndarray]:
    """Prefill of ragged prompts, a chain step and a tree step: every output and cache."""
    cache = target.allocate_cache(batch, 64)
    prompts = [rng.integers(1, 500, n).tolist() for n in (5, 11, 8)][:batch]
    out, _ = target.feed(cache, prompts, np.zeros(batch, np.int64))
    results = [out.logits, out.taps]
    lengths = np.array([len(p) for p in prompts])
    # A chain of 3 at each row's end, then a 4-node tree after it.
    for parents in ([-1, 0, 1], [-1, 0, 0, 1]):
        n = len(parents)
        ids = rng.integers(1, 500, (batch, n))
        depth = np.zeros(n, int)
        visible = np.eye(n, dtype=bool)
        for i, p in enumerate(parents):
            if p >= 0:
                depth[i], visible[i] = depth[p] + 1, visible[i] | visible[p]
        mask = np.zeros((batch, 1, n, int(lengths.max()) + n), bool)
        for b, length in enumerate(lengths):
            mask[b, 0, :, :length] = True
            mask[b, 0, :, length : length + n] = visible
        out = target.forward(cache, ids, lengths[:, None] + depth, mask, lengths)
        results += [out.logits, out.taps]
        lengths = lengths + n
    return results + [k.copy() for k in cache.keys] + [v.copy() for v in cache.values]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_the_lowered_graph_equals_the_exported_graph(family, batch, artifacts, tmp_path):
    artifact = shutil.copytree(artifacts[family], tmp_path / "artifact")
    build_artifact(artifact, BuildOptions("ort", "fp32"))
    manifest = load_manifest(artifact)
    assert manifest.data["builds"]["ort-fp32"]["lowering"] == {"target": "gqa"}
    lowered = ir.load(manifest.path(manifest.build.graphs["target"].file))
    ops = [n.op_type for n in lowered.graph]
    assert (
        "TreeAttention" not in ops and ops.count("GroupQueryAttention") == manifest.model.num_layers
    )
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * manifest.model.num_layers
    # RoPE moves into GQA, except after per-head q/k norms (Qwen3, Gemma 3; not on ORT's CPU) and
    # for partial rotary (the phi3 preset, as Phi-4-mini: its rotary is not GQA's form);
    # SmolLM3's NoPE layers take GQA without rotary.
    outside = (
        family in ("qwen3", "gemma3_text")
        or manifest.data["source"]["config"].get("partial_rotary_factor", 1.0) != 1.0
    )
    rotary = [n.attributes["do_rotary"].value for n in lowered.graph if n.op_type.startswith("Gr")]
    assert rotary == [int(not outside and uses) for uses in _rope_layers(manifest)]
    assert ("Cos" in ops) == outside
    exported = OrtTarget(manifest.with_build(None), threads=2)
    built = OrtTarget(manifest, threads=2)
    expected = steps(exported, batch, np.random.default_rng(0))
    actual = steps(built, batch, np.random.default_rng(0))
    for a, b in zip(actual, expected, strict=True):
        if b is not None:
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_speculation_equals_plain_on_the_lowered_build(
    drafter, artifacts, draft_artifacts, tmp_path, rng
):
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "artifact")
    build_artifact(artifact, BuildOptions("ort", "fp32"))
    target = OrtTarget(load_manifest(artifact), threads=2)
    spec = "ngram" if drafter == "ngram" else f"draft-model:{draft_artifacts['llama']}"
    prompts = [
        [5, 9, 5, 9, 5, 9, 13, 5, 9],
        [7, 3, 11, 7, 3, 11, 7],
        rng.integers(1, 500, 6).tolist(),
    ]
    for tree in (None, parse_tree_spec("[[0],[1],[0,0],[1,0]]")):
        if tree is not None and drafter == "ngram":
            continue
        making = make_drafter(spec, target, DrafterOptions(4, tree=tree, ngram_matches=2))
        for batch in (1, 3):
            chunk = prompts[:batch]
            assert (
                generate_speculative(target, making, chunk, 32).tokens
                == generate_plain(target, chunk, 32).tokens
            )


@pytest.mark.parametrize("name", ["eagle3", "eagle", "mtp-deepseek", "medusa"])
def test_heads_lowered_too_and_their_trees_equal_plain(name, head_artifacts, tmp_path, rng):
    artifact = shutil.copytree(head_artifacts[name], tmp_path / "artifact")
    build_artifact(artifact, BuildOptions("ort", "fp32"))
    manifest = load_manifest(artifact)
    # Medusa's heads are MLPs: nothing in them to lower.
    lowered = {"target": "gqa"} if name == "medusa" else {"target": "gqa", "draft_head": "gqa"}
    assert manifest.data["builds"]["ort-fp32"]["lowering"] == lowered
    target = OrtTarget(manifest, threads=2)
    prompts = [rng.integers(1, HEAD_VOCAB, n).tolist() for n in (3, 8, 5)]
    # Medusa drafts static trees only; the others also draft dynamic ones.
    tree = "[[0], [1], [0, 0], [0, 1], [1, 0]]" if name == "medusa" else "dynamic:9,2,3"
    for shape in (StaticTree.chain(3), parse_tree_spec(tree)):
        drafter = make_drafter(name.split("-")[0], target, DrafterOptions(tree=shape))
        for batch in (1, 3):
            chunk = prompts[:batch]
            plain = generate_plain(target, chunk, 24).tokens
            assert generate_speculative(target, drafter, chunk, 24).tokens == plain


def chunked_logits(target: OrtTarget, prompt: list[int], tokens: list[int], chunk: int):
    """Logits of `tokens` after `prompt`, fed `chunk` tokens per forward as chains."""
    cache = target.allocate_cache(1, len(prompt) + len(tokens))
    target.feed(cache, [prompt], np.zeros(1, np.int64))
    cache.lengths[:] = len(prompt)
    rows = []
    for start in range(0, len(tokens), chunk):
        ids = np.array([tokens[start : start + chunk]])
        n, write_pos = ids.shape[1], cache.lengths.copy()
        mask = causal_mask(write_pos, n, int(write_pos[0]) + n)
        rows.append(target.forward(cache, ids, write_pos[:, None] + np.arange(n), mask, write_pos))
        cache.lengths += n
    return np.concatenate([r.logits[0] for r in rows])


def _assert_rows_chunk_invariant(target: OrtTarget) -> None:
    rng = np.random.default_rng(0)
    for _ in range(3):
        prompt, tokens = rng.integers(1, 500, 17).tolist(), rng.integers(1, 500, 6).tolist()
        one = chunked_logits(target, prompt, tokens, 1)
        for chunk in (2, 3, 6):
            np.testing.assert_array_equal(chunked_logits(target, prompt, tokens, chunk), one)


@pytest.mark.parametrize(("block_size", "lowering"), [(32, "gqa"), (128, "gqa"), (128, "none")])
def test_row_invariant_targets_pad_lone_query_rows(block_size, lowering, artifacts, tmp_path):
    """An int4 target at accuracy level 4 keeps greedy identity by row invariance, so a
    token's logits do not depend on its chunk, bit for bit, up to the cache's last slot (the
    padding row writes to a spare one). Blocks of 32: GQA always sees two query rows or
    more; blocks of 128 (MatMulNBits computes rows in pairs): the whole graph runs one
    padding row (with the standard attention body too), as do blocks of 32 on an AVX2 EPYC."""
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "artifact")
    config = WeightOnlyConfig(block_size=block_size)
    options = BuildOptions("ort", "int4", weight_only=config, lowering=lowering)
    build_artifact(artifact, options)
    manifest = load_manifest(artifact)
    build = manifest.build
    assert build.quantization.greedy_identity == "chains"
    # Measured at build time: which CPU kernel runs decides (AVX-512 hosts pair rows at
    # blocks of 128 only; an AVX2 EPYC at blocks of 32 too).
    ort = specx.builders.ort
    padded = ort.matmulnbits_row_invariance(ort.weight_only_config(manifest, options)) == "padded"
    assert build.quantization.padding_row == padded
    lowered = manifest.data["builds"]["ort-int4"].get("lowering")
    assert lowered == ({"target": "gqa"} if lowering == "gqa" else None)
    assert build.graphs["target"].kv_spare_slots == int(lowering == "gqa" or padded)
    _assert_rows_chunk_invariant(OrtTarget(manifest, threads=2))


def test_pairing_kernels_break_row_invariance_without_the_padding_row(
    artifacts, tmp_path, monkeypatch
):
    """Why the padding row at blocks of 128: without it rows differ between chunks."""
    monkeypatch.setattr(specx.builders.ort, "matmulnbits_row_invariance", lambda config: "as is")
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "artifact")
    config = WeightOnlyConfig(block_size=128)
    build_artifact(artifact, BuildOptions("ort", "int4", weight_only=config))
    assert load_manifest(artifact).build.quantization.padding_row is False
    with pytest.raises(AssertionError):
        _assert_rows_chunk_invariant(OrtTarget(load_manifest(artifact), threads=2))


def test_an_fp32_builds_lone_row_agrees_with_a_chunk_up_to_the_last_bits(artifacts, tmp_path):
    """A float build (greedy identity "all") needs no padding row: on the CPUs measured its
    GroupQueryAttention computes a lone row other than rows together only in the last bits,
    and on others alike; either way a decode step's logits match a verify chunk's closely."""
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "artifact")
    build_artifact(artifact, BuildOptions("ort", "fp32"))
    manifest = load_manifest(artifact)
    assert manifest.build.quantization.greedy_identity == "all"
    assert not manifest.build.quantization.padding_row
    target = OrtTarget(manifest, threads=2)
    rng = np.random.default_rng(0)
    prompt, tokens = rng.integers(1, 500, 17).tolist(), rng.integers(1, 500, 6).tolist()
    one, three = (chunked_logits(target, prompt, tokens, c) for c in (1, 3))
    np.testing.assert_allclose(one, three, atol=1e-4)


def test_without_groupqueryattention_the_build_keeps_the_standard_body(
    artifacts, tmp_path, monkeypatch
):
    monkeypatch.setattr(specx.builders.ort, "gqa_available", lambda: False)
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "artifact")
    messages = []
    build_artifact(artifact, BuildOptions("ort", "fp32"), progress=messages.append)
    manifest = load_manifest(artifact)
    assert manifest.build.graphs["target"].file == "target.onnx"  # the exported graph
    assert any("no GroupQueryAttention lowering" in m for m in messages)


def test_the_pass_shares_its_inputs_and_removes_the_transposes(artifacts):
    model = ir.load(load_manifest(artifacts["llama"]).path("target.onnx"))
    before = [n.op_type for n in model.graph]
    GroupQueryAttentionPass()(model)
    after = [n.op_type for n in model.graph]
    layers = before.count("TreeAttention")
    assert after.count("GroupQueryAttention") == layers and after.count("Where") == 1
    assert after.count("Transpose") < before.count("Transpose") - 2 * layers


def _rope_layers(manifest) -> list[bool]:
    """Which layers rotate q and k, from the exported checkpoint's config."""
    config = manifest.data["source"]["config"]
    flags = config.get("no_rope_layers") or [1] * manifest.model.num_layers
    return [bool(f) for f in flags]
