"""TensorRT lint: does the ONNX-TensorRT parser accept every node of a graph?

The table below is the parser's documented operator support (onnx-tensorrt
`docs/operators.md` for TensorRT 10.15, opsets 9-24, and its static op checkers): the
ops specx graphs use or could plausibly contain, with the dtypes and restrictions the
parser states. TensorRT >= 10.15 is the floor: it is the first version whose parser
imports TensorScatter (as its in-place KV-cache update layer) and RMSNormalization.

A graph is linted twice, because the parser takes a `specx::TreeAttention` node in one of
two ways: as the registered plugin (`plugin` view: the node itself is checked against
the plugin's contract), or, when no plugin is registered, by inlining its model-local
function (`fallback` view: every standard op of the body must import).

Sources, rule by rule: "[docs]" is `docs/operators.md` (10.15), "[checker]" the parser's
op checkers (onnxOpCheckers.cpp), "[specx]" a choice of this project with its reason,
not a documented parser rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import onnx_ir as ir
from onnx_ir.passes.common import InlinePass, ShapeInferencePass

from specx.graphs import tree_attention as tree_op
from specx.graphs.ir_values import input_at

__all__ = ["TRT_OPS", "LintIssue", "OpSupport", "lint_for_tensorrt"]

_D = ir.DataType
FLOATS = frozenset({_D.FLOAT, _D.FLOAT16, _D.BFLOAT16})
NUMERIC = FLOATS | {_D.INT32, _D.INT64}
ANY = NUMERIC | {_D.BOOL}
MIN_OPSET, MAX_OPSET = 9, 24

Check = Callable[[ir.Node, ir.Graph], list[str]]


@dataclass(frozen=True)
class OpSupport:
    """What the parser accepts for one op: tensor dtypes, per-input overrides, extra checks."""

    dtypes: frozenset[ir.DataType]
    input_dtypes: dict[int, frozenset[ir.DataType]] = field(default_factory=dict)
    checks: tuple[Check, ...] = ()


@dataclass(frozen=True)
class LintIssue:
    """One node TensorRT would not import, and why."""

    graph: str
    view: str  # "plugin" or "fallback"
    node: str
    op_type: str
    reason: str

    def __str__(self) -> str:
        return f"{self.graph} [{self.view}] {self.op_type} node {self.node!r}: {self.reason}"


def _is_constant(value: ir.Value | None) -> bool:
    if value is None:
        return True
    producer = value.producer()
    return value.const_value is not None or (
        producer is not None and producer.op_type == "Constant"
    )


def _constant_inputs(*indices: int) -> Check:
    def check(node: ir.Node, graph: ir.Graph) -> list[str]:
        present = [(i, node.inputs[i]) for i in indices if i < len(node.inputs)]
        return [
            f"input {i} ({value.name}) must be a constant (initializer or Constant)"
            for i, value in present
            if value is not None and not _is_constant(value)
        ]

    return check


def _attribute_is(name: str, allowed: tuple[object, ...], default: object) -> Check:
    def check(node: ir.Node, graph: ir.Graph) -> list[str]:
        attr = node.attributes.get(name)
        value = default if attr is None else attr.value
        return [] if value in allowed else [f"attribute {name}={value!r}; supported: {allowed}"]

    return check


def _rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def _attention(node: ir.Node, graph: ir.Graph) -> list[str]:
    problems = []
    names = ("past_key", "past_value", "nonpad_kv_seqlen")
    for index, name in enumerate(names, start=4):
        if index < len(node.inputs) and node.inputs[index] is not None:
            problems.append(f"input {name} is not supported (no past/present in TensorRT)")
    if any(o is not None and (len(o.uses()) > 0 or o in graph.outputs) for o in node.outputs[1:]):
        problems.append("only the first output is supported (no present_key/value, qk output)")
    # [docs] qk_matmul_output_mode is unsupported. [specx] softmax_precision: no source
    # documents it either way; refused so the graph never depends on it.
    for attr in ("softmax_precision", "qk_matmul_output_mode"):
        if attr in node.attributes:
            problems.append(f"attribute {attr} makes the parser reject the node")
    if "softcap" in node.attributes:
        # operators.md (10.15) lists softcap among Attention's unsupported attributes, with no
        # exception for 0: the attribute itself is refused.
        problems.append("attribute softcap is not supported (even 0)")
    for index, name in enumerate(("Q", "K", "V")):
        if _rank(node.inputs[index]) not in (4, None):
            problems.append(f"{name} must be 4D, got rank {_rank(node.inputs[index])}")
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    if mask is not None:
        if mask.dtype not in (_D.BOOL, input_at(node, 0).dtype):  # [docs]
            problems.append(f"attn_mask must be BOOL or Q's dtype, got {mask.dtype}")
        if _rank(mask) not in (4, None):  # [docs] a 4D attn_mask
            problems.append(f"attn_mask must be 4D, got rank {_rank(mask)}")
        # [specx] no source states it; causal masking is expressed by the mask here, and
        # two masks on one node is a combination the project never needs.
        if node.attributes.get_int("is_causal", 0):
            problems.append("is_causal cannot be combined with attn_mask")
    return problems


def _tensor_scatter(node: ir.Node, graph: ir.Graph) -> list[str]:
    cache, update = input_at(node, 0), node.inputs[1]
    problems = [
        f"{name} must be 4D, got rank {_rank(v)}"
        for name, v in (("past_cache", cache), ("update", update))
        if _rank(v) not in (4, None)
    ]
    axis = node.attributes.get_int("axis", -2)
    if axis != -2:
        problems.append(f"axis must be -2, got {axis}")
    if node.attributes.get_string("mode", "linear") != "linear":
        problems.append("only mode='linear' is supported")
    # [specx] TensorScatter imports as TensorRT's KV-cache update layer, which updates its
    # cache in place (NVIDIA's KVCacheUpdate docs): the project keeps the cache a graph input
    # with a static capacity and the result a graph output, the one form those docs show.
    if cache not in graph.inputs:
        problems.append(f"past_cache {cache.name!r} must be a graph input (updated in place)")
    elif cache.shape is not None and not isinstance(cache.shape[2], int):
        problems.append(f"past_cache {cache.name!r} needs a static capacity (dim 2)")
    if node.outputs[0] not in graph.outputs:
        problems.append(f"present_cache {node.outputs[0].name!r} must be a graph output")
    return problems


def _constant(node: ir.Node, graph: ir.Graph) -> list[str]:
    unsupported = {"sparse_value", "value_string", "value_strings"}
    return [f"attribute {a} is not supported" for a in unsupported & set(node.attributes)]


_REDUCE = OpSupport(NUMERIC, checks=(_constant_inputs(1),))
_ELEMENTWISE = OpSupport(NUMERIC)
_MOVE = OpSupport(ANY)
_FLOAT_MATH = OpSupport(FLOATS)

TRT_OPS: dict[str, OpSupport] = {
    **dict.fromkeys(("Add", "Sub", "Mul", "Div", "Mod", "Pow", "Neg", "Max", "Min"), _ELEMENTWISE),
    **dict.fromkeys(("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"), _ELEMENTWISE),
    **dict.fromkeys(("And", "Or", "Not", "Xor"), OpSupport(frozenset({_D.BOOL}))),
    **dict.fromkeys(("Cos", "Sin", "Sqrt", "Reciprocal", "Sigmoid", "Exp", "Log"), _FLOAT_MATH),
    **dict.fromkeys(("Tanh", "Erf", "Relu", "Softmax", "MatMul", "Gemm"), _FLOAT_MATH),
    **dict.fromkeys(
        ("Concat", "Expand", "Gather", "Identity", "Reshape", "Shape", "Slice", "Split"), _MOVE
    ),
    **dict.fromkeys(("Tile", "Transpose", "Trilu", "Where", "Flatten", "Size"), _MOVE),
    **dict.fromkeys(("Squeeze", "Unsqueeze"), OpSupport(ANY, checks=(_constant_inputs(1),))),
    **dict.fromkeys(("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"), _REDUCE),
    **dict.fromkeys(("Cast", "CastLike"), OpSupport(ANY | {_D.UINT8})),
    "Constant": OpSupport(ANY, checks=(_constant,)),
    "ConstantOfShape": OpSupport(ANY),
    "Range": OpSupport(NUMERIC),
    "ArgMax": OpSupport(NUMERIC),
    "CumSum": OpSupport(FLOATS, input_dtypes={1: NUMERIC}, checks=(_constant_inputs(1),)),
    "TopK": OpSupport(NUMERIC, checks=(_attribute_is("sorted", (1,), 1),)),
    "ScatterND": OpSupport(NUMERIC, checks=(_attribute_is("reduction", ("none",), "none"),)),
    "RMSNormalization": OpSupport(FLOATS),
    "LayerNormalization": OpSupport(FLOATS),
    "Attention": OpSupport(FLOATS, input_dtypes={3: FLOATS | {_D.BOOL}}, checks=(_attention,)),
    "TensorScatter": OpSupport(
        FLOATS | {_D.INT32},
        input_dtypes={2: frozenset({_D.INT32, _D.INT64})},
        checks=(_tensor_scatter,),
    ),
}

# The plugin's contract: q/k/v/caches/out in one float dtype, write_pos INT64, mask BOOL.
_PLUGIN = OpSupport(FLOATS, input_dtypes={5: frozenset({_D.INT64}), 6: frozenset({_D.BOOL})})
_PLUGIN_ATTRIBUTES = {
    "num_heads",
    "num_kv_heads",
    "scale",
    "softcap",
    "plugin_namespace",
    "plugin_version",
}


def _node_issues(node: ir.Node, graph: ir.Graph, plugin_view: bool) -> list[str]:
    is_tree_attention = (node.domain, node.op_type) == (tree_op.DOMAIN, tree_op.OP_TYPE)
    if node.domain not in ("", "ai.onnx"):
        if not (plugin_view and is_tree_attention):
            return [f"custom-domain op {node.domain}::{node.op_type} has no importer or plugin"]
        support = _PLUGIN
        missing = _PLUGIN_ATTRIBUTES - set(node.attributes)
        problems = [f"plugin attributes missing: {sorted(missing)}"] if missing else []
    elif node.op_type in TRT_OPS:
        support, problems = TRT_OPS[node.op_type], []
    else:
        return [f"{node.op_type} is not in the ONNX-TensorRT parser's operator table"]
    for index, value in enumerate(node.inputs):
        allowed = support.input_dtypes.get(index, support.dtypes)
        if value is not None and value.dtype is not None and value.dtype not in allowed:
            problems.append(f"input {index} ({value.name}) has dtype {value.dtype.name}")
    if node.op_type != "Shape":
        for value in node.outputs:
            if value.dtype is not None and value.dtype not in support.dtypes | ANY:
                problems.append(f"output {value.name} has dtype {value.dtype.name}")
    for check in support.checks:
        problems += check(node, graph)
    return problems


def lint_for_tensorrt(model: ir.Model, name: str = "graph") -> list[LintIssue]:
    """Every node of `model` TensorRT's ONNX parser would reject, in both views.

    `model` is not modified. An empty list means the parser imports the graph with the
    TreeAttention plugin registered and also without it.
    """
    issues = []
    opset = model.opset_imports.get("", None)
    if opset is not None and not MIN_OPSET <= opset <= MAX_OPSET:
        reason = f"default-domain opset {opset} is outside TensorRT's {MIN_OPSET}-{MAX_OPSET}"
        issues.append(LintIssue(name, "plugin", "", "model", reason))
    for view in ("plugin", "fallback"):
        graph_model = model if view == "plugin" else _inlined(model)
        for node in graph_model.graph:
            for reason in _node_issues(node, graph_model.graph, view == "plugin"):
                issues.append(LintIssue(name, view, node.name or "", node.op_type, reason))
    return issues


def _inlined(model: ir.Model) -> ir.Model:
    copy = ir.from_proto(ir.to_proto(model))
    copy = InlinePass()(copy).model
    return ShapeInferencePass()(copy).model
