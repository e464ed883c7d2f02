"""A Llama-form decoder's weights read from its exported ONNX graph, for specx's CPU kernels.

`read_target` reads the target, `read_head` an EAGLE-3 head (`draft_head` and its
projection), each as `DecoderWeights`: float weights by name and the few constants the
kernels need (norm epsilon, softmax scale, RoPE frequencies). Anything the kernels do not
compute is refused (a target, naming what differs) or left to ONNX Runtime (a head, saying
why). specx.builders.cpu rounds and writes what these return.

Why the head too: on a cpu build the target step fell to ~18 ms on pyref-1b while the head,
on ONNX Runtime, kept its 2.5 ms a step, 0.15 of a target step against the 0.062 its bytes
allow, and a chain of 4's drafting grew to 0.56 of the round (benchmarks/README.md#edgepy).
The kernels run the head's one layer as they run the target's: its q/k/v read
[input_norm(embed) | hidden_norm(features)] and its residual starts from the features
(forward.c). The head graph is read by structure, not by its MatMuls' names (the export
leaves them unnamed): the two input norms feed a Concat and one MatMul (q/k/v), the
post-attention norm one MatMul (gate | up) and reads Add(features, MatMul(o)), the final
norm one MatMul (the draft vocabulary's lm_head) and reads Add(h, MatMul(down)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from specx.artifact import Manifest
from specx.builders.staging import load_graph
from specx.errors import BuildError

__all__ = ["HEAD_GRAPHS", "DecoderWeights", "read_head", "read_target", "refuse"]


@dataclass(frozen=True)
class DecoderWeights:
    """A Llama-form target or EAGLE-3 head as the kernels take it: constants, float weights.

    Linear weights are [n_out, k_in] (HF's orientation); `qkv` packs q | k | v and `gate_up`
    gate | up along the outputs, as the exported graph does.
    """

    constants: dict[str, float | int]
    norms: dict[str, np.ndarray]  # input_norm.{i}, post_norm.{i}, final_norm (head: hidden_norm)
    linears: dict[str, np.ndarray]  # qkv.{i}, o.{i}, gate_up.{i}, down.{i}, lm_head
    embed: np.ndarray  # [V, d]
    inv_freq: np.ndarray  # [rotary dims / 2]


def refuse(manifest: Manifest, what: str) -> BuildError:
    """The error refusing a target the kernels do not compute, naming `what` differs."""
    return BuildError(
        f"{manifest.root}: --backend cpu builds Llama-form targets only; this one {what}"
    )


def constant(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def single_consumer(value: ir.Value, op_type: str) -> ir.Node | None:
    uses = [use.node for use in value.uses() if use.node.op_type == op_type]
    return uses[0] if len(uses) == 1 else None


def read_target(manifest: Manifest) -> DecoderWeights:
    """The exported target's weights and constants, or a `BuildError` naming what is not Llama's.

    Layers are found by their norms' HF names; each norm's output feeds one MatMul (the packed
    q/k/v, or gate/up) whose weight is read. o_proj and down_proj keep their HF names.
    """
    model = manifest.model
    family = model.family or "unknown"
    if family not in ("llama",):
        raise refuse(manifest, f"is of family {family!r}")
    graph = load_graph(manifest, "target").graph
    norms_by_scale = _norms(graph)
    ops = {node.op_type for node in graph}
    for op in ("Tanh", "Softplus", "Gelu", "Erf"):
        if op in ops:
            raise refuse(manifest, f"computes {op} (a soft cap or another activation)")
    attention = [node for node in graph if node.op_type == "TreeAttention"]
    if len(attention) != model.num_layers:
        raise refuse(manifest, f"has {len(attention)} attentions for {model.num_layers} layers")
    scales = {a.attributes["scale"].as_float() for a in attention}
    norms: dict[str, np.ndarray] = {}
    linears: dict[str, np.ndarray] = {}
    eps: set[float] = set()

    def norm_then_matmul(scale_name: str, key: str, linear: str | None) -> None:
        node = norms_by_scale.get(scale_name)
        weight = None if node is None else constant(node.inputs[1])
        if node is None or weight is None:
            raise refuse(manifest, f"has no RMS norm {scale_name}")
        eps.add(node.attributes["epsilon"].as_float())
        norms[key] = weight.astype(np.float32)
        if linear is None:
            return
        matmul = single_consumer(node.outputs[0], "MatMul")
        packed = None if matmul is None else constant(matmul.inputs[1])
        if packed is None or matmul is None or single_consumer(matmul.outputs[0], "Add"):
            raise refuse(manifest, f"does not feed {scale_name}'s output to one bias-free MatMul")
        linears[linear] = np.ascontiguousarray(packed.T, dtype=np.float32)

    for i in range(model.num_layers):
        prefix = f"model.layers.{i}."
        norm_then_matmul(prefix + "input_layernorm.weight", f"input_norm.{i}", f"qkv.{i}")
        norm_then_matmul(
            prefix + "post_attention_layernorm.weight", f"post_norm.{i}", f"gate_up.{i}"
        )
        for name, key in (("self_attn.o_proj", "o"), ("mlp.down_proj", "down")):
            value = graph.initializers.get(prefix + name + ".weight.T")
            if value is None or value.const_value is None:
                raise refuse(manifest, f"has no {prefix}{name} weight")
            linears[f"{key}.{i}"] = np.ascontiguousarray(value.const_value.numpy().T, np.float32)
    norm_then_matmul("model.norm.weight", "final_norm", "lm_head")
    embed = graph.initializers.get("model.embed_tokens.weight")
    inv_freq = graph.initializers.get("rotary.inv_freq")
    if (
        embed is None
        or inv_freq is None
        or embed.const_value is None
        or inv_freq.const_value is None
    ):
        raise refuse(manifest, "has no model.embed_tokens.weight or rotary.inv_freq")
    d, heads, kv_heads, head_dim = (
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
    )
    qkv_width = (heads + 2 * kv_heads) * head_dim
    if linears["qkv.0"].shape != (qkv_width, d) or len(eps) != 1 or len(scales) != 1:
        raise refuse(manifest, "is not shaped as its manifest says (q/k/v, norms or scales differ)")
    constants: dict[str, float | int] = {
        "hidden": d,
        "layers": model.num_layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "inter": linears["gate_up.0"].shape[0] // 2,
        "vocab": model.vocab_size,
        "eps": eps.pop(),
        "attn_scale": scales.pop(),
    }
    return DecoderWeights(
        constants,
        norms,
        linears,
        np.ascontiguousarray(embed.const_value.numpy(), np.float32),
        np.ascontiguousarray(inv_freq.const_value.numpy(), np.float32),
    )


# The graphs an EAGLE-3 head's drafting runs, all three replaced on a cpu build: the chain
# becomes a loop over the kernels' forwards (specx.runtime.drafters.chain_graph.StepChain).
HEAD_GRAPHS = ("draft_head", "draft_projection", "draft_chain")
_PREFIX = "head.midlayer."


class _Unreadable(Exception):
    """The head graph is not the EAGLE-3 layer the kernels run (the message says how)."""


def _norms(graph: ir.Graph) -> dict[str, ir.Node]:
    """The graph's RMS norms by the name of their scale."""
    return {
        scale.name: node
        for node in graph
        if node.op_type == "RMSNormalization"
        and (scale := node.inputs[1]) is not None
        and scale.name is not None
    }


def _weight(node: ir.Node | None, what: str) -> np.ndarray:
    """A bias-free MatMul's constant weight as [n_out, k_in]."""
    weight = None if node is None else constant(node.inputs[1])
    if node is None or weight is None or node.op_type != "MatMul":
        raise _Unreadable(f"no constant MatMul for {what}")
    return np.ascontiguousarray(weight.T, dtype=np.float32)


def _residual_matmul(norm: ir.Node, what: str) -> np.ndarray:
    """The weight of the MatMul added to the residual that `norm` reads: Add(x, MatMul(...))."""
    add = norm.inputs[0].producer() if norm.inputs[0] is not None else None
    if add is None or add.op_type != "Add":
        raise _Unreadable(f"{what}: the norm does not read a residual Add")
    producers = [v.producer() for v in add.inputs if v is not None]
    matmuls = [p for p in producers if p is not None and p.op_type == "MatMul"]
    return _weight(matmuls[0] if len(matmuls) == 1 else None, what)


def _read(manifest: Manifest) -> DecoderWeights:
    graph = load_graph(manifest, "draft_head").graph
    norms = _norms(graph)
    names = {
        "input_norm.0": _PREFIX + "input_layernorm.weight",
        "hidden_norm": _PREFIX + "hidden_norm.weight",
        "post_norm.0": _PREFIX + "post_attention_layernorm.weight",
        "final_norm": "head.norm.weight",
    }
    missing = [name for name in names.values() if name not in norms]
    if missing:
        raise _Unreadable(f"no RMS norm {missing[0]}")
    nodes = {key: norms[name] for key, name in names.items()}
    concat = single_consumer(nodes["input_norm.0"].outputs[0], "Concat")
    if concat is None or [v.name for v in concat.inputs if v is not None] != [
        nodes["input_norm.0"].outputs[0].name,
        nodes["hidden_norm"].outputs[0].name,
    ]:
        raise _Unreadable("its q/k/v do not read [input_norm(embed) | hidden_norm(features)]")
    linears = {
        "qkv.0": _weight(single_consumer(concat.outputs[0], "MatMul"), "q/k/v"),
        "o.0": _residual_matmul(nodes["post_norm.0"], "o_proj"),
        "gate_up.0": _weight(
            single_consumer(nodes["post_norm.0"].outputs[0], "MatMul"), "gate | up"
        ),
        "down.0": _residual_matmul(nodes["final_norm"], "down_proj"),
        "lm_head": _weight(single_consumer(nodes["final_norm"].outputs[0], "MatMul"), "lm_head"),
    }
    attention = [node for node in graph if node.op_type == "TreeAttention"]
    eps = {node.attributes["epsilon"].as_float() for node in nodes.values()}
    embed = constant(graph.initializers.get("head.embed_tokens.weight"))
    inv_freq = constant(graph.initializers.get("head.rotary.inv_freq"))
    if len(attention) != 1 or len(eps) != 1 or embed is None or inv_freq is None:
        raise _Unreadable("not one attention, one norm epsilon, an embedding and RoPE")
    decoder = manifest.graph("draft_head").decoder
    assert decoder is not None  # an exported head's entry has its shapes
    d, head_dim, kv_heads = decoder.hidden_size, decoder.head_dim, decoder.num_kv_heads
    heads = linears["qkv.0"].shape[0] // head_dim - 2 * kv_heads
    if linears["qkv.0"].shape[1] != 2 * d or heads <= 0 or heads % kv_heads:
        raise _Unreadable(f"q/k/v {linears['qkv.0'].shape} do not fit its {d} hidden size")
    constants: dict[str, float | int] = {
        "hidden": d,
        "layers": 1,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "inter": linears["gate_up.0"].shape[0] // 2,
        "vocab": linears["lm_head"].shape[0],
        "eps": eps.pop(),
        "attn_scale": attention[0].attributes["scale"].as_float(),
    }
    norm_weights = {key: constant(node.inputs[1]) for key, node in nodes.items()}
    return DecoderWeights(
        constants,
        {key: np.asarray(w, np.float32) for key, w in norm_weights.items()},
        linears,
        np.ascontiguousarray(embed, np.float32),
        np.ascontiguousarray(inv_freq, np.float32),
    )


def read_head(manifest: Manifest) -> tuple[DecoderWeights | None, np.ndarray | None, str]:
    """The EAGLE-3 head and its projection [n_out, k_in] for the kernels, or why not.

    Returns (head, projection, "") or (None, None, why the head stays on ONNX Runtime).
    """
    spec = manifest.drafter
    if spec is None or spec.kind != "eagle3" or spec.projection is None:
        kind = "other draft graphs" if spec is None else f"an {spec.kind} head"
        return None, None, f"the kernels run EAGLE-3 heads, not {kind}"
    try:
        head = _read(manifest)
        nodes = list(load_graph(manifest, spec.projection).graph)
        if len(nodes) != 1:
            raise _Unreadable("its projection is more than one MatMul")
        return head, _weight(nodes[0], "the projection"), ""
    except _Unreadable as e:
        return None, None, f"its EAGLE-3 head is not the layer the kernels run: {e}"
