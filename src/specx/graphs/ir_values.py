"""Typed access to the onnx_ir values a pass relies on being there.

onnx_ir types every node input as optional (`Value | None`: ONNX lets an op omit its
optional inputs) and a value's producer and constant as optional too. Where the op or the
pattern a pass matched guarantees one, these say so once, and fail loudly if a graph breaks
the guarantee, instead of an AttributeError on None somewhere later.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["const_tensor", "input_at", "inputs_of", "name_of", "producer_of"]


def input_at(node: ir.Node, index: int) -> ir.Value:
    """The node's `index`-th input, one its op (or the matched pattern) requires."""
    value = node.inputs[index]
    if value is None:
        raise ValueError(f"{node.op_type} node {node.name!r} lacks its input {index}")
    return value


def inputs_of(node: ir.Node) -> list[ir.Value]:
    """All the node's inputs, for an op that has no optional ones (Add, Mul, Concat)."""
    return [input_at(node, i) for i in range(len(node.inputs))]


def producer_of(value: ir.Value) -> ir.Node:
    """The node computing `value`, which the caller knows is no graph input or initializer."""
    producer = value.producer()
    if producer is None:
        raise ValueError(f"value {value.name!r} has no producer")
    return producer


def const_tensor(value: ir.Value) -> ir.TensorProtocol:
    """The constant behind `value`, which the caller knows is an initializer."""
    if value.const_value is None:
        raise ValueError(f"value {value.name!r} is not a constant")
    return value.const_value


def name_of(value: ir.Value) -> str:
    """The value's name, where a serialized graph or a session feed needs one."""
    if value.name is None:
        raise ValueError("an unnamed value where a name is needed")
    return value.name
