"""Whether a TensorRT build of an artifact can run here (pure; no TensorRT import).

A serialized engine runs only on the TensorRT version that built it (major.minor) and on
a GPU of the same compute capability. `specx verify` and the TensorRT backend refuse a
mismatch with these messages instead of failing inside TensorRT.
"""

from __future__ import annotations

from specx.manifest_types import BuildEntry

__all__ = ["engine_mismatches"]


def engine_mismatches(
    build: BuildEntry, tensorrt_version: str | None, compute_capability: str | None
) -> list[str]:
    """Reasons the TensorRT `build` cannot run with this TensorRT and GPU (empty: it can).

    `None` for either means "unknown here" and that check is skipped.
    """
    problems = []
    built_with = build.tensorrt_version
    if tensorrt_version is not None and built_with is not None:
        if built_with.split(".")[:2] != tensorrt_version.split(".")[:2]:
            problems.append(
                f"engines were built with TensorRT {built_with}, this is TensorRT "
                f"{tensorrt_version}: rebuild them with `specx build --backend trt`"
            )
    built_for = build.compute_capability
    if compute_capability is not None and built_for is not None:
        if built_for != compute_capability:
            problems.append(
                f"engines were built for GPU compute capability {built_for} "
                f"({build.gpu or 'unknown GPU'}), this GPU is {compute_capability}"
            )
    return problems
