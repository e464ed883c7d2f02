"""pyref-deep: pyref-7m's predictions at a 32-layer model's cost (block expansion).

pyref-7m has 5 real layers R0..R4. pyref-deep has 32: R0 and R1 at layers 0 and 1, R2 at 15,
R3 at 28, R4 at 31, and 27 copies of real layers with their o_proj and down_proj zeroed
(`specx.training.block_expansion`): every layer does real attention and MLP work and keeps a
KV cache (6.4x pyref-7m's), but the residual stream, and so every logit and the greedy
output, is pyref-7m's bit for bit. EAGLE-3's default taps (layers 2, 16, 29) read the
streams after R1, R2 and R3 (low, mid, high) and miss R4; the committed EAGLE-3 head names
its own (2, 3, 5 on pyref-7m: after R1, R2 and R4, which are pyref-deep's 2, 16, 32;
`pyref_heads.for_deep`). The last hidden state is pyref-7m's, so heads trained on pyref-7m
carry over unchanged. (tests/test_block_expansion.py checks this placement through
`specx.training.block_expansion`.)

    python -m benchmarks.models.pyref_deep [--out ~/.cache/specx/pyref-deep]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from benchmarks.inputs import PYREF_7M

LAYERS = 32
REAL_POSITIONS = (0, 1, 15, 28, 31)


def write(source: Path, out: Path) -> Path:
    """Writes pyref-deep to `out` (replacing an earlier one written here)."""
    from specx.training.block_expansion import ExpansionLayout, expand_checkpoint

    if (out / "config.json").is_file():
        shutil.rmtree(out)
    return expand_checkpoint(source, out, ExpansionLayout.placing(LAYERS, REAL_POSITIONS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=PYREF_7M)
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache/specx/pyref-deep")
    args = parser.parse_args()
    print(write(args.source, args.out))


if __name__ == "__main__":
    main()
