"""Target-generated training data: corpus prompts continued by the target itself.

A head meets the target's own continuations at inference, so it should train on them
(EAGLE-3, HASS and SpecForge regenerate their data with the target; DistillSpec calls it
on-policy data). `regenerate` cuts prompts of `prompt_tokens` from the tokenized corpus and
lets the target continue each to `seq_len` tokens, batched on specx's own runtime (an export
of the target), under a mix of temperatures. Prompts (`prompts`) are either `windows`, from
random places, or `functions`: the tokens that end where a Python function's docstring ends,
so the target writes the body from its signature and docstring, as code assistants are asked
(HumanEval's prompts are such stubs).

On disk: `DIR/regenerate.json` (the settings and one sha256 per shard) and
`DIR/shard-NNNNN.npy` ([windows, seq_len] token ids). Shard i depends only on (seed, i)
and the settings, so a run stopped anywhere resumes at the first missing shard and ends
with the same bytes as an uninterrupted one; shards are written atomically. The total size
is fixed by the settings and checked against the free disk before anything is generated.
"""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specx.artifact import atomic_write_text, check_parents
from specx.errors import SpecxError

__all__ = [
    "MANIFEST",
    "RegenerateConfig",
    "continue_windows",
    "function_prompts",
    "is_regenerated",
    "read_windows",
    "regenerate",
]

MANIFEST = "regenerate.json"
FORMAT = "specx-regenerated/1"
PROMPT_KINDS = ("windows", "functions")


@dataclass(frozen=True)
class RegenerateConfig:
    """How many windows, how long, and the temperature mix (cycled batch by batch)."""

    windows: int
    seq_len: int = 256
    prompt_tokens: int = 32
    temperatures: tuple[float, ...] = (0.0, 0.7, 0.0, 1.0)  # half greedy, T 0.7 / 1.0
    batch: int = 32
    shard_windows: int = 512
    seed: int = 0
    prompts: str = "windows"  # a PROMPT_KINDS entry

    def __post_init__(self) -> None:
        if self.prompts not in PROMPT_KINDS:
            raise SpecxError(f"--prompts {self.prompts!r} must be one of {', '.join(PROMPT_KINDS)}")
        if not 1 <= self.prompt_tokens < self.seq_len:
            raise SpecxError(
                f"--prompt-tokens {self.prompt_tokens} must be in [1, --seq-len {self.seq_len})"
            )
        if not self.temperatures or any(not 0 <= t < 100 for t in self.temperatures):
            raise SpecxError(f"--temperatures {list(self.temperatures)} must be in [0, 100)")
        if min(self.windows, self.batch, self.shard_windows) < 1:
            raise SpecxError("--windows, --batch and --shard-windows must be positive")

    @property
    def shards(self) -> int:
        """How many shard files the windows fill."""
        return -(-self.windows // self.shard_windows)

    def shard_size(self, index: int) -> int:
        """Windows in shard `index` (the last one may be short)."""
        return min(self.shard_windows, self.windows - index * self.shard_windows)


def continue_windows(
    target, prompts: np.ndarray, new_tokens: int, temperature: float, seed: int
) -> np.ndarray:
    """Prompts [n, p] continued by the target to [n, p + new_tokens] (no eos stop)."""
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.sampling import SamplingParams

    sampling = SamplingParams(temperature, seed=seed)
    tokens = generate_plain(target, prompts.tolist(), new_tokens, sampling).tokens
    return np.concatenate([prompts, np.asarray(tokens, dtype=prompts.dtype)], axis=1)


def function_prompts(texts: Sequence[str], tokenizer, prompt_tokens: int) -> np.ndarray:
    """Prompts [n, prompt_tokens] that end where a function's docstring ends.

    One per function with a docstring in the Python `texts` (texts that do not parse are
    skipped): the tokens up to the end of the docstring's last line.
    """
    rows = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        line_starts = np.cumsum([0, *map(len, lines)])
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if ast.get_docstring(node) is None or node.body[0].end_lineno is None:
                continue
            end = int(line_starts[min(node.body[0].end_lineno, len(lines))])
            # Enough text for the prompt: a token spans well under 16 characters.
            start = max(0, end - 16 * prompt_tokens)
            ids = tokenizer.encode(text[start:end], add_special_tokens=False)
            if len(ids) >= prompt_tokens:
                rows.append(ids[-prompt_tokens:])
    return np.asarray(rows, dtype=np.int64).reshape(-1, prompt_tokens)


Draw = Callable[[np.random.Generator, int], np.ndarray]  # (rng, n) -> [n, prompt_tokens]


def _prompt_source(texts: Sequence[str], tokenizer, cfg: RegenerateConfig) -> tuple[str, Draw]:
    """What the prompts are drawn from (said in the progress line), and how."""
    p = cfg.prompt_tokens
    if cfg.prompts == "functions":
        pool = function_prompts(texts, tokenizer, p)
        if not len(pool):
            raise SpecxError(
                f"--prompts functions: the corpus has no Python function with a docstring "
                f"and {p} tokens before its end"
            )

        def draw_function(rng: np.random.Generator, n: int) -> np.ndarray:
            return pool[rng.integers(0, len(pool), n)]

        return f"{len(pool)} function prompts", draw_function
    stream = np.concatenate([np.asarray(tokenizer.encode(t), np.int64) for t in texts])
    if len(stream) <= p:
        raise SpecxError(f"the corpus has {len(stream)} tokens; a prompt needs {p}")

    def draw_window(rng: np.random.Generator, n: int) -> np.ndarray:
        return stream[rng.integers(0, len(stream) - p, n)[:, None] + np.arange(p)]

    return f"{len(stream)} corpus tokens", draw_window


def _shard(target, draw: Draw, cfg: RegenerateConfig, index: int) -> np.ndarray:
    rng = np.random.default_rng([cfg.seed, index])
    prompts = draw(rng, cfg.shard_size(index))
    out = []
    for j, first in enumerate(range(0, len(prompts), cfg.batch)):
        global_batch = index * -(-cfg.shard_windows // cfg.batch) + j
        temperature = cfg.temperatures[global_batch % len(cfg.temperatures)]
        chunk = prompts[first : first + cfg.batch]
        seed = int(rng.integers(2**31))
        out.append(
            continue_windows(target, chunk, cfg.seq_len - cfg.prompt_tokens, temperature, seed)
        )
    return np.concatenate(out)


def _dtype(vocab: int) -> type[np.integer]:
    return np.uint16 if vocab <= 2**16 else np.int32


def _check_output(output_dir: Path, settings: dict) -> dict[str, str]:
    """The shards already written with these settings; refuses anything else."""
    check_parents(output_dir)
    if not output_dir.exists():
        return {}
    if not output_dir.is_dir():
        raise SpecxError(f"-o {output_dir} is a file, not a directory")
    manifest = output_dir / MANIFEST
    if not manifest.is_file():
        if any(output_dir.iterdir()):
            raise SpecxError(
                f"-o {output_dir} is not empty and holds no {MANIFEST}: give a new or empty "
                "directory (or an earlier regeneration's, to resume it)"
            )
        return {}
    earlier = json.loads(manifest.read_text())
    if earlier.get("settings") != settings:
        raise SpecxError(
            f"-o {output_dir} was regenerated with other settings ({earlier.get('settings')}); "
            "give a new directory, or the same settings to resume"
        )
    return dict(earlier.get("shards", {}))


def regenerate(
    target_dir: str | Path,
    corpus: Sequence[str | Path],
    output_dir: str | Path,
    cfg: RegenerateConfig,
    progress: Callable[[str], None] = lambda message: None,
) -> Path:
    """Writes (or completes) `cfg.windows` target-continued windows into `output_dir`.

    Raises:
        SpecxError: an output directory holding other data or other settings, a corpus
            shorter than one prompt, a target without tokenizer.json, too little free disk.
    """
    from specx.artifact import load_manifest
    from specx.export.config import load_target_config
    from specx.export.target_export import export_target
    from specx.runtime.targets.ort import OrtTarget
    from specx.runtime.tokenizer import TextTokenizer
    from specx.training.corpus import read_texts

    target_dir, output_dir = Path(target_dir), Path(output_dir)
    tokenizer_path = target_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise SpecxError(f"{target_dir} has no tokenizer.json to tokenize the corpus with")
    config, _ = load_target_config(target_dir)
    if cfg.seq_len > config.max_position_embeddings:
        raise SpecxError(
            f"--seq-len {cfg.seq_len} exceeds the target's {config.max_position_embeddings} "
            "positions"
        )
    dtype = _dtype(config.vocab_size)
    settings = {**asdict(cfg), "temperatures": list(cfg.temperatures), "dtype": dtype.__name__}
    if cfg.prompts == "windows":  # the kind before there was a choice: its earlier runs resume
        del settings["prompts"]
    settings["target_config_sha256"] = hashlib.sha256(
        (target_dir / "config.json").read_bytes()
    ).hexdigest()
    done = _check_output(output_dir, settings)
    need = sum(cfg.shard_size(i) for i in range(cfg.shards) if f"{i:05d}" not in done)
    need *= cfg.seq_len * np.dtype(dtype).itemsize
    output_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(output_dir).free
    if need > free // 2:
        raise SpecxError(
            f"regenerating needs {need / 1e6:.0f} MB in {output_dir}, more than half of the "
            f"{free / 1e6:.0f} MB free"
        )
    if len(done) == cfg.shards:
        progress(f"{output_dir}: all {cfg.shards} shards of {cfg.windows} windows are written")
        return output_dir
    tokenizer = TextTokenizer(tokenizer_path)
    source, draw = _prompt_source(read_texts(corpus), tokenizer, cfg)
    progress(
        f"regenerating {cfg.windows} windows of {cfg.seq_len} tokens in {cfg.shards} shards "
        f"({len(done)} done; {need / 1e6:.1f} MB to write) from {source}"
    )
    with tempfile.TemporaryDirectory(prefix="specx-regenerate-") as scratch:
        artifact = export_target(target_dir, Path(scratch) / "target", max_context=cfg.seq_len)
        target = OrtTarget(load_manifest(artifact))
        for index in range(cfg.shards):
            name = f"{index:05d}"
            if name in done:
                continue
            windows = _shard(target, draw, cfg, index).astype(dtype)
            done[name] = _write_shard(output_dir / f"shard-{name}.npy", windows)
            record = {"format": FORMAT, "settings": settings, "shards": done}
            atomic_write_text(output_dir / MANIFEST, json.dumps(record, indent=2) + "\n")
            progress(f"shard {index + 1}/{cfg.shards}: {len(windows)} windows")
    return output_dir


def _write_shard(path: Path, windows: np.ndarray) -> str:
    staging = path.with_name(path.name + ".partial")
    with staging.open("wb") as f:
        np.save(f, windows)
    staging.replace(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_regenerated(path: str | Path) -> bool:
    """Whether `path` is a directory written by `regenerate`."""
    return (Path(path) / MANIFEST).is_file()


def read_windows(directory: str | Path, seq_len: int | None = None) -> np.ndarray:
    """All windows of a regenerated directory [n, L] as int64, each hash checked.

    `seq_len` keeps the first tokens of each window (it may not exceed the stored length).

    Raises:
        SpecxError: no shard written yet, a shard missing or altered, seq_len too long.
    """
    directory = Path(directory)
    record = json.loads((directory / MANIFEST).read_text())
    stored = record["settings"]["seq_len"]
    if seq_len is not None and seq_len > stored:
        raise SpecxError(
            f"{directory} holds windows of {stored} tokens; --seq-len {seq_len} asks more"
        )
    if not record["shards"]:
        raise SpecxError(f"{directory} has no regenerated shard yet")
    parts = []
    for name, digest in sorted(record["shards"].items()):
        path = directory / f"shard-{name}.npy"
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise SpecxError(f"{path} is missing or differs from the hash in {MANIFEST}")
        parts.append(np.load(path)[:, :seq_len].astype(np.int64))
    return np.concatenate(parts)
