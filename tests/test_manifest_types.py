"""Typed manifest sections: read once at load, bad fields named, calibration checked when used,
written back by `to_json` as the writers wrote them."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from specx.artifact import load_manifest, manifest_body, write_manifest
from specx.builders import BuildOptions, build_artifact
from specx.errors import ArtifactError
from specx.manifest_types import (
    BuildEntry,
    CalibratedSampling,
    CalibrationEntry,
    CandidateTiming,
    DecoderSpec,
    DrafterSpec,
    DynamicChoice,
    GraphEntry,
    ModelSpec,
    Quantization,
    ShapeMeasures,
    TapSpec,
    TensorSpec,
    TreeChoice,
    VerifyShape,
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
    assert build.quantization == Quantization("chains", details={"mode": "int8"})
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
        (
            {"builds": {"q": {**FLOAT_BUILD, "quantization": {"padding_row": "yes"}}}},
            "builds.q.quantization: padding_row must be true or false",
        ),
        (
            {"builds": {"q": {**FLOAT_BUILD, "quantization": {"activation_group": 0}}}},
            "builds.q.quantization: activation_group must be a positive integer",
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


TAPS = TapSpec("eagle3", 96, (2, 2, 1))
IDS = TensorSpec("input_ids", "int64", ("batch", "tokens"))
KEY = TensorSpec("past_key_0", "float32", ("batch", 2, "capacity", 16))
DECODER = DecoderSpec(num_layers=1, num_kv_heads=2, head_dim=16, hidden_size=32, vocab_size=20)
HEAD = GraphEntry(
    "draft_head.onnx",
    (IDS, KEY),
    (KEY,),
    ("draft_head.onnx.data",),
    opset=24,
    decoder=DECODER,
    kv_spare_slots=1,
    ort_only=True,
)
ENGINE = GraphEntry(
    "builds/trt-fp16.1/target.onnx",
    (IDS,),
    engine="builds/trt-fp16.1/target.engine",
    engine_sha256="ab" * 32,
    profiles=("decode", "prefill"),
)
STATIC = TreeChoice(
    "static 3 nodes, depth 2",
    "static",
    choices=((0,), (1,), (0, 0)),
    nodes=3,
    measured=ShapeMeasures(2, 1.6, 1.3, 1.4, (CandidateTiming("chain 1", 1.2, 1.1),)),
)

# Every section with each of its optional fields set, and at its defaults.
SECTIONS = [
    TAPS,
    ModelSpec(100, 32, 2, 4, 2, 8, 128, 64, (1, 2), TAPS, "llama", "float32", 0),
    ModelSpec(100, 32, 2, 4, 2, 8, 128, 64, (), TapSpec("none", 0, ())),
    KEY,
    DECODER,
    HEAD,
    ENGINE,
    GraphEntry("target.onnx"),
    BuildEntry(
        "ort",
        "int4",
        "builds/ort-int4.1",
        {"target": HEAD},
        quantization=Quantization(
            "chains", padding_row=False, details={"bits": 4, "quantized_matmuls": {"t": 3}}
        ),
        onnxruntime_version="1.22.0",
        lowering={"target": "gqa"},
    ),
    BuildEntry(
        "trt",
        "fp16",
        "builds/trt-fp16.1",
        {"target": ENGINE},
        tensorrt_version="10.15.1",
        compute_capability="9.0",
        gpu="H200",
    ),
    BuildEntry("ort", "fp32"),
    Quantization(),
    Quantization("none", padding_row=True),
    Quantization("chains", activation_group=64, details={"bits": 4, "drafts": {"bits": 4}}),
    DrafterSpec(
        "eagle3",
        "draft_head",
        "eagle3",
        projection="draft_projection",
        d2t="draft_d2t.npy",
        source={"spec": "eagle3:/heads", "weights": {"m": "ab"}},
    ),
    DrafterSpec("medusa", "draft_head", "last", medusa_heads=4),
    DynamicChoice(13, 4, 3),
    STATIC,
    TreeChoice("dynamic 13,4,3", "dynamic", dynamic=DynamicChoice(13, 4, 3), nodes=9),
    TreeChoice("chain 3", "chain", chain_length=3),
    TreeChoice(
        "suffix, 16-node budget", "budget", nodes=16, measured=ShapeMeasures(measured_speedup=2.0)
    ),
    ShapeMeasures(),
    ShapeMeasures(model_speedup=1.2, other={"predicted_speedup": 1.3}),
    CandidateTiming("chain 1", 1.2, 1.1),
    CalibratedSampling(0.7, 0.9),
]


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: type(s).__name__)
def test_each_section_reads_back_what_it_writes(section):
    written = json.loads(json.dumps(section.to_json()))  # through JSON: lists, not tuples
    assert type(section).from_json(written) == section


def test_a_calibration_entry_reads_back_what_it_writes():
    report = {"drafter": "eagle3", "batch_curve": [{"batch": 1, "measured_speedup": 1.4}]}
    entry = CalibrationEntry(STATIC, 2, 1.4, CalibratedSampling(0.7, 1.0), report)
    written = json.loads(json.dumps(entry.to_json()))
    assert written["drafter"] == "eagle3" and written["sampling"]["temperature"] == 0.7
    assert CalibrationEntry.from_json("calibration.eagle3", written) == entry
    shaped = CalibrationEntry(STATIC, 2, 1.4, CalibratedSampling(), report, CURVE)
    written = json.loads(json.dumps(shaped.to_json()))
    assert written["verify_shape"]["build"] == "ort-int4" and "verify_shape" not in report
    assert CalibrationEntry.from_json("calibration.eagle3", written) == shaped


CURVE = VerifyShape("ort-int4", (1, 2, 4, 8), (1.0, 1.2, 1.5, 2.3))

# A choice as `specx calibrate` wrote it before its measures were typed, and one of a
# calibration older still (a prediction under another name, no measured speedup).
RECORDED_CHOICE = {
    "label": "static 3 nodes, depth 2",
    "tree": "static",
    "choices": [[0], [1], [0, 0]],
    "nodes": 3,
    "depth": 2,
    "expected_accepted": 1.6,
    "model_speedup": 1.3,
    "measured_speedup": 1.4,
    "candidates": [
        {"label": "chain 2", "model_speedup": 1.2, "measured_speedup": 1.1},
        {"label": "static 3 nodes, depth 2", "model_speedup": 1.3, "measured_speedup": 1.4},
    ],
}
OLDER_CHOICE = {"label": "chain 3", "tree": "chain", "chain_length": 3, "predicted_speedup": 1.5}


def test_recorded_choices_load_typed_and_write_back_unchanged(artifact):
    entries = {
        key: {"choice": choice, "max_batch_spec": 1, "expected_speedup": 1.4}
        for key, choice in (("eagle3", RECORDED_CHOICE), ("ngram", OLDER_CHOICE))
    }
    _rewrite(artifact, calibration=entries)
    manifest = load_manifest(artifact)
    measured = manifest.calibration("eagle3").choice.measured
    assert measured == ShapeMeasures(
        2,
        1.6,
        1.3,
        1.4,
        (
            CandidateTiming("chain 2", 1.2, 1.1),
            CandidateTiming("static 3 nodes, depth 2", 1.3, 1.4),
        ),
    )
    older = manifest.calibration("ngram").choice.measured
    assert older == ShapeMeasures(other={"predicted_speedup": 1.5})
    for key, entry in entries.items():
        # written back in the current form: the greedy setting made explicit
        assert manifest.calibration(key).to_json() == {**entry, "sampling": SAMPLING_GREEDY}


SAMPLING_GREEDY = {"temperature": 0.0, "top_p": 1.0}


@pytest.mark.parametrize(
    ("measures", "message"),
    [
        ({"measured_speedup": "fast"}, "measured_speedup must be a number, got 'fast'"),
        ({"depth": 2.5}, "depth must be an integer, got 2.5"),
        ({"candidates": [{"label": "chain 2", "measured_speedup": 1.1}]}, "'model_speedup'"),
    ],
)
def test_a_malformed_measure_of_a_choice_is_named(measures, message):
    entry = {"choice": {**CHAIN_3, **measures}, "max_batch_spec": 1, "expected_speedup": 1.4}
    with pytest.raises(ArtifactError, match=rf"calibration\.ngram is malformed .*{message}"):
        CalibrationEntry.from_json("calibration.ngram", entry)


def test_a_verify_shape_interpolates_and_extends_its_last_slope():
    assert CURVE(1) == 1.0 and CURVE(4) == 1.5
    assert CURVE(3) == pytest.approx(1.35) and CURVE(6) == pytest.approx(1.9)
    assert CURVE(12) == pytest.approx(2.3 + 4 * 0.2)  # past 8 on the 4 -> 8 slope


@pytest.mark.parametrize(
    "shape",
    [{"build": "b", "tokens": [2, 4], "relative": [1.0, 1.1]}, {"build": "b", "tokens": [1, 2]}],
)
def test_a_malformed_verify_shape_is_named(shape):
    entry = CalibrationEntry(STATIC, 2, 1.4, CalibratedSampling()).to_json()
    with pytest.raises(ArtifactError, match=r"calibration\.eagle3 is malformed"):
        CalibrationEntry.from_json("calibration.eagle3", {**entry, "verify_shape": shape})


def test_optional_fields_at_their_defaults_are_left_out():
    assert GraphEntry("t.onnx").to_json() == {
        "file": "t.onnx",
        "inputs": [],
        "outputs": [],
        "data_files": [],
    }
    # A build without files of its own records its directory as null.
    assert BuildEntry("ort", "fp32").to_json() == {
        "backend": "ort",
        "precision": "fp32",
        "directory": None,
        "graphs": {},
    }
    assert TreeChoice("chain 3", "chain", chain_length=3).to_json() == CHAIN_3


# Quantization records as the builds wrote them before the record was typed.
WEIGHT_ONLY_RECORD = {
    "method": "rtn",
    "bits": 4,
    "block_size": 32,
    "symmetric": False,
    "accuracy_level": 4,
    "output_projection_bits": 4,
    "output_projection_rescored_top_k": 16,
    "scope": "all",
    "quantized_matmuls": {"target": {"4": 17}, "draft_head": {"4": 6}},
    "padding_row": False,
    "greedy_identity": "chains",
}
OPENVINO_RECORD = {
    "bits": 4,
    "block": 64,
    "symmetric": False,
    "activation_group": 64,
    "output_bits": 8,
    "greedy_identity": "chains",
    "drafts": {**WEIGHT_ONLY_RECORD, "quantized_matmuls": {"draft_head": {"4": 6}}},
}
INT8_RECORD = {
    "mode": "int8",
    "method": "QDQ",
    "source": "target.onnx",
    "quantized_matmuls": {"quantized": 17, "total": 17},
    "calibration_prompts": 3,
    "calibration_tokens": 24,
    "accuracy": {"top1_agreement": 0.98},
    "greedy_identity": "chains",
}


def test_a_null_quantization_field_reads_as_absent():
    """As the schema checks it (null counts as absent), a float build's identity: all."""
    record = {"greedy_identity": None, "padding_row": None, "bits": 8}
    assert Quantization.from_json(record) == Quantization(details={"bits": 8})


def test_quantization_records_written_before_the_type_load_and_write_back(artifact):
    exported = load_manifest(artifact).data["graphs"]
    records = {"ort-int4": WEIGHT_ONLY_RECORD, "openvino-int4": OPENVINO_RECORD}
    records |= {"ort-int8": INT8_RECORD, "ort-int8-draft": {"scope": "draft", "bits": 8}}
    build = {"backend": "ort", "precision": "int8", "directory": None, "graphs": exported}
    builds = {name: {**build, "quantization": q} for name, q in records.items()}
    _rewrite(artifact, builds=builds, default_build="ort-int4")
    on_disk = (artifact / "manifest.json").read_bytes()
    manifest = load_manifest(artifact)
    weight_only = manifest.builds["ort-int4"].quantization
    assert (weight_only.greedy_identity, weight_only.padding_row) == ("chains", False)
    assert weight_only.activation_group is None and weight_only.details["block_size"] == 32
    openvino = manifest.builds["openvino-int4"].quantization
    assert (openvino.activation_group, openvino.padding_row) == (64, None)
    assert openvino.details["drafts"] == OPENVINO_RECORD["drafts"]
    assert manifest.builds["ort-int8"].quantization.greedy_identity == "chains"
    assert manifest.builds["ort-int8-draft"].quantization.greedy_identity == "all"
    for name, record in records.items():
        assert manifest.builds[name].quantization.to_json() == record
    # Written through the typed values, the manifest is the same bytes.
    typed = {name: entry.to_json() for name, entry in manifest.builds.items()}
    write_manifest(artifact, {**manifest_body(manifest), "builds": typed})
    assert (artifact / "manifest.json").read_bytes() == on_disk


def _assert_sections_write_what_is_on_disk(root) -> None:
    """Each typed section of the manifest at `root`, written out, is its JSON on disk."""
    manifest = load_manifest(root)
    data = json.loads((root / "manifest.json").read_text())
    assert manifest.model.to_json() == data["model"]
    assert {name: g.to_json() for name, g in manifest.graphs.items()} == data["graphs"]
    assert {name: b.to_json() for name, b in manifest.builds.items()} == data.get("builds", {})
    drafter = None if manifest.drafter is None else manifest.drafter.to_json()
    assert drafter == data.get("drafter")
    for key in manifest.calibration_keys:
        assert manifest.calibration(key).to_json() == data["calibration"][key]


def test_an_export_and_its_builds_write_their_sections_back_unchanged(
    artifacts, head_artifacts, tmp_path
):
    _assert_sections_write_what_is_on_disk(artifacts["llama"])
    _assert_sections_write_what_is_on_disk(head_artifacts["medusa"])
    artifact = shutil.copytree(head_artifacts["eagle3"], tmp_path / "eagle3")
    _assert_sections_write_what_is_on_disk(artifact)
    assert load_manifest(artifact).graph("draft_chain").ort_only
    build_artifact(artifact, BuildOptions())  # ort-fp32: lowered, the chain derived again
    build_artifact(artifact, BuildOptions("ort", "int8"))  # a weight-only record
    manifest = load_manifest(artifact)
    assert manifest.builds["ort-fp32"].lowering and manifest.builds["ort-int8"].quantization
    _assert_sections_write_what_is_on_disk(artifact)


def test_typed_writes_replace_a_build_and_a_calibration(artifact):
    manifest = load_manifest(artifact)
    build = BuildEntry("ort", "fp32", graphs={"target": manifest.graph("target")})
    entry = CalibrationEntry(STATIC, 2, 1.4, CalibratedSampling(), {"drafter": "eagle3"})
    changed = manifest.with_new_build("q", build).with_calibration("eagle3", entry)
    write_manifest(artifact, manifest_body(changed))
    manifest = load_manifest(artifact)
    assert manifest.default_build == "q" and manifest.build == build
    assert manifest.calibration("eagle3") == entry
    fp16 = replace(build, precision="fp16")
    write_manifest(artifact, manifest_body(manifest.with_new_build("q", fp16)))
    assert load_manifest(artifact).builds == {"q": fp16}
    _assert_sections_write_what_is_on_disk(artifact)
