"""End to end: speculative sampling draws the first tokens from the same distribution as plain.

Thousands of copies of one prompt run as one batch, plainly and speculatively; a
chi-square test per output position compares the two token histograms. The same test
run with a deliberately broken verifier must reject, which shows the test has power.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from unittest import mock

import pytest

from broken_verifiers import broken_verify
from chi_square import p_values
from conftest import perturbed_copy
from cost_curves import FixedCurve
from no_replay import NoReplay
from specx.artifact import load_manifest
from specx.runtime import rounds
from specx.runtime.controller import ConfidenceController, FixedSizes, Schedule
from specx.runtime.drafters.combined import CombinedDrafter
from specx.runtime.drafters.draft_model import DraftModelDrafter
from specx.runtime.drafters.ngram import NGramDrafter
from specx.runtime.drafters.suffix import SuffixDrafter, SuffixOptions
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.sampling import SamplingParams
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets.ort import OrtTarget
from specx.runtime.tree_shapes import DynamicTree, StaticTree
from specx.runtime.verification import verify

SAMPLES = 4000
POSITIONS = 3
VOCAB = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A small-vocabulary target with peaked distributions and a noisy copy as draft."""
    from safetensors.torch import load_file, save_file

    from specx.export.random_checkpoint import CheckpointPreset, write_random_checkpoint
    from specx.export.target_export import export_target

    root = tmp_path_factory.mktemp("distribution")
    path = write_random_checkpoint(
        root / "target", "llama", CheckpointPreset(32, 64, 2, 4, 2, VOCAB), seed=5, tokenizer=False
    )
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] *= 60.0  # logits with a few-nats spread, not near-uniform
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    draft = perturbed_copy(path, root / "draft", noise=0.5, seed=1)
    target_art = export_target(path, root / "target-art", max_context=48)
    draft_art = export_target(draft, root / "draft-art", max_context=48)
    target = OrtTarget(load_manifest(target_art), threads=2)
    # The target's own greedy text, repeated: prompt lookup then drafts likely tokens.
    greedy = [1, 2, 3] + generate_plain(target, [[1, 2, 3]], 10).tokens[0]
    return target, OrtTarget(load_manifest(draft_art), threads=2), greedy + greedy[:6]


DRAFTERS = {
    "draft-chain": lambda draft: DraftModelDrafter(draft, StaticTree.chain(3)),
    "draft-tree-topk": lambda draft: DraftModelDrafter(
        draft, StaticTree.from_choices([[0], [1], [0, 0], [1, 0]])
    ),
    "draft-tree-iid": lambda draft: DraftModelDrafter(
        draft, StaticTree.from_choices([[0], [1], [0, 0]]), iid_siblings=True
    ),
    "draft-dynamic": lambda draft: DraftModelDrafter(draft, DynamicTree.of_nodes(6, 3, 2)),
    "ngram": lambda draft: NGramDrafter(3, max_matches=2),
    # The n-gram where the prompt repeats, the draft model's samples elsewhere, per row.
    "ngram+draft": lambda draft: CombinedDrafter(
        NGramDrafter(3, min_n=2), DraftModelDrafter(draft, StaticTree.chain(3))
    ),
    "suffix": lambda draft: SuffixDrafter(SuffixOptions(max_nodes=4, min_prob=0.0)),
}
SAMPLING = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=8),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.95),
]


def run(pair, drafter_name, sampling, verifier, seed, controller=None):
    target, draft, prompt = pair
    prompts = [prompt] * SAMPLES
    params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
    plain = generate_plain(target, prompts, POSITIONS, params)
    spec_params = SamplingParams(
        sampling.temperature, sampling.top_k, sampling.top_p, seed=seed + 1
    )
    drafter = DRAFTERS[drafter_name](draft)
    spec = generate_speculative(
        target, drafter, prompts, POSITIONS, spec_params, verifier=verifier, controller=controller
    )
    return plain, spec


# Each drafter under two of the settings, each setting under three drafters: the rule is one
# for every drafter, so a full grid would test the same verification 24 times.
GRID = [
    (name, SAMPLING[i])
    for name, pair in zip(
        DRAFTERS, [(0, 1), (2, 3), (0, 2), (1, 3), (0, 2), (0, 3), (1, 3)], strict=True
    )
    for i in pair
]


@pytest.mark.parametrize(
    ("drafter_name", "sampling"),
    GRID,
    ids=[f"{n}-T{s.temperature}-k{s.top_k}-p{s.top_p}" for n, s in GRID],
)
def test_speculative_sampling_matches_plain(pair, drafter_name, sampling):
    plain, spec = run(pair, drafter_name, sampling, verify, seed=11)
    acceptance = spec.stats.speculative.acceptance
    accepted = acceptance.accepted_tokens
    assert 0 < accepted < SAMPLES * (POSITIONS - 1), "drafts must be accepted only sometimes"
    assert min(p_values(plain, spec, VOCAB)) > 1e-3, acceptance.acceptance_by_position


@pytest.mark.parametrize(
    "drafter_name", ["draft-chain", "draft-tree-topk", "draft-tree-iid", "ngram+draft", "suffix"]
)
def test_broken_verifier_is_detected(pair, drafter_name):
    plain, spec = run(pair, drafter_name, SAMPLING[0], broken_verify, seed=11)
    assert min(p_values(plain, spec, VOCAB)) < 1e-6


# Sizes switch every round (none included); each row of the batch follows the cycle.
SWITCHING = [2, 0, 0, 1, 3]  # with an idle stretch: plain steps in a row


@pytest.mark.parametrize(
    ("drafter_name", "sampling"),
    [("draft-chain", SAMPLING[0]), ("draft-tree-topk", SAMPLING[3]), ("suffix", SAMPLING[0])],
    ids=["draft-chain-T0.7", "draft-tree-topk-T0.7-k10-p0.95", "suffix-T0.7"],
)
def test_sampling_with_switching_draft_sizes_matches_plain(pair, drafter_name, sampling):
    controller = FixedSizes(SWITCHING)
    plain, spec = run(pair, drafter_name, sampling, verify, seed=11, controller=controller)
    speculative = spec.stats.speculative
    assert speculative.controller.sizes_chosen.keys() >= {0, 2}  # the first two rounds: 2, then 0
    assert min(p_values(plain, spec, VOCAB)) > 1e-3, speculative.acceptance.acceptance_by_position


@pytest.mark.parametrize("drafter_name", ["draft-chain", "draft-tree-topk"])
def test_broken_verifier_is_detected_with_switching_sizes(pair, drafter_name):
    switching = FixedSizes(SWITCHING)
    plain, spec = run(pair, drafter_name, SAMPLING[0], broken_verify, seed=11, controller=switching)
    assert min(p_values(plain, spec, VOCAB)) < 1e-6


def run_trimmed(pair, sampling, verifier, chunk=8, positions=8, replays=False):
    """`run` for suffix drafts trimmed by their confidence, in batches of `chunk`.

    One kept size serves a batch (its verify forward is as wide as its widest row), so
    small batches, each with its own controller at fixed steep costs, make what is kept
    depend on a few rows' drafts and on what their earlier rounds accepted (over more
    positions than `run`'s: the first two are plain steps); a patience of 1 and quick
    probes add idle rows. Such short requests would be played plainly from their first
    stretch on (`PROBE_TAIL`, a cost rule that only lengthens plain stretches): it is off.
    Without `replays` every window of asking opens on a probe (with them, a random target
    keeps most windows shut).

    Returns:
        (plain result, the speculative tokens as a result's `tokens`, sizes chosen: count).
    """
    target, _, prompt = pair
    plain = generate_plain(target, [prompt] * SAMPLES, positions, sampling_with(sampling, 11))
    tokens, sizes = [], Counter()
    for start in range(0, SAMPLES, chunk):
        controller = ConfidenceController(
            costs=FixedCurve(0.3), patience=1, schedule=Schedule(probe_every=2, probe_budget=0.5)
        )
        drafter = SuffixDrafter(SuffixOptions(max_nodes=6, min_prob=0.0))
        if not replays:
            drafter = NoReplay(drafter)
        params = sampling_with(sampling, 1000 + start)
        with mock.patch.object(rounds, "PROBE_TAIL", 0):
            spec = generate_speculative(target, drafter, [prompt] * chunk, positions, params,
                                        verifier=verifier, controller=controller)  # fmt: skip
        tokens += spec.tokens
        sizes.update(spec.stats.speculative.controller.sizes_chosen)
    return plain, SimpleNamespace(tokens=tokens), sizes


def sampling_with(sampling: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)


@pytest.mark.parametrize("sampling", [SAMPLING[0], SAMPLING[1], SAMPLING[3]],
                         ids=["T0.7", "T1-k8", "T0.7-k10-p0.95"])  # fmt: skip
def test_sampling_with_drafts_trimmed_by_confidence_matches_plain(pair, sampling):
    plain, spec, sizes = run_trimmed(pair, sampling, verify)
    assert len(sizes) >= 4, sizes
    assert min(p_values(plain, spec, VOCAB)) > 1e-3


def test_sampling_with_windows_opened_by_replays_matches_plain(pair):
    plain, spec, sizes = run_trimmed(pair, SAMPLING[0], verify, replays=True)
    assert len(sizes) >= 2, sizes
    assert min(p_values(plain, spec, VOCAB)) > 1e-3


def test_broken_verifier_is_detected_with_confidence_trimming(pair):
    plain, spec, _ = run_trimmed(pair, SAMPLING[0], broken_verify)
    assert min(p_values(plain, spec, VOCAB)) < 1e-6
