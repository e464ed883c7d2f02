"""The TensorRT form of a specx graph, as a sequence of onnx-ir passes.

`lower_for_tensorrt(model, precision)` returns the graph `specx build --backend trt` parses:

- every `specx::TreeAttention` node is checked to carry `plugin_namespace`/`plugin_version`
  (so TensorRT's ONNX parser imports it as the registered plugin) and the model-local
  function of the same name (the standard-op fallback the parser inlines otherwise);
  and `aot=1`, which selects the plugin's ahead-of-time kernel (no Python in the engine),
  and `softcap` (0 where the node has none), so every field the plugin registers is there;
- KV caches get a static capacity: TensorRT (>= 10.15) maps TensorScatter to its in-place
  KV-cache update layer, which needs a static sequence dimension, and its `Attention`
  takes no past/present inputs, so this is the form it accepts;
- `--precision fp16|bf16` converts the dtypes (`ConvertPrecisionPass`): TensorRT 11
  networks are strongly typed, so the graph's dtypes are the engine's precision;
- ONNX `Gelu` (opset 20; Gemma's GeGLU) is written out in elementwise ops the parser's
  operator table has (`DecomposeGeluPass`), so the lint needs no claim about Gelu itself.

Each pass returns `PassResult(model, modified)` and can be used on its own.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassBase, PassError, PassResult
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from specx.graphs import tree_attention as tree_op
from specx.graphs.ir_values import input_at
from specx.graphs.precision import FLOAT_DTYPES, ConvertPrecisionPass, is_cache_name

__all__ = [
    "CheckPluginNodesPass",
    "DecomposeGeluPass",
    "FixCacheCapacityPass",
    "PluginFieldsPass",
    "PreferAotPluginPass",
    "lower_for_tensorrt",
]


class CheckPluginNodesPass(InPlacePass):
    """Fails unless every TreeAttention node is plugin-ready and has its fallback function."""

    def call(self, model: ir.Model) -> PassResult:
        """Raises PassError naming the first node that is not plugin-ready."""
        nodes = _tree_attention_nodes(model.graph)
        if nodes and (tree_op.DOMAIN, tree_op.OP_TYPE, "") not in model.functions:
            raise PassError(
                f"the graph has {len(nodes)} {tree_op.DOMAIN}::{tree_op.OP_TYPE} nodes but no "
                "model-local function to fall back on when the plugin is not registered"
            )
        for node in nodes:
            for name, expected in (
                ("plugin_namespace", tree_op.DOMAIN),
                ("plugin_version", tree_op.PLUGIN_VERSION),
            ):
                attr = node.attributes.get(name)
                if attr is None or attr.value != expected:
                    raise PassError(
                        f"node {node.name!r}: attribute {name} is "
                        f"{None if attr is None else attr.value!r}, expected {expected!r}"
                    )
        return PassResult(model, modified=False)


class FixCacheCapacityPass(InPlacePass):
    """Gives every `past_*`/`present_*` cache a static capacity (dim 2).

    TensorRT maps TensorScatter to its KV-cache update layer, which requires the cache to be
    a network input with a static sequence dimension and updates it in place: the output
    shares the input's memory.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def call(self, model: ir.Model) -> PassResult:
        """Rewrites the cache shapes of the graph's inputs and outputs."""
        graph = model.graph
        caches = [v for v in (*graph.inputs, *graph.outputs) if is_cache_name(v.name)]
        for value in caches:
            if value.shape is None or len(value.shape) != 4:
                raise PassError(f"cache {value.name!r} is not 4D [B, Hkv, CAP, D]: {value.shape}")
            dims = list(value.shape)
            dims[2] = self.capacity
            value.shape = ir.Shape(dims)
        return PassResult(model, modified=bool(caches))


class PreferAotPluginPass(InPlacePass):
    """Sets `aot=1` on TreeAttention nodes, selecting the plugin's compiled kernel.

    With it TensorRT takes the plugin's ahead-of-time implementation, so the engine runs
    without Python.
    """

    def call(self, model: ir.Model) -> PassResult:
        """Marks every TreeAttention node."""
        nodes = _tree_attention_nodes(model.graph)
        for node in nodes:
            node.attributes["aot"] = ir.AttrInt64("aot", 1)
        return PassResult(model, modified=bool(nodes))


class PluginFieldsPass(InPlacePass):
    """Gives every TreeAttention node `softcap` = 0 where it has none.

    The plugin registers every attribute it may meet, and TensorRT hands them to it
    positionally in registration order (`specx.tensorrt.plugin`), so an optional one is
    made present rather than left for the parser to skip.
    """

    def call(self, model: ir.Model) -> PassResult:
        """Adds the missing fields."""
        missing = [
            n for n in _tree_attention_nodes(model.graph) if tree_op.SOFTCAP not in n.attributes
        ]
        for node in missing:
            node.attributes[tree_op.SOFTCAP] = ir.AttrFloat32(tree_op.SOFTCAP, 0.0)
        return PassResult(model, modified=bool(missing))


class DecomposeGeluPass(InPlacePass):
    """Gelu(x) as x * 0.5 * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 x^3))), or with Erf.

    The `approximate="tanh"` form is Gemma's GeGLU; "none" is x * 0.5 * (1 + Erf(x / sqrt 2)).
    """

    def call(self, model: ir.Model) -> PassResult:
        """Replaces every Gelu node of the main graph."""
        nodes = [n for n in model.graph if n.domain in ("", "ai.onnx") and n.op_type == "Gelu"]
        for node in nodes:
            _decompose_gelu(model.graph, node)
        return PassResult(model, modified=bool(nodes))


def _decompose_gelu(graph: ir.Graph, node: ir.Node) -> None:
    x = input_at(node, 0)
    dtype = (x.dtype or ir.DataType.FLOAT).numpy()
    made: list[ir.Node] = []

    def op(op_type: str, *inputs: ir.Value) -> ir.Value:
        made.append(ir.node(op_type, list(inputs), name=f"{node.name}/{op_type}_{len(made)}"))
        return made[-1].outputs[0]

    def const(value: float) -> ir.Value:
        tensor = ir.tensor(np.array(value, dtype=dtype))
        made.append(ir.node("Constant", [], {"value": tensor}, name=f"{node.name}/c{len(made)}"))
        return made[-1].outputs[0]

    if node.attributes.get_string("approximate", "none") == "tanh":
        cube = op("Mul", op("Mul", x, x), x)
        inner = op("Add", x, op("Mul", cube, const(0.044715)))
        gate = op("Tanh", op("Mul", inner, const(math.sqrt(2 / math.pi))))
    else:
        gate = op("Erf", op("Mul", x, const(1 / math.sqrt(2))))
    out = op("Mul", op("Mul", x, const(0.5)), op("Add", gate, const(1.0)))
    graph.insert_before(node, made)
    old, name = node.outputs[0], node.outputs[0].name
    ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    out.name = name  # a graph output keeps its name


def _tree_attention_nodes(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if (n.domain, n.op_type) == (tree_op.DOMAIN, tree_op.OP_TYPE)]


def lower_for_tensorrt(model: ir.Model, capacity: int, precision: str = "fp32") -> ir.Model:
    """The TensorRT form of `model` with `capacity`-slot caches, converted to `precision`.

    Raises:
        ValueError: `precision` is not fp32, fp16 or bf16.
        onnx_ir.passes.PassError: a TreeAttention node is not plugin-ready.
    """
    if precision not in FLOAT_DTYPES:
        raise ValueError(f"precision must be one of {sorted(FLOAT_DTYPES)}, got {precision!r}")
    passes: list[PassBase] = [CheckPluginNodesPass()]
    if precision != "fp32":
        passes.append(ConvertPrecisionPass(FLOAT_DTYPES[precision]))
    passes += [
        DecomposeGeluPass(),
        FixCacheCapacityPass(capacity),
        PreferAotPluginPass(),
        PluginFieldsPass(),
        RemoveUnusedNodesPass(),
        TopologicalSortPass(),
    ]
    for step in passes:  # not `Sequential`, which buries the failing pass's own message
        model = step(model).model
    return model
