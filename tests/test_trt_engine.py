"""TensorRT engines built by `specx build --backend trt`, run by the TensorRT backend.

Needs TensorRT >= 10.15 and a CUDA device; skipped otherwise (`benchmarks/gpu_check.sh`
runs it on the first machine that has both).
"""

from __future__ import annotations

import shutil

import pytest

trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install tensorrt)")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("TensorRT engines need a CUDA device", allow_module_level=True)

from specx.artifact import load_manifest  # noqa: E402
from specx.builders import BuildOptions, build_artifact  # noqa: E402
from specx.publish import pack_artifact, verify_artifact  # noqa: E402
from specx.runtime.drafters import DrafterOptions, make_drafter  # noqa: E402
from specx.runtime.plain_decoding import generate_plain  # noqa: E402
from specx.runtime.speculative_decoding import generate_speculative  # noqa: E402
from specx.runtime.targets import open_decoder  # noqa: E402
from specx.runtime.targets.trt import TrtTarget  # noqa: E402
from specx.runtime.tree_shapes import parse_tree_spec  # noqa: E402

PROMPTS = [[5, 9, 5, 9, 5, 9, 13], [7, 3, 11]]


@pytest.fixture(scope="module")
def trt_artifacts(artifacts, head_artifacts, tmp_path_factory):
    root = tmp_path_factory.mktemp("trt")
    built = {}
    for name, source, precision in (
        ("llama-fp32", artifacts["llama"], "fp32"),
        ("llama-fp16", artifacts["llama"], "fp16"),
        ("eagle3-fp32", head_artifacts["eagle3"], "fp32"),
    ):
        path = shutil.copytree(source, root / name)
        build_artifact(path, BuildOptions("trt", precision, max_batch=4))
        built[name] = path
    return built


def test_manifest_records_the_engines(trt_artifacts):
    manifest = load_manifest(trt_artifacts["llama-fp16"])
    build = manifest.build
    assert build.backend == "trt" and build.precision == "fp16"
    assert build.tensorrt_version == trt.__version__
    assert build.compute_capability == "{}.{}".format(*torch.cuda.get_device_capability())
    assert build.graphs["target"].profiles == ("decode", "prefill")
    assert len(manifest.data["builds"]["trt-fp16"]["graphs"]["target"]["engine_sha256"]) == 64


def test_fp32_engine_decodes_like_onnx_runtime(trt_artifacts, artifacts):
    from specx.runtime.targets.ort import OrtTarget

    reference = generate_plain(OrtTarget(load_manifest(artifacts["llama"])), PROMPTS, 16).tokens
    target = open_decoder(load_manifest(trt_artifacts["llama-fp32"]))
    assert isinstance(target, TrtTarget)
    assert generate_plain(target, PROMPTS, 16).tokens == reference


@pytest.mark.parametrize("name", ["llama-fp32", "llama-fp16"])
def test_speculation_on_engines_is_lossless(trt_artifacts, name):
    target = open_decoder(load_manifest(trt_artifacts[name]))
    plain = generate_plain(target, PROMPTS, 16)
    drafter = make_drafter("ngram", target, DrafterOptions(num_draft_tokens=4))
    assert generate_speculative(target, drafter, PROMPTS, 16).tokens == plain.tokens


def test_eagle3_head_engines_draft_losslessly(trt_artifacts):
    target = open_decoder(load_manifest(trt_artifacts["eagle3-fp32"]))
    plain = generate_plain(target, PROMPTS, 16)
    options = DrafterOptions(tree=parse_tree_spec("dynamic:9,2,2"))
    drafter = make_drafter("eagle3", target, options)
    assert generate_speculative(target, drafter, PROMPTS, 16).tokens == plain.tokens


def test_packed_engines_verify_on_this_gpu(trt_artifacts, tmp_path):
    packed = pack_artifact(trt_artifacts["llama-fp16"], tmp_path / "engines.tar")
    report = verify_artifact(packed)
    assert report.builds == {"trt-fp16": "trt/fp16"} and report.notes == []
