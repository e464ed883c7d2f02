"""Weight-only int4/int8 builds (MatMulNBits): layout, numerics, GPTQ, builds, lossless
speculation on them, and exports whose memory does not grow with the weights."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

import specx.builders.ort
from conftest import HEAD_VOCAB
from specx.artifact import load_manifest
from specx.builders import BuildOptions, build_artifact
from specx.builders.gptq import gptq_quantize
from specx.builders.ort import matmulnbits_row_invariance
from specx.cli import main
from specx.errors import BuildError
from specx.graphs.weight_only import (
    WeightOnlyConfig,
    WeightOnlyQuantizePass,
    quantize_rtn,
)
from specx.runtime.calibrated import row_exact
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets.ort import OrtTarget, load_session
from specx.runtime.tree_shapes import DynamicTree, StaticTree

REPEATING = [[5, 9, 5, 9, 5, 9, 13, 5, 9, 5, 9], [7, 3, 11, 7, 3, 11, 7, 3], [4, 4, 6, 4, 4, 6]]


def matmul_model(weight: np.ndarray, logits: bool = False) -> ir.Model:
    """y = relu(x @ W); with `logits`, y = x @ W (an output projection)."""
    x = ir.Value(
        name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["m", weight.shape[0]])
    )
    w = ir.Value(name="w", const_value=ir.tensor(weight))
    node = ir.node("MatMul", [x, w], name="mm")
    node.outputs[0].name = "hidden"
    nodes = [node]
    if not logits:
        nodes.append(ir.node("Relu", [node.outputs[0]], name="relu"))
    nodes[-1].outputs[0].name = "y"
    graph = ir.Graph([x], nodes[-1].outputs, nodes=nodes, initializers=[w], opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


def run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    return load_session(ir.to_proto(model).SerializeToString()).run(None, {"x": x})[0]


@pytest.mark.parametrize("bits", [4, 8])
def test_rtn_bytes_equal_onnxruntimes_own_quantizer(bits, rng):
    pybind = pytest.importorskip("onnxruntime.capi._pybind_state")
    weight = rng.standard_normal((96, 7)).astype(np.float32)
    ours = quantize_rtn(weight, bits, 32, symmetric=True)
    packed = np.zeros((7, 3, 32 * bits // 8), np.uint8)
    scales = np.zeros((7, 3), np.float32)
    zeros = np.zeros((7, 3), np.uint8)
    quantize = pybind.quantize_matmul_4bits if bits == 4 else pybind.quantize_matmul_8bits
    quantize(packed, weight, scales, zeros, 32, 7, 96, True)
    assert np.array_equal(ours.packed(), packed)
    assert np.array_equal(ours.scales, scales)


@pytest.mark.parametrize(
    ("bits", "symmetric", "k"), [(4, True, 96), (4, False, 100), (8, True, 64), (8, False, 72)]
)
def test_matmulnbits_computes_the_dequantized_weight(bits, symmetric, k, rng):
    """The graph's meaning: y = relu(x @ dequantize(W)), also when K is not whole blocks."""
    weight = rng.standard_normal((k, 24)).astype(np.float32)
    model = matmul_model(weight)
    config = WeightOnlyConfig(bits, 32, symmetric, accuracy_level=0, output_bits=bits)
    WeightOnlyQuantizePass(config)(model)
    assert [n.op_type for n in model.graph] == ["MatMulNBits", "Relu"]
    node = next(iter(model.graph))
    assert node.attributes.get_int("K") == k and node.attributes.get_int("bits") == bits
    assert len(node.inputs) == (3 if symmetric else 4)
    x = rng.standard_normal((5, k)).astype(np.float32)
    dequantized = quantize_rtn(weight, bits, 32, symmetric).dequantize()[:k]
    np.testing.assert_allclose(run(model, x), np.maximum(x @ dequantized, 0), rtol=1e-4, atol=1e-4)
    error = np.abs(dequantized - weight).max() / np.abs(weight).max()
    assert error < (0.15 if bits == 4 else 0.01)


def test_a_rescored_output_projection_has_8_bit_logits_at_its_4_bit_top_k(rng):
    """The lm_head's meaning with rescoring: x @ W in 8 bits at the ids of the k largest
    4-bit logits, x @ W in 4 bits elsewhere (K not whole blocks, 3 rows)."""
    k, vocab, top = 80, 300, 8
    weight = rng.standard_normal((k, vocab)).astype(np.float32)
    model = matmul_model(weight, logits=True)
    config = WeightOnlyConfig(4, 32, accuracy_level=0, output_bits=4, output_rescore=top)
    WeightOnlyQuantizePass(config)(model)
    x = rng.standard_normal((3, k)).astype(np.float32)
    four = x @ quantize_rtn(weight, 4, 32, config.is_symmetric).dequantize()[:k]  # int4: zeros
    eight = x @ quantize_rtn(weight, 8, 32, True).dequantize()[:k]
    expected = four.copy()
    ids = np.argsort(-four, axis=-1)[:, :top]
    np.put_along_axis(expected, ids, np.take_along_axis(eight, ids, -1), -1)
    got = load_session(ir.to_proto(model).SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, four, atol=1e-3)  # the rescoring changed something


def test_gptq_beats_rtn_on_correlated_inputs_and_equals_it_without_correlation(rng):
    k, n = 64, 48
    mixing = rng.standard_normal((k, k)) * 0.3 + np.eye(k)
    x = rng.standard_normal((512, k)) @ mixing  # correlated inputs, like real activations
    weight = rng.standard_normal((k, n)).astype(np.float32)
    hessian = x.T @ x
    rtn = quantize_rtn(weight, 4, 32, True).dequantize()
    gptq = gptq_quantize(weight, hessian, 4, 32, True, damp=0.0).dequantize()
    error = {name: np.square(x @ (q - weight)).sum() for name, q in (("rtn", rtn), ("gptq", gptq))}
    assert error["gptq"] < 0.8 * error["rtn"], error
    # Uncorrelated inputs of equal scale: nothing to compensate, GPTQ rounds like RTN.
    identity = gptq_quantize(weight, np.eye(k) * 3.0, 4, 32, True, damp=0.0)
    assert np.array_equal(identity.codes, quantize_rtn(weight, 4, 32, True).codes)


@pytest.fixture(scope="module")
def int4(artifacts, tmp_path_factory):
    artifact = shutil.copytree(artifacts["llama"], tmp_path_factory.mktemp("int4") / "artifact")
    build_artifact(artifact, BuildOptions("ort", "int4"))  # the default configuration
    return artifact


@pytest.fixture(scope="module")
def int4_b128(artifacts, tmp_path_factory):
    """Blocks of 128 (the default for large targets): rows in pairs, a padding row."""
    artifact = shutil.copytree(artifacts["llama"], tmp_path_factory.mktemp("b128") / "artifact")
    config = WeightOnlyConfig(block_size=128)
    build_artifact(artifact, BuildOptions("ort", "int4", weight_only=config))
    assert load_manifest(artifact).build.quantization.padding_row
    return artifact


def test_the_int4_build_is_recorded_with_its_method(int4, artifacts):
    manifest = load_manifest(int4)
    assert manifest.default_build == "ort-int4"
    quantization = manifest.build.quantization
    record = quantization.details
    # A tiny target's weights sit in cache: blocks of 32 (build.py), padded where this CPU's
    # kernels pair rows there too (an AVX2 EPYC does; AVX-512 hosts do not).
    assert record["bits"] == 4 and record["block_size"] == 32 and record["method"] == "rtn"
    padded = matmulnbits_row_invariance(WeightOnlyConfig(block_size=32)) == "padded"
    assert quantization.padding_row == padded and quantization.greedy_identity == "chains"
    assert record["symmetric"] is False and record["accuracy_level"] == 4  # int4: zero points
    assert record["output_projection_bits"] == 4
    assert record["output_projection_rescored_top_k"] == 16
    assert row_exact(manifest)
    graph = onnx.load(
        manifest.path(manifest.build.graphs["target"].file), load_external_data=False
    ).graph
    ops = [n.op_type for n in graph.node]
    exported = onnx.load(
        load_manifest(artifacts["llama"]).path("target.onnx"), load_external_data=False
    )
    assert ops.count("MatMulNBits") == [n.op_type for n in exported.graph.node].count("MatMul")
    assert ops.count("MatMul") == 1  # the rescoring's k dot products with 8-bit rows
    assert ops.count("TopK") == 1 and ops.count("ScatterElements") == 1
    bits = [
        next(a.i for a in n.attribute if a.name == "bits")
        for n in graph.node
        if n.op_type == "MatMulNBits"
    ]
    assert record["quantized_matmuls"]["target"] == {"4": len(bits)}
    assert all(len(n.input) == 4 for n in graph.node if n.op_type == "MatMulNBits")  # zeros


def test_a_capped_lm_head_is_found_as_the_output_projection(artifacts, tmp_path, rng):
    """Gemma 2's logits are c * tanh(lm_head / c): the lm_head still gets the rescoring."""
    artifact = shutil.copytree(artifacts["gemma2"], tmp_path / "artifact")
    build_artifact(artifact, BuildOptions("ort", "int4"))
    manifest = load_manifest(artifact)
    graph = onnx.load(
        manifest.path(manifest.build.graphs["target"].file), load_external_data=False
    ).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("TopK") == 1 and ops.count("Tanh") == 1
    (rescore,) = [n for n in graph.node if n.op_type == "ScatterElements"]
    consumers = [n.op_type for n in graph.node if rescore.output[0] in n.input]
    assert consumers in (["Div"], ["Tanh"])  # the cap applies to the rescored logits (/ 1 folds)
    assert manifest.build.quantization.details["quantized_matmuls"]["target"] == {"4": 4 * 4 + 1}
    prompts = [rng.integers(1, 500, 24).tolist() for _ in range(2)]
    plain = generate_plain(OrtTarget(manifest, threads=2), prompts, 8)
    assert all(len(tokens) == 8 for tokens in plain.tokens)


def test_int4_logits_stay_close_to_float(int4, artifacts, rng):
    prompts = [rng.integers(1, 500, 24).tolist() for _ in range(4)]
    quantized = OrtTarget(load_manifest(int4), threads=2)
    exact = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    agree = total = 0
    for prompt in prompts:
        a = generate_plain(quantized, [prompt], 1).tokens[0]
        b = generate_plain(exact, [prompt], 1).tokens[0]
        agree, total = agree + (a == b), total + 1
    assert agree >= 3  # random-weight logits: near-ties flip, most do not


@pytest.mark.parametrize(
    ("drafter", "build"), [("ngram", "int4"), ("draft-model", "int4"), ("ngram", "int4_b128")]
)
def test_chain_speculation_equals_plain_on_the_int4_build(
    drafter, build, draft_artifacts, rng, request
):
    target = OrtTarget(load_manifest(request.getfixturevalue(build)), threads=2)
    spec = "ngram" if drafter == "ngram" else f"draft-model:{draft_artifacts['llama']}"
    making = make_drafter(spec, target, DrafterOptions(num_draft_tokens=4))
    prompts = REPEATING + [rng.integers(1, 500, 9).tolist()]
    accepted = 0
    for batch in (1, 3):
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            plain = generate_plain(target, chunk, 40)
            speculative = generate_speculative(target, making, chunk, 40)
            assert speculative.tokens == plain.tokens, chunk
            accepted += speculative.stats.speculative.acceptance.accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("name", ["eagle3", "eagle", "medusa", "mtp-deepseek"])
def test_head_chains_equal_plain_on_int4_builds(name, head_artifacts, tmp_path, rng):
    artifact = shutil.copytree(head_artifacts[name], tmp_path / "artifact")
    build_artifact(artifact, BuildOptions("ort", "int4"))
    manifest = load_manifest(artifact)
    converted = set(manifest.build.quantization.details["quantized_matmuls"])
    assert converted == set(manifest.graphs) - {"draft_chain"}
    # The one-call chain of an autoregressive head is derived from the quantized head.
    assert ("draft_chain" in manifest.build.graphs) == (name != "medusa")
    target = OrtTarget(manifest, threads=2)
    drafter = make_drafter(name.split("-")[0], target, DrafterOptions(tree=StaticTree.chain(3)))
    prompts = [rng.integers(1, HEAD_VOCAB, n).tolist() for n in (3, 8, 5, 12, 2, 7, 4, 9)]
    accepted = 0
    for batch in (1, 2):
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            plain = generate_plain(target, chunk, 40)
            speculative = generate_speculative(target, drafter, chunk, 40)
            assert speculative.tokens == plain.tokens, chunk
            accepted += speculative.stats.speculative.acceptance.accepted_tokens
    assert accepted > 0


def test_cli_builds_gptq_and_refuses_misuse(artifacts, tmp_path):
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "artifact")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in REPEATING))
    runner = CliRunner()
    refused = runner.invoke(
        main, ["build", str(artifact), "--precision", "int4", "--method", "gptq"]
    )
    assert refused.exit_code == 2 and "needs --prompts" in refused.stderr
    refused = runner.invoke(main, ["build", str(artifact), "--prompts", str(prompts)])
    assert refused.exit_code == 2 and "--prompts serves only --method gptq" in refused.stderr
    refused = runner.invoke(
        main, ["build", str(artifact), "--precision", "fp16", "--block-size", "32"]
    )
    assert (
        refused.exit_code == 2 and "--block-size applies only to --precision int4" in refused.stderr
    )
    with pytest.raises(BuildError, match="TensorRT int4/int8"):
        build_artifact(artifact, BuildOptions("trt", "int4"))
    args = [
        "build",
        str(artifact),
        "--precision",
        "int8",
        "--method",
        "gptq",
        "--prompts",
        str(prompts),
    ]
    done = runner.invoke(main, args)
    assert done.exit_code == 0, done.output
    record = load_manifest(artifact).build.quantization.details
    assert (record["bits"], record["method"], record["block_size"]) == (8, "gptq", 32)
    assert record["symmetric"] is True  # int8's default
    assert record["output_projection_bits"] == 8
    assert record["output_projection_rescored_top_k"] == 0
    refused = runner.invoke(main, [*args[:3], "fp16", "--asymmetric"])
    assert "--symmetric/--asymmetric applies only to --precision int4" in refused.stderr
    refused = runner.invoke(main, [*args[:4], "--lm-head-rescore", "8"])
    assert refused.exit_code == 2 and "needs a 4-bit lm_head" in refused.stderr
    target = OrtTarget(load_manifest(artifact), threads=2)
    assert len(generate_plain(target, REPEATING[:1], 8).tokens[0]) == 8


WRITE_CHECKPOINT = """
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from specx.export.config import load_target_config
from specx.export.decoder import TargetDecoder
for arg in sys.argv[1:]:  # OUT:VOCAB:LAYERS each, one interpreter start for all
    out, vocab, layers = Path(arg.split(":")[0]), *map(int, arg.split(":")[1:])
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512,
        intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    shapes = TargetDecoder.parameter_shapes(load_target_config(out)[0])
    generator = torch.Generator().manual_seed(0)
    save_file({k: (torch.randn(s, generator=generator) * 0.02).to(torch.bfloat16)
               for k, s in shapes.items()}, out / "model.safetensors")
"""


def _peak_rss_mb(command: list[str]) -> float:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, stderr.decode()[-2000:]
    return usage.ru_maxrss / 1024


def test_export_memory_does_not_grow_with_the_weights(tmp_path):
    """A checkpoint with 270 MB of float32 weights exports with < 135 MB more peak RSS than
    one with 6 MB: the old export held the weights several times over. (The build that export
    ends with loads the graph into ONNX Runtime to check it, as running it does: --no-build.)"""
    sizes = {"small": (2048, 1), "large": (65536, 2)}  # vocab, layers: embedding + lm_head
    peaks = {}
    told = [f"{tmp_path / name}:{vocab}:{layers}" for name, (vocab, layers) in sizes.items()]
    subprocess.run([sys.executable, "-c", WRITE_CHECKPOINT, *told], check=True)
    for name in sizes:
        checkpoint = tmp_path / name
        command = [sys.executable, "-m", "specx.cli", "export", str(checkpoint), "-o",
                   str(tmp_path / f"{name}-artifact"), "--max-context", "64",
                   "--no-build"]  # fmt: skip
        peaks[name] = _peak_rss_mb(command)
    weights_mb = Path(tmp_path / "large-artifact" / "target.onnx.data").stat().st_size / 2**20
    assert weights_mb > 250
    assert peaks["large"] - peaks["small"] < weights_mb / 2, (peaks, weights_mb)


def test_row_invariance_is_measured_and_recorded(artifacts, tmp_path):
    """Blocks of 128 take int8 kernel paths that compute rows in pairs (on AVX-512 and AVX2
    hosts here): the build measures which remedy holds and records it; generate warns if none."""
    config = WeightOnlyConfig(block_size=128)
    invariance = matmulnbits_row_invariance(config)
    # Blocks of 32: "as is" on AVX-512, "padded" on an AVX2 EPYC; never without a remedy.
    assert matmulnbits_row_invariance(WeightOnlyConfig(block_size=32)) is not None
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "artifact")
    build_artifact(artifact, BuildOptions("ort", "int4", weight_only=config))
    quantization = load_manifest(artifact).build.quantization
    assert quantization.greedy_identity == ("chains" if invariance else "none")
    assert quantization.padding_row == (invariance == "padded")
    if not invariance:
        args = ["generate", str(artifact), "--prompt-ids", "1,2", "--drafter", "ngram"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0 and "for no draft" in result.stderr


def test_the_block_size_follows_the_targets_size(artifacts, tmp_path, monkeypatch):
    """Blocks of 128 (and the padding row) once the target's MatMul weights stream from
    memory; the tiny test target counts as large when the threshold is below its size."""
    monkeypatch.setattr(specx.builders.ort, "STREAMED_WEIGHTS", 1000)
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "artifact")
    build_artifact(artifact, BuildOptions("ort", "int4"))
    quantization = load_manifest(artifact).build.quantization
    assert quantization.details["block_size"] == 128
    assert quantization.padding_row == (
        matmulnbits_row_invariance(WeightOnlyConfig(block_size=128)) == "padded"
    )


def test_a_draft_only_build_quantizes_the_head_and_keeps_the_float_target(
    head_artifacts, artifacts, tmp_path, rng
):
    artifact = shutil.copytree(head_artifacts["eagle"], tmp_path / "artifact")
    runner = CliRunner()
    done = runner.invoke(
        main, ["build", str(artifact), "--precision", "int8", "--quantize", "draft"]
    )
    assert done.exit_code == 0, done.output
    manifest = load_manifest(artifact)
    assert manifest.default_build == "ort-int8-draft"
    quantization = manifest.build.quantization
    assert quantization.details["scope"] == "draft" and quantization.greedy_identity == "all"
    assert "greedy_identity" not in quantization.to_json()
    assert set(quantization.details["quantized_matmuls"]) == {"draft_head"}
    assert not row_exact(manifest)  # the target is float: every logit is exact

    def ops(name: str) -> list[str]:
        path = manifest.path(manifest.build.graphs[name].file)
        return [n.op_type for n in onnx.load(path, load_external_data=False).graph.node]

    assert "MatMulNBits" not in ops("target") and "GroupQueryAttention" in ops("target")
    assert "MatMulNBits" in ops("draft_head")
    target = OrtTarget(manifest, threads=2)
    float_target = OrtTarget(load_manifest(head_artifacts["eagle"]), threads=2)
    tree = DynamicTree(9, 3, 2)
    drafter = make_drafter("eagle", target, DrafterOptions(tree=tree))
    prompts = [rng.integers(1, HEAD_VOCAB, n).tolist() for n in (3, 8, 5, 12, 2, 7)]
    accepted = 0
    for batch in (1, 2):
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            plain = generate_plain(target, chunk, 32)
            assert plain.tokens == generate_plain(float_target, chunk, 32).tokens
            speculative = generate_speculative(target, drafter, chunk, 32)
            assert speculative.tokens == plain.tokens, chunk
            accepted += speculative.stats.speculative.acceptance.accepted_tokens
    assert accepted > 0


def test_a_draft_only_build_is_refused_without_a_head_or_with_gptq(artifacts, tmp_path):
    with pytest.raises(BuildError, match="no draft head to quantize"):
        config = WeightOnlyConfig(scope="draft")
        build_artifact(artifacts["llama"], BuildOptions("ort", "int4", weight_only=config))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": REPEATING[0]}) + "\n")
    refused = CliRunner().invoke(
        main,
        ["build", str(artifacts["llama"]), "--precision", "int4", "--quantize", "draft",
         "--method", "gptq", "--prompts", str(prompts)],
    )  # fmt: skip
    assert refused.exit_code == 2 and "GPTQ calibrates the target" in refused.stderr


def test_the_inexact_build_warning_is_for_greedy_requests_and_names_the_precision(
    artifacts, tmp_path
):
    """A build recording greedy identity "none" warns a greedy speculative request, once per
    drafting plan; a sampled request, which promises the distribution, is not warned."""
    from specx import Speculation
    from specx.artifact import manifest_body, write_manifest

    artifact = shutil.copytree(artifacts["llama"], tmp_path / "artifact")
    build_artifact(artifact, BuildOptions("ort", "int4", weight_only=WeightOnlyConfig()))
    manifest = load_manifest(artifact)
    body = manifest_body(manifest)
    body["builds"][manifest.default_build]["quantization"]["greedy_identity"] = "none"
    write_manifest(artifact, body)
    engine = specx.load(artifact)
    ngram = Speculation("ngram")
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("specx")  # the CLI stops it propagating: listen on it
    logger.addHandler(handler)
    try:
        engine.generate([1, 2, 1, 2], max_new_tokens=4, speculation=ngram, temperature=0.7)
        assert not said
        for _ in range(2):
            engine.generate([1, 2, 1, 2], max_new_tokens=4, speculation=ngram)
    finally:
        logger.removeHandler(handler)
    assert len(said) == 1 and "for no draft" in said[0] and "(int4)" in said[0], said
    assert "int8 rounding" not in said[0]
