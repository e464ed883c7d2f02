"""The TensorRT lowering and the precision pass: structure, and numerics on ONNX Runtime.

The lowered graphs are run with ONNX Runtime (fp32, fp16) and ONNX's reference evaluator
(bf16, which ORT's CPU provider cannot run) and compared with the exported graph.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx_ir.passes import PassError

from specx.artifact import load_manifest
from specx.graphs.precision import ConvertPrecisionPass
from specx.graphs.trt_lowering import CheckPluginNodesPass, lower_for_tensorrt
from specx.sessions import load_session

CAPACITY = 128  # conftest.MAX_CONTEXT


def _load(artifact, graph: str = "target") -> ir.Model:
    manifest = load_manifest(artifact)
    return ir.load(manifest.path(manifest.graph(graph).file))


def _save(model: ir.Model, path) -> str:
    ir.save(model, path, external_data=f"{path.name}.data")
    return str(path)


def _session(path: str) -> ort.InferenceSession:
    # The runtime's options: other tests in this process create ORT's global thread pool.
    return load_session(path)


def _two_steps(run, inputs, cache_dtype, positions_offset: int = 0):
    """Prefill 6 tokens, then a 4-node tree (root, two children, a grandchild) at slot 6.

    `run(feeds) -> outputs` executes one graph; caches are carried from step to step.
    Returns the outputs of both steps (logits, taps and the caches after step 2).
    """
    caches = {
        i.name: np.zeros((2, *i.shape[1:2], CAPACITY, i.shape[3]), cache_dtype)
        for i in inputs
        if i.name.startswith("past_")
    }
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 500, size=(2, 6))
    mask = np.tril(np.ones((6, 6), bool))[None, None].repeat(2, 0)
    positions = np.arange(6)[None].repeat(2, 0) + positions_offset
    first = run(
        {
            "input_ids": ids,
            "position_ids": positions,
            "attention_mask": mask,
            "write_pos": np.zeros(2, np.int64),
            **caches,
        }
    )
    caches = _carry(first, caches)
    parents = [-1, 0, 0, 1]
    tree = np.zeros((4, 10), bool)
    tree[:, :6] = True
    for node, parent in enumerate(parents):
        tree[node, 6 + node] = True
        while parent >= 0:
            tree[node, 6 + parent] = True
            parent = parents[parent]
    depth = np.array([0, 1, 1, 2])
    second = run(
        {
            "input_ids": rng.integers(1, 500, size=(2, 4)),
            "position_ids": (6 + positions_offset + depth)[None].repeat(2, 0),
            "attention_mask": tree[None, None].repeat(2, 0),
            "write_pos": np.full(2, 6, np.int64),
            **caches,
        }
    )
    return first, second


def _carry(outputs: dict, caches: dict) -> dict:
    return {name: outputs[name.replace("past_", "present_")] for name in caches}


def _ort_runner(path: str):
    session = _session(path)
    names = [o.name for o in session.get_outputs()]

    def run(feeds):
        return dict(zip(names, session.run(None, feeds), strict=True))

    return session.get_inputs(), run


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lowered_fp32_graph_matches_the_exported_one_on_ort(artifacts, family, tmp_path):
    exported = _load(artifacts[family])
    lowered = lower_for_tensorrt(_load(artifacts[family]), CAPACITY, "fp32")
    inputs, reference = _ort_runner(_save(exported, tmp_path / "exported.onnx"))
    _, candidate = _ort_runner(_save(lowered, tmp_path / "lowered.onnx"))
    for want, got in zip(
        _two_steps(reference, inputs, np.float32),
        _two_steps(candidate, inputs, np.float32),
        strict=True,
    ):
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=1e-5, err_msg=name)


def test_lowering_fixes_capacity_and_marks_plugin_nodes(artifacts):
    lowered = lower_for_tensorrt(_load(artifacts["llama"]), CAPACITY, "fp16")
    caches = [v for v in (*lowered.graph.inputs, *lowered.graph.outputs) if "_key_" in v.name]
    assert caches and all(v.shape[2] == CAPACITY for v in caches)
    nodes = [n for n in lowered.graph if n.op_type == "TreeAttention"]
    assert len(nodes) == load_manifest(artifacts["llama"]).model.num_layers
    for node in nodes:
        assert node.attributes["plugin_namespace"].value == "specx"
        assert node.attributes["plugin_version"].value == "1"
        assert node.attributes["aot"].value == 1
        assert node.attributes["softcap"].value == 0.0  # every plugin field present
    assert ("specx", "TreeAttention", "") in lowered.functions
    capped = lower_for_tensorrt(_load(artifacts["gemma2"]), CAPACITY, "fp16")
    softcaps = [n.attributes["softcap"].value for n in capped.graph if n.op_type == "TreeAttention"]
    assert softcaps == pytest.approx([0.02] * len(softcaps))  # Gemma 2's own cap is kept


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lowering_refuses_a_node_without_plugin_fields(artifacts, precision):
    model = _load(artifacts["llama"])
    node = next(n for n in model.graph if n.op_type == "TreeAttention")
    del node.attributes["plugin_version"]
    with pytest.raises(PassError, match="plugin_version is None, expected '1'"):
        lower_for_tensorrt(model, CAPACITY, precision)
    model = _load(artifacts["llama"])
    del model.functions[("specx", "TreeAttention", "")]
    with pytest.raises(PassError, match="no model-local function"):
        CheckPluginNodesPass()(model)


def test_unknown_precision_is_refused(artifacts):
    with pytest.raises(ValueError, match="fp8"):
        lower_for_tensorrt(_load(artifacts["llama"]), CAPACITY, "fp8")


def test_fp16_keeps_rope_norms_and_interface_in_fp32(artifacts):
    model = _load(artifacts["qwen3"])
    ConvertPrecisionPass(ir.DataType.FLOAT16)(model)
    rope = [n for n in model.graph if n.op_type in ("Cos", "Sin")]
    assert rope and all(n.inputs[0].dtype == ir.DataType.FLOAT for n in rope)
    norms = [n for n in model.graph if n.op_type == "RMSNormalization"]
    assert norms and all(n.attributes["stash_type"].value == 1 for n in norms)
    assert all(n.outputs[0].dtype == ir.DataType.FLOAT16 for n in norms)
    io = {v.name: v.dtype for v in (*model.graph.inputs, *model.graph.outputs)}
    assert io["past_key_0"] == io["present_value_0"] == ir.DataType.FLOAT16
    assert io["logits"] == io["hidden_taps"] == ir.DataType.FLOAT
    matmuls = [n for n in model.graph if n.op_type == "MatMul"]
    assert all(n.outputs[0].dtype == ir.DataType.FLOAT16 for n in matmuls)


@pytest.mark.parametrize("offset", [0, 3000])
def test_fp16_graph_is_close_to_fp32_on_ort(artifacts, tmp_path, offset):
    """Within fp16 tolerance, also 3000 positions in: RoPE angles are computed in fp32."""
    exported = _load(artifacts["qwen3"])
    low = lower_for_tensorrt(_load(artifacts["qwen3"]), CAPACITY, "fp16")
    inputs, reference = _ort_runner(_save(exported, tmp_path / "fp32.onnx"))
    _, candidate = _ort_runner(_save(low, tmp_path / "fp16.onnx"))
    want = _two_steps(reference, inputs, np.float32, offset)
    got = _two_steps(candidate, inputs, np.float16, offset)
    for w, g in zip(want, got, strict=True):
        assert g["logits"].dtype == np.float32 and g["present_key_0"].dtype == np.float16
        scale = np.abs(w["logits"]).max()
        assert np.abs(g["logits"] - w["logits"]).max() < 5e-3 * scale + 1e-3
        agreement = (g["logits"].argmax(-1) == w["logits"].argmax(-1)).mean()
        assert agreement >= 0.9


def test_bf16_graph_is_close_to_fp32_on_the_reference_evaluator(artifacts, tmp_path):
    from onnx.reference import ReferenceEvaluator

    exported = _load(artifacts["llama"])
    low = lower_for_tensorrt(_load(artifacts["llama"]), CAPACITY, "bf16")
    inputs, reference = _ort_runner(_save(exported, tmp_path / "fp32.onnx"))
    evaluator = ReferenceEvaluator(_save(low, tmp_path / "bf16.onnx"))
    names = evaluator.output_names

    def run(feeds):
        return dict(zip(names, evaluator.run(None, feeds), strict=True))

    want = _two_steps(reference, inputs, np.float32)
    got = _two_steps(run, inputs, ml_dtypes.bfloat16)
    for w, g in zip(want, got, strict=True):
        scale = np.abs(w["logits"]).max()
        assert np.abs(g["logits"].astype(np.float32) - w["logits"]).max() < 3e-2 * scale


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_is_written_out_in_table_ops_with_the_same_values(approximate, tmp_path):
    from onnx import TensorProto, helper

    from specx.graphs.trt_lowering import DecomposeGeluPass

    node = helper.make_node("Gelu", ["x"], ["y"], name="gelu", approximate=approximate)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    x = np.linspace(-6, 6, 64, dtype=np.float32)
    model = ir.from_proto(proto)
    expected = _session(_save(model, tmp_path / "gelu.onnx")).run(None, {"x": x})[0]
    assert DecomposeGeluPass()(model).modified
    assert "Gelu" not in [n.op_type for n in model.graph]
    got = _session(_save(model, tmp_path / "decomposed.onnx")).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, atol=1e-6)
