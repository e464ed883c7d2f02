"""Trained-head drafters are lossless: greedy equality for every head and tree kind,
sampling distributions equal to plain sampling, and EAGLE-3's d2t mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from broken_verifiers import broken_verify
from chi_square import p_values
from conftest import HEAD_VOCAB
from specx.artifact import load_manifest
from specx.export.checkpoint import load_checkpoint
from specx.export.heads import load_head
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.drafters.medusa import MEDUSA_DEFAULT_TREE
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.sampling import SamplingParams
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets.ort import OrtTarget
from specx.runtime.tree_shapes import StaticTree, parse_tree_spec
from specx.runtime.verification import verify

TREES = ["chain:3", "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]", "dynamic:9,2,3"]
HEADS = {
    "eagle3": TREES,
    "eagle3-modelopt": ["dynamic:11,3,2"],
    "eagle": TREES,
    "mtp-deepseek": TREES,
    "mtp-qwen3_next": ["chain:2", "dynamic:7,1,3"],
    "mtp-mimo": ["chain:2", "dynamic:7,1,3"],
    "medusa": ["chain:4", "[[0],[1],[0,0],[0,1],[1,0],[0,0,0],[0,0,0,0]]"],
}


def drafter_for(target, name, tree):
    kind = name.split("-")[0]
    return make_drafter(kind, target, DrafterOptions(tree=parse_tree_spec(tree)))


@pytest.mark.parametrize("name", list(HEADS))
def test_greedy_equals_plain(name, head_artifacts, rng):
    target = OrtTarget(load_manifest(head_artifacts[name]), threads=2)
    prompts = [rng.integers(1, HEAD_VOCAB, n).tolist() for n in (3, 8, 5, 12, 2, 7)]
    accepted = 0
    for tree in HEADS[name]:
        drafter = drafter_for(target, name, tree)
        for batch in (1, 3):
            for start in range(0, len(prompts), batch):
                chunk = prompts[start : start + batch]
                plain = generate_plain(target, chunk, 30)
                spec = generate_speculative(target, drafter, chunk, 30)
                assert spec.tokens == plain.tokens, f"{name} {tree} {chunk}"
                accepted += spec.stats.speculative.acceptance.accepted_tokens
    assert accepted > 0


def test_medusa_default_tree(head_artifacts):
    target = OrtTarget(load_manifest(head_artifacts["medusa"]), threads=2)
    drafter = make_drafter("medusa", target, DrafterOptions())
    assert drafter.max_nodes == len(MEDUSA_DEFAULT_TREE) == 63
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    spec = generate_speculative(target, drafter, prompts, 24)
    assert spec.tokens == generate_plain(target, prompts, 24).tokens
    assert spec.stats.speculative.acceptance.accepted_tokens > 0


DISTRIBUTION_CASES = [
    ("eagle3", "dynamic:7,2,2"),
    ("eagle", "dynamic:17,2,6"),
    ("eagle", "chain:3"),
    ("mtp-deepseek", "dynamic:7,2,2"),
    ("medusa", "[[0],[1],[2],[3],[4],[5],[0,0],[1,0]]"),
    ("medusa", "chain:3"),
]


def sample_both(target, drafter, verifier):
    prompts = [[1, 2, 3, 4]] * 3000
    plain = generate_plain(target, prompts, 3, SamplingParams(temperature=0.7, seed=5))
    spec = generate_speculative(
        target, drafter, prompts, 3, SamplingParams(temperature=0.7, seed=6), verifier=verifier
    )
    return plain, spec


@pytest.mark.parametrize(("name", "tree"), DISTRIBUTION_CASES)
def test_sampling_matches_plain(name, tree, head_artifacts):
    target = OrtTarget(load_manifest(head_artifacts[name]), threads=2)
    plain, spec = sample_both(target, drafter_for(target, name, tree), verify)
    assert spec.stats.speculative.acceptance.accepted_tokens > 0
    assert min(p_values(plain, spec, HEAD_VOCAB)) > 1e-3


# Random heads agree with the target rarely; these cases accept often enough that a
# wrong residual (sampled chain) or a missing p(c) <- 0 (top-k tree) shows.
@pytest.mark.parametrize(
    ("name", "tree"), [("eagle3", "chain:3"), ("eagle3", "dynamic:7,2,2"), ("medusa", "chain:3")]
)
def test_broken_verifier_is_detected(name, tree, head_artifacts):
    target = OrtTarget(load_manifest(head_artifacts[name]), threads=2)
    plain, spec = sample_both(target, drafter_for(target, name, tree), broken_verify)
    assert min(p_values(plain, spec, HEAD_VOCAB)) < 1e-6


def test_eagle3_d2t_maps_draft_ids_to_target_ids(head_target, head_dirs, head_artifacts):
    from safetensors.torch import load_file

    tensors = load_file(head_dirs["eagle3"] / "model.safetensors")
    in_draft_vocab = set((torch.arange(20) + tensors["d2t"]).tolist())
    assert len(in_draft_vocab) == 20 and in_draft_vocab != set(range(20))
    target = OrtTarget(load_manifest(head_artifacts["eagle3"]), threads=2)
    drafter = make_drafter("eagle3", target, DrafterOptions(tree=StaticTree.chain(1)))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    output = generate_plain(target, prompts, 1)
    histories = [p + t for p, t in zip(prompts, output.tokens, strict=True)]
    from specx.runtime.plain_decoding import prefill

    cache = target.allocate_cache(2, 32)
    _, step = prefill(target, cache, prompts)
    drafter.start(prompts, 64, [step.taps[b, : len(p)] for b, p in enumerate(prompts)])
    drafts = drafter.propose(histories, np.array([True, True]), SamplingParams(), None)
    # The head, run in torch on the same inputs, picks draft id i; the proposal is i + d2t[i].
    head = load_head(f"eagle3:{head_dirs['eagle3']}", load_checkpoint(head_target))
    for b, history in enumerate(histories):
        n = len(history) - 1
        taps = torch.from_numpy(step.taps[b, :n][None])
        ids = torch.tensor([history[1:]])
        cache_t = [
            torch.zeros(1, head.config.num_kv_heads, n, head.config.head_dim) for _ in range(2)
        ]
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        with torch.no_grad():
            logits = head(
                ids,
                head.project(taps),
                torch.arange(n)[None],
                mask,
                torch.zeros(1, dtype=torch.int64),
                cache_t,
            )[0]
        draft_id = int(logits[0, -1].argmax())
        proposed = int(drafts[b].tokens[0])
        assert proposed == draft_id + int(tensors["d2t"][draft_id])
        assert proposed in in_draft_vocab
    # Across many greedy and sampled rounds, no proposal leaves the draft vocabulary.
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=0)):
        tree_drafter = make_drafter(
            "eagle3", target, DrafterOptions(tree=parse_tree_spec("dynamic:9,2,3"))
        )
        chain_drafter = make_drafter("eagle3", target, DrafterOptions(tree=StaticTree.chain(3)))
        for drafter in (tree_drafter, chain_drafter):
            seen = []
            original = drafter.propose

            def spy(*args, original=original, seen=seen):
                trees = original(*args)
                seen.extend(int(t) for tree in trees for t in tree.tokens)
                return trees

            drafter.propose = spy
            generate_speculative(target, drafter, [[1, 2, 3], [5, 5, 5]], 20, sampling)
            assert seen and set(seen) <= in_draft_vocab


def test_eagle3_projects_taps_once_per_proposal_with_the_drafts_of_eager_projection(
    head_artifacts,
):
    """Taps wait unprojected until the head reads them: one projection call per proposal
    (every row's pending taps together, the prompts' with the first), none at the end of a
    stretch the head never reads, none at all in a request that never drafts, and the
    drafts are those of projecting every stretch's taps as they arrive."""
    from specx.runtime.controller import FixedSizes

    target = OrtTarget(load_manifest(head_artifacts["eagle3"]), threads=2)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 6, 2]]

    def run(eager: bool, cycle=(0, 0, 0, 0, 0, 2)) -> tuple[list, int, int]:
        drafter = make_drafter("eagle3", target, DrafterOptions(tree=StaticTree.chain(2)))
        projection, propose, calls = drafter.projection, drafter.propose, [0, 0]

        def counted(x):
            calls[0] += 1
            return projection(x)

        def counted_propose(*args, **kwargs):
            calls[1] += 1
            return propose(*args, **kwargs)

        drafter.projection, drafter.propose = counted, counted_propose
        if eager:  # the former rule: project each accepted stretch at once
            accept = drafter.accept

            def accept_and_project(*args):
                accept(*args)
                drafter._project_pending()

            drafter.accept = accept_and_project
        drafts: list = []
        result = generate_speculative(
            target,
            drafter,
            prompts,
            40,
            controller=FixedSizes(list(cycle)),
            observer=lambda row, draft, verdict: drafts.append((row, draft.tokens.tolist())),
        )
        assert result.tokens == generate_plain(target, prompts, 40).tokens
        return drafts, calls[0], calls[1]

    lazy, lazy_calls, proposals = run(eager=False)
    eager, eager_calls, _ = run(eager=True)
    assert lazy and lazy == eager
    assert lazy_calls == proposals
    assert eager_calls > lazy_calls
    assert run(eager=False, cycle=(0,))[1:] == (0, 0)


@pytest.mark.parametrize("name", ["eagle3", "eagle", "mtp-deepseek", "draft-model"])
@pytest.mark.parametrize("tree", ["chain:3", "dynamic:9,2,3"])
def test_prepare_leaves_the_first_proposal_as_without_it(name, tree, head_artifacts):
    """`prepare` (the drafter's deferred prefill) feeds up to the roots' positions only: the
    first proposal after it drafts what a proposal straight after `start` does."""
    from specx.runtime.drafters.draft_model import DraftModelDrafter
    from specx.runtime.plain_decoding import prefill

    target = OrtTarget(load_manifest(head_artifacts["eagle3" if name == "draft-model" else name]))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    first = generate_plain(target, prompts, 1).tokens
    histories = [p + t for p, t in zip(prompts, first, strict=True)]
    _, step = prefill(target, target.allocate_cache(2, 32), prompts)
    taps = [step.taps[b, : len(p)] for b, p in enumerate(prompts)]

    def first_proposal(prepared: bool):
        if name == "draft-model":  # the target drafting for itself
            drafter = DraftModelDrafter(target, parse_tree_spec(tree))
        else:
            drafter = drafter_for(target, name, tree)
        drafter.start(prompts, 64, taps)
        if prepared:
            drafter.prepare(histories)
        return drafter.propose(histories, np.array([True, True]), SamplingParams(), None)

    for with_prepare, without in zip(first_proposal(True), first_proposal(False), strict=True):
        np.testing.assert_array_equal(with_prepare.tokens, without.tokens)
        np.testing.assert_array_equal(with_prepare.parents, without.parents)
        np.testing.assert_allclose(with_prepare.confidence, without.confidence, rtol=1e-5)


def test_prepare_runs_once_before_the_first_proposal_outside_the_rounds_timing(head_artifacts):
    """Both loops (a static batch, continuous batching) call a drafter's deferred prefill
    once per request, before its first proposal, and keep its time out of what the
    controller is told a round's drafting cost and out of the rounds' drafting time in the
    stats, which report it apart."""
    import time

    from specx.runtime.continuous import BatchSequence, ContinuousBatch
    from specx.runtime.controller import FixedSizes

    target = OrtTarget(load_manifest(head_artifacts["eagle3"]), threads=2)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    slow = 1.0  # a prefill far slower than any round here, even on a loaded machine

    def instrumented():
        drafter, calls = drafter_for(target, "eagle3", "chain:2"), []
        prepare, propose = drafter.prepare, drafter.propose

        def slow_prepare(histories):
            calls.append("prepare")
            time.sleep(slow)
            prepare(histories)

        def counted_propose(*args, **kwargs):
            calls.append("propose")
            return propose(*args, **kwargs)

        drafter.prepare, drafter.propose = slow_prepare, counted_propose
        return drafter, calls

    class Recorder(FixedSizes):  # drafts 2 nodes every round; keeps the timings it is told
        def timed(self, width: int, verify_s: float, draft_s: float) -> None:
            self.draft_times.append(draft_s)

    def recorder() -> Recorder:
        controller = Recorder([2])
        controller.draft_times = []
        return controller

    drafter, calls = instrumented()
    controller = recorder()
    result = generate_speculative(target, drafter, prompts, 12, controller=controller)
    assert result.tokens == generate_plain(target, prompts, 12).tokens
    assert calls[0] == "prepare" and calls.count("prepare") == 1 and "propose" in calls
    assert controller.draft_times and max(controller.draft_times) < slow
    spec = result.stats.speculative
    assert spec is not None and spec.draft_prefill_s >= slow > spec.draft_s

    batch, rows = ContinuousBatch(target, 2), []
    for prompt in prompts:
        drafter, calls = instrumented()
        controller = recorder()
        row = BatchSequence(
            prompt, 12, SamplingParams(), frozenset(), lambda _r, _t: True, drafter, controller
        )
        batch.admit(row)
        rows.append((row, calls, controller))
    while batch.running:
        batch.step()
    for row, calls, controller in rows:
        assert row.emitted == generate_plain(target, [row.prompt], 12).tokens[0]
        assert calls[0] == "prepare" and calls.count("prepare") == 1 and "propose" in calls
        assert controller.draft_times and max(controller.draft_times) < slow
    assert batch.draft_prefill_s >= 2 * slow > batch.draft_s
