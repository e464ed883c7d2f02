"""`specx build`: ORT builds recorded and used, fp16 decoding, atomic manifests, TRT profiles."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

import specx.builders.staging
from specx.artifact import load_manifest
from specx.builders import BuildOptions, build_artifact
from specx.builders.registry import check_precision
from specx.cli import main
from specx.errors import ArtifactError, BuildError
from specx.manifest_types import BuildEntry, TensorSpec
from specx.precision import FP32
from specx.runtime.drafters.ngram import NGramDrafter
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets import open_decoder
from specx.tensorrt.profiles import ProfileLimits, optimization_profiles

PROMPTS = [[5, 9, 5, 9, 5, 9, 13], [7, 3, 11]]


@pytest.fixture
def artifact(artifacts, tmp_path):
    return shutil.copytree(artifacts["llama"], tmp_path / "artifact")


def _plain(artifact) -> list[list[int]]:
    target = open_decoder(load_manifest(artifact), threads=2)
    return generate_plain(target, PROMPTS, 12).tokens


def test_ort_fp32_build_records_the_exported_graphs(artifact):
    before = _plain(artifact)
    options = BuildOptions("ort", "fp32", lowering="none")
    assert build_artifact(artifact, options) == "ort-fp32"
    manifest = load_manifest(artifact)
    assert manifest.default_build == "ort-fp32"
    assert manifest.build.graphs["target"].file == "target.onnx"
    assert manifest.build.onnxruntime_version
    assert _plain(artifact) == before


def test_ort_fp16_build_decodes_and_speculation_stays_lossless(artifact):
    fp32 = _plain(artifact)
    build_artifact(artifact, BuildOptions("ort", "fp16"))
    manifest = load_manifest(artifact)
    target = open_decoder(manifest, threads=2)
    assert manifest.build.graphs["target"].file.startswith("builds/ort-fp16.")
    cache = target.allocate_cache(1)
    assert cache.keys[0].dtype == np.float16
    plain = generate_plain(target, PROMPTS, 12)
    spec = generate_speculative(target, NGramDrafter(4), PROMPTS, 12)
    assert spec.tokens == plain.tokens
    agreement = np.mean(
        [a == b for x, y in zip(plain.tokens, fp32, strict=True) for a, b in zip(x, y, strict=True)]
    )
    assert agreement >= 0.75  # fp16 may flip near-ties of random weights, not most tokens


def test_rebuilding_replaces_the_previous_build_directory(artifact):
    build_artifact(artifact, BuildOptions("ort", "fp16"))
    first = load_manifest(artifact).build.directory
    build_artifact(artifact, BuildOptions("ort", "fp16"))
    second = load_manifest(artifact).build.directory
    assert first != second and not (artifact / first).exists() and (artifact / second).is_dir()


def test_an_interrupted_build_leaves_the_manifest_untouched(artifact, monkeypatch):
    original = (artifact / "manifest.json").read_bytes()

    def interrupted(root, body, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(specx.builders.staging, "write_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_artifact(artifact, BuildOptions("ort", "fp16"))
    assert (artifact / "manifest.json").read_bytes() == original
    assert not [p for p in artifact.iterdir() if p.name.startswith(".build-")]
    load_manifest(artifact)


def test_a_damaged_build_blocks_only_itself_and_specx_build_replaces_it(artifact):
    """A build whose file fails its pin refuses to run, naming the file and the builds that
    do run; the exported graphs still run; a manifest rewrite does not pin the damage anew;
    `specx verify` names it; building it again replaces it."""
    import specx
    from specx.artifact import manifest_body, write_manifest
    from specx.publish import verify_artifact

    build_artifact(artifact, BuildOptions("ort", "fp16"))
    graph = artifact / load_manifest(artifact).build.graphs["target"].file
    graph.write_bytes(graph.read_bytes()[:-10])
    manifest = load_manifest(artifact)
    assert set(manifest.damaged) == {"ort-fp16"} and manifest.default_build == "ort-fp16"
    with pytest.raises(ArtifactError, match=r"'ort-fp16' .* damaged: .*modified or truncated"):
        specx.load(artifact)
    prompt = [5, 9, 5, 9, 13]
    exported = specx.load(artifact, build="exported").generate(prompt, max_new_tokens=6)
    write_manifest(artifact, manifest_body(manifest))  # as another build or a calibration does
    assert set(load_manifest(artifact).damaged) == {"ort-fp16"}  # its old pin kept
    with pytest.raises(ArtifactError, match="build 'ort-fp16'"):
        verify_artifact(artifact)
    build_artifact(artifact, BuildOptions("ort", "fp16"))
    assert not load_manifest(artifact).damaged
    verify_artifact(artifact)
    fp16 = specx.load(artifact).generate(prompt, max_new_tokens=6, ignore_eos=True)
    assert len(fp16.tokens) == 6 and exported.tokens


def test_bad_build_requests_are_refused(artifact):
    with pytest.raises(BuildError, match="no bfloat16 kernels"):
        build_artifact(artifact, BuildOptions("ort", "bf16"))
    with pytest.raises(BuildError, match="--backend must be one of"):
        build_artifact(artifact, BuildOptions("tvm", "fp32"))


def test_trt_build_without_tensorrt_says_what_is_missing(artifact):
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here; tests/test_trt_engine.py covers it")
    except ImportError:
        pass
    original = (artifact / "manifest.json").read_bytes()
    result = CliRunner().invoke(main, ["build", str(artifact), "--backend", "trt"])
    assert result.exit_code == 2
    assert "TensorRT is not installed" in result.output and "10.15" in result.output
    assert (artifact / "manifest.json").read_bytes() == original


def test_cli_build_and_generate_use_the_build(artifact):
    runner = CliRunner()
    assert runner.invoke(main, ["build", str(artifact), "--precision", "fp16"]).exit_code == 0
    result = runner.invoke(
        main,
        [
            "generate",
            str(artifact),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    assert (stats["build"], stats["backend"]) == ("ort-fp16", "ort")


def test_optimization_profiles_follow_the_manifest(artifacts):
    manifest = load_manifest(artifacts["llama"])
    inputs = manifest.graph("target").inputs
    limits = ProfileLimits(kv_capacity=128, max_tree_tokens=64, max_batch=4)
    profiles = optimization_profiles(inputs, limits)
    assert list(profiles) == ["decode", "prefill"]
    decode, prefill = profiles["decode"], profiles["prefill"]
    assert decode["input_ids"] == ([1, 1], [1, 8], [4, 64])
    assert prefill["input_ids"] == ([1, 1], [1, 64], [4, 128])
    assert decode["attention_mask"] == ([1, 1, 1, 1], [1, 1, 8, 64], [4, 1, 64, 128])
    kv = manifest.model.num_kv_heads, manifest.model.head_dim
    assert decode["past_key_0"] == (
        [1, kv[0], 128, kv[1]],
        [1, kv[0], 128, kv[1]],
        [4, kv[0], 128, kv[1]],
    )
    with pytest.raises(ArtifactError, match="dynamic dimension 'sequence'"):
        optimization_profiles([TensorSpec("x", "float32", ("sequence",))], limits)


def test_engine_mismatches_name_the_version_and_gpu():
    build = BuildEntry(
        "trt", "fp16", tensorrt_version="10.15.1", compute_capability="9.0", gpu="H200"
    )
    assert build.engine_mismatches("10.15.3", "9.0") == []
    assert build.engine_mismatches(None, None) == []
    problems = build.engine_mismatches("11.1.0", "8.9")
    assert "built with TensorRT 10.15.1, this is TensorRT 11.1.0" in problems[0]
    assert "compute capability 9.0 (H200), this GPU is 8.9" in problems[1]


class _CopyBackend:
    """A toy backend: the exported graphs rewritten as they are, on ONNX Runtime."""

    name = "toy-copy"
    runtime = "ort"
    precisions = (FP32,)
    options = frozenset()  # no option beyond --backend and --precision

    def build_name(self, options: BuildOptions) -> str:
        return f"toy-{options.precision}"

    def check(self, manifest, options, prompts) -> None:
        check_precision(self, options.precision)

    def build(self, job) -> BuildEntry:
        from specx.builders.staging import load_graph, save_graph

        graphs = {}
        for name in job.manifest.graphs:
            job.progress(f"[toy] copying {name}")
            graphs[name] = save_graph(load_graph(job.manifest, name), job.output, name)
        return BuildEntry(self.runtime, job.options.precision.name, graphs=graphs)


def test_a_new_backend_is_one_class_and_its_registration(artifact, monkeypatch):
    from specx.builders import BACKENDS, register
    from specx.runtime.engine import load

    before = _plain(artifact)
    monkeypatch.setitem(BACKENDS, "toy-copy", None)  # restored (removed) after the test
    register(_CopyBackend())
    with pytest.raises(BuildError, match="--backend toy-copy builds --precision fp32, not fp16"):
        build_artifact(artifact, BuildOptions("toy-copy", "fp16"))
    # The CLI asks the registry what the backend takes: no CLI change for a new one.
    for extra, message in (
        (["--max-batch", "4"], "--max-batch applies only to --backend trt"),
        (["--block-size", "32"], "--block-size applies only to --backend cpu, openvino, ort or"),
        (["--precision", "int4"], "--backend toy-copy builds --precision fp32, not int4"),
    ):
        refused = CliRunner().invoke(
            main, ["build", str(artifact), "--backend", "toy-copy", *extra]
        )
        assert refused.exit_code != 0 and message in refused.output, refused.output
    result = CliRunner().invoke(main, ["build", str(artifact), "--backend", "toy-copy"])
    assert result.exit_code == 0, result.output
    manifest = load_manifest(artifact)
    assert manifest.default_build == "toy-fp32"
    assert manifest.build.backend == "ort"  # the runtime that opens it
    assert manifest.build.graphs["target"].file.startswith("builds/toy-fp32.")
    assert _plain(artifact) == before
    completion = load(artifact, threads=2).generate(PROMPTS[0], max_new_tokens=4)
    assert (completion.stats.build, completion.stats.backend) == ("toy-fp32", "ort")


def test_a_backend_must_name_a_runtime_that_exists_and_unknown_ones_are_refused(artifact):
    from specx.builders import register

    class Nowhere(_CopyBackend):
        runtime = "tpu"

    with pytest.raises(ValueError, match="no runtime opener 'tpu'"):
        register(Nowhere())
    with pytest.raises(BuildError, match="--backend must be one of .*'ort'.*got 'nope'"):
        build_artifact(artifact, BuildOptions("nope"))


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_weights_behind_a_link_are_refused_before_any_work(artifact, tmp_path, link):
    """onnx-ir will not read external data through a link; the build says so up front."""
    data = artifact / "target.onnx.data"
    elsewhere = tmp_path / "weights.data"
    shutil.move(data, elsewhere)
    if link == "symbolic":
        data.symlink_to(elsewhere)
    else:
        data.hardlink_to(elsewhere)
    done = CliRunner().invoke(main, ["build", str(artifact), "--precision", "int4"])
    assert done.exit_code == 2, done.output
    assert f"{data} is a {'symbolic link' if link == 'symbolic' else 'file with other'}" in (
        done.stderr
    )
    assert not list(artifact.glob(".build-*")) and not (artifact / "builds").exists()
