"""`specx pack` / `verify` / `unpack`: deterministic tars; tampering, truncation, engines."""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import pytest
from click.testing import CliRunner

import specx.publish
from specx.artifact import load_manifest, manifest_body, write_manifest
from specx.cli import main
from specx.errors import ArtifactError
from specx.publish import pack_artifact, verify_artifact


@pytest.fixture
def artifact(artifacts, tmp_path):
    return shutil.copytree(artifacts["qwen2"], tmp_path / "qwen2-artifact")


@pytest.fixture
def packed(artifact, tmp_path):
    return pack_artifact(artifact, tmp_path / "qwen2.tar")


def _rewrite(packed, tmp_path, edit) -> str:
    """A copy of the tar with `edit(name, data) -> (name, data) | None` applied per member."""
    out = tmp_path / "edited.tar"
    with tarfile.open(packed) as src, tarfile.open(out, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            edited = edit(member.name, data)
            if edited is None:
                continue
            member.name, data = edited
            member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    return out


def test_pack_then_verify(packed, artifact, tmp_path):
    report = verify_artifact(packed)
    assert report.files == len(load_manifest(artifact).data["files"])
    again = pack_artifact(artifact, tmp_path / "again.tar")
    assert again.read_bytes() == packed.read_bytes()  # deterministic
    with tarfile.open(packed) as tar:
        assert sorted(m.name for m in tar.getmembers())[0].startswith("qwen2-artifact/")


def test_a_modified_file_is_refused(packed, tmp_path):
    def flip(name, data):
        if name.endswith("target.onnx.data"):
            data = bytes([data[0] ^ 1]) + data[1:]
        return name, data

    with pytest.raises(ArtifactError, match="target.onnx.data does not match the manifest"):
        verify_artifact(_rewrite(packed, tmp_path, flip))


def test_a_truncated_tar_is_refused(packed, tmp_path):
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    with pytest.raises(ArtifactError, match="truncated|missing|does not match"):
        verify_artifact(truncated)


def test_missing_and_unlisted_files_are_refused(packed, tmp_path):
    def drop(name, data):
        return None if name.endswith("tokenizer.json") else (name, data)

    with pytest.raises(ArtifactError, match="tokenizer.json is listed in the manifest but missing"):
        verify_artifact(_rewrite(packed, tmp_path, drop))

    def smuggle(name, data):
        return (name.replace("tokenizer.json", "extra.py"), data)

    with pytest.raises(ArtifactError, match="does not pin"):
        verify_artifact(_rewrite(packed, tmp_path, smuggle))


def test_unsafe_members_are_refused(packed, tmp_path):
    def escape(name, data):
        return (name.replace("qwen2-artifact/tokenizer.json", "qwen2-artifact/../evil"), data)

    with pytest.raises(ArtifactError, match="unsafe member"):
        verify_artifact(_rewrite(packed, tmp_path, escape))
    linked = tmp_path / "linked.tar"
    shutil.copy(packed, linked)
    with tarfile.open(linked, "a") as tar:
        link = tarfile.TarInfo("qwen2-artifact/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    with pytest.raises(ArtifactError, match="unsafe member 'qwen2-artifact/link'"):
        verify_artifact(linked)


def _with_trt_build(artifact):
    """The artifact with a (fake) TensorRT build entry: an engine built elsewhere."""
    manifest = load_manifest(artifact)
    build_dir = artifact / "builds" / "trt-fp16.x"
    build_dir.mkdir(parents=True)
    (build_dir / "target.engine").write_bytes(b"serialized engine")
    body = manifest_body(manifest)
    body["builds"] = {
        "trt-fp16": {
            "backend": "trt",
            "precision": "fp16",
            "tensorrt_version": "10.15.1",
            "compute_capability": "9.0",
            "gpu": "NVIDIA H200",
            "directory": "builds/trt-fp16.x",
            "graphs": {
                "target": {
                    **manifest.data["graphs"]["target"],
                    "engine": "builds/trt-fp16.x/target.engine",
                    "profiles": ["decode", "prefill"],
                }
            },
        }
    }
    write_manifest(artifact, body)
    return artifact


def test_foreign_engines_are_refused_where_tensorrt_runs(artifact, monkeypatch):
    _with_trt_build(artifact)
    monkeypatch.setattr(specx.publish, "_local_tensorrt", lambda: None)
    report = verify_artifact(artifact)
    assert report.builds == {"trt-fp16": "trt/fp16"}
    assert "not checked against this machine" in report.notes[0]
    monkeypatch.setattr(specx.publish, "_local_tensorrt", lambda: ("10.15.2", "9.0"))
    assert verify_artifact(artifact).notes == []
    monkeypatch.setattr(specx.publish, "_local_tensorrt", lambda: ("10.15.2", "8.6"))
    with pytest.raises(ArtifactError, match="compute capability 9.0 .*this GPU is 8.6"):
        verify_artifact(artifact)


def test_a_swapped_engine_is_refused(artifact, tmp_path):
    _with_trt_build(artifact)
    (artifact / "builds" / "trt-fp16.x" / "target.engine").write_bytes(b"another engine")
    with pytest.raises(ArtifactError, match="target.engine does not match"):
        verify_artifact(artifact)


def test_cli_pack_and_verify(artifact, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli.tar"
    assert runner.invoke(main, ["pack", str(artifact), "-o", str(out)]).exit_code == 0
    result = runner.invoke(main, ["verify", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["files"] == len(load_manifest(artifact).data["files"])
    out.write_bytes(out.read_bytes()[:2000])
    result = runner.invoke(main, ["verify", str(out)])
    assert result.exit_code == 2 and result.output.startswith("error:")


def test_unpack_writes_the_artifact_back_and_it_runs(packed, artifact, tmp_path):
    """Every pinned file and the manifest, byte for byte; it loads with its hashes checked
    and generates what the original does."""
    import specx
    from specx.publish import unpack_artifact

    said: list[str] = []
    out = unpack_artifact(packed, tmp_path / "unpacked", progress=said.append)
    original = load_manifest(artifact)
    assert load_manifest(out).files == original.files  # every pin checked on load
    for name in [*original.files, "manifest.json"]:
        assert (out / name).read_bytes() == (artifact / name).read_bytes(), name
    assert said[0].startswith("unpacking") and said[-1].startswith(f"{len(original.files)}/")
    prompt = [1, 2, 3, 4]
    want = specx.load(artifact).generate(prompt, max_new_tokens=6, ignore_eos=True).tokens
    assert specx.load(out).generate(prompt, max_new_tokens=6, ignore_eos=True).tokens == want


def test_unpack_checks_each_file_and_leaves_nothing_when_one_is_off(packed, tmp_path):
    from specx.publish import unpack_artifact

    def flip(name, data):
        if name.endswith("tokenizer.json"):
            data = data[:-1] + bytes([data[-1] ^ 1])
        return name, data

    edited = _rewrite(packed, tmp_path, flip)
    with pytest.raises(ArtifactError, match="tokenizer.json does not match the manifest"):
        unpack_artifact(edited, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited.tar", "qwen2-artifact",
                                                          "qwen2.tar"]  # fmt: skip


def test_unpack_replaces_only_an_artifact_and_only_when_told(packed, artifact, tmp_path):
    """Named as in the tar, beside it, by default; an artifact there is replaced only with
    overwrite, and a directory of other data never."""
    from specx.publish import unpack_artifact

    with pytest.raises(ArtifactError, match="already exists; pass --overwrite"):
        unpack_artifact(packed)  # the fixture packed `artifact`, which sits beside the tar
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = shutil.copy(packed, elsewhere / "qwen2.tar")
    assert unpack_artifact(moved) == elsewhere / "qwen2-artifact"
    assert unpack_artifact(moved, overwrite=True) == elsewhere / "qwen2-artifact"
    other = tmp_path / "data"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="not replaceable|does not pin|not a specx artifact"):
        unpack_artifact(packed, other, overwrite=True)
    assert (other / "notes.txt").read_text() == "mine"


def test_cli_unpack(packed, tmp_path):
    out = tmp_path / "cli-unpacked"
    result = CliRunner().invoke(main, ["unpack", str(packed), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert load_manifest(out).files
    again = CliRunner().invoke(main, ["unpack", str(packed), "-o", str(out)])
    assert again.exit_code == 2 and "already exists; pass --overwrite" in again.output
    replaced = CliRunner().invoke(main, ["unpack", str(packed), "-o", str(out), "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
