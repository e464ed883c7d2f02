"""Weight-only builds on the trained reference target: accuracy against float32 per method.

pyref-7m (../shared/models/pyref-7m) is exported, then built at int8 and int4 with each
method and block size; every build is scored teacher-forced on held-out code (the
checkpoint's held-out stdlib files, 256-token windows, two per file, up to 48): next-token
loss increase over fp32 and top-1 agreement with fp32. GPTQ calibrates on 32 windows of
training-split files (every 50th stdlib file not held out). The lm_head is int8 in every
build (its default) unless the row says otherwise.

    python -m benchmarks.weight_only_accuracy [--target DIR]

Writes benchmarks/results/weight_only_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

from benchmarks.inputs import PYREF_7M, RESULTS
from benchmarks.runners import scratch_dir

CONFIGS = [  # label, bits, block, method, lm_head bits, lm_head top-k rescored in 8 bits
    ("int8 rtn b128", 8, 128, "rtn", 8, 0),
    ("int4 rtn b128", 4, 128, "rtn", 8, 0),
    ("int4 rtn b32", 4, 32, "rtn", 8, 0),
    ("int4 rtn b32, int4 lm_head (genai's default)", 4, 32, "rtn", 4, 0),
    ("int4 gptq b128", 4, 128, "gptq", 8, 0),
    ("int4 gptq b32", 4, 32, "gptq", 8, 0),
    ("int4 gptq b128, int4 lm_head", 4, 128, "gptq", 4, 0),
    ("int4 gptq b32, int4 lm_head", 4, 32, "gptq", 4, 0),
    ("int4 rtn b128, int4 lm_head rescoring its top 16", 4, 128, "rtn", 4, 16),
    ("int4 rtn b32, int4 lm_head rescoring its top 16", 4, 32, "rtn", 4, 16),
    ("int4 gptq b128, int4 lm_head rescoring its top 16", 4, 128, "gptq", 4, 16),
    ("int4 gptq b32, int4 lm_head rescoring its top 16", 4, 32, "gptq", 4, 16),
]


def windows(tokenizer, files: list[Path], per_file: int, limit: int) -> list[list[int]]:
    found = []
    for path in files:
        if path.is_file():
            ids = tokenizer.encode(path.read_text(errors="replace"))
            found += [ids[i : i + 256] for i in range(0, len(ids) - 256, 256)][:per_file]
    return found[:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=PYREF_7M)
    parser.add_argument("--out", type=Path, default=RESULTS / "weight_only_accuracy.json")
    parser.add_argument("--only", help="Labels to run, separated by ';' (default: all).")
    args = parser.parse_args()
    if not (args.target / "model.safetensors").is_file():
        print(f"skipped: {args.target} is absent", file=sys.stderr)
        return
    from specx.artifact import load_manifest
    from specx.builders import BuildOptions, build_artifact
    from specx.builders.int8_static import teacher_forced_accuracy
    from specx.export.target_export import export_target
    from specx.graphs.weight_only import WeightOnlyConfig
    from specx.runtime.tokenizer import TextTokenizer

    work = scratch_dir("specx-weight-only-")
    artifact = export_target(args.target, work / "artifact", max_context=512)
    tokenizer = TextTokenizer(artifact / "tokenizer.json")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held = json.loads((args.target / "held_out_files.json").read_text())["held_out_files"]
    held_out = windows(tokenizer, [stdlib / f for f in held], 2, 48)
    training = [p for p in sorted(stdlib.rglob("*.py")) if str(p.relative_to(stdlib)) not in held]
    calibration = windows(tokenizer, training[::50], 1, 32)
    manifest = load_manifest(artifact)
    inputs, fp32 = manifest.graph("target").inputs, manifest.path("target.onnx")
    rows = {}
    only = set(args.only.split(";")) if args.only else None
    for label, bits, block, method, lm_head, rescore in CONFIGS:
        if only is not None and label not in only:
            continue
        config = WeightOnlyConfig(
            bits, block, output_bits=lm_head, method=method, output_rescore=rescore
        )
        build_artifact(artifact, BuildOptions("ort", f"int{bits}", weight_only=config),
                       prompts=calibration)  # fmt: skip
        built = load_manifest(artifact)
        graph = built.path(built.runtime_graph("target").file)
        accuracy = teacher_forced_accuracy(fp32, graph, inputs, held_out, threads=2)
        rows[label] = {
            "top1_agreement": accuracy.top1_agreement,
            "loss_increase_nats": accuracy.loss_increase,
            "loss_fp32": accuracy.loss_fp32,
            "positions": accuracy.positions,
        }
        print(
            f"{label}: top-1 {accuracy.top1_agreement:.4f}, "
            f"+{accuracy.loss_increase:.4f} nats/token",
            file=sys.stderr,
            flush=True,
        )
    report = {
        "benchmark": "weight_only_accuracy",
        "target": str(args.target),
        "held_out_windows": len(held_out),
        "calibration_windows": len(calibration),
        "builds": rows,
    }
    if only is not None and args.out.is_file():  # merged into the rows already measured
        report["builds"] = {**json.loads(args.out.read_text())["builds"], **rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
