"""`specx build`: backend-specific graphs (and TensorRT engines) recorded in the artifact.

A build lives in `builds/<name>.<id>/` inside the artifact and is described in the
manifest under `builds[<name>]`: the runtime that opens it (`backend`), precision, the
files of every graph and what the backend records besides (for TensorRT the version, GPU
compute capability, optimization profiles and engine sha256). The newest build becomes
`default_build`, which the runtime opens.

Backends (`specx.builders.registry`), one build module each; what else each one is made of
lives by layer (graphs may not import builds, the runtime may not import either):

    backend      lowering (graphs.)            build (builders.)     runtime.targets.
    ort          ort_lowering, weight_only,    ort, gptq             ort
                 row_invariance, precision
    int8-static  row_invariance                int8_static           ort
    openvino     ov_lowering                   openvino              openvino
    trt          trt_lowering, trt_lint        trt (tensorrt.engine, trt
                                               tensorrt.profiles)
    cpu          -                             cpu                   cpu

- `ort`: fp32 with TreeAttention lowered to ONNX Runtime's GroupQueryAttention, fp16, and
  weight-only int4 / int8 (MatMulNBits; round-to-nearest or GPTQ);
- `int8-static`: INT8 QDQ with activation ranges calibrated on prompts;
- `openvino`: OpenVINO IR for its CPU plugin, fp32 or weight-only int4 / int8 (OpenVINO
  imported only there and in its runtime target);
- `cpu`: the target's weights in the layout of specx's own compiled CPU kernels
  (`runtime.kernels`), int4 / int8, for a Llama-form target;
- `trt`: lowered, linted TensorRT engines; TreeAttention runs as the `specx::TreeAttention`
  plugin (`tensorrt.plugin`, its kernel `tensorrt.triton_tree_attention`); TensorRT is
  imported only there. `specx.runtime.targets.OPENERS` maps each build's recorded backend
  to its runtime target.

Atomic for every backend (`specx.builders.staging`). `build_each` (`--backend auto`) builds
every CPU backend installed; `specx.calibration.build_choice` then times each build on this
machine and makes the fastest the default.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from specx.artifact import Manifest, load_manifest
from specx.builders import cpu, int8_static, openvino, ort, trt
from specx.builders.registry import (
    BACKENDS,
    Backend,
    BuildJob,
    BuildOptions,
    BuildOutput,
    Progress,
    backend,
    register,
)
from specx.builders.staging import exported_entries, fresh_output, publish_build
from specx.errors import BuildError

__all__ = [
    "BACKENDS",
    "Backend",
    "BuildJob",
    "BuildOptions",
    "BuildOutput",
    "build_artifact",
    "build_each",
    "cpu_backends",
    "exported_entries",
    "publish_build",
    "register",
]

for _module in (ort, trt, int8_static, openvino, cpu):
    register(_module.BACKEND)


def build_artifact(
    artifact_dir: str | os.PathLike[str],
    options: BuildOptions,
    progress: Progress = lambda message: None,
    prompts: Sequence[Sequence[int]] = (),
    builder: Backend | None = None,
) -> str:
    """Builds the artifact with `options.backend` and makes it the default build.

    `prompts` are calibration prompts (token ids), for the backends that need them (GPTQ,
    static INT8). `builder` overrides the registered backend (a configured instance).

    Returns:
        The build's name.

    Raises:
        BuildError: an unknown backend, options it cannot build (checked before any work),
            lint failures, or TensorRT / a GPU missing for `--backend trt`.
        ArtifactError: the artifact does not verify.
    """
    builder = builder or backend(options.backend)
    manifest = load_manifest(artifact_dir)
    check_weight_files(manifest)
    builder.check(manifest, options, prompts)
    name = builder.build_name(options)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=manifest.root))
    output = fresh_output(name, staging)
    try:
        entry = builder.build(BuildJob(manifest, options, output, progress, prompts))
        publish_build(manifest, name, output, entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"built {name} in {time.perf_counter() - started:.1f}s")
    return name


def cpu_backends(
    manifest: Manifest, options: BuildOptions, progress: Progress = lambda message: None
) -> list[str]:
    """The CPU backends installed here that build `precision`, ONNX Runtime first.

    Each one left out is named in one `progress` line, with why.
    """
    precision = options.precision
    backends = ["ort"]
    if importlib.util.find_spec("openvino") is None:
        progress("OpenVINO is not installed (pip install 'specx[openvino]'): no OpenVINO build")
    elif precision not in openvino.BACKEND.precisions:
        built = ", ".join(p.name for p in openvino.BACKEND.precisions)
        progress(f"OpenVINO builds {built}, not {precision}: no OpenVINO build")
    else:
        backends.append("openvino")
    try:
        cpu.BACKEND.check(manifest, dataclasses.replace(options, backend="cpu"), ())
    except BuildError as e:
        progress(f"no cpu build: {e}")
    else:
        backends.append("cpu")
    return backends


def build_each(
    artifact_dir: str | os.PathLike[str],
    options: BuildOptions,
    backends: Sequence[str],
    progress: Progress = lambda message: None,
) -> list[str]:
    """Builds `options` on each of `backends`; returns the builds' names (the last is default).

    Every backend checks the options before anything is built: one clear error, no work lost.
    """
    manifest = load_manifest(artifact_dir, verify_hashes=False)  # each build verifies it
    each = [dataclasses.replace(options, backend=name) for name in backends]
    for name, configured in zip(backends, each, strict=True):
        backend(name).check(manifest, configured, ())
    return [build_artifact(artifact_dir, configured, progress) for configured in each]


def check_weight_files(manifest: Manifest) -> None:
    """Refuses exported weights behind a link, before any work.

    onnx-ir, which reads every graph a build transforms, will not follow a symbolic or hard
    link to external data (its guard against path traversal) and would fail midway.
    """
    for entry in manifest.graphs.values():
        for name in entry.data_files:
            path = manifest.path(name)
            if path.is_symlink():
                kind = "a symbolic link"
            elif path.is_file() and path.stat().st_nlink > 1:
                kind = "a file with other hard links"
            else:
                continue
            raise BuildError(
                f"{path} is {kind}; onnx-ir does not read external weights through links. "
                "Copy the file into the artifact in its place."
            )
