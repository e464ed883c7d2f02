"""`specx serve` under load: plain vs speculative continuous batching on pyref-7m; and
(`--prefix-cache`) the time to first token of prompts that share a long prefix.

For each concurrency C in --concurrency (default 1, 4, 16): --requests greedy streamed
completions (half HumanEval, half mt_bench prompts, --new-tokens each, eos ignored) sent by
C client threads that each start the next request as soon as their last one ends; once
with plain decoding ("drafter": null) and once with --drafter (default suffix), each on a
freshly started `specx serve` subprocess (so the suffix drafter has seen only that run's
earlier requests), modes alternating, --repeats runs each, the run with the highest
throughput kept. Reports throughput (generated tokens / wall time), request latency
p50/p95, time to first token p50/p95, and whether both modes' tokens were identical.
The server runs the ORT-lowered fp32 build with 2 threads and 16 slots; the client runs in
this process. Writes benchmarks/results/serving.json and serving.png; prints a table.

    python -m benchmarks.serving [--requests 24] [--new-tokens 96] [--repeats 2]

`--prefix-cache`: a chat product resends its system prompt and history every turn. A
`--prefix`-token shared prefix (stdlib source, as pyref-7m's training text) followed by
`--requests` (default 8) different `--suffix`-token suffixes, each a greedy streamed
completion of `--new-tokens` (default 8) tokens at batch 1. Two `specx serve` subprocesses on
the same artifact (`--artifact`; default pyref-7m's ORT fp32 build, as above), one with the
default prefix cache and one with `--no-prefix-cache`, receive the same requests in turn
(interleaved request by request, the order alternating); the first request warms each (and
fills the cache). Reports each side's TTFT (first streamed token) median and fastest, their
ratio, the cache's counters from /metrics, and whether both sides returned the same tokens.
Writes benchmarks/results/prefix_cache.json.

    python -m benchmarks.serving --prefix-cache [--artifact DIR] [--prefix 700] [--suffix 20]
        [--requests 8] [--new-tokens 8] [--threads 2]

`--llama-cpp`: pyref-1b int4 under 1-16 clients against llama-server on the same checkpoint
(benchmarks/serving_llama_cpp.py says how).
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.inputs import PYREF_7M, RESULTS, SHARED, load_prompts, log, stdlib_split
from benchmarks.runners import scratch_dir


def artifact(work: Path) -> Path:
    from specx.builders import BuildOptions, build_artifact
    from specx.export.target_export import export_target

    out = export_target(PYREF_7M, work / "pyref-7m", max_context=1024)
    build_artifact(out, BuildOptions("ort", "fp32"))
    return out


class Server:
    """`specx serve` in a subprocess on a free port."""

    def __init__(self, artifact_dir: Path, threads: int, slots: int, *options: str):
        import httpx

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        command = [sys.executable, "-m", "specx.cli", "serve", str(artifact_dir), "--port",
                   str(self.port), "--threads", str(threads), "--slots", str(slots),
                   *options]  # fmt: skip
        self.process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("specx serve did not start")
            time.sleep(0.2)

    def close(self) -> None:  # noqa: D102
        self.process.terminate()
        self.process.wait(timeout=30)


def one_request(url: str, prompt: list[int], drafter: str | None, new_tokens: int) -> dict:
    import httpx

    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "drafter": drafter}  # fmt: skip
    started = time.perf_counter()
    first, tokens, speculative = None, [], {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            payload = line.removeprefix("data: ")
            if not line or payload == "[DONE]":
                continue
            chunk = json.loads(payload)
            ids = chunk["choices"][0]["token_ids"]
            if ids and first is None:
                first = time.perf_counter() - started
            tokens += ids
            speculative = chunk.get("speculative", speculative)
    return {"latency_s": time.perf_counter() - started, "ttft_s": first, "tokens": tokens,
            "acceptance_length": speculative.get("acceptance_length", 1.0)}  # fmt: skip


def run(url, prompts, drafter, concurrency, new_tokens) -> dict:
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(url, p, drafter, new_tokens), prompts))
    wall = time.perf_counter() - started
    latency = sorted(r["latency_s"] for r in results)
    ttft = sorted(r["ttft_s"] for r in results)
    return {
        "throughput_tokens_per_s": sum(len(r["tokens"]) for r in results) / wall,
        "latency_p50_s": statistics.median(latency),
        "latency_p95_s": latency[min(len(latency) - 1, round(0.95 * (len(latency) - 1)))],
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p95_s": ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))],
        "acceptance_length": statistics.mean(r["acceptance_length"] for r in results),
        "wall_s": wall,
        "tokens": [r["tokens"] for r in results],
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["concurrency"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker, color in (("plain", "o", "tab:blue"), ("speculative", "s", "tab:orange")):
        rows = [report["results"][f"{mode} c={c}"] for c in levels]
        left.plot(levels, [r["throughput_tokens_per_s"] for r in rows], marker=marker,
                  color=color, label=mode)  # fmt: skip
        right.plot(levels, [r["latency_p50_s"] for r in rows], marker=marker, color=color,
                   label=f"{mode} p50")  # fmt: skip
        right.plot(levels, [r["latency_p95_s"] for r in rows], marker=marker, color=color,
                   linestyle="--", alpha=0.6, label=f"{mode} p95")  # fmt: skip
    left.set(xlabel="concurrent requests", ylabel="generated tokens / s", xscale="log",
             title="throughput")  # fmt: skip
    right.set(xlabel="concurrent requests", ylabel="request latency (s)", xscale="log",
              title="latency")  # fmt: skip
    for axis in (left, right):
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.legend()
    fig.suptitle(f"specx serve, pyref-7m, {report['drafter']} vs plain (continuous batching)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-cache", action="store_true", help="TTFT, prefix cache on/off")
    parser.add_argument("--llama-cpp", action="store_true", help="pyref-1b vs llama-server")
    parser.add_argument("--drafter-head", default="eagle3", help="--llama-cpp: specx's drafter")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="--llama-cpp: specx serve's --prefill-chunk")  # fmt: skip
    parser.add_argument("--requests", type=int, default=None, help="default 24; 8 for TTFT")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 96; 8 for TTFT")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", default=None, help="default 1,4,16 (1,2,4,8,16)")
    parser.add_argument("--drafter", default="suffix")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--artifact", type=Path, default=None, help="--prefix-cache: served")
    parser.add_argument("--prefix", type=int, default=700, help="--prefix-cache: shared tokens")
    parser.add_argument("--suffix", type=int, default=20, help="--prefix-cache: tokens after")
    parser.add_argument("--out", type=Path, default=None,
                        help="default results/serving.json (prefix_cache.json)")  # fmt: skip
    args = parser.parse_args()
    if not (PYREF_7M / "config.json").is_file():
        log(f"{SHARED} has no pyref-7m; nothing measured")
        return
    if args.llama_cpp:
        from benchmarks.serving_llama_cpp import against_llama_cpp

        args.concurrency = args.concurrency or "1,2,4,8,16"
        against_llama_cpp(args, Server)
    elif args.prefix_cache:
        prefix_cache(args)
    else:
        under_load(args)


def under_load(args: argparse.Namespace) -> None:
    """Plain vs speculative at each concurrency (the module docstring's first paragraph)."""
    args.requests = args.requests or 24
    args.new_tokens = args.new_tokens or 96
    args.out = args.out or RESULTS / "serving.json"
    levels = [int(c) for c in (args.concurrency or "1,4,16").split(",")]
    prompts = load_prompts("humaneval.jsonl", args.requests // 2) + load_prompts(
        "mt_bench.jsonl", args.requests - args.requests // 2
    )
    art = artifact(scratch_dir("specx-serving-"))
    report = {
        "benchmark": "serving",
        "specx_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True).stdout.strip(),
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "requests": len(prompts), "new_tokens": args.new_tokens, "slots": args.slots,
        "drafter": args.drafter, "concurrency": levels, "results": {},
    }  # fmt: skip
    for c in levels:
        best: dict[str, dict] = {}
        for r in range(args.repeats):
            modes = [("plain", None), ("speculative", args.drafter)]
            for mode, drafter in modes if r % 2 == 0 else modes[::-1]:
                server = Server(art, args.threads, args.slots)
                try:
                    result = run(server.url, prompts, drafter, c, args.new_tokens)
                finally:
                    server.close()
                log(f"c={c} {mode}: {result['throughput_tokens_per_s']:.0f} tokens/s, p50 "
                    f"{result['latency_p50_s']:.2f}s")  # fmt: skip
                if mode not in best or (result["throughput_tokens_per_s"]
                                        > best[mode]["throughput_tokens_per_s"]):  # fmt: skip
                    best[mode] = result
        identical = best["plain"]["tokens"] == best["speculative"]["tokens"]
        for mode, result in best.items():
            result.pop("tokens")
            report["results"][f"{mode} c={c}"] = {**result, "identical_to_plain": identical}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print("| concurrency | mode | tokens/s | latency p50 / p95 (s) | TTFT p50 / p95 (s) | "
          "acceptance length | identical |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for key, row in report["results"].items():
        mode, c = key.split(" c=")
        print(f"| {c} | {mode} | {row['throughput_tokens_per_s']:.0f} | "
              f"{row['latency_p50_s']:.2f} / {row['latency_p95_s']:.2f} | "
              f"{row['ttft_p50_s']:.3f} / {row['ttft_p95_s']:.3f} | "
              f"{row['acceptance_length']:.2f} | {row['identical_to_plain']} |")  # fmt: skip


def prefix_prompts(args: argparse.Namespace) -> list[list[int]]:
    """One shared prefix, then a different suffix per request (stdlib text, tokenized)."""
    from specx.runtime.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(PYREF_7M / "tokenizer.json")
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


def prefix_cache(args: argparse.Namespace) -> None:
    """TTFT with the prefix cache on and off (the module docstring's `--prefix-cache`)."""
    args.requests = args.requests or 8
    args.new_tokens = args.new_tokens or 8
    args.out = args.out or RESULTS / "prefix_cache.json"
    target = args.artifact or artifact(scratch_dir("specx-prefix-cache-"))
    requests = prefix_prompts(args)
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
