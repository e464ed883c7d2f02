"""`specx calibrate`: measure acceptance and costs, choose trees, write them into the manifest.

Steps, all on this machine and the artifact's default build:

1. plain decoding of the prompts (batch 1): the per-token time the speedup is relative to;
2. the drafter on a probe tree (K ranks at each of D depths under the top-1 path; a chain
   for n-gram drafts), counting which rank the target's token had at each depth
   (`AcceptanceCounts`) and acceptance against draft confidence;
3. two chains (depth 1 and D) for the draft-cost fit d = a + b*depth + c*nodes (trees: all
   three runs; chains: the two chain runs alone, since a head drafts a chain in one call of
   its draft_chain graph and a tree depth by depth), and the target's verify curve t(n) at
   the prompts' mean context;
4. the optimal tree per node budget (`best_trees`) and every chain, each with its
   model-predicted speedup (`specx.calibration.costs`);
5. the model's best candidates (3 static trees, 2 chains, EAGLE-2 parameters from the best
   tree; a shape that is a chain measured once) decoded on the prompts, each prompt
   plainly and speculatively back to back, fastest of `repeats` (`specx.calibration.
   timing`), each speculative run as the engine serves a first request, its controller
   sizing every round's draft under the shape (`_AsServed`): the fastest candidate is the
   choice; then the choice at batch 1, 2, 4, 8, measured the same way (batch 1 timed afresh:
   the fastest of several timings reads high; that fresh speedup is the one expected on
   similar prompts), gives the largest batch where speculation still pays 5% (`PAYS`;
   `max_batch_spec`, 0 when it never does: generation then stays plain).

The model narrows hundreds of trees to a handful; measuring the handful keeps what the
model misses (per-round bookkeeping, rank correlations across depths) out of the choice.

On a build whose greedy identity rests on row invariance (INT8, int4 / int8 weight-only,
OpenVINO; `specx.runtime.calibrated.row_exact`) greedy trees are verified through their
spine (`specx.runtime.spine`), which the timed candidates include: trees stay candidates.

Acceptance is measured under the rule the loop applies at the calibrated sampling
setting: greedy verification by default; with `temperature` > 0 (and `top_p`) every run,
plain and speculative, samples with a fixed seed, so the probe counts what the sampled
rules accept (the chain rule, the deterministic-siblings rule for trees: each accepts at
most one child per node, which is all the probe's counting needs) and the candidates are
timed at that setting. Each setting is its own entry, `calibration[<drafter>]` for greedy
and `calibration[<drafter>@T=<t>[,top_p=<p>]]` otherwise (`calibration_key`), written
atomically into manifest.json after everything succeeded: a failed calibration leaves
the manifest as it was. `specx generate` uses the entry nearest its own sampling setting
(`specx.runtime.calibrated.calibrated_choice`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from specx.artifact import load_manifest, manifest_body, write_manifest
from specx.calibration.acceptance import AcceptanceCounts, probe_choices
from specx.calibration.costs import DraftCost, fit_draft_cost, measure_verify_curve
from specx.calibration.layer_skip import SkipChoice, choose_skipped
from specx.calibration.timing import PairedTiming, measure_speedup
from specx.calibration.tree_selection import RankedTree, best_trees, chain_expected
from specx.drafter_name import STEPWISE, DrafterName
from specx.errors import CalibrationError, SpecxError
from specx.manifest_types import (
    CalibratedSampling,
    CalibrationEntry,
    CandidateTiming,
    DynamicChoice,
    ShapeMeasures,
    TreeChoice,
    VerifyShape,
)
from specx.progress import Progress
from specx.runtime.calibrated import calibration_key, choice_shape, row_exact
from specx.runtime.controller import Controller
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.drafters.base import Drafter
from specx.runtime.drafters.layer_skip import parse_layers
from specx.runtime.plain_decoding import check_prompts, generate_plain
from specx.runtime.plans import DraftPlan, Plans
from specx.runtime.sampling import SamplingParams
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets import build_name, open_decoder
from specx.runtime.targets.base import DecoderBackend
from specx.runtime.targets.cpu import CpuTarget
from specx.runtime.tree_shapes import DynamicTree, StaticTree, TreeShape

__all__ = [
    "BatchPoint",
    "CalibrationOptions",
    "CalibrationRun",
    "batch_summary",
    "calibrate_artifact",
    "predicted_speedup",
]

VERIFY_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class CalibrationOptions:
    """What to measure: the drafter (default: the artifact's head), probe size, tokens."""

    drafter: str | None = None
    probe_top_k: int = 4
    probe_depth: int = 6
    max_new_tokens: int = 48
    batches: tuple[int, ...] = (1, 2, 4, 8)
    threads: int | None = None
    repeats: int = 3  # candidate timings: fastest of this many paired runs per prompt
    temperature: float = 0.0  # the sampling setting measured at (0: greedy)
    top_p: float = 1.0
    seed: int = 0  # of every sampled run, so a calibration can be repeated

    def __post_init__(self) -> None:
        if not self.batches or self.batches[0] != 1 or list(self.batches) != sorted(self.batches):
            raise CalibrationError(
                f"calibration batches must rise from 1 (the expected speedup is batch 1's), "
                f"not {self.batches}"
            )

    def sampling(self) -> SamplingParams:
        """The setting every run of the calibration decodes with."""
        try:
            return SamplingParams(self.temperature, top_p=self.top_p, seed=self.seed)
        except ValueError as e:
            raise CalibrationError(f"calibration sampling: {e}") from e


@dataclass(frozen=True)
class CalibrationRun:
    """Prompts decoded one at a time, each its fastest pass: times summed, prefill excluded.

    Plain decoding has no draft, verify or rounds: they count 0.
    """

    decode_s: float
    tokens: int  # new tokens after each prompt's first (at least 1 a prompt)
    draft_s: float = 0.0
    verify_s: float = 0.0
    rounds: int = 0

    def __add__(self, other: CalibrationRun) -> CalibrationRun:
        return CalibrationRun(
            self.decode_s + other.decode_s,
            self.tokens + other.tokens,
            self.draft_s + other.draft_s,
            self.verify_s + other.verify_s,
            self.rounds + other.rounds,
        )

    @property
    def seconds_per_token(self) -> float:
        """Decode time per token: plain decoding's is what every speedup is relative to."""
        return self.decode_s / self.tokens

    @property
    def draft_s_per_round(self) -> float:
        """Drafting time per round, a sample of the draft-cost fit (0 for plain decoding)."""
        return self.draft_s / max(self.rounds, 1)

    @property
    def verify_s_per_round(self) -> float:
        """Verify time per round: beside the verify curve, the loop's overhead per round."""
        return self.verify_s / max(self.rounds, 1)


@dataclass(frozen=True)
class BatchPoint:
    """Speculation's measured speedup at one batch size: a point of the batch curve."""

    batch: int
    measured_speedup: float
    plain_ms_per_token: float | None = None
    speculative_ms_per_token: float | None = None
    acceptance_length: float | None = None  # recorded by a drafter that sizes its own trees

    @classmethod
    def timed(cls, batch: int, timing: PairedTiming) -> BatchPoint:
        """The point of a paired timing at `batch`."""
        return cls(
            batch, timing.speedup, timing.plain_ms_per_token, timing.speculative_ms_per_token
        )

    def to_json(self) -> dict[str, Any]:
        """The report's form (`batch_curve`), as calibrate always wrote it: None left out."""
        recorded = {
            "batch": self.batch,
            "plain_ms_per_token": self.plain_ms_per_token,
            "speculative_ms_per_token": self.speculative_ms_per_token,
            "measured_speedup": self.measured_speedup,
            "acceptance_length": self.acceptance_length,
        }
        return {name: value for name, value in recorded.items() if value is not None}


def predicted_speedup(expected_accepted: float, round_seconds: float, plain_seconds: float):
    """E[tokens per round] * t_plain / round time (see `specx.calibration.costs`)."""
    return (1.0 + expected_accepted) * plain_seconds / round_seconds


def calibrate_artifact(
    artifact_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    options: CalibrationOptions = CalibrationOptions(),
    progress: Progress = lambda message: None,
) -> CalibrationEntry:
    """Measures, chooses and records; returns the calibration entry written to the manifest.

    Raises:
        CalibrationError: no prompts, no drafter, or a prompt too long for the capacity.
        SpecxError: the artifact or drafter spec is invalid.
    """
    manifest = load_manifest(artifact_dir)
    sampling = options.sampling()
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise CalibrationError("calibration needs at least one non-empty prompt")
    head = manifest.drafter
    spec = options.drafter or (None if head is None else head.kind)
    if spec is None:
        raise CalibrationError(
            f"{manifest.root} has no drafter to calibrate: export it with --drafter "
            "(eagle3|eagle|medusa|mtp), or pass --drafter ngram | draft-model:ARTIFACT"
        )
    target = open_decoder(manifest, options.threads)
    skip = _skipped_layers(target, spec, prompts, options, progress)
    if skip is not None:
        spec = f"skip:{','.join(map(str, skip.best.skipped))}"
    if spec == "suffix":
        return _calibrate_budget(manifest, target, spec, prompts, options, sampling, progress)
    # A LOOKUP+KIND drafter's probe and draft costs are its model's (the lookup's rows would
    # count n-gram chains as probe ranks); its candidates are timed whole.
    probed = _modelled(spec)
    top_k = 1 if probed == "ngram" else options.probe_top_k
    heads = None if head is None else head.medusa_heads
    depth = _probe_depth(heads, probed, options.probe_depth, top_k, target)
    for index, prompt in enumerate(prompts):
        try:
            check_prompts(
                [prompt],
                options.max_new_tokens,
                target.capacity,
                target.vocab_size,
                top_k * depth + 1,
            )
        except SpecxError as e:
            raise CalibrationError(f"calibration prompt {index}: {e}") from e

    started = time.perf_counter()
    setting = "greedy" if sampling.greedy else calibration_key("", sampling)[1:]
    progress(f"[1/5] plain decoding of {len(prompts)} prompts ({setting})")
    plain_s = _run(target, None, prompts, options).seconds_per_token

    progress(f"[2/5] {spec} on a probe tree: top-{top_k} x depth {depth}")
    probe = (
        StaticTree.chain(depth)
        if top_k == 1
        else StaticTree.from_choices(probe_choices(top_k, depth))
    )
    counts = AcceptanceCounts(top_k, depth)

    def observe(row, draft, verdict):
        counts.record(draft, probe.ranks, verdict)

    # (depth, nodes, run) for the draft-cost fit: the probe tree, then chains of 1 and D.
    runs = [
        (
            depth,
            probe.max_nodes,
            _run(target, _drafter(probed, target, probe, options), prompts, options, observe),
        )
    ]
    progress("[3/5] draft-cost runs and the verify curve")
    for length in sorted({1, depth}):
        drafter = _drafter(probed, target, StaticTree.chain(length), options)
        runs.append((length, length, _run(target, drafter, prompts, options)))
    samples = [(d, n, r.draft_s_per_round) for d, n, r in runs]
    cost, chain_cost = fit_draft_cost(samples), fit_draft_cost(samples[1:])
    context = int(np.mean([len(p) for p in prompts])) + options.max_new_tokens // 2
    sizes = tuple(n for n in VERIFY_SIZES if n <= target.max_tree_tokens)
    curve = measure_verify_curve(target, sizes, context)
    overhead = float(np.mean([r.verify_s_per_round - curve(n + 1) for _, n, r in runs]))

    progress("[4/5] choosing trees by predicted speedup")
    p = counts.probabilities()

    def round_seconds(depth_: int, nodes: int, chain: bool = False) -> float:
        drafting = (chain_cost if chain else cost)(depth_, nodes)
        return curve(nodes + 1) + max(overhead, 0.0) + drafting

    trees = best_trees(p, target.max_tree_tokens - 1) if top_k > 1 else []
    scored = [
        (predicted_speedup(t.expected_accepted, round_seconds(t.depth, t.nodes), plain_s), t)
        for t in trees
    ]
    chains = [
        (predicted_speedup(chain_expected(p, n), round_seconds(n, n, chain=True), plain_s), n)
        for n in range(1, depth + 1)
    ]
    candidates = _candidates(scored, chains, p, probed)
    progress(f"[5/5] measuring {len(candidates)} candidates, then the batch curve")
    relative = tuple(s / curve.seconds[0] for s in curve.seconds)
    verify = VerifyShape(build_name(manifest), curve.tokens, relative)
    plans = Plans(target, options.threads, verify)
    measured = []
    for i, candidate in enumerate(candidates, 1):
        progress(f"  candidate {i}/{len(candidates)}: {candidate.label}")
        served = _AsServed.of(plans, spec, _candidate_shape(candidate), options)
        measured.append(_with(candidate, measured_speedup=served.time(prompts, 1).speedup))
    choice = _with(
        max(measured, key=_speedup),
        candidates=tuple(
            CandidateTiming(c.label, _predicted_speedup(c), _speedup(c)) for c in measured
        ),
    )
    served = _AsServed.of(plans, spec, _candidate_shape(choice), options)
    batch_curve = _batch_curve(served, choice, prompts, progress)
    seconds = time.perf_counter() - started
    report = {
        **_header(manifest, spec, prompts, options, seconds),
        "acceptance": counts.summary(),
        "costs": {
            "plain_ms_per_token": 1e3 * plain_s,
            "verify_curve": curve.summary(),
            "verify_overhead_ms": 1e3 * overhead,
            "draft_ms": _milliseconds(cost),
            "chain_draft_ms": _milliseconds(chain_cost),
            "draft_cost_c": _draft_cost_c(
                chain_cost if choice.tree == "chain" else cost, choice, curve
            ),
        },
        "trees_by_budget": [
            {
                "nodes": t.nodes,
                "depth": t.depth,
                "expected_accepted": t.expected_accepted,
                "predicted_speedup": s,
            }
            for s, t in scored
        ],
        "chains": [{"length": n, "predicted_speedup": s} for s, n in chains],
        "spine_only": sampling.greedy and row_exact(manifest),
        **({} if skip is None else {"layer_skip": skip.to_json()}),
    }
    entry = _entry(choice, batch_curve, sampling, report, verify)
    name = DrafterName.parse(spec)
    if name.kind == "skip":  # the layers `--drafter skip` then leaves out
        skipped = parse_layers(name.argument or "", target.num_layers)
        entry = replace(entry, skipped_layers=tuple(sorted(skipped)))
    key = calibration_key(DrafterName.parse(spec).kind, sampling)
    write_manifest(manifest.root, manifest_body(manifest.with_calibration(key, entry)))
    progress(
        f"calibrated {spec} ({setting}): {choice.label} "
        f"({_speedup(choice):.2f}x on the calibration prompts), "
        f"{batch_summary(entry.max_batch_spec)}, in {seconds:.0f}s"
    )
    return entry


def _modelled(spec: str) -> str:
    """The model part of a `LOOKUP+KIND` spec (with its argument); any other spec as it is."""
    name = DrafterName.parse(spec)
    return spec if name.combined is None else str(DrafterName(name.combined[1], name.argument))


def _skipped_layers(target, spec: str, prompts, options, progress) -> SkipChoice | None:
    """For `skip` without layers named: the set `choose_skipped` measures best, else None."""
    name = DrafterName.parse(spec)
    if name.kind != "skip" or name.argument is not None:
        return None
    make_drafter("skip:0", target, DrafterOptions(1))  # a build that cannot skip says so now
    assert isinstance(target, CpuTarget)  # the one backend whose drafter above was made
    progress(f"[0/5] choosing the layers skip leaves out ({target.num_layers} layers)")
    return choose_skipped(target, prompts, options.max_new_tokens, options.probe_depth, progress)


def _calibrate_budget(manifest, target, spec, prompts, options, sampling, progress):
    """A drafter that sizes its own trees (suffix): its speedup per batch size, no tree.

    Each speculative run is a fresh engine's first request (`_AsServed`), so nothing learnt
    from an earlier repeat of the same prompt inflates the measurement (a deployment's warm
    drafter does better).
    """
    started = time.perf_counter()
    nodes = make_drafter(spec, target, DrafterOptions(threads=options.threads)).max_nodes
    for index, prompt in enumerate(prompts):
        try:
            check_prompts([prompt], options.max_new_tokens, target.capacity,
                          target.vocab_size, nodes + 1)  # fmt: skip
        except SpecxError as e:
            raise CalibrationError(f"calibration prompt {index}: {e}") from e
    setting = "greedy" if sampling.greedy else calibration_key("", sampling)[1:]
    progress(f"[1/1] {spec} ({nodes}-node budget, {setting}) vs plain at batch sizes "
             f"{', '.join(map(str, options.batches))}")  # fmt: skip
    served = _AsServed.of(Plans(target, options.threads), spec, None, options)
    curve = []
    for batch in options.batches:
        group = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
        timing = served.time(group, batch)
        point = BatchPoint.timed(batch, timing)
        curve.append(replace(point, acceptance_length=timing.acceptance_length))
    first = curve[0].measured_speedup
    choice = TreeChoice(f"{spec}, {nodes}-node budget", "budget", nodes=nodes,
                        measured=ShapeMeasures(measured_speedup=first))  # fmt: skip
    header = _header(manifest, spec, prompts, options, time.perf_counter() - started)
    entry = _entry(choice, curve, sampling, header)
    key = calibration_key(spec, sampling)
    write_manifest(manifest.root, manifest_body(manifest.with_calibration(key, entry)))
    progress(f"calibrated {spec} ({setting}): {first:.2f}x at batch 1, "
             f"{batch_summary(entry.max_batch_spec)}")  # fmt: skip
    return entry


def _entry(
    choice: TreeChoice,
    batch_curve: list[BatchPoint],
    sampling: SamplingParams,
    report: dict,
    verify: VerifyShape | None = None,
) -> CalibrationEntry:
    """The manifest entry: the choice, the largest batch it pays at, what was measured.

    `verify`: the build's verify curve, where calibration measured one.
    """
    max_batch_spec = _max_batch_spec(batch_curve)
    return CalibrationEntry(
        choice,
        max_batch_spec,
        batch_curve[0].measured_speedup if max_batch_spec else 1.0,  # off: plain's speed
        CalibratedSampling(sampling.temperature, sampling.top_p),
        {**report, "batch_curve": [point.to_json() for point in batch_curve]},
        verify,
    )


def _with(choice: TreeChoice, **measures: Any) -> TreeChoice:
    """`choice` with `measures` added to what calibration recorded of it."""
    return replace(choice, measured=replace(choice.measured, **measures))


def _speedup(choice: TreeChoice) -> float:
    """A measured shape's speedup over plain decoding on the calibration prompts."""
    speedup = choice.measured.measured_speedup
    assert speedup is not None, f"{choice.label}: a candidate is timed before it is chosen"
    return speedup


def _predicted_speedup(candidate: TreeChoice) -> float:
    """The cost model's speedup for a candidate (`_candidates` records it)."""
    speedup = candidate.measured.model_speedup
    assert speedup is not None, f"{candidate.label} is a candidate: it has its prediction"
    return speedup


def _header(manifest, spec: str, prompts, options, seconds: float) -> dict[str, Any]:
    """What every calibration entry records about how it was measured, in `seconds`."""
    return {
        "drafter": spec,
        "measured_on": {
            "build": build_name(manifest),
            "prompts": len(prompts),
            "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
            "max_new_tokens": options.max_new_tokens,
            "repeats": options.repeats,
            "seed": options.seed,
            "threads": options.threads,
            "seconds": seconds,
        },
    }


# The least measured speedup that turns speculation on at a batch size: a gain within the
# timing noise of 1 on the calibration prompts is a likely loss on the user's (a speculative
# loop that drafts nothing runs plain decoding's steps, but a benchmark cell timing plain
# decoding against itself spreads several percent either way: docs/decisions.md#pays-margin).
PAYS = 1.05


def _max_batch_spec(curve: list[BatchPoint]) -> int:
    """The largest batch of the curve up to which speculation still paid `PAYS` (0: never)."""
    largest = 0
    for point in curve:
        if point.measured_speedup < PAYS:
            break
        largest = point.batch
    return largest


def batch_summary(max_batch_spec: int) -> str:
    """What a batch threshold means for `specx generate`, in words."""
    if max_batch_spec == 0:
        return (
            f"speculation off: it reached {PAYS}x plain decoding at no batch size measured, "
            "so generate decodes plainly"
        )
    return f"speculation up to batch {max_batch_spec}"


def _probe_depth(
    medusa_heads: int | None, spec: str, depth: int, top_k: int, target: DecoderBackend
) -> int:
    """The probe depth: at most the Medusa heads there are, and the tree must fit a verify."""
    if spec == "medusa" and medusa_heads:
        depth = min(depth, medusa_heads)
    if top_k * depth + 1 > target.max_tree_tokens:
        raise CalibrationError(
            f"a probe tree of {top_k} x {depth} nodes exceeds the artifact's "
            f"{target.max_tree_tokens} verify tokens: lower --probe-top-k/--probe-depth"
        )
    return depth


def _candidate_shape(candidate: TreeChoice) -> StaticTree | DynamicTree:
    """A candidate's tree: `_candidates` makes static, chain and dynamic ones, no budget."""
    shape = choice_shape(candidate)
    assert shape is not None, f"a calibration candidate without a tree: {candidate}"
    return shape


def _drafter(
    spec: str, target: DecoderBackend, shape: StaticTree | DynamicTree, options: CalibrationOptions
):
    return make_drafter(spec, target, _drafter_options(spec, shape, options))


def _drafter_options(
    spec: str, shape: TreeShape | None, options: CalibrationOptions
) -> DrafterOptions:
    """`spec` drafting `shape` (None: its default): n-gram takes a chain as its length."""
    if DrafterName.parse(spec).kind == "ngram":
        count = None if shape is None else shape.max_nodes
        return DrafterOptions(num_draft_tokens=count, threads=options.threads)
    return DrafterOptions(tree=shape, threads=options.threads)


def _run(target, drafter, prompts, options, observer=None) -> CalibrationRun:
    """Decodes the prompts one at a time; returns their times, tokens and rounds summed.

    Each prompt is decoded `options.repeats` times and its fastest pass kept, as the
    candidates are timed: the cost model's inputs (plain ms/token, draft and verify time per
    round) from single passes were biased up by interference and under-predicted every chain
    (docs/decisions.md#calibration-fastest-of-repeats). `observer` sees the first pass only.
    """
    sampling = options.sampling()
    fastest = []
    for prompt in prompts:
        passes = [
            _decode(target, drafter, prompt, options, sampling, observer if i == 0 else None)
            for i in range(options.repeats)
        ]
        fastest.append(min(passes, key=lambda run: run.decode_s))
    return sum(fastest, CalibrationRun(0.0, 0))


def _decode(target, drafter, prompt, options, sampling, observer) -> CalibrationRun:
    """One prompt's decode: its times (prefill excluded), new tokens after the first, rounds."""
    if drafter is None:
        stats = generate_plain(target, [prompt], options.max_new_tokens, sampling).stats
    else:
        stats = generate_speculative(
            target, drafter, [prompt], options.max_new_tokens, sampling, observer=observer
        ).stats
    tokens = max(stats.new_tokens - 1, 1)
    spec = stats.speculative
    if spec is None:
        return CalibrationRun(stats.decode_s, tokens)
    return CalibrationRun(
        stats.decode_s, tokens, spec.draft_s, spec.verify_s, spec.acceptance.rounds
    )


def _candidates(
    scored: list[tuple[float, RankedTree]],
    chains: list[tuple[float, int]],
    p: np.ndarray,
    spec: str,
) -> list[TreeChoice]:
    """The shapes the model ranks best, to be measured.

    The three best static trees, the two best chains (every chain for n-gram), and EAGLE-2
    parameters from the best tree where the drafter grows dynamic trees. A shape that is a
    chain is measured once, as a chain.
    """
    candidates = []
    chain_lengths = [n for _, n in sorted(chains, reverse=True)]
    lengths = set(chain_lengths if spec == "ngram" else chain_lengths[:2])
    for speedup, tree in sorted(scored, key=lambda item: -item[0])[:3]:
        if tree.nodes == tree.depth:  # a chain: measured once, as one
            lengths.add(tree.nodes)
            continue
        candidates.append(
            TreeChoice(
                f"static {tree.nodes} nodes, depth {tree.depth}",
                "static",
                choices=tree.choices,
                nodes=tree.nodes,
                measured=_predicted(tree.depth, tree.expected_accepted, speedup),
            )
        )
    for speedup, length in sorted(chains, reverse=True):
        if length not in lengths:
            continue
        candidates.append(
            TreeChoice(
                f"chain {length}",
                "chain",
                chain_length=length,
                nodes=length,
                measured=_predicted(length, chain_expected(p, length), speedup),
            )
        )
    if scored and DrafterName.parse(spec).kind in STEPWISE:
        speedup, tree = max(scored, key=lambda item: item[0])
        top_k = 1 + max(max(c) for c in tree.choices)
        if top_k > 1:  # top-1 growth is a chain, measured above
            dynamic = DynamicTree.of_nodes(tree.nodes, tree.depth, top_k)
            candidates.append(
                TreeChoice(
                    f"dynamic {dynamic.total_token},{dynamic.depth},{top_k}",
                    "dynamic",
                    dynamic=DynamicChoice(dynamic.total_token, dynamic.depth, top_k),
                    nodes=tree.nodes,
                    measured=_predicted(tree.depth, tree.expected_accepted, speedup),
                )
            )
    return candidates


def _predicted(depth: int, expected_accepted: float, speedup: float) -> ShapeMeasures:
    """What the cost model predicts of a candidate, recorded with it."""
    return ShapeMeasures(depth=depth, expected_accepted=expected_accepted, model_speedup=speedup)


def _batch_curve(served: _AsServed, choice: TreeChoice, prompts, progress) -> list[BatchPoint]:
    """Measured speedup of the chosen tree per batch size (prompts cycled to fill batches).

    Every batch is timed afresh, batch 1 included, `batch` prompts at a time, plainly and
    speculatively, with the same token budget. The choice's own timing is the fastest of
    several noisy ones, so it reads high: kept as batch 1, it turned `skip` on at a measured
    1.058x on pyref-7m, and the default then decoded at 0.91x plain on other prompts
    (docs/decisions.md#batch-one-timed-afresh).
    """
    curve = []
    for batch in served.options.batches:
        progress(f"  batch curve: {choice.label} at batch {batch}")
        group = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
        curve.append(BatchPoint.timed(batch, served.time(group, batch)))
    return curve


@dataclass(frozen=True)
class _AsServed:
    """A shape timed as the engine serves it: its pooled drafter, its per-round controller.

    The engine sizes every round's draft with a controller (`specx.runtime.controller`) that
    the calibrated shape only caps. Timed with whole drafts instead, n-gram's chain 2 beat
    chain 4 here and then capped the controller at 2: 1.04x greedy at batch 1, where the
    uncalibrated chain 4 under its controller made 1.17x
    (docs/decisions.md#calibration-times-the-controller). Every run is a fresh engine's
    first request (`Plans.forget`), as `specx generate` runs: a drafter that learns starts
    empty, the controller knows only the verify curve measured in step 3.
    """

    plans: Plans
    plan: DraftPlan
    options: CalibrationOptions

    @classmethod
    def of(
        cls, plans: Plans, spec: str, shape: TreeShape | None, options: CalibrationOptions
    ) -> _AsServed:
        """`spec` drafting `shape` (None: its own default) through `plans`' engine state."""
        drafter_options = _drafter_options(spec, shape, options)
        return cls(
            plans, DraftPlan(DrafterName.parse(spec), drafter_options, None, True, None), options
        )

    def time(self, prompts: Sequence[Sequence[int]], batch: int) -> PairedTiming:
        """Plain vs served decoding of `prompts`, `batch` at a time (`measure_speedup`)."""
        o = self.options
        return measure_speedup(
            self.plans.target, None, prompts, o.max_new_tokens, o.repeats, batch, o.sampling(),
            new_drafter=self._drafter, new_controller=self._controller,
        )  # fmt: skip

    def _drafter(self) -> Drafter:
        self.plans.forget()
        drafter = self.plans.take(self.plan)
        self.plans.give_back(self.plan, drafter)  # the next run's again, unless it learns
        return drafter

    def _controller(self, drafter: Drafter, prompts: Sequence[Sequence[int]]) -> Controller | None:
        o = self.options
        return self.plans.controller(
            self.plan, drafter, o.sampling(), prompts, o.max_new_tokens, len(prompts)
        )


def _milliseconds(cost: DraftCost) -> dict[str, float]:
    return {
        "per_round": 1e3 * cost.per_round,
        "per_depth": 1e3 * cost.per_depth,
        "per_node": 1e3 * cost.per_node,
    }


def _draft_cost_c(cost: DraftCost, choice: TreeChoice, curve) -> float:
    """Draft time of the chosen tree in units of one target step (the seed's c)."""
    depth = choice.measured.depth
    assert depth is not None, "a chosen tree or chain has its depth (`_predicted`)"
    return cost(depth, choice.nodes) / curve(1)
