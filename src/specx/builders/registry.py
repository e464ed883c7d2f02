"""What a build backend is, and where `specx build --backend NAME` finds one.

A backend turns an artifact's exported graphs into the graphs (or engines) one runtime runs.
It checks its options before any work, writes its files into a staging directory and returns
the build's manifest entry; `specx.builders.build_artifact` does the rest (staging,
publishing, the default build) for every backend alike. Its `runtime` names the opener in
`specx.runtime.targets.OPENERS` that runs what it built, and the manifest records that name
as the build's `backend`, so an artifact opens with numpy and onnxruntime alone whichever
backend built it.

Adding a backend is one module with a class meeting `Backend` and a `register(...)` call
(`tests/test_build.py` adds a toy one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from specx.artifact import Manifest
from specx.errors import BuildError
from specx.graphs.weight_only import WeightOnlyConfig
from specx.manifest_types import BuildEntry
from specx.precision import FP32, Precision
from specx.progress import Progress

__all__ = [
    "BACKENDS",
    "Backend",
    "BuildJob",
    "BuildOptions",
    "BuildOutput",
    "WEIGHT_OPTIONS",
    "backend",
    "check_precision",
    "register",
    "taking",
]


@dataclass(frozen=True)
class BuildOptions:
    """What to build: backend, precision, and the TensorRT engine's ranges and effort."""

    backend: str = "ort"
    precision: Precision = FP32  # a name is read as `Precision.named(name)`
    max_batch: int = 8
    optimization_level: int = 3
    timing_cache: Path | None = None  # TensorRT timing cache, read and updated across builds
    weight_only: WeightOnlyConfig | None = None  # int4 / int8: how weights are quantized
    lowering: str = "gqa"  # ORT: TreeAttention as GroupQueryAttention where allowed; or "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision.named(self.precision))

    @property
    def draft_only(self) -> bool:
        """A weight-only build of the draft head's graphs alone (`--quantize draft`)."""
        return self.weight_only is not None and self.weight_only.scope == "draft"


@dataclass(frozen=True)
class BuildOutput:
    """Where a build's files are written (`staging`) and the path they will have (`directory`)."""

    staging: Path
    directory: str  # builds/<name>.<id>, relative to the artifact


@dataclass(frozen=True)
class BuildJob:
    """One build in progress: the artifact, the options, where files go, how to report."""

    manifest: Manifest
    options: BuildOptions
    output: BuildOutput
    progress: Progress
    prompts: Sequence[Sequence[int]] = ()  # calibration prompts (token ids), where needed


class Backend(Protocol):
    """One way to build an artifact for a runtime."""

    name: str  # `specx build --backend NAME`
    runtime: str  # the opener that runs its builds (`specx.runtime.targets.OPENERS`)
    precisions: tuple[Precision, ...]  # what it builds
    # `specx build` options it takes besides --backend and --precision (parameter names:
    # "block_size", "max_batch"); the CLI refuses the others before any work.
    options: frozenset[str]

    def build_name(self, options: BuildOptions) -> str:
        """The build's name in the manifest, e.g. `ort-int4`, `trt-fp16`."""
        ...

    def check(self, manifest: Manifest, options: BuildOptions, prompts: Sequence) -> None:
        """Raises `BuildError` for options or an artifact it cannot build, before any work."""
        ...

    def build(self, job: BuildJob) -> BuildEntry:
        """Writes the build's files into `job.output.staging`; returns its manifest entry.

        The entry's `backend` is this backend's `runtime`; it holds `precision`, `graphs`
        (each graph's file under `job.output.directory`, its data files and signature) and
        whatever else the backend records. Its `directory` is set when it is published.
        """
        ...


# The weight-only rounding options every backend with int4 / int8 builds takes.
WEIGHT_OPTIONS = ("block_size", "symmetric")

BACKENDS: dict[str, Backend] = {}


def register(backend_: Backend) -> Backend:
    """Makes `backend_` available to `specx build --backend` under its name."""
    from specx.runtime.targets import OPENERS

    if backend_.runtime not in OPENERS:
        raise ValueError(f"backend {backend_.name!r}: no runtime opener {backend_.runtime!r}")
    BACKENDS[backend_.name] = backend_
    return backend_


def backend(name: str) -> Backend:
    """The registered backend `name`."""
    if name not in BACKENDS:
        raise BuildError(f"--backend must be one of {sorted(BACKENDS)} or auto, got {name!r}")
    return BACKENDS[name]


def check_precision(backend_: Backend, precision: Precision) -> None:
    """Refuses (BuildError) a precision `backend_` does not build."""
    if precision not in backend_.precisions:
        built = ", ".join(str(p) for p in backend_.precisions)
        raise BuildError(f"--backend {backend_.name} builds --precision {built}, not {precision}")


def taking(option: str) -> list[str]:
    """The registered backends that take `option` (a parameter name), by name."""
    return sorted(name for name, b in BACKENDS.items() if option in b.options)
