"""The TensorRT plugin `specx::TreeAttention` (the AOT Triton kernel) equals the reference.

Needs TensorRT (>= 10.9; 10.15 for the no-plugin fallback) and a CUDA device.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install tensorrt)")
if not torch.cuda.is_available():
    pytest.skip("TensorRT needs a CUDA device", allow_module_level=True)

import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from specx.export.tree_attention_op import tree_attention_reference  # noqa: E402
from specx.graphs import tree_attention as graph_op  # noqa: E402
from specx.tensorrt.plugin import register_tree_attention_plugin  # noqa: E402

BATCH, HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 2, 4, 2, 64, 48
N, KV_LEN, MAX_N = 5, 40, 8  # N and L are dynamic in the model; these are the run's
WRITE_POS = (17, 30)
SCALE = 1 / math.sqrt(HEAD_DIM)
ONNX_TYPES = {
    torch.float32: TensorProto.FLOAT,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
}
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}
# Min, opt and max shapes of the dynamic inputs.
PROFILE = {
    name: [(BATCH, heads, n, HEAD_DIM) for n in (1, N, MAX_N)]
    for name, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))
}
PROFILE["mask"] = [(BATCH, 1, 1, 1), (BATCH, 1, N, KV_LEN), (BATCH, 1, MAX_N, CAPACITY)]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]


def tree_attention_model(dtype: torch.dtype, softcap: float = 0.0) -> onnx.ModelProto:
    """A model of one `specx::TreeAttention` node, its function attached; N and L dynamic.

    The node carries `softcap` even when 0, as `lower_for_tensorrt` (`PluginFieldsPass`)
    makes every node do.
    """
    elem = ONNX_TYPES[dtype]
    kv_new = [BATCH, KV_HEADS, "tokens", HEAD_DIM]
    cache = [BATCH, KV_HEADS, CAPACITY, HEAD_DIM]
    inputs = {
        "q": (elem, [BATCH, HEADS, "tokens", HEAD_DIM]),
        "k": (elem, kv_new),
        "v": (elem, kv_new),
        "k_cache": (elem, cache),
        "v_cache": (elem, cache),
        "write_pos": (TensorProto.INT64, [BATCH]),
        "mask": (TensorProto.BOOL, [BATCH, 1, "tokens", "kv_len"]),
    }
    outputs = {"out": inputs["q"], "k_cache_out": (elem, cache), "v_cache_out": (elem, cache)}
    node = helper.make_node(
        graph_op.OP_TYPE,
        list(graph_op.INPUTS),
        list(graph_op.OUTPUTS),
        name="tree_attention",
        domain=graph_op.DOMAIN,
        **graph_op.node_attributes(HEADS, KV_HEADS, SCALE, softcap),
    )
    if softcap == 0:
        node.attribute.append(helper.make_attribute(graph_op.SOFTCAP, 0.0))
    graph = helper.make_graph(
        [node],
        "tree_attention",
        [helper.make_tensor_value_info(name, *spec) for name, spec in inputs.items()],
        [helper.make_tensor_value_info(name, *spec) for name, spec in outputs.items()],
    )
    opsets = [helper.make_opsetid("", graph_op.FUNCTION_OPSET), helper.make_opsetid("specx", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = helper.find_min_ir_version_for(opsets, ignore_unknown=True)
    return graph_op.attach_function(model)


def parse(model: onnx.ModelProto, logger):
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString()):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise AssertionError("ONNX parse failed:\n" + "\n".join(errors))
    return builder, network, parser


def build_engine(model: onnx.ModelProto):
    logger = trt.Logger(trt.Logger.WARNING)
    builder, network, _parser = parse(model, logger)
    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    profile = builder.create_optimization_profile()
    for name, (min_shape, opt_shape, max_shape) in PROFILE.items():
        profile.set_shape(name, min_shape, opt_shape, max_shape)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, "engine build failed (see the TensorRT log above)"
    return trt.Runtime(logger).deserialize_cuda_engine(plan)


def make_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    # A star tree per row: node i sees the prefix, the root (node 0) and itself.
    mask = torch.zeros(BATCH, 1, N, KV_LEN, dtype=torch.bool)
    for b, start in enumerate(WRITE_POS):
        mask[b, 0, :, : start + 1] = True
        for i in range(N):
            mask[b, 0, i, start + i] = True
    return {
        "q": randn(BATCH, HEADS, N, HEAD_DIM),
        "k": randn(BATCH, KV_HEADS, N, HEAD_DIM),
        "v": randn(BATCH, KV_HEADS, N, HEAD_DIM),
        "k_cache": randn(BATCH, KV_HEADS, CAPACITY, HEAD_DIM),
        "v_cache": randn(BATCH, KV_HEADS, CAPACITY, HEAD_DIM),
        "write_pos": torch.tensor(WRITE_POS),
        "mask": mask,
    }


@pytest.mark.parametrize("softcap", [0.0, 0.5], ids=["uncapped", "softcap"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_matches_reference(dtype, softcap):
    register_tree_attention_plugin()
    engine = build_engine(tree_attention_model(dtype, softcap))
    # What the engine must guarantee: with each cache output bound to its input's address,
    # that buffer holds the updated cache afterwards. Whether TensorRT writes it in place or
    # copies (its docs promise in-place only for the KVCacheUpdate layer, and say it "may
    # insert copies" for plugins) is its choice; `get_aliased_input_tensor` is not asserted.
    inputs = make_inputs(dtype)
    fp32 = {name: t.float() if t.is_floating_point() else t for name, t in inputs.items()}
    expected, expected_k, expected_v = tree_attention_reference(
        **fp32, num_heads=HEADS, num_kv_heads=KV_HEADS, scale=SCALE, softcap=softcap
    )

    device = {name: t.cuda().contiguous() for name, t in inputs.items()}
    out = torch.empty_like(device["q"])
    # The caches are updated in place: each output is bound to its input's address.
    bindings = {**device, "out": out, "k_cache_out": device["k_cache"]}
    bindings["v_cache_out"] = device["v_cache"]
    context = engine.create_execution_context()
    for name in PROFILE:
        context.set_input_shape(name, tuple(device[name].shape))
    for name, tensor in bindings.items():
        context.set_tensor_address(name, tensor.data_ptr())
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)
    assert torch.equal(device["k_cache"].cpu(), expected_k.to(dtype))
    assert torch.equal(device["v_cache"].cpu(), expected_v.to(dtype))


def test_parser_imports_the_registered_plugin():
    register_tree_attention_plugin()
    _builder, network, _parser = parse(
        tree_attention_model(torch.float16), trt.Logger(trt.Logger.WARNING)
    )
    types = [network.get_layer(i).type for i in range(network.num_layers)]
    assert trt.LayerType.PLUGIN_V3 in types, types


_PARSE_ONLY = textwrap.dedent(
    """
    import json, sys
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    ok = parser.parse_from_file(sys.argv[1])
    print(json.dumps({
        "ok": bool(ok),
        "errors": [str(parser.get_error(i)) for i in range(parser.num_errors)],
        "layers": [str(network.get_layer(i).type) for i in range(network.num_layers)],
    }))
    """
)


def test_without_the_plugin_the_parser_inlines_the_function(tmp_path):
    """A fresh process, where nothing registered the plugin: the function body is used."""
    version = tuple(int(part) for part in trt.__version__.split(".")[:2])
    if version < (10, 15):
        pytest.skip(f"TensorRT {trt.__version__} lacks TensorScatter/Attention (needs 10.15)")
    path = tmp_path / "tree_attention.onnx"
    onnx.save(tree_attention_model(torch.float16), path)
    child = subprocess.run(
        [sys.executable, "-c", _PARSE_ONLY, str(path)], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["ok"], report["errors"]
    assert report["layers"] and not any("PLUGIN" in layer for layer in report["layers"])
