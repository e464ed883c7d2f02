"""Speculation that never loses: the per-round controller vs fixed drafts vs plain decoding.

For each target (pyref-7m; pyref-deep when `benchmarks/models/pyref_deep.py` wrote it), drafter
(ngram, suffix, skip, ngram+eagle3, and every trained drafter under --heads, the committed
benchmarks/heads/pyref-7m: EAGLE-1/3, Medusa, MTP and the draft model, all trained against pyref-7m,
whose residual stream and tokens pyref-deep shares; what a head's layout names by layer is
renumbered for pyref-deep, `pyref_heads.for_deep`), temperature (0, 0.7, 1.0; --temperatures) and
batch (1, 2, 4, 6, 8; --batches): plain decoding, the drafter at its default configuration with
every draft kept (`--fixed-draft`: chains of 4, suffix's 16 nodes, Medusa's default tree), and the
default `specx generate` (what `specx.load(...).generate_batch(..., speculation=DRAFTER)` does: the
calibration entry nearest the temperature when there is one, and the per-round controller), on the
ORT-lowered build (skip: cpu-int8); each repeat runs every group of prompts in turn (an untimed
plain run, then the modes in an order rotated by repeat), fastest of --repeats per group; decode
time. All three go through one `Engine`. Beside it, `paired`: per group the median over repeats of
plain's time over the mode's in the same repeat (`_paired`), which a drift in the machine's speed
does not move; `paired_total_speedup` the same with the prefill (where a drafter's prompt work is:
suffix drafting's indexing, a head's catch-up).

With --calibrate, every drafter is first calibrated at each temperature (`specx calibrate
--temperature T`, batches 1, 2, 4, 8, its default; suffix drafting, which sizes its own trees,
gets its batch threshold only) on --prompts other prompts of the same sets, as a deployment
would at build time. Every timed run starts after `Engine.reset_drafters`: a pooled suffix
drafter would otherwise have seen the same prompt's output in the previous repeat (drafters
that do not learn across requests stay pooled, as on a server). With --first-request every
timed run starts after `Engine.forget_requests` instead: round costs, when asking pays and the
acceptance earlier requests found are forgotten too, so each run is a fresh process's first
request (what `specx generate` always is; a server learns them across requests).
--only DRAFTERS --merge re-measures some drafters into an existing report.

    python -m benchmarks.never_loses [--prompts 24] [--new-tokens 64] [--repeats 2] [--calibrate]
        [--first-request] [--batches 1,2,4,6,8] [--only ngram,suffix,eagle3,draft-model]
        [--min-groups 8]

--min-groups N: a cell at batch B times max(--prompts, N x B) prompts, so that every cell has
at least N groups (24 prompts give a batch-8 cell 3 groups, whose paired speedup spread +-5-7%).
Prompts alternate HumanEval and mt_bench, so every cell and most groups hold both sets;
--load copy times rewrite requests instead (`copy_load`: a held-out function, a request to write
it again, its first third), keyed `TARGET DRAFTER copy T=.. batch ..`.

Writes benchmarks/results/never_loses.json and prints a markdown table: each cell with the 95%
bootstrap interval of its prompt groups' paired speedups (`bootstrap_interval`), then each
drafter's pooled speedup over all its groups, with its interval (`pooled`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import subprocess
from pathlib import Path

from benchmarks.inputs import PYREF_7M, RESULTS, SHARED, copy_heavy_prompts, load_prompts, log
from benchmarks.models import pyref_heads
from benchmarks.runners import scratch_dir

HEAD_KINDS = ("eagle", "eagle3", "medusa", "mtp")
MODEL_FREE = ("none", "skip")  # artifacts without a head: ngram, suffix, the draft model; skip
TEMPERATURES = (0.0, 0.7, 1.0)
BATCHES = (1, 2, 4, 6, 8)  # 24 prompts make whole groups of each


def artifacts(
    work: Path, heads: Path, only: list[str] | None = None, targets: list[str] | None = None
) -> dict[str, dict[str, Path]]:
    """target -> drafter kind ("none" for model-free) -> artifact with an ort-fp32 build
    (skip's: a cpu-int8 build, where the kernels skip layers over the target's weights).

    Heads: EAGLE-1/3, Medusa and MTP from `heads` (benchmarks/models/pyref_heads.py; renumbered for
    pyref-deep by `pyref_heads.for_deep`), each where it exists (`only`: these kinds alone;
    `targets`: these targets alone).
    """
    from specx.builders import BuildOptions, build_artifact
    from specx.export.target_export import export_target

    checkpoints = {"pyref-7m": PYREF_7M}
    deep = Path.home() / ".cache" / "specx" / "pyref-deep"
    if (deep / "config.json").is_file():
        checkpoints["pyref-deep"] = deep
    kinds = [k for k in HEAD_KINDS if (heads / k / "config.json").is_file()]
    built: dict[str, dict[str, Path]] = {}
    for name, checkpoint in checkpoints.items():
        if targets is not None and name not in targets:
            continue
        built[name] = {}
        for kind in ["none", "skip", *kinds]:
            if only is not None and kind != "none" and kind not in only:
                continue
            log(f"exporting {name} ({kind})")
            source = heads / kind
            if name == "pyref-deep" and kind not in MODEL_FREE:
                source = pyref_heads.for_deep(kind, heads, work / name)
            drafter = None if kind in MODEL_FREE else f"{kind}:{source}"
            out = export_target(checkpoint, work / name / kind, max_context=1024, drafter=drafter)
            # skip drafts with the cpu kernels over the target's own weights (int8 there).
            build_artifact(
                out, BuildOptions("cpu", "int8") if kind == "skip" else BuildOptions("ort", "fp32")
            )
            built[name][kind] = out
    return built


def draft_model(work: Path, heads: Path) -> str | None:
    """`draft-model:ARTIFACT` for the committed draft model, or None when absent."""
    from specx.export.target_export import export_target

    checkpoint = heads / "draft-model"
    if not (checkpoint / "config.json").is_file():
        return None
    return f"draft-model:{export_target(checkpoint, work / 'draft-model', max_context=1024)}"


def free_load(total: int) -> tuple[list[list[int]], list[list[int]]]:
    """`total` HumanEval and MT-bench prompts, alternating, and as many others to calibrate on.

    Interleaved, so that a cell's first prompts hold both sets whatever its count.
    """
    half = total // 2
    humaneval = load_prompts("humaneval.jsonl", 2 * half)
    mt_bench = load_prompts("mt_bench.jsonl", 2 * (total - half))
    pairs = itertools.zip_longest(humaneval[:half], mt_bench[: total - half])
    prompts = [p for pair in pairs for p in pair if p is not None]
    return prompts, humaneval[half:] + mt_bench[total - half :]


def copy_load(total: int) -> tuple[list[list[int]], list[list[int]]]:
    """`total` rewrite requests (`copy_heavy_prompts` from 300 characters: 74 in all), the
    last 8 kept apart to calibrate on; the rest cycled, so each group of up to 66 consecutive
    prompts (a batch) holds no prompt twice."""
    from specx.runtime.tokenizer import TextTokenizer

    pool = copy_heavy_prompts(TextTokenizer(PYREF_7M / "tokenizer.json"), None, shortest=300)
    timed, held_out = pool[:-8], pool[-8:]
    return [timed[i % len(timed)] for i in range(total)], held_out


def measure_cell(engine, drafter, prompts, batch, temperature, args) -> dict:
    from specx.runtime.engine import Speculation

    # Medusa keeps its default static tree; every other head and the draft model chain 4.
    fixed = Speculation(drafter, num_draft_tokens=16 if drafter == "suffix" else 4,
                        adaptive=False)  # fmt: skip
    options = {"max_new_tokens": args.new_tokens, "temperature": temperature, "seed": 0,
               "ignore_eos": True}  # fmt: skip
    modes = {"plain": None, "fixed": fixed, "default": drafter}
    if args.no_fixed:
        del modes["fixed"]
    if args.control:
        modes["control"] = None  # plain again: the cell's own noise band
    decode = dict.fromkeys(modes, 0.0)
    ratios: dict[str, list[float]] = {name: [] for name in modes if name != "plain"}
    identical, sizes, calibration = True, {}, None
    count = max(args.prompts, args.min_groups * batch)  # every cell has --min-groups groups
    groups = [prompts[start : start + batch] for start in range(0, count, batch)]
    bests: list[dict[str, list]] = [{} for _ in groups]
    runs: list[dict[str, list]] = [{name: [] for name in modes} for _ in groups]  # RunStats
    # Repeats outside groups: what the engine learnt across requests (round costs, when to
    # ask a drafter) comes from the other prompts' runs, as on a server, never from this
    # prompt's previous repeat.
    for r in range(args.repeats):
        names = list(modes)[r % len(modes) :] + list(modes)[: r % len(modes)]
        for group, best, run in zip(groups, bests, runs, strict=True):
            # Untimed: the timed runs find this group's shapes warm, as back-to-back repeats
            # of one group did (cold, a group's fastest of 9 spread 0.10 against 0.06).
            engine.generate_batch(group, **options)
            for name in names:
                # Every run starts cold: a pooled suffix drafter would otherwise have seen
                # this very prompt's output in the previous repeat.
                if args.first_request:
                    engine.forget_requests()
                else:
                    engine.reset_drafters()
                done = engine.generate_batch(group, **options, speculation=modes[name])
                run[name].append(done[0].stats.run)
                if name not in best or done[0].stats.decode_s < best[name][0].stats.decode_s:
                    best[name] = done
    for best in bests:
        for name, done in best.items():
            decode[name] += done[0].stats.decode_s
        for name in ratios:  # the group's own speedup: the pairs the interval resamples
            ratios[name].append(best["plain"][0].stats.decode_s / best[name][0].stats.decode_s)
        if temperature == 0:
            plain = [c.tokens for c in best["plain"]]
            identical &= all([c.tokens for c in best[m]] == plain for m in modes)
        stats = best["default"][0].stats
        calibration = stats.calibration or calibration
        spec = stats.run.speculative
        chosen = spec.controller.sizes_chosen if spec and spec.controller else {}
        for size, count in chosen.items():
            sizes[size] = sizes.get(size, 0) + count
    paired = {name: [_paired(run, name, "decode_s") for run in runs] for name in ratios}
    # With the prefill: a drafter's prompt work (suffix indexing, a head's catch-up) is there.
    paired_total = {name: [_paired(run, name, "total_s") for run in runs] for name in ratios}
    return {
        "fixed_speedup": decode["plain"] / decode["fixed"] if "fixed" in decode else None,
        "default_speedup": decode["plain"] / decode["default"],
        "control_speedup": decode["plain"] / decode["control"] if "control" in decode else None,
        "default_interval": bootstrap_interval(ratios["default"]),
        "control_interval": bootstrap_interval(ratios["control"]) if "control" in ratios else None,
        "group_speedups": {name: [round(r, 4) for r in rs] for name, rs in ratios.items()},
        "paired_group_speedups": {n: [round(r, 4) for r in rs] for n, rs in paired.items()},
        "paired_speedup": _geometric_mean(paired["default"]),
        "paired_interval": bootstrap_interval(paired["default"]),
        "paired_control": _geometric_mean(paired["control"]) if "control" in paired else None,
        "paired_control_interval": (
            bootstrap_interval(paired["control"]) if "control" in paired else None
        ),
        "paired_total_speedup": _geometric_mean(paired_total["default"]),
        "paired_total_interval": bootstrap_interval(paired_total["default"]),
        "paired_total_control": (
            _geometric_mean(paired_total["control"]) if "control" in paired_total else None
        ),
        "identical_to_plain": identical if temperature == 0 else None,
        "default_sizes_chosen": sizes,
        "calibration_entry": calibration,
        "default_speculation": stats.speculation,
    }


def _paired(run: dict[str, list], mode: str, time: str) -> float:
    """A group's median over repeats of plain's `time` over the mode's, both of one repeat.

    The runs of a repeat follow one another within a second or two, so a drift in the
    machine's speed (this host ran ~15% faster for seconds at a time: a fastest-of-N that
    lands in such a burst for one mode only reads as that mode's gain or loss) falls on both.
    """
    pairs = zip(run["plain"], run[mode], strict=True)
    return statistics.median(getattr(p, time) / getattr(m, time) for p, m in pairs)


def _geometric_mean(ratios: list[float]) -> float:
    return float(math.exp(sum(map(math.log, ratios)) / len(ratios)))


def bootstrap_interval(ratios: list[float], draws: int = 2000) -> list[float]:
    """95% interval of the geometric mean of per-group speedups (groups resampled, seed 0).

    One cell's groups are its paired measurements: plain and the mode timed back to back on
    the same prompts. Their spread, not one total, says whether a cell's 0.97x is a loss.
    """
    import numpy as np

    logs = np.log(np.asarray(ratios))
    picks = np.random.default_rng(0).integers(0, len(logs), (draws, len(logs)))
    means = np.exp(logs[picks].mean(axis=1))
    return [round(float(q), 4) for q in np.quantile(means, [0.025, 0.975])]


def pooled(
    results: dict, drafter: str, mode: str = "default", groups: str = "group_speedups"
) -> tuple[float, list[float]]:
    """A drafter's geometric-mean speedup over every group of every cell, with its interval.

    `groups`: the groups' fastest-of-N speedups, or `paired_group_speedups`.
    """
    ratios = [r for key, row in results.items() if f" {drafter} " in key
              for r in row.get(groups, {}).get(mode, [])]  # fmt: skip
    if not ratios:
        return float("nan"), []
    return _geometric_mean(ratios), bootstrap_interval(ratios)


def calibrate(artifact, drafter, temperature, prompts, args) -> None:
    from specx.calibration.calibrate import CalibrationOptions, calibrate_artifact

    options = CalibrationOptions(
        drafter=drafter, max_new_tokens=args.new_tokens, repeats=2,
        threads=args.threads, temperature=temperature,
    )  # fmt: skip
    entry = calibrate_artifact(artifact, prompts, options)
    log(f"  calibrated {drafter} at T={temperature}: {entry.choice.label}, "
        f"max_batch_spec {entry.max_batch_spec}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--min-groups", type=int, default=0,
                        help="at least this many prompt groups a cell (more prompts at large "
                        "batches)")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heads", type=Path, default=pyref_heads.HEADS,
                        help="the trained drafters (benchmarks/heads/pyref-7m)")  # fmt: skip
    parser.add_argument("--calibrate", action="store_true", help="calibrate every drafter first")
    parser.add_argument("--only", default=None, help="comma-separated drafters to measure")
    parser.add_argument("--targets", default=None, help="comma-separated targets (pyref-7m, ...)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--temperatures", default=",".join(map(str, TEMPERATURES)),
                        help="comma-separated temperatures, each calibrated apart")  # fmt: skip
    parser.add_argument("--first-request", action="store_true",
                        help="every timed run as a fresh engine's first request")  # fmt: skip
    parser.add_argument("--no-fixed", action="store_true", help="plain vs the default only")
    parser.add_argument("--control", action="store_true",
                        help="time plain twice: each cell's plain-vs-plain noise band")  # fmt: skip
    parser.add_argument(
        "--merge", action="store_true", help="update the cells measured in an existing --out"
    )
    parser.add_argument("--load", choices=("free", "copy"), default="free",
                        help="free generation (HumanEval, MT-bench) or rewrite requests "
                        "(copy-heavy)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "never_loses.json")
    args = parser.parse_args()
    if not (PYREF_7M / "config.json").is_file():
        log(f"{SHARED} has no pyref-7m; nothing measured")
        return
    from specx.runtime.engine import load

    total = max(args.prompts, args.min_groups * max(map(int, args.batches.split(","))))
    prompts, held_out = (copy_load if args.load == "copy" else free_load)(total)
    work = scratch_dir("specx-never-loses-")
    report: dict = {
        "benchmark": "never_loses",
        "specx_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "calibrated": args.calibrate,
        "first_request": args.first_request,
        "repeats": args.repeats,
        "results": {},
    }
    only = None if args.only is None else args.only.split(",")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    draft = draft_model(work, args.heads)
    targets = None if args.targets is None else args.targets.split(",")
    for target_name, by_kind in artifacts(work, args.heads, only, targets).items():
        for kind, artifact in by_kind.items():
            kinds = [kind]
            if kind == "none":
                kinds = ["ngram", "suffix", *([draft] if draft else [])]
            elif kind == "eagle3":  # the head alone, and with the n-gram where text repeats
                kinds = ["eagle3", "ngram+eagle3"]
            kinds = [d for d in kinds if only is None or _name(d) in only]
            if not kinds:
                continue
            for drafter in kinds:
                if args.calibrate:
                    for temperature in temperatures:
                        calibrate(artifact, drafter, temperature, held_out, args)
            engine = load(artifact, threads=args.threads)
            for drafter in kinds:
                for temperature in temperatures:
                    for batch in map(int, args.batches.split(",")):
                        which = "" if args.load == "free" else f" {args.load}"
                        key = f"{target_name} {_name(drafter)}{which} T={temperature} batch {batch}"
                        log(key)
                        row = measure_cell(engine, drafter, prompts, batch, temperature, args)
                        report["results"][key] = row
                        log(f"  fixed {row['fixed_speedup'] or 0:.2f}x, default "
                            f"{row['default_speedup']:.2f}x, control "
                            f"{row['control_speedup'] or 0:.2f}x, paired total "
                            f"{row['paired_total_speedup']:.2f}x")  # fmt: skip
    if args.merge and args.out.is_file():
        earlier = json.loads(args.out.read_text())
        earlier["results"].update(report["results"])
        earlier.setdefault("merged_runs", []).append(
            {
                "specx_commit": report["specx_commit"],
                "repeats": args.repeats,
                "cells": sorted(report["results"]),
            }
        )
        report = earlier
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| cell | fixed draft | default (controller) | 95% interval | default / fixed "
          "| plain / plain | its interval | paired default | paired plain / plain "
          "| paired default, total |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, row in report["results"].items():
        fixed, default = row["fixed_speedup"], row["default_speedup"]
        control = row.get("control_speedup")
        cells = [
            f"{fixed:.2f}x" if fixed else "-",
            f"{default:.2f}x",
            _interval(row.get("default_interval")),
            f"{default / fixed:.0%}" if fixed else "-",
            f"{control:.2f}x" if control else "-",
            _interval(row.get("control_interval")),
            _paired_cell(row.get("paired_speedup"), row.get("paired_interval")),
            _paired_cell(row.get("paired_control"), row.get("paired_control_interval")),
            _paired_cell(row.get("paired_total_speedup"), row.get("paired_total_interval")),
        ]
        print(f"| {key} | " + " | ".join(cells) + " |")
    drafters = sorted({key.split()[1] for key in report["results"]})
    for drafter in drafters:
        for groups, label in (("group_speedups", ""), ("paired_group_speedups", " paired")):
            for mode in ("default", "control"):
                mean, interval = pooled(report["results"], drafter, mode, groups)
                if interval:
                    print(f"pooled {drafter} {mode}{label}: {mean:.3f}x, "
                          f"95% {_interval(interval)}")  # fmt: skip


def _paired_cell(speedup: float | None, interval: list[float] | None) -> str:
    return f"{speedup:.2f}x ({_interval(interval)})" if speedup else "-"


def _interval(interval: list[float] | None) -> str:
    return f"{interval[0]:.2f}-{interval[1]:.2f}" if interval else "-"


def _name(drafter: str) -> str:
    """A drafter's name in the report: `draft-model`, not its artifact's path."""
    return drafter.partition(":")[0]


if __name__ == "__main__":
    main()
