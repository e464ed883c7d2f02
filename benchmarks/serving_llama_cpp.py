"""`python -m benchmarks.serving --llama-cpp`: `specx serve` against llama-server under load.

pyref-1b int4 on both sides: specx serves its EAGLE-3 artifact's default build (`--artifact`,
edge.py's, `--drafter eagle3`: the artifact's head), llama.cpp its own Q4_0 file of the same
checkpoint with continuous batching (`-np C`, a 1,024-token context a slot). For each
concurrency C in `--concurrency` both servers start fresh with C slots (prompt caching off on
both: `--no-prefix-cache`; `--cache-ram 0` and `cache_prompt: false`) and C client threads
on 127.0.0.1 send `--requests` greedy streamed completions (HumanEval prompts, `--new-tokens`
each, end of text ignored), each thread starting its next request when its last one ends;
the servers take turns level by level (llama.cpp first at odd levels), each warmed by one
short request a client first.

Reported per server and level: output tokens/s over the wall time, time to first token p50 /
p99, inter-token latency p50 / p99 (a chunk's wait spread over its tokens), and whether every
specx output equals specx's own plain decoding of the prompt (computed in this process
first); llama.cpp's outputs are compared with specx's (other arithmetic: agreement, not
identity). Then specx's engine in this process (`specx.load(...).generate` with the same
drafter) against a one-slot server, taking turns prompt by prompt, fastest of `--repeats`
each: tokens/s alike, prefill included.
Writes benchmarks/results/serving_llama_cpp.json.

    python -m benchmarks.serving --llama-cpp [--concurrency 1,2,4,8,16] [--requests 16]
        [--new-tokens 64]
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.inputs import RESULTS, load_prompts, log
from benchmarks.runners import LlamaServer

CACHE = Path.home() / ".cache" / "specx"
ARTIFACT = CACHE / "edge" / "specx" / "eagle3"
GGUF = CACHE / "llama.cpp" / "models" / "pyref-1b-q4_0.gguf"
LLAMA_BIN = CACHE / "llama.cpp" / "build" / "bin"


@dataclass
class Streamed:
    """One streamed request: when it started and when each chunk's tokens came."""

    started: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in chunk)
    tokens: list[int] = field(default_factory=list)

    def take(self, ids: list[int]) -> None:  # noqa: D102
        if ids:
            self.arrivals.append((time.perf_counter(), len(ids)))
            self.tokens += ids


def specx_request(url: str, prompt: list[int], new_tokens: int) -> Streamed:
    """A greedy completion from `specx serve` (its default drafter), streamed."""
    import httpx

    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    out = Streamed(time.perf_counter())
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            payload = line.removeprefix("data: ")
            if line and payload != "[DONE]":
                out.take(json.loads(payload)["choices"][0]["token_ids"])
    return out


def llama_request(url: str, prompt: list[int], new_tokens: int) -> Streamed:
    """A greedy completion from llama-server's /completion, streamed, token ids returned."""
    import httpx

    body = {"prompt": prompt, "n_predict": new_tokens, "ignore_eos": True, "temperature": 0.0,
            "cache_prompt": False, "return_tokens": True, "stream": True}  # fmt: skip
    out = Streamed(time.perf_counter())
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.take([int(t) for t in json.loads(line[6:]).get("tokens", [])])
    return out


def percentile(values: list[float], q: float) -> float:  # noqa: D103
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def load(request, url: str, prompts: list[list[int]], clients: int, new_tokens: int) -> dict:
    """`prompts` sent by `clients` threads; throughput, TTFT and inter-token latency.

    The server is warmed first by `clients` short requests at once (its weights paged in,
    each slot used, a speculative server's round costs timed), untimed, as a server that
    has run a while is.
    """
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda p: request(url, p, 8), prompts[:clients]))
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: request(url, p, new_tokens), prompts))
    wall = time.perf_counter() - started
    ttft = [r.arrivals[0][0] - r.started for r in results]
    gaps = [
        (t - before) / n
        for r in results
        for (before, _), (t, n) in zip(r.arrivals, r.arrivals[1:], strict=False)
        for _ in range(n)
    ]
    return {
        "tokens_per_s": sum(len(r.tokens) for r in results) / wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * statistics.median(gaps),
        "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
        "wall_s": wall,
        "tokens": [r.tokens for r in results],
    }


def plain_outputs(engine, prompts, new_tokens: int) -> list[list[int]]:
    """specx's own plain decoding of each prompt: what every server output must equal."""
    return [engine.generate(p, max_new_tokens=new_tokens, ignore_eos=True).tokens
            for p in prompts]  # fmt: skip


def engine_vs_server(engine, url: str, prompts, new_tokens: int, drafter: str, repeats: int,
                     plain: list[list[int]]) -> dict:  # fmt: skip
    """The engine in this process and a one-slot server, prompt by prompt, taking turns
    (which goes first alternates), each prompt's fastest of `repeats`: tokens/s of each,
    request to last token, prefill included on both sides."""
    best = {"engine": [float("inf")] * len(prompts), "server": [float("inf")] * len(prompts)}
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            for side in ("engine", "server") if (r + i) % 2 == 0 else ("server", "engine"):
                started = time.perf_counter()
                if side == "engine":
                    tokens = engine.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True,
                                             speculation=drafter).tokens  # fmt: skip
                else:
                    tokens = specx_request(url, prompt, new_tokens).tokens
                best[side][i] = min(best[side][i], time.perf_counter() - started)
                assert tokens == plain[i], f"{side}'s output left plain decoding's on prompt {i}"
    rates = {side: len(prompts) * new_tokens / sum(times) for side, times in best.items()}
    return {"engine_tokens_per_s": rates["engine"], "server_tokens_per_s": rates["server"],
            "server_vs_engine": rates["server"] / rates["engine"], "repeats": repeats}  # fmt: skip


def against_llama_cpp(args, specx_server) -> None:
    """The module docstring's run; `specx_server` starts `specx serve` (serving.Server)."""
    artifact, levels = args.artifact or ARTIFACT, [int(c) for c in args.concurrency.split(",")]
    requests, new_tokens = args.requests or 16, args.new_tokens or 64
    for needed in (artifact, GGUF, LLAMA_BIN / "llama-server"):
        if not needed.exists():
            raise SystemExit(f"{needed} is missing: benchmarks.edge and benchmarks.llama_cpp")
    prompts = load_prompts("humaneval.jsonl", requests)
    import specx

    log(f"{len(prompts)} prompts x {new_tokens} tokens: specx's plain outputs")
    engine = specx.load(artifact, threads=args.threads)
    plain = plain_outputs(engine, prompts, new_tokens)
    report = {
        "benchmark": "serving_llama_cpp",
        "specx_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True).stdout.strip(),
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "artifact": str(artifact), "gguf": str(GGUF), "drafter": args.drafter_head,
        "requests": len(prompts), "new_tokens": new_tokens,
        "prefill_chunk": args.prefill_chunk,
        "levels": {},
    }  # fmt: skip
    for i, clients in enumerate(levels):
        row = {}
        order = ("specx", "llama.cpp") if i % 2 == 0 else ("llama.cpp", "specx")
        for side in order:
            if side == "specx":
                chunk = () if args.prefill_chunk is None else ("--prefill-chunk",
                                                               str(args.prefill_chunk))  # fmt: skip
                server = specx_server(artifact, args.threads, clients, "--drafter",
                                      args.drafter_head, "--no-prefix-cache", *chunk)  # fmt: skip
                try:
                    row[side] = load(specx_request, server.url, prompts, clients, new_tokens)
                finally:
                    server.close()
            else:
                with LlamaServer(LLAMA_BIN, GGUF, args.threads, slots=clients) as llama:
                    url = f"http://127.0.0.1:{llama.port}"
                    row[side] = load(llama_request, url, prompts, clients, new_tokens)
        outputs = {side: row[side].pop("tokens") for side in row}
        row["specx_equal_to_plain"] = outputs["specx"] == plain
        agree = [a == b for a, b in zip(outputs["llama.cpp"], plain, strict=True)]
        row["llama_cpp_equal_to_specx_plain"] = sum(agree)
        specx_rate, llama_rate = row["specx"]["tokens_per_s"], row["llama.cpp"]["tokens_per_s"]
        row["ratio_tokens_per_s"] = specx_rate / llama_rate
        report["levels"][str(clients)] = row
        log(f"c={clients}: specx {specx_rate:.1f} tok/s, llama.cpp {llama_rate:.1f} "
            f"({row['ratio_tokens_per_s']:.2f}x)")  # fmt: skip
    log("the engine against a one-slot server, prompt by prompt")
    server = specx_server(artifact, args.threads, 1, "--drafter", args.drafter_head,
                          "--no-prefix-cache")  # fmt: skip
    try:
        specx_request(server.url, prompts[0], 8)  # warmed, as the levels' servers are
        report["one_client"] = engine_vs_server(engine, server.url, prompts, new_tokens,
                                                args.drafter_head, args.repeats, plain)  # fmt: skip
    finally:
        server.close()
    out = args.out or RESULTS / "serving_llama_cpp.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print("| clients | specx tok/s | llama.cpp tok/s | ratio | TTFT p50/p99 s, specx vs llama.cpp "
          "| ITL p50/p99 ms, specx vs llama.cpp | specx == plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for c, row in report["levels"].items():
        s, p = row["specx"], row["llama.cpp"]
        print(f"| {c} | {s['tokens_per_s']:.1f} | {p['tokens_per_s']:.1f} | "
              f"{row['ratio_tokens_per_s']:.2f}x | {s['ttft_p50_s']:.2f}/{s['ttft_p99_s']:.2f} vs "
              f"{p['ttft_p50_s']:.2f}/{p['ttft_p99_s']:.2f} | {s['itl_p50_ms']:.0f}/"
              f"{s['itl_p99_ms']:.0f} vs {p['itl_p50_ms']:.0f}/{p['itl_p99_ms']:.0f} | "
              f"{row['specx_equal_to_plain']} |")  # fmt: skip
    one = report["one_client"]
    print(f"one client, interleaved: engine {one['engine_tokens_per_s']:.1f} tok/s, server "
          f"{one['server_tokens_per_s']:.1f} ({one['server_vs_engine']:.3f}x)")  # fmt: skip
