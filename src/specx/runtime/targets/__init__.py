"""Opens an artifact's graphs on the backend its manifest selects.

`specx build` records builds in the manifest and names the default one, and each build
names the runtime that opens it (`backend`); without a build the exported float32 graphs
run on ONNX Runtime (CPU). A TensorRT build runs engines; its module, and with it
`tensorrt` and `torch`, is imported only then; an OpenVINO build likewise imports `openvino`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from specx.artifact import Manifest
from specx.errors import ArtifactError
from specx.runtime.targets.base import DecoderBackend

__all__ = [
    "EXPORTED",
    "OPENERS",
    "Opener",
    "backend_name",
    "build_name",
    "graph_runtime",
    "open_decoder",
    "open_stateless",
    "select_build",
]


class Opener(Protocol):
    """How one runtime opens an artifact's graphs (a build names its opener as `backend`)."""

    def decoder(self, manifest: Manifest, threads: int | None, graph: str) -> DecoderBackend:
        """A decoder graph ("target" or "draft_head")."""
        ...

    def stateless(
        self, manifest: Manifest, graph: str, threads: int | None
    ) -> Callable[[np.ndarray], np.ndarray]:
        """A one-input graph (Medusa heads, the EAGLE-3 projection)."""
        ...


class _OnnxRuntime:
    def decoder(self, manifest: Manifest, threads: int | None, graph: str) -> DecoderBackend:
        from specx.runtime.targets.ort import OrtTarget

        return OrtTarget(manifest, threads, graph)

    def stateless(self, manifest: Manifest, graph: str, threads: int | None):
        from specx.runtime.targets.ort import OrtGraph

        return OrtGraph(manifest, graph, threads)


class _TensorRT:
    def decoder(self, manifest: Manifest, threads: int | None, graph: str) -> DecoderBackend:
        from specx.runtime.targets.trt import TrtTarget

        return TrtTarget(manifest, graph)

    def stateless(self, manifest: Manifest, graph: str, threads: int | None):
        from specx.runtime.targets.trt import TrtGraph

        return TrtGraph(manifest, graph)


class _OpenVino:
    def decoder(self, manifest: Manifest, threads: int | None, graph: str) -> DecoderBackend:
        from specx.runtime.targets.openvino import OvTarget

        return OvTarget(manifest, threads, graph)

    def stateless(self, manifest: Manifest, graph: str, threads: int | None):
        # An OpenVINO build runs its target there and records its other graphs as ONNX
        # Runtime's (specx.builders.openvino), so no one-input graph is ever OpenVINO's.
        raise ArtifactError(
            f"{manifest.root}: graph {graph!r} names OpenVINO, which runs only a build's target"
        )


class _CpuKernels:
    def decoder(self, manifest: Manifest, threads: int | None, graph: str) -> DecoderBackend:
        from specx.runtime.targets.cpu import CpuTarget

        return CpuTarget(manifest, threads, graph)

    def stateless(self, manifest: Manifest, graph: str, threads: int | None):
        # The one one-input graph the kernels run: an EAGLE-3 head's projection.
        from specx.runtime.targets.cpu import CpuProjection

        return CpuProjection(manifest, graph, threads)


# Runtime name (a build's `backend`) -> its opener; modules load on first use, so TensorRT
# (and torch) are imported only for a TensorRT build, OpenVINO only for an OpenVINO one.
OPENERS: dict[str, Opener] = {
    "ort": _OnnxRuntime(),
    "trt": _TensorRT(),
    "openvino": _OpenVino(),
    "cpu": _CpuKernels(),
}


EXPORTED = "exported"  # the name the exported graphs run under when no build is the default


def build_name(manifest: Manifest) -> str:
    """The artifact's default build, or `EXPORTED` when the exported graphs run."""
    return manifest.default_build or EXPORTED


def select_build(manifest: Manifest, name: str | None) -> Manifest:
    """The artifact with build `name` as its default (`EXPORTED`: no build; None: as is).

    Raises:
        ArtifactError: the artifact has no build `name`.
    """
    if name is None:
        return manifest
    if name != EXPORTED and name not in manifest.builds:
        raise ArtifactError(
            f"{manifest.root} has no build {name!r}: it has {sorted(manifest.builds) + [EXPORTED]}"
        )
    return manifest.with_build(None if name == EXPORTED else name)


def build_reason(manifest: Manifest, named: bool = False, rows: int = 1) -> str:
    """Why the default build is the one that runs, for the stats.

    `named`: the caller chose it; `rows`: the sequences it decodes together (`build_for_load`).
    """
    try:
        choice = manifest.build_choice
    except ArtifactError as e:  # a broken record costs the reason, not the run
        return f"the artifact's default build ({e})"
    fastest = "" if choice is None else f"; the build timed fastest here was {choice.picked}"
    if named:
        return f"named{fastest}"
    if choice is None:
        return "the artifact's default build, the newest (none timed: specx build --backend auto)"
    name, why = choice.for_load(rows)
    return why if name == manifest.default_build else choice.reason


def build_for_load(manifest: Manifest, rows: int) -> str | None:
    """The build timed fastest with `rows` sequences decoding together, if not the default.

    `specx build --backend auto` times each build at batches too (a server's slots); None:
    run the default (one row, no such timing, or that build since replaced or damaged).
    """
    try:
        choice = manifest.build_choice
    except ArtifactError:
        return None
    if choice is None or rows <= 1:
        return None
    name, _ = choice.for_load(rows)
    healthy = name in manifest.builds and name not in manifest.damaged
    return name if healthy and name != manifest.default_build else None


def backend_name(manifest: Manifest) -> str:
    """The runtime of the artifact's default build (`"ort"` for the exported graphs)."""
    build = manifest.build
    name = "ort" if build is None else build.backend
    if name not in OPENERS:
        raise ArtifactError(f"{manifest.root}: unknown backend {name!r} in the default build")
    return name


def graph_runtime(manifest: Manifest, graph: str) -> str:
    """The runtime that opens `graph`: its own where the build names one, else the build's."""
    name = manifest.runtime_graph(graph).runtime or backend_name(manifest)
    if name not in OPENERS:
        raise ArtifactError(f"{manifest.root}: unknown runtime {name!r} for graph {graph!r}")
    return name


def open_decoder(
    manifest: Manifest, threads: int | None = None, graph: str = "target"
) -> DecoderBackend:
    """The decoder graph `graph` ("target" or "draft_head") on its runtime."""
    return OPENERS[graph_runtime(manifest, graph)].decoder(manifest, threads, graph)


def open_stateless(
    manifest: Manifest, graph: str, threads: int | None = None
) -> Callable[[np.ndarray], np.ndarray]:
    """A one-input graph (Medusa heads, the EAGLE-3 projection) on its runtime."""
    return OPENERS[graph_runtime(manifest, graph)].stateless(manifest, graph, threads)
