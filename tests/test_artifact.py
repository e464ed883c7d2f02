"""Artifacts: what the manifest pins, and refusal of tampered, truncated or foreign ones."""

from __future__ import annotations

import json
import shutil

import pytest

from specx.artifact import FORMAT_VERSION, load_manifest, sha256_file
from specx.errors import ArtifactError
from specx.export import target_export
from specx.export.target_export import export_target


@pytest.fixture
def artifact_copy(artifacts, tmp_path):
    return shutil.copytree(artifacts["llama"], tmp_path / "artifact")


def test_manifest_pins_source_and_files(artifacts, checkpoints):
    manifest = load_manifest(artifacts["llama"])
    data = manifest.data
    assert data["format_version"] == FORMAT_VERSION and data["specx_version"]
    assert data["source"]["family"] == "llama"
    assert data["source"]["weights"] == {
        "model.safetensors": sha256_file(checkpoints["llama"] / "model.safetensors")
    }
    assert set(data["files"]) == {"target.onnx", "target.onnx.data", "tokenizer.json"}
    for name, digest in data["files"].items():
        assert sha256_file(artifacts["llama"] / name) == digest
    assert data["graphs"]["target"]["opset"] == 24
    assert manifest.tokenizer_file.name == "tokenizer.json"


def test_tampered_weights_are_refused(artifact_copy):
    data = artifact_copy / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match=r"target\.onnx\.data does not match .*sha256"):
        load_manifest(artifact_copy)


def test_truncated_graph_is_refused(artifact_copy):
    graph = artifact_copy / "target.onnx"
    graph.write_bytes(graph.read_bytes()[:1000])
    with pytest.raises(ArtifactError, match=r"target\.onnx does not match"):
        load_manifest(artifact_copy)


def test_missing_file_is_refused(artifact_copy):
    (artifact_copy / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match=r"tokenizer\.json is listed .* but missing"):
        load_manifest(artifact_copy)


def test_newer_format_is_refused(artifact_copy):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    manifest["specx_version"] = "9.0.0"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"artifact format 2, written by specx '9\.0\.0'"):
        load_manifest(artifact_copy)


def test_unpinned_graph_is_refused(artifact_copy):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["files"]["target.onnx"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="does not pin its sha256"):
        load_manifest(artifact_copy)


def test_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        load_manifest(tmp_path)


def test_existing_output_needs_overwrite(checkpoints, artifact_copy):
    with pytest.raises(ArtifactError, match="already exists; pass --overwrite"):
        export_target(checkpoints["llama"], artifact_copy)


def test_interrupted_export_leaves_nothing(checkpoints, tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(target_export, "save_graph_streamed", crash)
    with pytest.raises(KeyboardInterrupt):
        export_target(checkpoints["llama"], tmp_path / "out", max_context=32)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_overwrite_keeps_old_artifact(checkpoints, artifact_copy, monkeypatch):
    before = (artifact_copy / "manifest.json").read_text()
    monkeypatch.setattr(
        target_export,
        "save_graph_streamed",
        lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt),
    )
    with pytest.raises(KeyboardInterrupt):
        export_target(checkpoints["llama"], artifact_copy, max_context=32, overwrite=True)
    assert (artifact_copy / "manifest.json").read_text() == before
    assert sorted(p.name for p in artifact_copy.parent.iterdir()) == ["artifact"]
    load_manifest(artifact_copy)


def test_an_eos_token_outside_the_vocabulary_is_refused(artifact_copy):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    vocab = manifest["model"]["vocab_size"]
    manifest["model"]["eos_token_ids"] = [0, vocab]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=rf"eos_token_ids \[{vocab}\] lie outside the vocab"):
        load_manifest(artifact_copy)
