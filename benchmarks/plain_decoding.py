"""Plain decoding speed: specx on ONNX Runtime vs transformers eager, same weights, same run.

Also measures the verify-cost curve time(N)/time(1): one target forward over N new
tokens (a speculative tree) at 256 cached tokens, for N in 1..64.

    python benchmarks/plain_decoding.py [--threads 2] [--out benchmarks/results/plain_decoding.json]

Prints JSON; the model is a ~27M-parameter random-weight Llama (d 512, 8 layers,
vocab 8192) written on the fly, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from runners import scratch_dir


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/plain_decoding.json"))
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from specx.artifact import load_manifest
    from specx.export.random_checkpoint import write_random_checkpoint
    from specx.export.target_export import export_target
    from specx.masks import causal_mask
    from specx.runtime.ort_target import OrtTarget
    from specx.runtime.plain_decoding import generate_plain

    torch.set_num_threads(args.threads)
    work = scratch_dir("specx-bench-")
    log(f"[1/4] writing the bench-27m checkpoint to {work}")
    checkpoint = write_random_checkpoint(
        work / "checkpoint", "llama", "bench-27m", seed=0, tokenizer=False
    )
    log("[2/4] exporting")
    artifact = export_target(checkpoint, work / "artifact", max_context=512, progress=log)
    target = OrtTarget(load_manifest(artifact), threads=args.threads)
    prompt = np.random.default_rng(0).integers(1, target.vocab_size, args.prompt_tokens).tolist()

    log("[3/4] plain decoding: specx vs transformers")
    specx_runs = [generate_plain(target, [prompt], args.new_tokens) for _ in range(args.repeats)]
    specx_ms = statistics.median(r.stats.ms_per_token for r in specx_runs)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = torch.tensor([prompt])
    hf_kwargs = dict(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.no_grad():
        hf_tokens = hf.generate(ids, **hf_kwargs)[0, len(prompt) :].tolist()
        prefill_s = median_time(lambda: hf(ids), args.repeats)
        total_s = median_time(lambda: hf.generate(ids, **hf_kwargs), args.repeats)
    hf_ms = 1e3 * (total_s - prefill_s) / (args.new_tokens - 1)
    specx_tokens = generate_plain(target, [prompt], args.new_tokens).tokens[0]

    log("[4/4] verify-cost curve at 256 cached tokens")
    cache = target.allocate_cache(1, 256 + 64)
    cache.lengths[:] = 256
    curve = {}
    for n in (1, 2, 4, 8, 16, 32, 64):
        write_pos = np.array([256])
        inputs = (
            np.ones((1, n), np.int64),
            (256 + np.arange(n))[None],
            causal_mask(write_pos, n, 256 + n),
            write_pos,
        )
        curve[n] = median_time(lambda inputs=inputs: target.forward(cache, *inputs), 20)
    report = {
        "benchmark": "plain_decoding",
        "model": "random-weight Llama d512 x 8 layers, vocab 8192 (bench-27m preset)",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "threads": args.threads,
        },
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "specx_ms_per_token": specx_ms,
        "transformers_ms_per_token": hf_ms,
        "speedup_vs_transformers": hf_ms / specx_ms,
        "greedy_outputs_equal": specx_tokens == hf_tokens,
        "verify_ms": {n: 1e3 * t for n, t in curve.items()},
        "verify_cost_ratio": {n: t / curve[1] for n, t in curve.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
