"""Which drafter for which load: copy-heavy and free generation on pyref-1b's cpu-int4 build.

    python -m benchmarks.drafter_mix [--prompts 6] [--new-tokens 96] [--repeats 2]

Loads: `copy` (held-out stdlib functions, each followed by a request to write it again and its
first third: `inputs.copy_heavy_prompts`), `humaneval` and `mt_bench` (free generation).
Drafters on the same target, in one process, interleaved prompt by prompt, fastest of
`repeats` per prompt (drafters that learn across requests made fresh for every run): plain,
ngram, suffix, eagle3 (chain 4), ngram+eagle3, suffix+eagle3, and skip with the layers
`calibration.layer_skip.choose_skipped` picks on the free prompts in this run (on pyref-1b
a trap: its 15 block-expanded layers are near identity, so skipping them is nearly free).
Per load and drafter: decode and total ms/token, tokens a round (bonus counted), per-position
acceptance, and the speedup over plain; every greedy output is checked against plain's.
Needs the EAGLE-3 artifact `python -m benchmarks.edge --prepare-only --cpu-builds` prepares.
Writes results/drafter_mix.json.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np

from benchmarks.inputs import PYREF_7M, RESULTS, copy_heavy_prompts, load_prompts, log
from benchmarks.runners import SpecxPlain, SpecxSpeculative, interleave

ARTIFACT = Path.home() / ".cache" / "specx" / "edge" / "specx" / "eagle3"
BUILD = "cpu-int4"
DRAFTERS = ("ngram", "suffix", "eagle3", "ngram+eagle3", "suffix+eagle3", "skip")


def loads(count: int) -> dict[str, list[list[int]]]:
    """Each load's prompts, pyref's token ids."""
    from specx.runtime.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(PYREF_7M / "tokenizer.json")
    return {
        "copy": copy_heavy_prompts(tokenizer, count),
        "humaneval": load_prompts("humaneval.jsonl", count),
        "mt_bench": load_prompts("mt_bench.jsonl", count),
    }


def runners(target, skipped: tuple[int, ...], threads: int) -> dict:
    """Plain and every drafter over one target (the plain runner opens its own)."""
    from specx.runtime.drafters import DrafterOptions, make_drafter

    def factory(spec: str):
        return lambda prompt: make_drafter(spec, target, DrafterOptions(4))

    made = {"plain": SpecxPlain(ARTIFACT, BUILD, threads)}
    for spec in DRAFTERS:
        named = f"skip:{','.join(map(str, skipped))}" if spec == "skip" else spec
        made[spec] = SpecxSpeculative(target, factory(named))
    return made


def row(summary, runner, new_tokens: int, plain: dict) -> dict:
    """A drafter's times, acceptance and speedups over plain on one load."""
    report = summary.report(new_tokens)
    if isinstance(runner, SpecxSpeculative):
        stats = list(runner.stats.values())
        rounds = sum(s.acceptance.rounds for s in stats)
        report["tokens_per_round"] = sum(
            s.acceptance.acceptance_length * s.acceptance.rounds for s in stats
        ) / max(rounds, 1)
        depth = max(len(s.acceptance.acceptance_by_position) for s in stats)
        positions = np.full((len(stats), depth), np.nan)  # drafts of different depths
        for i, s in enumerate(stats):
            positions[i, : len(s.acceptance.acceptance_by_position)] = (
                s.acceptance.acceptance_by_position
            )
        report["acceptance_by_position"] = np.nanmean(positions, axis=0).tolist()
        runner.stats.clear()
    for measure in ("decode", "total"):
        key = f"{measure}_ms_per_token"
        report[f"{measure}_speedup"] = plain[key] / report[key]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "drafter_mix.json")
    args = parser.parse_args()
    if not (ARTIFACT / "manifest.json").is_file() or not PYREF_7M.is_dir():
        raise SystemExit(
            f"{ARTIFACT} (or shared/models/pyref-7m) is missing: run "
            "python -m benchmarks.edge --prepare-only --cpu-builds first"
        )
    from specx.artifact import load_manifest
    from specx.calibration.layer_skip import choose_skipped
    from specx.runtime.targets import open_decoder

    target = open_decoder(load_manifest(ARTIFACT).with_build(BUILD), threads=args.threads)
    prompts = loads(args.prompts)
    log("choosing the layers skip leaves out, on the free prompts")
    free = prompts["humaneval"][:3] + prompts["mt_bench"][:3]
    skip = choose_skipped(target, free, 48, 6, log)
    made = runners(target, skip.best.skipped, args.threads)
    report: dict = {
        "benchmark": "drafter_mix",
        "target": f"pyref-1b {BUILD}",
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "skip": skip.to_json(),
        "loads": {},
    }
    for load, load_prompts_ in prompts.items():
        log(f"{load}: {len(made)} runners x {len(load_prompts_)} prompts x {args.repeats}")
        summaries = interleave(made, load_prompts_, args.new_tokens, args.repeats)
        plain = summaries["plain"].report(args.new_tokens)
        rows = {n: row(summaries[n], made[n], args.new_tokens, plain) for n in made}
        for name in DRAFTERS:
            rows[name]["identical_to_plain"] = summaries[name].tokens == summaries["plain"].tokens
        report["loads"][load] = rows
        log(
            f"{load}: "
            + ", ".join(f"{n} {r['decode_speedup']:.2f}x" for n, r in rows.items() if n != "plain")
        )
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
