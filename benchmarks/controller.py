"""Speculation that never loses: the per-round controller vs fixed drafts vs plain decoding.

For each target (pyref-7m; pyref-deep when `benchmarks/pyref_deep.py` wrote it), drafter
(ngram, suffix, and every trained head found under --heads: trained against pyref-7m, whose
last hidden state pyref-deep shares), temperature (0, 0.7, 1.0) and batch (1, 4): plain
decoding, the drafter at its default configuration with every draft kept (`--fixed-draft`),
and the default `specx generate` (the adaptive controller), on the ORT-lowered build; groups
of prompts run interleaved, fastest of --repeats per group; decode time only.

    python benchmarks/controller.py [--prompts 8] [--new-tokens 64] [--repeats 2]

Writes benchmarks/results/controller.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import load_prompts  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
TEMPERATURES = (0.0, 0.7, 1.0)
BATCHES = (1, 4)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def artifacts(work: Path, heads: Path) -> dict[str, dict[str, Path]]:
    """target -> drafter kind ("none" for model-free) -> artifact with an ort-fp32 build."""
    from specx.build import BuildOptions, build_artifact
    from specx.export.target_export import export_target

    targets = {"pyref-7m": SHARED / "models" / "pyref-7m"}
    deep = Path.home() / ".cache" / "specx" / "pyref-deep"
    if (deep / "config.json").is_file():
        targets["pyref-deep"] = deep
    kinds = [k for k in ("eagle", "eagle3") if (heads / k / "config.json").is_file()]
    built: dict[str, dict[str, Path]] = {}
    for name, checkpoint in targets.items():
        built[name] = {}
        for kind in ["none", *kinds]:
            log(f"exporting {name} ({kind})")
            drafter = None if kind == "none" else f"{kind}:{heads / kind}"
            out = export_target(checkpoint, work / name / kind, max_context=1024, drafter=drafter)
            build_artifact(out, BuildOptions("ort", "fp32"))
            built[name][kind] = out
    return built


def measure_cell(target, make_drafter, prompts, batch, sampling, args) -> dict:
    from specx.runtime.controller import AdaptiveController
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.speculative_decoding import generate_speculative

    modes = {
        "plain": lambda group, s: generate_plain(target, group, args.new_tokens, s),
        "fixed": lambda group, s: generate_speculative(
            target, make_drafter(), group, args.new_tokens, s
        ),
        "default": lambda group, s: generate_speculative(
            target, make_drafter(), group, args.new_tokens, s, controller=AdaptiveController()
        ),
    }
    decode = dict.fromkeys(modes, 0.0)
    identical, sizes = True, {}
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        best: dict[str, object] = {}
        for r in range(args.repeats):
            names = list(modes)[r % 3 :] + list(modes)[: r % 3]
            for name in names:
                result = modes[name](group, sampling)
                if name not in best or result.stats["decode_s"] < best[name].stats["decode_s"]:
                    best[name] = result
        for name, result in best.items():
            decode[name] += result.stats["decode_s"]
        if sampling.greedy:
            identical &= all(best[m].tokens == best["plain"].tokens for m in ("fixed", "default"))
        for size, count in best["default"].stats["sizes_chosen"].items():
            sizes[size] = sizes.get(size, 0) + count
    return {
        "fixed_speedup": decode["plain"] / decode["fixed"],
        "default_speedup": decode["plain"] / decode["default"],
        "identical_to_plain": identical if sampling.greedy else None,
        "default_sizes_chosen": sizes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heads", type=Path, default=Path.home() / ".cache/specx/pyref-heads")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/controller.json"))
    args = parser.parse_args()
    if not (SHARED / "models" / "pyref-7m" / "config.json").is_file():
        log(f"{SHARED} has no pyref-7m; nothing measured")
        return
    from specx.artifact import load_manifest
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.ort_target import OrtTarget
    from specx.runtime.sampling import SamplingParams

    prompts = load_prompts("humaneval.jsonl", args.prompts // 2) + load_prompts(
        "mt_bench.jsonl", args.prompts - args.prompts // 2
    )
    work = Path(tempfile.mkdtemp(prefix="specx-controller-"))
    report: dict = {
        "benchmark": "controller",
        "specx_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "results": {},
    }
    for target_name, by_kind in artifacts(work, args.heads).items():
        for kind, artifact in by_kind.items():
            target = OrtTarget(load_manifest(artifact), threads=args.threads)
            for drafter in ["ngram", "suffix"] if kind == "none" else [kind]:
                make = lambda d=drafter, t=target: make_drafter(d, t, DrafterOptions())  # noqa: E731
                for temperature in TEMPERATURES:
                    for batch in BATCHES:
                        sampling = SamplingParams(temperature, seed=0)
                        key = f"{target_name} {drafter} T={temperature} batch {batch}"
                        log(key)
                        row = measure_cell(target, make, prompts, batch, sampling, args)
                        report["results"][key] = row
                        log(f"  fixed {row['fixed_speedup']:.2f}x, default "
                            f"{row['default_speedup']:.2f}x")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| cell | fixed draft | default (controller) | default / fixed |")
    print("|---|---|---|---|")
    for key, row in report["results"].items():
        fixed, default = row["fixed_speedup"], row["default_speedup"]
        print(f"| {key} | {fixed:.2f}x | {default:.2f}x | {default / fixed:.0%} |")


if __name__ == "__main__":
    main()
