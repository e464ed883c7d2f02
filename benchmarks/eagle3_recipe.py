"""What each part of the EAGLE-3 recipe buys on pyref-7m: taps, draft vocabulary, TTT depth,
training data, bf16, tap scaling; one change at a time against a base recipe,
same steps and seed.

Every run trains `--steps` steps of 8 x 256 tokens (lr 2e-3, seed 0) and is measured on the
same held-out target-generated windows (pyref_heads.py's data: the target continuing
prompts from stdlib files the reference split holds out): acceptance `sum min(p, q)` by
draft depth and the chain-5 acceptance length those rates imply. Writes
benchmarks/results/eagle3_recipe.json.

    python benchmarks/eagle3_recipe.py [--steps 150] [--only base,taps-234,...]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pyref_heads  # noqa: E402
from suite import SHARED, stdlib_split  # noqa: E402

BASE = {"tap_layers": (2, 3, 5), "ttt_steps": 3, "draft_vocab": None, "normalise_taps": False}
# name -> (what changes, the TrainConfig fields it changes, train on the stdlib text instead)
VARIANTS: dict[str, tuple[str, dict, bool]] = {
    "base": (
        "taps 2,3,5 (low, mid, last output), full vocabulary, TTT 3, bf16, raw taps",
        {},
        False,
    ),
    "taps-234": (
        "taps 2,3,4 (pyref-deep's default taps: misses the last layer)",
        {"tap_layers": (2, 3, 4)},
        False,
    ),  # fmt: skip
    "taps-135": ("taps 1,3,5", {"tap_layers": (1, 3, 5)}, False),
    "taps-222": (
        "taps 2,2,2 (EAGLE-3's 2, N//2, N-3 on 5 layers)",
        {"tap_layers": (2, 2, 2)},
        False,
    ),  # fmt: skip
    "vocab-2048": ("draft vocabulary 2048 (most frequent tokens)", {"draft_vocab": 2048}, False),
    "ttt-7": ("training-time test 7 steps (the paper's depth)", {"ttt_steps": 7}, False),
    "stdlib-text": ("the stdlib text itself instead of the target's continuations", {}, True),
    "fp32": ("fp32 (the base trains under bf16 autocast)", {"bf16": False}, False),
    "normalised-taps": (
        "taps scaled to unit RMS per channel while training (folded into fc when saved)",
        {"normalise_taps": True},
        False,
    ),
}


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, file=sys.stderr, flush=True)


def run(name: str, steps: int, work: Path) -> dict:
    from specx.training.loop import TrainConfig, train_drafter

    what, change, stdlib = VARIANTS[name]
    fields = {**pyref_heads.COMMON, **BASE, **change, "steps": steps, "eval_every": 0}
    fields["save_every"] = steps + 1
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    data = pyref_heads.ensure_data()
    corpus = [str(p) for p in stdlib_split()[0]] if stdlib else []
    started = time.perf_counter()
    report = train_drafter(
        SHARED / "models" / "pyref-7m",
        corpus,
        out,
        TrainConfig("eagle3", **fields),
        log,
        data=[] if stdlib else data.train,
        held_out=data.held_out,
    ).report
    last = report["learning_curve"][-1]
    return {
        "change": what,
        "config": report["config"],
        "seconds": time.perf_counter() - started,
        "tokens_per_s": steps * fields["batch"] * fields["seq_len"] / report["train_seconds"],
        "acceptance_by_depth": last["acceptance_by_depth"],
        "tau_chain5_estimate": last["tau_chain5_estimate"],
        "coverage_held_out": report.get("coverage_held_out"),
    }


def coverage(sizes=(512, 1024, 2048, 3072, 4096)) -> dict[str, dict[str, float]]:
    """Share of training / held-out target tokens inside a draft vocabulary of each size
    (the most frequent training tokens, as `specx train --draft-vocab`)."""
    from specx.training.loop import _coverage, _draft_vocab
    from specx.training.regenerate import read_windows

    data = pyref_heads.ensure_data()
    train, held = read_windows(data.train[0]), read_windows(data.held_out)
    out = {}
    for size in sizes:
        ids = _draft_vocab(train, size, 4096)
        out[str(size)] = {
            "train": _coverage(train, ids, 4096),
            "held_out": _coverage(held, ids, 4096),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--only", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/eagle3_recipe.json"))
    args = parser.parse_args()
    if not (SHARED / "models" / "pyref-7m" / "model.safetensors").is_file():
        log("skipped: shared/models/pyref-7m is absent")
        return
    work = Path.home() / ".cache" / "specx" / "eagle3-recipe"
    report = json.loads(args.out.read_text()) if args.out.is_file() else {"runs": {}}
    report.update(
        {
            "benchmark": "eagle3_recipe",
            "steps": args.steps,
            "machine": {"platform": platform.platform(), "cpu_threads": 2},
        }
    )
    report["draft_vocab_coverage"] = coverage()
    log(f"draft vocabulary coverage: {report['draft_vocab_coverage']}")
    for name in [n for n in args.only.split(",") if n]:
        log(f"{name}: {VARIANTS[name][0]}")
        report["runs"][name] = row = run(name, args.steps, work)
        log(
            f"  acceptance by depth {[round(a, 3) for a in row['acceptance_by_depth']]}, "
            f"chain-5 tau ~{row['tau_chain5_estimate']:.2f}, {row['tokens_per_s']:.0f} tokens/s"
        )
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
