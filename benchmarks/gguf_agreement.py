"""A llama.cpp GGUF file through specx: greedy agreement with llama.cpp, and speed.

The file is pyref-1b at Q4_0, as llama.cpp's converter and llama-quantize made it
(benchmarks/llama_cpp.py). `specx export FILE` then `specx build --backend cpu --precision
int4` keeps its codes and scales (specx.builders.grid); that build decodes greedily beside
llama.cpp's `llama-server` on the same file, specx's own export of the HF checkpoint (its
cpu-int4 build, rounded by specx), and the float graphs of both exports (the GGUF's
de-quantized weights; the HF checkpoint's own), so each pair's agreement is read against
what quantizing alone moves.

Agreement per pair: how many prompts give the same `--new-tokens` tokens, and the mean
position of the first difference (`--new-tokens` where none). Decode ms/token (fastest of
`--repeats`, interleaved prompt by prompt) for the three int4 runners.

    python -m benchmarks.gguf_agreement [--prompts 8] [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from benchmarks.inputs import PYREF_7M, RESULTS, log, prompts_for
from benchmarks.runners import LlamaCompletion, LlamaServer, SpecxPlain, interleave

CACHE = Path.home() / ".cache" / "specx"
PAIRS = (
    ("llama.cpp Q4_0", "specx gguf cpu-int4"),
    ("specx gguf cpu-int4", "specx gguf fp32"),
    ("specx gguf fp32", "specx hf fp32"),
    ("specx hf cpu-int4", "specx hf fp32"),
    ("llama.cpp Q4_0", "specx hf cpu-int4"),
)


def exported(gguf: Path, artifact: Path) -> Path:
    """The GGUF's artifact with its cpu-int4 build (made once, reused)."""
    if not (artifact / "manifest.json").is_file():
        log(f"exporting {gguf}")
        subprocess.run([sys.executable, "-m", "specx.cli", "export", str(gguf), "-o",
                        str(artifact), "--no-build"], check=True)  # fmt: skip
    builds = artifact / "builds"
    if not builds.is_dir() or not any(p.name.startswith("cpu-int4") for p in builds.iterdir()):
        log("building cpu-int4 (the GGUF's codes kept)")
        subprocess.run([sys.executable, "-m", "specx.cli", "build", str(artifact), "--backend",
                        "cpu", "--precision", "int4"], check=True)  # fmt: skip
    return artifact


def agreement(a: list[list[int]], b: list[list[int]], new_tokens: int) -> dict:
    """Same outputs out of all, and the mean first differing position."""
    firsts = [
        next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), new_tokens)
        for p, q in zip(a, b, strict=True)
    ]
    return {
        "identical": sum(f == new_tokens for f in firsts),
        "prompts": len(firsts),
        "mean_first_difference": sum(firsts) / len(firsts),
        "first_differences": firsts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=CACHE / "llama.cpp/models/pyref-1b-q4_0.gguf")
    parser.add_argument("--llama-bin", type=Path, default=CACHE / "llama.cpp/build/bin")
    parser.add_argument("--hf-artifact", type=Path, default=CACHE / "edge/specx/plain")
    parser.add_argument("--work", type=Path, default=CACHE / "gguf")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", type=Path, default=RESULTS / "gguf_agreement.json")
    args = parser.parse_args()
    for needed in (args.gguf, args.llama_bin / "llama-server", args.hf_artifact, PYREF_7M):
        if not needed.exists():
            sys.exit(f"{needed} is missing: python -m benchmarks.llama_cpp makes the GGUF")
    from specx.artifact import load_manifest
    from specx.runtime.tokenizer import TextTokenizer

    artifact = exported(args.gguf, args.work / "pyref-1b-q4_0")
    prompts = prompts_for(TextTokenizer(PYREF_7M / "tokenizer.json"), args.prompts)[: args.prompts]
    log(f"{len(prompts)} prompts x {args.new_tokens} tokens, greedy")
    tokens: dict[str, list[list[int]]] = {}
    with LlamaServer(args.llama_bin, args.gguf, args.threads) as server:
        timed = {
            "llama.cpp Q4_0": LlamaCompletion(server),
            "specx gguf cpu-int4": SpecxPlain(artifact, "cpu-int4", args.threads),
            "specx hf cpu-int4": SpecxPlain(args.hf_artifact, "cpu-int4", args.threads),
        }
        summaries = interleave(timed, prompts, args.new_tokens, args.repeats)
    speed = {name: s.report(args.new_tokens) for name, s in summaries.items()}
    tokens |= {name: s.tokens for name, s in summaries.items()}
    for name, path in (("specx gguf fp32", artifact), ("specx hf fp32", args.hf_artifact)):
        log(f"{name}: the exported float graphs")
        tokens[name] = interleave({name: SpecxPlain(path, None, args.threads)}, prompts,
                                  args.new_tokens, 1)[name].tokens  # fmt: skip
    report = {
        "benchmark": "gguf_agreement",
        "gguf": str(args.gguf),
        "kept_grid": load_manifest(artifact)
        .builds["cpu-int4"]
        .quantization.details.get("kept_grid"),
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "decode": speed,
        "agreement": {
            f"{a} vs {b}": agreement(tokens[a], tokens[b], args.new_tokens) for a, b in PAIRS
        },  # fmt: skip
    }
    assert all(len(t) == len(prompts) for t in tokens.values())
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for pair, row in report["agreement"].items():
        print(f"{pair}: {row['identical']}/{row['prompts']} identical, first difference at "
              f"{row['mean_first_difference']:.1f} on average")  # fmt: skip
    for name, row in speed.items():
        print(f"{name}: decode {row['decode_ms_per_token']:.1f} ms/token")


if __name__ == "__main__":
    main()
