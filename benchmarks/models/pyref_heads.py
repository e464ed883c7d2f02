"""The trained pyref-7m drafters every benchmark reads: committed under benchmarks/heads/.

`benchmarks/heads/pyref-7m/<kind>/` (kind = eagle3, eagle, mtp, medusa, draft-model) holds
each drafter in the public format its loader reads, weights in fp16, with its training
report; `benchmarks/heads/pyref-7m/README.md` gives the recipe, seed, training time, held-out
acceptance and sha256 of each. The benchmarks use them as they are; `--retrain KINDS` trains
those again with the recipes below and ships them in place of the committed ones.

Data (the target's own text, as EAGLE-3, HASS and SpecForge train): `specx regenerate` has
pyref-7m continue 32-token prompts from the CPython stdlib files its reference split trains
on (8192 windows of 256 tokens, half greedy, a quarter each at T=0.7 and T=1), and, for
held-out acceptance, prompts from the 26 files it holds out (256 windows). Both are written
to ~/.cache/specx/pyref-data once (13 minutes here) and resumed if interrupted; training
resumes from its last saved state too (`~/.cache/specx/pyref-heads-train/<kind>`).
`--continue KINDS` trains a shipped head on from where it is, the next of its CONTINUE
stages, on sets no stage saw: fresh stdlib prompts (`train-3`), then the target writing the
bodies of the training split's functions from the 64 tokens that end with their docstrings
(`functions`: `specx regenerate --prompts functions`; the edge benchmark's HumanEval prompts
are such stubs).

pyref-deep (benchmarks/models/pyref_deep.py) shares pyref-7m's residual stream, so the same
heads draft for it: `for_deep` renumbers what a layout names by layer (MTP's layer index,
EAGLE-3's taps) for the 32-layer target.

`--int4-twin WIDE` distils against pyref-1b's int4 build instead, through its narrow twin
(`python -m benchmarks.models.pyref_wide WIDE --twin` writes it: pyref-7m's shape computing
what the int4 build computes): its own data (`~/.cache/specx/pyref-int4-data`), runs and
shipped heads (`benchmarks/heads/pyref-1b-int4/`, which pyref_wide.py widens for pyref-1b).

    python -m benchmarks.models.pyref_heads [--retrain eagle3,eagle,...] [--continue eagle3]
        [--steps N] [--int4-twin WIDE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.inputs import PYREF_7M as PYREF_7M_DIR
from benchmarks.inputs import ROOT, stdlib_split

KINDS = ("eagle3", "eagle", "mtp", "medusa", "draft-model")
CACHE = Path.home() / ".cache" / "specx"
HEADS = ROOT / "benchmarks" / "heads" / "pyref-7m"
TRAIN = CACHE / "pyref-heads-train"
DATA = CACHE / "pyref-data"
COMMON = {"batch": 8, "seq_len": 256, "lr": 2e-3, "seed": 0, "save_every": 100, "bf16": True}
# kind -> TrainConfig fields besides COMMON (`more_data`: train on MORE_DATA too).
RECIPES: dict[str, dict] = {
    "eagle3": {
        "steps": 3000,
        "ttt_steps": 7,
        "tap_layers": (2, 3, 5),
        "normalise_taps": True,
        "eval_every": 200,
        "more_data": True,
    },
    "eagle": {"steps": 1200, "eval_every": 100},
    "mtp": {"steps": 300, "ttt_steps": 3, "eval_every": 100},
    "medusa": {"steps": 400, "eval_every": 100},
    "draft-model": {"steps": 400, "eval_every": 100},
}
TRAIN_DATA = {"windows": 8192, "batch": 64, "shard_windows": 512, "seed": 0}
# More of the same (other prompts: another seed), for the recipes that name it.
MORE_DATA = {"windows": 16384, "batch": 64, "shard_windows": 512, "seed": 2}
# kind -> the stages after the first, in order: each trains from the head the stages before
# it shipped (TrainConfig `init`) on `data`, sets no stage saw before, with its own
# learning-rate schedule (a warm restart).
CONTINUE: dict[str, list[dict]] = {
    "eagle3": [
        {"steps": 2000, "lr": 1e-3, "eval_every": 200, "data": ("train-3",)},
        {"steps": 700, "lr": 5e-4, "eval_every": 100, "data": ("functions",)},
    ]
}
FRESH_DATA = {"windows": 16384, "batch": 64, "shard_windows": 512, "seed": 3}
# The target writing function bodies from their signature and docstring (the edge
# benchmark's HumanEval prompts are such stubs), from the training split's functions.
FUNCTION_DATA = {
    "windows": 8192, "batch": 64, "shard_windows": 512, "seed": 4, "prompts": "functions",
    "prompt_tokens": 64,
}  # fmt: skip
HELD_OUT_DATA = {"windows": 256, "batch": 64, "shard_windows": 256, "seed": 1}
DATA_SETS = {
    "held-out": HELD_OUT_DATA,
    "train": TRAIN_DATA,
    "train-2": MORE_DATA,
    "train-3": FRESH_DATA,
    "functions": FUNCTION_DATA,
}
# pyref-7m's residual stream entering layer i (0..5) is pyref-deep's entering DEEP_LAYER[i].
DEEP_LAYER = (0, 1, 2, 16, 29, 32)


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Teacher:
    """Whose predictions the heads learn, and where its data, runs and shipped heads live."""

    name: str
    source: str  # what the heads' README says they were distilled against
    target: Path
    data: Path
    train: Path
    heads: Path


PYREF_7M = Teacher("pyref-7m", "`shared/models/pyref-7m`", PYREF_7M_DIR, DATA, TRAIN, HEADS)


def int4_twin(wide: Path) -> Teacher:
    """pyref-1b's int4 build, through the narrow twin pyref_wide.py writes under `wide`."""
    return Teacher(
        "pyref-1b at int4",
        "pyref-1b's int4 build through its pyref-7m-sized twin "
        "(`python -m benchmarks.models.pyref_wide WIDE --twin`)",
        wide / "pyref-7m-int4-twin",
        CACHE / "pyref-int4-data",
        CACHE / "pyref-int4-heads-train",
        HEADS.parent / "pyref-1b-int4",
    )


@dataclass(frozen=True)
class Data:
    train: list[Path]
    held_out: Path


def ensure_data(sets: tuple[str, ...] = ("train",), teacher: Teacher = PYREF_7M) -> Data:
    """The regenerated training `sets` (names in DATA_SETS) and held-out windows, written
    (or completed) when missing."""
    from specx.training.regenerate import RegenerateConfig, regenerate

    if not (teacher.target / "model.safetensors").is_file():
        raise SystemExit(f"no checkpoint at {teacher.target} ({teacher.name})")
    train_files, held_files = stdlib_split()
    for name in ("held-out", *sets):
        files = held_files if name == "held-out" else train_files
        config = RegenerateConfig(**DATA_SETS[name])
        regenerate(teacher.target, [str(p) for p in files], teacher.data / name, config, log)
    return Data([teacher.data / name for name in sets], teacher.data / "held-out")


def train(kind: str, steps: int | None = None, teacher: Teacher = PYREF_7M) -> Path:
    """Trains `kind` with its recipe into teacher.train/kind (resuming); returns that directory."""
    recipe = {**COMMON, **RECIPES[kind], **({"steps": steps} if steps else {})}
    sets = ("train", "train-2") if recipe.pop("more_data", False) else ("train",)
    return _train_run(kind, recipe, sets, teacher.train / kind, teacher)


def continue_training(kind: str, steps: int | None = None, heads: Path = HEADS) -> Path:
    """Trains the next CONTINUE stage from the head shipped under `heads` (a copy, as that
    one is replaced when this ships); the new report holds the shipped one as `previous`."""
    shipped = json.loads((heads / kind / "train_report.json").read_text())
    stage = len(stages(shipped)) + 1
    if stage - 2 >= len(CONTINUE.get(kind, [])):
        raise SystemExit(f"{kind}: the shipped head has {stage - 1} stages, CONTINUE no more")
    start = TRAIN / f"{kind}-stage{stage}-start"
    if not (start / "train_report.json").is_file():  # else: a resumed stage keeps its start
        shutil.copytree(heads / kind, start, dirs_exist_ok=True)
    recipe = {**COMMON, **CONTINUE[kind][stage - 2], **({"steps": steps} if steps else {})}
    sets = recipe.pop("data")
    first = json.loads((start / "train_report.json").read_text())
    for key in ("ttt_steps", "normalise_taps"):  # the stage trains as the first did
        recipe[key] = first["config"][key]
    recipe["init"] = str(start)
    out = _train_run(kind, recipe, sets, TRAIN / f"{kind}-stage{stage}")
    report = json.loads((out / "train_report.json").read_text())
    report["previous"] = first
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return out


def _train_run(
    kind: str, recipe: dict, sets: tuple[str, ...], out: Path, teacher: Teacher = PYREF_7M
) -> Path:
    from specx.training.loop import TrainConfig, train_drafter

    data = ensure_data(sets, teacher)
    if (out / "train_report.json").is_file() and not (out / "train_state.pt").is_file():
        shutil.rmtree(out)  # an earlier finished run: train afresh
    log(f"training {kind} into {out} ({recipe})")
    config = TrainConfig(kind, **recipe)
    train_drafter(teacher.target, [], out, config, log, data=data.train, held_out=data.held_out)
    return out


def ship(kind: str, trained: Path, heads: Path = HEADS, teacher: Teacher = PYREF_7M) -> Path:
    """Copies a trained drafter into `heads/kind` with fp16 weights, and its report."""
    from safetensors.numpy import load_file, save_file

    out = heads / kind
    staging = heads / f".{kind}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for path in sorted(trained.iterdir()):
        if path.suffix == ".safetensors":
            tensors = {
                k: v.astype("float16") if v.dtype.kind == "f" else v
                for k, v in load_file(path).items()
            }
            save_file(tensors, staging / path.name, metadata={"format": "pt"})
        elif path.name in (
            "config.json",
            "train_report.json",
            "generation_config.json",
            "tokenizer.json",
        ):
            shutil.copyfile(path, staging / path.name)
    if out.exists():
        shutil.rmtree(out)
    staging.replace(out)
    write_readme(heads, teacher)
    return out


def weights_sha256(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.glob("*.safetensors"))
    }


def stages(report: dict | None) -> list[dict]:
    """A head's training reports, first stage first (a continued head's `previous` ones)."""
    return [] if report is None else [*stages(report.get("previous")), report]


def _recipe(kind: str, report: dict) -> dict:
    cfg = report["config"]
    recipe = {k: cfg[k] for k in ("steps", "batch", "seq_len", "lr", "seed", "bf16")}
    recipe["windows"] = report["train_windows"]
    for key in ("ttt_steps", "tap_layers", "draft_vocab", "normalise_taps"):
        if kind in ("eagle3", "mtp") and cfg.get(key) is not None:
            recipe[key] = cfg[key]
    return recipe


def write_readme(heads: Path = HEADS, teacher: Teacher = PYREF_7M) -> None:
    """heads/README.md: recipe, seed, time, acceptance and hashes of every shipped drafter."""
    rows, hashes = [], {}
    for kind in KINDS:
        report_path = heads / kind / "train_report.json"
        if not report_path.is_file():
            continue
        report = json.loads(report_path.read_text())
        runs = stages(report)
        recipe = _recipe(kind, runs[0])
        for later in runs[1:]:  # a continued head: each stage's own steps, lr and data
            recipe.setdefault("then", []).append(
                {k: _recipe(kind, later)[k] for k in ("steps", "lr", "windows")}
            )
        last = report["learning_curve"][-1]
        depth = ", ".join(f"{a:.2f}" for a in last["acceptance_by_depth"])
        minutes = sum(run["train_seconds"] for run in runs) / 60
        rows.append(
            f"| {kind} | {json.dumps(recipe)} | {minutes:.0f} min | {depth} | "
            f"{last['tau_chain5_estimate']:.2f} |"
        )
        hashes[kind] = weights_sha256(heads / kind)
    notes = NOTES.get(teacher.name, {})
    noted = "".join(f"- {kind}: {notes[kind]}\n" for kind in hashes if kind in notes)
    text = (
        README_HEAD.format(name=teacher.name, source=teacher.source)
        + "\n".join(rows)
        + "\n\n"
        + noted
        + "\nsha256 of the weight files:\n\n"
    )
    for kind, files in hashes.items():
        text += "".join(f"- `{kind}/{name}`: `{digest}`\n" for name, digest in files.items())
    (heads / "README.md").write_text(text)
    (heads / "heads.json").write_text(json.dumps(hashes, indent=2) + "\n")


# What a row's training time does not say: teacher name -> kind -> note.
NOTES: dict[str, dict[str, str]] = {
    "pyref-7m": {
        "eagle3": "three stages. First, 3000 steps on both regenerated sets (`train` and "
        "`train-2`: 24,576 windows, 6.1M tokens seen; held-out 0.83 at depth 1, chain-5 tau "
        "3.93). Then `--continue`: 2000 steps from that head on 16,384 fresh windows (`train-3`, "
        "prompts neither stage saw), lr 1e-3 with its own warm-up and decay; held-out depth 1 "
        "fell to 0.81 after the restart and passed the first stage's 0.83 at step 1200, ending "
        "at 0.847. Then `--continue` again: 700 steps, lr 5e-4, on 8,192 windows of pyref-7m "
        "writing the bodies of the training split's functions from the 64 tokens that end with "
        "their docstrings (`functions`: `specx regenerate --prompts functions`, 6,892 "
        "functions); held-out depth 1 (stdlib windows) went 0.847 -> 0.835 while acceptance on "
        "the benchmarks' HumanEval stubs rose (head_acceptance.py, greedy chain 5: 3.64 -> "
        "4.10). Two threads (`OMP_NUM_THREADS=2`); the stages ran while other work shared the "
        "machine or was timed (paused with SIGSTOP), so the row's time is wall time, pauses "
        "included. Alone the recipe trains at 1,100-1,185 tokens/s, so the three stages are "
        "about 95 + 60 + 22 minutes of compute with their held-out evaluations. Taps normalised "
        "(1/RMS per channel, folded into fc when saved). Earlier heads: 1500 steps on 8,192 "
        "windows 0.78 and tau 3.43; 2000 steps on raw taps 0.77 and 3.31.",
    },
    "pyref-1b at int4": {
        "eagle": "the pyref-7m recipe on 8192 windows the twin wrote (its own continuations of "
        "the same prompts), with two threads (`OMP_NUM_THREADS=2`), the machine otherwise "
        "idle after its first minutes.",
    },
}
README_HEAD = """# Trained drafters for {name}

Written by `python -m benchmarks.models.pyref_heads` (see its docstring for the data and
recipes): distilled against {source} on windows (256 tokens; the row's count) of its
own continuations of stdlib prompts, each in the public format its loader reads (`specx
export --drafter KIND:DIR`; the draft model is an HF Llama checkpoint), weights in fp16. Held-out
acceptance is `sum min(p, q)` by draft depth on 64 windows (of the 256 written) of the target
continuing prompts from the files the reference split holds out (never trained on), and the chain-5
acceptance length (bonus counted) those rates imply. Training ran on this 2-core machine,
one thread per run, two runs at a time (`OMP_NUM_THREADS=1`), unless a note below says
otherwise.

| kind | recipe | training time | held-out acceptance by depth | chain-5 tau (estimate) |
|---|---|---|---|---|
"""


def for_deep(kind: str, heads: Path, work: Path) -> Path:
    """A head for pyref-deep: the same weights, with layer numbers renumbered (see above)."""
    if kind == "mtp":
        return _mtp_renumbered(heads / kind, 32, work / "mtp-deep")
    if kind != "eagle3":
        return heads / kind
    config = json.loads((heads / kind / "config.json").read_text())
    outputs = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if outputs is None:
        return heads / kind
    out = work / "eagle3-deep"
    shutil.copytree(heads / kind, out, dirs_exist_ok=True)
    deep = [DEEP_LAYER[o + 1] - 1 for o in outputs]  # layer outputs in both numberings
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = deep
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _mtp_renumbered(head: Path, layers: int, out: Path) -> Path:
    """The MTP head under `model.layers.{layers}.` (DeepSeek-V3 names it by target depth)."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(head / "model.safetensors")
    prefix = f"model.layers.{layers}."
    renamed = {prefix + k.split(".", 3)[3]: v for k, v in weights.items()}
    if renamed.keys() == weights.keys():
        return head
    out.mkdir(parents=True, exist_ok=True)
    save_file(renamed, out / "model.safetensors")
    (out / "config.json").write_text((head / "config.json").read_text())
    return out


def ensure_heads(kinds: list[str], heads: Path = HEADS, retrain: bool = False) -> list[str]:
    """The `kinds` present under `heads`; trains and ships the missing ones (all: `retrain`)."""
    unknown = sorted(set(kinds) - set(RECIPES))
    if unknown:
        raise SystemExit(f"no recipe for {unknown}; known: {sorted(RECIPES)}")
    for kind in kinds:
        if retrain or not (heads / kind / "config.json").is_file():
            ship(kind, train(kind), heads)
    return kinds


def trained_drafters(retrain: bool = False) -> dict[str, Path]:
    """kind -> the committed trained drafter (benchmarks/heads/pyref-7m; `retrain`: anew)."""
    return {kind: HEADS / kind for kind in ensure_heads(list(KINDS), retrain=retrain)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retrain", default="", help="kinds to train again and ship")
    parser.add_argument(
        "--continue", dest="more", default="",
        help="kinds to train on from their shipped heads (their next CONTINUE stage) and ship",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="instead of the recipe's")
    parser.add_argument("--heads", type=Path, default=None, help="default: the teacher's")
    parser.add_argument(
        "--int4-twin", type=Path, default=None, metavar="WIDE",
        help="distil against pyref-1b's int4 build (its twin under WIDE: pyref_wide.py --twin)",
    )  # fmt: skip
    args = parser.parse_args()
    if not (PYREF_7M_DIR / "model.safetensors").is_file():
        log("skipped: shared/models/pyref-7m is absent")
        return
    teacher = int4_twin(args.int4_twin) if args.int4_twin else PYREF_7M
    heads = args.heads or teacher.heads
    for kind in [k for k in args.retrain.split(",") if k]:
        ship(kind, train(kind, args.steps, teacher), heads, teacher)
    for kind in [k for k in args.more.split(",") if k]:
        ship(kind, continue_training(kind, args.steps, heads), heads, teacher)
    write_readme(heads, teacher)


if __name__ == "__main__":
    main()
