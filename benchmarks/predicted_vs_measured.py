"""`specx calibrate` on the reference target: predicted vs measured speedup, vs hand-picked.

    python -m benchmarks.predicted_vs_measured [--drafters eagle,eagle3,medusa,mtp,ngram,
        draft-model]

For each drafter of pyref-7m (the committed heads, benchmarks/heads/pyref-7m, trained when
missing):
`specx calibrate` on 16 prompts (12 HumanEval, 4 stdlib training files), then, on held-out
prompts of the same mix (the last 16 HumanEval prompts and 8 held-out stdlib files, none
used for calibration), greedy at batch 1: the calibrated choice and the hand-picked
defaults of the suite, each timed against plain decoding the way calibration times its
candidates (`specx.calibration.timing`: each prompt plain and speculative back to back,
fastest of `--repeats`). Reports the predicted and measured speedup of the calibrated
choice (and their relative error), whether it is at least as fast as every default, and
the batch curve measured against the calibration's prediction. Then the INT8 target
(`specx quantize`, then `specx calibrate` on it): accuracy against fp32, the change in
acceptance and speed, greedy identity of its calibrated chain, and how many prompts two
trees decode differently from its plain decoding (INT8 keeps chains, not trees, identical).
JSON to benchmarks/results/predicted_vs_measured.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

from benchmarks.inputs import PYREF_7M, RESULTS, SHARED, log, stdlib_split
from benchmarks.models.pyref_heads import trained_drafters
from benchmarks.runners import scratch_dir

HUMANEVAL = SHARED / "data" / "eval" / "humaneval.jsonl"
SMALL_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


def split_prompts(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Two disjoint prompt sets of the same mix (HumanEval stubs and stdlib source).

    Calibration: the first 12 HumanEval prompts + 4 stdlib files the target trained on;
    held out: the last 16 HumanEval prompts + 8 held-out stdlib files.
    """
    lines = HUMANEVAL.read_text().splitlines()

    def encode(line: str) -> list[int]:
        text = json.loads(line)["turns"][0].replace("Complete the code I provided.\n", "")
        return tokenizer.encode(text)[-320:]

    train, held = stdlib_split()

    def source(path: Path) -> list[int]:
        return tokenizer.encode(path.read_text(errors="replace")[:1200])[-320:]

    calibration = [encode(x) for x in lines[:12]] + [source(p) for p in train[::200][:4]]
    return calibration, [encode(x) for x in lines[-16:]] + [source(p) for p in held[:8]]


def held_out(target, spec, options, prompts, new_tokens, repeats, batch: int = 1) -> dict:
    """Plain vs speculative on the same prompts, paired, fastest of `repeats` per prompt."""
    from specx.calibration.timing import measure_speedup
    from specx.runtime.drafters import make_drafter

    drafter = make_drafter(spec, target, options)
    timing = measure_speedup(target, drafter, prompts, new_tokens, repeats, batch)
    return {
        "plain_ms_per_token": timing.plain_ms_per_token,
        "ms_per_token": timing.speculative_ms_per_token,
        "acceptance_length": timing.acceptance_length,
        "speedup": timing.speedup,
        "identical_to_plain": timing.identical,
    }


def mismatching_prompts(target, spec, options, prompts, new_tokens) -> int:
    """How many prompts' greedy speculative output differs from plain decoding."""
    from specx.runtime.drafters import make_drafter
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.speculative_decoding import generate_speculative

    drafter = make_drafter(spec, target, options)
    return sum(
        generate_speculative(target, drafter, [p], new_tokens).tokens
        != generate_plain(target, [p], new_tokens).tokens
        for p in prompts
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", default="eagle,eagle3,medusa,mtp,ngram,draft-model")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="paired runs per prompt")
    parser.add_argument("--out", type=Path, default=RESULTS / "predicted_vs_measured.json")
    args = parser.parse_args()
    model_dir = PYREF_7M
    if not (model_dir / "model.safetensors").is_file():
        print(f"skipped: {model_dir} is absent", file=sys.stderr)
        return

    from specx.artifact import load_manifest
    from specx.builders.int8_static import quantize_artifact
    from specx.calibration.calibrate import CalibrationOptions, calibrate_artifact
    from specx.export.target_export import export_target
    from specx.runtime.calibrated import calibrated_choice
    from specx.runtime.drafters import DrafterOptions
    from specx.runtime.drafters.medusa import MEDUSA_DEFAULT_TREE
    from specx.runtime.targets.ort import OrtTarget, configure_threads
    from specx.runtime.tokenizer import TextTokenizer
    from specx.runtime.tree_shapes import DynamicTree, StaticTree

    configure_threads(args.threads)
    started = time.perf_counter()
    drafters_dir = trained_drafters()
    work = scratch_dir("specx-calibration-")
    tokenizer = TextTokenizer(model_dir / "tokenizer.json")
    calibration_prompts, held = split_prompts(tokenizer)
    report = {
        "benchmark": "predicted_vs_measured",
        "target": "pyref-7m",
        "command": "python -m benchmarks.predicted_vs_measured",
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "calibration_prompts": len(calibration_prompts),
        "held_out_prompts": len(held),
        "new_tokens": args.new_tokens,
        "drafters": {},
    }
    for spec in args.drafters.split(","):
        name = spec
        if spec in ("eagle", "eagle3", "medusa", "mtp"):
            artifact = export_target(
                model_dir, work / spec, max_context=1024, drafter=f"{spec}:{drafters_dir[spec]}"
            )
        else:
            artifact = export_target(model_dir, work / spec, max_context=1024)
            if spec == "draft-model":
                draft_artifact = export_target(
                    drafters_dir["draft-model"], work / "draft", max_context=1024
                )
                spec = f"draft-model:{draft_artifact}"
        log(f"[{name}] calibrating on {len(calibration_prompts)} prompts")
        # Calibrated at the generation length it is evaluated at (n-gram's best chain grows
        # with it: repetition accumulates over the output).
        calibration = CalibrationOptions(
            drafter=spec, threads=args.threads, max_new_tokens=args.new_tokens
        )
        # the entry recorded in the manifest: the report reads its measurements
        entry = calibrate_artifact(artifact, calibration_prompts, calibration)
        manifest = load_manifest(artifact)
        target = OrtTarget(manifest, args.threads)
        choice = calibrated_choice(manifest, spec)
        configs = {"calibrated": DrafterOptions(tree=choice.shape, threads=args.threads)}
        if name == "ngram":
            configs = {
                "calibrated": DrafterOptions(choice.shape.max_nodes, threads=args.threads),
                "chain 4 (default)": DrafterOptions(4),
                "chain 6": DrafterOptions(6),
            }
        elif name == "medusa":
            configs["static mc_sim_7b_63 (default)"] = DrafterOptions(
                tree=StaticTree.from_choices(MEDUSA_DEFAULT_TREE)
            )
            configs["static 7"] = DrafterOptions(tree=StaticTree.from_choices(SMALL_TREE))
        else:
            configs["chain 4 (default)"] = DrafterOptions(4)
            configs["static 7"] = DrafterOptions(tree=StaticTree.from_choices(SMALL_TREE))
            if name != "draft-model":
                configs["dynamic 12,5,3"] = DrafterOptions(tree=DynamicTree.of_nodes(12, 5, 3))
        log(f"[{name}] held-out: {len(configs)} configurations, each paired with plain")
        results = {
            label: held_out(target, spec, options, held, args.new_tokens, args.repeats)
            for label, options in configs.items()
        }
        # What `specx generate` does with the calibration: the chosen tree, or plain decoding
        # when calibration found that speculation does not pay (max_batch_spec 0).
        speculating = entry.max_batch_spec >= 1
        tree_predicted = entry.choice.measured.measured_speedup
        tree_measured = results["calibrated"]["speedup"]
        predicted = entry.expected_speedup
        measured = tree_measured if speculating else 1.0
        defaults = {k: v["speedup"] for k, v in results.items() if k != "calibrated"}
        report["drafters"][name] = {
            "choice": {k: v for k, v in entry.choice.to_json().items() if k != "choices"},
            "acceptance_by_depth_and_rank": entry.report["acceptance"][
                "acceptance_by_depth_and_rank"
            ],
            "draft_cost_c": entry.report["costs"]["draft_cost_c"],
            "plain_ms_per_token": results["calibrated"]["plain_ms_per_token"],
            "results": results,
            "speculation_on": speculating,
            "predicted_speedup": predicted,
            "measured_speedup": measured,
            "relative_error": abs(predicted - measured) / measured,
            "tree_predicted_speedup": tree_predicted,
            "tree_measured_speedup": tree_measured,
            "tree_relative_error": abs(tree_predicted - tree_measured) / tree_measured,
            "calibrated_at_least_as_fast_as_defaults": all(
                measured >= s for s in defaults.values()
            ),
            "calibrated_tree_at_least_as_fast_as_defaults": all(
                tree_measured >= s for s in defaults.values()
            ),
            "max_batch_spec": entry.max_batch_spec,
            "batch_curve_calibration": entry.report["batch_curve"],
        }
        log(
            f"[{name}] {entry.choice.label}: tree predicted {tree_predicted:.2f}x, "
            f"measured {tree_measured:.2f}x; speculation {'on' if speculating else 'off'}; "
            f"defaults {defaults}"
        )
        if name == "eagle":
            report["batch_curve_measured"] = {
                batch: held_out(
                    target, spec, configs["calibrated"], held[: 8 * batch], 32, args.repeats, batch
                )["speedup"]
                for batch in (1, 2, 4, 8)
            }
            log("[int8] quantizing the eagle artifact on the calibration prompts")
            int8_dir = shutil.copytree(artifact, work / "eagle-int8")
            quantized = quantize_artifact(int8_dir, calibration_prompts, eval_prompts=held)
            int8_entry = calibrate_artifact(int8_dir, calibration_prompts, calibration)
            int8_manifest = load_manifest(int8_dir)
            int8_target = OrtTarget(int8_manifest, args.threads)
            int8_choice = calibrated_choice(int8_manifest, spec).shape
            int8 = held_out(
                int8_target,
                spec,
                DrafterOptions(tree=int8_choice, threads=args.threads),
                held,
                args.new_tokens,
                args.repeats,
            )
            trees = {"static 7": configs["static 7"], "dynamic 12,5,3": configs["dynamic 12,5,3"]}
            report["int8"] = {
                "accuracy": quantized.accuracy.to_json(),
                "plain_ms_per_token": {
                    "fp32": results["calibrated"]["plain_ms_per_token"],
                    "int8": int8["plain_ms_per_token"],
                },
                "calibrated_choice": int8_entry.choice.label,
                "calibrated_speedup": {"predicted": int8_entry.choice.measured.measured_speedup}
                | {"measured": int8["speedup"]},
                "acceptance_length": {
                    "fp32": results["calibrated"]["acceptance_length"],
                    "int8": int8["acceptance_length"],
                },
                "int8_speculative_equals_int8_plain": int8["identical_to_plain"],
                "tree_prompts_differing_from_plain": {
                    label: mismatching_prompts(int8_target, spec, options, held, args.new_tokens)
                    for label, options in trees.items()
                },
            }
    report["wall_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out} in {report['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
