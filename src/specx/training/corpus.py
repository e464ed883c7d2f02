"""Training text -> fixed-length token windows, with a deterministic held-out split."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from specx.errors import SpecxError

__all__ = ["held_out", "read_texts", "stdlib_files", "token_windows"]

_TEXT_SUFFIXES = (".py", ".txt", ".md")


def held_out(relative_path: str, percent: int = 3) -> bool:
    """The reference recipe's split: `md5(relative path) % 100 < percent` is held out."""
    return int(hashlib.md5(relative_path.encode()).hexdigest(), 16) % 100 < percent


def stdlib_files(percent: int = 3) -> tuple[list[Path], list[Path]]:
    """The running Python's stdlib .py files, split into (train, held out).

    Excluded: test/, tests/, site-packages, __pycache__; the split is `held_out` on the path
    relative to the stdlib root (the reference target's rule).
    """
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    held = [p for p in files if held_out(p.relative_to(root).as_posix(), percent)]
    return [p for p in files if p not in set(held)], held


def read_texts(sources: Sequence[str | Path]) -> list[str]:
    """Texts from files, directories (recursively: .py, .txt, .md) and JSONL prompt sets.

    Raises:
        SpecxError: a source does not exist or yields no text.
    """
    texts: list[str] = []
    for source in map(Path, sources):
        if source.is_dir():
            files: Iterable[Path] = sorted(
                p for p in source.rglob("*") if p.suffix in _TEXT_SUFFIXES
            )
        elif source.is_file():
            files = [source]
        else:
            raise SpecxError(f"corpus source {source} does not exist")
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            if path.suffix == ".jsonl":
                for line in text.splitlines():
                    if line.strip():
                        record = json.loads(line)
                        texts += record.get("turns", []) + record.get("reference", [])
            else:
                texts.append(text)
    if not any(t.strip() for t in texts):
        raise SpecxError(f"no text found in {', '.join(map(str, sources))}")
    return texts


def token_windows(token_lists: Sequence[Sequence[int]], length: int) -> np.ndarray:
    """Non-overlapping windows [n, length] cut from the concatenated documents."""
    stream = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists if len(t)])
    count = len(stream) // length
    if count == 0:
        raise SpecxError(f"the corpus has {len(stream)} tokens, fewer than one window of {length}")
    return stream[: count * length].reshape(count, length)
