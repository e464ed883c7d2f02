"""RowInvariantPass: single rows padded to two so a token's result does not depend on its chunk."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specx.artifact import load_manifest
from specx.graphs import tree_attention as tree_op
from specx.graphs.row_invariance import RowInvariantPass
from specx.masks import causal_mask
from specx.sessions import load_session

WIDTH = 8


def _qdq_graph() -> onnx.ModelProto:
    """x -> Mul -> h (a graph output), quantized into two MatMuls, summed into y.

    The shape of ONNX Runtime's quantizer output: `h` is routed through Q/DQ and the graph
    output is the dequantized copy; each MatMul has its own Q/DQ pair.
    """
    rng = np.random.default_rng(0)
    scale = numpy_helper.from_array(np.array(0.02, np.float32), "scale")
    zero = numpy_helper.from_array(np.array(0, np.int8), "zero")
    initializers = [scale, zero, numpy_helper.from_array(np.full(WIDTH, 1.5, np.float32), "g")]
    nodes = [helper.make_node("Mul", ["x", "g"], ["h_QuantizeLinear_Input"])]
    for i in range(2):
        weight = rng.integers(-127, 128, (WIDTH, WIDTH)).astype(np.int8)
        initializers += [
            numpy_helper.from_array(weight, f"w{i}"),
            numpy_helper.from_array(np.full(WIDTH, 0.01, np.float32), f"w{i}_scale"),
            numpy_helper.from_array(np.zeros(WIDTH, np.int8), f"w{i}_zero"),
        ]
        dequantized = "h" if i == 0 else f"h_dq{i}"
        nodes += [
            helper.make_node(
                "QuantizeLinear", ["h_QuantizeLinear_Input", "scale", "zero"], [f"h_q{i}"]
            ),
            helper.make_node("DequantizeLinear", [f"h_q{i}", "scale", "zero"], [dequantized]),
            helper.make_node(
                "DequantizeLinear", [f"w{i}", f"w{i}_scale", f"w{i}_zero"], [f"w{i}_dq"], axis=1
            ),
            helper.make_node("MatMul", [dequantized, f"w{i}_dq"], [f"m{i}"]),
        ]
    nodes.append(helper.make_node("Add", ["m0", "m1"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n", WIDTH])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n", WIDTH]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", "n", WIDTH]),
            helper.make_tensor_value_info("m0", TensorProto.FLOAT, ["batch", "n", WIDTH]),
        ],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _padded(model: onnx.ModelProto) -> onnx.ModelProto:
    result = RowInvariantPass()(ir.from_proto(model))
    assert result.modified
    padded = ir.to_proto(result.model)
    onnx.checker.check_model(padded)
    return padded


def _run(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    session = load_session(model.SerializeToString())
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"x": x}), strict=True))


def test_quantized_matmuls_see_an_extra_row_and_outputs_keep_their_rows():
    model = _qdq_graph()
    padded = _padded(model)
    graph = padded.graph
    producers = {out: node for node in graph.node for out in node.output}
    for node in graph.node:
        if node.op_type == "QuantizeLinear":
            concat = producers[node.input[0]]
            assert concat.op_type == "Concat", node.name
            assert producers[concat.input[1]].op_type == "Slice"  # the copied last row
        if node.op_type == "MatMul":
            users = [n for n in graph.node if node.output[0] in n.input]
            assert [n.op_type for n in users] == ["Slice"], node.name
    # One padded copy of the shared input, not one per MatMul.
    assert sum(n.op_type == "Concat" for n in graph.node) == 1
    assert [o.name for o in graph.output] == ["y", "h", "m0"]
    # The hidden-state output is the float value again, not its dequantized copy.
    assert producers["h"].op_type == "Mul"

    rng = np.random.default_rng(1)
    for shape in ((1, 1, WIDTH), (2, 1, WIDTH), (1, 5, WIDTH)):
        x = rng.standard_normal(shape).astype(np.float32)
        before, after = _run(model, x), _run(padded, x)
        assert after["y"].shape == after["m0"].shape == shape
        np.testing.assert_allclose(after["y"], before["y"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(after["m0"], before["m0"], rtol=1e-6, atol=1e-6)
        # Unquantized, as a draft head reads it.
        np.testing.assert_array_equal(after["h"], x * np.float32(1.5))
    # A row alone comes out bit-identical to the same row among others (ONNX Runtime's
    # integer MatMul takes another path for one row; on this machine its result differs).
    x = rng.standard_normal((1, 4, WIDTH)).astype(np.float32)
    np.testing.assert_array_equal(_run(padded, x[:, :1])["y"], _run(padded, x)["y"][:, :1])


def test_a_graph_without_quantized_matmuls_or_tree_attention_is_left_alone():
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "float",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, WIDTH])],
        [numpy_helper.from_array(np.eye(WIDTH, dtype=np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    assert not RowInvariantPass()(ir.from_proto(model)).modified


def _chunked_logits(
    session: ort.InferenceSession, prompt: list[int], continuation: list[int], chunk: int
) -> np.ndarray:
    """Logits of `continuation` after a prefill of `prompt`, fed `chunk` tokens at a time."""
    capacity = len(prompt) + len(continuation)
    inputs = {i.name: i for i in session.get_inputs()}
    caches = {
        name: np.zeros((1, spec.shape[1], capacity, spec.shape[3]), np.float32)
        for name, spec in inputs.items()
        if name.startswith("past_")
    }
    outputs = [o.name for o in session.get_outputs()]
    rows, start = [], 0
    steps = [prompt] + [continuation[i : i + chunk] for i in range(0, len(continuation), chunk)]
    for tokens in steps:
        n = len(tokens)
        feed = {
            "input_ids": np.array([tokens], np.int64),
            "position_ids": (start + np.arange(n, dtype=np.int64))[None],
            "attention_mask": causal_mask(np.array([start]), n, start + n),
            "write_pos": np.array([start], np.int64),
            **caches,
        }
        result = dict(zip(outputs, session.run(None, feed), strict=True))
        caches = {name: result[name.replace("past_", "present_")] for name in caches}
        rows.append(result["logits"][0])
        start += n
    return np.concatenate(rows[1:])


def test_tree_attention_rows_are_bit_identical_for_any_chunk(artifacts):
    """The float target with the row-invariant TreeAttention body, on ONNX Runtime."""
    manifest = load_manifest(artifacts["llama"])
    model = onnx.load(str(manifest.path(manifest.graph("target").file)))
    padded = ir.to_proto(RowInvariantPass()(ir.from_proto(model)).model)
    function = next(f for f in padded.functions if f.name == tree_op.OP_TYPE)
    assert function == tree_op.function_proto(row_invariant=True)
    assert len(padded.graph.initializer) == len(model.graph.initializer)  # nothing else added
    session = load_session(padded.SerializeToString())
    rng = np.random.default_rng(0)
    vocab = manifest.model.vocab_size
    for _ in range(3):
        prompt, continuation = rng.integers(0, vocab, 17).tolist(), rng.integers(0, vocab, 6)
        one = _chunked_logits(session, prompt, continuation.tolist(), 1)
        for chunk in (2, 3, 6):
            chunked = _chunked_logits(session, prompt, continuation.tolist(), chunk)
            np.testing.assert_array_equal(chunked, one, err_msg=f"chunk {chunk}")
    # Same values as the exported body, to float rounding.
    original = load_session(model.SerializeToString())
    np.testing.assert_allclose(
        _chunked_logits(original, prompt, continuation.tolist(), 3), one, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("softcap", [0.0, 0.7], ids=["uncapped", "softcap"])
@pytest.mark.parametrize("row_invariant", [False, True])
def test_the_function_body_computes_the_reference_attention(row_invariant, softcap):
    """Every body against numpy: write the new rows, attend under the mask (GQA), capped."""
    rng = np.random.default_rng(2)
    heads, kv_heads, dim, capacity, n, start = 4, 2, 8, 16, 3, 5
    node = helper.make_node(
        tree_op.OP_TYPE,
        list(tree_op.INPUTS),
        list(tree_op.OUTPUTS),
        domain=tree_op.DOMAIN,
        **tree_op.node_attributes(heads, kv_heads, 0.3, softcap),
    )
    f32, i64, b = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    graph = helper.make_graph(
        [node],
        "attention",
        [
            helper.make_tensor_value_info("q", f32, [1, heads, n, dim]),
            helper.make_tensor_value_info("k", f32, [1, kv_heads, n, dim]),
            helper.make_tensor_value_info("v", f32, [1, kv_heads, n, dim]),
            helper.make_tensor_value_info("k_cache", f32, [1, kv_heads, capacity, dim]),
            helper.make_tensor_value_info("v_cache", f32, [1, kv_heads, capacity, dim]),
            helper.make_tensor_value_info("write_pos", i64, [1]),
            helper.make_tensor_value_info("mask", b, [1, 1, n, start + n]),
        ],
        [helper.make_tensor_value_info(name, f32, None) for name in tree_op.OUTPUTS],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(tree_op.DOMAIN, 1)],
        functions=[tree_op.function_proto(row_invariant, softcap=softcap > 0)],
    )
    q = rng.standard_normal((1, heads, n, dim)).astype(np.float32)
    k, v = (rng.standard_normal((1, kv_heads, n, dim)).astype(np.float32) for _ in range(2))
    caches = [rng.standard_normal((1, kv_heads, capacity, dim)).astype(np.float32) for _ in "kv"]
    mask = causal_mask(np.array([start]), n, start + n)
    mask[0, 0, 2, start + 1] = False  # a tree: node 2 does not see node 1
    session = load_session(model.SerializeToString())
    feed = dict(q=q, k=k, v=v, k_cache=caches[0], v_cache=caches[1])
    out, *_ = session.run(None, {**feed, "write_pos": np.array([start]), "mask": mask})
    keys, values = (c.copy() for c in caches)
    keys[:, :, start : start + n], values[:, :, start : start + n] = k, v
    group = heads // kv_heads
    keys, values = (np.repeat(a[:, :, : start + n], group, axis=1) for a in (keys, values))
    scores = 0.3 * q @ keys.transpose(0, 1, 3, 2)
    if softcap:
        assert np.abs(scores).max() > 2 * softcap  # the cap bends these scores
        scores = softcap * np.tanh(scores / softcap)
    scores = np.where(mask, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = (weights / weights.sum(-1, keepdims=True)) @ values
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
