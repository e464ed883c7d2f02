"""`specx export`, `train` and `demo`: the commands that need the export extra (torch)."""

from __future__ import annotations

import json
import sys
import tempfile
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
from specx.cli.generate import print_stats
from specx.errors import GenerationError, SpecxError

__all__ = ["COMMANDS", "demo", "export", "train"]


@click.command()
@click.argument("target_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    "output_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Artifact directory to create.",
)
@click.option(
    "--max-context",
    type=IntRange(min=2),
    default=2048,
    show_default=True,
    help="KV-cache capacity in tokens (prompt + generated + tree scratch).",
)
@click.option(
    "--taps",
    type=click.Choice(["none", "last", "eagle3"]),
    default=None,
    help="Hidden states to output: last = final post-norm state (Medusa/EAGLE-1/MTP); "
    "eagle3 = states entering layers 2, N//2, N-3 [default: what --drafter reads, else none].",
)
@click.option(
    "--drafter",
    help="Export a draft head with the target: eagle3:DIR | eagle:DIR | medusa:DIR | mtp[:DIR] "
    "(mtp alone reads the MTP layer from the target checkpoint).",
)
@click.option(
    "--max-tree-tokens",
    type=POSITIVE,
    default=None,
    help="Most tokens one verify forward takes (root + draft tree nodes) [default: 64].",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace an existing specx artifact at --output (never anything else).",
)
def export(
    target_dir: Path,
    output_dir: Path,
    max_context: int,
    taps: str | None,
    drafter: str | None,
    max_tree_tokens: int | None,
    overwrite: bool,
) -> None:
    """Export the HF checkpoint in TARGET_DIR to a specx artifact (ONNX + manifest)."""
    require_extra("export")
    from specx.export.target_export import export_target

    export_target(
        target_dir,
        output_dir,
        max_context=max_context,
        taps=taps,
        drafter=drafter,
        max_tree_tokens=max_tree_tokens,
        overwrite=overwrite,
        progress=progress,
    )


_TRAIN_ONLY = {
    "draft_vocab": ("eagle3",),
    "tap_layers": ("eagle3",),
    "ttt_steps": ("eagle3", "mtp"),
    "medusa_heads": ("medusa",),
}


@click.command()
@click.argument("kind", type=click.Choice(["eagle3", "eagle", "medusa", "mtp", "draft-model"]))
@click.argument("target_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--corpus",
    multiple=True,
    required=True,
    help="Text file, directory (.py/.txt/.md, recursive) or JSONL prompt set; repeatable.",
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
    help="EAGLE-3 draft vocabulary size (most frequent corpus tokens; d2t/t2d).",
)
@click.option("--medusa-heads", type=POSITIVE, default=4, show_default=True)
@click.option(
    "--tap-layers",
    help="EAGLE-3: comma-separated layers whose input states the head reads [default: 2, "
    "N//2, N-3]; for a teacher whose streams equal the deployment target's taps.",
)
@click.option(
    "--on-policy",
    "on_policy",
    type=NATURAL,
    default=0,
    show_default=True,
    help="Add this many windows continued by the target, half greedy and half at T=0.7 "
    "(on-policy data).",
)
@click.pass_context
def train(
    ctx: click.Context,
    kind: str,
    target_dir: Path,
    corpus: tuple[str, ...],
    output_dir: Path,
    steps: int,
    batch: int,
    seq_len: int,
    lr: float,
    seed: int,
    ttt_steps: int,
    draft_vocab: int | None,
    medusa_heads: int,
    tap_layers: str | None,
    on_policy: int,
) -> None:
    """Distil a KIND drafter against the target in TARGET_DIR (soft labels from the target)."""
    for name, kinds in _TRAIN_ONLY.items():
        flags = passed(ctx, name)
        if flags and kind not in kinds:
            raise SpecxError(only_applies(flags, f"{' and '.join(kinds)} training, not {kind}"))
    layers = None
    if tap_layers is not None:
        items = [t.strip() for t in tap_layers.split(",")]
        if len(items) != 3 or not all(t.isascii() and t.isdigit() for t in items):
            raise SpecxError(f"--tap-layers must be three layer numbers, got {tap_layers!r}")
        layers = tuple(int(t) for t in items)
    require_extra("train")
    from specx.training.loop import TrainConfig, train_drafter

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
        tap_layers=layers,
    )
    result = train_drafter(target_dir, corpus, output_dir, config, progress=progress)
    click.echo(json.dumps(result.report, indent=2))


@click.command()
@click.option(
    "--target",
    "target_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="HF checkpoint to use instead of a random-weight demo model.",
)
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=None,
    help="A new or empty directory that keeps the checkpoint and artifact "
    "[default: a temporary directory, removed afterwards].",
)
@click.option("--prompt", default="def fibonacci(n):\n", show_default=True)
@click.option("--max-new-tokens", type=POSITIVE, default=64, show_default=True)
@click.option("--threads", type=POSITIVE, default=None, help="ONNX Runtime threads.")
def demo(
    target_dir: Path | None,
    workdir: Path | None,
    prompt: str,
    max_new_tokens: int,
    threads: int | None,
) -> None:
    """Run the whole pipeline with no downloads: export, then plain and speculative decoding.

    Prints a JSON report: the texts, plain and n-gram speculative stats (acceptance
    length, per-position acceptance, ms/token), the speedup, and whether the greedy
    outputs are identical (they must be).
    """
    if not prompt:
        raise GenerationError("--prompt is empty")
    if workdir is not None and workdir.exists():
        if not workdir.is_dir() or any(workdir.iterdir()):
            raise SpecxError(
                f"--workdir {workdir} exists and is not an empty directory: give a new one"
            )
    require_extra("demo")
    if workdir is not None:
        report = _demo(workdir, target_dir, prompt, max_new_tokens, threads)
    else:
        with tempfile.TemporaryDirectory(prefix="specx-demo-") as scratch:
            report = _demo(Path(scratch), target_dir, prompt, max_new_tokens, threads)
            report["artifact"] = None  # removed with the temporary directory
    json.dump(report, sys.stdout, indent=2)
    click.echo()
    print_stats(report["plain"])
    print_stats(report["speculative"])
    if not report["identical_to_plain"]:
        raise GenerationError("speculative output differs from plain decoding: please report")


def _demo(
    workdir: Path, target_dir: Path | None, prompt: str, max_new_tokens: int, threads: int | None
) -> dict:
    from specx.artifact import load_manifest
    from specx.export.random_checkpoint import write_random_checkpoint
    from specx.export.target_export import export_target
    from specx.runtime.backends import open_decoder
    from specx.runtime.drafters.ngram import NGramDrafter
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.speculative_decoding import generate_speculative
    from specx.runtime.tokenizer import TextTokenizer

    if target_dir is None:
        target_dir = workdir / "checkpoint"
        progress(f"writing a random-weight Llama checkpoint to {target_dir}")
        write_random_checkpoint(target_dir, "llama", "small", seed=0)
    artifact = export_target(target_dir, workdir / "artifact", max_context=1024, progress=progress)
    manifest = load_manifest(artifact)
    tokenizer = TextTokenizer(manifest.tokenizer_file) if manifest.tokenizer_file else None
    prompt_ids = tokenizer.encode(prompt) if tokenizer else [1, 2, 3, 4]
    target = open_decoder(manifest, threads=threads)
    progress("decoding: plain, then speculative with the n-gram drafter")
    plain = generate_plain(target, [prompt_ids], max_new_tokens)
    spec = generate_speculative(target, NGramDrafter(6), [prompt_ids], max_new_tokens)
    return {
        "artifact": str(artifact),
        "prompt": prompt,
        "text": tokenizer.decode(spec.tokens[0]) if tokenizer else None,
        "tokens": spec.tokens[0],
        "identical_to_plain": spec.tokens == plain.tokens,
        "speedup": plain.stats["ms_per_token"] / spec.stats["ms_per_token"],
        "plain": plain.stats,
        "speculative": {k: v for k, v in spec.stats.items() if k != "per_request"},
    }


COMMANDS = (export, train, demo)
