"""specx vs onnxruntime-genai (and transformers) on the same weights, measured the same way.

Every runner decodes each prompt greedily for exactly --new-tokens tokens, in one process,
interleaved prompt by prompt, fastest of --repeats per prompt (`runners.interleave`);
decode ms/token (every token after the first) and total ms/token (prefill included) are
reported apart. Outputs are compared token for token with genai's.

Sections:
- plain: pyref-7m, the 27.5M random Llama (bench-27m) and pyref-deep (32 layers), fp32 and
  int4: specx's exported graphs, specx's lowered ORT build (`specx build --backend ort`),
  genai's builder output (-p fp32 / -p int4), transformers eager (fp32, first model only).
- model-free: pyref-7m fp32, HumanEval and mt_bench prompts: genai's n-gram mode
  (ngram_size 3, 6 draft tokens, chained lookup) vs specx's n-gram chain and suffix
  drafter. The suffix drafter is measured cold (no earlier requests) and warm (it has
  decoded the set's earlier prompts, never the one being timed).
- verify: t(N)/t(1) of one target forward over N tokens at 256 cached tokens, exported vs
  lowered, pyref-7m and bench-27m.

    python -m benchmarks.peers [--prompts 12] [--new-tokens 128] [--repeats 3]
        [--sections plain,model-free,verify] [--work ~/.cache/specx/peers]

Needs onnxruntime-genai and ../shared (prompts, pyref-7m); writes benchmarks/results/
peers.json and prints a markdown summary. Builds are cached under --work.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.inputs import PYREF_7M, RESULTS, SHARED, load_prompts, log
from benchmarks.runners import (
    GenaiNgram,
    GenaiPlain,
    SpecxPlain,
    SpecxSpeculative,
    Summary,
    Timing,
    interleave,
)

PROMPT_SETS = {"humaneval": "humaneval.jsonl", "mt_bench": "mt_bench.jsonl"}


@dataclass(frozen=True)
class Case:
    """One model: its HF checkpoint, the specx artifact and genai's builds of it."""

    name: str
    checkpoint: Path
    artifact: Path
    genai: dict[str, Path]  # precision -> genai model directory


def prepare(name: str, checkpoint: Path, work: Path) -> Case:
    """Exports, builds (ort-fp32, ort-int4) and runs genai's builder once; cached in `work`."""
    from specx.artifact import load_manifest
    from specx.builders import BuildOptions, build_artifact
    from specx.export.target_export import export_target

    artifact = work / name / "artifact"
    if not (artifact / "manifest.json").is_file():
        log(f"[{name}] exporting")
        export_target(checkpoint, artifact, max_context=1024, progress=log)
    for precision in ("fp32", "int4"):
        if _stale(load_manifest(artifact), precision):
            log(f"[{name}] building ort-{precision}")
            build_artifact(artifact, BuildOptions("ort", precision), progress=log)
    genai = {}
    for precision in ("fp32", "int4"):
        out = work / name / f"genai-{precision}"
        if not (out / "genai_config.json").is_file():
            log(f"[{name}] genai builder -p {precision}")
            command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                       str(checkpoint), "-o", str(out), "-p", precision, "-e", "cpu"]  # fmt: skip
            subprocess.run(command, check=True, capture_output=True)
        genai[precision] = out
    return Case(name, checkpoint, artifact, genai)


def _stale(manifest, precision: str) -> bool:
    """Whether a cached build is missing or quantized otherwise than today's default."""
    from specx.builders import BuildOptions
    from specx.builders.ort import weight_only_config

    build = manifest.builds.get(f"ort-{precision}")
    if build is None or precision != "int4":
        return build is None
    wanted = weight_only_config(manifest, BuildOptions("ort", precision)).record()
    return any(build.quantization.details.get(k) != v for k, v in wanted.items())


class TransformersPlain:
    """transformers eager greedy decoding: one forward per token over its KV cache."""

    def __init__(self, checkpoint: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()

    def __call__(self, prompt: Sequence[int], new_tokens: int) -> Timing:  # noqa: D102
        with self.torch.no_grad():
            started = time.perf_counter()
            out = self.model(self.torch.tensor([list(prompt)]), use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens, prefilled = [int(token)], time.perf_counter()
            for _ in range(new_tokens - 1):
                out = self.model(token, past_key_values=out.past_key_values, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(token))
            done = time.perf_counter()
        return Timing(prefilled - started, done - prefilled, tokens)


def reported(summaries: dict[str, Summary], new_tokens: int, reference: str) -> dict:
    rows = {}
    base = summaries[reference].report(new_tokens)
    for name, summary in summaries.items():
        row = summary.report(new_tokens)
        row["decode_speedup_vs_genai"] = base["decode_ms_per_token"] / row["decode_ms_per_token"]
        row["total_speedup_vs_genai"] = base["total_ms_per_token"] / row["total_ms_per_token"]
        row["tokens_equal_genai"] = summary.tokens == summaries[reference].tokens
        rows[name] = row
    return rows


def plain_section(cases: list[Case], prompts, args) -> dict:
    results = {}
    for i, case in enumerate(cases):
        for precision in ("fp32", "int4"):
            log(f"plain: {case.name} {precision}")
            runners = {"onnxruntime-genai": GenaiPlain(case.genai[precision], args.threads)}
            if precision == "fp32":
                runners["specx exported"] = SpecxPlain(case.artifact, None, args.threads)
            runners["specx lowered build"] = SpecxPlain(
                case.artifact, f"ort-{precision}", args.threads
            )
            if precision == "fp32" and i == 0:
                runners["transformers eager"] = TransformersPlain(case.checkpoint, args.threads)
            summaries = interleave(runners, prompts, args.new_tokens, args.repeats)
            results[f"{case.name} {precision}"] = reported(
                summaries, args.new_tokens, "onnxruntime-genai"
            )
    return results


def model_free_section(case: Case, args) -> dict:
    from specx.artifact import load_manifest
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.targets import open_decoder

    target = open_decoder(load_manifest(case.artifact).with_build("ort-fp32"), threads=args.threads)
    results = {}
    for set_name, file in PROMPT_SETS.items():
        log(f"model-free: {case.name} {set_name}")
        prompts = load_prompts(file, args.prompts)
        outputs = [generate_plain(target, [p], args.new_tokens).tokens[0] for p in prompts]
        spec = specx_drafting(target, prompts, outputs)
        runners = {
            "onnxruntime-genai ngram": GenaiNgram(case.genai["fp32"], args.threads),
            "onnxruntime-genai plain": GenaiPlain(case.genai["fp32"], args.threads),
            "specx plain (lowered)": SpecxPlain(case.artifact, "ort-fp32", args.threads),
            **spec,
        }
        summaries = interleave(runners, prompts, args.new_tokens, args.repeats)
        rows = reported(summaries, args.new_tokens, "onnxruntime-genai ngram")
        for name, runner in spec.items():
            stats = [runner.stats[tuple(p)] for p in prompts]
            rows[name]["acceptance_length"] = statistics.mean(
                s.acceptance.acceptance_length for s in stats
            )
            rows[name]["mean_draft_ms_per_round"] = statistics.mean(
                1e3 * s.draft_s / max(s.acceptance.rounds, 1) for s in stats
            )
        results[set_name] = rows
    return results


def specx_drafting(target, prompts, outputs) -> dict[str, SpecxSpeculative]:
    """specx's model-free drafters; warm suffix drafting knows the prompts before each one."""
    from specx.runtime.drafters.ngram import NGramDrafter
    from specx.runtime.drafters.suffix import SuffixDrafter, SuffixOptions, SuffixTrie

    options = SuffixOptions()
    earlier: dict[tuple[int, ...], SuffixTrie] = {}
    for i, prompt in enumerate(prompts):  # the shared memory a process would have by then
        trie = SuffixTrie(options.depth)
        for p, o in zip(prompts[:i], outputs[:i], strict=True):
            trie.new_document()
            trie.extend(p + o)
        earlier[tuple(prompt)] = trie
    return {
        "specx ngram chain 6": SpecxSpeculative(target, lambda prompt: NGramDrafter(6, 1, 3)),
        "specx suffix (cold)": SpecxSpeculative(target, lambda prompt: SuffixDrafter(options)),
        "specx suffix (warm)": SpecxSpeculative(
            target, lambda prompt: SuffixDrafter(options, shared=earlier[tuple(prompt)])
        ),
    }


def verify_section(cases: list[Case], args) -> dict:
    from specx.artifact import load_manifest
    from specx.masks import causal_mask
    from specx.runtime.targets import open_decoder

    curves = {}
    for case in cases:
        for label, build in (("exported", None), ("lowered", "ort-fp32")):
            manifest = load_manifest(case.artifact).with_build(build)
            target = open_decoder(manifest, threads=args.threads)
            cache = target.allocate_cache(1, 256 + 64)
            times = {}
            for n in (1, 2, 4, 8, 16, 32, 64):
                write_pos = np.array([256])
                inputs = (
                    np.ones((1, n), np.int64),
                    (256 + np.arange(n))[None],
                    causal_mask(write_pos, n, 256 + n),
                    write_pos,
                )
                runs = []
                for _ in range(30):
                    started = time.perf_counter()
                    target.forward(cache, *inputs)
                    runs.append(time.perf_counter() - started)
                times[n] = min(runs)
            curves[f"{case.name} {label}"] = {
                "ms": {n: 1e3 * t for n, t in times.items()},
                "ratio": {n: t / times[1] for n, t in times.items()},
            }
    return curves


def checkpoint_for(name: str, work: Path) -> Path | None:
    """The model's HF checkpoint (bench-27m written on first use), or None when absent."""
    from specx.export.random_checkpoint import write_random_checkpoint

    if name == "pyref-7m":
        return PYREF_7M
    if name == "pyref-deep":
        path = Path.home() / ".cache" / "specx" / "pyref-deep"
        return path if (path / "config.json").is_file() else None
    if name == "bench-27m":
        path = work / "bench-27m" / "hf"
        if not (path / "config.json").is_file():
            write_random_checkpoint(path, "llama", "bench-27m", seed=0)
        return path
    raise SystemExit(f"unknown model {name!r}: pyref-7m, bench-27m or pyref-deep")


def cases_for(names: list[str], work: Path) -> list[Case]:
    cases = []
    for name in names:
        checkpoint = checkpoint_for(name, work)
        if checkpoint is None:
            log(f"{name} is missing (python -m benchmarks.models.pyref_deep writes it): skipped")
            continue
        cases.append(prepare(name, checkpoint, work))
    return cases


def markdown(report: dict) -> str:
    lines = []
    for section in ("plain", "model_free"):
        for key, rows in report.get(section, {}).items():
            lines.append(f"\n{section} — {key}\n")
            lines.append("| runner | decode ms/tok | total ms/tok | decode vs genai | = genai |")
            lines.append("|---|---|---|---|---|")
            for name, row in rows.items():
                lines.append(
                    f"| {name} | {row['decode_ms_per_token']:.3f} | "
                    f"{row['total_ms_per_token']:.3f} | {row['decode_speedup_vs_genai']:.2f}x | "
                    f"{row['tokens_equal_genai']} |"
                )
    for key, curve in report.get("verify", {}).items():
        ratios = ", ".join(f"{n}: {r:.2f}" for n, r in curve["ratio"].items())
        lines.append(f"\nverify t(N)/t(1) {key}: {ratios}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="pyref-7m,bench-27m,pyref-deep")
    parser.add_argument("--sections", default="plain,model-free,verify")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "specx" / "peers")
    parser.add_argument("--out", type=Path, default=RESULTS / "peers.json")
    args = parser.parse_args()
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        log("onnxruntime-genai is not installed: pip install onnxruntime-genai; nothing measured")
        return
    if not (PYREF_7M / "config.json").is_file():
        log(f"{SHARED} has no pyref-7m or prompts; nothing measured")
        return
    sections = set(args.sections.split(","))
    cases = cases_for(args.models.split(","), args.work)
    report: dict = {
        "benchmark": "peers",
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "specx_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
    }
    if "plain" in sections:
        report["plain"] = plain_section(cases, load_prompts("humaneval.jsonl", args.prompts), args)
    if "model-free" in sections:
        report["model_free"] = model_free_section(cases[0], args)
    if "verify" in sections:
        report["verify"] = verify_section([c for c in cases if c.name != "pyref-deep"], args)
    if args.out.is_file():  # sections not measured this time keep their last results
        report = {**json.loads(args.out.read_text()), **report}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
