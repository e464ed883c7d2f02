"""Prefix caching in `specx serve`: time to first token of prompts that share a long prefix.

A chat product resends its system prompt and history every turn. Here: a `--prefix`-token
shared prefix (stdlib source, as pyref-7m's training text) followed by `--requests`
different `--suffix`-token suffixes, each a greedy streamed completion of `--new-tokens`
tokens at batch 1. Two `specx serve` subprocesses on the same artifact, one with the
default prefix cache and one with `--no-prefix-cache`, receive the same requests in turn
(interleaved request by request, the order alternating); the first request warms each
(and fills the cache). Reports each side's TTFT (first streamed token) median and
fastest, their ratio, the cache's counters from /metrics, and whether both sides
returned the same tokens.

    python benchmarks/prefix_cache.py [--artifact DIR] [--prefix 700] [--suffix 20]
        [--requests 8] [--new-tokens 8] [--threads 2]

Default artifact: pyref-7m exported and built (ORT fp32) as benchmarks/serving.py does.
Writes benchmarks/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runners import scratch_dir  # noqa: E402
from serving import Server, artifact, one_request  # noqa: E402
from suite import SHARED, stdlib_split  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompts(args) -> list[list[int]]:
    """One shared prefix, then a different suffix per request (stdlib text, tokenized)."""
    from specx.runtime.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(SHARED / "models" / "pyref-7m" / "tokenizer.json")
    train, _ = stdlib_split()
    text = "".join(p.read_text(errors="replace") for p in train[:40])
    ids = tokenizer.encode(text)
    prefix = ids[: args.prefix]
    suffixes = [ids[args.prefix + 997 * (i + 1) :][: args.suffix] for i in range(args.requests + 1)]
    return [prefix + s for s in suffixes]


def cache_metrics(url: str) -> dict[str, float]:
    import httpx

    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return {
        line.split()[0]: float(line.split()[1])
        for line in lines
        if line.startswith("specx_prefix_cache")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, default=None)
    parser.add_argument("--prefix", type=int, default=700)
    parser.add_argument("--suffix", type=int, default=20)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix_cache.json"))
    args = parser.parse_args()
    if not (SHARED / "models" / "pyref-7m" / "model.safetensors").is_file():
        log("skipped: shared/models/pyref-7m is absent")
        return
    target = args.artifact or artifact(scratch_dir("specx-prefix-cache-"))
    requests = prompts(args)
    servers = {
        "prefix cache": Server(target, args.threads, 1),
        "no prefix cache": Server(target, args.threads, 1, "--no-prefix-cache"),
    }
    results: dict[str, list[dict]] = {name: [] for name in servers}
    try:
        for i, prompt in enumerate(requests):
            order = list(servers) if i % 2 == 0 else list(servers)[::-1]
            for name in order:
                results[name].append(one_request(servers[name].url, prompt, None, args.new_tokens))
            log(f"request {i + 1}/{len(requests)}")
        counters = cache_metrics(servers["prefix cache"].url)
    finally:
        for server in servers.values():
            server.close()
    report = {
        "benchmark": "prefix_cache",
        "artifact": str(target) if args.artifact else "pyref-7m, ORT fp32 build",
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "requests": args.requests,
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "identical_tokens": [r["tokens"] for r in results["prefix cache"]]
        == [r["tokens"] for r in results["no prefix cache"]],
        "cache_metrics": counters,
    }
    for name, rows in results.items():
        ttft = [r["ttft_s"] * 1e3 for r in rows[1:]]  # the first request warms (and fills)
        report[name] = {"ttft_ms_median": statistics.median(ttft), "ttft_ms_fastest": min(ttft)}
    on, off = report["prefix cache"], report["no prefix cache"]
    report["ttft_ratio_median"] = off["ttft_ms_median"] / on["ttft_ms_median"]
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
