"""What a build computes at: `--precision`'s closed vocabulary, typed.

A precision is a weight width and a kind: float (the whole graph at that width), weight-only
(integer weights, float activations: `specx build --precision int4 / int8`) or static
(weights and activations integer, scales calibrated on prompts: `specx quantize`). Static
INT8 and weight-only int8 share a width and differ in everything else, so they are two
values (and their builds two names: `ort-int8-static`, `ort-int8`). The manifest records a
build's precision by `name`, so an artifact reads without this module's types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specx.errors import BuildError

__all__ = ["BF16", "FP16", "FP32", "INT4", "INT8", "PRECISIONS", "STATIC_INT8", "Precision"]


@dataclass(frozen=True)
class Precision:
    """A build's precision (see the module docstring)."""

    name: str  # `--precision NAME`, and the build name's suffix
    bits: int  # a weight's
    kind: Literal["float", "weight-only", "static"]

    def __str__(self) -> str:
        return self.name if self.kind != "static" else f"{self.name} (static)"

    @property
    def weight_only(self) -> bool:
        """Integer weights, float activations (the weight-only options apply)."""
        return self.kind == "weight-only"

    @property
    def is_float(self) -> bool:
        """The whole graph in floating point."""
        return self.kind == "float"

    @staticmethod
    def named(name: str | Precision) -> Precision:
        """`--precision NAME`'s value; BuildError naming the choices for any other name."""
        if isinstance(name, Precision):
            return name
        if name not in PRECISIONS:
            raise BuildError(f"--precision must be one of {', '.join(PRECISIONS)}, not {name!r}")
        return PRECISIONS[name]


FP32 = Precision("fp32", 32, "float")
FP16 = Precision("fp16", 16, "float")
BF16 = Precision("bf16", 16, "float")
INT4 = Precision("int4", 4, "weight-only")
INT8 = Precision("int8", 8, "weight-only")
STATIC_INT8 = Precision("int8", 8, "static")  # `specx quantize`; not a `--precision` choice

# `specx build --precision`'s choices, by name.
PRECISIONS: dict[str, Precision] = {p.name: p for p in (FP32, FP16, BF16, INT4, INT8)}
