"""Real-size model on this CPU: export and build cost, then plain decoding vs onnxruntime-genai.

On the random-weight Llama-3.2-1B-shaped checkpoint (benchmarks/models/real_size_checkpoint.py,
1.5B parameters, bf16), 2 threads:

1. wall time and peak RSS (of the child process) of `specx export`, `specx build --precision
   int4 / int8` and onnxruntime-genai's builder at fp32 and int4, and each output's size;
2. plain greedy decoding, both runtimes in this process on the same weights, interleaved
   prompt by prompt, fastest of `--repeats` per prompt, decode ms/token (tokens after the
   first) and total ms/token reported apart (benchmarks/runners.py), one pair at a time:
   specx fp32 vs genai fp32; specx's default int4 (blocks of 128 with a padding row, int4
   lm_head with its top 16 logits rescored in 8 bits) and the former default (blocks of 32,
   int8 lm_head) vs genai's default int4 (blocks of 32, int4 lm_head); the same
   configuration on both sides at blocks of 128 and of 32 (int4 lm_head, no rescoring);
   specx int8.

    python -m benchmarks.real_size [--work DIR] [--prompts 4] [--new-tokens 64]
    python -m benchmarks.real_size --costs-only      # export/build costs, no decoding
    python -m benchmarks.real_size --default-only    # specx's default int4 and both genai
                                                     # int4s in one interleaving
    python -m benchmarks.real_size --default-only --llama-cpp   # and llama.cpp's Q4_0
    python -m benchmarks.real_size --export-only     # export vs genai's builder, alternated

`--llama-cpp` adds llama.cpp's plain decoding at Q4_0 (its `llama-server` on 127.0.0.1, a process
of its own, prompt cache off; built and the checkpoint converted by benchmarks/llama_cpp.py under
~/.cache/specx/llama.cpp) to the `--default-only` interleaving.

Writes benchmarks/results/real_size.json. Random weights give near-uniform logits, so two
correct runtimes can part at near-ties: tokens are compared, not required equal.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import sys
from pathlib import Path

import numpy as np

from benchmarks import llama_cpp
from benchmarks.inputs import RESULTS
from benchmarks.models.real_size_checkpoint import write as write_checkpoint
from benchmarks.runners import (
    GenaiPlain,
    LlamaCompletion,
    LlamaServer,
    SpecxPlain,
    directory_gb,
    interleave,
    measured_run,
)

# (label, precision, build options, genai peer)
BUILDS = [
    ("int8", "int8", [], "genai-int4"),
    ("int4 b128 lm_head int4", "int4", ["--lm-head-rescore", "0"], "genai-int4-b128"),
    ("int4 b32 lm_head int4", "int4", ["--block-size", "32", "--lm-head-rescore", "0"],
     "genai-int4"),
    ("int4 b32 lm_head int8", "int4", ["--block-size", "32", "--lm-head-bits", "8"],
     "genai-int4"),  # the default before the padding row and the rescoring
    ("int4", "int4", [], "genai-int4"),  # the default: blocks of 128, lm_head int4 rescored
]  # fmt: skip


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def warm(checkpoint: Path) -> None:
    """Reads the checkpoint once so every timed command finds it in the page cache (the
    first command would otherwise pay the disk reads the later ones skip), and flushes the
    dirty pages earlier commands left (so no command pays another's writeback)."""
    for path in sorted(checkpoint.iterdir()):
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass
    os.sync()


def step(name: str, command: list[str], results: dict) -> None:
    log(f"{name}: {' '.join(command)}")
    measured = measured_run(command)
    if measured.returncode != 0:
        raise SystemExit(f"{name} failed:\n{measured.stderr_tail}")
    results[name] = {"seconds": measured.seconds, "peak_rss_gb": measured.peak_rss_gb}
    log(f"  {measured.seconds:.1f}s, peak RSS {measured.peak_rss_gb:.2f} GB")


def genai_build(
    checkpoint: Path, out: Path, precision: str, work: Path, results: dict, block: int = 0
) -> None:
    shutil.rmtree(out, ignore_errors=True)
    command = [
        sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint),
        "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(work / "genai-cache"),
    ]  # fmt: skip
    if block:
        command += ["--extra_options", f"block_size={block}"]
    name = f"genai builder {precision}" + (f" block {block}" if block else "")
    warm(checkpoint)
    step(name, command, results)
    results[name]["size_gb"] = directory_gb(out)


def compare(runners: dict, prompts, args) -> dict:
    summaries = interleave(runners, prompts, args.new_tokens, args.repeats)
    names = list(summaries)
    report = {name: s.report(args.new_tokens) for name, s in summaries.items()}
    first = summaries[names[0]].tokens
    for name in names[1:]:
        same = sum(a == b for a, b in zip(first, summaries[name].tokens, strict=True))
        report[name][f"prompts_identical_to_{names[0]}"] = f"{same}/{len(first)}"
    for name, row in report.items():
        log(
            f"  {name}: decode {row['decode_ms_per_token']:.2f} ms/token, "
            f"total {row['total_ms_per_token']:.2f}"
        )
    return report


def random_prompts(args, seed: int) -> list[list[int]]:
    """`--prompts` random prompts of `--prompt-tokens` ids (random weights: any ids do)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 4096, args.prompt_tokens).tolist() for _ in range(args.prompts)]


def default_vs_genai(checkpoint: Path, artifact: Path, work: Path, args) -> None:
    """specx's default int4 build and both genai int4s in one interleaving (and llama.cpp's
    Q4_0 with `--llama-cpp`); each built first where missing."""
    specx = [sys.executable, "-m", "specx.cli"]
    costs: dict = {}
    if not list((artifact / "builds").glob("ort-int4.*")):
        shutil.rmtree(artifact, ignore_errors=True)
        step("specx export", [*specx, "export", str(checkpoint), "-o", str(artifact),
                              "--max-context", "1024", "--no-build"], costs)  # fmt: skip
        step("specx build int4", [*specx, "build", str(artifact), "--precision", "int4"], costs)
    for name, block in (("genai-int4", 0), ("genai-int4-b128", 128)):
        if not (work / name / "genai_config.json").is_file():
            genai_build(checkpoint, work / name, "int4", work, costs, block=block)
    prompts = random_prompts(args, seed=1)
    runners = {
        "specx int4 (default)": SpecxPlain(artifact, "ort-int4", args.threads),
        "genai-int4": GenaiPlain(work / "genai-int4", args.threads),
        "genai-int4-b128": GenaiPlain(work / "genai-int4-b128", args.threads),
    }
    extra: dict = {}
    with contextlib.ExitStack() as stack:
        if args.llama_cpp:
            bin_dir, gguf, amx = llama_cpp.plain_q4_0(checkpoint, llama_cpp.CACHE / "llama.cpp")
            server = stack.enter_context(LlamaServer(bin_dir, gguf, args.threads))
            runners["llama.cpp Q4_0"] = LlamaCompletion(server)
            size = round(gguf.stat().st_size / 1e9, 2)
            extra["llama_cpp"] = {"amx": amx, "gguf": gguf.name, "size_gb": size}
        log(f"plain decoding: {', '.join(runners)}")
        report = compare(runners, prompts, args)
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results["default_vs_genai"] = {"prompts": args.prompts, "repeats": args.repeats, **extra,
                                   **report}  # fmt: skip
    args.out.write_text(json.dumps(results, indent=2) + "\n")


def export_vs_genai(checkpoint: Path, work: Path, args) -> None:
    """`specx export` and genai's fp32 builder alternated `--repeats` times; fastest of each."""
    specx_out, genai_out = work / "export-timing", work / "genai-fp32-timing"
    commands = {
        "specx export": [sys.executable, "-m", "specx.cli", "export", str(checkpoint), "-o",
                         str(specx_out), "--max-context", "1024", "--no-build"],
        "genai builder fp32": [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                               str(checkpoint), "-o", str(genai_out), "-p", "fp32", "-e", "cpu",
                               "-c", str(work / "genai-cache")],
    }  # fmt: skip
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    report: dict = {"repeats": args.repeats}
    for _ in range(args.repeats):
        for name, command in commands.items():
            for out in (specx_out, genai_out):
                shutil.rmtree(out, ignore_errors=True)
            warm(checkpoint)
            measured = measured_run(command)
            if measured.returncode != 0:
                raise SystemExit(f"{name} failed:\n{measured.stderr_tail}")
            seconds[name].append(round(measured.seconds, 2))
            report[name] = {"seconds": seconds[name], "peak_rss_gb": measured.peak_rss_gb}
            log(f"  {name}: {measured.seconds:.1f}s, peak RSS {measured.peak_rss_gb:.2f} GB")
    for out in (specx_out, genai_out):
        shutil.rmtree(out, ignore_errors=True)
    fastest = {name: min(times) for name, times in seconds.items()}
    report["ratio_of_fastest"] = round(fastest["specx export"] / fastest["genai builder fp32"], 3)
    log(f"export / genai builder, fastest of {args.repeats}: {report['ratio_of_fastest']:.2f}x")
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results["export_vs_genai"] = report
    args.out.write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache/specx/real-size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "real_size.json")
    parser.add_argument(
        "--costs-only", action="store_true", help="Time and measure the builds, no decoding."
    )
    parser.add_argument(
        "--default-only",
        action="store_true",
        help="Only decode: the artifact's existing default int4 build vs genai int4 at its "
        "default and at blocks of 128, all three interleaved (results under default_vs_genai).",
    )
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="With --default-only: llama.cpp's Q4_0 in the interleaving too.",
    )
    parser.add_argument(
        "--export-only",
        action="store_true",
        help="Only `specx export` vs genai's fp32 builder, alternated --repeats times "
        "(results under export_vs_genai).",
    )
    args = parser.parse_args()
    work = args.work
    checkpoint, artifact = work / "checkpoint", work / "artifact"
    if not (checkpoint / "model.safetensors").is_file():
        log(f"writing the 1B-shaped checkpoint to {checkpoint}")
        write_checkpoint(checkpoint)
    if args.default_only:
        default_vs_genai(checkpoint, artifact, work, args)
        return
    if args.export_only:
        export_vs_genai(checkpoint, work, args)
        return
    costs: dict = {}
    specx = [sys.executable, "-m", "specx.cli"]
    shutil.rmtree(artifact, ignore_errors=True)
    warm(checkpoint)
    step("specx export", [*specx, "export", str(checkpoint), "-o", str(artifact),
                          "--max-context", "1024", "--no-build"], costs)  # fmt: skip
    costs["specx export"]["size_gb"] = directory_gb(artifact)
    genai_build(checkpoint, work / "genai-fp32", "fp32", work, costs)
    genai_build(checkpoint, work / "genai-int4", "int4", work, costs)
    genai_build(checkpoint, work / "genai-int4-b128", "int4", work, costs, block=128)
    prompts = random_prompts(args, seed=0)
    speed: dict = {}

    if args.costs_only:
        for label, precision, extra, _ in BUILDS:
            name = f"specx build {label}"
            step(name, [*specx, "build", str(artifact), "--precision", precision, *extra], costs)
            build_dir = next((artifact / "builds").glob(f"ort-{precision}.*"))
            costs[name]["size_gb"] = directory_gb(build_dir)
        print(json.dumps(costs, indent=2))
        return
    log("plain decoding, fp32")
    speed["fp32"] = compare(
        {
            "specx fp32": SpecxPlain(artifact, None, args.threads),
            "genai fp32": GenaiPlain(work / "genai-fp32", args.threads),
        },
        prompts,
        args,
    )
    gc.collect()
    for label, precision, extra, peer in BUILDS:
        name = f"specx build {label}"
        step(name, [*specx, "build", str(artifact), "--precision", precision, *extra], costs)
        build_dir = next((artifact / "builds").glob(f"ort-{precision}.*"))
        costs[name]["size_gb"] = directory_gb(build_dir)
        log(f"plain decoding, specx {label} vs {peer}")
        speed[label] = compare(
            {
                f"specx {label}": SpecxPlain(artifact, f"ort-{precision}", args.threads),
                peer: GenaiPlain(work / peer, args.threads),
            },
            prompts,
            args,
        )
        gc.collect()
    report = {
        "benchmark": "real_size",
        "model": "random-weight Llama-3.2-1B shape (hidden 2048, 16 layers, 32/8 heads, "
        "vocab 128256, untied lm_head; 1.50B parameters, bf16 checkpoint)",
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "costs": costs,
        "plain_decoding": speed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
