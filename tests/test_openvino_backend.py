"""`specx build --backend openvino`: the lowering's rule, the compressed weights, lossless
speculation on OpenVINO builds. Skipped where OpenVINO is not installed (it is optional)."""

from __future__ import annotations

import shutil

import numpy as np
import onnx_ir as ir
import pytest

ov = pytest.importorskip("openvino", reason="OpenVINO is not installed (pip install openvino)")

from specx.artifact import load_manifest  # noqa: E402
from specx.builders import BuildOptions, build_artifact  # noqa: E402
from specx.builders.openvino import _Compression, compress_weights  # noqa: E402
from specx.graphs.ov_lowering import lower_for_openvino  # noqa: E402
from specx.graphs.weight_only import quantize_rtn  # noqa: E402
from specx.masks import causal_mask  # noqa: E402
from specx.runtime.drafters import DrafterOptions, make_drafter  # noqa: E402
from specx.runtime.plain_decoding import generate_plain  # noqa: E402
from specx.runtime.speculative_decoding import generate_speculative  # noqa: E402
from specx.runtime.targets import open_decoder  # noqa: E402
from specx.runtime.targets.ort import OrtTarget  # noqa: E402

PROMPTS = [[5, 9, 5, 9, 5, 9, 13, 5, 9, 5, 9], [7, 3, 11, 7, 3, 11, 7, 3], [4, 4, 6, 4, 4, 6]]


@pytest.fixture(scope="module")
def built(artifacts, tmp_path_factory):
    """Copies of two families' artifacts with OpenVINO builds: llama int4 and fp32 (the
    default, built last), gemma2 (soft-capped attention) fp32."""
    root = tmp_path_factory.mktemp("openvino")
    out = {}
    for family, precisions in (("llama", ("int4", "fp32")), ("gemma2", ("fp32",))):
        artifact = shutil.copytree(artifacts[family], root / family)
        for precision in precisions:
            build_artifact(artifact, BuildOptions(backend="openvino", precision=precision))
        out[family] = artifact
    return out


def _tree_step_mask(prefix: int) -> tuple[np.ndarray, np.ndarray]:
    """A 4-node tree after `prefix` tokens (root; two children; a grandchild): mask, positions."""
    parents = [-1, 0, 0, 1]
    mask = np.zeros((1, 1, 4, prefix + 4), bool)
    mask[..., :prefix] = True
    depth = []
    for node, parent in enumerate(parents):
        seen = node
        while seen >= 0:
            mask[0, 0, node, prefix + seen] = True
            seen = parents[seen]
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return mask, np.array([[prefix + d for d in depth]])


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_fp32_build_computes_the_exported_graph(built, family):
    """Prefill then a tree step on batch 2 at different slots: logits and cache as ORT's."""
    manifest = load_manifest(built[family])
    ours = open_decoder(manifest.with_build("openvino-fp32"), threads=1)
    reference = OrtTarget(manifest.with_build(None), threads=1)
    caches = [t.allocate_cache(2) for t in (ours, reference)]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, (2, 9))
    starts = np.array([0, 0])
    mask = causal_mask(starts, 9, 9)
    outputs = [
        t.forward(c, ids, np.arange(9)[None].repeat(2, 0), mask, starts)
        for t, c in zip((ours, reference), caches, strict=True)
    ]
    np.testing.assert_allclose(outputs[0].logits, outputs[1].logits, atol=2e-5)
    tree, positions = _tree_step_mask(9)
    ids = rng.integers(0, 100, (2, 4))
    write = np.array([9, 9])
    mask, positions = tree.repeat(2, 0), positions.repeat(2, 0)
    outputs = [
        t.forward(c, ids, positions, mask, write)
        for t, c in zip((ours, reference), caches, strict=True)
    ]
    np.testing.assert_allclose(outputs[0].logits, outputs[1].logits, atol=2e-5)
    for mine, theirs in zip(
        caches[0].keys + caches[0].values, caches[1].keys + caches[1].values, strict=True
    ):
        np.testing.assert_allclose(mine[:, :, :13], theirs[:, :, :13], atol=2e-5)


def test_requests_taking_turns_on_one_target_each_read_their_own_cache(built):
    """The cache is bound to the request once per cache: a forward on another cache rebinds."""
    manifest = load_manifest(built["llama"]).with_build("openvino-fp32")
    shared = open_decoder(manifest, threads=1)
    alone = [open_decoder(manifest, threads=1) for _ in range(2)]  # one cache each, ever
    caches = [(shared.allocate_cache(1), target.allocate_cache(1)) for target in alone]
    for step in range(3):  # a prefill of 8 tokens, then one token at a time, in turns
        for i, (turns, own) in enumerate(caches):
            start = 0 if step == 0 else 7 + step
            ids = np.array([PROMPTS[i][:8]]) if step == 0 else np.array([[3 + i + step]])
            width = ids.shape[1]
            mask = causal_mask(np.array([start]), width, start + width)
            args = (ids, start + np.arange(width)[None], mask, np.array([start]))
            np.testing.assert_array_equal(
                shared.forward(turns, *args).logits, alone[i].forward(own, *args).logits
            )


def test_a_forward_whose_rows_pass_the_mask_is_refused(built):
    from specx.errors import GenerationError

    target = open_decoder(load_manifest(built["llama"]).with_build("openvino-fp32"), threads=1)
    cache = target.allocate_cache(1)
    with pytest.raises(GenerationError, match="the mask covers 4 slots"):
        target.forward(
            cache,
            np.zeros((1, 2), np.int64),
            np.array([[3, 4]]),
            np.ones((1, 1, 2, 4), bool),
            np.array([3]),
        )


def test_compressed_weights_are_the_rtn_codes_and_the_output_projection_keeps_8_bits():
    """A MatMul chain read into OpenVINO and compressed computes x @ dequantized W."""
    rng = np.random.default_rng(0)
    hidden_w = rng.standard_normal((256, 384)).astype(np.float32) * 0.05
    out_w = rng.standard_normal((384, 512)).astype(np.float32) * 0.05
    ops = ov.opset13
    x = ops.parameter([-1, 256], np.float32, name="x")
    hidden = ops.matmul(x, ops.constant(hidden_w), False, False)
    logits = ops.matmul(hidden, ops.constant(out_w), False, False)
    logits.output(0).get_tensor().set_names({"logits"})
    model = ov.Model([logits], [x])
    compression = _Compression(bits=4, block=128, symmetric=False, activation_group=128)
    assert compress_weights(model, compression, lambda m: None) == 2
    compiled = ov.Core().compile_model(
        model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
    )
    inputs = rng.standard_normal((3, 256)).astype(np.float32)
    first = _as_decompressed(quantize_rtn(hidden_w, 4, 128, False))
    second = _as_decompressed(quantize_rtn(out_w, 8, 128, False))
    expected = inputs @ first @ second
    np.testing.assert_allclose(compiled(inputs)[0], expected, rtol=1e-4, atol=1e-4)
    float_result = inputs @ hidden_w @ out_w
    assert np.abs(compiled(inputs)[0] - float_result).max() > 1e-3  # it was compressed


def _as_decompressed(quantized) -> np.ndarray:
    """The weight [K, N] as the plugin computes it: (code - zero) * the scale rounded to fp16."""
    values = quantized.codes.astype(np.float32) - quantized.zero_points[..., None]
    weight = values * quantized.scales[..., None].astype(np.float16).astype(np.float32)
    return weight.reshape(weight.shape[0], -1).T


@pytest.mark.parametrize("build", ["openvino-fp32", "openvino-int4"])
def test_greedy_speculation_on_an_openvino_build_equals_its_plain_decoding(built, build):
    target = open_decoder(load_manifest(built["llama"]).with_build(build), threads=1)
    plain = generate_plain(target, PROMPTS, 24)
    # A chain of 3, and trees of n-gram matches (several continuations per round).
    for options in (DrafterOptions(3), DrafterOptions(4, ngram_matches=3)):
        drafter = make_drafter("ngram", target, options)
        speculative = generate_speculative(target, drafter, PROMPTS, 24)
        assert speculative.tokens == plain.tokens, (build, options)


def test_the_lowering_leaves_no_tree_attention_and_outputs_new_rows(artifacts):
    manifest = load_manifest(artifacts["llama"])
    model = lower_for_openvino(ir.load(manifest.path(manifest.graph("target").file)))
    assert not [
        n for n in model.graph if n.op_type in ("TreeAttention", "Attention", "TensorScatter")
    ]
    outputs = [o.name for o in model.graph.outputs]
    assert "new_key_0" in outputs and not [o for o in outputs if o.startswith("present_")]
    assert not model.functions


def test_openvino_fuses_every_layers_rope_in_the_lowered_graph(built):
    """rotate_half respelled (RotateHalfPass): the CPU plugin runs each RoPE as one node."""
    from specx.runtime.targets.openvino import compile_graph

    manifest = load_manifest(built["llama"])
    compiled = compile_graph(manifest, "target", threads=1)
    kinds = [
        op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()
    ]
    layers = manifest.model.num_layers
    assert kinds.count("RoPE") == 2 * layers  # queries and keys
    lowered = lower_for_openvino(ir.load(manifest.path(manifest.graph("target").file)))
    assert not [n for n in lowered.graph if n.op_type == "Neg"]


def test_generate_on_an_openvino_build_needs_neither_torch_nor_onnx(built):
    """The default build is the last one (openvino-fp32); the runtime opens it with openvino."""
    import json
    import subprocess
    import sys

    from test_runtime_isolation import BLOCKER

    args = [sys.executable, "-c", BLOCKER, "generate", str(built["llama"]), "--prompt", "import"]
    args += ["--max-new-tokens", "4", "--json", "--threads", "1"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["stats"]["build"], result["stats"]["backend"]) == ("openvino-fp32", "openvino")
    assert len(result["tokens"][0]) >= 1


def test_onnx_runtime_only_build_options_are_refused_for_openvino(built):
    from click.testing import CliRunner

    from specx.cli import main

    args = ["build", str(built["llama"]), "--backend", "openvino", "--precision", "int4"]
    done = CliRunner().invoke(main, [*args, "--accuracy-level", "0"])
    assert done.exit_code != 0
    assert "--accuracy-level applies only to --backend ort" in done.output
    done = CliRunner().invoke(
        main, ["build", str(built["llama"]), "--backend", "openvino", "--lowering", "none"]
    )
    assert "--lowering applies only to --backend ort" in done.output


@pytest.mark.parametrize(
    "field, value", [("accuracy_level", 0), ("output_bits", 8), ("output_rescore", 4)]
)
def test_onnx_runtime_only_weight_settings_are_refused_by_the_library(built, field, value):
    """Through the library as through the CLI: a setting the OpenVINO build would ignore."""
    from specx.errors import BuildError
    from specx.graphs.weight_only import WeightOnlyConfig

    config = WeightOnlyConfig(4, **{field: value})
    options = BuildOptions(backend="openvino", precision="int4", weight_only=config)
    with pytest.raises(BuildError, match=f"^{field}: ONNX Runtime's int4 settings"):
        build_artifact(built["llama"], options)


def _alone_and_together(target) -> tuple[np.ndarray, np.ndarray]:
    """Logits of 5 tokens after a prompt: one forward of all 5, and 5 one-token forwards."""
    rng = np.random.default_rng(0)
    prompt, chunk = rng.integers(0, 100, (1, 12)), rng.integers(0, 100, (1, 5))
    caches = [target.allocate_cache(1) for _ in range(2)]
    for cache in caches:
        target.forward(
            cache, prompt, np.arange(12)[None], causal_mask(np.array([0]), 12, 12), np.array([0])
        )
    start = np.array([12])
    together = target.forward(
        caches[0], chunk, 12 + np.arange(5)[None], causal_mask(start, 5, 17), start
    )
    alone = []
    for j in range(5):
        at = np.array([12 + j])
        step = target.forward(
            caches[1], chunk[:, j : j + 1], at[:, None], causal_mask(at, 1, 13 + j), at
        )
        alone.append(step.logits[0, 0])
    return np.array(alone), together.logits[0]


def test_a_token_alone_and_in_a_chunk_gets_the_same_logits_on_int4(built, monkeypatch):
    """Bit for bit, thanks to the pad row; without it OpenVINO's single-row path differs."""
    import specx.runtime.targets.openvino as ov_target

    target = open_decoder(load_manifest(built["llama"]).with_build("openvino-int4"), threads=1)
    alone, together = _alone_and_together(target)
    np.testing.assert_array_equal(alone, together)
    monkeypatch.setattr(ov_target, "PAD_SINGLE_ROWS", False)
    alone, together = _alone_and_together(target)
    assert np.abs(alone - together).max() > 0


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_heads_draft_on_onnx_runtime_for_an_openvino_target(head_artifacts, kind, tmp_path):
    """The build's target is OpenVINO IR, its draft graphs ONNX Runtime's (the one-call chain
    graph included), and speculation with the head stays lossless."""
    from specx.runtime.drafters.chain_graph import DraftChain
    from specx.runtime.targets import graph_runtime

    artifact = shutil.copytree(head_artifacts[kind], tmp_path / kind)
    build_artifact(artifact, BuildOptions(backend="openvino", precision="int4"))
    manifest = load_manifest(artifact)
    drafts = [name for name in manifest.build.graphs if name != "target"]
    assert drafts and {graph_runtime(manifest, name) for name in drafts} == {"ort"}
    assert graph_runtime(manifest, "target") == "openvino"
    assert DraftChain.available(manifest) == (kind == "eagle3")
    target = open_decoder(manifest, threads=1)
    plain = generate_plain(target, PROMPTS, 20)
    options = DrafterOptions(3) if kind != "medusa" else DrafterOptions()
    speculative = generate_speculative(target, make_drafter(kind, target, options), PROMPTS, 20)
    assert speculative.tokens == plain.tokens
    assert speculative.stats.speculative.acceptance.rounds > 0


def test_activations_are_quantized_per_weight_block(artifacts, tmp_path):
    """The build records its weight block as the plugin's activation group and the runtime
    compiles with it (not the plugin's default 32); rows stay row-invariant, chains lossless."""
    from specx.graphs.weight_only import WeightOnlyConfig
    from specx.runtime.targets.openvino import compile_graph

    artifact = shutil.copytree(artifacts["llama"], tmp_path / "llama")
    config = WeightOnlyConfig(4, block_size=64)
    build_artifact(artifact, BuildOptions("openvino", "int4", weight_only=config))
    manifest = load_manifest(artifact)
    assert manifest.build.quantization.activation_group == 64
    compiled = compile_graph(manifest, "target", threads=1)
    assert compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == 64
    target = open_decoder(manifest, threads=1)
    alone, together = _alone_and_together(target)
    np.testing.assert_array_equal(alone, together)
    plain = generate_plain(target, PROMPTS, 24)
    drafter = make_drafter("ngram", target, DrafterOptions(3))
    assert generate_speculative(target, drafter, PROMPTS, 24).tokens == plain.tokens
