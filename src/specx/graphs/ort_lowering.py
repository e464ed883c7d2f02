"""The ONNX Runtime form of a target: attention, RoPE and residual norms as contrib kernels.

The exported graph spends more on small nodes than on arithmetic on a CPU: profiled on
pyref-7m's decode step, it runs many more nodes than onnxruntime-genai's builder emits for
the same weights, and spends more node time outside MatMul than genai's graph. Two passes,
each one concern, bring it to about genai's node count and its step to the speed of
genai's own graph in a bare loop (docs/decisions.md#ort-lowering-passes):

`GroupQueryAttentionPass`: each TreeAttention (TensorScatter x2, Slice x2, Attention, and
the head transposes around it) becomes one com.microsoft GroupQueryAttention (GQA), which
writes the N new keys and values into the cache in place (the same buffer bound as past
and present), at slots `seqlens_k + 1 - N` .. `seqlens_k`, and attends over
`[0, total_sequence_length)` with an additive `attention_bias`:

    seqlens_k = write_pos + N - 1,  total_sequence_length = L,  query_seqlens = N per row
    attention_bias = where(mask, 0, -inf)                         # the tree mask, unchanged
    softcap = TreeAttention's softcap, if it has one (GQA caps before adding the bias)
    query = the packed QKV projection itself (plus its biases), do_rotary = 1, with
            cos/sin tables evaluated from the graph's own RoPE subgraph and the graph's
            position_ids (a tree node's position is its depth past the prefix)
    out:  GQA's [B, N, H*D] output replaces the transpose + reshape that followed the node

Where the projection or RoPE is not the exporter's standard form (Qwen3's per-head q/k
norms, which ORT's CPU GQA does not apply; a head size not a multiple of 16), RoPE stays
outside, redone in the tokens-first layout, and q, k, v go in separately.

`SkipRmsNormPass`: each residual Add + RMSNormalization pair becomes one
SkipSimplifiedLayerNormalization (both its outputs kept).

Numerics: the same math in other kernels (logits within 1e-5 of the exported graph, tested
per family over prefill, chain and tree steps, batch 1 and 3). Applied for ONNX Runtime
builds only (`specx build --backend ort --lowering gqa`): the artifact's exported graphs and
the TensorRT lowering keep TreeAttention. An ONNX Runtime without GroupQueryAttention keeps
the standard body (`gqa_available`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes.common import RemoveUnusedNodesPass

from specx.graphs import tree_attention as tree_op
from specx.graphs.ir_values import input_at, inputs_of, name_of
from specx.graphs.rotate_half import match_rotate_half

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
            value = ir.val(f"gqa_{name}", const_value=ir.tensor(array, name=f"gqa_{name}"))
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
    """Replaces every TreeAttention node of the main graph by GroupQueryAttention.

    With `max_positions` (the largest position id + 1 the graph will see), RoPE moves into
    GQA as well where the graph has the standard form (`_packed_qkv`).

    With `pad_single_rows`, GQA always sees one query row more than the step has (a copy of
    the last, marked padding by `query_seqlens`: never written to the cache, its output
    dropped). GQA computes a lone query row on another path than rows together (logits
    differ by ~1e-6, measured on pyref-7m), while chunks of 2 or more agree bit for bit
    with each other; with the pad a decode step's row equals the same token's row in a
    verify chunk, which a build with int8 activations needs (`specx.graphs.row_invariance`).
    The pad row needs one spare cache slot past the last written one (`kv_spare_slots`).
    """

    def __init__(self, max_positions: int | None = None, pad_single_rows: bool = False):
        super().__init__()
        self.max_positions = max_positions
        self.pad_single_rows = pad_single_rows

    def call(self, model: ir.Model) -> PassResult:  # noqa: D102
        graph = model.graph
        nodes = [n for n in graph if (n.domain, n.op_type) == (tree_op.DOMAIN, tree_op.OP_TYPE)]
        if not nodes:
            return PassResult(model, modified=False)
        build = _Builder(graph)
        shared: dict[ir.Value, dict[str, ir.Value]] = {}  # per mask (sliding-window layers)
        rotary = _rotary(build, model, nodes[0], self.max_positions)
        if rotary is not None and self.pad_single_rows:
            positions = _pad_row(build, nodes[0], rotary.position_ids, axis=1)
            rotary = dataclasses.replace(rotary, position_ids=positions)
        for node in nodes:
            mask = input_at(node, 6)
            if mask not in shared:
                shared[mask] = _shared_inputs(build, node, self.pad_single_rows)
            _replace(build, node, shared[mask], rotary, self.pad_single_rows)
        model.opset_imports.setdefault(MS_DOMAIN, 1)
        RemoveUnusedNodesPass()(model)
        return PassResult(model, modified=True)


def _shared_inputs(build: _Builder, first: ir.Node, pad: bool) -> dict[str, ir.Value]:
    """GQA's seqlens_k, total_sequence_length, query_seqlens and bias, built once.

    From the node's write_pos and [B, 1, N, L] mask, which the layers of its kind share
    (sliding-window layers have a mask of their own, `specx.export.decoder._window`). With
    `pad`, the padding row is a real query row to GQA (it computes only the rows
    `query_seqlens` counts, so a row marked padding would leave the lone real row alone):
    its key and value land in the scratch slot after the step, which no mask shows and the
    next write replaces; it sees every slot but that one, and its output is dropped.
    """
    mask, write_pos = first.inputs[6], first.inputs[5]
    i32 = ir.DataType.INT32
    one = build.const("one", np.array(1, np.int64))
    add = lambda op, inputs, **attrs: build.node(first, op, inputs, attrs).outputs[0]  # noqa: E731
    zero = build.const("zero", np.array(0.0, np.float32))
    neg_inf = build.const("neg_inf", np.array(-np.inf, np.float32))
    bias = add("Where", [mask, zero, neg_inf])
    n = add("Squeeze", [add("Shape", [mask], start=2, end=3)])
    total = add("Squeeze", [add("Shape", [mask], start=3, end=4)])
    if pad:  # one more row, one more column
        n, total = add("Add", [n, one]), add("Add", [total, one])
        bias = add("Pad", [bias, build.const("pad_row", np.array([0, 0, 0, 0, 0, 0, 1, 0])), zero])
        pad_column = build.const("pad_column", np.array([0, 0, 0, 0, 0, 0, 0, 1]))
        bias = add("Pad", [bias, pad_column, neg_inf])
    last = add("Sub", [add("Add", [write_pos, n]), one])
    per_row = add("Expand", [n, add("Shape", [write_pos])])
    return {
        "bias": bias,
        "seqlens_k": add("Cast", [last], to=i32),
        "total": add("Cast", [total], to=i32),
        "query_seqlens": add("Cast", [per_row], to=i32),
    }


def _pad_row(build: _Builder, before: ir.Node, value: ir.Value, axis: int) -> ir.Value:
    """`value` with a copy of its last row along `axis` appended (one edge-mode Pad)."""
    pads = build.const("pad_end", np.array([0, 1], np.int64))
    axes = build.const(f"axis_{axis}", np.array([axis], np.int64))
    return build.node(before, "Pad", [value, pads, None, axes], {"mode": "edge"}).outputs[0]


def _replace(
    build: _Builder, node: ir.Node, shared: dict, rotary: Rotary | None, pad: bool
) -> None:
    q, k, v = (input_at(node, i) for i in range(3))
    k_cache, v_cache = node.inputs[3:5]
    attrs = node.attributes
    packed = _packed_qkv(build, node, rotary) if rotary is not None else None
    qkv: list[ir.Value | None]
    rope: list[ir.Value | None]
    if packed is not None and rotary is not None:  # packed only ever comes with rotary
        qkv = [packed, None, None]
        rope = [rotary.cos_cache, rotary.sin_cache, rotary.position_ids]
    else:
        qkv = [_flat_rotated(build, node, q), _flat_rotated(build, node, k)]
        qkv.append(_flat_input(build, node, v))
        rope = [None, None, None]
    if pad:
        qkv = [x if x is None else _pad_row(build, node, x, axis=1) for x in qkv]
    inputs = [*qkv, k_cache, v_cache, shared["seqlens_k"], shared["total"], *rope]
    inputs += [shared["bias"], None, None, None, None, None, shared["query_seqlens"]]
    gqa = build.node(
        node,
        "GroupQueryAttention",
        inputs,
        {
            "num_heads": attrs["num_heads"].value,
            "kv_num_heads": attrs["num_kv_heads"].value,
            "scale": attrs["scale"].value,
            "do_rotary": int(packed is not None),
            # GQA caps the scores before adding attention_bias, as TreeAttention does.
            **({"softcap": attrs[tree_op.SOFTCAP].value} if tree_op.SOFTCAP in attrs else {}),
        },
        domain=MS_DOMAIN,
        num_outputs=3,
        name=f"{node.name}_gqa",
    )
    out, present_key, present_value = gqa.outputs
    if pad:
        starts = build.const("first_start", np.array([0], np.int64))
        ends = build.const("last_start", np.array([-1], np.int64))
        rows = build.const("axis_1", np.array([1], np.int64))
        out = build.node(node, "Slice", [out, starts, ends, rows]).outputs[0]
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
        if reshape is not None and reshape.op_type == "Reshape":
            source = input_at(reshape, 0)
            if source.shape is not None and len(source.shape) == 3:
                return source
        return _flat(build, node, tokens_first)
    moved = build.node(node, "Transpose", [value], {"perm": _TO_HEADS_FIRST}).outputs[0]
    return _flat(build, node, moved)


def _flat_rotated(build: _Builder, node: ir.Node, value: ir.Value) -> ir.Value:
    """[B, N, H*D] of RoPE(x), where the graph computes it on Transpose(x).

    The same RoPE ops are redone on x itself, with cos/sin unsqueezed at axis 2, not 1.
    """
    rotated = _rope_on_tokens_first(build, node, value)
    return _flat(build, node, rotated) if rotated is not None else _flat_input(build, node, value)


@dataclass(frozen=True)
class RopeMatch:
    """The exporter's `x * cos + rotate_half(x) * sin` on xt = Transpose(x, [0, 2, 1, 3]).

    Matched as Add(Mul(xt, cos_u), Mul(rotate_half(xt), sin_u)) (`match_rotate_half`),
    cos_u = Unsqueeze(cos, [1]) and sin_u likewise; `x` is [B, N, H, D], cos/sin [B, N, D].
    """

    x: ir.Value
    cos: ir.Value
    sin: ir.Value
    split: ir.Node  # rotate_half's split of xt into halves
    concat: ir.Node


def _match_rope(value: ir.Value) -> RopeMatch | None:
    add = value.producer()
    if add is None or add.op_type != "Add":
        return None
    direct, rotated = (p.producer() for p in inputs_of(add))
    if direct is None or rotated is None or direct.op_type != "Mul" or rotated.op_type != "Mul":
        return None
    xt, cos_u = inputs_of(direct)
    x = _heads_first(xt)
    concat = input_at(rotated, 0).producer()
    turned = match_rotate_half(concat) if concat is not None else None
    if x is None or turned is None or turned.x is not xt:
        return None
    cos, sin = _unsqueezed_source(cos_u), _unsqueezed_source(input_at(rotated, 1))
    if cos is None or sin is None:
        return None
    return RopeMatch(x, cos, sin, turned.split, turned.concat)


def _rope_on_tokens_first(build: _Builder, node: ir.Node, value: ir.Value) -> ir.Value | None:
    """Recomputes the RoPE subgraph ending in `value` on the pre-transpose tensor, or None.

    The same ops on x itself, with cos/sin unsqueezed at axis 2, not 1.
    """
    rope = _match_rope(value)
    if rope is None:
        return None
    cos2, sin2 = build.at_axis_2(node, rope.cos), build.at_axis_2(node, rope.sin)
    split = rope.split
    halves = build.node(node, "Split", [rope.x, *split.inputs[1:]], split.attributes, num_outputs=2)
    negated = build.node(node, "Neg", [halves.outputs[1]]).outputs[0]
    turned = build.node(node, "Concat", [negated, halves.outputs[0]], rope.concat.attributes)
    straight = build.node(node, "Mul", [rope.x, cos2]).outputs[0]
    crossed = build.node(node, "Mul", [turned.outputs[0], sin2]).outputs[0]
    return build.node(node, "Add", [straight, crossed]).outputs[0]


def _unsqueezed_source(value: ir.Value) -> ir.Value | None:
    """The [B, N, D] tensor behind Unsqueeze(it, [1]), if `value` is that."""
    producer = value.producer()
    if producer is None or producer.op_type != "Unsqueeze":
        return None
    axes = input_at(producer, 1).const_value if len(producer.inputs) > 1 else None
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


@dataclass(frozen=True)
class Rotary:
    """GQA's own RoPE inputs: cos/sin tables over every position, and the graph's positions."""

    cos_cache: ir.Value  # [max_positions, D/2]
    sin_cache: ir.Value  # [max_positions, D/2]
    position_ids: ir.Value  # [B, N] int64, the graph input
    cos: ir.Value  # the graph's cos, [B, N, D]: layers whose RoPE reads another stay outside
    sin: ir.Value


def _rotary(
    build: _Builder, model: ir.Model, first: ir.Node, max_positions: int | None
) -> Rotary | None:
    """GQA's cos/sin tables, evaluated from the graph's own RoPE subgraph, or None.

    None when there is no `max_positions`, the first layer's RoPE is not the standard form,
    cos/sin depend on anything but `position_ids`, or their two halves differ (GQA rotates
    the halves of each head by one angle per pair, as HF's `rotate_half` form does).
    """
    rope = _match_rope(input_at(first, 0))
    positions = next((v for v in model.graph.inputs if v.name == "position_ids"), None)
    if max_positions is None or rope is None or positions is None:
        return None
    feed = np.arange(max_positions, dtype=np.int64)[None]
    tables = _evaluate(model, [rope.cos, rope.sin], positions, feed)
    if tables is None:
        return None
    cos, sin = (t.reshape(max_positions, -1) for t in tables)
    half = cos.shape[1] // 2
    if any(not np.array_equal(t[:, :half], t[:, half:]) for t in (cos, sin)):
        return None
    return Rotary(
        build.const("cos_cache", np.ascontiguousarray(cos[:, :half])),
        build.const("sin_cache", np.ascontiguousarray(sin[:, :half])),
        positions,
        rope.cos,
        rope.sin,
    )


def _evaluate(
    model: ir.Model, outputs: list[ir.Value], source: ir.Value, feed: np.ndarray
) -> list[np.ndarray] | None:
    """`outputs` computed from `source` = `feed` by the graph's own nodes, on ONNX Runtime.

    None if they depend on another graph input.
    """
    import onnx

    from specx.sessions import load_session

    order = {node: i for i, node in enumerate(model.graph)}
    nodes: set[ir.Node] = set()
    constants: dict[ir.Value, ir.TensorProtocol] = {}
    stack = list(outputs)
    while stack:
        value = stack.pop()
        producer = value.producer()
        if value is source or producer in nodes:
            continue
        if producer is None:
            if value.const_value is None:
                return None
            constants[value] = value.const_value
            continue
        nodes.add(producer)
        stack.extend(v for v in producer.inputs if v is not None)
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in sorted(nodes, key=order.__getitem__)],
        "rope_tables",
        [onnx.helper.make_tensor_value_info(name_of(source), onnx.TensorProto.INT64, None)],
        [
            onnx.helper.make_tensor_value_info(name_of(v), onnx.TensorProto.FLOAT, None)
            for v in outputs
        ],
        [ir.serde.serialize_tensor(t) for t in constants.values()],
    )
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
    proto = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version)
    session = load_session(proto.SerializeToString())
    return session.run([v.name for v in outputs], {source.name: feed})


def _packed_qkv(build: _Builder, node: ir.Node, rotary: Rotary) -> ir.Value | None:
    """The [B, N, (H + 2 Hkv) D] projection GQA can take whole, rotating q and k itself.

    Expected: q and k the standard RoPE (on the shared cos/sin) of Transpose(Reshape(s_0))
    and Transpose(Reshape(s_1)), v = Transpose(Reshape(s_2)), s = Split(packed) on the last
    axis into [H D, Hkv D, Hkv D]: the exporter's packed QKV projection; D a multiple of 16.
    A constant bias added to a split output (Qwen2) is added to `packed` instead.
    """
    q, k = _match_rope(input_at(node, 0)), _match_rope(input_at(node, 1))
    v = _heads_first(input_at(node, 2))
    if q is None or k is None or v is None:
        return None
    if any((r.cos, r.sin) != (rotary.cos, rotary.sin) for r in (q, k)):
        return None
    producers = [x.producer() for x in (q.x, k.x, v)]
    reshapes = [p for p in producers if p is not None and p.op_type == "Reshape"]
    if len(reshapes) != len(producers):
        return None
    parts = [_unbiased(input_at(p, 0)) for p in reshapes]
    split = parts[0][0].producer()
    if split is None or split.op_type != "Split" or [p[0] for p in parts] != list(split.outputs):
        return None
    sizes = _qkv_sizes(split, node)
    if sizes is None:
        return None
    packed = split.inputs[0]
    biases = [b for _, b in parts]
    if any(b is not None and b.shape != (n,) for b, n in zip(biases, sizes, strict=True)):
        return None
    if all(b is None for b in biases):
        return packed
    pairs = zip(biases, sizes, strict=True)
    filled = [np.zeros(n, np.float32) if b is None else b for b, n in pairs]
    bias = build.const(f"{node.name}_qkv_bias", np.concatenate(filled))
    return build.node(node, "Add", [packed, bias]).outputs[0]


def _unbiased(value: ir.Value) -> tuple[ir.Value, np.ndarray | None]:
    """(x, bias) for value = Add(x, bias) with a constant 1-D fp32 bias, else (value, None)."""
    add = value.producer()
    if add is None or add.op_type != "Add":
        return value, None
    x, bias = inputs_of(add)
    constant = bias.const_value
    if constant is None or constant.dtype != ir.DataType.FLOAT or len(constant.shape) != 1:
        return value, None
    return x, constant.numpy()


def _qkv_sizes(split: ir.Node, node: ir.Node) -> list[int] | None:
    """[H D, Hkv D, Hkv D] if `split` cuts the last axis so, with D a multiple of 16."""
    heads, kv_heads = node.attributes["num_heads"].value, node.attributes["num_kv_heads"].value
    split_input = split.inputs[1] if len(split.inputs) > 1 else None  # optional: may be absent
    sizes = split_input.const_value if split_input is not None else None
    shape = input_at(split, 0).shape
    axis = split.attributes.get_int("axis", 0)
    if sizes is None or shape is None or axis not in (-1, shape.rank() - 1):
        return None
    q_size, k_size, v_size = sizes.numpy().tolist()
    if q_size % heads or (k_size, v_size) != (q_size // heads * kv_heads,) * 2:
        return None
    if (q_size // heads) % 16:
        return None  # ORT's rotary kernel refuses such heads at run time
    return [q_size, k_size, v_size]


class SkipRmsNormPass(InPlacePass):
    """Fuses each residual Add feeding an RMSNormalization into SkipSimplifiedLayerNormalization.

    `h = a + b; y = RMSNorm(h)` becomes one node with outputs y and h (the residual stream
    the next layer adds to): on a decode step one fused kernel runs faster than the Add and
    RMSNorm pair it replaces (docs/decisions.md#skip-rms-norm). Row by row the same math as
    before (no row depends on
    another), so a row-invariant build stays row-invariant.
    """

    def call(self, model: ir.Model) -> PassResult:  # noqa: D102
        graph = model.graph
        fused = [n for n in list(graph) if _fuse_skip_norm(graph, n)]
        if fused:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        return PassResult(model, modified=bool(fused))


def _fuse_skip_norm(graph: ir.Graph, norm: ir.Node) -> bool:
    if (norm.domain, norm.op_type) != ("", "RMSNormalization") or len(norm.inputs) != 2:
        return False
    add = input_at(norm, 0).producer()
    if add is None or (add.domain, add.op_type) != ("", "Add"):
        return False
    a, b = inputs_of(add)
    shape = input_at(norm, 0).shape
    if shape is None or a.shape != shape or b.shape != shape or shape.rank() not in (2, 3):
        return False  # a broadcasting Add (a bias) is no skip connection
    axis = norm.attributes.get_int("axis", -1)
    if axis not in (-1, shape.rank() - 1) or norm.attributes.get_int("stash_type", 1) != 1:
        return False
    epsilon = norm.attributes.get_float("epsilon", 1e-5)
    skip = ir.node(
        "SkipSimplifiedLayerNormalization",
        [a, b, norm.inputs[1]],
        {"epsilon": epsilon},
        domain=MS_DOMAIN,
        num_outputs=4,
        name=f"{norm.name}_skip",
    )
    graph.insert_before(add, skip)
    out, mean, inv_std, total = skip.outputs
    mean.name, inv_std.name = "", ""  # not computed when unnamed
    for old, new in ((norm.outputs[0], out), (add.outputs[0], total)):
        new.shape, new.type, name = old.shape, old.type, old.name
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        old.name, new.name = f"{name}_unfused", name
    if not total.uses() and total not in graph.outputs:
        total.name = ""
    graph.remove([norm, add], safe=True)
    return True
