"""TensorRT optimization profiles for a specx graph, from its manifest signature.

A TensorRT engine with dynamic dimensions needs, per input, the min/opt/max shape it is
tuned for. specx graphs name their dynamic dims, so the ranges follow from the manifest:

    batch     1 .. max_batch                   (opt: opt_batch)
    tokens    decode profile 1 .. max_tree_tokens (opt: opt_tokens); prefill 1 .. kv_capacity
    kv_len    1 .. kv_capacity                 (opt: half the capacity)
    capacity  kv_capacity exactly: the TensorRT backend always allocates full caches

Two profiles, because a tree of at most 64 tokens and a prompt of thousands want
different kernels: profile 0 (`decode`) serves verification and drafting, profile 1
(`prefill`) serves prompts. Pure: no TensorRT import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specx.errors import ArtifactError
from specx.manifest_types import TensorSpec

__all__ = ["ProfileLimits", "Shapes", "optimization_profiles"]

Shapes = tuple[list[int], list[int], list[int]]  # min, opt, max


@dataclass(frozen=True)
class ProfileLimits:
    """The ranges an engine is built for."""

    kv_capacity: int
    max_tree_tokens: int
    max_batch: int = 8
    opt_batch: int = 1
    opt_tokens: int = 8


def optimization_profiles(
    inputs: Sequence[TensorSpec], limits: ProfileLimits
) -> dict[str, dict[str, Shapes]]:
    """`{"decode": {input: (min, opt, max)}, "prefill": {...}}` for a graph's inputs.

    `inputs` is the graph's manifest signature: name, dtype, shape with ints or dim names.

    Raises:
        ArtifactError: an input has a dynamic dimension whose range is unknown.
    """
    cap = limits.kv_capacity
    tree = min(limits.max_tree_tokens, cap)
    ranges = {
        "decode": {"tokens": (1, min(limits.opt_tokens, tree), tree)},
        "prefill": {"tokens": (1, max(1, cap // 2), cap)},
    }
    shared = {
        "batch": (1, min(limits.opt_batch, limits.max_batch), limits.max_batch),
        "kv_len": (1, max(1, cap // 2), cap),
        "capacity": (cap, cap, cap),
    }
    profiles: dict[str, dict[str, Shapes]] = {}
    for profile, own in ranges.items():
        dims = {**shared, **own}
        shapes: dict[str, Shapes] = {}
        for value in inputs:
            if all(isinstance(d, int) for d in value.shape):
                continue
            bounds = []
            for dim in value.shape:
                if isinstance(dim, int):
                    bounds.append((dim, dim, dim))
                elif dim in dims:
                    bounds.append(dims[dim])
                else:
                    raise ArtifactError(
                        f"input {value.name!r} has dynamic dimension {dim!r}; the TensorRT "
                        f"build knows the ranges of {sorted(dims)} only"
                    )
            shapes[value.name] = tuple([b[i] for b in bounds] for i in range(3))  # type: ignore[assignment]
        profiles[profile] = shapes
    return profiles
