"""TensorRT lint: every exported graph passes in its lowered form; known rejections are caught."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from specx.artifact import load_manifest
from specx.cli import main
from specx.graphs.trt_lint import lint_for_tensorrt
from specx.graphs.trt_lowering import lower_for_tensorrt


def _graphs(artifact):
    manifest = load_manifest(artifact)
    for name, entry in manifest.graphs.items():
        if not entry.ort_only:  # the one-call draft chain: ONNX Runtime only
            yield name, manifest.model.kv_capacity, manifest.path(entry.file)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_every_exported_graph_lints_clean_once_lowered(artifacts, head_artifacts, precision):
    checked = set()
    for artifact in (*artifacts.values(), *head_artifacts.values()):
        for name, capacity, path in _graphs(artifact):
            model = lower_for_tensorrt(ir.load(path), capacity, precision)
            assert lint_for_tensorrt(model, name) == [], f"{artifact}/{name}"
            checked.add(name)
    assert checked == {"target", "draft_head", "draft_projection"}


def test_the_unlowered_graph_is_flagged_for_its_dynamic_cache(artifacts):
    (_, _, path), *_ = _graphs(artifacts["llama"])
    issues = lint_for_tensorrt(ir.load(path), "target")
    caches = [i for i in issues if i.op_type == "TensorScatter"]
    assert caches and all(i.view == "fallback" for i in caches)
    assert "static capacity" in caches[0].reason
    # The other finding: the plugin field the lowering adds (PluginFieldsPass).
    rest = {(i.view, i.op_type, i.reason) for i in issues if i.op_type != "TensorScatter"}
    assert rest == {("plugin", "TreeAttention", "plugin attributes missing: ['softcap']")}


def _model(nodes, inputs, outputs, initializers=(), opset=24) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))


def _tensor(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


F = TensorProto.FLOAT
QKV = [_tensor(n, F, [1, 2, 3, 4]) for n in ("q", "k", "v")]


def _reasons(model) -> list[str]:
    return [i.reason for i in lint_for_tensorrt(model) if i.view == "plugin"]


def test_attention_with_past_inputs_is_rejected():
    past = [_tensor("pk", F, [1, 2, 5, 4]), _tensor("pv", F, [1, 2, 5, 4])]
    node = helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "pko", "pvo"])
    outputs = [_tensor("y", F, None), _tensor("pko", F, None), _tensor("pvo", F, None)]
    reasons = _reasons(_model([node], QKV + past, outputs))
    assert any("past_key is not supported" in r for r in reasons)
    assert any("only the first output" in r for r in reasons)


def test_attention_with_softmax_precision_is_rejected():
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], softmax_precision=1)
    reasons = _reasons(_model([node], QKV, [_tensor("y", F, None)]))
    assert reasons == ["attribute softmax_precision makes the parser reject the node"]


def test_tensor_scatter_on_the_wrong_axis_or_not_in_place_is_rejected():
    cache, update = _tensor("c", F, [1, 2, 8, 4]), _tensor("u", F, [1, 2, 1, 4])
    index = _tensor("i", TensorProto.INT64, [1])
    node = helper.make_node("TensorScatter", ["c", "u", "i"], ["o"], axis=2)
    identity = helper.make_node("Identity", ["o"], ["out"])
    reasons = _reasons(_model([node, identity], [cache, update, index], [_tensor("out", F, None)]))
    assert any("axis must be -2" in r for r in reasons)
    assert any("must be a graph output" in r for r in reasons)


def test_unknown_ops_integer_matmul_and_dynamic_reduce_axes_are_rejected():
    x = _tensor("x", TensorProto.INT32, [2, 2])
    axes = _tensor("axes", TensorProto.INT64, [1])
    nodes = [
        helper.make_node("MatMul", ["x", "x"], ["m"]),
        helper.make_node("Cast", ["m"], ["mf"], to=F),
        helper.make_node("ReduceMean", ["mf", "axes"], ["r"]),
        helper.make_node("Einsum", ["r"], ["e"], equation="ij->ji"),
    ]
    reasons = _reasons(_model(nodes, [x, axes], [_tensor("e", F, None)]))
    assert any("input 0 (x) has dtype INT32" in r for r in reasons)
    assert any("must be a constant" in r for r in reasons)
    assert any("Einsum is not in the ONNX-TensorRT parser's operator table" in r for r in reasons)


def test_constant_axes_and_supported_ops_pass():
    x = _tensor("x", F, [2, 2])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], np.array([-1]))
    node = helper.make_node("ReduceMean", ["x", "axes"], ["r"])
    assert lint_for_tensorrt(_model([node], [x], [_tensor("r", F, None)], [axes])) == []


def test_a_custom_op_without_plugin_or_function_is_rejected_in_both_views():
    node = helper.make_node("Mystery", ["x"], ["y"], domain="acme")
    graph = helper.make_graph([node], "g", [_tensor("x", F, [1])], [_tensor("y", F, [1])])
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("acme", 1)]
    )
    issues = lint_for_tensorrt(ir.from_proto(proto))
    assert {i.view for i in issues} == {"plugin", "fallback"}
    assert all("acme::Mystery has no importer or plugin" in i.reason for i in issues)


def test_cli_lint_reports_a_clean_artifact(artifacts):
    result = CliRunner().invoke(main, ["lint", str(artifacts["qwen2"]), "--precision", "fp16"])
    assert result.exit_code == 0, result.output
    assert "0 issues" in result.output


def test_attention_with_a_used_extra_output_is_flagged_not_crashed():
    """The extra-output check summed `Value.uses()` tuples: a TypeError when one was used."""
    past = [_tensor("pk", F, [1, 2, 5, 4]), _tensor("pv", F, [1, 2, 5, 4])]
    node = helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "pko", "pvo"])
    use = helper.make_node("Identity", ["pko"], ["copied"])
    outputs = [_tensor("y", F, None), _tensor("copied", F, None)]
    reasons = _reasons(_model([node, use], QKV + past, outputs))
    assert any("only the first output" in r for r in reasons)


def test_attention_softcap_and_a_3d_mask_are_flagged():
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], softcap=0.0)
    reasons = _reasons(_model([node], QKV, [_tensor("y", F, None)]))
    assert reasons == ["attribute softcap is not supported (even 0)"]
    mask = _tensor("mask", TensorProto.BOOL, [1, 3, 3])
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"])
    reasons = _reasons(_model([node], [*QKV, mask], [_tensor("y", F, None)]))
    assert reasons == ["attn_mask must be 4D, got rank 3"]
