"""The ONNX Runtime form of a target: each TreeAttention as one com.microsoft GroupQueryAttention.

The exported TreeAttention's standard-op body (TensorScatter x2, Slice x2, Attention) and the
head transposes around it cost more than its arithmetic on a CPU: a profiled 1B int4 decode
step spent about 20% outside its MatMuls, in those nodes. ONNX Runtime's GroupQueryAttention
(GQA) does the same work in one kernel: it writes the N new keys and values into the cache
in place (the same buffer bound as past and present), at slots `seqlens_k + 1 - N` ..
`seqlens_k`, and attends over `[0, total_sequence_length)` with an additive
`attention_bias`. Rewrites, per TreeAttention node:

    seqlens_k = write_pos + N - 1,  total_sequence_length = L,  query_seqlens = N per row
    attention_bias = where(mask, 0, -inf)                         # the tree mask, unchanged
    q, k: RoPE applied in [B, N, H, D] (the same ops, cos/sin unsqueezed at axis 2) and
          flattened to [B, N, H*D], instead of transposed to [B, H, N, D] first
    v:    the projection's output before its reshape and transpose
    out:  GQA's [B, N, H*D] output replaces the transpose + reshape that followed the node

The bias, lengths and casts are built once per graph and shared by every layer. Numerics:
the same math in another kernel (logits within 1e-6 of the exported graph here, tested per
family over prefill, chain and tree steps, batch 1 and 3). Applied for ONNX Runtime builds
only (`specx build --backend ort --lowering gqa`): the artifact's exported graphs and the
TensorRT lowering keep TreeAttention. Where a node's neighbourhood does not have the
exported shape, the pass transposes around GQA instead (correct, slower); an ONNX Runtime
without GroupQueryAttention keeps the standard body (`gqa_available`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes.common import RemoveUnusedNodesPass

from specx.graphs import tree_attention as tree_op

__all__ = ["GroupQueryAttentionPass", "gqa_available"]

MS_DOMAIN = "com.microsoft"
_TO_HEADS_FIRST = [0, 2, 1, 3]


def gqa_available() -> bool:
    """Whether this ONNX Runtime has a CPU kernel for com.microsoft GroupQueryAttention."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as capi
    except ImportError:
        return False
    return any(
        s.name == "GroupQueryAttention" and s.domain == MS_DOMAIN
        for s in capi.get_all_operator_schema()
    )


class _Builder:
    """Nodes to insert before a point of the graph, and shared constants."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        self.constants: dict[str, ir.Value] = {}

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        if name not in self.constants:
            value = ir.Value(name=f"gqa_{name}", const_value=ir.tensor(array, name=f"gqa_{name}"))
            value.shape, value.type = (
                value.const_value.shape,
                ir.TensorType(value.const_value.dtype),
            )
            self.graph.register_initializer(value)
            self.constants[name] = value
        return self.constants[name]

    def at_axis_2(self, before: ir.Node, value: ir.Value) -> ir.Value:
        """Unsqueeze(value, [2]), one per value (cos and sin are shared by every layer)."""
        key = f"axis_2:{id(value)}"
        if key not in self.constants:
            axis = self.const("axis_2", np.array([2], np.int64))
            self.constants[key] = self.node(before, "Unsqueeze", [value, axis]).outputs[0]
        return self.constants[key]

    def node(self, before: ir.Node, op: str, inputs, attributes=None, **kwargs) -> ir.Node:
        node = ir.node(op, inputs, attributes or {}, **kwargs)
        self.graph.insert_before(before, node)
        return node


class GroupQueryAttentionPass(InPlacePass):
    """Replaces every TreeAttention node of the main graph by GroupQueryAttention."""

    def call(self, model: ir.Model) -> PassResult:  # noqa: D102
        graph = model.graph
        nodes = [n for n in graph if (n.domain, n.op_type) == (tree_op.DOMAIN, tree_op.OP_TYPE)]
        if not nodes:
            return PassResult(model, modified=False)
        build = _Builder(graph)
        shared = _shared_inputs(build, nodes[0])
        for node in nodes:
            _replace(build, node, shared)
        model.opset_imports.setdefault(MS_DOMAIN, 1)
        RemoveUnusedNodesPass()(model)
        return PassResult(model, modified=True)


def _shared_inputs(build: _Builder, first: ir.Node) -> dict[str, ir.Value]:
    """GQA's seqlens_k, total_sequence_length, query_seqlens and bias, built once.

    From the first node's q, write_pos and mask, which every layer shares.
    """
    q, mask, write_pos = first.inputs[0], first.inputs[6], first.inputs[5]
    i32 = ir.DataType.INT32
    add = lambda op, inputs, **attrs: build.node(first, op, inputs, attrs).outputs[0]  # noqa: E731
    bias = add("Where", [mask, build.const("zero", np.array(0.0, np.float32)),
                         build.const("neg_inf", np.array(-np.inf, np.float32))])  # fmt: skip
    n = add("Squeeze", [add("Shape", [q], start=2, end=3)])
    last = add("Sub", [add("Add", [write_pos, n]), build.const("one", np.array(1, np.int64))])
    total = add("Squeeze", [add("Shape", [mask], start=3, end=4)])
    per_row = add("Expand", [n, add("Shape", [write_pos])])
    return {
        "bias": bias,
        "seqlens_k": add("Cast", [last], to=i32),
        "total": add("Cast", [total], to=i32),
        "query_seqlens": add("Cast", [per_row], to=i32),
    }


def _replace(build: _Builder, node: ir.Node, shared: dict) -> None:
    q, k, v, k_cache, v_cache = node.inputs[:5]
    attrs = node.attributes
    inputs = [
        _flat_rotated(build, node, q),
        _flat_rotated(build, node, k),
        _flat_input(build, node, v),
        k_cache,
        v_cache,
        shared["seqlens_k"],
        shared["total"],
        None,
        None,
        None,
        shared["bias"],
        None,
        None,
        None,
        None,
        None,
        shared["query_seqlens"],
    ]
    gqa = build.node(
        node,
        "GroupQueryAttention",
        inputs,
        {
            "num_heads": attrs["num_heads"].value,
            "kv_num_heads": attrs["num_kv_heads"].value,
            "scale": attrs["scale"].value,
        },
        domain=MS_DOMAIN,
        num_outputs=3,
        name=f"{node.name}_gqa",
    )
    out, present_key, present_value = gqa.outputs
    _use_flat_output(build, node, out)
    for old, new in ((node.outputs[1], present_key), (node.outputs[2], present_value)):
        new.shape, new.type = old.shape, old.type
        name = old.name
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        old.name, new.name = f"{name}_tree_attention", name
    build.graph.remove(node, safe=True)


def _heads_first(value: ir.Value) -> ir.Value | None:
    """The [B, N, H, D] value behind `value` = Transpose(it, [0, 2, 1, 3]), if so."""
    producer = value.producer()
    if producer is None or producer.op_type != "Transpose" or producer.domain != "":
        return None
    perm = producer.attributes.get_ints("perm", None)
    return producer.inputs[0] if perm is not None and list(perm) == _TO_HEADS_FIRST else None


def _flat(build: _Builder, before: ir.Node, value: ir.Value) -> ir.Value:
    shape = build.const("flat", np.array([0, 0, -1], np.int64))
    return build.node(before, "Reshape", [value, shape]).outputs[0]


def _flat_input(build: _Builder, node: ir.Node, value: ir.Value) -> ir.Value:
    """[B, N, H*D] of a [B, H, N, D] input: the reshape's input when the graph has one."""
    tokens_first = _heads_first(value)
    if tokens_first is not None:
        reshape = tokens_first.producer()
        if reshape is not None and reshape.op_type == "Reshape" and reshape.inputs[0].shape:
            if len(reshape.inputs[0].shape) == 3:
                return reshape.inputs[0]
        return _flat(build, node, tokens_first)
    moved = build.node(node, "Transpose", [value], {"perm": _TO_HEADS_FIRST}).outputs[0]
    return _flat(build, node, moved)


def _flat_rotated(build: _Builder, node: ir.Node, value: ir.Value) -> ir.Value:
    """[B, N, H*D] of RoPE(x), where the graph computes it on Transpose(x).

    The same RoPE ops are redone on x itself, with cos/sin unsqueezed at axis 2, not 1.
    """
    rotated = _rope_on_tokens_first(build, node, value)
    return _flat(build, node, rotated) if rotated is not None else _flat_input(build, node, value)


def _rope_on_tokens_first(build: _Builder, node: ir.Node, value: ir.Value) -> ir.Value | None:
    """Recomputes the RoPE subgraph ending in `value` on the pre-transpose tensor, or None.

    Expected (the exporter's form of `x * cos + rotate_half(x) * sin`):
        Add(Mul(xt, cos_u), Mul(Concat(Neg(Split(xt)[1]), Split(xt)[0]), sin_u)),
        xt = Transpose(x, [0, 2, 1, 3]), cos_u = Unsqueeze(cos, [1]), sin_u likewise.
    """
    add = value.producer()
    if add is None or add.op_type != "Add":
        return None
    direct, rotated = (p.producer() for p in add.inputs)
    if direct is None or rotated is None or direct.op_type != "Mul" or rotated.op_type != "Mul":
        return None
    xt, cos_u = direct.inputs
    x = _heads_first(xt)
    concat = rotated.inputs[0].producer()
    sin_u = rotated.inputs[1]
    if x is None or concat is None or concat.op_type != "Concat":
        return None
    neg, first_half = concat.inputs[0].producer(), concat.inputs[1]
    split = first_half.producer()
    if neg is None or neg.op_type != "Neg" or split is None or split.op_type != "Split":
        return None
    if split.inputs[0] is not xt or neg.inputs[0] is not split.outputs[1]:
        return None
    cos, sin = _unsqueezed_source(cos_u), _unsqueezed_source(sin_u)
    if cos is None or sin is None:
        return None
    cos2, sin2 = build.at_axis_2(node, cos), build.at_axis_2(node, sin)
    halves = build.node(node, "Split", [x, *split.inputs[1:]], split.attributes, num_outputs=2)
    negated = build.node(node, "Neg", [halves.outputs[1]]).outputs[0]
    turned = build.node(node, "Concat", [negated, halves.outputs[0]], concat.attributes)
    straight = build.node(node, "Mul", [x, cos2]).outputs[0]
    crossed = build.node(node, "Mul", [turned.outputs[0], sin2]).outputs[0]
    return build.node(node, "Add", [straight, crossed]).outputs[0]


def _unsqueezed_source(value: ir.Value) -> ir.Value | None:
    """The [B, N, D] tensor behind Unsqueeze(it, [1]), if `value` is that."""
    producer = value.producer()
    if producer is None or producer.op_type != "Unsqueeze":
        return None
    axes = producer.inputs[1].const_value if len(producer.inputs) > 1 else None
    if axes is None or axes.numpy().tolist() != [1]:
        return None
    return producer.inputs[0]


def _use_flat_output(build: _Builder, node: ir.Node, out: ir.Value) -> None:
    """Gives GQA's [B, N, H*D] output to what consumed the node's [B, H, N, D] output."""
    old = node.outputs[0]
    uses = list(old.uses())
    if len(uses) == 1:
        transpose = uses[0].node
        perm = transpose.attributes.get_ints("perm", None)
        later = list(transpose.outputs[0].uses()) if transpose.op_type == "Transpose" else []
        if perm is not None and list(perm) == _TO_HEADS_FIRST and len(later) == 1:
            reshape = later[0].node
            if reshape.op_type == "Reshape" and reshape.outputs[0].shape is not None:
                if len(reshape.outputs[0].shape) == 3:
                    out.shape, out.type = reshape.outputs[0].shape, reshape.outputs[0].type
                    ir.convenience.replace_all_uses_with(reshape.outputs[0], out)
                    build.graph.remove([reshape, transpose], safe=True)
                    return
    # Otherwise give the consumers [B, H, N, D] back.
    heads = build.node(node, "Shape", [node.inputs[0]]).outputs[0]
    order = build.const("tokens_first", np.array(_TO_HEADS_FIRST, np.int64))
    shape = build.node(node, "Gather", [heads, order]).outputs[0]
    split = build.node(node, "Reshape", [out, shape]).outputs[0]
    back = build.node(node, "Transpose", [split], {"perm": _TO_HEADS_FIRST}).outputs[0]
    back.shape, back.type = old.shape, old.type
    ir.convenience.replace_all_uses_with(old, back)
