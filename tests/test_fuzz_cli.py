"""Hundreds of randomly malformed inputs (fixed seed): each ends in one `error:` line, exit 1/2.

Every case is malformed by construction (a value outside its option's range, a prompts line
of the wrong type, a manifest field of the wrong type, a truncated file, a dangerous output
path), so none may succeed; none may print a traceback or change a file outside the
scratch directory.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from specx.cli import main
from specx.errors import GenerationError
from specx.runtime.prompts import read_prompts_file

SEED = 20261130
CLI_CASES = 320
READER_CASES = 400

BAD_INT = ["nan", "inf", "abc", "", "1.5", "-1", "1e3", "0x10", "--1"]
BAD_POSITIVE = [*BAD_INT, "0", "-7"]
BAD_FLOAT = ["nan", "inf", "-inf", "-1", "-0.5", "abc", "", "1e999"]
BAD_TOP_P = ["nan", "0", "1.5", "-1", "inf", "x"]
CHECKED_MODEL_KEYS = [
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "kv_capacity",
    "max_tree_tokens",
    "eos_token_ids",
    "taps",
]
BAD_IDS = ["", ",", "1,", "a", "1.5", "-1", "1,,2", "\uff11", "1e3", "0x1", "1;2"]


def random_json(rng: random.Random, depth: int = 0):
    kinds = ["int", "neg", "float", "nan", "str", "bool", "null"]
    if depth < 2:
        kinds += ["list", "dict"]
    kind = rng.choice(kinds)
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        keys = ["prompt", "prompt_ids", "turns", "x", "question_id"]
        return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return {
        "int": lambda: rng.randint(0, 10**6),
        "neg": lambda: -rng.randint(1, 100),
        "float": lambda: rng.uniform(-5, 5),
        "nan": lambda: rng.choice([float("nan"), float("inf"), -float("inf")]),
        "str": lambda: rng.choice(["", "abc", "1,2,3", "\u00e9\u00e8"]),
        "bool": lambda: rng.choice([True, False]),
        "null": lambda: None,
    }[kind]()


def bad_record(rng: random.Random) -> str:
    """One JSONL line that the prompts reader must refuse."""
    not_str = [v for v in (random_json(rng), 3, [], {}, None, True) if not isinstance(v, str)]
    bad_item = rng.choice([1.5, -1, "a", True, None, [1], float("nan"), {}])
    ids = [rng.randint(0, 50) for _ in range(rng.randint(0, 3))]
    ids.insert(rng.randint(0, len(ids)), bad_item)
    choice = rng.randrange(9)
    record = [
        lambda: rng.choice([[], [1, 2], 3, "text", None, 2.5]),
        lambda: {"x": random_json(rng)},
        lambda: {
            "prompt": "a",
            "prompt_ids": [1],
            **({"turns": ["b"]} if rng.random() < 0.5 else {}),
        },
        lambda: {"prompt": rng.choice([*not_str, ""])},
        lambda: {"prompt_ids": rng.choice([ids, [], "1,2", 7, None, {"a": 1}])},
        lambda: {"turns": rng.choice([[], "abc", [3], [None, "x"], {}])},
        lambda: None,  # truncated JSON
        lambda: None,  # not UTF-8
        lambda: None,  # blank lines only (a file with no prompts)
    ][choice]()
    if choice == 6:
        valid = json.dumps({"prompt_ids": [1, 2, 3]})
        return valid[: rng.randint(1, len(valid) - 1)]
    if choice == 7:
        return "\udcff"  # becomes the byte 0xff below
    if choice == 8:
        return ""
    return json.dumps(record)


def write_prompts(rng: random.Random, path: Path) -> Path:
    bad = bad_record(rng)
    lines = [json.dumps({"prompt_ids": [1, 2]}) for _ in range(rng.randint(0, 3))]
    if bad:
        lines.insert(rng.randint(0, len(lines)), bad)
    else:
        lines = ["", " "]  # no prompts at all
    data = ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")
    path.write_bytes(data)
    return path


class Cases:
    """Random malformed invocations of every command."""

    def __init__(self, rng: random.Random, paths: dict[str, Path], scratch: Path):
        self.rng, self.paths, self.scratch = rng, paths, scratch
        self.count = 0

    def file(self, suffix: str) -> Path:
        self.count += 1
        return self.scratch / f"case{self.count}{suffix}"

    def pick(self, options: dict[str, list[str]]) -> list[str]:
        flag = self.rng.choice(list(options))
        return [flag, self.rng.choice(options[flag])]

    def generate(self) -> list[str]:
        rng, art = self.rng, str(self.paths["artifact"])
        extra = rng.sample(["--json", "--ignore-eos"], rng.randint(0, 2))
        kind = rng.randrange(4)
        if kind == 0:
            bad = self.pick(
                {
                    "--max-new-tokens": BAD_POSITIVE,
                    "--temperature": BAD_FLOAT,
                    "--top-k": BAD_INT,
                    "--top-p": BAD_TOP_P,
                    "--seed": BAD_INT,
                    "--threads": BAD_POSITIVE,
                }
            )
            return ["generate", art, "--prompt-ids", "1,2", *bad, *extra]
        if kind == 1:
            bad = self.pick(
                {
                    "--num-draft-tokens": BAD_POSITIVE,
                    "--ngram-min": BAD_POSITIVE,
                    "--ngram-matches": BAD_POSITIVE,
                    "--max-batch-spec": BAD_INT,
                    "--tree": ["chain:0", "dynamic:1", "[[1,", "static:/missing.json", "x"],
                }
            )
            # Without a drafter, speculative options are refused whatever their value.
            drafter = rng.choice([[], ["--drafter", "ngram"], ["--drafter", "hydra"]])
            return ["generate", art, "--prompt-ids", "1", *drafter, *bad, *extra]
        if kind == 2:
            path = write_prompts(rng, self.file(".jsonl"))
            return ["generate", art, "--prompts-file", str(path), *extra]
        ids = rng.choice(BAD_IDS)
        return ["generate", art, "--prompt-ids", ids, *extra]

    def manifest(self) -> list[str]:
        rng = self.rng
        copy = shutil.copytree(self.paths["artifact"], self.file(".artifact"))
        path = copy / "manifest.json"
        text = path.read_text()
        data = json.loads(text)
        kind = rng.randrange(5)
        if kind == 0:
            path.write_text(text[: rng.randint(0, len(text) - 3)])
        elif kind == 1:
            key = rng.choice(CHECKED_MODEL_KEYS[:-2])
            data["model"][key] = rng.choice(["lots", -3, 0, None, [], {}, 1.5, True, float("nan")])
            path.write_text(json.dumps(data))
        elif kind == 2:
            del data["model"][rng.choice(CHECKED_MODEL_KEYS)]
            path.write_text(json.dumps(data))
        elif kind == 3:
            field = rng.choice(["default_build", "tokenizer", "graphs", "files"])
            data[field] = {
                "default_build": rng.choice([3, [], True, "missing-build"]),
                "tokenizer": rng.choice([3, [], "../x", "/etc/passwd", "missing.json"]),
                "graphs": rng.choice([[], {"target": {"file": 3}}, {"target": []}]),
                "files": rng.choice([{"../x": "0" * 64}, {"target.onnx": "xyz"}, []]),
            }[field]
            path.write_text(json.dumps(data))
        else:
            data["model"]["eos_token_ids"] = rng.choice([[-1], ["x"], 3, [1.5], None])
            path.write_text(json.dumps(data))
        return ["generate", str(copy), "--prompt-ids", "1"]

    def export(self) -> list[str]:
        rng, ckpt = self.rng, str(self.paths["checkpoint"])
        kind = rng.randrange(3)
        out = str(self.file(".out"))
        if kind == 0:
            bad = self.pick(
                {
                    "--max-context": ["0", "1", "-5", "abc", "nan"],
                    "--max-tree-tokens": BAD_POSITIVE,
                    "--taps": ["bogus", ""],
                    "--drafter": ["hydra:x", "eagle3", "medusa:", "eagle"],
                }
            )
            return ["export", ckpt, "-o", out, *bad]
        if kind == 1:
            return ["export", ckpt, "-o", out, "--max-context", "8", "--max-tree-tokens", "9"]
        dangerous = rng.choice(
            [
                ckpt,
                str(self.paths["checkpoint"].parent),
                ".",
                str(self.paths["artifact"]),
                str(self.paths["user_file"]),
                str(self.paths["user_dir"]),
                f"{self.scratch}/new/../../fixture/checkpoint",
            ]
        )
        if dangerous == str(self.paths["artifact"]):
            return ["export", ckpt, "-o", dangerous]  # exists: needs --overwrite
        return ["export", ckpt, "-o", dangerous, "--overwrite"]

    def other(self) -> list[str]:
        rng, art, ckpt = self.rng, str(self.paths["artifact"]), str(self.paths["checkpoint"])
        kind = rng.randrange(7)
        if kind == 0:
            bad = self.pick(
                {
                    "--steps": BAD_POSITIVE,
                    "--batch": BAD_POSITIVE,
                    "--seq-len": [*BAD_POSITIVE, "1"],
                    "--lr": [*BAD_FLOAT, "0"],
                    "--seed": BAD_INT,
                    "--draft-vocab": [*BAD_POSITIVE, "100000"],
                    "--on-policy": BAD_INT,
                }
            )
            kind_ = "eagle3" if bad[0] == "--draft-vocab" else rng.choice(["eagle", "mtp"])
            out = str(self.file(".head"))
            return ["train", kind_, ckpt, "--corpus", ckpt, "-o", out, *bad]
        if kind == 1:
            out = rng.choice([ckpt, str(self.paths["user_dir"])])
            return ["train", "eagle", ckpt, "--corpus", ckpt, "-o", out]
        if kind == 2:
            if rng.random() < 0.5:
                prompts = write_prompts(rng, self.file(".jsonl"))
                return ["calibrate", art, "--drafter", "ngram", "--prompts", str(prompts)]
            bad = self.pick(
                {
                    "--repeats": BAD_POSITIVE,
                    "--max-prompts": BAD_POSITIVE,
                    "--max-new-tokens": BAD_POSITIVE,
                    "--probe-top-k": BAD_POSITIVE,
                    "--probe-depth": BAD_POSITIVE,
                    "--threads": BAD_POSITIVE,
                }
            )
            return ["calibrate", art, "--drafter", "ngram", *bad]
        if kind == 3:
            prompts = write_prompts(rng, self.file(".jsonl"))
            good = self.file(".jsonl")
            good.write_text('{"prompt_ids": [1, 2]}\n')
            return rng.choice(
                [
                    ["quantize", art, "--prompts", str(prompts)],
                    [
                        "quantize",
                        art,
                        "--prompts",
                        str(good),
                        "--max-prompts",
                        rng.choice(BAD_POSITIVE),
                    ],
                    ["quantize", art, "--prompts", str(good), "--mode", "int3"],
                ]
            )
        if kind == 4:
            target = rng.choice(
                [self.paths["user_file"], self.paths["user_dir"], self.paths["user_file"] / "x.tar"]
            )
            return ["pack", art, "-o", str(target), *rng.choice([[], ["--overwrite"]])]
        if kind == 5:
            bad = self.pick(
                {
                    "--optimization-level": ["-1", "6", "x"],
                    "--max-batch": BAD_POSITIVE,
                    "--precision": ["fp8", "int4x"],
                    "--backend": ["cuda", ""],
                }
            )
            return ["build", art, *bad]
        junk = self.file(rng.choice([".tar", ".bin"]))
        junk.write_bytes(rng.randbytes(rng.randint(0, 2000)))
        return ["verify", str(junk)]

    def next(self) -> list[str]:
        return self.rng.choice(
            [self.generate, self.generate, self.manifest, self.export, self.other, self.other]
        )()


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() if p.is_file() else b"<dir>" for p in [root, *root.rglob("*")]}


def test_fuzzed_cli_inputs_fail_with_one_line(artifacts, checkpoints, tmp_path, monkeypatch):
    fixture = tmp_path / "fixture"
    paths = {
        "artifact": shutil.copytree(artifacts["llama"], fixture / "artifact"),
        "checkpoint": shutil.copytree(checkpoints["llama"], fixture / "checkpoint"),
        "user_dir": fixture / "user",
        "user_file": fixture / "notes.txt",
    }
    paths["user_dir"].mkdir()
    (paths["user_dir"] / "data.txt").write_text("mine")
    paths["user_file"].write_text("mine")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.chdir(scratch)
    before = snapshot(fixture)
    cases = Cases(random.Random(SEED), paths, scratch)
    for _ in range(CLI_CASES):
        args = cases.next()
        result = CliRunner().invoke(main, args)
        shown = f"{args}\n{result.output}"
        assert result.exit_code in (1, 2), shown
        assert result.exception is None or isinstance(result.exception, SystemExit), shown
        assert "Traceback" not in result.output and "Usage:" not in result.output, shown
        lines = result.stderr.strip().splitlines()
        assert lines and lines[-1].startswith("error: "), shown
    assert snapshot(fixture) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fixture", "scratch"]


def test_fuzzed_prompts_files_raise_generation_errors(tmp_path):
    rng = random.Random(SEED + 1)
    for i in range(READER_CASES):
        path = write_prompts(rng, tmp_path / f"p{i}.jsonl")
        with pytest.raises(GenerationError, match=rf"p{i}\.jsonl"):
            read_prompts_file(path)
