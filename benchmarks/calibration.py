"""Calibration on the reference target: predicted vs measured speedup, calibrated vs hand-picked.

    python benchmarks/calibration.py [--drafters eagle,eagle3,medusa,mtp,ngram,draft-model]

For each drafter of pyref-7m (trained heads from the suite's cache, rebuilt when missing):
`specx calibrate` on 16 prompts (12 HumanEval, 4 stdlib training files), then, on held-out
prompts of the same mix (the last 16 HumanEval prompts and 8 held-out stdlib files, none
used for calibration), greedy at batch 1:
plain decoding, the calibrated choice and the hand-picked defaults of the suite. Reports
the predicted and measured speedup of the calibrated choice (and their relative error),
whether it is at least as fast as every default, and the batch curve measured against
the calibration's prediction. Then the INT8 target (`specx quantize`): accuracy against
fp32 and the change in acceptance and speed. JSON to benchmarks/results/calibration.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from suite import SHARED, stdlib_split, train_drafters

HUMANEVAL = SHARED / "data" / "eval" / "humaneval.jsonl"
SMALL_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


def measure(target, spec, options, prompts, new_tokens, batch: int = 1) -> dict:
    """ms/token (summed decode time over emitted tokens) and acceptance, greedy."""
    from specx.runtime.drafters import make_drafter
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.speculative_decoding import generate_speculative

    decode_s = tokens = 0.0
    lengths, outputs = [], []
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        if spec is None:
            result = generate_plain(target, group, new_tokens)
            decode_s += result.stats["decode_s"]
        else:
            drafter = make_drafter(spec, target, options)
            result = generate_speculative(target, drafter, group, new_tokens)
            decode_s += result.stats["total_s"] - result.stats["prefill_s"]
            lengths.append(result.stats["acceptance_length"])
        tokens += result.stats["new_tokens"] - len(group)
        outputs += result.tokens
    out = {"ms_per_token": 1e3 * decode_s / tokens, "tokens": outputs}
    if lengths:
        out["acceptance_length"] = statistics.mean(lengths)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", default="eagle,eagle3,medusa,mtp,ngram,draft-model")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/calibration.json"))
    args = parser.parse_args()
    model_dir = SHARED / "models" / "pyref-7m"
    if not (model_dir / "model.safetensors").is_file():
        print(f"skipped: {model_dir} is absent", file=sys.stderr)
        return

    from specx.artifact import load_manifest
    from specx.calibration.calibrate import CalibrationOptions, calibrate_artifact
    from specx.calibration.quantization import quantize_artifact
    from specx.export.target_export import export_target
    from specx.runtime.calibrated import calibrated_choice
    from specx.runtime.drafters import DrafterOptions
    from specx.runtime.drafters.medusa import MEDUSA_DEFAULT_TREE
    from specx.runtime.drafters.tree_search import DynamicTree, StaticTree
    from specx.runtime.ort_target import OrtTarget, configure_threads
    from specx.runtime.tokenizer import TextTokenizer

    configure_threads(args.threads)
    started = time.perf_counter()
    drafters_dir = train_drafters(model_dir, 400, False)
    work = Path(tempfile.mkdtemp(prefix="specx-calibration-"))
    tokenizer = TextTokenizer(model_dir / "tokenizer.json")
    calibration_prompts, held_out = split_prompts(tokenizer)
    report = {
        "benchmark": "calibration",
        "target": "pyref-7m",
        "command": "python benchmarks/calibration.py",
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "calibration_prompts": len(calibration_prompts),
        "held_out_prompts": len(held_out),
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
        entry = calibrate_artifact(
            artifact, calibration_prompts, CalibrationOptions(drafter=spec, threads=args.threads)
        )
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
                configs["dynamic 12,5,3"] = DrafterOptions(tree=DynamicTree(12, 5, 3))
        log(f"[{name}] held-out: plain + {len(configs)} configurations")
        plain = measure(target, None, None, held_out, args.new_tokens)
        results = {}
        for label, options in configs.items():
            again = measure(target, None, None, held_out, args.new_tokens)  # adjacent to the run
            row = measure(target, spec, options, held_out, args.new_tokens)
            row["speedup"] = again["ms_per_token"] / row["ms_per_token"]
            row["identical_to_plain"] = row.pop("tokens") == plain["tokens"]
            results[label] = row
        # What `specx generate` does with the calibration: the chosen tree, or plain decoding
        # when calibration found that speculation does not pay (max_batch_spec 0).
        speculating = entry["max_batch_spec"] >= 1
        tree_predicted = entry["choice"]["measured_speedup"]
        tree_measured = results["calibrated"]["speedup"]
        predicted = entry["expected_speedup"]
        measured = tree_measured if speculating else 1.0
        defaults = {k: v["speedup"] for k, v in results.items() if k != "calibrated"}
        report["drafters"][name] = {
            "choice": {k: v for k, v in entry["choice"].items() if k != "choices"},
            "acceptance_by_depth_and_rank": entry["acceptance"]["acceptance_by_depth_and_rank"],
            "draft_cost_c": entry["costs"]["draft_cost_c"],
            "plain_ms_per_token": plain["ms_per_token"],
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
            "max_batch_spec": entry["max_batch_spec"],
            "batch_curve_calibration": entry["batch_curve"],
        }
        log(
            f"[{name}] {entry['choice']['label']}: tree predicted {tree_predicted:.2f}x, "
            f"measured {tree_measured:.2f}x; speculation {'on' if speculating else 'off'}; "
            f"defaults {defaults}"
        )
        if name == "eagle":
            report["batch_curve_measured"] = {}
            for batch in (1, 2, 4, 8):
                group = held_out[: 8 * batch]
                base = measure(target, None, None, group, 32, batch)
                spec_row = measure(target, spec, configs["calibrated"], group, 32, batch)
                report["batch_curve_measured"][batch] = (
                    base["ms_per_token"] / spec_row["ms_per_token"]
                )
            log("[int8] quantizing the eagle artifact on the calibration prompts")
            int8_dir = shutil.copytree(artifact, work / "eagle-int8")
            quantized = quantize_artifact(int8_dir, calibration_prompts, eval_prompts=held_out)
            int8_target = OrtTarget(load_manifest(int8_dir), args.threads)
            int8_plain = measure(int8_target, None, None, held_out, args.new_tokens)
            int8_spec = measure(int8_target, spec, configs["calibrated"], held_out, args.new_tokens)
            report["int8"] = {
                "accuracy": quantized["accuracy"],
                "plain_ms_per_token": {
                    "fp32": plain["ms_per_token"],
                    "int8": int8_plain["ms_per_token"],
                },
                "eagle_calibrated_ms_per_token": {
                    "fp32": results["calibrated"]["ms_per_token"],
                    "int8": int8_spec["ms_per_token"],
                },
                "acceptance_length": {
                    "fp32": results["calibrated"]["acceptance_length"],
                    "int8": int8_spec["acceptance_length"],
                },
                "int8_speculative_equals_int8_plain": int8_spec["tokens"] == int8_plain["tokens"],
            }
    report["wall_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out} in {report['wall_s']:.0f}s")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
