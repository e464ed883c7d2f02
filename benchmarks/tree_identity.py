"""How often greedy tree speculation departs from the same build's plain decoding.

For each build of an artifact (with an EAGLE-3 head) and each tree shape: every prompt is
decoded plainly and with the head's tree (no controller: the whole tree every round), and the
first token where the two differ is a *mismatch*. Tokens are counted up to and including it
(what follows a mismatch is another continuation, not another mismatch), so the rate is
mismatches per 10,000 tokens compared. A chain is the control: quantized builds keep chains
identical by row invariance (docs/builds.md).

    python -m benchmarks.tree_identity ART [--builds ort-int4,openvino-int4] [--prompts 40]
        [--new-tokens 96] [--shapes "chain:4;dynamic:16,8,2;dynamic:16,5,4;dynamic:32,6,4"]
        [--out benchmarks/results/tree_identity.json]

Timing plays no part there, so it may share the machine with other work. `--timed N` instead
times each shape against the build's plain decoding (fastest of N per prompt, interleaved
prompt by prompt, the head's whole tree every round, the drafter reused as `Engine` pools it;
decode and total ms/token, tau, the target's verify per width inside the loop, the drafting
time per round and the head's prefill per request apart): run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.inputs import RESULTS, prompts_for
from benchmarks.runners import SpecxPlain, SpecxSpeculative, calls_ms, interleave

SHAPES = "chain:4;dynamic:16,8,2;dynamic:16,5,4;dynamic:32,6,4"


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, file=sys.stderr, flush=True)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (None: identical)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def measure(engine, prompts, new_tokens: int, shape: str, plain: list[list[int]]) -> dict:
    from specx import Speculation

    speculation = Speculation("eagle3", tree=shape, adaptive=False)
    compared = mismatches = 0
    where = []
    tau = []
    for prompt, expected in zip(prompts, plain, strict=True):
        done = engine.generate(
            prompt, max_new_tokens=new_tokens, ignore_eos=True, speculation=speculation
        )
        differs = first_difference(done.tokens, expected)
        compared += len(expected) if differs is None else differs + 1
        if differs is not None:
            mismatches += 1
            where.append(differs)
        tau.append(done.stats.acceptance_length)
    return {
        "prompts": len(prompts),
        "tokens_compared": compared,
        "mismatches": mismatches,
        "per_10k_tokens": round(1e4 * mismatches / compared, 2),
        "first_mismatch_at": where,
        "acceptance_length": round(sum(tau) / len(tau), 3),
    }


def timed(artifact: Path, build: str, prompts, new_tokens: int, shapes, repeats, threads) -> dict:
    """Each shape against plain decoding on `build`, interleaved (see the module docstring)."""
    from specx.artifact import load_manifest
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.targets import open_decoder
    from specx.runtime.tree_shapes import parse_tree_spec

    def factory(shape: str):  # made once: a head learns nothing across requests
        options = DrafterOptions(tree=parse_tree_spec(shape))
        return lambda prompt: make_drafter("eagle3", target, options)

    target = open_decoder(load_manifest(artifact).with_build(build), threads=threads)
    runners = {"plain": SpecxPlain(artifact, build, threads)}
    runners |= {s: SpecxSpeculative(target, factory(s)) for s in shapes}
    summaries = interleave(runners, prompts, new_tokens, repeats)
    plain = summaries["plain"].report(new_tokens)
    out = {"plain": plain | {"step_ms": calls_ms(runners["plain"].calls).get(1)}}
    for shape in shapes:
        runner = runners[shape]
        report = summaries[shape].report(new_tokens)
        stats = list(runner.stats.values())
        rounds = sum(s.acceptance.rounds for s in stats)
        out[shape] = report | {
            "decode_speedup": plain["decode_ms_per_token"] / report["decode_ms_per_token"],
            "total_speedup": plain["total_ms_per_token"] / report["total_ms_per_token"],
            "acceptance_length": sum(s.acceptance.acceptance_length for s in stats) / len(stats),
            "draft_ms_per_round": 1e3 * sum(s.draft_s for s in stats) / rounds,
            "draft_prefill_ms_per_request": 1e3 * np.mean([s.draft_prefill_s for s in stats]),
            "verify_ms_by_width": calls_ms(runner.calls),
            "identical": summaries[shape].tokens == summaries["plain"].tokens,
        }
        log(f"{build} {shape}: {out[shape]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--builds", default="ort-int4")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timed", type=int, default=0, help="time, fastest of N (0: count)")
    parser.add_argument("--out", type=Path, default=RESULTS / "tree_identity.json")
    args = parser.parse_args()

    import specx

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results: dict = {
        "artifact": str(args.artifact),
        "commit": commit,
        "machine": platform.processor() or platform.machine(),
        "new_tokens": args.new_tokens,
        "builds": {},
    }
    for build in args.builds.split(","):
        engine = specx.load(args.artifact, threads=args.threads, build=build)
        prompts = prompts_for(engine.tokenizer, args.prompts)
        if args.timed:
            shapes = args.shapes.split(";")
            results["builds"][build] = timed(
                args.artifact, build, prompts, args.new_tokens, shapes, args.timed, args.threads
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
            continue
        log(f"{build}: plain decoding of {len(prompts)} prompts x {args.new_tokens} tokens")
        plain = [
            engine.generate(p, max_new_tokens=args.new_tokens, ignore_eos=True).tokens
            for p in prompts
        ]
        shapes = results["builds"][build] = {}
        for shape in args.shapes.split(";"):
            shapes[shape] = measure(engine, prompts, args.new_tokens, shape, plain)
            log(f"{build} {shape}: {shapes[shape]}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")  # after every build
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
