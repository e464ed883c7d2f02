"""Publishing artifacts: `specx pack` writes one tar; `verify` checks a tar; `unpack` opens it.

`specx verify` also checks an artifact directory; `specx unpack` writes a tar out as one again.

A packed artifact is a plain, deterministic tar (sorted members, zeroed owners and times)
holding `<name>/manifest.json` and every file the manifest pins, nothing else. Verifying
checks, without extracting: the manifest's format version, the sha256 of every listed
file, that nothing unlisted, linked or outside the artifact is in the tar, and, for
TensorRT builds, that the engines match this machine's TensorRT version and GPU (when
TensorRT is installed here; otherwise that check is reported as skipped).

Standard library only (plus `tensorrt`/`torch` when present, for the engine check).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from specx import __version__
from specx.artifact import (
    MANIFEST_NAME,
    Manifest,
    apply_umask,
    atomic_output_dir,
    check_parents,
    load_manifest,
    parse_manifest,
)
from specx.errors import ArtifactError
from specx.manifest_types import BuildEntry

__all__ = ["VerifyReport", "pack_artifact", "unpack_artifact", "verify_artifact"]

_CHUNK = 1 << 20


@dataclass
class VerifyReport:
    """What `verify_artifact` checked."""

    source: str
    specx_version: str
    files: int = 0
    builds: dict[str, str] = field(default_factory=dict)  # name -> backend/precision
    notes: list[str] = field(default_factory=list)


def pack_artifact(
    artifact_dir: str | os.PathLike[str], output: str | os.PathLike[str], overwrite: bool = False
) -> Path:
    """Verifies the artifact, then writes it as one tar at `output` (atomically).

    An existing `output` is replaced only with `overwrite` and only if it is a tar
    `specx pack` wrote (one artifact directory with a specx manifest); missing parent
    directories are created.

    Raises:
        ArtifactError: `output` may not be written, or the artifact does not verify.
    """
    output = _check_pack_output(output, overwrite)
    manifest = load_manifest(artifact_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    top = manifest.root.name
    names = [MANIFEST_NAME, *sorted(manifest.files)]
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
            for name in names:
                info = tar.gettarinfo(str(manifest.root / name), arcname=f"{top}/{name}")
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                info.mode = 0o644
                with open(manifest.root / name, "rb") as f:
                    tar.addfile(info, f)
            raw.flush()
            os.fsync(raw.fileno())
        apply_umask(tmp)
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return output


def _check_pack_output(output: str | os.PathLike[str], overwrite: bool) -> Path:
    output = check_parents(output)
    if not (output.exists() or output.is_symlink()):
        return output
    if output.is_dir() or output.is_symlink():
        raise ArtifactError(f"{output} is a directory or a link: give the path of a .tar file")
    if not _is_specx_pack(output):
        raise ArtifactError(
            f"{output} already exists and is not a tar written by specx pack: choose another "
            "output path (specx replaces only files it wrote)"
        )
    if not overwrite:
        raise ArtifactError(f"{output} already exists; pass --overwrite to replace it")
    return output


def _is_specx_pack(path: Path) -> bool:
    try:
        with tarfile.open(path, mode="r:") as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
            manifests = [m for m in members if PurePosixPath(m.name).parts[1:] == (MANIFEST_NAME,)]
            if len(manifests) != 1:
                return False
            parse_manifest(_read(tar, manifests[0], path), str(path))
    except (tarfile.TarError, EOFError, OSError, ArtifactError):
        return False
    return True


def verify_artifact(source: str | os.PathLike[str]) -> VerifyReport:
    """Checks a packed tar or an artifact directory; raises on the first problem.

    Raises:
        ArtifactError: naming the file or engine at fault (tampered, truncated, missing,
            unlisted, unsafe member, incompatible format, foreign engine).
    """
    source = Path(source)
    if source.is_dir():
        manifest = load_manifest(source)
        if manifest.damaged:  # the runtime opens the others; a verify fails on any
            raise ArtifactError(
                "; ".join(f"build {b!r}: {why}" for b, why in sorted(manifest.damaged.items()))
            )
    elif source.is_file():
        manifest = _verify_tar(source)
    else:
        raise ArtifactError(f"{source} is neither an artifact directory nor a packed tar")
    version = manifest.data.get("specx_version", "?")
    report = VerifyReport(str(source), version, len(manifest.files))
    _check_builds(version, manifest.builds, report)
    return report


def _verify_tar(path: Path) -> Manifest:
    """The manifest of a packed artifact whose every file matched it (its root: the tar)."""
    with _open_pack(path) as pack:
        for name, expected in pack.data["files"].items():
            actual = _sha256_member(pack.tar, pack.members[name], path)
            _check_digest(pack, name, actual, expected)
    return Manifest.from_json(path, pack.data)


def unpack_artifact(
    archive: str | os.PathLike[str],
    output_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] = lambda message: None,
) -> Path:
    """Writes a packed artifact out as a directory, every file checked as it is written.

    `output_dir` defaults to the tar's artifact directory name beside the tar. The tar's
    layout is checked before anything is written (one artifact directory, no unsafe or
    unlisted member); each file's sha256 is computed as it is extracted into a staging
    directory, which becomes `output_dir` only when every file matched. An existing
    `output_dir` is replaced only with `overwrite`, and only if it is a specx artifact.

    Raises:
        ArtifactError: the tar is not a verifiable specx pack, or `output_dir` may not be
            written.
    """
    archive = Path(archive)
    if not archive.is_file():
        raise ArtifactError(f"{archive} is not a file: give a tar written by specx pack")
    with _open_pack(archive) as pack:
        target = Path(output_dir) if output_dir is not None else archive.parent / pack.top
        total = sum(pack.members[n].size for n in pack.data["files"])
        with atomic_output_dir(target, overwrite) as staging:  # checks `target` first
            progress(f"unpacking {len(pack.data['files'])} files ({total / 1e6:.1f} MB)")
            for i, (name, expected) in enumerate(sorted(pack.data["files"].items())):
                actual = _extract_member(pack, name, staging / name)
                _check_digest(pack, name, actual, expected)
                if pack.members[name].size >= _CHUNK * 64 or i == len(pack.data["files"]) - 1:
                    progress(f"{i + 1}/{len(pack.data['files'])} files: {name}")
            manifest = pack.members[MANIFEST_NAME]
            (staging / MANIFEST_NAME).write_bytes(_read(pack.tar, manifest, archive))
    return target


@dataclass
class _Pack:
    """An open packed artifact whose layout was checked (not yet its files' hashes)."""

    path: Path
    tar: tarfile.TarFile
    top: str  # the artifact directory's name in the tar
    members: dict[str, tarfile.TarInfo]  # relative path -> its member
    data: dict  # the parsed manifest


@contextlib.contextmanager
def _open_pack(path: Path) -> Iterator[_Pack]:
    """The tar at `path`, its layout checked.

    One artifact directory with its manifest; no unsafe, unlisted or missing member.
    """
    try:
        tar = tarfile.open(path, mode="r:*")
    except (tarfile.TarError, OSError) as e:
        raise ArtifactError(f"{path} is not a readable tar ({e}); was it truncated?") from e
    with tar:
        try:
            members = tar.getmembers()
        except (tarfile.TarError, EOFError) as e:
            raise ArtifactError(f"{path} is truncated or corrupt: {e}") from e
        tops = {PurePosixPath(m.name).parts[0] for m in members if m.name}
        if len(tops) != 1:
            raise ArtifactError(f"{path} must hold one artifact directory, found {sorted(tops)}")
        top = tops.pop()
        by_name = {}
        for member in members:
            relative = PurePosixPath(member.name).relative_to(top).as_posix()
            unsafe = member.name.startswith("/") or ".." in PurePosixPath(member.name).parts
            if unsafe or not (member.isfile() or member.isdir()):
                raise ArtifactError(f"{path}: refusing unsafe member {member.name!r}")
            if member.isfile():
                by_name[relative] = member
        if MANIFEST_NAME not in by_name:
            raise ArtifactError(f"{path} has no {top}/{MANIFEST_NAME}")
        where = f"{path}:{top}/{MANIFEST_NAME}"
        data = parse_manifest(_read(tar, by_name[MANIFEST_NAME], path), where)
        unlisted = sorted(set(by_name) - set(data["files"]) - {MANIFEST_NAME})
        if unlisted:
            raise ArtifactError(f"{path} holds files the manifest does not pin: {unlisted}")
        missing = sorted(set(data["files"]) - set(by_name))
        if missing:
            raise ArtifactError(f"{path}: {top}/{missing[0]} is listed in the manifest but missing")
        yield _Pack(path, tar, top, by_name, data)


def _check_digest(pack: _Pack, name: str, actual: str, expected: str) -> None:
    if actual != expected:
        raise ArtifactError(
            f"{pack.path}: {pack.top}/{name} does not match the manifest: sha256 {actual} != "
            f"{expected} (modified or truncated after packing)"
        )


def _extract_member(pack: _Pack, name: str, out: Path) -> str:
    """The member `name` written to `out` (parents made); returns the bytes' sha256."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "xb") as sink:
        return _sha256_member(pack.tar, pack.members[name], pack.path, sink)


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> bytes:
    try:
        f = tar.extractfile(member)
        return f.read() if f is not None else b""
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArtifactError(f"{path}: cannot read {member.name} ({e}); truncated?") from e


def _sha256_member(
    tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path, sink: BinaryIO | None = None
) -> str:
    """The member's sha256; its bytes also go to `sink` as they are read, where given."""
    digest = hashlib.sha256()
    try:
        f = tar.extractfile(member)
        if f is None:  # callers pass regular files only
            raise ArtifactError(f"{path}: {member.name} is not a regular file")
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            if sink is not None:
                sink.write(chunk)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArtifactError(f"{path}: cannot read {member.name} ({e}); truncated?") from e
    return digest.hexdigest()


def _check_builds(version: str, builds: Mapping[str, BuildEntry], report: VerifyReport) -> None:
    if _version_tuple(version) > _version_tuple(__version__):
        report.notes.append(
            f"written by specx {version}, newer than this {__version__} "
            "(same artifact format, so it loads)"
        )
    for name, build in builds.items():
        report.builds[name] = f"{build.backend}/{build.precision}"
        if build.backend != "trt":
            continue
        local = _local_tensorrt()
        if local is None:
            report.notes.append(
                f"build {name}: TensorRT {build.tensorrt_version} engines for compute "
                f"capability {build.compute_capability}; TensorRT or a GPU is not "
                "available here, so they were not checked against this machine"
            )
            continue
        problems = build.engine_mismatches(*local)
        if problems:
            raise ArtifactError(f"build {name}: " + "; ".join(problems))


def _local_tensorrt() -> tuple[str, str] | None:
    try:
        import tensorrt
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return tensorrt.__version__, "{}.{}".format(*torch.cuda.get_device_capability())


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("."):
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)
