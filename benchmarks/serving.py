"""`specx serve` under load: plain vs speculative continuous batching on pyref-7m.

For each concurrency C in --concurrency (default 1, 4, 16): --requests greedy streamed
completions (half HumanEval, half mt_bench prompts, --new-tokens each, eos ignored) sent by
C client threads that each start the next request as soon as their last one ends; once
with plain decoding ("drafter": null) and once with --drafter (default suffix), each on a
freshly started `specx serve` subprocess (so the suffix drafter has seen only that run's
earlier requests), modes alternating, --repeats runs each, the run with the highest
throughput kept. Reports throughput (generated tokens / wall time), request latency
p50/p95, time to first token p50/p95, and whether both modes' tokens were identical.

    python benchmarks/serving.py [--requests 24] [--new-tokens 96] [--repeats 2]

The server runs the ORT-lowered fp32 build with 2 threads and 16 slots; the client runs in
this process. Writes benchmarks/results/serving.json and serving.png; prints a table.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import SHARED, load_prompts  # noqa: E402
from runners import scratch_dir  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def artifact(work: Path) -> Path:
    from specx.build import BuildOptions, build_artifact
    from specx.export.target_export import export_target

    out = export_target(SHARED / "models" / "pyref-7m", work / "pyref-7m", max_context=1024)
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
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--drafter", default="suffix")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serving.json"))
    args = parser.parse_args()
    if not (SHARED / "models" / "pyref-7m" / "config.json").is_file():
        log(f"{SHARED} has no pyref-7m; nothing measured")
        return
    levels = [int(c) for c in args.concurrency.split(",")]
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


if __name__ == "__main__":
    main()
