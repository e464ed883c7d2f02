"""Per-operator time of one decode step (and one verify step), specx and onnxruntime-genai.

ONNX Runtime's profiler over `--steps` decode steps of a specx build's target graph after a
prompt of `--context` tokens, and over the same number of N-token verify steps (a chain of
N = `--verify` tokens); with `--genai DIR`, the same decode steps of genai's model. Per
operator type: ms per run (the first run, the prompt, excluded) and the largest nodes.

    python benchmarks/profile_step.py ARTIFACT [--build ort-int4] [--genai DIR]
        [--context 128] [--steps 15] [--verify 8] [--threads 2]

Prints a table; the profiler slows every node a little, so compare within one run.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import numpy as np


def summarize(profile: Path, label: str, top: int = 6) -> None:
    """Per-op and per-node kernel time of every run after the first."""
    events = json.loads(profile.read_text())
    runs = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "Session" and e["name"] == "model_run"
    )
    cut, count = runs[0][1], len(runs) - 1
    by_op, by_node = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] > cut:
            by_op[e["args"]["op_name"]] += e["dur"]
            by_node[e["name"].removesuffix("_kernel_time")] += e["dur"]
    mean_run = sum(end - start for start, end in runs[1:]) / count / 1e3
    print(f"\n{label}: {count} runs, {mean_run:.3f} ms per run")
    for op, us in by_op.most_common():
        print(f"  {op:36s} {us / count / 1e3:8.3f} ms")
    for node, us in by_node.most_common(top):
        print(f"    {node[-56:]:56s} {us / count / 1e3:8.3f} ms")


def profile_specx(args, work: Path) -> None:
    from specx import sessions
    from specx.artifact import load_manifest
    from specx.masks import causal_mask
    from specx.runtime.backends import open_decoder

    for label, width in (("decode", 1), (f"verify {args.verify}", args.verify)):
        base = sessions.session_options

        def profiled(threads=None, base=base, label=label):
            options = base(threads)
            options.enable_profiling = True
            options.profile_file_prefix = str(work / label.replace(" ", "_"))
            return options

        sessions.session_options = profiled
        try:
            manifest = load_manifest(args.artifact).with_build(args.build)
            target = open_decoder(manifest, threads=args.threads)
        finally:
            sessions.session_options = base
        cache = target.allocate_cache(1, args.context + args.steps * width + 1)
        prompt = np.random.default_rng(0).integers(1, target.vocab_size, args.context)
        target.feed(cache, [prompt.tolist()], np.zeros(1, np.int64))
        cache.lengths[:] = args.context
        for _ in range(args.steps):
            start = cache.lengths.copy()
            ids = np.ones((1, width), np.int64)
            mask = causal_mask(start, width, int(start[0]) + width)
            target.forward(cache, ids, start[:, None] + np.arange(width), mask, start)
            cache.lengths += width
        summarize(Path(target.session.end_profiling()), f"specx {args.build or 'exported'} {label}")


def profile_genai(args, work: Path) -> None:
    import onnxruntime as ort

    from specx.sessions import session_options

    config = json.loads((args.genai / "genai_config.json").read_text())["model"]
    decoder = config["decoder"]
    options = session_options(args.threads)
    options.enable_profiling = True
    options.profile_file_prefix = str(work / "genai")
    session = ort.InferenceSession(
        str(args.genai / decoder["filename"]), options, providers=["CPUExecutionProvider"]
    )
    binding = session.io_binding()
    capacity = args.context + args.steps + 1
    shape = (1, decoder["num_key_value_heads"], capacity, decoder["head_size"])
    for layer in range(decoder["num_hidden_layers"]):
        for kind in ("key", "value"):
            value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
            binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", value)
            binding.bind_ortvalue_output(f"present.{layer}.{kind}", value)
    logits = np.empty((1, 1, config["vocab_size"]), np.float32)
    for step in range(args.steps + 1):
        binding.bind_cpu_input("input_ids", np.array([[7]], np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, args.context + step + 1), np.int64))
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        session.run_with_iobinding(binding)
    summarize(Path(session.end_profiling()), "onnxruntime-genai decode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--build", default=None, help="a build name; default: exported graphs")
    parser.add_argument("--genai", type=Path, default=None, help="a genai model directory")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--verify", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="specx-profile-") as work:
        profile_specx(args, Path(work))
        if args.genai is not None:
            profile_genai(args, Path(work))


if __name__ == "__main__":
    main()
