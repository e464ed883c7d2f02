"""`specx generate`: plain or speculative decoding of an artifact (runtime only: no torch)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from specx.cli.common import (
    BUILD_HELP,
    NATURAL,
    POSITIVE,
    FiniteFloat,
    only_applies,
    passed,
    progress,
    warn,
)
from specx.errors import GenerationError

if TYPE_CHECKING:  # the runtime loads once a command runs (onnxruntime, numpy)
    from specx.runtime.metrics import RunStats
    from specx.runtime.results import Stats

__all__ = ["COMMANDS", "Comparison", "DecodeProgress", "generate", "print_stats"]

_SPECULATIVE_OPTIONS = (
    "num_draft_tokens",
    "tree",
    "ngram_min",
    "ngram_max",
    "ngram_matches",
    "max_batch_spec",
    "compare",
    "fixed_draft",
)
_NGRAM_OPTIONS = ("ngram_min", "ngram_max", "ngram_matches")


class DecodeProgress:
    """Progress of a batched decode on stderr: the first step, then at most every `interval_s`.

    Called by the decoding loops with (tokens emitted so far, sequences finished).
    """

    def __init__(self, label: str, sequences: int, max_new_tokens: int, interval_s: float = 2.0):
        self.label, self.sequences = label, sequences
        self.total = sequences * max_new_tokens
        self.interval_s = interval_s
        self.started = time.perf_counter()
        self.shown_at: float | None = None

    def __call__(self, tokens: int, finished: int) -> None:  # noqa: D102
        now = time.perf_counter()
        last = finished == self.sequences or tokens >= self.total
        if self.shown_at is None or last or now - self.shown_at >= self.interval_s:
            self.shown_at = now
            progress(
                f"{self.label}: {tokens}/{self.total} tokens, {finished}/{self.sequences} "
                f"sequences done, {now - self.started:.1f}s"
            )


def _check_options(ctx: click.Context, drafter: str | None, temperature: float) -> None:
    """Refuses options that would be ignored; warns where the result is still what was asked."""
    speculative = passed(ctx, *_SPECULATIVE_OPTIONS)
    if drafter is None and speculative:
        raise GenerationError(
            only_applies(speculative, "speculative decoding")
            + ": add --drafter (ngram, suffix, skip, draft-model:ARTIFACT, or the artifact's head)"
        )
    ngram = passed(ctx, *_NGRAM_OPTIONS)
    if drafter is not None and not drafter.startswith("ngram") and ngram:
        raise GenerationError(only_applies(ngram, "--drafter ngram"))
    if ctx.params["ngram_min"] > ctx.params["ngram_max"]:
        raise GenerationError(
            f"--ngram-min {ctx.params['ngram_min']} is larger than --ngram-max "
            f"{ctx.params['ngram_max']}"
        )
    truncation = passed(ctx, "top_k", "top_p")
    if temperature == 0 and truncation:
        raise GenerationError(
            only_applies(truncation, "sampling")
            + ": --temperature is 0 (greedy); pass --temperature > 0 to sample"
        )
    if temperature == 0 and passed(ctx, "seed"):
        warn("--seed has no effect: --temperature 0 decodes greedily, which is deterministic")


@click.command(short_help="Generate from an artifact, plainly or speculatively.")
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompt", help="Prompt text (needs the artifact's tokenizer).")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option(
    "--prompts-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL batch: one object per line with 'prompt', 'prompt_ids' or 'turns'.",
)
@click.option("--max-new-tokens", type=POSITIVE, default=64, show_default=True)
@click.option(
    "--temperature", type=FiniteFloat(min=0), default=0.0, show_default=True, help="0 = greedy."
)
@click.option(
    "--top-k", type=NATURAL, default=0, show_default=True, help="0 = no top-k truncation."
)
@click.option(
    "--top-p",
    type=FiniteFloat(min=0, max=1, min_open=True),
    default=1.0,
    show_default=True,
    help="1.0 = no nucleus truncation.",
)
@click.option("--seed", type=NATURAL, default=None, help="Seed for sampling (reproducible runs).")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the end-of-sequence token.")
@click.option(
    "--drafter",
    help="Decode speculatively: ngram | suffix | skip[:LAYERS] | draft-model:ARTIFACT | eagle3 "
    "| eagle | mtp | medusa (the last four use the head exported into ARTIFACT_DIR; skip: the "
    "target with some layers left out drafts for itself, on a cpu build; LAYERS e.g. 4,6,8-11, "
    "default the calibrated ones).",
)
@click.option(
    "--num-draft-tokens",
    type=POSITIVE,
    default=None,
    help="Draft tokens per round (chain length; node budget for ngram and suffix trees) "
    "[default: the calibrated choice (specx calibrate), else 4; 16 for suffix].",
)
@click.option(
    "--tree",
    help="Draft tree for model drafters: chain:K, dynamic:TOTAL,DEPTH,TOPK (EAGLE-2), "
    "static:FILE or a JSON choice list such as [[0],[1],[0,0]].",
)
@click.option("--ngram-min", type=POSITIVE, default=1, show_default=True, help="Shortest n-gram.")
@click.option("--ngram-max", type=POSITIVE, default=3, show_default=True, help="Longest n-gram.")
@click.option(
    "--ngram-matches",
    type=POSITIVE,
    default=1,
    show_default=True,
    help="Matches merged into the ngram draft tree (1 = chain).",
)
@click.option(
    "--max-batch-spec",
    type=NATURAL,
    default=None,
    help="Decode plainly when the batch is larger than this (0 = never speculate).",
)
@click.option(
    "--compare",
    is_flag=True,
    help="Also run plain decoding in the same process and report the speedup.",
)
@click.option(
    "--fixed-draft",
    is_flag=True,
    help="Draft the whole tree every round. By default each sequence's draft is sized per "
    "round from its own acceptance and the measured costs, down to none where it does not pay.",
)
@click.option("--threads", type=POSITIVE, default=None, help="ONNX Runtime threads (default: all).")
@click.option("--build", "build_name", default=None, help=BUILD_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print tokens, text and stats as JSON.")
@click.pass_context
def generate(
    ctx: click.Context,
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
    num_draft_tokens: int | None,
    tree: str | None,
    ngram_min: int,
    ngram_max: int,
    ngram_matches: int,
    max_batch_spec: int | None,
    compare: bool,
    fixed_draft: bool,
    threads: int | None,
    build_name: str | None,
    as_json: bool,
) -> None:
    """Generate from the target in ARTIFACT_DIR, plainly or speculatively.

    Runs the artifact's default build (`specx export` builds ort-fp32, `specx build` others),
    or the one --build names.
    """
    from specx.runtime.engine import Speculation, load
    from specx.runtime.prompts import read_prompts
    from specx.runtime.tree_shapes import parse_tree_spec

    _check_options(ctx, drafter, temperature)
    shape = parse_tree_spec(tree) if tree else None
    engine = load(artifact_dir, threads=threads, build=build_name)
    encode = engine.tokenizer.encode if engine.tokenizer else None
    prompts = read_prompts(prompt, prompt_ids, prompts_file, encode)
    speculation = None
    if drafter is not None:
        ngram = (ngram_min, ngram_max, ngram_matches)
        speculation = Speculation(
            drafter, num_draft_tokens, shape, ngram, max_batch_spec, not fixed_draft
        )
    options: dict[str, Any] = {  # generate_batch's keyword arguments
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "seed": seed,
        "ignore_eos": ignore_eos,
    }
    show = prompts_file is not None or len(prompts) > 1

    def progress(label: str) -> DecodeProgress | None:
        return DecodeProgress(label, len(prompts), max_new_tokens) if show else None

    label = "decoding plainly" if drafter is None else f"decoding with {drafter}"
    done = engine.generate_batch(
        prompts, **options, speculation=speculation, progress=progress(label)
    )
    stats = done[0].stats
    comparison: Comparison | None = None
    if compare and drafter is not None:
        plain = engine.generate_batch(prompts, **options, progress=progress("decoding plainly"))
        spec = stats.run.speculative
        drafted = spec is not None and spec.acceptance.rounds_with_draft > 0
        comparison = Comparison(
            plain=plain[0].stats,
            # Where the run drafted nothing (calibration or the controller turned it off), both
            # sides decoded plainly: their ratio is noise, not a speedup.
            speedup=plain[0].stats.ms_per_token / stats.ms_per_token if drafted else None,
            # Sampled speculation matches the target's distribution, not plain decoding's
            # draws token for token (its random stream is consumed differently): no verdict.
            identical_tokens=[c.tokens for c in plain] == [c.tokens for c in done]
            if temperature == 0
            else None,
        )
    if as_json:
        texts = [c.text for c in done]
        report = stats.to_json()
        if comparison is not None:
            report["compare"] = comparison.to_json()
        click.echo(json.dumps({"tokens": [c.tokens for c in done], "text": texts, "stats": report}))
        return
    for i, completion in enumerate(done):
        if len(done) > 1:
            click.echo(f"--- completion {i + 1}/{len(done)} ---")
        text = completion.text
        click.echo(text if text is not None else " ".join(map(str, completion.tokens)))
    print_stats(stats, comparison)


@dataclass(frozen=True)
class Comparison:
    """`--compare`: the same prompts decoded plainly, against the speculative run."""

    plain: Stats
    speedup: float | None  # plain ms/token over speculative; None: both decoded plainly
    identical_tokens: bool | None  # None: sampled (lossless in distribution only)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, as the speculative stats' "compare"."""
        return {
            "plain": self.plain.to_json(),
            "speedup": self.speedup,
            "identical_tokens": self.identical_tokens,
        }

    def describe(self, speculation: str) -> str:
        """The comparison in words; `speculation`: the run's ("on", or why it was off)."""
        if self.identical_tokens is None:
            verdict = "sampled: lossless in distribution, not token by token"
        else:
            verdict = f"identical tokens: {self.identical_tokens}"
        if self.speedup is None:
            why = "" if speculation == "on" else f" ({speculation})"
            return (
                f"plain {self.plain.ms_per_token:.2f} ms/token; both runs decoded plainly{why}, "
                f"so there is no speedup to report; {verdict}"
            )
        return (
            f"plain {self.plain.ms_per_token:.2f} ms/token, speedup {self.speedup:.2f}x, {verdict}"
        )


def print_stats(stats: Stats | RunStats, compare: Comparison | None = None) -> None:
    """One line of stats on stderr: totals, decode ms/token and ms/step, acceptance.

    `stats`: an engine's (with its build, calibration and speculation), or a decoding
    loop's.
    """
    from specx.runtime.results import Stats

    run = stats.run if isinstance(stats, Stats) else stats
    line = (
        f"[{run.mode}] {run.new_tokens} tokens in {run.total_s:.3f}s "
        f"(prefill {run.prefill_s:.3f}s): {run.tokens_per_s:.1f} tokens/s; decode "
        f"{run.ms_per_token:.2f} ms/token, {run.ms_per_step:.2f} ms/step (batch {run.batch}"
    )
    line += f", build {stats.build})" if isinstance(stats, Stats) else ")"
    spec = run.speculative
    if spec is not None:
        acceptance = spec.acceptance
        line += (
            f", acceptance length {acceptance.acceptance_length:.2f} over {acceptance.rounds} "
            "rounds"
        )
    if compare is not None:
        speculation = stats.speculation if isinstance(stats, Stats) else "on"
        line += "; " + compare.describe(speculation)
    calibrated = stats.calibrated if isinstance(stats, Stats) else None
    if calibrated is not None:
        line += (
            f"; calibrated {calibrated.description}, predicted speedup "
            f"{calibrated.predicted_speedup:.2f}x"
        )
    if spec is not None and spec.controller is not None:
        sizes = ", ".join(f"{k}: {n}" for k, n in spec.controller.sizes_chosen.items())
        line += f"; draft sizes chosen (size: rows) {sizes}"
    if run.speculation_off is not None:
        speculation = stats.speculation if isinstance(stats, Stats) else run.speculation_off
        line += f"; speculation {speculation}"
    click.echo(line, err=True)


COMMANDS = (generate,)
