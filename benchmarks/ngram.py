"""N-gram (prompt lookup) speculation vs plain decoding, and vs transformers' prompt lookup.

Same run, same weights (the trained pyref-7m reference target), batch 1:
- copy-heavy prompts: news articles to summarise (`shared/data/eval/sum.jsonl`);
- free-form prompts: open chat questions (`shared/data/eval/mt_bench.jsonl`);
- code prompts: HumanEval stubs (`shared/data/eval/humaneval.jsonl`), in-domain.

    python benchmarks/ngram.py [--prompts 20] [--new-tokens 96] [--threads 2]

Writes benchmarks/results/ngram.json; skips (exit 0, a message) when shared/ is absent.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from runners import scratch_dir

if TYPE_CHECKING:
    from specx.runtime.metrics import RunStats

SHARED = Path(__file__).resolve().parents[2] / "shared"
CATEGORIES = {"copy-heavy": "sum.jsonl", "free-form": "mt_bench.jsonl", "code": "humaneval.jsonl"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_prompts(path: Path, tokenizer, count: int, max_tokens: int) -> list[list[int]]:
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines()[:count]:
        text = json.loads(line)["turns"][0]
        prompts.append(tokenizer.encode(text)[:max_tokens])
    return prompts


def mean_stats(results: list[RunStats]) -> dict:
    out = {
        "ms_per_token": float(np.mean([r.ms_per_token for r in results])),
        "tokens_per_s": float(np.mean([r.tokens_per_s for r in results])),
    }
    spec = [r.speculative for r in results if r.speculative is not None]
    if not spec:
        return out
    acceptance = [s.acceptance for s in spec]
    out |= {
        "acceptance_length": float(np.mean([a.acceptance_length for a in acceptance])),
        "draft_s": float(np.mean([s.draft_s for s in spec])),
        "verify_s": float(np.mean([s.verify_s for s in spec])),
        "rounds": float(np.mean([a.rounds for a in acceptance])),
    }
    depth = max(len(a.acceptance_by_position) for a in acceptance)
    out["acceptance_by_position"] = [
        float(
            np.mean(
                [
                    a.acceptance_by_position[d]
                    for a in acceptance
                    if len(a.acceptance_by_position) > d
                ]
            )
        )
        for d in range(depth)
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--draft-tokens", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ngram.json"))
    args = parser.parse_args()
    model_dir = SHARED / "models" / "pyref-7m"
    if not (model_dir / "model.safetensors").is_file() or not (SHARED / "data" / "eval").is_dir():
        log(f"skipped: {model_dir} or {SHARED / 'data' / 'eval'} is absent")
        return

    import torch
    from transformers import AutoModelForCausalLM

    from specx.artifact import load_manifest
    from specx.export.target_export import export_target
    from specx.runtime.drafters.ngram import NGramDrafter
    from specx.runtime.ort_target import OrtTarget
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.speculative_decoding import generate_speculative
    from specx.runtime.tokenizer import TextTokenizer

    torch.set_num_threads(args.threads)
    work = scratch_dir("specx-ngram-")
    log("[1/3] exporting pyref-7m")
    artifact = export_target(model_dir, work / "artifact", max_context=1024, progress=log)
    target = OrtTarget(load_manifest(artifact), threads=args.threads)
    tokenizer = TextTokenizer(artifact / "tokenizer.json")
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    drafter = NGramDrafter(args.draft_tokens, min_n=1, max_n=3)
    report = {
        "benchmark": "ngram",
        "target": "pyref-7m (trained Llama, 7M parameters)",
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "prompts_per_category": args.prompts,
        "new_tokens": args.new_tokens,
        "drafter": {"name": "ngram", "num_draft_tokens": args.draft_tokens, "n": [1, 3]},
        "results": {},
    }
    log("[2/3] specx plain vs ngram, transformers plain vs prompt lookup")
    for category, file in CATEGORIES.items():
        prompts = load_prompts(
            SHARED / "data" / "eval" / file, tokenizer, args.prompts, args.prompt_tokens
        )
        for label, sampling in (
            ("greedy", SamplingParams()),
            ("T=0.7", SamplingParams(temperature=0.7, seed=0)),
        ):
            plain, spec, identical = [], [], True
            for prompt in prompts:
                a = generate_plain(target, [prompt], args.new_tokens, sampling)
                b = generate_speculative(target, drafter, [prompt], args.new_tokens, sampling)
                plain.append(a.stats)
                spec.append(b.stats)
                identical &= a.tokens == b.tokens
            hf_plain, hf_pld, hf_identical = [], [], True
            for prompt in prompts:
                ids = torch.tensor([prompt])
                kwargs = dict(
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    pad_token_id=0,
                    do_sample=not sampling.greedy,
                )
                if not sampling.greedy:
                    kwargs.update(temperature=sampling.temperature, top_k=0)
                timings = []
                outputs = []
                for extra in ({}, {"prompt_lookup_num_tokens": args.draft_tokens}):
                    torch.manual_seed(0)
                    with torch.no_grad():
                        started = time.perf_counter()
                        out = hf.generate(ids, **kwargs, **extra)
                        timings.append(time.perf_counter() - started)
                    outputs.append(out[0, len(prompt) :].tolist())
                hf_plain.append(1e3 * timings[0] / args.new_tokens)
                hf_pld.append(1e3 * timings[1] / args.new_tokens)
                hf_identical &= outputs[0] == outputs[1]
            specx_plain, specx_spec = mean_stats(plain), mean_stats(spec)
            entry = {
                "specx_plain": specx_plain,
                "specx_ngram": specx_spec,
                "specx_speedup": specx_plain["ms_per_token"] / specx_spec["ms_per_token"],
                "draft_cost_c": (specx_spec["draft_s"] / specx_spec["rounds"])
                / (specx_plain["ms_per_token"] / 1e3),
                "transformers_plain_ms_per_token": float(np.mean(hf_plain)),
                "transformers_prompt_lookup_ms_per_token": float(np.mean(hf_pld)),
                "transformers_speedup": float(np.mean(hf_plain) / np.mean(hf_pld)),
                "specx_ngram_vs_transformers_prompt_lookup": float(
                    np.mean(hf_pld) / specx_spec["ms_per_token"]
                ),
            }
            if sampling.greedy:
                entry["specx_identical_to_plain"] = identical
                entry["transformers_identical_to_plain"] = hf_identical
            report["results"][f"{category}/{label}"] = entry
            log(
                f"  {category}/{label}: acceptance length {specx_spec['acceptance_length']:.2f}, "
                f"specx {entry['specx_speedup']:.2f}x, "
                f"transformers {entry['transformers_speedup']:.2f}x"
            )
    log("[3/3] writing report")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
