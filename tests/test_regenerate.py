"""`specx regenerate`: target-generated windows, deterministic for a seed, resumable, checked;
and `specx train --data` on them."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specx.cli import main
from specx.errors import SpecxError
from specx.training.loop import TrainConfig, train_drafter
from specx.training.regenerate import (
    RegenerateConfig,
    function_prompts,
    read_windows,
    regenerate,
)

CORPUS = [str(Path(sysconfig.get_paths()["stdlib"]) / "json")]
SMALL = RegenerateConfig(windows=10, seq_len=24, prompt_tokens=8, batch=3, shard_windows=4)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from specx.export.random_checkpoint import CheckpointPreset, write_random_checkpoint

    return write_random_checkpoint(
        tmp_path_factory.mktemp("target") / "t", "llama", CheckpointPreset(32, 64, 2, 2, 1, 256)
    )


@pytest.fixture(scope="module")
def straight(target_dir, tmp_path_factory):
    return regenerate(target_dir, CORPUS, tmp_path_factory.mktemp("regen") / "a", SMALL)


def _shards(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("shard-*.npy"))}


def test_windows_are_the_targets_continuations_of_corpus_prompts(target_dir, straight):
    from specx.artifact import load_manifest
    from specx.export.target_export import export_target
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.targets.ort import OrtTarget

    windows = read_windows(straight)
    assert windows.shape == (10, 24) and len(_shards(straight)) == 3
    # The first batch is greedy: its continuations are plain greedy decoding's.
    artifact = export_target(target_dir, straight.parent / "art", max_context=24)
    target = OrtTarget(load_manifest(artifact))
    prompts = windows[:3, :8].tolist()
    assert generate_plain(target, prompts, 16).tokens == windows[:3, 8:].tolist()
    record = json.loads((straight / "regenerate.json").read_text())
    assert record["settings"]["temperatures"] == [0.0, 0.7, 0.0, 1.0]


def test_the_same_seed_gives_the_same_bytes_another_seed_others(target_dir, straight, tmp_path):
    again = regenerate(target_dir, CORPUS, tmp_path / "b", SMALL)
    assert _shards(again) == _shards(straight)
    other = RegenerateConfig(**{**SMALL.__dict__, "seed": 1})
    assert _shards(regenerate(target_dir, CORPUS, tmp_path / "c", other)) != _shards(straight)


STUBS = '''import os


def documented(path):
    """Return the path, made absolute."""
    return os.path.abspath(path)


def undocumented(x):
    return x + 1


class Box:
    async def fetch(self, key, default=None):
        """Look the key up,
        or give the default.
        """
        return self.items.get(key, default)
'''


def test_function_prompts_end_where_docstrings_end(target_dir, tmp_path):
    from specx.runtime.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(target_dir / "tokenizer.json")
    pool = function_prompts([STUBS, "def broken(:\n"], tokenizer, 6)
    assert pool.shape == (2, 6)  # the two functions with a docstring; the unparsable text skipped
    for row, closing in zip(pool, ('absolute."""\n', 'default.\n        """\n'), strict=True):
        end = STUBS.index(closing) + len(closing)
        text = tokenizer.decode(row.tolist())
        assert text.strip() and STUBS[:end].endswith(text)
    (tmp_path / "stubs.py").write_text(STUBS)
    config = RegenerateConfig(**{**SMALL.__dict__, "prompts": "functions", "prompt_tokens": 6})
    windows = read_windows(regenerate(target_dir, [tmp_path / "stubs.py"], tmp_path / "f", config))
    assert {tuple(w[:6]) for w in windows} <= {tuple(row) for row in pool}
    (tmp_path / "bare.py").write_text("def f(x):\n    return x\n" * 20)
    with pytest.raises(SpecxError, match="no Python function with a docstring"):
        regenerate(target_dir, [tmp_path / "bare.py"], tmp_path / "g", config)
    assert not list((tmp_path / "g").iterdir())  # refused before anything was exported


def test_an_interrupted_run_resumes_to_the_same_bytes(target_dir, straight, tmp_path):
    def stop_after_first_shard(message):
        if message.startswith("shard 1/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        regenerate(target_dir, CORPUS, tmp_path / "r", SMALL, stop_after_first_shard)
    assert len(_shards(tmp_path / "r")) == 1
    messages: list[str] = []
    regenerate(target_dir, CORPUS, tmp_path / "r", SMALL, messages.append)
    assert "(1 done;" in messages[0]
    assert _shards(tmp_path / "r") == _shards(straight)
    messages.clear()  # complete: nothing is exported or generated again
    regenerate(target_dir, CORPUS, tmp_path / "r", SMALL, messages.append)
    assert messages == [f"{tmp_path / 'r'}: all 3 shards of 10 windows are written"]


def test_bad_output_and_settings_are_refused_before_work(target_dir, straight, tmp_path):
    other = RegenerateConfig(**{**SMALL.__dict__, "seq_len": 32})
    with pytest.raises(SpecxError, match="regenerated with other settings"):
        regenerate(target_dir, CORPUS, straight, other)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(SpecxError, match="not empty and holds no regenerate.json"):
        regenerate(target_dir, CORPUS, tmp_path / "foreign", SMALL)
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"
    with pytest.raises(SpecxError, match="--prompt-tokens 24 must be in"):
        RegenerateConfig(windows=1, seq_len=24, prompt_tokens=24)
    with pytest.raises(SpecxError, match="exceeds the target's"):
        regenerate(target_dir, CORPUS, tmp_path / "long", RegenerateConfig(1, seq_len=8192))


def test_an_altered_shard_is_refused(straight, tmp_path):
    import shutil

    copy = Path(shutil.copytree(straight, tmp_path / "copy"))
    shard = copy / "shard-00001.npy"
    windows = np.load(shard)
    windows[0, 0] ^= 1
    np.save(shard, windows)
    with pytest.raises(SpecxError, match="differs from the hash"):
        read_windows(copy)


def test_train_on_regenerated_data_with_a_regenerated_held_out_set(target_dir, straight, tmp_path):
    held = regenerate(
        target_dir, CORPUS, tmp_path / "held", RegenerateConfig(**{**SMALL.__dict__, "seed": 9})
    )
    cfg = TrainConfig("eagle", steps=6, batch=2, seq_len=24, eval_every=3)
    report = train_drafter(
        target_dir, [], tmp_path / "head", cfg, data=[straight], held_out=held
    ).report
    assert report["train_windows"] == report["regenerated_windows"] == 10
    assert report["held_out_windows"] == 10
    assert [c["step"] for c in report["learning_curve"]] == [0, 3, 6]
    with pytest.raises(SpecxError, match="not a directory written by `specx regenerate`"):
        train_drafter(target_dir, [], tmp_path / "h2", cfg, data=[tmp_path], held_out=held)
    with pytest.raises(SpecxError, match="needs --held-out"):
        train_drafter(target_dir, [], tmp_path / "h3", cfg, data=[straight])


def test_cli_regenerate_and_train_on_it(target_dir, tmp_path):
    out = tmp_path / "cli"
    args = ["regenerate", str(target_dir), "--corpus", CORPUS[0], "-o", str(out)]
    result = CliRunner().invoke(
        main, [*args, "--windows", "4", "--seq-len", "16", "--prompt-tokens", "4"]
    )
    assert result.exit_code == 0, result.output
    assert read_windows(out).shape == (4, 16)
    bad = CliRunner().invoke(main, [*args, "--windows", "4", "--temperatures", "0,hot"])
    assert bad.exit_code != 0 and "--temperatures must be comma-separated numbers" in bad.output
    bad = CliRunner().invoke(main, [*args, "--windows", "4", "--prompts", "lines"])
    assert bad.exit_code != 0 and "'lines' is not one of 'windows', 'functions'" in bad.output
    result = CliRunner().invoke(
        main, ["train", "eagle", str(target_dir), "-o", str(tmp_path / "x")]
    )
    assert result.exit_code != 0 and "give --corpus text or --data windows" in result.output
