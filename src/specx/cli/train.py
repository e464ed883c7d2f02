"""`specx regenerate` and `specx train`: data from the target, and drafters distilled on it."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specx.cli.common import (
    NATURAL,
    POSITIVE,
    FiniteFloat,
    IntRange,
    only_applies,
    passed,
    progress,
    require_extra,
)
from specx.errors import SpecxError

__all__ = ["COMMANDS", "regenerate", "train"]

_CORPUS_HELP = "Text file, directory (.py/.txt/.md, recursive) or JSONL prompt set; repeatable."


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(","))
    except ValueError:
        raise SpecxError(f"--temperatures must be comma-separated numbers, got {text!r}") from None


@click.command(short_help="Write a target's own continuations of prompts (training data).")
@click.argument("target_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--corpus", multiple=True, required=True, help=_CORPUS_HELP)
@click.option(
    "-o",
    "--output",
    "output_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Directory for the windows: new, empty, or an earlier run's (which it completes).",
)
@click.option("--windows", type=POSITIVE, required=True, help="How many windows to write.")
@click.option("--seq-len", type=IntRange(min=2), default=256, show_default=True)
@click.option(
    "--prompt-tokens",
    type=POSITIVE,
    default=32,
    show_default=True,
    help="Corpus tokens that start each window; the target writes the rest.",
)
@click.option(
    "--prompts",
    type=click.Choice(["windows", "functions"]),
    default="windows",
    show_default=True,
    help="Prompts from random places of the corpus, or ending where a Python function's "
    "docstring ends (the target writes the body).",
)
@click.option(
    "--temperatures",
    default="0,0.7,0,1",
    show_default=True,
    help="Sampling temperatures, cycled batch by batch (0 = greedy).",
)
@click.option("--batch", type=POSITIVE, default=64, show_default=True)
@click.option("--shard-windows", type=POSITIVE, default=512, show_default=True)
@click.option("--seed", type=NATURAL, default=0, show_default=True)
def regenerate(
    target_dir: Path,
    corpus: tuple[str, ...],
    output_dir: Path,
    windows: int,
    seq_len: int,
    prompt_tokens: int,
    prompts: str,
    temperatures: str,
    batch: int,
    shard_windows: int,
    seed: int,
) -> None:
    """Have the target in TARGET_DIR continue corpus prompts: training data for drafters.

    Deterministic for a seed, written in hash-checked shards, resumable (run it again with
    the same options); `specx train --data DIR` trains on it.
    """
    from specx.training.regenerate import RegenerateConfig

    config = RegenerateConfig(
        windows,
        seq_len=seq_len,
        prompt_tokens=prompt_tokens,
        temperatures=_temperatures(temperatures),
        batch=batch,
        shard_windows=shard_windows,
        seed=seed,
        prompts=prompts,
    )
    require_extra("regenerate")
    from specx.training.regenerate import regenerate as run

    click.echo(run(target_dir, corpus, output_dir, config, progress=progress))


def _tap_layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",")]
    if len(items) != 3 or not all(t.isascii() and t.isdigit() for t in items):
        raise SpecxError(f"--tap-layers must be three layer numbers, got {text!r}")
    return tuple(int(t) for t in items)


@click.command(short_help="Train a drafter for a target: EAGLE-3, EAGLE, Medusa, MTP, draft model.")
@click.argument("kind")
@click.argument("target_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--corpus", multiple=True, help=_CORPUS_HELP)
@click.option(
    "--data",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Target-generated windows (`specx regenerate`) to train on; repeatable.",
)
@click.option(
    "--held-out",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Target-generated windows of prompts never trained on, to measure acceptance on "
    "[default: the last 10% of the corpus].",
)
@click.option(
    "-o",
    "--output",
    "output_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Directory for the drafter in its public format: new, empty, or an earlier "
    "training output (whose saved state it resumes).",
)
@click.option(
    "--init",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A KIND drafter in its public format to train on from (fine-tuning it; its shape, "
    "taps and draft vocabulary are kept) [default: a new one].",
)
@click.option("--steps", type=POSITIVE, default=300, show_default=True)
@click.option("--batch", type=POSITIVE, default=8, show_default=True)
@click.option("--seq-len", type=IntRange(min=2), default=128, show_default=True)
@click.option("--lr", type=FiniteFloat(min=0, min_open=True), default=1e-3, show_default=True)
@click.option("--seed", type=NATURAL, default=0, show_default=True)
@click.option(
    "--ttt-steps",
    type=POSITIVE,
    default=3,
    show_default=True,
    help="EAGLE-3/MTP training-time-test steps (later steps weighted 0.8^i).",
)
@click.option(
    "--draft-vocab",
    type=POSITIVE,
    default=None,
    help="EAGLE-3 draft vocabulary size (most frequent training tokens; d2t/t2d) "
    "[default: the full vocabulary].",
)
@click.option("--medusa-heads", type=POSITIVE, default=4, show_default=True)
@click.option(
    "--tap-layers",
    help="EAGLE-3: the three layers whose input states the head reads, in [1, N] (N = the "
    "last layer's output) [default: 2, N//2, N-3]; saved with the head.",
)
@click.option(
    "--normalise-taps/--raw-taps",
    default=True,
    show_default=True,
    help="EAGLE-3: train on taps scaled to unit RMS per channel (a preconditioner, folded "
    "into fc when saved) or on the raw residual streams.",
)
@click.option(
    "--on-policy",
    "on_policy",
    type=NATURAL,
    default=0,
    show_default=True,
    help="Add this many windows continued by the target, half greedy and half at T=0.7 "
    "(on-policy data; `specx regenerate` makes more, on disk).",
)
@click.option(
    "--eval-every",
    type=NATURAL,
    default=0,
    show_default=True,
    help="Measure held-out acceptance every this many steps (the learning curve).",
)
@click.option("--save-every", type=POSITIVE, default=100, show_default=True)
@click.option("--bf16", is_flag=True, help="bf16 autocast for the drafter (labels stay fp32).")
@click.pass_context
def train(
    ctx: click.Context,
    kind: str,
    target_dir: Path,
    corpus: tuple[str, ...],
    data: tuple[Path, ...],
    held_out: Path | None,
    output_dir: Path,
    init: Path | None,
    steps: int,
    batch: int,
    seq_len: int,
    lr: float,
    seed: int,
    ttt_steps: int,
    draft_vocab: int | None,
    medusa_heads: int,
    tap_layers: str | None,
    normalise_taps: bool,
    on_policy: int,
    eval_every: int,
    save_every: int,
    bf16: bool,
) -> None:
    """Distil a KIND drafter against the target in TARGET_DIR (soft labels from the target).

    KIND: eagle3, eagle, medusa, mtp or draft-model.
    """
    require_extra("train")
    from specx.training.kinds import KIND_OPTIONS, KINDS, drafter_kind
    from specx.training.loop import TrainConfig, train_drafter

    drafter = drafter_kind(kind)
    for name in sorted(KIND_OPTIONS - drafter.options):
        flags = passed(ctx, name)
        if flags:
            kinds = [k.name for k in KINDS.values() if name in k.options]
            raise SpecxError(only_applies(flags, f"{' and '.join(kinds)} training, not {kind}"))
    shaped = passed(ctx, "tap_layers", "draft_vocab", "medusa_heads")
    if init is not None and shaped:
        raise SpecxError(
            f"{', '.join(shaped)}: the --init drafter keeps the shape it was trained with"
        )
    if not corpus and not data:
        raise SpecxError("give --corpus text or --data windows (or both) to train on")
    config = TrainConfig(
        kind,
        steps=steps,
        batch=batch,
        seq_len=seq_len,
        lr=lr,
        seed=seed,
        ttt_steps=ttt_steps,
        draft_vocab=draft_vocab,
        medusa_heads=medusa_heads,
        on_policy_windows=on_policy,
        tap_layers=_tap_layers(tap_layers),
        normalise_taps=normalise_taps,
        eval_every=eval_every,
        save_every=save_every,
        bf16=bf16,
        init=None if init is None else str(init),
    )
    result = train_drafter(
        target_dir, corpus, output_dir, config, progress=progress, data=data, held_out=held_out
    )
    click.echo(json.dumps(result.report, indent=2))


COMMANDS = (regenerate, train)
