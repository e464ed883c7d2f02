"""A trained head at fp32, int8 and int4 on the float pyref-deep target, in one interleaving.

`specx build --precision int8|int4 --quantize draft` stores only the draft head's MatMul
weights in 8 or 4 bits (MatMulNBits); the target stays the fp32 ORT-lowered graph, so its
verify cost curve and greedy identity are those of fp32 and only the draft gets cheaper.
pyref-deep (benchmarks/pyref_deep.py) is exported once with the head under `--heads
DIR/<kind>` (benchmarks/pyref_heads.py trains it when missing) and built three ways into
the same artifact; then, prompt by prompt, plain decoding and every (configuration, head
precision) pair run back to back, `--repeats` times in rotating order, fastest decode per
prompt (`runners.interleave`). 18 held-out prompts (12 HumanEval stubs + 6 held-out stdlib
files, as the suite), greedy.

    python benchmarks/draft_precision.py [--kind eagle] [--configs "chain:3;chain:4"]

Reports per pair: decode ms/token, speedup over plain, acceptance length and draft ms per
round (from each prompt's last run), and whether every output equals plain decoding's.
Writes benchmarks/results/draft_precision.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pyref_deep  # noqa: E402
import pyref_heads  # noqa: E402
from deep_heads import build_options  # noqa: E402
from runners import SpecxPlain, SpecxSpeculative, interleave, scratch_dir  # noqa: E402
from suite import SHARED, prompts_for  # noqa: E402

BUILDS = {"fp32": "ort-fp32", "int8": "ort-int8-draft", "int4": "ort-int4-draft"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=Path, default=pyref_heads.HEADS)
    parser.add_argument("--kind", default="eagle")
    parser.add_argument("--configs", default="chain:3;chain:4")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_precision.json"))
    args = parser.parse_args()
    source, head = SHARED / "models" / "pyref-7m", args.heads / args.kind
    if not (source / "model.safetensors").is_file():
        log(f"skipped: {source} is absent")
        return
    pyref_heads.ensure_heads([args.kind], args.heads)
    from specx.artifact import load_manifest
    from specx.build import build_artifact
    from specx.export.target_export import export_target
    from specx.runtime.backends import open_decoder
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.drafters.tree_search import parse_tree_spec
    from specx.runtime.tokenizer import TextTokenizer

    work = scratch_dir("specx-draft-precision-")
    deep = pyref_deep.write(source, work / "pyref-deep")
    drafter_spec = f"{args.kind}:{pyref_heads.for_deep(args.kind, args.heads, work)}"
    artifact = export_target(deep, work / "artifact", max_context=1024, drafter=drafter_spec)
    for build in BUILDS.values():
        log(f"building {build}")
        build_artifact(artifact, build_options(build))
    manifest = load_manifest(artifact)
    runners: dict = {"plain": SpecxPlain(artifact, BUILDS["fp32"], args.threads)}
    for spec in args.configs.split(";"):
        for precision, build in BUILDS.items():
            target = open_decoder(manifest.with_build(build), threads=args.threads)
            drafter = make_drafter(args.kind, target, DrafterOptions(tree=parse_tree_spec(spec)))
            runners[f"{spec} {precision}"] = SpecxSpeculative(target, lambda _, d=drafter: d)
    prompts = prompts_for(TextTokenizer(source / "tokenizer.json"), 12)
    summaries = interleave(runners, prompts, args.new_tokens, args.repeats)
    plain = summaries["plain"].report(args.new_tokens)["decode_ms_per_token"]
    rows = {}
    for name, summary in summaries.items():
        row = summary.report(args.new_tokens)
        row["speedup"] = plain / row["decode_ms_per_token"]
        row["identical_to_plain"] = summary.tokens == summaries["plain"].tokens
        if name != "plain":
            stats = list(runners[name].stats.values())
            rounds = sum(s.acceptance.rounds for s in stats)
            emitted = sum(s.acceptance.acceptance_length * s.acceptance.rounds for s in stats)
            row["acceptance_length"] = emitted / rounds
            row["draft_ms_per_round"] = 1e3 * sum(s.draft_s for s in stats) / rounds
        rows[name] = row
    report = {
        "benchmark": "draft_precision",
        "target": "pyref-deep (fp32, ORT-lowered)",
        "head": json.loads((head / "train_report.json").read_text()),
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "quantization": {b: manifest.builds[b].quantization or None for b in BUILDS.values()},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| drafter | decode ms/token | speedup | tau | draft ms/round | identical |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        tau, draft = row.get("acceptance_length"), row.get("draft_ms_per_round")
        print(
            f"| {name} | {row['decode_ms_per_token']:.2f} | {row['speedup']:.2f}x "
            f"| {'' if tau is None else f'{tau:.2f}'} | {'' if draft is None else f'{draft:.2f}'} "
            f"| {row['identical_to_plain']} |"
        )


if __name__ == "__main__":
    main()
