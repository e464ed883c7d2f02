"""The exported graph (through ONNX Runtime) equals the torch decoder it came from."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from conftest import FAMILIES, MAX_CONTEXT
from specx.artifact import load_manifest
from specx.export.checkpoint import load_checkpoint
from specx.export.decoder import TargetDecoder
from specx.graphs import tree_attention as ta
from specx.manifest_types import TapSpec
from specx.runtime.targets.ort import OrtTarget

CAPACITY = 24


def random_step_inputs(rng, batch, n, prefix, cfg):
    """Random cache contents, per-row write positions and a random tree-like mask."""
    write_pos = np.array([prefix - 2 * b if prefix else 0 for b in range(batch)], dtype=np.int64)
    kv_len = int(write_pos.max()) + n
    mask = np.zeros((batch, 1, n, kv_len), dtype=bool)
    for b in range(batch):
        mask[b, 0, :, : write_pos[b]] = True
        new = np.tril(rng.random((n, n)) < 0.5)
        np.fill_diagonal(new, True)
        mask[b, 0, :, write_pos[b] : write_pos[b] + n] = new
    shape = (batch, cfg.num_kv_heads, CAPACITY, cfg.head_dim)
    cache = [rng.standard_normal(shape).astype(np.float32) for _ in range(2 * cfg.num_layers)]
    ids = rng.integers(0, cfg.vocab_size, (batch, n))
    positions = write_pos[:, None] + rng.integers(0, n, (batch, n))
    return ids, positions, mask, write_pos, cache


@pytest.mark.parametrize("family", FAMILIES)
def test_onnx_matches_torch(family, checkpoints, artifacts, rng):
    checkpoint = load_checkpoint(checkpoints[family])
    decoder = TargetDecoder.from_state_dict(checkpoint.config, checkpoint.state_dict, "eagle3")
    target = OrtTarget(load_manifest(artifacts[family]), threads=2)
    for batch in (1, 2):
        for n in (1, 5):
            for prefix in (0, 7):
                ids, pos, mask, write_pos, cache = random_step_inputs(
                    rng, batch, n, prefix, checkpoint.config
                )
                with torch.no_grad():
                    expected = decoder(
                        torch.from_numpy(ids),
                        torch.from_numpy(pos),
                        torch.from_numpy(mask),
                        torch.from_numpy(write_pos),
                        [torch.from_numpy(c) for c in cache],
                    )
                ort_cache = target.allocate_cache(batch, CAPACITY)
                for dst, src in zip(
                    ort_cache.keys + ort_cache.values, cache[0::2] + cache[1::2], strict=True
                ):
                    dst[...] = src
                got = target.forward(ort_cache, ids, pos, mask, write_pos)
                where = f"{family} B={batch} N={n} prefix={prefix}"
                np.testing.assert_allclose(
                    got.logits, expected[0].numpy(), atol=1e-4, err_msg=where
                )
                np.testing.assert_allclose(got.taps, expected[1].numpy(), atol=1e-4, err_msg=where)
                for i in range(checkpoint.config.num_layers):
                    np.testing.assert_allclose(
                        ort_cache.keys[i], expected[2 + 2 * i].numpy(), atol=1e-4, err_msg=where
                    )
                    np.testing.assert_allclose(
                        ort_cache.values[i], expected[3 + 2 * i].numpy(), atol=1e-4, err_msg=where
                    )


def test_each_attention_is_one_plugin_ready_node(artifacts):
    manifest = load_manifest(artifacts["qwen3"])
    model = onnx.load(manifest.path("target.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.domain == ta.DOMAIN]
    assert len(nodes) == manifest.model.num_layers
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert node.op_type == ta.OP_TYPE
        assert attrs["plugin_namespace"] == b"specx" and attrs["plugin_version"] == b"1"
        assert attrs["num_heads"] == 4 and attrs["num_kv_heads"] == 2
        assert attrs["scale"] == pytest.approx(manifest.model.head_dim**-0.5)
    # No attention of the decoder escaped the op: the only Attention is inside the function.
    assert not [n for n in model.graph.node if n.op_type in ("Attention", "Softmax")]
    (function,) = [f for f in model.functions if f.name == ta.OP_TYPE]
    assert {n.op_type for n in function.node} >= {"TensorScatter", "Attention"}
    assert {(o.domain, o.version) for o in model.opset_import} >= {("", 24), ("specx", 1)}


def test_manifest_records_signature_and_dynamic_dims(artifacts):
    manifest = load_manifest(artifacts["llama"])
    graph = manifest.graph("target")
    inputs = {t.name: t for t in graph.inputs}
    assert inputs["input_ids"].shape == ("batch", "tokens")
    assert inputs["attention_mask"].shape == ("batch", 1, "tokens", "kv_len")
    assert inputs["past_key_0"].shape == ("batch", 2, "capacity", 16)
    outputs = {t.name: t for t in graph.outputs}
    assert outputs["logits"].shape == ("batch", "tokens", 512)
    assert outputs["hidden_taps"].shape == ("batch", "tokens", 3 * 64)
    assert manifest.model.kv_capacity == MAX_CONTEXT
    assert manifest.model.taps == TapSpec(kind="eagle3", width=192, layers=(2, 2, 1))


def test_max_context_defaults_to_the_trained_positions_and_more_is_asked_for_by_name(tmp_path):
    from specx.artifact import load_manifest
    from specx.errors import ExportError
    from specx.export.random_checkpoint import CheckpointPreset, write_random_checkpoint
    from specx.export.target_export import export_target

    preset = CheckpointPreset(32, 64, 1, 2, 1, 128, max_position_embeddings=96)
    checkpoint = write_random_checkpoint(tmp_path / "ck", "llama", preset)
    default = export_target(checkpoint, tmp_path / "a")
    assert load_manifest(default).model.kv_capacity == 96
    with pytest.raises(ExportError, match=r"--max-context 128 exceeds the 96 positions ck was"):
        export_target(checkpoint, tmp_path / "b", max_context=128)
    assert not (tmp_path / "b").exists()
    allowed = export_target(
        checkpoint, tmp_path / "c", max_context=128, beyond_trained_positions=True
    )
    assert load_manifest(allowed).model.kv_capacity == 128
