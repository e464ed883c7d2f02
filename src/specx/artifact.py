"""The specx artifact: a directory of graphs plus a `manifest.json` that pins every file.

An artifact is what `specx export` writes and what the runtime loads. The manifest
records the specx version and artifact format, the source checkpoint (config and
weight digests), every file with its sha256, each graph's IO signature and opset,
the KV-cache layout and capacity, the hidden-state taps, and the tokenizer.

Writes are atomic: a directory is assembled under a temporary name and renamed
into place, and `manifest.json` is replaced with `os.replace`, so an interrupted
export leaves either the old artifact or none, never half of one. Loading checks
the format version and the sha256 of every file and refuses anything else.

Standard library only: the runtime imports this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specx import __version__
from specx.artifact_schema import check_manifest_types
from specx.errors import ArtifactError
from specx.manifest_types import (
    BuildChoice,
    BuildEntry,
    CalibrationEntry,
    DrafterSpec,
    GraphEntry,
    ModelSpec,
    SourceGrid,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "atomic_output_dir",
    "atomic_write_bytes",
    "atomic_write_text",
    "apply_umask",
    "check_output_dir",
    "check_parents",
    "exported_body",
    "is_specx_artifact",
    "load_manifest",
    "manifest_body",
    "parse_manifest",
    "sha256_file",
    "write_manifest",
]

FORMAT_NAME = "specx-artifact"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Returns the hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Writes `text` to `path` so that readers see the old file or the new one, never half."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Writes `data` to `path` so that readers see the old file or the new one, never half."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike[str]) -> None:
    """Gives `path` and everything under it the permissions the umask gives new files.

    Temporary files and directories (`tempfile`, ONNX's external-data writer) are created
    owner-only; an artifact must be readable like the rest of a checkout, e.g. by a
    service account that did not export it.
    """
    mask = _umask()
    root = Path(path)
    for p in [root, *root.rglob("*")] if root.is_dir() else [root]:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def is_specx_artifact(path: str | os.PathLike[str]) -> bool:
    """True when `path` is a directory whose manifest.json parses as a specx manifest."""
    manifest = Path(path) / MANIFEST_NAME
    if not manifest.is_file():
        return False
    try:
        parse_manifest(manifest.read_bytes(), str(manifest))
    except (ArtifactError, OSError):
        return False
    return True


def check_parents(path: str | os.PathLike[str]) -> Path:
    """Checks that `path`'s missing parents can be created; returns `path` made absolute.

    Raises:
        ArtifactError: the nearest existing ancestor is not a directory.
    """
    # `..` and symlinked parents resolved now: `new/../existing` must not be taken for new.
    path = Path(os.path.abspath(path))
    path = path.parent.resolve() / path.name
    for ancestor in path.parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise ArtifactError(f"cannot create {path}: {ancestor} is not a directory")
            break
    return path


def check_output_dir(
    path: str | os.PathLike[str],
    overwrite: bool = False,
    protected: tuple[str | os.PathLike[str], ...] = (),
) -> Path:
    """Checks that an artifact may be written at `path`, before any work is done.

    A new path is always fine (its parents are created). An existing one is replaced only
    with `overwrite`, and only if it is a specx artifact holding nothing but what its
    manifest pins (plus specx's own dot-named staging leftovers): never a plain file, a
    symlink, a directory of other data, the current directory or one above it, or a
    directory that is or holds one of the `protected` paths (the export's sources).

    Returns:
        The absolute path.

    Raises:
        ArtifactError: naming the path and the reason it is refused.
    """
    path = check_parents(path)
    if not (path.exists() or path.is_symlink()):
        return path
    if not overwrite:
        if path.is_dir() and is_specx_artifact(path):
            raise ArtifactError(f"{path} already exists; pass --overwrite to replace it")
        raise ArtifactError(
            f"{path} already exists and is not a specx artifact: choose another output path "
            "(specx replaces only artifacts it wrote)"
        )
    reason = _why_not_replaceable(path, tuple(Path(p) for p in protected))
    if reason:
        raise ArtifactError(f"refusing to replace {path}: {reason}")
    return path


def _why_not_replaceable(path: Path, protected: tuple[Path, ...]) -> str | None:
    if path.is_symlink():
        return "it is a symbolic link"
    if not path.is_dir():
        return "it is a file, not an artifact directory"
    resolved = path.resolve()
    cwd = Path.cwd().resolve()
    if cwd == resolved or resolved in cwd.parents:
        return "it is the current directory or one above it"
    for source in protected:
        source = source.resolve()
        if source == resolved:
            return "it is a source of this export"
        if resolved in source.parents:
            return f"it holds {source}, a source of this export"
    if not is_specx_artifact(path):
        return "it is not a specx artifact (no valid manifest.json); specx replaces only its own"
    pinned = set(json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))["files"])
    foreign = sorted(
        relative
        for p in path.rglob("*")
        if not p.is_dir()
        and (relative := p.relative_to(path).as_posix()) not in pinned
        and relative != MANIFEST_NAME
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if foreign:
        return f"it holds files its manifest does not pin, which specx did not write: {foreign[:5]}"
    return None


@contextlib.contextmanager
def atomic_output_dir(
    path: str | os.PathLike[str],
    overwrite: bool = False,
    protected: tuple[str | os.PathLike[str], ...] = (),
) -> Iterator[Path]:
    """Yields a temporary sibling directory that becomes `path` only if the block succeeds.

    `path` is checked first (`check_output_dir`): an existing path is replaced only when
    it is a specx artifact and `overwrite` is set. The result gets the umask's permissions.

    Raises:
        ArtifactError: `path` may not be written or replaced.
    """
    path = check_output_dir(path, overwrite, protected)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.staging-", dir=path.parent))
    try:
        yield staging
        apply_umask(staging)
        check_output_dir(path, overwrite, protected)  # again: the work may have taken minutes
        if path.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, retired / path.name)
            os.replace(staging, path)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@dataclass(frozen=True)
class Manifest:
    """A loaded, verified manifest: its typed sections, and the JSON body they were read from.

    `data` is the body as read, kept for `manifest_body` to write back with a section
    changed (`with_build`, `with_new_build`, `with_calibration` change both), and for the
    calibration entries, which are checked when used (`calibration`).
    """

    root: Path  # the artifact directory
    data: dict[str, Any]
    model: ModelSpec
    graphs: Mapping[str, GraphEntry]  # the exported graphs
    builds: Mapping[str, BuildEntry]
    default_build: str | None  # the build the runtime opens; None: the exported graphs
    drafter: DrafterSpec | None  # the head exported with the target, if any
    files: Mapping[str, str]  # every pinned file (relative path) -> sha256
    tokenizer: str | None  # relative paths, as `files` names them
    chat_template: str | None
    source_grid: SourceGrid | None = None  # a quantized source file's grid (GGUF exports)
    # Builds whose files fail their pins (build name -> what failed): each blocks only itself.
    damaged: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(
        cls, root: Path, data: dict[str, Any], damaged: Mapping[str, str] | None = None
    ) -> Manifest:
        """The manifest of a body `parse_manifest` checked (which this cannot fail on)."""
        drafter = data.get("drafter")
        return cls(
            root=root,
            data=data,
            model=ModelSpec.from_json(data["model"]),
            graphs={name: GraphEntry.from_json(g) for name, g in data["graphs"].items()},
            builds={name: BuildEntry.from_json(b) for name, b in data.get("builds", {}).items()},
            default_build=data.get("default_build"),
            drafter=DrafterSpec.from_json(drafter) if drafter else None,
            files=data["files"],
            tokenizer=data.get("tokenizer"),
            chat_template=data.get("chat_template"),
            source_grid=_source_grid(data),
            damaged=dict(damaged or {}),
        )

    def path(self, relative: str) -> Path:
        """Absolute path of a file the manifest lists."""
        return self.root / relative

    def graph(self, name: str) -> GraphEntry:
        """The exported graph `name` (file, signature)."""
        if name not in self.graphs:
            raise ArtifactError(
                f"{self.root / MANIFEST_NAME}: no graph named {name!r} (has {sorted(self.graphs)})"
            )
        return self.graphs[name]

    @property
    def build(self) -> BuildEntry | None:
        """The build the runtime uses (`specx build`), or None: the exported graphs on ORT.

        `builds` maps a build name to its backend, precision and graphs; `default_build`
        names the one `specx generate` runs unless told otherwise.
        """
        name = self.default_build
        if name is not None and name in self.damaged:
            healthy = [b for b in self.builds if b not in self.damaged]
            raise ArtifactError(
                f"build {name!r} of {self.root} is damaged: "
                f"{self.damaged[name]}. `specx build` with its --backend and "
                f"--precision replaces it; the artifact's other builds run (--build NAME: "
                f"{healthy + ['exported']})"
            )
        return None if name is None else self.builds[name]

    def with_build(self, name: str | None) -> Manifest:
        """This artifact with build `name` as the default (None: the exported graphs)."""
        if name is not None and name not in self.builds:
            raise ArtifactError(
                f"{self.root / MANIFEST_NAME}: no build {name!r} (has {sorted(self.builds)})"
            )
        data = {**self.data, "default_build": name}
        return dataclasses.replace(self, data=data, default_build=name)

    def with_new_build(self, name: str, entry: BuildEntry) -> Manifest:
        """This artifact with `entry` as build `name` (replacing any of that name), the default.

        A recorded `build_choice` goes: it timed builds this one replaces or outranks.
        """
        data = {**self.data, "builds": {**self.data.get("builds", {}), name: entry.to_json()}}
        data.pop("build_choice", None)
        builds = {**self.builds, name: entry}
        damaged = {b: why for b, why in self.damaged.items() if b != name}
        return dataclasses.replace(self, data=data, builds=builds, damaged=damaged).with_build(name)

    def runtime_graph(self, name: str) -> GraphEntry:
        """The entry of graph `name` in the default build, else the exported graph's."""
        build = self.build
        if build is None:
            return self.graph(name)
        if name not in build.graphs:
            raise ArtifactError(
                f"{self.root / MANIFEST_NAME}: build {self.default_build!r} has no "
                f"graph {name!r} (has {sorted(build.graphs)})"
            )
        return build.graphs[name]

    @property
    def calibration_keys(self) -> tuple[str, ...]:
        """The calibrated drafters: a drafter's name, `@<sampling setting>` past greedy."""
        return tuple(self.data.get("calibration") or {})

    def calibration(self, key: str) -> CalibrationEntry:
        """`specx calibrate`'s entry `key`, checked now: a stale entry breaks only its users.

        Raises:
            ArtifactError: the entry is malformed (named, with the advice to recalibrate).
        """
        where = f"{self.root / MANIFEST_NAME}: calibration.{key}"
        return CalibrationEntry.from_json(where, self.data["calibration"][key])

    @property
    def build_choice(self) -> BuildChoice | None:
        """Why the default build is, where `specx build --backend auto` chose it.

        Checked now: a broken record raises ArtifactError naming it.
        """
        data = self.data.get("build_choice")
        where = f"{self.root / MANIFEST_NAME}: build_choice"
        return None if data is None else BuildChoice.from_json(where, data)

    def with_build_choice(self, choice: BuildChoice) -> Manifest:
        """This artifact with `choice` recorded and its picked build the default."""
        chosen = self.with_build(choice.picked)
        return dataclasses.replace(chosen, data={**chosen.data, "build_choice": choice.to_json()})

    def with_calibration(self, key: str, entry: CalibrationEntry) -> Manifest:
        """This artifact with `entry` as calibration `key` (replacing any of that key)."""
        calibration = {**(self.data.get("calibration") or {}), key: entry.to_json()}
        return dataclasses.replace(self, data={**self.data, "calibration": calibration})

    @property
    def chat_template_file(self) -> Path | None:
        """The artifact's chat template (`specx.chat`), or None when it has none."""
        return None if self.chat_template is None else self.root / self.chat_template

    @property
    def tokenizer_file(self) -> Path | None:
        """The artifact's tokenizer.json, or None when it was exported without one."""
        return None if self.tokenizer is None else self.root / self.tokenizer


def _source_grid(data: dict[str, Any]) -> SourceGrid | None:
    source = data.get("source")
    grid = source.get("grid") if isinstance(source, dict) else None
    return SourceGrid.from_json(grid) if isinstance(grid, dict) else None


def exported_body(
    source: Mapping[str, Any],
    model: ModelSpec,
    graphs: Mapping[str, GraphEntry],
    drafter: DrafterSpec | None,
    tokenizer: str | None,
    chat_template: str | None,
) -> dict[str, Any]:
    """The body of a new artifact's manifest (`write_manifest` adds the format and files).

    `source` records the checkpoint for people (path, config, weight sha256s).
    """
    body = {
        "source": dict(source),
        "model": model.to_json(),
        "graphs": {name: graph.to_json() for name, graph in graphs.items()},
        "tokenizer": tokenizer,
    }
    # Absent rather than null, as exports have always left them.
    if drafter is not None:
        body["drafter"] = drafter.to_json()
    if chat_template is not None:
        body["chat_template"] = chat_template
    return body


def manifest_body(manifest: Manifest) -> dict[str, Any]:
    """The manifest without the fields `write_manifest` regenerates (format, files)."""
    generated = ("format", "format_version", "specx_version", "files")
    return {k: v for k, v in manifest.data.items() if k not in generated}


def write_manifest(
    root: str | os.PathLike[str],
    body: dict[str, Any],
    exclude: tuple[str, ...] = (),
    known: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Hashes every file under `root` into `body["files"]` and writes `manifest.json` atomically.

    Files under the directories in `exclude` (relative paths) are left out: a build being
    replaced, which is deleted once the new manifest is in place. `known` gives digests
    computed while the files were written (relative path -> sha256), not read again. A file
    the manifest already pins keeps its pin: specx rewrites the manifest, never a file it
    pinned, so a file damaged since keeps failing its check rather than being pinned anew.

    Returns:
        The full manifest as written.
    """
    root = Path(root)
    excluded = tuple(root / e for e in exclude)
    known = {**_pinned(root), **(known or {})}
    files = {
        p.relative_to(root).as_posix(): known.get(p.relative_to(root).as_posix()) or sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and p.name != MANIFEST_NAME
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
        and not any(p.is_relative_to(e) for e in excluded)
    }
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "specx_version": __version__,
        **body,
        "files": files,
    }
    _check_references(root / MANIFEST_NAME, manifest)
    atomic_write_text(root / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _pinned(root: Path) -> dict[str, str]:
    """The files the manifest at `root` pins (none where there is no readable one)."""
    try:
        files = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return {}
    return dict(files) if isinstance(files, dict) else {}


def load_manifest(root: str | os.PathLike[str], verify_hashes: bool = True) -> Manifest:
    """Reads and verifies an artifact's manifest.

    Raises:
        ArtifactError: the manifest is missing or malformed, from an incompatible
            format version, a listed file is missing, or a file's sha256 differs.
    """
    root = Path(root).absolute()
    manifest_path = root / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ArtifactError(f"{root} is not a specx artifact: {MANIFEST_NAME} is missing")
    data = parse_manifest(manifest_path.read_bytes(), str(manifest_path))
    damaged: dict[str, str] = {}
    if verify_hashes:
        owners = _build_files(data)
        for name, expected in data["files"].items():
            problem = _pin_problem(root / name, expected, manifest_path)
            if problem is None:
                continue
            if name not in owners:  # shared by every build (exported graphs, tokenizer)
                raise ArtifactError(problem)
            for build in owners[name]:
                damaged.setdefault(build, problem)
    return Manifest.from_json(root, data, damaged)


def _pin_problem(path: Path, expected: str, manifest_path: Path) -> str | None:
    """What is wrong with a pinned file, or None where it matches its sha256."""
    if not path.is_file():
        return f"{path} is listed in {manifest_path} but missing"
    actual = sha256_file(path)
    if actual != expected:
        return (
            f"{path} does not match {manifest_path}: sha256 {actual} != {expected} "
            "(the file was modified or truncated after it was written)"
        )
    return None


def _build_files(data: dict[str, Any]) -> dict[str, list[str]]:
    """Each file only builds use -> those builds (the rest every build may read)."""
    shared = {g["file"] for g in data["graphs"].values()}
    shared |= {d for g in data["graphs"].values() for d in g.get("data_files", [])}
    owners: dict[str, list[str]] = {}
    for build, entry in data.get("builds", {}).items():
        for graph in entry.get("graphs", {}).values():
            for name in [graph["file"], *graph.get("data_files", []), graph.get("engine")]:
                if name and name not in shared:
                    owners.setdefault(name, []).append(build)
    return owners


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """Parses and checks a manifest's JSON body (format, version, sections, references).

    Raises:
        ArtifactError: naming `where` and the problem.
    """
    try:
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{where} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise ArtifactError(f"{where} is not a specx manifest (format != {FORMAT_NAME!r})")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{where} has artifact format {version!r}, written by specx "
            f"{data.get('specx_version')!r}; this specx {__version__} reads format "
            f"{FORMAT_VERSION} only: re-export the model with this version"
        )
    for key in ("graphs", "model", "files"):
        if not isinstance(data.get(key), dict):
            raise ArtifactError(f"{where} lacks the {key!r} section")
    check_manifest_types(where, data)
    _check_references(Path(where), data)
    return data


def _check_references(manifest_path: Path, data: dict[str, Any]) -> None:
    files = data["files"]
    graphs = list(data["graphs"].values())
    builds = data.get("builds", {})
    if not isinstance(builds, dict):
        raise ArtifactError(f"{manifest_path}: 'builds' must be an object")
    default = data.get("default_build")
    if default is not None and default not in builds:
        raise ArtifactError(f"{manifest_path}: default_build {default!r} is not in builds")
    for build in builds.values():
        graphs += list(build.get("graphs", {}).values())
    referenced = [g["file"] for g in graphs]
    referenced += [d for g in graphs for d in g.get("data_files", [])]
    referenced += [g["engine"] for g in graphs if "engine" in g]
    if data.get("tokenizer"):
        referenced.append(data["tokenizer"])
    for name in referenced:
        if name not in files:
            raise ArtifactError(f"{manifest_path} references {name!r} but does not pin its sha256")
