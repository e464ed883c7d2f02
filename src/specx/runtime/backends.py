"""Opens an artifact's graphs on the backend its manifest selects.

`specx build` records builds in the manifest and names the default one; without a build
the exported float32 graphs run on ONNX Runtime (CPU). A TensorRT build runs engines;
its module, and with it `tensorrt` and `torch`, is imported only then.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specx.artifact import Manifest
from specx.errors import ArtifactError
from specx.runtime.decoder_backend import DecoderBackend

__all__ = ["backend_name", "open_decoder", "open_stateless"]


def backend_name(manifest: Manifest) -> str:
    """`"ort"` or `"trt"`: the backend of the artifact's default build."""
    build = manifest.build
    name = "ort" if build is None else build["backend"]
    if name not in ("ort", "trt"):
        raise ArtifactError(f"{manifest.root}: unknown backend {name!r} in the default build")
    return name


def open_decoder(
    manifest: Manifest, threads: int | None = None, graph: str = "target"
) -> DecoderBackend:
    """The decoder graph `graph` ("target" or "draft_head") on the manifest's backend."""
    if backend_name(manifest) == "trt":
        from specx.runtime.trt_target import TrtTarget

        return TrtTarget(manifest, graph)
    from specx.runtime.ort_target import OrtTarget

    return OrtTarget(manifest, threads, graph)


def open_stateless(
    manifest: Manifest, graph: str, threads: int | None = None
) -> Callable[[np.ndarray], np.ndarray]:
    """A one-input graph (Medusa heads, the EAGLE-3 projection) on the manifest's backend."""
    if backend_name(manifest) == "trt":
        from specx.runtime.trt_target import TrtGraph

        return TrtGraph(manifest, graph)
    from specx.runtime.ort_target import OrtGraph

    return OrtGraph(manifest, graph, threads)
