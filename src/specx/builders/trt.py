"""`specx build --backend trt`: one TensorRT engine per graph.

Every graph is lowered to the TensorRT form (`specx.graphs.trt_lowering`), linted against
the parser's operator table (`specx.graphs.trt_lint`), then built with TensorRT, which is
imported only here, with optimization profiles covering the artifact's shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from specx.artifact import Manifest
from specx.builders.registry import BuildJob, BuildOptions, check_precision
from specx.builders.staging import load_graph, save_graph
from specx.errors import BuildError
from specx.graphs.trt_lint import lint_for_tensorrt
from specx.graphs.trt_lowering import lower_for_tensorrt
from specx.manifest_types import BuildEntry
from specx.precision import BF16, FP16, FP32, Precision

__all__ = ["BACKEND", "TensorRT"]


class TensorRT:
    """Lowered, linted graphs built into TensorRT engines (needs TensorRT and a GPU)."""

    name = "trt"
    runtime = "trt"
    precisions: tuple[Precision, ...] = (FP32, FP16, BF16)
    options = frozenset({"max_batch", "optimization_level", "timing_cache"})

    def build_name(self, options: BuildOptions) -> str:
        """`trt-<precision>`."""
        return f"trt-{options.precision}"

    def check(self, manifest: Manifest, options: BuildOptions, prompts: Sequence) -> None:
        """Floating-point precisions only: TensorRT int4/int8 would go through ModelOpt."""
        if options.precision.weight_only:
            raise BuildError(
                f"--precision {options.precision} is an ONNX Runtime weight-only build "
                "(MatMulNBits); TensorRT int4/int8 goes through NVIDIA ModelOpt, which is not "
                "installed here"
            )
        check_precision(self, options.precision)

    def build(self, job: BuildJob) -> BuildEntry:
        """Lowers and lints every graph, then builds each engine."""
        from specx.tensorrt.profiles import ProfileLimits, optimization_profiles

        manifest, options, output = job.manifest, job.options, job.output
        capacity = manifest.model.kv_capacity
        lowered = {}
        for name, exported in manifest.graphs.items():
            if exported.ort_only:
                continue  # e.g. the one-call draft chain (an ONNX Loop): TensorRT drafts per depth
            job.progress(f"[trt] lowering {name} ({options.precision}) and linting it")
            model = lower_for_tensorrt(load_graph(manifest, name), capacity, options.precision.name)
            issues = lint_for_tensorrt(model, name)
            if issues:
                listing = "\n  ".join(str(i) for i in issues)
                raise BuildError(f"TensorRT would reject {len(issues)} node(s):\n  {listing}")
            lowered[name] = model
        from specx.tensorrt.engine import build_engine, device_summary

        version, capability, gpu = device_summary()  # raises BuildError naming what is missing
        limits = ProfileLimits(
            kv_capacity=capacity,
            max_tree_tokens=manifest.model.max_tree_tokens,
            max_batch=options.max_batch,
        )
        graphs = {}
        for name, model in lowered.items():
            entry = save_graph(model, output, name)
            profiles = optimization_profiles(entry.inputs, limits)
            job.progress(f"[trt] building the {name} engine ({len(profiles)} profiles)")
            digest = build_engine(
                output.staging / f"{name}.onnx",
                output.staging / f"{name}.engine",
                profiles,
                optimization_level=options.optimization_level,
                timing_cache=options.timing_cache,
            )
            graphs[name] = replace(
                entry,
                engine=f"{output.directory}/{name}.engine",
                engine_sha256=digest,
                profiles=tuple(profiles),
            )
        return BuildEntry(
            self.runtime,
            options.precision.name,
            graphs=graphs,
            tensorrt_version=version,
            compute_capability=capability,
            gpu=gpu,
        )


BACKEND = TensorRT()
