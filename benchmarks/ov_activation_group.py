"""What a verify of N rows costs on specx's OpenVINO int4 build, by the plugin's activation group.

OpenVINO's CPU plugin quantizes the activations of a compressed MatMul to int8 per group of
DYNAMIC_QUANTIZATION_GROUP_SIZE channels (its default: 32; 0 turns it off). This compiles
the target IR of an artifact's `openvino-int4` build (edge.py writes pyref-1b's) once per
group size and times one forward of N = 1, 2, 3, 5, 8 new rows after a `--context`-token
prefix, the cache as specx's runtime passes it (its numpy buffers shared, capacity 1025
slots), every group size and row count taking turns, fastest of `--repeats` per point.
N = 1 is one row as it is (the runtime runs a lone token as two rows: `ov_target`).

    python benchmarks/ov_activation_group.py [ARTIFACT] [--groups 0,32,64,128] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "ov_activation_group.json"
ROWS = (1, 2, 3, 5, 8)
CAPACITY = 1025  # pyref-1b's artifact: 1024 slots and the runtime's spare one


def feeds(compiled, rows: int, context: int, rng: np.random.Generator) -> dict:
    """One forward's inputs: `rows` new tokens after `context` cached ones, causal."""
    width = -(-(context + rows) // 32) * 32  # the runtime's mask quantum
    mask = np.zeros((1, 1, rows, width), bool)
    for j in range(rows):
        mask[0, 0, j, : context + j + 1] = True
    out = {
        "input_ids": rng.integers(0, 1000, (1, rows)),
        "position_ids": (context + np.arange(rows))[None],
        "attention_mask": mask,
        "write_pos": np.array([context]),
    }
    for port in compiled.inputs:
        name = port.get_any_name()
        if name.startswith("past_"):
            shape = port.get_partial_shape()
            heads, head_dim = shape[1].get_length(), shape[3].get_length()
            out[name] = np.zeros((1, heads, CAPACITY, head_dim), np.float32)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "artifact", type=Path, nargs="?", default=Path.home() / ".cache/specx/edge/specx/plain"
    )
    parser.add_argument("--groups", default="0,32,64,128")
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not (args.artifact / "manifest.json").is_file():
        print(f"skipped: no artifact at {args.artifact} (benchmarks/edge.py writes it)")
        return
    import openvino as ov

    from specx.artifact import load_manifest

    manifest = load_manifest(args.artifact).with_build("openvino-int4")
    path = manifest.path(manifest.runtime_graph("target").file)
    groups = [int(g) for g in args.groups.split(",")]
    requests = {}
    for group in groups:
        config = {
            "INFERENCE_PRECISION_HINT": "f32",
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_NUM_THREADS": args.threads,
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": group,
        }
        requests[group] = ov.Core().compile_model(str(path), "CPU", config).create_infer_request()
    rng = np.random.default_rng(0)
    compiled = requests[groups[0]].get_compiled_model()
    inputs = {rows: feeds(compiled, rows, args.context, rng) for rows in ROWS}
    best = {(g, n): float("inf") for g in groups for n in ROWS}
    for _ in range(args.repeats):
        for group, request in requests.items():
            for rows, feed in inputs.items():
                request.infer(feed, share_inputs=True)  # the shape's first call prepares it
                start = time.perf_counter()
                request.infer(feed, share_inputs=True)
                best[group, rows] = min(best[group, rows], (time.perf_counter() - start) * 1e3)
    table = {str(g): {"ms": {str(n): round(best[g, n], 2) for n in ROWS}} for g in groups}
    for g in groups:
        table[str(g)]["t5_over_t2"] = round(best[g, 5] / best[g, 2], 3)
        print(f"group {g:4d}: " + "  ".join(f"t({n}) {best[g, n]:6.2f}" for n in ROWS))
    report = {
        "benchmark": "ov_activation_group",
        "artifact": str(args.artifact),
        "weight_block": manifest.build.quantization.get("block"),
        "context": args.context,
        "repeats": args.repeats,
        "threads": args.threads,
        "openvino": ov.__version__,
        "by_group": table,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
