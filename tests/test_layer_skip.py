"""`--drafter skip`: the target drafts for itself with layers skipped, on a cpu build.

Its layer sets as users spell them, its view sharing the target's weights, greedy identity
for chains and trees, the sampled rule's distribution (with a broken verifier caught), and a
clear refusal on builds that would need a second copy of the weights.
"""

from __future__ import annotations

import shutil

import pytest

from specx.errors import SpecxError
from specx.runtime import kernels
from specx.runtime.drafters.layer_skip import default_skipped, parse_layers

needs_kernels = pytest.mark.skipif(kernels.library() is None, reason=kernels.unavailable() or "")
PROMPTS = [[5, 9, 5, 9, 5, 9, 13, 5, 9, 5, 9], [7, 3, 11, 7, 3, 11, 7, 3], [4, 4, 6, 4, 4, 6]]


def test_layer_sets_parse_as_users_spell_them():
    assert parse_layers("3", 8) == {3}
    assert parse_layers("1,3-5, 7", 8) == {1, 3, 4, 5, 7}
    assert default_skipped(20) == frozenset(range(1, 18, 2))
    assert default_skipped(5) == {1}


@pytest.mark.parametrize(
    ("text", "match"),
    [("x", "'x' is not a layer index"), ("2-", "is not a layer index"), ("8", "outside"),
     ("5-3", "outside"), ("-1", "not a layer index"), ("0-7", "skips all 8 layers")],
)  # fmt: skip
def test_a_bad_layer_set_is_one_clear_error(text, match):
    with pytest.raises(SpecxError, match=match):
        parse_layers(text, 8)


@pytest.fixture(scope="module")
def cpu_built(artifacts, tmp_path_factory):
    """The 4-layer llama artifact with a cpu-int4 build (its default)."""
    from specx.builders import BuildOptions, build_artifact

    artifact = shutil.copytree(artifacts["llama"], tmp_path_factory.mktemp("skip") / "llama")
    build_artifact(artifact, BuildOptions(backend="cpu", precision="int4"))
    return artifact


@needs_kernels
def test_the_view_reads_the_target_s_own_weights(cpu_built):
    from specx.artifact import load_manifest
    from specx.runtime.targets import open_decoder

    target = open_decoder(load_manifest(cpu_built), threads=2)
    view = target.skipping(frozenset({1, 2}))
    assert view.num_layers == 2 and not view.has_taps
    kept = [view._layers[i].gate_up.weight for i in range(2)]
    assert kept == [target._layers[i].gate_up.weight for i in (0, 3)]  # the same pages
    assert view.allocate_cache(1, 16).stacked.shape[0] == 2 * 2  # keys and values, 2 layers


@needs_kernels
@pytest.mark.parametrize("spec,tree", [("skip:1", None), ("skip:1-2", "dynamic:6,3,2")])
def test_greedy_skip_drafting_equals_plain_decoding(cpu_built, spec, tree):
    from specx.artifact import load_manifest
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.speculative_decoding import generate_speculative
    from specx.runtime.targets import open_decoder
    from specx.runtime.tree_shapes import parse_tree_spec

    target = open_decoder(load_manifest(cpu_built), threads=2)
    plain = generate_plain(target, PROMPTS, 24)
    options = DrafterOptions(3) if tree is None else DrafterOptions(tree=parse_tree_spec(tree))
    drafter = make_drafter(spec, target, options)
    speculative = generate_speculative(target, drafter, PROMPTS, 24)
    assert speculative.tokens == plain.tokens
    assert speculative.stats.speculative.acceptance.accepted_tokens > 0


def test_a_build_without_the_kernels_refuses_skip_and_says_why(artifacts):
    from specx.artifact import load_manifest
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.targets import open_decoder

    target = open_decoder(load_manifest(artifacts["llama"]), threads=1)  # ONNX Runtime
    with pytest.raises(SpecxError, match="runs on a cpu build.*second copy"):
        make_drafter("skip:1", target, DrafterOptions(3))
    with pytest.raises(SpecxError, match="outside the target's layers 0-3"):
        make_drafter("skip:4", target, DrafterOptions(3))


SAMPLES, POSITIONS, VOCAB = 4000, 3, 16


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A 3-layer small-vocabulary target with peaked distributions, built for the kernels;
    its layer 1 writes little to the residual stream, so skipping it drafts often right."""
    from safetensors.torch import load_file, save_file

    from specx.artifact import load_manifest
    from specx.builders import BuildOptions, build_artifact
    from specx.export.random_checkpoint import CheckpointPreset, write_random_checkpoint
    from specx.export.target_export import export_target
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.targets import open_decoder

    root = tmp_path_factory.mktemp("skip-distribution")
    preset = CheckpointPreset(32, 64, 3, 4, 2, VOCAB)
    path = write_random_checkpoint(root / "ckpt", "llama", preset, seed=5, tokenizer=False)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] *= 60.0  # logits with a few-nats spread, not near-uniform
    for name in ("self_attn.o_proj", "mlp.down_proj"):  # layer 1 writes little: skip it
        weights[f"model.layers.1.{name}.weight"] *= 0.8
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    artifact = export_target(path, root / "art", max_context=48)
    build_artifact(artifact, BuildOptions(backend="cpu", precision="int8"))
    target = open_decoder(load_manifest(artifact), threads=2)
    greedy = [1, 2, 3] + generate_plain(target, [[1, 2, 3]], 10).tokens[0]
    return target, greedy


def _sampled(peaked, verifier):
    from specx.runtime.drafters.layer_skip import LayerSkipDrafter
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.speculative_decoding import generate_speculative
    from specx.runtime.tree_shapes import StaticTree

    target, prompt = peaked
    prompts = [prompt] * SAMPLES
    plain = generate_plain(target, prompts, POSITIONS, SamplingParams(0.7, seed=11))
    drafter = LayerSkipDrafter(target, frozenset({1}), StaticTree.chain(3))
    spec = generate_speculative(
        target, drafter, prompts, POSITIONS, SamplingParams(0.7, seed=12), verifier=verifier
    )
    return plain, spec


@needs_kernels
def test_sampled_skip_drafting_draws_the_target_s_distribution(peaked):
    from chi_square import p_values
    from specx.runtime.verification import verify

    plain, spec = _sampled(peaked, verify)
    accepted = spec.stats.speculative.acceptance.accepted_tokens
    assert 0 < accepted < SAMPLES * (POSITIONS - 1), "drafts must be accepted only sometimes"
    assert min(p_values(plain, spec, VOCAB)) > 1e-3


@needs_kernels
def test_a_broken_verifier_is_caught_with_skip_drafts(peaked):
    from broken_verifiers import broken_verify
    from chi_square import p_values

    plain, spec = _sampled(peaked, broken_verify)
    assert min(p_values(plain, spec, VOCAB)) < 1e-6


@needs_kernels
def test_calibration_chooses_the_layers_and_skip_then_uses_them(cpu_built, tmp_path):
    from specx.artifact import load_manifest
    from specx.calibration.calibrate import CalibrationOptions, calibrate_artifact
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.targets import open_decoder

    artifact = shutil.copytree(cpu_built, tmp_path / "calibrated")
    options = CalibrationOptions(
        drafter="skip", probe_top_k=2, probe_depth=2, max_new_tokens=8, batches=(1,), repeats=1
    )
    said: list[str] = []
    entry = calibrate_artifact(artifact, PROMPTS[:2], options, said.append)
    search = entry.report["layer_skip"]
    assert len(search["nested"]) == 3 and sorted(search["ranking"]) == [0, 1, 2, 3]
    assert entry.skipped_layers == tuple(search["chosen"]["skipped"])
    assert entry.report["drafter"] == "skip:" + ",".join(map(str, entry.skipped_layers))
    assert any("choosing the layers skip leaves out" in line for line in said)
    target = open_decoder(load_manifest(artifact), threads=2)
    drafter = make_drafter("skip", target, DrafterOptions(2))
    assert drafter.skipped == frozenset(entry.skipped_layers)
