"""The kernel benchmark: every int4 build's target forward t(N) beside this machine's roofline.

For pyref-1b (benchmarks/models/pyref_wide.py; or each `--artifact`), each of its int4
builds (ONNX Runtime `ort-int4`, OpenVINO `openvino-int4`, specx's own kernels `cpu-int4`)
is timed for N = 1, 2, 4, 8, 16, 32 new tokens over 128 and 2,048 cached tokens
(`specx.calibration.costs.measure_verify_curve`, median of the repeats, each build in a
process of its own, as `specx build --backend auto` times them). Beside them,
measured in the same run (benchmarks/roofline.c, compiled here with the system compiler):
the read bandwidth of a buffer larger than the caches and the int8 multiply-add rate of
independent `vpdpbusd` chains, on every thread. A forward's roofline is

    max((weights streamed + KV cache read) / bandwidth, N x multiply-adds / int8 rate)

with the weights a build streams per forward (its MatMul weights, not the embedding's
gathered rows) and the KV cache's bytes at the context, priced with the better of the probes
before and after the timings (the bandwidth of these shared hosts moves run to run).
`--llama-cpp` adds llama.cpp's `llama-bench -p N -n 0` (Q4_0, at depth 0 for 128 and at the
context's depth for 2,048) where benchmarks/llama_cpp.py has built it (pyref-1b only: its
GGUF). `--llama-shaped` adds a random-weight checkpoint shaped like Llama-3.2-1B (hidden
2048, 16 layers, 32 / 8 heads, MLP 8192, vocabulary 128256), exported and built at int4 on
each backend here.

    python -m benchmarks.kernels [--artifact DIR ...] [--llama-shaped] [--llama-cpp]
        [--contexts 128,2048] [--tokens 1,2,4,8,16,32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CACHE = Path.home() / ".cache" / "specx"
BUILDS = ("ort-int4", "openvino-int4", "cpu-int4")
BACKEND_OF = {"ort-int4": "ort", "openvino-int4": "openvino", "cpu-int4": "cpu"}
# Llama-3.2-1B's shape (random weights: its speed, not its function)
LLAMA_SHAPE = (2048, 8192, 16, 32, 8, 128256)


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, file=sys.stderr, flush=True)


def roofline(threads: int) -> dict:
    """Read GB/s and int8 GMAC/s on `threads` threads (benchmarks/roofline.c)."""
    with tempfile.TemporaryDirectory() as work:
        binary = Path(work) / "roofline"
        flags = ["-O3", "-fopenmp", "-mavx512f", "-mavx512vnni"]
        subprocess.run(["gcc", *flags, "-o", str(binary), str(ROOT / "benchmarks/roofline.c")],
                       check=True)  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run([str(binary), "640", "4"], capture_output=True, text=True,
                              env=env, check=True)  # fmt: skip
    return json.loads(done.stdout)


def measure(artifact: Path, build: str, tokens: list[int], context: int, repeats: int) -> dict:
    """t(N) in ms of `build` (in this process: the caller runs it in its own)."""
    from specx.artifact import load_manifest
    from specx.calibration.costs import measure_verify_curve
    from specx.runtime.targets import open_decoder

    manifest = load_manifest(artifact, verify_hashes=False).with_build(build)
    target = open_decoder(manifest, threads=2)
    curve = measure_verify_curve(target, tuple(tokens), context, repeats=repeats)
    return {str(n): 1e3 * s for n, s in zip(curve.tokens, curve.seconds, strict=True)}


def measure_apart(artifact: Path, build: str, tokens, context: int, repeats: int) -> dict:
    """`measure` in a child process: one build's runtime and thread pools per process."""
    command = [sys.executable, "-m", "benchmarks.kernels", "--measure", str(artifact), build,
               ",".join(map(str, tokens)), str(context), str(repeats)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"timing {build} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def weights(artifact: Path) -> dict:
    """The forward's multiply-adds per token and each build's streamed megabytes."""
    from benchmarks.edge import streamed_mb
    from specx.artifact import load_manifest

    manifest = load_manifest(artifact, verify_hashes=False)
    out: dict = {"streamed_mb": {}}
    if "cpu-int4" in manifest.builds:
        entry = manifest.with_build("cpu-int4").runtime_graph("target")
        index = json.loads(manifest.path(entry.file).read_text())["tensors"]
        linears = {name: spec for name, spec in index.items() if "bits" in spec}
        out["macs_per_token"] = sum(spec["k"] * spec["n"] for spec in linears.values())
        packed = sum(int(np.prod(spec["shape"])) for spec in linears.values())
        out["streamed_mb"]["cpu-int4"] = packed / 1e6
    if "ort-int4" in manifest.builds:
        graph = manifest.with_build("ort-int4").runtime_graph("target").file
        out["streamed_mb"]["ort-int4"] = streamed_mb(manifest.path(graph))
    model = manifest.model
    out["kv_bytes_per_token"] = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4
    return out


def floors(sizes: dict, machine: dict, build: str, context: int, tokens: list[int]) -> dict:
    """Each N's roofline in ms for `build`'s bytes (the cpu build's where it has none)."""
    streamed = sizes["streamed_mb"].get(build) or sizes["streamed_mb"].get("cpu-int4")
    memory = (streamed * 1e6 + context * sizes["kv_bytes_per_token"]) / machine["read_gb_per_s"]
    compute = sizes["macs_per_token"] / machine["int8_gmac_per_s"]
    return {str(n): max(memory, n * compute) / 1e6 for n in tokens}


def llama_bench(tokens: list[int], context: int) -> dict | None:
    """llama.cpp's t(N) in ms at Q4_0 (pyref-1b's GGUF), or None where it is not built."""
    from benchmarks import llama_cpp

    work = CACHE / "llama.cpp"
    models = work / "models" / "pyref-1b-q4_0.gguf"
    tool = llama_cpp.bench_tool(work)
    if tool is None or not models.is_file():
        return None
    depth = 0 if context <= 128 else context
    times = {}
    for n in tokens:
        done = subprocess.run(
            [str(tool), "-m", str(models), "-t", "2", "-p", str(n), "-n", "0", "-d", str(depth),
             "-r", "5", "-o", "json"],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            log(f"llama-bench failed: {done.stderr[-500:]}")
            return None
        times[str(n)] = json.loads(done.stdout)[0]["avg_ns"] / 1e6
    return times


def built(checkpoint: Path, artifact: Path) -> Path:
    """`checkpoint` exported for 2,304 slots into `artifact` with each int4 build (kept; the
    openvino and cpu ones rebuilt when the code that writes them changed)."""
    from specx.artifact import load_manifest
    from specx.builders import BuildOptions, build_artifact
    from specx.export.target_export import export_target

    if not (artifact / "manifest.json").is_file():
        log(f"exporting {checkpoint} for 2,304 cached tokens")
        export_target(checkpoint, artifact, max_context=2304, beyond_trained_positions=True)
    from benchmarks.edge import extra_build

    builds = load_manifest(artifact, verify_hashes=False).builds
    for build in BUILDS:
        if BACKEND_OF[build] != "ort":  # rebuilt when the code that writes it changed
            extra_build(artifact, BACKEND_OF[build])
        elif build not in builds:
            log(f"building {build}")
            build_artifact(artifact, BuildOptions(BACKEND_OF[build], "int4"), log)
    return artifact


def llama_shaped(work: Path) -> Path:
    """The random-weight Llama-3.2-1B-shaped checkpoint, written once, and its artifact."""
    from specx.export.random_checkpoint import CheckpointPreset, write_random_checkpoint

    checkpoint = work / "llama-1b-shaped-checkpoint"
    if not (checkpoint / "config.json").is_file():
        log("writing a random Llama-3.2-1B-shaped checkpoint")
        preset = CheckpointPreset(*LLAMA_SHAPE)
        write_random_checkpoint(checkpoint, "llama", preset, tokenizer=False)
    return built(checkpoint, work / "llama-1b-shaped")


def best_roofline(probes: list[dict]) -> dict:
    """The better of each rate the probes read (each probe's median pass for bandwidth): the
    floor is what the machine does when the host lets it (its bandwidth moves run to run)."""
    return {
        "read_gb_per_s": max(p["read_gb_per_s"] for p in probes),
        "int8_gmac_per_s": max(p["int8_gmac_per_s"] for p in probes),
        "probes": probes,
    }


def run(args: argparse.Namespace, artifacts: list[Path]) -> dict:
    machine = {"platform": platform.platform(), "processor": platform.processor()}
    probes = [roofline(2)]
    log(f"roofline: {probes[0]}")
    report: dict = {"benchmark": "kernels", "machine": machine, "artifacts": {}}
    for artifact in artifacts:
        from specx.artifact import load_manifest

        builds = [b for b in BUILDS if b in load_manifest(artifact, verify_hashes=False).builds]
        sizes = weights(artifact)
        entry: dict = {"sizes": sizes, "contexts": {}}
        for context in args.contexts:
            cell: dict = {"t_ms": {}, "roofline_ms": {}, "of_roofline": {}}
            for build in builds:
                log(f"{artifact.name} {build} at {context} cached tokens")
                times = measure_apart(artifact, build, args.tokens, context, args.repeats)
                cell["t_ms"][build] = times
            if args.llama_cpp and artifact.name == "pyref-1b":
                cell["t_ms"]["llama.cpp-q4_0"] = llama_bench(args.tokens, context)
            entry["contexts"][str(context)] = cell
        report["artifacts"][str(artifact)] = entry
    probes.append(roofline(2))
    log(f"roofline again: {probes[-1]}")
    machine |= best_roofline(probes)
    for entry in report["artifacts"].values():  # priced with the best rates of the run
        for context, cell in entry["contexts"].items():
            for build, times in cell["t_ms"].items():
                if times is None or build not in BUILDS:
                    continue
                floor = floors(entry["sizes"], machine, build, int(context), args.tokens)
                cell["roofline_ms"][build] = floor
                cell["of_roofline"][build] = {n: times[n] / floor[n] for n in times}
    return report


def markdown(report: dict) -> str:
    lines = []
    machine = report["machine"]
    lines.append(
        f"read {machine['read_gb_per_s']:.1f} GB/s, int8 {machine['int8_gmac_per_s']:.0f} GMAC/s"
    )
    for artifact, entry in report["artifacts"].items():
        for context, cell in entry["contexts"].items():
            lines.append(f"\n{Path(artifact).name}, {context} cached tokens: t(N) ms (x roofline)")
            for build, times in cell["t_ms"].items():
                if times is None:
                    continue
                ratios = cell["of_roofline"].get(build, {})
                row = " / ".join(
                    f"{t:.1f}" + (f" ({ratios[n]:.2f}x)" if n in ratios else "")
                    for n, t in times.items()
                )
                lines.append(f"  {build}: {row}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        artifact, build, tokens, context, repeats = sys.argv[2:7]
        times = measure(Path(artifact), build, [int(n) for n in tokens.split(",")],
                        int(context), int(repeats))  # fmt: skip
        print(json.dumps(times))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, action="append", default=[])
    parser.add_argument("--llama-shaped", action="store_true")
    parser.add_argument("--llama-cpp", action="store_true")
    parser.add_argument("--work", type=Path, default=CACHE / "kernels")
    parser.add_argument("--wide", type=Path, default=CACHE / "pyref-wide")
    parser.add_argument("--contexts", type=lambda s: [int(v) for v in s.split(",")],
                        default=[128, 2048])  # fmt: skip
    parser.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")],
                        default=[1, 2, 4, 8, 16, 32])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prepare-only", action="store_true", help="export and build, no timing")
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    artifacts = list(args.artifact)
    if not artifacts:
        from benchmarks.models import pyref_wide

        if not (pyref_wide.SOURCE / "model.safetensors").is_file():
            log("skipped pyref-1b: shared/models/pyref-7m is absent")
        else:
            target = pyref_wide.write_target(args.wide, pyref_wide.Shape())
            artifacts.append(built(target, args.work / "pyref-1b"))
    if args.llama_shaped:
        artifacts.append(llama_shaped(args.work))
    if args.prepare_only:
        return
    report = run(args, artifacts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
