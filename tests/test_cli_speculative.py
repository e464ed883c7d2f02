"""`specx generate --drafter ...` and `specx demo` from the command line."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from specx.cli import main


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_ngram_compare_reports_speedup_and_identity(artifacts):
    prompt = ",".join(["5", "6", "7", "8"] * 4)
    result = invoke(
        "generate",
        artifacts["llama"],
        "--prompt-ids",
        prompt,
        "--drafter",
        "ngram",
        "--num-draft-tokens",
        5,
        "--ngram-matches",
        2,
        "--compare",
        "--json",
        "--max-new-tokens",
        24,
        "--threads",
        2,
    )
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    assert stats["mode"] == "speculative" and stats["drafter"] == "ngram"
    assert stats["compare"]["identical_tokens"] is True
    assert stats["compare"]["speedup"] > 0
    assert stats["acceptance_length"] >= 1.0
    assert stats["draft"] == "ngram's own trees, up to 5 nodes"  # 2 matches: a tree


def test_compare_reports_no_speedup_where_both_runs_decoded_plainly(artifacts):
    """Speculation off (here by --max-batch-spec 0; a calibration can decide the same): the
    two runs are both plain, and their ratio is noise, not a speedup."""
    args = ["generate", artifacts["llama"], "--prompt-ids", "5,6,7,8,5,6,7,8", "--drafter"]
    args += ["ngram", "--max-batch-spec", 0, "--compare", "--max-new-tokens", 8]
    stats = json.loads(invoke(*args, "--json").stdout)["stats"]
    assert stats["mode"] == "plain" and stats["speculation"].startswith("off")
    assert "draft" not in stats  # nothing was drafted
    assert stats["compare"]["speedup"] is None and stats["compare"]["identical_tokens"] is True
    line = invoke(*args).stderr
    assert "both runs decoded plainly (off: " in line and "no speedup to report" in line
    assert re.search(r"speedup \d", line) is None


@pytest.mark.parametrize("fixed", [False, True])
def test_the_controller_sizes_drafts_unless_fixed(artifacts, fixed):
    prompt = ",".join(["5", "6", "7", "8"] * 4)
    flags = ["--fixed-draft"] if fixed else []
    result = invoke("generate", artifacts["llama"], "--prompt-ids", prompt, "--drafter",
                    "suffix", "--compare", "--json", "--max-new-tokens", 24, *flags)  # fmt: skip
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    assert stats["drafter"] == "suffix" and stats["compare"]["identical_tokens"] is True
    assert ("sizes_chosen" in stats) is not fixed
    if not fixed:
        assert sum(stats["sizes_chosen"].values()) == stats["rounds"]


def test_draft_model_with_static_tree(artifacts, draft_artifacts, tmp_path):
    tree = tmp_path / "tree.json"
    tree.write_text("[[0], [1], [0, 0]]")
    result = invoke(
        "generate",
        artifacts["llama"],
        "--prompt-ids",
        "3,4,5",
        "--drafter",
        f"draft-model:{draft_artifacts['llama']}",
        "--tree",
        tree,
        "--fixed-draft",  # the whole tree every round: its depth shows in the stats
        "--compare",
        "--json",
        "--max-new-tokens",
        16,
    )
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    assert stats["drafter"] == "draft-model" and stats["compare"]["identical_tokens"] is True
    assert len(stats["acceptance_by_position"]) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--drafter", "hydra"], "unknown drafter 'hydra'"),
        (["--drafter", "ngram", "--tree", "[[0]]"], "--tree does not apply to ngram"),
        (["--drafter", "draft-model"], "draft-model needs an artifact"),
        (["--drafter", "ngram", "--num-draft-tokens", "0"], "0 is not in the range x>=1"),
        (["--compare"], "--compare applies only to speculative decoding: add --drafter"),
        (["--fixed-draft"], "--fixed-draft applies only to speculative decoding"),
        (["--drafter", "suffix", "--tree", "[[0]]"], "--tree does not apply to suffix"),
        (["--drafter", "suffix", "--ngram-max", "4"], "--ngram-max applies only to --drafter"),
    ],
)
def test_bad_speculative_options(artifacts, args, message):
    result = invoke("generate", artifacts["llama"], "--prompt-ids", "1,2", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_malformed_tree_is_a_clear_error(artifacts, draft_artifacts):
    result = invoke(
        "generate",
        artifacts["llama"],
        "--prompt-ids",
        "1,2",
        "--drafter",
        f"draft-model:{draft_artifacts['llama']}",
        "--tree",
        "[[0],[1,0]]",
    )
    assert result.exit_code == 2 and "has no parent [1]" in result.output


def test_demo_runs_end_to_end_through_the_engine(tmp_path, monkeypatch):
    """The demo decodes as a user's code does: `specx.load`, then `Engine.generate` plainly
    and with n-gram speculation (so its stats name the build and why it runs)."""
    from specx.runtime.engine import Engine

    calls: list[object] = []
    generate = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, *a, **k: calls.append(
        k.get("speculation")) or generate(self, *a, **k))  # fmt: skip
    result = invoke("demo", "--workdir", tmp_path, "--max-new-tokens", 24, "--threads", 2)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert calls == [None, "ngram"]
    assert report["identical_to_plain"] is True
    assert report["speculative"]["mode"] == "speculative" and len(report["tokens"]) == 24
    assert report["speculative"]["build"] == report["plain"]["build"] == "ort-fp32"
    assert (report["speedup"] is None) == (report["speculative"]["rounds_with_draft"] == 0)
    assert (tmp_path / "artifact" / "manifest.json").is_file()


def test_export_with_head_and_generate(head_target, head_dirs, tmp_path):
    artifact = tmp_path / "art"
    result = invoke(
        "export",
        head_target,
        "-o",
        artifact,
        "--max-context",
        96,
        "--drafter",
        f"eagle3:{head_dirs['eagle3']}",
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["drafter"]["kind"] == "eagle3" and manifest["model"]["taps"]["kind"] == "eagle3"
    assert {"draft_head", "draft_projection", "draft_chain", "target"} == set(manifest["graphs"])
    assert manifest["default_build"] == "ort-fp32"  # export ends with the CPU build
    assert set(manifest["builds"]["ort-fp32"]["lowering"]) == {"target", "draft_head"}
    result = invoke(
        "generate",
        artifact,
        "--prompt-ids",
        "1,2,3",
        "--drafter",
        "eagle3",
        "--tree",
        "dynamic:9,2,3",
        "--compare",
        "--json",
        "--max-new-tokens",
        20,
    )
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    assert stats["compare"]["identical_tokens"] is True and stats["build"] == "ort-fp32"
    exported = invoke(
        "generate", artifact, "--prompt-ids", "1,2,3", "--max-new-tokens", 20, "--json",
        "--build", "exported",
    )  # fmt: skip
    assert exported.exit_code == 0, exported.output
    assert json.loads(exported.stdout)["stats"]["build"] == "exported"
    assert json.loads(exported.stdout)["tokens"] == json.loads(result.stdout)["tokens"]
    unknown = invoke("generate", artifact, "--prompt-ids", "1", "--build", "ort-int4")
    assert unknown.exit_code == 2 and "has no build 'ort-int4'" in unknown.output
    wrong = invoke("generate", artifact, "--prompt-ids", "1", "--drafter", "medusa")
    assert wrong.exit_code == 2 and "exported with drafter 'eagle3', not 'medusa'" in wrong.output
    taps = invoke(
        "export",
        head_target,
        "-o",
        tmp_path / "x",
        "--taps",
        "last",
        "--drafter",
        f"eagle3:{head_dirs['eagle3']}",
    )
    assert taps.exit_code == 2 and "reads --taps eagle3, not last" in taps.output


def test_compare_at_a_temperature_gives_no_token_verdict(artifacts):
    args = ["generate", artifacts["llama"], "--prompt-ids", "5,6,7,8,5,6,7,8", "--drafter"]
    result = invoke(*args, "ngram", "--compare", "--temperature", 0.8, "--max-new-tokens", 8)
    assert result.exit_code == 0, result.output
    assert "sampled: lossless in distribution, not token by token" in result.stderr
    assert "identical tokens" not in result.stderr
    result = invoke(*args, "ngram", "--compare", "--json", "--temperature", 0.8)
    assert json.loads(result.stdout)["stats"]["compare"]["identical_tokens"] is None


def test_export_without_build_runs_the_exported_graphs(checkpoints, tmp_path):
    artifact = tmp_path / "art"
    result = invoke(
        "export", checkpoints["llama"], "-o", artifact, "--max-context", 64, "--no-build"
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert "default_build" not in manifest and not manifest.get("builds")
    result = invoke("generate", artifact, "--prompt-ids", "1,2", "--max-new-tokens", 3, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["build"] == "exported"
