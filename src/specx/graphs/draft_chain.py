"""One ONNX Runtime call per draft round: an autoregressive head's catch-up plus its greedy chain.

A head (EAGLE-1/2, EAGLE-3, MTP) drafting a chain of K tokens per-depth costs K calls of a
one-layer graph, each mostly per-call overhead, plus Python between them (measured on
pyref-deep: a large share of the drafting time was spent outside the head's runs;
docs/decisions.md#draft-chain-one-call). This graph does the
whole round in one call, built from the exported `draft_head` graph:

    logits, hidden, cache = head(input_ids, features, ...)        # the catch-up, as fed
    token_0 = argmax(logits[b, last_index[b]])                    # first draft token
    for j in 1 .. steps:                                          # ONNX Loop, steps = K - 1
        logits, h, cache = head(token_{j-1}, h_{j-1}, position p_b + j, slot s_b + j - 1,
                                mask: slots <= s_b + j - 1)
        token_j = argmax(logits)

where p_b is the position after the last fed token and s_b the slot after it. Outputs:
`draft_ids [B, K]` (target vocabulary ids: an EAGLE-3 head's draft ids mapped by d2t inside
the graph), `draft_probs [B, K]` (each token's softmax probability, the drafter's
confidence), and the updated cache. The loop body is the head graph itself; its weights
are the outer graph's initializers, stored once. Ties go to the lowest id, as
`numpy.argmax` and the per-depth path (`specx.runtime.drafters.tree_search`) do.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specx.graphs.signature import graph_entry
from specx.manifest_types import GraphEntry

__all__ = [
    "CHAIN_INPUTS",
    "CHAIN_OUTPUTS",
    "HEAD_INPUTS",
    "HEAD_OUTPUTS",
    "build_draft_chain",
    "save_draft_chain",
]

# An autoregressive head's graph (`draft_head`) as export writes it and the chain inlines it.
HEAD_INPUTS = [
    "input_ids",
    "features",
    "position_ids",
    "attention_mask",
    "write_pos",
    "past_key_0",
    "past_value_0",
]
HEAD_OUTPUTS = ["logits", "hidden", "present_key_0", "present_value_0"]
CHAIN_INPUTS = [*HEAD_INPUTS, "last_index", "steps"]
CHAIN_OUTPUTS = ["draft_ids", "draft_probs", "present_key_0", "present_value_0"]


def _inlined(
    head: onnx.GraphProto, prefix: str, inputs: dict[str, str]
) -> tuple[list[onnx.NodeProto], dict[str, str]]:
    """The head's nodes with every value renamed under `prefix`, inputs bound to `inputs`.

    Returns:
        The nodes and the names their graph outputs got.
    """
    weights = {i.name for i in head.initializer}
    names = dict(inputs)

    def renamed(name: str) -> str:
        if not name or name in weights:
            return name
        return names.setdefault(name, f"{prefix}{name}")

    nodes = []
    for node in head.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = f"{prefix}{node.name}"
        copy.input[:] = [renamed(n) for n in node.input]
        copy.output[:] = [renamed(n) for n in node.output]
        nodes.append(copy)
    return nodes, {o.name: renamed(o.name) for o in head.output}


def _argmax_and_prob(logits: str, prefix: str, to_target: str | None):
    """Nodes computing (target id [B], probability [B]) of the best entry of logits [B, V]."""
    nodes = [
        helper.make_node("ArgMax", [logits], [f"{prefix}draft_id"], axis=-1, keepdims=0),
        helper.make_node("Softmax", [logits], [f"{prefix}probs"], axis=-1),
        helper.make_node(
            "ReduceMax", [f"{prefix}probs", "axis_last"], [f"{prefix}prob"], keepdims=0
        ),
    ]
    token = f"{prefix}draft_id"
    if to_target is not None:
        nodes.append(helper.make_node("Gather", [to_target, token], [f"{prefix}token"]))
        token = f"{prefix}token"
    return nodes, token, f"{prefix}prob"


def _constants(to_target: np.ndarray | None) -> list[onnx.TensorProto]:
    values = {
        "axis_last": np.array([-1], np.int64),
        "axis_1": np.array([1], np.int64),
        "axes_1_2": np.array([1, 2], np.int64),
        "one": np.array(1, np.int64),
        "zero": np.array(0, np.int64),
        "true": np.array(True),
    }
    if to_target is not None:
        values["to_target"] = to_target.astype(np.int64)
    return [numpy_helper.from_array(v, name) for name, v in values.items()]


def _loop_body(head: onnx.GraphProto, to_target: str | None) -> onnx.GraphProto:
    """One greedy step: (token, hidden, key, value) -> the same, plus the token and its prob."""
    step = [
        helper.make_node("Add", ["step_base", "j"], ["b/slot"]),  # [B] write slot
        helper.make_node("Unsqueeze", ["b/slot", "axis_1"], ["b/write_2d"]),
        helper.make_node("Add", ["step_position", "j"], ["b/position_1d"]),
        helper.make_node("Unsqueeze", ["b/position_1d", "axis_1"], ["b/position"]),
        helper.make_node("Unsqueeze", ["b/token_in", "axis_1"], ["b/ids"]),
        helper.make_node("Less", ["slots", "b/limit_2d"], ["b/visible"]),  # [B, M]
        helper.make_node("Unsqueeze", ["b/visible", "axes_1_2"], ["b/mask"]),
    ]
    step.insert(2, helper.make_node("Add", ["b/write_2d", "one"], ["b/limit_2d"]))
    nodes, outputs = _inlined(
        head,
        "b/",
        {
            "input_ids": "b/ids",
            "features": "b/hidden_in",
            "position_ids": "b/position",
            "attention_mask": "b/mask",
            "write_pos": "b/slot",
            "past_key_0": "b/key_in",
            "past_value_0": "b/value_in",
        },
    )
    squeeze = helper.make_node("Squeeze", [outputs["logits"], "axis_1"], ["b/last_logits"])
    pick, token, prob = _argmax_and_prob("b/last_logits", "b/", to_target)
    tail = [
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        helper.make_node("Identity", [token], ["token_out"]),
        helper.make_node("Identity", [outputs["hidden"]], ["hidden_out"]),
        helper.make_node("Identity", [outputs["present_key_0"]], ["key_out"]),
        helper.make_node("Identity", [outputs["present_value_0"]], ["value_out"]),
        helper.make_node("Identity", [token], ["scan_token"]),
        helper.make_node("Identity", [prob], ["scan_prob"]),
    ]
    float_, int64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("j", int64, []),
        helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
        helper.make_tensor_value_info("b/token_in", int64, None),
        helper.make_tensor_value_info("b/hidden_in", float_, None),
        helper.make_tensor_value_info("b/key_in", float_, None),
        helper.make_tensor_value_info("b/value_in", float_, None),
    ]
    outputs_ = [
        helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
        helper.make_tensor_value_info("token_out", int64, None),
        helper.make_tensor_value_info("hidden_out", float_, None),
        helper.make_tensor_value_info("key_out", float_, None),
        helper.make_tensor_value_info("value_out", float_, None),
        helper.make_tensor_value_info("scan_token", int64, None),
        helper.make_tensor_value_info("scan_prob", float_, None),
    ]
    return helper.make_graph([*step, *nodes, squeeze, *pick, *tail], "draft_step", inputs, outputs_)


def build_draft_chain(
    head: onnx.ModelProto, to_target: np.ndarray | None = None
) -> onnx.ModelProto:
    """The one-call chain graph of an exported autoregressive head (see the module docstring).

    `head` may reference its weights as external data; the result references the same
    initializers (save it next to the head's data file). `to_target` maps draft ids to
    target ids (EAGLE-3's i + d2t[i]); None when the head predicts target ids.
    """
    graph = head.graph
    mapping = "to_target" if to_target is not None else None
    catch_up, outputs = _inlined(graph, "c/", {name: name for name in HEAD_INPUTS})
    batch_gather = [
        helper.make_node("Unsqueeze", ["last_index", "axis_1"], ["last_2d"]),
        helper.make_node("GatherND", [outputs["logits"], "last_2d"], ["root_logits"], batch_dims=1),
        helper.make_node(
            "GatherND", [outputs["hidden"], "last_2d"], ["root_hidden_1d"], batch_dims=1
        ),
        helper.make_node("Unsqueeze", ["root_hidden_1d", "axis_1"], ["root_hidden"]),
        helper.make_node("GatherND", ["position_ids", "last_2d"], ["last_position"], batch_dims=1),
        helper.make_node("Add", ["last_position", "one"], ["step_position"]),  # p_b
        helper.make_node("Add", ["write_pos", "last_index"], ["last_slot"]),
        helper.make_node("Add", ["last_slot", "one"], ["step_base"]),  # s_b
        helper.make_node("ReduceMax", ["step_base"], ["max_base"], keepdims=0),
        helper.make_node("Add", ["max_base", "steps"], ["slot_count"]),
        helper.make_node("Range", ["zero", "slot_count", "one"], ["slots_1d"]),
        helper.make_node("Unsqueeze", ["slots_1d", "zero_axis"], ["slots"]),  # [1, M]
    ]
    first, token0, prob0 = _argmax_and_prob("root_logits", "r/", mapping)
    loop = helper.make_node(
        "Loop",
        [
            "steps",
            "true",
            token0,
            "root_hidden",
            outputs["present_key_0"],
            outputs["present_value_0"],
        ],
        ["last_token", "last_hidden", "chain_key", "chain_value", "scan_tokens", "scan_probs"],
        body=_loop_body(graph, mapping),
    )
    tail = [
        helper.make_node("Unsqueeze", [token0, "axis_1"], ["first_token"]),
        helper.make_node("Unsqueeze", [prob0, "axis_1"], ["first_prob"]),
        helper.make_node("Transpose", ["scan_tokens"], ["later_tokens"], perm=[1, 0]),
        helper.make_node("Transpose", ["scan_probs"], ["later_probs"], perm=[1, 0]),
        helper.make_node("Concat", ["first_token", "later_tokens"], ["draft_ids"], axis=1),
        helper.make_node("Concat", ["first_prob", "later_probs"], ["draft_probs"], axis=1),
        helper.make_node("Identity", ["chain_key"], ["present_key_0"]),
        helper.make_node("Identity", ["chain_value"], ["present_value_0"]),
    ]
    inputs = [i for i in graph.input if i.name in HEAD_INPUTS] + [
        helper.make_tensor_value_info("last_index", TensorProto.INT64, ["batch"]),
        helper.make_tensor_value_info("steps", TensorProto.INT64, []),
    ]
    cache_outputs = {o.name: o for o in graph.output}
    outputs_ = [
        helper.make_tensor_value_info("draft_ids", TensorProto.INT64, ["batch", "draft_tokens"]),
        helper.make_tensor_value_info("draft_probs", TensorProto.FLOAT, ["batch", "draft_tokens"]),
        cache_outputs["present_key_0"],
        cache_outputs["present_value_0"],
    ]
    constants = _constants(to_target)
    constants.append(numpy_helper.from_array(np.array([0], np.int64), "zero_axis"))
    chain = helper.make_graph(
        [*catch_up, *batch_gather, *first, loop, *tail],
        "draft_chain",
        inputs,
        outputs_,
        initializer=[*graph.initializer, *constants],
    )
    model = helper.make_model(chain, opset_imports=head.opset_import, ir_version=head.ir_version)
    model.functions.extend(head.functions)
    return model


def save_draft_chain(
    directory: Path, head_entry: GraphEntry, to_target: np.ndarray | None
) -> GraphEntry:
    """Writes `draft_chain.onnx` from the head graph saved in `directory` (same weights file).

    Returns:
        Its manifest entry (`ort_only`: TensorRT builds and lint leave it out).
    """
    head = onnx.load(directory / Path(head_entry.file).name, load_external_data=False)
    chain = build_draft_chain(head, to_target)
    onnx.save(chain, directory / "draft_chain.onnx")
    entry = graph_entry(chain, "draft_chain.onnx", Path(head_entry.data_files[0]).name)
    return replace(entry, ort_only=True)
