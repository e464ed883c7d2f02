"""The trained heads the pyref-deep benchmarks read: one recipe per kind, trained when missing.

Each head is distilled against pyref-7m (`shared/models/pyref-7m`), whose residual stream is
pyref-deep's (benchmarks/pyref_deep.py), so training is 6x cheaper than against the deep
target; EAGLE-3 reads the teacher's layers 2, 3, 4, which are pyref-deep's taps 2, 16, 29.
Corpus: the CPython standard library files the reference split does not hold out (as the
suite). A head is trained only when `DIR/<kind>/train_report.json` is missing (`retrain`:
always), so the benchmarks rerun on the same heads; the recipe and seed are in each
`train_report.json`.

    python benchmarks/pyref_heads.py [--kinds eagle,eagle3] [--heads DIR] [--retrain]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from suite import SHARED, stdlib_split  # noqa: E402

HEADS = Path.home() / ".cache" / "specx" / "pyref-heads"
# kind -> TrainConfig fields besides COMMON (on a 2-core machine: EAGLE-1 ~24 min, EAGLE-3 ~40).
RECIPES: dict[str, dict] = {
    "eagle": {"steps": 2400, "on_policy_windows": 256},
    "eagle3": {
        "steps": 1500,
        "ttt_steps": 4,
        "draft_vocab": 2048,
        "tap_layers": (2, 3, 4),
        "on_policy_windows": 512,
    },
}
COMMON = {"batch": 8, "seq_len": 256, "lr": 2e-3, "seed": 0, "save_every": 200}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_heads(kinds: list[str], heads: Path = HEADS, retrain: bool = False) -> list[str]:
    """Trains the `kinds` missing under `heads` (all of them with `retrain`); returns them."""
    from specx.training.loop import TrainConfig, train_drafter

    unknown = sorted(set(kinds) - set(RECIPES))
    if unknown:
        raise SystemExit(f"no recipe for {unknown}; known: {sorted(RECIPES)}")
    train_files, _ = stdlib_split()
    for kind in kinds:
        out = heads / kind
        if retrain or not (out / "train_report.json").is_file():
            log(f"training the {kind} head into {out} ({RECIPES[kind]})")
            config = TrainConfig(kind, **COMMON, **RECIPES[kind])
            train_drafter(
                SHARED / "models" / "pyref-7m", [str(p) for p in train_files], out, config, log
            )
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(RECIPES))
    parser.add_argument("--heads", type=Path, default=HEADS)
    parser.add_argument("--retrain", action="store_true")
    args = parser.parse_args()
    if not (SHARED / "models" / "pyref-7m" / "model.safetensors").is_file():
        log("skipped: shared/models/pyref-7m is absent")
        return
    ensure_heads(args.kinds.split(","), args.heads, args.retrain)


if __name__ == "__main__":
    main()
