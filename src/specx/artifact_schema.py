"""The types of the manifest fields the runtime trusts, checked once when a manifest is parsed.

A manifest is JSON that a person can edit, so every field the runtime reads is checked
here by type and range, and a bad one is named (`model.kv_capacity must be a positive
integer, got 'lots'`) instead of failing later as a TypeError deep in decoding. File
names must be relative paths inside the artifact: the loader hashes what they name. The
typed sections (`specx.manifest_types`) are read from what passed, so every field they
read is checked here (calibration entries excepted: they are checked when used).

Standard library only: the runtime imports this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath
from typing import Any, get_args

from specx.errors import ArtifactError
from specx.manifest_types import GreedyIdentity

__all__ = ["check_manifest_types"]

Check = Callable[[Any], bool]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_TAP_KINDS = ("none", "last", "eagle3")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _relative_file(value: Any) -> bool:
    if not isinstance(value, str) or not value or "\\" in value:
        return False
    path = PurePosixPath(value)
    return not path.is_absolute() and ".." not in path.parts


def _list_of(check: Check) -> Check:
    return lambda value: isinstance(value, list) and all(check(v) for v in value)


def _is(*types: type) -> Check:
    return lambda value: isinstance(value, types) and not isinstance(value, bool)


_MODEL: dict[str, tuple[Check, str]] = {
    "vocab_size": (_positive_int, "a positive integer"),
    "hidden_size": (_positive_int, "a positive integer"),
    "num_layers": (_positive_int, "a positive integer"),
    "num_heads": (_positive_int, "a positive integer"),
    "num_kv_heads": (_positive_int, "a positive integer"),
    "head_dim": (_positive_int, "a positive integer"),
    "kv_capacity": (_positive_int, "a positive integer"),
    "max_tree_tokens": (_positive_int, "a positive integer"),
    "eos_token_ids": (_list_of(_natural), "a list of non-negative integers"),
    "taps": (lambda v: isinstance(v, dict), "an object"),
}
_TAPS: dict[str, tuple[Check, str]] = {
    "kind": (lambda v: v in _TAP_KINDS, f"one of {', '.join(_TAP_KINDS)}"),
    "width": (_natural, "a non-negative integer"),
    "layers": (_list_of(_natural), "a list of non-negative integers"),
}
_DECODER = {
    name: (_positive_int, "a positive integer")
    for name in ("num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")
}
_DRAFTER = {name: (_is(str), "a string") for name in ("kind", "graph", "taps")}
_DRAFTER_OPTIONAL = {
    "medusa_heads": (_positive_int, "a positive integer"),
    "projection": (_is(str), "a string"),
    "d2t": (_relative_file, "a relative path inside the artifact"),
}
_BUILD_OPTIONAL = {
    "directory": (_relative_file, "a relative path inside the artifact"),
    "quantization": (lambda v: isinstance(v, dict), "an object"),
    **{name: (_is(str), "a string") for name in ("tensorrt_version", "compute_capability", "gpu")},
}
_GREEDY_IDENTITY = get_args(GreedyIdentity)
_QUANTIZATION_OPTIONAL = {
    "greedy_identity": (lambda v: v in _GREEDY_IDENTITY, f"one of {', '.join(_GREEDY_IDENTITY)}"),
    "padding_row": (lambda v: isinstance(v, bool), "true or false"),
    "activation_group": (_positive_int, "a positive integer"),
}
_IO = {
    "name": (_is(str), "a string"),
    "dtype": (_is(str), "a string"),
    "shape": (_list_of(_is(int, str)), "a list of integers and names"),
}


def _fields(where: str, data: dict, schema: Mapping[str, tuple[Check, str]]) -> None:
    for key, (check, expected) in schema.items():
        if key not in data:
            raise ArtifactError(f"{where}: {key} is missing")
        if not check(data[key]):
            raise ArtifactError(f"{where}: {key} must be {expected}, got {data[key]!r:.60}")


def _optional_fields(where: str, data: dict, schema: Mapping[str, tuple[Check, str]]) -> None:
    """`_fields` for the fields of `schema` that `data` has (null counts as absent)."""
    present = [key for key in schema if data.get(key) is not None]
    _fields(where, data, {key: schema[key] for key in present})


def _object(where: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise ArtifactError(f"{where} must be an object, got {value!r:.60}")
    return value


def _graph(where: str, entry: Any) -> None:
    entry = _object(where, entry)
    if not _relative_file(entry.get("file")):
        raise ArtifactError(f"{where}.file must be a relative path inside the artifact")
    if "data_files" in entry and not _list_of(_relative_file)(entry["data_files"]):
        raise ArtifactError(f"{where}.data_files must be a list of relative paths")
    if "engine" in entry and not _relative_file(entry["engine"]):
        raise ArtifactError(f"{where}.engine must be a relative path inside the artifact")
    spare = entry.get("kv_spare_slots", 0)
    if not isinstance(spare, int) or isinstance(spare, bool) or not 0 <= spare <= 8:
        raise ArtifactError(f"{where}.kv_spare_slots must be an integer in 0..8, got {spare!r}")
    if not isinstance(entry.get("ort_only", False), bool):
        raise ArtifactError(f"{where}.ort_only must be true or false")
    if not isinstance(entry.get("runtime", ""), str):
        raise ArtifactError(f"{where}.runtime must be a runtime's name")
    if not _list_of(_is(str))(entry.get("profiles", [])):
        raise ArtifactError(f"{where}.profiles must be a list of strings")
    for side in ("inputs", "outputs"):
        values = entry.get(side)
        if not isinstance(values, list):
            raise ArtifactError(f"{where}.{side} must be a list")
        for i, value in enumerate(values):
            _fields(f"{where}.{side}[{i}]", _object(f"{where}.{side}[{i}]", value), _IO)
    if "decoder" in entry:
        _fields(f"{where}.decoder", _object(f"{where}.decoder", entry["decoder"]), _DECODER)


def check_manifest_types(where: str, data: dict[str, Any]) -> None:
    """Checks the types of every field the runtime reads.

    Raises:
        ArtifactError: naming `where` and the first field at fault.
    """
    for name, digest in data["files"].items():
        if not _relative_file(name):
            raise ArtifactError(f"{where}: files lists {name!r}, not a path inside the artifact")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ArtifactError(f"{where}: files[{name!r}] is not a sha256 hex digest")
    _fields(f"{where}: model", data["model"], _MODEL)
    vocab = data["model"]["vocab_size"]
    outside = [t for t in data["model"]["eos_token_ids"] if t >= vocab]
    if outside:
        raise ArtifactError(
            f"{where}: model.eos_token_ids {outside} lie outside the vocabulary of {vocab} tokens"
        )
    _fields(f"{where}: model.taps", data["model"]["taps"], _TAPS)
    for name, entry in data["graphs"].items():
        _graph(f"{where}: graphs.{name}", entry)
    for name, build in _object(f"{where}: builds", data.get("builds", {})).items():
        build = _object(f"{where}: builds.{name}", build)
        for key in ("backend", "precision"):
            if not isinstance(build.get(key), str):
                raise ArtifactError(f"{where}: builds.{name}.{key} must be a string")
        for graph, entry in _object(f"{where}: builds.{name}.graphs", build.get("graphs")).items():
            _graph(f"{where}: builds.{name}.graphs.{graph}", entry)
        _optional_fields(f"{where}: builds.{name}", build, _BUILD_OPTIONAL)
        _optional_fields(
            f"{where}: builds.{name}.quantization",
            build.get("quantization") or {},
            _QUANTIZATION_OPTIONAL,
        )
    for key in ("default_build", "tokenizer", "chat_template"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ArtifactError(f"{where}: {key} must be a string or null")
    for key in ("tokenizer", "chat_template"):
        if data.get(key) is not None and not _relative_file(data[key]):
            raise ArtifactError(f"{where}: {key} must be a relative path inside the artifact")
    if data.get("calibration") is not None:
        _object(f"{where}: calibration", data["calibration"])
    if data.get("drafter") is not None and _object(f"{where}: drafter", data["drafter"]):
        _fields(f"{where}: drafter", data["drafter"], _DRAFTER)
        _optional_fields(f"{where}: drafter", data["drafter"], _DRAFTER_OPTIONAL)
