"""Bad input destroys nothing and is never silently wrong: one clear error, before any work."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import specx.export.target_export as target_export
from specx.artifact import check_output_dir, load_manifest, manifest_body, write_manifest
from specx.calibration.calibrate import batch_summary
from specx.cli import main
from specx.errors import ArtifactError, GenerationError
from specx.runtime.drafters.draft_model import VocabMismatchError, check_same_vocabulary
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.prompts import read_prompts_file
from specx.runtime.sampling import SamplingParams
from specx.runtime.targets.ort import OrtTarget


def run(*args) -> SimpleNamespace:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return SimpleNamespace(code=result.exit_code, out=result.stdout, err=result.stderr)


def snapshot(*roots: Path) -> dict[str, tuple[int, bytes]]:
    """Every file and directory under `roots`: mode and content."""
    found = {}
    for root in roots:
        for p in [root, *root.rglob("*")]:
            content = p.read_bytes() if p.is_file() else b"<dir>"
            found[str(p)] = (p.stat().st_mode, content)
    return found


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if an export gets as far as loading the checkpoint."""

    def refuse(*args, **kwargs):
        raise AssertionError("the export loaded the checkpoint before refusing")

    monkeypatch.setattr(target_export, "load_checkpoint", refuse)


@pytest.fixture
def checkpoint_copy(checkpoints, tmp_path):
    return shutil.copytree(checkpoints["llama"], tmp_path / "ckpt")


# --- data loss -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where",
    [
        "the checkpoint",
        "a parent of it",
        "the current directory",
        "a file",
        "user data",
        "new/../checkpoint",
        "a symlink to an artifact",
        "an artifact holding a user file",
    ],
)
def test_overwrite_never_replaces_what_specx_did_not_write(
    where, checkpoint_copy, artifacts, tmp_path, monkeypatch, no_loading
):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    (tmp_path / "file.txt").write_text("mine")
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "art")
    (tmp_path / "link").symlink_to(artifact)
    monkeypatch.chdir(user)
    output = {
        "the checkpoint": checkpoint_copy,
        "a parent of it": tmp_path,
        "the current directory": Path("."),
        "a file": tmp_path / "file.txt",
        "user data": user,
        "new/../checkpoint": tmp_path / "new" / ".." / "ckpt",
        "a symlink to an artifact": tmp_path / "link",
        "an artifact holding a user file": artifact,
    }[where]
    if where == "an artifact holding a user file":
        (artifact / "my-notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    result = run("export", checkpoint_copy, "-o", output, "--overwrite")
    assert result.code == 2 and result.err.startswith("error: refusing to replace"), result.err
    assert snapshot(tmp_path) == before


def test_existing_output_without_overwrite(checkpoint_copy, artifacts, tmp_path, no_loading):
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "art")
    assert "pass --overwrite" in run("export", checkpoint_copy, "-o", artifact).err
    refused = run("export", checkpoint_copy, "-o", checkpoint_copy).err
    assert "is not a specx artifact" in refused and "--overwrite" not in refused


def test_overwrite_replaces_an_artifact_and_keeps_the_umask(checkpoint_copy, artifacts, tmp_path):
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "art")
    old = os.umask(0o022)
    try:
        result = run("export", checkpoint_copy, "-o", artifact, "--overwrite", "--max-context", 64)
    finally:
        os.umask(old)
    assert result.code == 0, result.err
    assert load_manifest(artifact).model.kv_capacity == 64
    for p in [artifact, *artifact.rglob("*")]:
        assert stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644), p


def test_the_exporters_chatter_is_silenced():
    """torch logs a "torchvision is not installed" warning per torchvision op, every export."""
    import logging

    from specx.export.onnx_graph import _quiet_exporter

    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    assert registration.isEnabledFor(logging.WARNING)
    with _quiet_exporter():
        assert not registration.isEnabledFor(logging.WARNING)
        assert registration.isEnabledFor(logging.ERROR)
    assert registration.isEnabledFor(logging.WARNING)


def test_interrupted_replacement_is_rechecked(artifacts, tmp_path):
    """A user file that appears while the export runs still stops the replacement."""
    from specx.artifact import atomic_output_dir

    artifact = shutil.copytree(artifacts["llama"], tmp_path / "art")
    with pytest.raises(ArtifactError, match="does not pin"):
        with atomic_output_dir(artifact, overwrite=True) as staging:
            (staging / "x").write_text("new")
            (artifact / "late.txt").write_text("mine")
    assert (artifact / "late.txt").read_text() == "mine"
    assert check_output_dir(tmp_path / "a" / "b").name == "b"
    (tmp_path / "f").write_text("")
    with pytest.raises(ArtifactError, match="is not a directory"):
        check_output_dir(tmp_path / "f" / "b")


@pytest.mark.parametrize("where", ["the target", "user data"])
def test_train_output_is_refused_before_loading(where, checkpoint_copy, tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.json").write_text("{}")
    output = checkpoint_copy if where == "the target" else user
    before = snapshot(tmp_path)
    result = run("train", "eagle", checkpoint_copy, "--corpus", checkpoint_copy, "-o", output)
    assert result.code == 2 and "-o" in result.err, result.err
    assert snapshot(tmp_path) == before


def test_pack_output(artifacts, tmp_path):
    (tmp_path / "file.tar").write_text("mine")
    before = snapshot(tmp_path)
    for overwrite in ([], ["--overwrite"]):
        result = run("pack", artifacts["llama"], "-o", tmp_path / "file.tar", *overwrite)
        assert result.code == 2 and "not a tar written by specx pack" in result.err
    assert snapshot(tmp_path) == before
    packed = tmp_path / "missing" / "dir" / "x.tar"
    assert run("pack", artifacts["llama"], "-o", packed).code == 0
    assert "pass --overwrite" in run("pack", artifacts["llama"], "-o", packed).err
    assert run("pack", artifacts["llama"], "-o", packed, "--overwrite").code == 0
    assert "not a directory" in run("pack", artifacts["llama"], "-o", packed / "x.tar").err


def test_demo_workdir_must_be_new_and_the_temp_dir_is_cleaned(checkpoints, tmp_path, monkeypatch):
    import tempfile

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert "not an empty directory" in run("demo", "--workdir", tmp_path / "busy").err
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    result = run("demo", "--target", checkpoints["llama"], "--max-new-tokens", 8)
    assert result.code == 0, result.err
    assert json.loads(result.out)["identical_to_plain"] is True
    assert list(scratch.iterdir()) == []


# --- silently wrong --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "nan"], "'nan' is not a finite number"),
        (["--temperature", "inf"], "'inf' is not a finite number"),
        (["--top-p", "nan"], "'--top-p'"),
        (["--top-k", "5"], "--top-k applies only to sampling"),
        (["--top-p", "0.5"], "--top-p applies only to sampling"),
        (["--tree", "chain:3"], "--tree applies only to speculative decoding"),
        (["--num-draft-tokens", "3"], "--num-draft-tokens applies only to speculative"),
        (["--max-batch-spec", "2"], "--max-batch-spec applies only to speculative"),
        (["--drafter", "ngram", "--ngram-min", "4"], "--ngram-min 4 is larger"),
        (["--drafter", "mtp", "--ngram-matches", "2"], "--ngram-matches applies only to --drafter"),
        (["--threads", "-1"], "'--threads': -1 is not in the range"),
        (["--threads", "0"], "'--threads': 0 is not in the range"),
        (["--seed", "-1"], "'--seed': -1 is not in the range"),
        (["--max-new-tokens", "0"], "'--max-new-tokens': 0 is not in the range"),
    ],
)
def test_generate_refuses_ignored_or_out_of_range_options(artifacts, args, message):
    result = run("generate", artifacts["llama"], "--prompt-ids", "1,2", *args)
    assert result.code == 2 and message in result.err, result.err
    assert len(result.err.strip().splitlines()) == 1


def test_seed_without_temperature_warns_and_decodes_greedily(artifacts):
    greedy = run("generate", artifacts["llama"], "--prompt-ids", "1,2", "--json")
    seeded = run("generate", artifacts["llama"], "--prompt-ids", "1,2", "--json", "--seed", 3)
    assert "warning: --seed has no effect" in seeded.err
    assert json.loads(seeded.out)["tokens"] == json.loads(greedy.out)["tokens"]


def test_sampling_params_refuse_non_finite_values():
    for bad in (
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"seed": -1},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('{"prompt_ids": "1,2,3"}', "'prompt_ids' must be a non-empty list of integers"),
        ('{"prompt_ids": [1.7, 2.2]}', "prompt_ids[0] must be a non-negative integer, got 1.7"),
        ('{"prompt_ids": [1, true]}', "prompt_ids[1] must be a non-negative integer, got True"),
        ('{"prompt_ids": ["a"]}', "prompt_ids[0] must be a non-negative integer"),
        ('{"prompt_ids": []}', "got an empty list"),
        ('{"prompt": 42}', "'prompt' must be a non-empty string, got the number 42"),
        ('{"prompt": ""}', "got an empty string"),
        ('{"turns": []}', "'turns' must be a non-empty list"),
        ('{"turns": [7]}', "'turns[0]' must be a non-empty string"),
        ('{"prompt": "a", "prompt_ids": [1]}', "exactly one of"),
        ('{"question_id": 3}', "found none"),
        ("[1, 2]", "expected a JSON object, got a list"),
        ('{"prompt": "a"', "not valid JSON"),
    ],
)
def test_prompts_file_values_are_checked_by_type(tmp_path, lines, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + lines + "\n")
    with pytest.raises(GenerationError) as error:
        read_prompts_file(path)
    assert f"{path}:3: " in str(error.value) and message in str(error.value)


def test_binary_and_empty_prompts_files(tmp_path):
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b'{"prompt": "a"}\n\xff\xfe\x00')
    with pytest.raises(GenerationError, match=r"b\.jsonl:2: not UTF-8"):
        read_prompts_file(binary)
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(GenerationError, match="has no prompts"):
        read_prompts_file(empty)


def test_a_draft_model_without_a_tokenizer_is_refused():
    def backend(name, files):
        manifest = SimpleNamespace(root=Path(name), files=files)
        return SimpleNamespace(vocab_size=10, manifest=manifest)

    with_tokenizer = backend("target", {"tokenizer.json": "a" * 64})
    without = backend("draft", {})
    with pytest.raises(VocabMismatchError, match="draft has none"):
        check_same_vocabulary(with_tokenizer, without)
    with pytest.raises(VocabMismatchError, match="sha256 differs"):
        check_same_vocabulary(with_tokenizer, backend("d", {"tokenizer.json": "b" * 64}))
    check_same_vocabulary(backend("t", {}), without)  # neither has one: ids only


def test_eagle3_taps_that_coincide_are_named(checkpoint_copy, tmp_path):
    result = run(
        "export", checkpoint_copy, "-o", tmp_path / "a", "--taps", "eagle3", "--max-context", 32
    )
    assert result.code == 0, result.err
    assert "warning: --taps eagle3 on a 4-layer target reads layers [2, 2, 1]" in result.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["eagle3", "--draft-vocab", "100000"], "--draft-vocab 100000 must be in [1, 512]"),
        (["eagle", "--draft-vocab", "10"], "--draft-vocab applies only to eagle3 training"),
        (["medusa", "--ttt-steps", "2"], "--ttt-steps applies only to eagle3 and mtp"),
        (["eagle", "--lr", "-1"], "'--lr': -1.0 is not in the range"),
        (["eagle", "--lr", "nan"], "'nan' is not a finite number"),
        (["eagle", "--steps", "0"], "'--steps': 0 is not in the range"),
    ],
)
def test_train_options_are_checked_before_loading(checkpoint_copy, tmp_path, args, message):
    kind, *rest = args
    result = run(
        "train", kind, checkpoint_copy, "--corpus", checkpoint_copy, "-o", tmp_path / "out", *rest
    )
    assert result.code == 2 and message in result.err, result.err
    assert not (tmp_path / "out").exists()


# --- tracebacks ------------------------------------------------------------------------------


BLOCK_EXPORT_EXTRA = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "onnx", "onnxscript", "onnx_ir"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from specx.cli import main
main(prog_name="specx")
"""


@pytest.mark.parametrize(
    "command",
    [
        ["export", "{ckpt}", "-o", "{tmp}/a"],
        ["demo"],
        ["train", "eagle", "{ckpt}", "--corpus", "{ckpt}", "-o", "{tmp}/h"],
        ["build", "{art}", "--precision", "fp16"],
        ["lint", "{art}"],
        ["quantize", "{art}", "--prompts", "{tmp}/p.jsonl"],
    ],
)
def test_a_runtime_only_install_names_the_extra(command, checkpoint_copy, artifacts, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    values = {"ckpt": checkpoint_copy, "art": artifacts["llama"], "tmp": tmp_path}
    args = [a.format(**values) for a in command]
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_EXPORT_EXTRA, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: specx {command[0]} needs the 'export' extra")
    ), done.stderr
    assert "pip install 'specx[export]'" in done.stderr and "Traceback" not in done.stderr


def test_the_command_list_says_each_command_whole():
    """`specx --help` gives every command a whole summary, none cut short with '...'."""
    from click.testing import CliRunner

    from specx.cli import main

    listed = CliRunner().invoke(main, ["--help"], terminal_width=80).output
    commands = listed[listed.index("Commands:") :]
    assert "..." not in commands, commands
    for name in main.commands:
        assert f"  {name} " in commands


def test_python_m_runs_every_command():
    for command in ("quantize", "lint", "build", "pack", "verify", "calibrate", "generate"):
        done = subprocess.run(
            [sys.executable, "-m", "specx.cli", command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and f"specx {command}" in done.stdout, done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["calibrate", "{art}", "--repeats", "0"], "'--repeats': 0 is not in the range"),
        (["calibrate", "{art}", "--probe-depth", "-2"], "'--probe-depth': -2 is not"),
        (["build", "{art}", "--max-batch", "4"], "--max-batch applies only to --backend trt"),
        (["build", "{art}", "--backend", "trt", "--optimization-level", "9"], "0<=x<=5"),
        (["quantize", "{art}", "--prompts", "{tmp}/p.jsonl", "--max-prompts", "0"], "x>=1"),
        (["export", "{art}", "-o", "{tmp}/x", "--max-context", "1"], "'--max-context': 1 is"),
    ],
)
def test_other_commands_check_ranges(artifacts, tmp_path, args, message):
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    values = {"art": artifacts["llama"], "tmp": tmp_path}
    result = run(*[a.format(**values) for a in args])
    assert result.code == 2 and message in result.err, result.err


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (("model", "kv_capacity"), "lots", "model: kv_capacity must be a positive integer"),
        (("model", "eos_token_ids"), [1, "x"], "eos_token_ids must be a list of non-negative"),
        (("model", "taps"), {"kind": "all"}, "taps: kind must be one of"),
        (("default_build",), 3, "default_build must be a string"),
        (("graphs", "target", "file"), "../../etc/passwd", "graphs.target.file must be a"),
        (("files",), {"/etc/passwd": "0" * 64}, "not a path inside the artifact"),
    ],
)
def test_malformed_manifest_fields_are_named(artifacts, tmp_path, field, value, message):
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "a")
    path = artifact / "manifest.json"
    data = json.loads(path.read_text())
    parent = data
    for key in field[:-1]:
        parent = parent[key]
    parent[field[-1]] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=message.replace("[", r"\[")):
        load_manifest(artifact)
    result = run("generate", artifact, "--prompt-ids", "1")
    assert result.code == 2 and message in result.err


# --- misleading output -----------------------------------------------------------------------


def test_batch_stats_say_per_token_and_per_step(artifacts):
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    seen = []
    result = generate_plain(
        target, [[1, 2], [3], [4, 5, 6]], 9, progress=lambda t, f: seen.append(t)
    )
    stats = result.stats
    assert stats.target_forwards == 8 and stats.new_tokens == 27
    decode_ms = 1e3 * stats.decode_s
    assert stats.ms_per_token == pytest.approx(decode_ms / (27 - 3))
    assert stats.ms_per_step == pytest.approx(decode_ms / 8)
    assert seen == [3 * i for i in range(1, 10)]


def test_batch_text_output_progress_and_stats_line(artifacts, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n{"prompt": "import os"}\n')
    result = run(
        "generate",
        artifacts["llama"],
        "--prompts-file",
        prompts,
        "--max-new-tokens",
        4,
        "--ignore-eos",
    )
    assert result.code == 0, result.err
    assert "--- completion 1/2 ---" in result.out and "--- completion 2/2 ---" in result.out
    assert "decoding plainly: 8/8 tokens, 2/2 sequences done" in result.err
    assert "ms/token" in result.err and "ms/step" in result.err


def test_calibrated_speculation_off_names_the_calibration(artifacts, tmp_path):
    artifact = shutil.copytree(artifacts["llama"], tmp_path / "a")
    body = manifest_body(load_manifest(artifact))
    body["calibration"] = {
        "ngram": {
            "choice": {"tree": "chain", "chain_length": 3, "label": "chain 3"},
            "max_batch_spec": 0,
            "expected_speedup": 1.0,
        }
    }
    write_manifest(artifact, body)
    result = run("generate", artifact, "--prompt-ids", "1,2", "--drafter", "ngram", "--json")
    message = json.loads(result.out)["stats"]["speculation"]
    assert "calibration (specx calibrate)" in message and "--max-batch-spec 0" not in message
    assert batch_summary(0).startswith("speculation off") and "batch 0" not in batch_summary(0)
    body["calibration"]["ngram"]["choice"] = {"tree": "dynamic"}
    write_manifest(artifact, body)
    broken = run("generate", artifact, "--prompt-ids", "1,2", "--drafter", "ngram")
    assert broken.code == 2 and "calibration.ngram is malformed" in broken.err
