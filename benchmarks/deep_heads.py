"""Trained heads on pyref-deep: measured speedup next to its ideal bound, and drafting overhead.

pyref-deep (benchmarks/models/pyref_deep.py) is exported with each trained head under
`--heads DIR/<kind>` (the committed benchmarks/heads/pyref-7m, trained against pyref-7m by
benchmarks/models/pyref_heads.py; `--retrain` trains and ships them again). For every configuration,
on 18 held-out prompts (12 HumanEval stubs + 6 held-out stdlib files, as the suite), 96 new
tokens, each prompt plain and speculative back to back, fastest of `--repeats`
(`specx.calibration.timing`), greedy and at T=0.7:

    speedup = plain decode time / speculative decode time
    bound   = tau * t(1) / (t(N + 1) + draft)

with tau the run's acceptance length, t(n) the target's forward over n tokens at the prompts'
context (median of 7), N the configuration's node budget and `draft` the measured drafting
time per round. For one-call chains the drafting overhead is also reported: the draft_chain
graph's own ONNX Runtime time per round against the drafter's wall time per round.

    python -m benchmarks.deep_heads [--heads benchmarks/heads/pyref-7m] [--kinds eagle,eagle3]
        [--build ort-fp32|ort-int4|ort-int8-draft|ort-int4-draft|exported]

The target runs as `specx build --backend ort` leaves it (the ORT lowering) unless
`--build exported`.

Writes benchmarks/results/deep_heads.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from benchmarks.inputs import PYREF_7M, RESULTS, log, prompts_for
from benchmarks.models import pyref_deep, pyref_heads
from benchmarks.runners import BUILDS, build_options, scratch_dir

CONFIGS = ["chain:2", "chain:3", "chain:4", "chain:5", "dynamic:9,3,2", "dynamic:13,4,3"]


def draft_overhead(drafter, target, prompts, new_tokens) -> dict:
    """Drafter wall time per round vs the draft_chain graph's own run time per round."""
    from specx.runtime.speculative_decoding import generate_speculative

    chain = drafter.chain
    spent = [0.0]
    run = chain.session.run_with_iobinding

    def timed(binding):
        started = time.perf_counter()
        run(binding)
        spent[0] += time.perf_counter() - started

    chain.session.run_with_iobinding = timed
    try:
        rounds = draft = 0.0
        for prompt in prompts:
            spec = generate_speculative(target, drafter, [prompt], new_tokens).stats.speculative
            assert spec is not None  # no max_batch_spec: it speculated
            rounds += spec.acceptance.rounds
            draft += spec.draft_s
    finally:
        chain.session.run_with_iobinding = run
    return {
        "draft_ms_per_round": 1e3 * draft / rounds,
        "graph_ms_per_round": 1e3 * spent[0] / rounds,
        "overhead": 1 - spent[0] / draft,
    }


def measure(target, drafter, prompts, args, sampling, curve, nodes) -> dict:
    from specx.calibration.timing import measure_speedup
    from specx.runtime.speculative_decoding import generate_speculative

    timing = measure_speedup(target, drafter, prompts, args.new_tokens, args.repeats, 1, sampling)
    rounds = draft = 0.0
    for prompt in prompts[:6]:
        stats = generate_speculative(target, drafter, [prompt], args.new_tokens, sampling).stats
        assert stats.speculative is not None  # no max_batch_spec: it speculated
        rounds += stats.speculative.acceptance.rounds
        draft += stats.speculative.draft_s
    tau, draft_s = timing.acceptance_length, draft / rounds
    bound = tau * curve(1) / (curve(nodes + 1) + draft_s)
    return {
        "speedup": timing.speedup,
        "bound": bound,
        "of_bound": timing.speedup / bound,
        "acceptance_length": tau,
        "draft_ms_per_round": 1e3 * draft_s,
        "plain_ms_per_token": timing.plain_ms_per_token,
        "speculative_ms_per_token": timing.speculative_ms_per_token,
        "identical_to_plain": timing.identical if sampling.greedy else None,
    }


def model_free(target, prompts, args, samplings, curve, report) -> None:
    """`--model-free` drafters at their default settings on the same target."""
    from specx.runtime.drafters import DrafterOptions, make_drafter

    for kind in [k for k in args.model_free.split(",") if k]:
        for label, sampling in samplings.items():
            drafter = make_drafter(kind, target, DrafterOptions())
            log(f"{kind} {label}")
            nodes = getattr(drafter, "max_nodes", 16)
            row = measure(target, drafter, prompts, args, sampling, curve, nodes)
            report["results"][f"{kind} {label}"] = row
            tau = row["acceptance_length"]
            log(f"  {row['speedup']:.2f}x (bound {row['bound']:.2f}x), tau {tau:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=Path, default=pyref_heads.HEADS)
    parser.add_argument("--kinds", default="eagle,eagle3", help="committed heads to measure")
    parser.add_argument("--retrain", action="store_true", help="train and ship the heads again")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--build", default="ort-fp32", choices=["exported", *BUILDS])
    parser.add_argument(
        "--model-free", default="", help="also these drafters (e.g. ngram,suffix) on the target"
    )
    parser.add_argument("--configs", default=";".join(CONFIGS), help="tree specs, ';'-separated")
    parser.add_argument("--out", type=Path, default=RESULTS / "deep_heads.json")
    args = parser.parse_args()
    source = PYREF_7M
    if not (source / "model.safetensors").is_file():
        log(f"skipped: {source} is absent")
        return
    from specx.artifact import load_manifest
    from specx.builders import build_artifact
    from specx.calibration.costs import measure_verify_curve
    from specx.export.target_export import export_target
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.targets.ort import OrtTarget
    from specx.runtime.tokenizer import TextTokenizer
    from specx.runtime.tree_shapes import parse_tree_spec

    samplings = {"greedy": SamplingParams(), "T=0.7": SamplingParams(0.7, seed=0)}
    work = scratch_dir("specx-deep-heads-")
    deep = pyref_deep.write(source, work / "pyref-deep")
    prompts = prompts_for(TextTokenizer(source / "tokenizer.json"), 12)
    kinds = pyref_heads.ensure_heads(args.kinds.split(","), args.heads, args.retrain)
    report = {
        "benchmark": "deep_heads",
        "target": "pyref-deep (pyref-7m block-expanded to 32 layers)",
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "build": args.build,
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "heads": {k: json.loads((args.heads / k / "train_report.json").read_text()) for k in kinds},
        "results": {},
    }
    curve = None
    for kind in kinds:
        log(f"exporting pyref-deep with the {kind} head")
        artifact = export_target(
            deep,
            work / kind,
            max_context=1024,
            drafter=f"{kind}:{pyref_heads.for_deep(kind, args.heads, work)}",
        )
        if args.build != "exported":  # the ORT lowering, what `specx build` gives users
            build_artifact(artifact, build_options(args.build))
        target = OrtTarget(load_manifest(artifact), args.threads)
        if curve is None:
            context = sum(len(p) for p in prompts) // len(prompts)
            curve = measure_verify_curve(
                target, (1, 2, 3, 4, 5, 6, 8, 9, 12, 13, 16), context, repeats=15
            )
            report["verify_curve"] = curve.summary()
        configs = args.configs.split(";") if kind != "medusa" else ["chain:3", "chain:4"]
        if args.build == "ort-int4":  # greedy identity holds for chains there (row invariance)
            configs = [c for c in configs if c.startswith("chain:")]
        for spec in configs:
            shape = parse_tree_spec(spec)
            for label, sampling in samplings.items():
                drafter = make_drafter(kind, target, DrafterOptions(tree=shape))
                log(f"{kind} {spec} {label}")
                row = measure(target, drafter, prompts, args, sampling, curve, shape.max_nodes)
                if getattr(drafter, "chain", None) is not None and sampling.greedy:
                    row["drafting"] = draft_overhead(drafter, target, prompts[:6], args.new_tokens)
                report["results"][f"{kind} {spec} {label}"] = row
                tau = row["acceptance_length"]
                log(f"  {row['speedup']:.2f}x (bound {row['bound']:.2f}x), tau {tau:.2f}")
        if kind == kinds[0]:
            model_free(target, prompts, args, samplings, curve, report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| configuration | speedup | ideal bound | of bound | tau | draft ms/round |")
    print("|---|---|---|---|---|---|")
    for name, row in report["results"].items():
        print(
            f"| {name} | {row['speedup']:.2f}x | {row['bound']:.2f}x | {row['of_bound']:.0%} "
            f"| {row['acceptance_length']:.2f} | {row['draft_ms_per_round']:.2f} |"
        )


if __name__ == "__main__":
    main()
