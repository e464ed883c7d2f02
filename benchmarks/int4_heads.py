"""Heads distilled against the int4 target vs against the float one, drafting for pyref-1b at int4.

int4 moves pyref's predictions: pyref-7m's argmax equals what pyref-1b's int4 build decodes
greedily at 95.4% of positions, its int4 twin's at 99.4% (`benchmarks/pyref_wide.py --twin`),
so a head that learned pyref-7m is wrong where int4 differs. For every kind with a head
distilled against the twin (`benchmarks/heads/pyref-1b-int4/<kind>`, from `pyref_heads.py
--int4-twin`) and its pyref-7m-distilled counterpart (`benchmarks/heads/pyref-7m/<kind>`),
both widened to pyref-1b, each exported with pyref-1b and built at int4 as edge.py builds:
18 held-out prompts x 96 tokens, chains of 2..4 greedy and 3 at T=0.7, plain decoding and
every configuration interleaved prompt by prompt, fastest of `--repeats`. Reports acceptance
length (bonus counted) and by position, greedy identity with plain, and decode speed over
specx plain (meaningful only on a quiet machine). Writes benchmarks/results/int4_heads.json.

    python benchmarks/int4_heads.py [--wide ~/.cache/specx/pyref-wide] [--kinds eagle]
        [--repeats 1] [--prompts 12] [--new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pyref_heads  # noqa: E402
import pyref_wide  # noqa: E402
from edge import _fresh, acceptance, int4_artifact  # noqa: E402
from runners import SpecxPlain, SpecxSpeculative, interleave  # noqa: E402
from suite import prompts_for  # noqa: E402

CHAINS = (2, 3, 4)
# head set -> (committed heads, folder under WIDE its widened copies go to)
TEACHERS = {
    "fp32-distilled": (pyref_heads.HEADS, "heads"),
    "int4-distilled": (pyref_heads.HEADS.parent / "pyref-1b-int4", "heads-int4"),
}


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, file=sys.stderr, flush=True)


def prepare(wide: Path, work: Path, kinds: list[str]) -> dict[tuple[str, str], Path]:
    """(head set, kind) -> pyref-1b exported with that widened head and built at int4."""
    shape = pyref_wide.Shape()
    target = pyref_wide.write_target(wide, shape)
    artifacts = {}
    for name, (committed, folder) in TEACHERS.items():
        heads = pyref_wide.write_heads(wide, shape, committed, folder)
        for kind in kinds:
            drafter = f"{kind}:{heads[kind]}"
            artifacts[name, kind] = int4_artifact(target, work / name / kind, drafter, heads[kind])
    return artifacts


def runners_for(artifacts, plain_artifact: Path, threads: int, sampling, chains) -> dict:
    from specx.artifact import load_manifest
    from specx.runtime.backends import open_decoder

    runners = {"specx plain": SpecxPlain(plain_artifact, "ort-int4", threads, sampling)}
    for (name, kind), artifact in artifacts.items():
        target = open_decoder(load_manifest(artifact).with_build("ort-int4"), threads)
        for n in chains:
            runners[f"{kind} {name} chain {n}"] = SpecxSpeculative(
                target, _fresh(kind, target, f"chain:{n}"), sampling
            )
    return runners


def section(runners: dict, prompts, new_tokens: int, repeats: int, greedy: bool) -> dict:
    summaries = interleave(runners, prompts, new_tokens, repeats)
    plain = summaries["specx plain"].report(new_tokens)["decode_ms_per_token"]
    plain_tokens = summaries["specx plain"].tokens
    rows = {}
    for name, runner in runners.items():
        row = summaries[name].report(new_tokens)
        if isinstance(runner, SpecxSpeculative):
            row |= acceptance(runner)
            row["speedup_vs_specx_plain"] = plain / row["decode_ms_per_token"]
            if greedy:
                row["identical_to_plain"] = summaries[name].tokens == plain_tokens
        rows[name] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wide", type=Path, default=pyref_heads.CACHE / "pyref-wide")
    parser.add_argument("--work", type=Path, default=pyref_heads.CACHE / "int4-heads")
    parser.add_argument("--kinds", default="eagle")
    parser.add_argument(
        "--prompts", type=int, default=12, help="HumanEval stubs (and half as many stdlib files)"
    )
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/int4_heads.json"))
    args = parser.parse_args()
    if not (pyref_wide.SOURCE / "model.safetensors").is_file():
        log("skipped: shared/models/pyref-7m is absent")
        return
    kinds = args.kinds.split(",")
    missing = [
        f"{committed / kind}"
        for committed, _ in TEACHERS.values()
        for kind in kinds
        if not (committed / kind / "config.json").is_file()
    ]
    if missing:
        raise SystemExit(f"no committed head at {', '.join(missing)} (pyref_heads.py trains it)")
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.tokenizer import TextTokenizer

    artifacts = prepare(args.wide, args.work, kinds)
    plain_artifact = pyref_wide.int4_build(args.wide, args.wide / "pyref-1b")
    prompts = prompts_for(TextTokenizer(pyref_wide.SOURCE / "tokenizer.json"), args.prompts)
    report = {
        "benchmark": "int4_heads",
        "target": "pyref-1b at int4 (specx build --precision int4)",
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "sections": {},
    }
    settings = {"greedy": (None, CHAINS), "T=0.7": (SamplingParams(0.7, seed=0), (3,))}
    for name, (sampling, chains) in settings.items():
        log(f"{name}: plain and {len(artifacts) * len(chains)} configurations")
        runners = runners_for(artifacts, plain_artifact, args.threads, sampling, chains)
        rows = section(runners, prompts, args.new_tokens, args.repeats, sampling is None)
        report["sections"][name] = rows
        for runner, row in rows.items():
            if "acceptance_length" in row:
                depth = ", ".join(f"{a:.2f}" for a in row["acceptance_by_position"])
                log(
                    f"{name} {runner}: tau {row['acceptance_length']:.2f} ({depth}), "
                    f"{row['speedup_vs_specx_plain']:.2f}x plain"
                )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
