"""The `specx` command line: each command's docstring is its help; bodies call the library."""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from specx import __version__
from specx.errors import GenerationError, SpecxError

__all__ = ["main"]


def _progress(message: str) -> None:
    click.echo(message, err=True)


class _SpecxGroup(click.Group):
    """Turns SpecxError into a one-line message and exit code 2 instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SpecxError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(2)


@click.group(cls=_SpecxGroup)
@click.version_option(__version__, prog_name="specx")
@click.option("-v", "--verbose", is_flag=True, help="Log debug details to stderr.")
def main(verbose: bool) -> None:
    """Compile lossless speculative decoding: HF checkpoint -> ONNX artifact -> runtime."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(message)s")


@main.command()
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
    type=int,
    default=None,
    help="Most tokens one verify forward takes (root + draft tree nodes) [default: 64].",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact directory.")
def export(
    target_dir: Path,
    output_dir: Path,
    max_context: int,
    taps: str | None,
    drafter: str | None,
    max_tree_tokens: int,
    overwrite: bool,
) -> None:
    """Export the HF checkpoint in TARGET_DIR to a specx artifact (ONNX + manifest)."""
    from specx.export.target_export import export_target

    export_target(
        target_dir,
        output_dir,
        max_context=max_context,
        taps=taps,
        drafter=drafter,
        max_tree_tokens=max_tree_tokens,
        overwrite=overwrite,
        progress=_progress,
    )


def _read_prompts(
    prompt: str | None, prompt_ids: str | None, prompts_file: Path | None, tokenizer
) -> list[list[int]]:
    given = [x for x in (prompt, prompt_ids, prompts_file) if x is not None]
    if len(given) != 1:
        raise GenerationError("give exactly one of --prompt, --prompt-ids, --prompts-file")
    if prompt_ids is not None:
        try:
            return [[int(t) for t in prompt_ids.split(",")]]
        except ValueError as e:
            raise GenerationError(f"--prompt-ids must be comma-separated integers: {e}") from e
    texts_or_ids: list[str | list[int]] = [prompt] if prompt is not None else []
    if prompts_file is not None:
        for number, line in enumerate(prompts_file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                item = record.get("prompt_ids") or record.get("prompt") or record["turns"][0]
            except (json.JSONDecodeError, KeyError, IndexError, AttributeError, TypeError) as e:
                raise GenerationError(
                    f"{prompts_file}:{number}: expected a JSON object with 'prompt', "
                    f"'prompt_ids' or 'turns': {e}"
                ) from e
            texts_or_ids.append(item)
        if not texts_or_ids:
            raise GenerationError(f"{prompts_file} has no prompts")
    prompts = []
    for item in texts_or_ids:
        if isinstance(item, list):
            prompts.append([int(t) for t in item])
        elif tokenizer is None:
            raise GenerationError(
                "text prompts need a tokenizer; the artifact has none: use --prompt-ids"
            )
        else:
            prompts.append(tokenizer.encode(item))
    return prompts


@main.command()
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompt", help="Prompt text (needs the artifact's tokenizer).")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option(
    "--prompts-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL batch: one object per line with 'prompt', 'prompt_ids' or 'turns'.",
)
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, help="0 = no top-k truncation.")
@click.option("--top-p", default=1.0, show_default=True, help="1.0 = no nucleus truncation.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (reproducible runs).")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the end-of-sequence token.")
@click.option(
    "--drafter",
    help="Decode speculatively: ngram | draft-model:ARTIFACT | eagle3 | eagle | mtp | medusa "
    "(the last four use the head exported into ARTIFACT_DIR).",
)
@click.option(
    "--num-draft-tokens",
    type=int,
    default=None,
    help="Draft tokens per round (chain length; node budget for ngram trees) "
    "[default: the calibrated choice (specx calibrate), else 4].",
)
@click.option(
    "--tree",
    help="Draft tree for model drafters: chain:K, dynamic:TOTAL,DEPTH,TOPK (EAGLE-2), "
    "static:FILE or a JSON choice list such as [[0],[1],[0,0]].",
)
@click.option("--ngram-min", default=1, show_default=True, help="Shortest n-gram to match.")
@click.option("--ngram-max", default=3, show_default=True, help="Longest n-gram to match.")
@click.option(
    "--ngram-matches",
    default=1,
    show_default=True,
    help="Matches merged into the ngram draft tree (1 = chain).",
)
@click.option(
    "--max-batch-spec",
    type=int,
    default=None,
    help="Decode plainly when the batch is larger than this.",
)
@click.option(
    "--compare",
    is_flag=True,
    help="Also run plain decoding in the same process and report the speedup.",
)
@click.option("--threads", type=int, default=None, help="ONNX Runtime threads (default: all).")
@click.option("--json", "as_json", is_flag=True, help="Print tokens, text and stats as JSON.")
def generate(
    artifact_dir: Path,
    prompt: str | None,
    prompt_ids: str | None,
    prompts_file: Path | None,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    ignore_eos: bool,
    drafter: str | None,
    num_draft_tokens: int,
    tree: str | None,
    ngram_min: int,
    ngram_max: int,
    ngram_matches: int,
    max_batch_spec: int | None,
    compare: bool,
    threads: int | None,
    as_json: bool,
) -> None:
    """Generate from the target in ARTIFACT_DIR, plainly or speculatively.

    Runs the artifact's default build (`specx build`); without one, the exported graphs on
    ONNX Runtime (CPU).
    """
    from specx.artifact import load_manifest
    from specx.runtime.backends import open_decoder
    from specx.runtime.calibrated import calibrated_choice, chains_only
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.drafters.tree_search import parse_tree_spec
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.speculative_decoding import generate_speculative
    from specx.runtime.tokenizer import TextTokenizer

    manifest = load_manifest(artifact_dir)
    tokenizer = TextTokenizer(manifest.tokenizer_file) if manifest.tokenizer_file else None
    prompts = _read_prompts(prompt, prompt_ids, prompts_file, tokenizer)
    try:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except ValueError as e:
        raise GenerationError(str(e)) from e
    target = open_decoder(manifest, threads=threads)
    eos = () if ignore_eos else manifest.model["eos_token_ids"]
    if drafter is None:
        if compare:
            raise GenerationError("--compare needs --drafter")
        result = generate_plain(target, prompts, max_new_tokens, sampling, eos)
    else:
        shape = parse_tree_spec(tree) if tree else None
        calibrated = calibrated_choice(manifest, drafter)
        use_calibration = calibrated is not None and tree is None and num_draft_tokens is None
        if use_calibration:
            if drafter.startswith("ngram"):
                num_draft_tokens = calibrated.shape.max_nodes  # a chain
            else:
                shape = calibrated.shape
            if max_batch_spec is None:
                max_batch_spec = calibrated.max_batch_spec
        options = DrafterOptions(
            4 if num_draft_tokens is None else num_draft_tokens,
            shape,
            ngram_min,
            ngram_max,
            ngram_matches,
            threads,
        )
        drafting = make_drafter(drafter, target, options)
        if not drafting.drafts_chains and chains_only(manifest):
            click.echo(
                f"warning: the {manifest.data.get('default_build')} build keeps greedy "
                "speculation identical to its plain decoding for chain drafts only; a tree can "
                "differ where int8 rounding flips a near-tie (pass a chain, or calibrate)",
                err=True,
            )
        result = generate_speculative(
            target,
            drafting,
            prompts,
            max_new_tokens,
            sampling,
            eos,
            max_batch_spec,
        )
        if use_calibration:
            result.stats["calibration"] = {
                "tree": calibrated.description,
                "max_batch_spec": calibrated.max_batch_spec,
                "predicted_speedup": calibrated.predicted_speedup,
            }
        if compare:
            plain = generate_plain(target, prompts, max_new_tokens, sampling, eos)
            result.stats["compare"] = {
                "plain": plain.stats,
                "speedup": plain.stats["ms_per_token"] / result.stats["ms_per_token"],
                "identical_tokens": plain.tokens == result.tokens,
            }
    result.stats["backend"] = manifest.data.get("default_build", "ort")
    texts = [tokenizer.decode(t) if tokenizer else None for t in result.tokens]
    if as_json:
        click.echo(json.dumps({"tokens": result.tokens, "text": texts, "stats": result.stats}))
        return
    for tokens, text in zip(result.tokens, texts, strict=True):
        click.echo(text if text is not None else " ".join(map(str, tokens)))
    _print_stats(result.stats)


def _print_stats(stats: dict[str, Any]) -> None:
    line = (
        f"[{stats['mode']}] {stats['new_tokens']} tokens in {stats['total_s']:.3f}s: "
        f"{stats['tokens_per_s']:.1f} tokens/s, {stats['ms_per_token']:.2f} ms/token "
        f"(batch {stats['batch']})"
    )
    if "acceptance_length" in stats:
        line += (
            f", acceptance length {stats['acceptance_length']:.2f} over {stats['rounds']} rounds"
        )
    if "compare" in stats:
        compare = stats["compare"]
        line += (
            f"; plain {compare['plain']['ms_per_token']:.2f} ms/token, speedup "
            f"{compare['speedup']:.2f}x, identical tokens: {compare['identical_tokens']}"
        )
    if "calibration" in stats:
        calibration = stats["calibration"]
        line += (
            f"; calibrated {calibration['tree']}, predicted speedup "
            f"{calibration['predicted_speedup']:.2f}x"
        )
    if "speculation" in stats:
        line += f"; speculation {stats['speculation']}"
    click.echo(line, err=True)


@main.command()
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
    help="Directory for the drafter in its public format (resumes a saved state).",
)
@click.option("--steps", default=300, show_default=True)
@click.option("--batch", default=8, show_default=True)
@click.option("--seq-len", default=128, show_default=True)
@click.option("--lr", default=1e-3, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--ttt-steps",
    default=3,
    show_default=True,
    help="EAGLE-3/MTP training-time-test steps (later steps weighted 0.8^i).",
)
@click.option(
    "--draft-vocab",
    type=int,
    default=None,
    help="EAGLE-3 draft vocabulary size (most frequent corpus tokens; d2t/t2d).",
)
@click.option("--medusa-heads", default=4, show_default=True)
@click.option(
    "--on-policy",
    "on_policy",
    default=0,
    show_default=True,
    help="Add this many windows continued by sampling from the target (on-policy data).",
)
def train(
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
    on_policy: int,
) -> None:
    """Distil a KIND drafter against the target in TARGET_DIR (soft labels from the target)."""
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
    )
    result = train_drafter(target_dir, corpus, output_dir, config, progress=_progress)
    click.echo(json.dumps(result.report, indent=2))


@main.command()
@click.option(
    "--target",
    "target_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="HF checkpoint to use instead of a random-weight demo model.",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to write the checkpoint and artifact (default: a temp dir).",
)
@click.option("--prompt", default="def fibonacci(n):\n", show_default=True)
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--threads", type=int, default=None)
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
    from specx.artifact import load_manifest
    from specx.export.random_checkpoint import write_random_checkpoint
    from specx.export.target_export import export_target
    from specx.runtime.backends import open_decoder
    from specx.runtime.drafters.ngram import NGramDrafter
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.speculative_decoding import generate_speculative
    from specx.runtime.tokenizer import TextTokenizer

    workdir = workdir or Path(tempfile.mkdtemp(prefix="specx-demo-"))
    if target_dir is None:
        target_dir = workdir / "checkpoint"
        _progress(f"writing a random-weight Llama checkpoint to {target_dir}")
        write_random_checkpoint(target_dir, "llama", "small", seed=0)
    artifact = export_target(
        target_dir, workdir / "artifact", max_context=1024, overwrite=True, progress=_progress
    )
    manifest = load_manifest(artifact)
    tokenizer = TextTokenizer(manifest.tokenizer_file) if manifest.tokenizer_file else None
    prompt_ids = tokenizer.encode(prompt) if tokenizer else [1, 2, 3, 4]
    target = open_decoder(manifest, threads=threads)
    _progress("decoding: plain, then speculative with the n-gram drafter")
    plain = generate_plain(target, [prompt_ids], max_new_tokens)
    spec = generate_speculative(target, NGramDrafter(6), [prompt_ids], max_new_tokens)
    report = {
        "artifact": str(artifact),
        "prompt": prompt,
        "text": tokenizer.decode(spec.tokens[0]) if tokenizer else None,
        "tokens": spec.tokens[0],
        "identical_to_plain": spec.tokens == plain.tokens,
        "speedup": plain.stats["ms_per_token"] / spec.stats["ms_per_token"],
        "plain": plain.stats,
        "speculative": {k: v for k, v in spec.stats.items() if k != "per_request"},
    }
    json.dump(report, sys.stdout, indent=2)
    click.echo()
    _print_stats(plain.stats)
    _print_stats(spec.stats)
    if not report["identical_to_plain"]:
        raise GenerationError("speculative output differs from plain decoding: please report")


if __name__ == "__main__":
    main()


def _add_commands() -> None:
    from specx import cli_build, cli_calibration, cli_quantize

    for command in (cli_build.lint, cli_build.build, cli_build.pack, cli_build.verify):
        main.add_command(command)
    main.add_command(cli_calibration.calibrate)
    main.add_command(cli_quantize.quantize)


_add_commands()
