"""Sibling MatMuls packed into one: q/k/v projections, gate/up projections.

MatMuls that read the same activation with constant weights of their own become one MatMul
over the weights concatenated along the output axis, followed by a Split into the original
outputs. Each output column is the same dot product over the same inputs, so values do not
change; ONNX Runtime runs one GEMM per group instead of two or three. Measured on pyref-7m,
plain decoding on 2 CPU threads, fastest of 3, in either order: faster, identical tokens
(docs/decisions.md#packed-matmuls). The exported graphs
carry the packed form (`specx.export.onnx_graph.export_module`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes.common import RemoveUnusedNodesPass

from specx.graphs.ir_values import const_tensor, input_at

__all__ = ["PackSiblingMatMulsPass"]


class PackSiblingMatMulsPass(InPlacePass):
    """Packs MatMuls sharing their first input, each with its own constant 2D weight."""

    def call(self, model: ir.Model) -> PassResult:
        """Replaces each group of two or more such MatMuls by one MatMul and a Split."""
        graph = model.graph
        groups: dict[int, list[ir.Node]] = {}
        for node in graph:
            if _packable(node):
                groups.setdefault(id(node.inputs[0]), []).append(node)
        packed = [nodes for nodes in groups.values() if len(nodes) > 1]
        for nodes in packed:
            _pack(graph, nodes)
        if packed:
            RemoveUnusedNodesPass()(model)  # the unpacked weights
        return PassResult(model, modified=bool(packed))


def _packable(node: ir.Node) -> bool:
    if (node.domain, node.op_type) != ("", "MatMul") or node.inputs[0] is None:
        return False
    weight = node.inputs[1]
    return (
        weight is not None
        and weight.const_value is not None
        and weight.shape is not None
        and len(weight.shape) == 2
        and len(list(weight.uses())) == 1  # a shared (tied) weight would be copied
        and weight.dtype == node.inputs[0].dtype
    )


@runtime_checkable
class Concatenable(Protocol):
    """A lazy weight that can stand for itself and others side by side, still unread."""

    def concatenated(self, others: list[ir.TensorProtocol], name: str) -> ir.TensorProtocol:
        """The weights [self, *others] along axis 1, or NotImplemented."""


def _concatenated(tensors: list[ir.TensorProtocol], name: str) -> ir.TensorProtocol:
    """The weights side by side; a streamed export's stay on disk until they are written."""
    first, others = tensors[0], tensors[1:]
    if isinstance(first, Concatenable):
        packed = first.concatenated(others, name)
        if packed is not NotImplemented:
            return packed
    return ir.tensor(np.concatenate([t.numpy() for t in tensors], axis=1), name=name)


def _pack(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    tensors = [const_tensor(input_at(node, 1)) for node in nodes]
    first = nodes[0]
    name = first.outputs[0].name
    packed_weight = ir.val(
        f"{name}_packed_weight", const_value=_concatenated(tensors, f"{name}_packed_weight")
    )
    sizes = np.array([t.shape[1] for t in tensors], dtype=np.int64)
    split_sizes = ir.Value(
        name=f"{name}_packed_split",
        shape=ir.Shape([len(nodes)]),
        type=ir.TensorType(ir.DataType.INT64),
        const_value=ir.tensor(sizes, name=f"{name}_packed_split"),
    )
    graph.register_initializer(packed_weight)
    graph.register_initializer(split_sizes)
    matmul = ir.node("MatMul", [first.inputs[0], packed_weight], name=f"{first.name}_packed")
    split = ir.node(
        "Split",
        [matmul.outputs[0], split_sizes],
        {"axis": -1},
        num_outputs=len(nodes),
        name=f"{first.name}_unpacked",
    )
    graph.insert_before(first, [matmul, split])
    matmul.outputs[0].type = first.outputs[0].type
    if first.outputs[0].shape is not None:
        dims = list(first.outputs[0].shape)
        matmul.outputs[0].shape = ir.Shape([*dims[:-1], int(sizes.sum())])
    for node, output in zip(nodes, split.outputs, strict=True):
        original = node.outputs[0]
        output.shape, output.type = original.shape, original.type
        ir.convenience.replace_all_uses_with(original, output, replace_graph_outputs=True)
        output_name = original.name
        original.name = f"{output_name}_unpacked"
        output.name = output_name
