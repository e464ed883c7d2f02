"""PackSiblingMatMulsPass: q/k/v and gate/up MatMuls packed into one, same values."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from specx.artifact import load_manifest
from specx.graphs.packed_matmuls import PackSiblingMatMulsPass
from specx.sessions import load_session


def _graph() -> onnx.ModelProto:
    """x feeds q/k/v-like MatMuls (packable), and two MatMuls sharing one weight (not)."""
    rng = np.random.default_rng(0)
    weights = {
        name: rng.standard_normal(shape).astype(np.float32)
        for name, shape in [("wq", (8, 8)), ("wk", (8, 4)), ("wv", (8, 4)), ("tied", (8, 8))]
    }
    nodes = [helper.make_node("MatMul", ["x", w], [f"y_{w}"]) for w in ("wq", "wk", "wv")]
    nodes += [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("MatMul", ["r", "tied"], ["t1"]),
        helper.make_node("MatMul", ["x", "tied"], ["t2"]),
        helper.make_node("Add", ["y_wk", "y_wv"], ["kv"]),
    ]
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "siblings",
        [helper.make_tensor_value_info("x", f32, ["b", "n", 8])],
        [
            helper.make_tensor_value_info("y_wq", f32, ["b", "n", 8]),
            helper.make_tensor_value_info("kv", f32, ["b", "n", 4]),
            helper.make_tensor_value_info("t1", f32, ["b", "n", 8]),
            helper.make_tensor_value_info("t2", f32, ["b", "n", 8]),
        ],
        [numpy_helper.from_array(w, name) for name, w in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return load_session(model.SerializeToString()).run(None, {"x": x})


def test_siblings_are_packed_into_one_matmul_with_the_same_values():
    model = _graph()
    result = PackSiblingMatMulsPass()(ir.from_proto(model))
    assert result.modified
    packed = ir.to_proto(result.model)
    onnx.checker.check_model(packed, full_check=True)
    ops = [n.op_type for n in packed.graph.node]
    # q/k/v -> one MatMul + Split; the tied weight's two MatMuls stay apart.
    assert ops.count("MatMul") == 3 and ops.count("Split") == 1
    assert {t.name for t in packed.graph.initializer}.isdisjoint({"wq", "wk", "wv"})
    assert [o.name for o in packed.graph.output] == ["y_wq", "kv", "t1", "t2"]
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
    for before, after in zip(_run(model, x), _run(packed, x), strict=True):
        np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


def test_exported_graphs_have_no_unpacked_siblings(artifacts):
    manifest = load_manifest(artifacts["llama"])
    graph = onnx.load(str(manifest.path(manifest.graph("target").file))).graph
    weights = {t.name for t in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in weights:
            readers[node.input[0]] = readers.get(node.input[0], 0) + 1
    assert readers and max(readers.values()) == 1
    layers = manifest.model.num_layers
    assert sum(n.op_type == "Split" and len(n.output) == 3 for n in graph.node) == layers
