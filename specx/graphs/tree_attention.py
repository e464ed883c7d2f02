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

The node carries `plugin_namespace`/`plugin_version`, so the TensorRT ONNX parser maps
it to a registered plugin of the same name; without one, TensorRT and ONNX Runtime
both inline the model-local function defined here from standard ops (TensorScatter,
Slice, Attention; opset 24).
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
    "node_attributes",
]

DOMAIN = "specx"
OP_TYPE = "TreeAttention"
PLUGIN_VERSION = "1"
FUNCTION_OPSET = 24
INPUTS = ("q", "k", "v", "k_cache", "v_cache", "write_pos", "mask")
OUTPUTS = ("out", "k_cache_out", "v_cache_out")
ATTRIBUTES = ("num_heads", "num_kv_heads", "scale", "plugin_namespace", "plugin_version")


def node_attributes(num_heads: int, num_kv_heads: int, scale: float) -> dict[str, object]:
    """The attributes every TreeAttention node carries, plugin fields included."""
    return {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "scale": scale,
        "plugin_namespace": DOMAIN,
        "plugin_version": PLUGIN_VERSION,
    }


def _ref_attr(name: str, attr_type: int) -> onnx.AttributeProto:
    attr = onnx.AttributeProto(name=name, ref_attr_name=name, type=attr_type)
    return attr


def function_proto(row_invariant: bool = False) -> onnx.FunctionProto:
    """The standard-op body of TreeAttention, as a model-local ONNX function.

    With `row_invariant`, the body attends with one extra query row (a copy of the last,
    under the last mask row) and drops its output. ONNX Runtime's CPU Attention computes
    a single query row on another path than several, and the two differ in the last bits;
    with the extra row every query takes the multi-row path, so a token's output is the
    same whether it comes alone (plain decoding) or in a verify chunk. Where that matters
    (`specx.graphs.row_invariance`) it costs one query row per layer.
    """
    i64 = onnx.TensorProto.INT64
    rows = "_rows" if row_invariant else ""
    attention = helper.make_node(
        "Attention",
        [f"q{rows}", "k_valid", "v_valid", f"mask{rows}"],
        [f"out{rows}"],
        name="attention",
    )
    attention.attribute.append(_ref_attr("scale", onnx.AttributeProto.FLOAT))
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
    nodes.append(attention)
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
        attributes=list(ATTRIBUTES),
        doc_string="Tree attention over a fixed-capacity KV cache (specx.graphs.tree_attention)",
    )


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
    """Adds the TreeAttention function to `model` in place and aligns its opsets.

    The default domain is raised to the function's opset because ONNX Runtime
    requires a model-local function and its model to agree on each domain's version;
    the ops the exporter emits at opset 23 have the same semantics at 24.
    """
    functions = [f for f in model.functions if not (f.domain == DOMAIN and f.name == OP_TYPE)]
    del model.functions[:]
    model.functions.extend([*functions, function_proto()])
    versions = {o.domain: o for o in model.opset_import}
    if "" in versions:
        versions[""].version = max(versions[""].version, FUNCTION_OPSET)
    else:
        model.opset_import.append(helper.make_opsetid("", FUNCTION_OPSET))
    if DOMAIN not in versions:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def attach_function_ir(model: ir.Model) -> ir.Model:
    """`attach_function` for an onnx-ir model (one whose weights are not in memory)."""
    function = ir.serde.deserialize_function(function_proto())
    for key in [k for k in model.functions if k[:2] == (DOMAIN, OP_TYPE)]:
        del model.functions[key]
    model.functions[function.identifier()] = function
    model.opset_imports[""] = max(model.opset_imports.get("", 0), FUNCTION_OPSET)
    model.opset_imports.setdefault(DOMAIN, 1)
    model.graph.opset_imports[""] = model.opset_imports[""]
    model.graph.opset_imports.setdefault(DOMAIN, 1)
    return model
