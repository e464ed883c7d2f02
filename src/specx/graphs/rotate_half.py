"""RoPE's rotate_half as specx's export writes it, matched in one place for every lowering.

    rotate_half(x) = Concat(Neg(Split(x)[1]), Split(x)[0])   # x [..., D] halved on its last axis

The ONNX Runtime lowering finds it inside the RoPE it moves (`specx.graphs.ort_lowering`);
the OpenVINO lowering respells it (`specx.graphs.ov_lowering.RotateHalfPass`).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from specx.graphs.ir_values import input_at

__all__ = ["RotateHalf", "match_rotate_half"]


@dataclass(frozen=True)
class RotateHalf:
    """A matched rotate_half: its Concat and Split nodes, its input and half its width."""

    concat: ir.Node
    split: ir.Node
    x: ir.Value  # [..., D]
    half: int  # D / 2


def match_rotate_half(concat: ir.Node) -> RotateHalf | None:
    """The rotate_half whose output `concat` computes, or None for any other node."""
    if concat.op_type != "Concat" or len(concat.inputs) != 2:
        return None
    negated, first = concat.inputs
    neg = negated.producer() if negated is not None else None
    if neg is None or neg.op_type != "Neg":
        return None
    split = input_at(neg, 0).producer()
    if split is None or split.op_type != "Split" or list(split.outputs) != [first, neg.inputs[0]]:
        return None
    x = input_at(split, 0)
    shape = x.shape
    if shape is None or not isinstance(shape[-1], int) or shape[-1] % 2:
        return None
    last = (-1, len(shape) - 1)
    axes = split.attributes.get_int("axis", 0), concat.attributes.get_int("axis")
    if any(axis not in last for axis in axes):
        return None
    sizes = split.inputs[1] if len(split.inputs) > 1 else None
    halves = sizes.const_value if sizes is not None else None
    if halves is not None and halves.numpy().tolist() != [shape[-1] // 2] * 2:
        return None
    return RotateHalf(concat, split, x, shape[-1] // 2)
