"""What a request that does not speculate pays for having a drafter: the speculative loop idle.

On one artifact (pyref-7m, exported with the drafter's head where it has one, ORT-lowered),
per batch size: plain decoding (`generate_plain`), then `generate_speculative` with the
drafter but no draft ever verified, in three ways:
- `stretch`: one stretch of plain steps for the whole request (a controller that never
  drafts): the loop's own cost, and whatever the drafter's start costs the steps after it;
- `steps`: a stretch of one step per round (a controller that re-decides every round and
  always says "plain"): the cost a stretch's end adds (the drafter hearing of it);
- `default`: the engine's default (`generate_batch(..., speculation=DRAFTER)`), which may
  probe;
and plain decoding again (`control`, the run's noise band). Groups of --batch prompts, every
mode per group in an order rotated by repeat, the engine's pooled drafter (`reset_drafters`
before each run: fresh where it learns across requests), fastest of --repeats
per group, decode and total time (with the prefill) apart; ratios are plain's time over the
mode's (1.0: free).

    python benchmarks/idle_cost.py [--drafter eagle3] [--batches 1,4] [--repeats 15]

Writes benchmarks/results/idle_cost.json (merged by drafter) and prints one line per cell.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pyref_heads  # noqa: E402
from peers import load_prompts  # noqa: E402
from runners import scratch_dir  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
MODES = ("plain", "stretch", "steps", "default", "control")


def artifact(drafter: str, work: Path) -> Path:
    """pyref-7m exported (with the committed head when `drafter` is one) and ORT-lowered."""
    from specx.build import BuildOptions, build_artifact
    from specx.export.target_export import export_target

    head = pyref_heads.HEADS / drafter
    spec = f"{drafter}:{head}" if (head / "config.json").is_file() else None
    checkpoint = SHARED / "models" / "pyref-7m"
    out = export_target(checkpoint, work / drafter, max_context=1024, drafter=spec)
    build_artifact(out, BuildOptions("ort", "fp32"))
    return out


def measure(engine, drafter: str, groups, temperature: float, repeats: int) -> dict[str, dict]:
    """Plain's time over each mode's (decode, and total with the prefill), summed over the
    groups' fastest runs."""
    from specx.runtime.controller import FixedSizes
    from specx.runtime.engine import Speculation
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.speculative_decoding import generate_speculative

    class Never(FixedSizes):
        def idle_rounds(self, active):  # noqa: D102
            return 1 << 30  # the whole request is one stretch

    sampling = SamplingParams(temperature, seed=0)
    options = {"max_new_tokens": 64, "temperature": temperature, "seed": 0, "ignore_eos": True}

    def idle(group, controller) -> tuple[float, float]:
        engine.reset_drafters()  # as `default`: a drafter that learns starts fresh
        plan = engine.plan(Speculation(drafter), sampling)
        pooled = engine.plans.take(plan)
        try:
            done = generate_speculative(
                engine.target, pooled, group, 64, sampling, controller=controller
            )
        finally:
            engine.plans.give_back(plan, pooled)
        return done.stats.decode_s, done.stats.total_s

    def default(group) -> tuple[float, float]:
        engine.reset_drafters()
        run = engine.generate_batch(group, **options, speculation=drafter)[0].stats.run
        return run.decode_s, run.total_s

    def plain(group) -> tuple[float, float]:
        run = engine.generate_batch(group, **options)[0].stats.run
        return run.decode_s, run.total_s

    run = {
        "plain": plain,
        "stretch": lambda g: idle(g, Never([0])),
        "steps": lambda g: idle(g, FixedSizes([0])),
        "default": default,
        "control": plain,
    }
    inf = (float("inf"), float("inf"))
    best = [{mode: [*inf] for mode in MODES} for _ in groups]  # fastest decode, total
    for r in range(repeats):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for group, fastest in zip(groups, best, strict=True):
            plain(group)  # untimed: the group's shapes warm
            for mode in order:
                times = run[mode](group)
                fastest[mode] = [min(a, b) for a, b in zip(fastest[mode], times, strict=True)]
    ratios: dict[str, dict] = {}
    for i, measure_name in enumerate(("decode", "total")):
        summed = {mode: sum(f[mode][i] for f in best) for mode in MODES}
        ratios[measure_name] = {m: round(summed["plain"] / summed[m], 4) for m in MODES[1:]}
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="eagle3")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/idle_cost.json"))
    args = parser.parse_args()
    if not (SHARED / "models" / "pyref-7m" / "config.json").is_file():
        print(f"{SHARED} has no pyref-7m; nothing measured", file=sys.stderr)
        return
    from specx.runtime.engine import load

    half = args.prompts // 2
    prompts = load_prompts("humaneval.jsonl", half) + load_prompts(
        "mt_bench.jsonl", args.prompts - half
    )
    engine = load(artifact(args.drafter, scratch_dir("specx-idle-")), threads=2)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    cells = {}
    for batch in map(int, args.batches.split(",")):
        groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        key = f"{args.drafter} T={args.temperature} batch {batch}"
        cells[key] = measure(engine, args.drafter, groups, args.temperature, args.repeats)
        print(key, cells[key], flush=True)
    report = json.loads(args.out.read_text()) if args.out.is_file() else {"runs": {}}
    report["runs"][args.drafter] = {
        "specx_commit": commit.stdout.strip(),
        "prompts": args.prompts,
        "repeats": args.repeats,
        "new_tokens": 64,
        "cells": cells,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
