"""The `specx::TreeAttention` ONNX op: schema, standard-op function body, and attachment.

One node per attention layer of an exported graph::

    out, k_cache_out, v_cache_out = TreeAttention(
        q,          # [B, H, N, D]     queries of the N new tokens (tree nodes), RoPE applied
        k, v,       # [B, Hkv, N, D]   their keys (RoPE applied) and values
        k_cache,    # [B, Hkv, CAP, D] fixed-capacity caches, updated in place where bound so
        v_cache,
        write_pos,  # [B] int64        slot of the first new token per sequence
        mask,       # [B, 1, N, L] bool, L <= CAP: True where query i may see cache slot j
    )

Rule: the N new rows are written to slots `write_pos[b] .. write_pos[b] + N - 1`, then
every query attends over cache slots `[0, L)` under `mask` (grouped-query attention
when H > Hkv). A tree is expressed entirely by the mask: node i sees the prefix, its
ancestors and itself. Reading only `[0, L)` keeps the cost independent of CAP.
Attention weights are `softmax(where(mask, cap(scale * q.k), -inf))`, where `cap(s) =
softcap * tanh(s / softcap)` when the node carries a `softcap` attribute > 0 (Gemma 2) and
`cap(s) = s` otherwise: capped before masking, so masked slots stay at -inf.

The node carries `plugin_namespace`/`plugin_version`, so the TensorRT ONNX parser maps
it to a registered plugin of the same name; without one, TensorRT and ONNX Runtime
both inline the model-local function defined here from standard ops (TensorScatter,
Slice, Attention; opset 24). A graph whose nodes carry `softcap` gets a body that computes
the attention itself (MatMul, Tanh, Where, Softmax), because ONNX Attention's own `softcap`
attribute is one TensorRT's parser refuses (`specx.graphs.trt_lint`).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx import helper

__all__ = [
    "DOMAIN",
    "FUNCTION_OPSET",
    "INPUTS",
    "OP_TYPE",
    "OUTPUTS",
    "PLUGIN_VERSION",
    "attach_function",
    "attach_function_ir",
    "function_proto",
    "graph_uses_softcap",
    "node_attributes",
    "uses_softcap",
]

DOMAIN = "specx"
OP_TYPE = "TreeAttention"
PLUGIN_VERSION = "1"
FUNCTION_OPSET = 24
INPUTS = ("q", "k", "v", "k_cache", "v_cache", "write_pos", "mask")
OUTPUTS = ("out", "k_cache_out", "v_cache_out")
ATTRIBUTES = ("num_heads", "num_kv_heads", "scale", "plugin_namespace", "plugin_version")
SOFTCAP = "softcap"


def node_attributes(
    num_heads: int, num_kv_heads: int, scale: float, softcap: float = 0.0
) -> dict[str, object]:
    """The attributes of a TreeAttention node, plugin fields included; `softcap` only if > 0."""
    attributes: dict[str, object] = {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "scale": scale,
        "plugin_namespace": DOMAIN,
        "plugin_version": PLUGIN_VERSION,
    }
    if softcap > 0:
        attributes[SOFTCAP] = softcap
    return attributes


def uses_softcap(softcaps: list[float]) -> bool:
    """Whether a graph whose TreeAttention nodes carry `softcaps` (0: none) needs the capped body.

    Raises:
        ValueError: some nodes are capped and others not; one model-local body serves all.
    """
    capped = [c > 0 for c in softcaps]
    if any(capped) and not all(capped):
        raise ValueError(f"{sum(capped)} of {len(capped)} TreeAttention nodes carry softcap")
    return any(capped)


def _ref_attr(name: str, attr_type: onnx.AttributeProto.AttributeType) -> onnx.AttributeProto:
    attr = onnx.AttributeProto(name=name, ref_attr_name=name, type=attr_type)
    return attr


def graph_uses_softcap(graph: ir.Graph) -> bool:
    """`uses_softcap` for the TreeAttention nodes of an onnx-ir graph."""
    return uses_softcap(
        [
            n.attributes.get_float(SOFTCAP, 0.0)
            for n in graph
            if (n.domain, n.op_type) == (DOMAIN, OP_TYPE)
        ]
    )


def function_proto(row_invariant: bool = False, softcap: bool = False) -> onnx.FunctionProto:
    """The standard-op body of TreeAttention, as a model-local ONNX function.

    With `softcap`, the attention is computed by `_capped_attention` (every node must carry
    the attribute) instead of one ONNX Attention.

    With `row_invariant`, the body attends with one extra query row (a copy of the last,
    under the last mask row) and drops its output. ONNX Runtime's CPU Attention computes
    a single query row on another path than several, and the two differ in the last bits;
    with the extra row every query takes the multi-row path, so a token's output is the
    same whether it comes alone (plain decoding) or in a verify chunk. Where that matters
    (`specx.graphs.row_invariance`) it costs one query row per layer.
    """
    i64 = onnx.TensorProto.INT64
    rows = "_rows" if row_invariant else ""
    if softcap:
        attention = _capped_attention(f"q{rows}", f"mask{rows}", f"out{rows}")
    else:
        attention = [
            helper.make_node(
                "Attention",
                [f"q{rows}", "k_valid", "v_valid", f"mask{rows}"],
                [f"out{rows}"],
                name="attention",
            )
        ]
        attention[0].attribute.append(_ref_attr("scale", onnx.AttributeProto.FLOAT))
    nodes = [
        helper.make_node(
            "TensorScatter", ["k_cache", "k", "write_pos"], ["k_cache_out"], axis=-2, name="write_k"
        ),
        helper.make_node(
            "TensorScatter", ["v_cache", "v", "write_pos"], ["v_cache_out"], axis=-2, name="write_v"
        ),
        helper.make_node("Shape", ["mask"], ["kv_len"], start=3, end=4, name="kv_len"),
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("zero", i64, [1], [0])),
        helper.make_node(
            "Constant", [], ["seq_axis"], value=helper.make_tensor("seq_axis", i64, [1], [2])
        ),
        helper.make_node(
            "Slice", ["k_cache_out", "zero", "kv_len", "seq_axis"], ["k_valid"], name="valid_k"
        ),
        helper.make_node(
            "Slice", ["v_cache_out", "zero", "kv_len", "seq_axis"], ["v_valid"], name="valid_v"
        ),
    ]
    if row_invariant:
        nodes += _extra_query_row()
    nodes += attention
    if row_invariant:
        nodes += [
            helper.make_node("Shape", ["q"], ["num_rows"], start=2, end=3, name="num_rows"),
            helper.make_node(
                "Slice", ["out_rows", "zero", "num_rows", "seq_axis"], ["out"], name="real_rows"
            ),
        ]
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUTS),
        list(OUTPUTS),
        nodes,
        [helper.make_opsetid("", FUNCTION_OPSET)],
        attributes=[*ATTRIBUTES, SOFTCAP] if softcap else list(ATTRIBUTES),
        doc_string="Tree attention over a fixed-capacity KV cache (specx.graphs.tree_attention)",
    )


def _capped_attention(q: str, mask: str, out: str) -> list[onnx.NodeProto]:
    """`out` = softmax(where(mask, softcap * tanh(scale * q.k / softcap), -inf)) . v.

    q [B, H, N, D] is viewed as [B, Hkv, H/Hkv, N, D] so each kv head serves its group
    (`k_valid`/`v_valid` [B, Hkv, L, D] gain a group axis of 1); the mask [B, 1, N, L] gains a
    head axis. Constants take q's dtype (CastLike), so fp16/bf16 graphs need no pass here.
    """
    i64, f32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT

    def const(name: str, tensor: onnx.TensorProto) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=tensor)

    def ref_const(
        name: str, attr: str, attr_type: onnx.AttributeProto.AttributeType
    ) -> onnx.NodeProto:
        node = helper.make_node("Constant", [], [name])
        field = "value_float" if attr_type == onnx.AttributeProto.FLOAT else "value_int"
        node.attribute.append(onnx.AttributeProto(name=field, ref_attr_name=attr, type=attr_type))
        return node

    node = helper.make_node
    return [
        ref_const("kv_heads", "num_kv_heads", onnx.AttributeProto.INT),
        ref_const("scale_f", "scale", onnx.AttributeProto.FLOAT),
        ref_const("cap_f", SOFTCAP, onnx.AttributeProto.FLOAT),
        const("axis_0", helper.make_tensor("axis_0", i64, [1], [0])),
        const("axis_1", helper.make_tensor("axis_1", i64, [1], [1])),
        const("group_axis", helper.make_tensor("group_axis", i64, [1], [2])),
        const("minus_one", helper.make_tensor("minus_one", i64, [1], [-1])),
        const("neg_inf", helper.make_tensor("neg_inf", f32, [], [float("-inf")])),
        node("Unsqueeze", ["kv_heads", "axis_0"], ["kv_heads_1d"]),
        node("Shape", [q], ["q_shape"]),
        node("Shape", [q], ["batch"], end=1),
        node("Shape", [q], ["rows_dim"], start=2),
        node("Concat", ["batch", "kv_heads_1d", "minus_one", "rows_dim"], ["grouped"], axis=0),
        node("Reshape", [q, "grouped"], ["q_grouped"]),  # [B, Hkv, G, N, D]
        node("Unsqueeze", ["k_valid", "group_axis"], ["k_grouped"]),  # [B, Hkv, 1, L, D]
        node("Unsqueeze", ["v_valid", "group_axis"], ["v_grouped"]),
        node("Transpose", ["k_grouped"], ["k_t"], perm=[0, 1, 2, 4, 3]),
        node("MatMul", ["q_grouped", "k_t"], ["qk"]),  # [B, Hkv, G, N, L]
        node("CastLike", ["scale_f", "qk"], ["scale_t"]),
        node("CastLike", ["cap_f", "qk"], ["cap_t"]),
        node("CastLike", ["neg_inf", "qk"], ["neg_inf_t"]),
        node("Mul", ["qk", "scale_t"], ["scores"]),
        node("Div", ["scores", "cap_t"], ["scores_over_cap"]),
        node("Tanh", ["scores_over_cap"], ["scores_tanh"]),
        node("Mul", ["scores_tanh", "cap_t"], ["capped"]),
        node("Unsqueeze", [mask, "axis_1"], ["mask_grouped"]),  # [B, 1, 1, N, L]
        node("Where", ["mask_grouped", "capped", "neg_inf_t"], ["masked"]),
        node("Softmax", ["masked"], ["weights"], axis=-1),
        node("MatMul", ["weights", "v_grouped"], ["out_grouped"]),
        node("Reshape", ["out_grouped", "q_shape"], [out]),
    ]


def _extra_query_row() -> list[onnx.NodeProto]:
    """`q_rows`, `mask_rows`: q and mask with a copy of their last row appended (axis 2)."""
    i64 = onnx.TensorProto.INT64
    last = helper.make_tensor("last", i64, [1], [-1])
    end = helper.make_tensor("end", i64, [1], [2**63 - 1])
    nodes = [
        helper.make_node("Constant", [], ["last"], value=last),
        helper.make_node("Constant", [], ["end"], value=end),
    ]
    for name in ("q", "mask"):
        nodes += [
            helper.make_node(
                "Slice", [name, "last", "end", "seq_axis"], [f"{name}_last"], name=f"{name}_last"
            ),
            helper.make_node(
                "Concat", [name, f"{name}_last"], [f"{name}_rows"], axis=2, name=f"{name}_rows"
            ),
        ]
    return nodes


def attach_function(model: onnx.ModelProto) -> onnx.ModelProto:
    """`attach_function_ir` for a ModelProto; returns a new proto."""
    return ir.to_proto(attach_function_ir(ir.from_proto(model)))


def attach_function_ir(model: ir.Model) -> ir.Model:
    """Adds the TreeAttention function to `model` in place and aligns its opsets.

    The body is the capped one when the nodes carry `softcap` (`graph_uses_softcap`). The
    default domain is raised to the function's opset because ONNX Runtime requires a
    model-local function and its model to agree on each domain's version; the ops the
    exporter emits at opset 23 have the same semantics at 24.
    """
    function = ir.serde.deserialize_function(
        function_proto(softcap=graph_uses_softcap(model.graph))
    )
    for key in [k for k in model.functions if k[:2] == (DOMAIN, OP_TYPE)]:
        del model.functions[key]
    model.functions[function.identifier()] = function
    model.opset_imports[""] = max(model.opset_imports.get("", 0), FUNCTION_OPSET)
    model.opset_imports.setdefault(DOMAIN, 1)
    model.graph.opset_imports[""] = model.opset_imports[""]
    model.graph.opset_imports.setdefault(DOMAIN, 1)
    return model
