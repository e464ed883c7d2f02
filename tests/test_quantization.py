"""`specx quantize`: static INT8 QDQ target recorded as a build, lossless speculation on it,
its accuracy against float32, and refusals that leave the manifest untouched."""

from __future__ import annotations

import json
import math
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

import specx.builders.int8_static as quantization
import specx.builders.staging
from conftest import SHARED
from specx.artifact import load_manifest
from specx.builders.int8_static import BUILD_NAME, quantize_artifact
from specx.cli import main
from specx.cli.calibrate import quantize
from specx.errors import BuildError, SpecxError
from specx.graphs import tree_attention as tree_op
from specx.masks import causal_mask
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.plain_decoding import generate_plain, prefill
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets import open_decoder
from specx.runtime.tokenizer import TextTokenizer

# Repetitive prompts: the n-gram drafter finds matches and the target accepts some.
REPEATING = [[5, 9, 5, 9, 5, 9, 13, 5, 9, 5, 9], [7, 3, 11, 7, 3, 11, 7, 3]]


def _calibration_prompts(vocab_size: int, count: int = 6, length: int = 32) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab_size, length).tolist() for _ in range(count)] + REPEATING


@pytest.fixture(scope="module")
def quantized(artifacts, tmp_path_factory):
    artifact = shutil.copytree(artifacts["llama"], tmp_path_factory.mktemp("int8") / "artifact")
    prompts = _calibration_prompts(load_manifest(artifact).model.vocab_size)
    report = quantize_artifact(artifact, prompts)
    return artifact, prompts, report


@pytest.fixture
def artifact(artifacts, tmp_path):
    return shutil.copytree(artifacts["llama"], tmp_path / "artifact")


def _graph(path: Path) -> onnx.GraphProto:
    return onnx.load(str(path), load_external_data=False).graph


def test_the_int8_build_is_recorded_and_becomes_the_default(quantized):
    artifact, prompts, report = quantized
    manifest = load_manifest(artifact)  # verifies every pinned file's sha256
    assert manifest.default_build == BUILD_NAME == report.build
    build = manifest.build
    assert build is not None and (build.backend, build.precision) == ("ort", "int8")
    assert manifest.data["builds"][BUILD_NAME]["onnxruntime_version"]
    assert build.directory == report.directory
    assert build.directory.startswith(f"builds/{BUILD_NAME}.")
    target = build.graphs["target"]
    assert target.file == f"{build.directory}/target.onnx"
    assert target.data_files == (f"{build.directory}/target.onnx.data",)
    assert all(f in manifest.files for f in [target.file, *target.data_files])
    exported = manifest.graph("target")
    assert (target.inputs, target.outputs) == (exported.inputs, exported.outputs)
    record = build.quantization.details
    assert record["mode"] == "int8" and "QDQ" in record["method"]
    assert record["calibration_prompts"] == len(prompts)
    assert record["calibration_tokens"] == sum(len(p) for p in prompts)
    assert record["quantized_matmuls"]["quantized"] == record["quantized_matmuls"]["total"] > 0
    assert record["accuracy"] == report.accuracy.to_json() == report.to_json()["accuracy"]
    assert build.quantization.greedy_identity == "chains"
    assert not [p.name for p in artifact.iterdir() if p.name.startswith(".")]  # no staging left


def test_static_and_weight_only_int8_builds_have_names_of_their_own(quantized):
    """`specx quantize` and `specx build --precision int8` make two builds, neither
    replacing the other (they once shared the name `ort-int8`)."""
    from specx.builders import BuildOptions, backend

    weight_only = backend("ort").build_name(BuildOptions("ort", "int8"))
    assert BUILD_NAME == "ort-int8-static" != weight_only == "ort-int8"
    assert load_manifest(quantized[0]).builds[BUILD_NAME].quantization.details["mode"] == "int8"


def test_every_matmul_is_wrapped_in_qdq_and_tree_attention_is_row_invariant(quantized):
    artifact, _, _ = quantized
    manifest = load_manifest(artifact)
    original = _graph(manifest.path(manifest.graph("target").file))
    graph = _graph(manifest.path(manifest.runtime_graph("target").file))
    producers = {out: node for node in graph.node for out in node.output}
    ops = [node.op_type for node in graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    int8_weights = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.INT8}
    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    assert len(matmuls) == sum(n.op_type == "MatMul" for n in original.node)
    for node in matmuls:
        activation, weight = (producers[name] for name in node.input)
        assert activation.op_type == weight.op_type == "DequantizeLinear", node.name
        assert producers[activation.input[0]].op_type == "QuantizeLinear", node.name
        assert weight.input[0] in int8_weights, node.name
        quantizes_output = [n for n in graph.node if node.output[0] in n.input]
        assert all(n.op_type != "QuantizeLinear" for n in quantizes_output), node.name
    logits = next(o for o in graph.output if o.name == "logits")
    assert logits.type.tensor_type.elem_type == onnx.TensorProto.FLOAT

    def kept(g: onnx.GraphProto) -> list[bytes]:
        ops = ("TreeAttention", "RMSNormalization")
        return [n.SerializeToString() for n in g.node if n.op_type in ops]

    assert kept(graph) == kept(original) and len(kept(graph)) > 0

    model = onnx.load(str(manifest.path(manifest.runtime_graph("target").file)))
    assert list(model.functions) == [tree_op.function_proto(row_invariant=True)]


def test_int8_rows_are_bit_identical_whether_decoded_alone_or_in_a_chunk(quantized):
    """What keeps greedy speculation on the INT8 target identical to its plain decoding."""
    artifact, prompts, _ = quantized
    target = open_decoder(load_manifest(artifact), threads=2)
    rng = np.random.default_rng(3)
    vocab = target.vocab_size
    for prompt in prompts[:3]:
        continuation = rng.integers(0, vocab, 7).tolist()
        rows = {}
        for chunk in (1, 2, 7):
            cache = target.allocate_cache(1, len(prompt) + len(continuation))
            prefill(target, cache, [prompt])
            steps = []
            for start in range(0, len(continuation), chunk):
                tokens = continuation[start : start + chunk]
                write_pos = cache.lengths.copy()
                mask = causal_mask(write_pos, len(tokens), int(write_pos[0]) + len(tokens))
                positions = write_pos[:, None] + np.arange(len(tokens))
                output = target.forward(cache, np.array([tokens]), positions, mask, write_pos)
                steps.append(output.logits[0])
                cache.lengths += len(tokens)
            rows[chunk] = np.concatenate(steps)
        np.testing.assert_array_equal(rows[2], rows[1])
        np.testing.assert_array_equal(rows[7], rows[1])


def test_speculation_on_the_int8_target_is_lossless(quantized):
    artifact, _, _ = quantized
    manifest = load_manifest(artifact)
    assert manifest.runtime_graph("target").file.startswith(f"builds/{BUILD_NAME}.")
    target = open_decoder(manifest, threads=2)
    plain = generate_plain(target, REPEATING, 32)
    spec = generate_speculative(
        target, make_drafter("ngram", target, DrafterOptions(num_draft_tokens=4)), REPEATING, 32
    )
    assert spec.tokens == plain.tokens
    assert spec.stats.speculative.acceptance.accepted_tokens > 0


def test_the_accuracy_report_is_sane(quantized):
    _, prompts, report = quantized
    accuracy = report.accuracy
    assert accuracy.prompts == len(prompts)
    assert accuracy.positions == sum(len(p) for p in prompts)
    assert accuracy.scored_tokens == sum(len(p) - 1 for p in prompts)
    assert 0.0 <= accuracy.top1_agreement <= 1.0
    assert math.isfinite(accuracy.loss_fp32) and math.isfinite(accuracy.loss_int8)
    assert accuracy.loss_increase == pytest.approx(accuracy.loss_int8 - accuracy.loss_fp32)
    assert 0.0 <= accuracy.max_abs_logit_diff < 1.0  # random weights: small logits
    assert report.calibration == (len(prompts), sum(len(p) for p in prompts))


def test_the_cli_reads_jsonl_prompts_and_prints_the_report(artifact, tmp_path):
    lines = [{"prompt_ids": p} for p in REPEATING] + [{"prompt": "def f(x):\n    return x"}]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = [str(artifact), "--prompts", str(prompts_file), "--max-prompts", "2", "--json"]
    result = CliRunner().invoke(quantize, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["build"] == BUILD_NAME and report["calibration_prompts"] == 2
    assert load_manifest(artifact).default_build == BUILD_NAME

    text = CliRunner().invoke(quantize, [str(artifact), "--prompts", str(prompts_file)])
    assert text.exit_code == 0, text.output
    assert "top-1 agreement" in text.stdout and "calibrated on 3 prompts" in text.stdout
    assert len(list((artifact / "builds").iterdir())) == 1  # the rebuild retired the first

    build = ["build", str(artifact), "--backend", "int8-static"]
    refused = CliRunner().invoke(main, build)
    assert refused.exit_code == 2 and "--backend int8-static needs --prompts" in refused.stderr
    refused = CliRunner().invoke(
        main, [*build, "--prompts", str(prompts_file), "--precision", "int4"]
    )
    message = "--backend int8-static builds --precision int8 (static), not int4"
    assert refused.exit_code == 2 and message in refused.stderr
    done = CliRunner().invoke(main, [*build, "--prompts", str(prompts_file)])
    assert done.exit_code == 0, done.output
    record = load_manifest(artifact).build
    assert record is not None and record.backend == "ort"
    assert record.quantization.details["calibration_prompts"] == 3


@pytest.mark.parametrize(
    ("prompts", "mode", "message"),
    [
        ([], "int8", "no calibration prompts"),
        ([[1, 2, 3], [4] * 129], "int8", "prompt 1 has 129 tokens, more than the artifact's KV"),
        ([[1, 2], []], "int8", "calibration prompt 1 is empty"),
        ([[1, 2, 99999]], "int8", "outside [0, 512)"),
        ([[1, 2, 3]], "int4", "--mode must be one of"),
        ([[1, 2, 3]], "fp8", "FP8 quantization goes through NVIDIA ModelOpt"),
        ([[1, 2, 3]], "trt-int8", "TensorRT INT8 quantization goes through NVIDIA ModelOpt"),
    ],
)
def test_refusals_leave_the_manifest_untouched(artifact, monkeypatch, prompts, mode, message):
    monkeypatch.setattr(quantization, "_modelopt_installed", lambda: False)
    before = (artifact / "manifest.json").read_bytes()
    with pytest.raises(BuildError) as error:
        quantize_artifact(artifact, prompts, mode)
    assert message in str(error.value)
    if mode in ("fp8", "trt-int8"):
        assert "not installed" in str(error.value)
    assert (artifact / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in artifact.iterdir()) == sorted(
        ["manifest.json", "target.onnx", "target.onnx.data", "tokenizer.json"]
    )


def test_with_modelopt_installed_fp8_is_refused_as_not_implemented(artifact, monkeypatch):
    monkeypatch.setattr(quantization, "_modelopt_installed", lambda: True)
    with pytest.raises(SpecxError, match="not implemented"):
        quantize_artifact(artifact, [[1, 2, 3]], "fp8")


@pytest.mark.parametrize(
    ("module", "stage"),
    [(quantization, "_quantize_static"), (specx.builders.staging, "write_manifest")],
)
def test_a_failed_quantization_leaves_the_manifest_untouched(artifact, monkeypatch, module, stage):
    before = (artifact / "manifest.json").read_bytes()

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, stage, fail)
    with pytest.raises(KeyboardInterrupt):
        quantize_artifact(artifact, REPEATING)
    assert (artifact / "manifest.json").read_bytes() == before
    assert not [p for p in artifact.iterdir() if p.name.startswith(".")]
    assert not list(artifact.glob("builds/*"))
    load_manifest(artifact)


def _held_out_prompts(tokenizer: TextTokenizer, length: int) -> list[list[int]]:
    """256-token chunks of the stdlib files pyref-7m was not trained on (or snippets)."""
    listing = json.loads((SHARED / "models" / "pyref-7m" / "held_out_files.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks = []
    for name in listing["held_out_files"]:
        path = stdlib / name
        if path.is_file():
            ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
            chunks += [ids[s : s + length] for s in range(0, len(ids) - length + 1, length)][:2]
    if len(chunks) < 8:
        snippets = [
            "import os\n\n\ndef read(path):\n    with open(path) as f:\n        return f.read()\n",
            "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def pop(self):",
            "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n    else:\n        break\n",
            "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
        ]
        chunks += [tokenizer.encode(s * 4) for s in snippets]
    return chunks


def test_pyref_int8_keeps_top1_and_loss(pyref_artifact, tmp_path):
    artifact = shutil.copytree(pyref_artifact, tmp_path / "pyref")
    tokenizer = TextTokenizer(load_manifest(artifact).tokenizer_file)
    chunks = _held_out_prompts(tokenizer, 256)
    calibration, evaluation = chunks[0::2][:12], chunks[1::2][:16]
    report = quantize_artifact(artifact, calibration, eval_prompts=evaluation, threads=2)
    accuracy = report.accuracy
    numbers = (
        f"pyref-7m int8 on {accuracy.scored_tokens} held-out tokens: loss fp32 "
        f"{accuracy.loss_fp32:.4f} -> int8 {accuracy.loss_int8:.4f} nats/token "
        f"({accuracy.loss_increase:+.4f}), top-1 agreement {accuracy.top1_agreement:.4f}"
    )
    print(numbers)
    assert accuracy.top1_agreement >= 0.9, numbers
    assert accuracy.loss_increase < 0.1, numbers
