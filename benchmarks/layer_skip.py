"""Self-speculation by layer skipping on targets whose every layer is trained.

    python -m benchmarks.layer_skip [--prompts 6] [--new-tokens 64] [--repeats 3]

Targets: pyref-7m (5 layers, with its committed EAGLE-3 head) and pyref-12l (12 layers,
`python -m benchmarks.models.reference_target --layers 12 --out ~/.cache/specx/pyref-12l`),
each where it exists; both trained layer by layer from scratch, unlike pyref-1b, whose
block-expanded layers are near identity (the issue's trap). Each is exported (max context
1024), built for specx's kernels at int8 (`skip` shares the target's mapped weights there)
and calibrated with `--drafter skip` on 6 HumanEval/MT-bench prompts that are not timed,
which picks the skipped set (`calibration.layer_skip.choose_skipped`) and where it pays.

Timed in one process, interleaved prompt by prompt, fastest of `repeats` (HumanEval and
MT-bench prompts, greedy): plain; `skip` with the calibrated set, every chain of 4 kept
(fixed); the default path (`Engine.generate(speculation="skip")`: the calibration entry,
then the per-round controller, which may decode plainly), against the engine's own plain
decoding (`engine plain`: the same measure, its text streaming included); EAGLE-3 chain 4
where a head exists. Per mode: decode and total ms/token, speedup over plain, tokens a round (bonus
counted), acceptance by position, and c (a draft step over the plain step). Every output
is checked against plain's. Writes results/layer_skip.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.drafter_mix import row
from benchmarks.inputs import PYREF_7M, RESULTS, SHARED, log
from benchmarks.runners import SpecxPlain, SpecxSpeculative, Timing, interleave, scratch_dir

HEADS = Path(__file__).resolve().parent / "heads" / "pyref-7m"
TARGETS = {
    "pyref-7m": (PYREF_7M, HEADS / "eagle3"),
    "pyref-12l": (Path.home() / ".cache" / "specx" / "pyref-12l", None),
}
BUILD = "cpu-int8"


class EngineDefault:
    """`Engine.generate(prompt, speculation=...)`: the calibrated default path."""

    def __init__(self, engine, speculation: str | None):
        self.engine, self.speculation = engine, speculation
        self.stats: list = []

    def __call__(self, prompt: Sequence[int], new_tokens: int) -> Timing:  # noqa: D102
        self.engine.reset_drafters()
        done = self.engine.generate(
            list(prompt), max_new_tokens=new_tokens, ignore_eos=True, speculation=self.speculation
        )
        run = done.stats.run
        self.stats.append(done.stats)
        return Timing(run.prefill_s, run.decode_s, done.tokens)


def prepared(name: str, checkpoint: Path, head: Path | None, calibration: list[list[int]]):
    """The target exported, built for the kernels and calibrated for `skip` (cached)."""
    from specx.artifact import load_manifest
    from specx.builders import BuildOptions, build_artifact
    from specx.calibration.calibrate import CalibrationOptions, calibrate_artifact
    from specx.export.target_export import export_target

    artifact = scratch_dir("layer-skip") / name
    drafter = None if head is None else f"eagle3:{head}"
    log(f"{name}: exporting, building {BUILD}, calibrating skip")
    export_target(checkpoint, artifact, max_context=1024, drafter=drafter, progress=log)
    build_artifact(artifact, BuildOptions("cpu", "int8"), progress=log)
    options = CalibrationOptions(drafter="skip", threads=2, max_new_tokens=48)
    entry = calibrate_artifact(artifact, calibration, options, log)
    return artifact, load_manifest(artifact), entry


def c_per_step(runner: SpecxSpeculative, plain_ms: float) -> float:
    """A draft step's cost over plain decoding's step: drafting seconds per chain step."""
    stats = list(runner.stats.values())
    steps = sum(s.acceptance.rounds for s in stats) * 4  # a fixed chain of 4 a round
    return 1e3 * sum(s.draft_s for s in stats) / max(steps, 1) / plain_ms


def texts(file: str, count: int) -> list[str]:
    """The first `count` prompts of an eval set (`shared/data/eval/FILE`)."""
    lines = (SHARED / "data" / "eval" / file).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["turns"][0] for line in lines[:count]]


def measure(name: str, args, timed: list[str], calibrating: list[str]) -> dict:
    """One target's modes, interleaved (the prompts in its own tokenizer's ids)."""
    import specx
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.tokenizer import TextTokenizer

    checkpoint, head = TARGETS[name]
    tokenizer = TextTokenizer(checkpoint / "tokenizer.json")
    prompts = [tokenizer.encode(t)[:200] for t in timed]
    calibration = [tokenizer.encode(t)[:200] for t in calibrating]
    artifact, manifest, entry = prepared(name, checkpoint, head, calibration)
    engine = specx.load(artifact, threads=args.threads)
    target = engine.target
    # The calibrated set (its layers also chosen where calibration turned skip off).
    skip = "skip:" + ",".join(map(str, entry.skipped_layers))

    def factory(spec: str):
        return lambda prompt: make_drafter(spec, target, DrafterOptions(4))

    made: dict = {"plain": SpecxPlain(artifact, BUILD, args.threads)}
    made["skip fixed"] = SpecxSpeculative(target, factory(skip))
    # The default path's own baseline: the engine's plain decoding (its sink streams text).
    made["engine plain"] = EngineDefault(engine, None)
    made["skip default"] = EngineDefault(engine, "skip")
    if head is not None:
        made["eagle3 chain 4"] = SpecxSpeculative(target, factory("eagle3"))
    log(f"{name}: {len(made)} modes x {len(prompts)} prompts x {args.repeats}")
    summaries = interleave(made, prompts, args.new_tokens, args.repeats)
    plain = summaries["plain"].report(args.new_tokens)
    rows = {}
    for mode, runner in made.items():
        c = None  # before `row` clears a drafter's stats
        if isinstance(runner, SpecxSpeculative):
            c = c_per_step(runner, plain["decode_ms_per_token"])
        rows[mode] = row(summaries[mode], runner, args.new_tokens, plain)
        rows[mode]["identical_to_plain"] = summaries[mode].tokens == summaries["plain"].tokens
        if c is not None:
            rows[mode]["c"] = c
    default = made["skip default"].stats
    rows["skip default"]["speculation"] = sorted({s.speculation for s in default})
    for measure in ("decode", "total"):
        key = f"{measure}_ms_per_token"
        rows["skip default"][f"{measure}_speedup_vs_engine_plain"] = (
            rows["engine plain"][key] / rows["skip default"][key]
        )
    log(f"{name}: " + ", ".join(f"{m} {r['decode_speedup']:.2f}x" for m, r in rows.items()))
    return {
        "layers": target.num_layers,
        "build": BUILD,
        "calibrated": entry.to_json(),
        "modes": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "layer_skip.json")
    args = parser.parse_args()
    count = args.prompts
    code, chat = texts("humaneval.jsonl", count), texts("mt_bench.jsonl", count)
    timed = code[: count // 2] + chat[: count - count // 2]  # the rest calibrates
    calibrating = code[count // 2 :] + chat[count - count // 2 :]
    present = {n: t for n, t in TARGETS.items() if (t[0] / "model.safetensors").is_file()}
    for missing in set(TARGETS) - set(present):
        log(f"{missing}: no checkpoint at {TARGETS[missing][0]}, left out")
    started = time.perf_counter()
    report = {
        "benchmark": "layer_skip",
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "prompts": count,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "targets": {name: measure(name, args, timed, calibrating) for name in present},
    }
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(report, indent=2, default=_plain) + "\n")
    log(f"wrote {args.out}")


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else str(value)


if __name__ == "__main__":
    main()
