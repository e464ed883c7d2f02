"""A quantized source's codes and scales, taken back from its de-quantized weights.

An artifact exported from llama.cpp's GGUF file (`specx.export.gguf`) holds the file's
weights de-quantized to fp32, exactly: a Q4_0 block of 32 is (q - 8) x d, a Q8_0 block
q x d, with d in fp16 and q small integers. A build at the same width need not round those
weights again (which would land on another grid: specx's int4 blocks are 128 wide and
asymmetric); it can recover llama.cpp's own q and d and run the very weights llama.cpp runs:

- Q4_0: llama.cpp's d is the block's value of largest magnitude over -8, so that value is
  (0 - 8) x d: d = v / -8 (exact: a power of two), q = w / d + 8.
- Q8_0: d = max |w| / 127 (the block's largest |q| is 127), q = w / d.

Every block is checked to give back its values exactly; a weight that does not (not from
such a file, or changed since) is refused by name rather than rounded silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specx.errors import BuildError
from specx.manifest_types import SourceGrid

__all__ = ["GRIDS", "Grid", "NONE_KEPT", "KeptGrids", "kept_codes", "kept_grids"]


@dataclass(frozen=True)
class Grid:
    """A llama.cpp block type the builds can keep."""

    name: str
    bits: int
    block: int
    zero: int  # the code of 0: q + zero is the stored code
    largest: int  # d = (the block's value of largest magnitude) / largest
    codes: tuple[int, int]  # the codes a block may hold, lowest and highest


GRIDS = {
    "Q4_0": Grid("Q4_0", bits=4, block=32, zero=8, largest=-8, codes=(0, 15)),
    "Q8_0": Grid("Q8_0", bits=8, block=32, zero=128, largest=127, codes=(1, 255)),
}


@dataclass(frozen=True)
class KeptGrids:
    """Which of a build's weights keep the source's grid: the layers', the output's."""

    linears: Grid | None
    output: Grid | None


NONE_KEPT = KeptGrids(None, None)


def kept_grids(source: SourceGrid | None, bits: int, output_bits: int) -> KeptGrids:
    """The source's grids a build at `bits` (output projection at `output_bits`) keeps."""

    def at(type_name: str | None, width: int) -> Grid | None:
        grid = GRIDS.get(type_name or "")
        return grid if grid is not None and grid.bits == width else None

    if source is None:
        return NONE_KEPT
    return KeptGrids(at(source.linears, bits), at(source.output, output_bits))


def kept_codes(weight: np.ndarray, grid: Grid, name: str) -> tuple[np.ndarray, np.ndarray]:
    """`weight` [n, k]'s codes [n, k] (uint8, q + zero) and scales [n, k / block] on `grid`.

    Raises:
        BuildError: a block whose values are not on the grid.
    """
    n, k = weight.shape
    if k % grid.block:
        raise BuildError(f"{name}: {k} inputs are not whole {grid.name} blocks of {grid.block}")
    blocks = weight.reshape(n, k // grid.block, grid.block).astype(np.float32)
    if grid.largest < 0:  # the signed value of largest magnitude
        at = np.abs(blocks).argmax(axis=-1)[..., None]
        scales = np.take_along_axis(blocks, at, axis=-1)[..., 0] / np.float32(grid.largest)
    else:
        scales = np.abs(blocks).max(axis=-1) / np.float32(grid.largest)
    safe = np.where(scales == 0, np.float32(1), scales)[..., None]
    q = np.rint(blocks / safe)
    lowest, highest = grid.codes
    off = (q + grid.zero < lowest) | (q + grid.zero > highest)
    exact = np.float16(scales).astype(np.float32) == scales  # d is stored in fp16
    if off.any() or not exact.all() or not np.array_equal(q * scales[..., None], blocks):
        raise BuildError(
            f"{name}: its weights are not on the source's {grid.name} grid (changed since the "
            "GGUF export?); build without the grid by exporting from a float checkpoint"
        )
    codes = (q + grid.zero).astype(np.uint8).reshape(n, k)
    return codes, scales
