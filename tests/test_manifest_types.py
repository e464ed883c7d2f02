"""Typed manifest sections: read once at load, bad fields named, calibration checked when used."""

from __future__ import annotations

import shutil

import pytest

from specx.artifact import load_manifest, manifest_body, write_manifest
from specx.errors import ArtifactError
from specx.manifest_types import (
    BuildEntry,
    CalibratedSampling,
    CalibrationEntry,
    DynamicChoice,
    ModelSpec,
    TapSpec,
    TensorSpec,
    TreeChoice,
)

CHAIN_3 = {"tree": "chain", "chain_length": 3, "label": "chain 3"}


@pytest.fixture
def artifact(artifacts, tmp_path):
    return shutil.copytree(artifacts["llama"], tmp_path / "artifact")


def _rewrite(artifact, **sections) -> None:
    body = manifest_body(load_manifest(artifact))
    write_manifest(artifact, {**body, **sections})


def test_sections_are_typed_values(artifacts):
    manifest = load_manifest(artifacts["llama"])
    model = manifest.model
    assert isinstance(model, ModelSpec) and model.kv_capacity == 128
    assert model.taps == TapSpec(kind="eagle3", width=3 * model.hidden_size, layers=(2, 2, 1))
    assert isinstance(model.eos_token_ids, tuple)
    target = manifest.graph("target")
    assert target.file == "target.onnx" and target.data_files == ("target.onnx.data",)
    assert target.inputs[0] == TensorSpec("input_ids", "int64", ("batch", "tokens"))
    assert target.decoder is None and target.kv_spare_slots == 0 and not target.ort_only
    assert manifest.build is None and manifest.runtime_graph("target") == target


def test_a_build_is_typed_and_selected(artifact):
    exported = load_manifest(artifact).data["graphs"]["target"]
    record = {"backend": "ort", "precision": "int8", "directory": None, "graphs": {}}
    record["graphs"]["target"] = {**exported, "kv_spare_slots": 1}
    record["quantization"] = {"greedy_identity": "chains", "mode": "int8"}
    _rewrite(artifact, builds={"q": record}, default_build="q")
    manifest = load_manifest(artifact)
    build = manifest.build
    assert isinstance(build, BuildEntry) and build.backend == "ort"
    assert build.greedy_identity == "chains" and build.quantization["mode"] == "int8"
    assert manifest.runtime_graph("target").kv_spare_slots == 1
    assert manifest.with_build(None).build is None
    assert manifest.with_build(None).data["default_build"] is None  # what a writer writes back


FLOAT_BUILD = {"backend": "ort", "precision": "fp32", "graphs": {}}


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"builds": {"q": {**FLOAT_BUILD, "quantization": {"greedy_identity": "most"}}}},
            "builds.q.quantization: greedy_identity must be one of all, chains, none",
        ),
        ({"builds": {"q": {**FLOAT_BUILD, "gpu": 3}}}, "builds.q: gpu must be a string"),
        ({"drafter": {"kind": "eagle3", "graph": "draft_head"}}, "drafter: taps is missing"),
        (
            {"drafter": {"kind": "medusa", "graph": "h", "taps": "last", "medusa_heads": 0}},
            "drafter: medusa_heads must be a positive integer",
        ),
    ],
)
def test_a_bad_typed_field_is_named(artifact, sections, message):
    _rewrite(artifact, **sections)
    with pytest.raises(ArtifactError, match=f"manifest.json: {message}"):
        load_manifest(artifact)


def test_a_bad_graph_flag_is_named(artifact):
    body = manifest_body(load_manifest(artifact))
    body["graphs"]["target"]["ort_only"] = "yes"
    write_manifest(artifact, body)
    with pytest.raises(ArtifactError, match="graphs.target.ort_only must be true or false"):
        load_manifest(artifact)


def test_calibration_entries_are_read_when_used(artifact):
    nodes_and_levels = {"total_tokens": 12, "depth": 5, "top_k": 3}
    legacy = {"tree": "dynamic", "label": "d", "dynamic": nodes_and_levels}
    broken = {"choice": CHAIN_3, "max_batch_spec": 1, "expected_speedup": 1.2}
    _rewrite(
        artifact,
        calibration={
            "ngram": {"choice": CHAIN_3, "max_batch_spec": 0, "expected_speedup": 1.0},
            "eagle": {"choice": legacy, "max_batch_spec": 2, "expected_speedup": 1.5},
            "ngram@T=0.7": {**broken, "sampling": {"temperature": "hot", "top_p": 1.0}},
        },
    )
    manifest = load_manifest(artifact)  # a stale entry does not stop the artifact loading
    assert manifest.calibration_keys == ("eagle", "ngram", "ngram@T=0.7")
    assert manifest.calibration("ngram") == CalibrationEntry(
        TreeChoice("chain 3", "chain", chain_length=3), 0, 1.0, CalibratedSampling()
    )
    # Recorded as nodes and levels, before `dynamic` took EAGLE-2's meaning.
    assert manifest.calibration("eagle").choice.dynamic == DynamicChoice(13, 4, 3)
    with pytest.raises(ArtifactError, match=r"calibration.ngram@T=0.7.sampling is malformed"):
        manifest.calibration("ngram@T=0.7")
