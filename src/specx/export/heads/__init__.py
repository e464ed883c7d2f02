"""Draft heads in their public checkpoint formats, one class each, behind one registry.

Autoregressive heads (EAGLE-3, EAGLE-1/2, MTP) share the graph contract
`(input_ids, features, position_ids, attention_mask, write_pos, key, value) ->
(logits, hidden, key, value)` and draft with their own KV cache and tree mask; Medusa maps
features to the logits of every head at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

from specx.drafter_name import DrafterName
from specx.errors import ExportError
from specx.export.checkpoint import Checkpoint
from specx.export.heads.eagle import load_eagle
from specx.export.heads.eagle3 import load_eagle3
from specx.export.heads.medusa import load_medusa
from specx.export.heads.mtp import load_mtp

__all__ = ["HEAD_TAPS", "head_source", "load_head"]

# Which target taps each head reads.
HEAD_TAPS = {"eagle3": "eagle3", "eagle": "last", "medusa": "last", "mtp": "last"}

_LOADERS: dict[str, Callable] = {
    "eagle3": lambda path, ckpt: load_eagle3(path, ckpt.config, ckpt.state_dict),
    "eagle": lambda path, ckpt: load_eagle(path, ckpt.config, ckpt.state_dict),
    "medusa": lambda path, ckpt: load_medusa(path, ckpt.config, ckpt.state_dict),
    "mtp": lambda path, ckpt: load_mtp(path, ckpt.config, ckpt.state_dict, ckpt.directory),
}


# Heads whose weights live in the target checkpoint itself (no KIND:DIR needed).
_IN_TARGET = {"mtp"}


def head_source(spec: str) -> tuple[str, Path | None]:
    """The kind of the head `KIND[:DIR]` names and its checkpoint directory, checked.

    Raises:
        ExportError: a kind export does not support, or a missing directory.
    """
    kind, directory = astuple(DrafterName.parse(spec))
    if kind not in _LOADERS:
        raise ExportError(f"unknown drafter {kind!r}; export supports {', '.join(_LOADERS)}")
    if not directory and kind not in _IN_TARGET:
        raise ExportError(f"--drafter {kind} needs a checkpoint directory: {kind}:DIR")
    return kind, Path(directory) if directory else None


def load_head(spec: str, target: Checkpoint):
    """Loads the head named by `KIND:DIR` (`mtp` alone reads the target checkpoint).

    Raises:
        ExportError: unknown kind or a missing directory.
        CheckpointError: the head checkpoint is malformed or does not fit the target.
    """
    kind, directory = head_source(spec)
    return _LOADERS[kind](directory, target)
