"""`specx build --backend cpu`: the target for specx's own CPU kernels (`specx.runtime.kernels`).

Why a third CPU backend: ONNX Runtime's int4 kernel streams the weights again for every pair
of a verify's rows and OpenVINO's is slow at one row, so neither makes N tokens cost what one
does (docs/decisions.md#cpu-kernels). The kernels' forward reads each weight tile once for all
rows, and its rows are independent by construction, so trees are exact on it with no pad row
and no spine rule (`greedy_identity: all`).

The build reads the exported target's weights and constants (specx.builders.cpu_read), rounds
every MatMul weight to nearest at the build's width in blocks of 128 inputs (32 on a small
target; int4 asymmetric, int8 symmetric; `--block-size` and `--symmetric` change those; the
output projection at 8 bits, as the OpenVINO build keeps it) and writes them in the kernels'
layout to one file, `target.bin`, indexed by `target.json`. Only a Llama-form target is
built (pre-norm, SwiGLU, RoPE on every layer, no biases, q/k norms, sliding windows or soft
caps); anything else is refused before any work, naming what differs. An EAGLE-3 head is
written the same way (`draft_head.bin`, `draft_projection.bin`) and drafts on the kernels
too; other draft graphs are built as the ONNX Runtime backend builds them and run there, as
an OpenVINO build's do.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specx.artifact import Manifest
from specx.builders.cpu_read import HEAD_GRAPHS, DecoderWeights, read_head, read_target, refuse
from specx.builders.grid import NONE_KEPT, Grid, KeptGrids, kept_codes, kept_grids
from specx.builders.ort import STREAMED_WEIGHTS, build_drafts
from specx.builders.registry import WEIGHT_OPTIONS, BuildJob, BuildOptions, check_precision
from specx.errors import BuildError
from specx.graphs.weight_only import WeightOnlyConfig, quantize_rtn
from specx.manifest_types import BuildEntry, GraphEntry, Quantization
from specx.precision import INT4, INT8, Precision
from specx.runtime import kernels

__all__ = ["BACKEND", "Cpu"]

OUTPUT_BITS = 8  # the lm_head's width at either precision
FORMAT = 2  # <graph>.json's layout (specx.runtime.targets.cpu reads it): 2 adds zero points


def check_shapes(manifest: Manifest) -> None:
    """Refuses widths the kernels do not block: every MatMul's inputs in whole blocks of 32."""
    model = manifest.model
    widths = {
        "hidden size": model.hidden_size,
        "heads x head size": model.num_heads * model.head_dim,
    }
    odd = [f"{name} {width}" for name, width in widths.items() if width % kernels.QBLOCK]
    if odd:
        raise BuildError(
            f"{manifest.root}: --backend cpu needs MatMul inputs in whole blocks of "
            f"{kernels.QBLOCK}; this target's {', '.join(odd)}"
        )


class _Writer:
    """A graph's tensors appended to `<graph>.bin` at 64-byte offsets, indexed by `<graph>.json`.

    Used as a context: on exit the index is written and `entry` is the graph's manifest entry
    (the exported graph's signature, runtime left to the build's).
    """

    def __init__(self, job: BuildJob, graph: str, constants: dict):
        self.job, self.graph, self.constants = job, graph, constants
        self.file = open(job.output.staging / f"{graph}.bin", "wb")  # noqa: SIM115 (__exit__)
        self.index: dict[str, dict] = {}
        self.entry: GraphEntry

    def add(self, name: str, array: np.ndarray) -> None:
        offset = -(-self.file.tell() // 64) * 64
        self.file.write(b"\0" * (offset - self.file.tell()))
        self.file.write(np.ascontiguousarray(array).tobytes())
        self.index[name] = {"offset": offset, "dtype": array.dtype.str, "shape": list(array.shape)}

    def add_linear(
        self, name: str, weight: np.ndarray, rounding: Rounding, grid: Grid | None = None
    ) -> None:
        """`weight` [n, k] rounded and packed, or kept on `grid`; the index records how."""
        shape = {"k": weight.shape[1], "n": weight.shape[0]}
        if grid is not None:
            codes, scales = kept_codes(weight, grid, name)
            self.add(name, kernels.pack_codes(codes, scales, grid.bits))
            self.index[name].update(bits=grid.bits, block=grid.block, zero_points=False, **shape)
            return
        self.add(name, rounding.packed(weight))
        zero_points = not rounding.symmetric
        self.index[name].update(bits=rounding.bits, block=rounding.block,
                                zero_points=zero_points, **shape)  # fmt: skip

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()
        if exc[0] is not None:
            return
        index = {"format": FORMAT, "constants": self.constants, "tensors": self.index}
        staging, directory = self.job.output.staging, self.job.output.directory
        (staging / f"{self.graph}.json").write_text(json.dumps(index, indent=1))
        exported = self.job.manifest.graph(self.graph)
        self.entry = dataclasses.replace(
            exported,
            file=f"{directory}/{self.graph}.json",
            data_files=(f"{directory}/{self.graph}.bin",),
            opset=None,
        )


def block_size(weights: DecoderWeights) -> int:
    """The block: 128 inputs on a target whose weights stream from memory, else 32.

    ONNX Runtime's int4 builds' rule (specx.builders.ort.STREAMED_WEIGHTS): a large block
    quarters the per-block work of the kernels' inner loop (docs/decisions.md#cpu-kernels),
    and a large target's accuracy holds at it. Every MatMul's inputs must be whole blocks.
    """
    total = sum(w.size for w in weights.linears.values())
    if total >= STREAMED_WEIGHTS and _blocks_of(weights, 128):
        return 128
    return kernels.QBLOCK


def _blocks_of(weights: DecoderWeights, block: int) -> bool:
    return all(w.shape[1] % block == 0 for w in weights.linears.values())


@dataclass(frozen=True)
class Rounding:
    """How a build rounds MatMul weights to nearest: width, block of inputs, zero points.

    int4 blocks default to asymmetric (a zero point per column and block), as ONNX Runtime's
    and OpenVINO's int4 builds round: symmetric blocks of 128 cost pyref-1b's EAGLE-3 chain of
    4 a tenth of its acceptance (docs/decisions.md#kernels-zero-points); int8 blocks are
    symmetric (the kernels' int8 path has no zero points).
    """

    bits: int
    block: int
    symmetric: bool

    def packed(self, weight: np.ndarray) -> np.ndarray:
        """`weight` [n, k] rounded in blocks, in the kernels' layout."""
        quantized = quantize_rtn(weight.T, self.bits, self.block, symmetric=self.symmetric)
        codes = quantized.codes.reshape(weight.shape[0], -1)
        if self.bits == 8:  # the kernels' int8 paths take codes 1..255 (|q| <= 127)
            codes = np.maximum(codes, 1)
        return kernels.pack_codes(codes, quantized.scales, self.bits, quantized.zero_points)


class Cpu:
    """The target (and an EAGLE-3 head) in the kernels' layout; other drafts as ONNX Runtime's."""

    name = "cpu"
    runtime = "cpu"
    precisions: tuple[Precision, ...] = (INT4, INT8)
    options = frozenset(WEIGHT_OPTIONS)

    def build_name(self, options: BuildOptions) -> str:
        """`cpu-<precision>`."""
        return f"cpu-{options.precision}"

    def check(self, manifest: Manifest, options: BuildOptions, prompts: Sequence) -> None:
        """int4 / int8 of a Llama-form target, round to nearest, with the kernels built here."""
        check_precision(self, options.precision)
        config = options.weight_only
        if config is not None:
            _check_rounding(config)
        reason = kernels.unavailable()
        if reason is not None:
            raise BuildError(reason)
        if manifest.model.family not in ("llama",):
            raise refuse(manifest, f"is of family {manifest.model.family!r}")
        check_shapes(manifest)

    def build(self, job: BuildJob) -> BuildEntry:
        """target.bin + target.json (and an EAGLE-3 head's) for the kernels; other drafts ORT's."""
        bits = job.options.precision.bits
        job.progress("[cpu] reading the target's weights")
        weights = read_target(job.manifest)
        kept = kept_grids(job.manifest.source_grid, bits, OUTPUT_BITS)
        rounding = _rounding(job.options.weight_only, bits, weights, kept)
        head, projection, why = read_head(job.manifest)
        on_kernels = HEAD_GRAPHS if head is not None else ()
        graphs: dict[str, GraphEntry] = {}
        drafts = None
        if set(job.manifest.graphs) - {"target", *on_kernels}:
            job.progress(f"[cpu] the draft graphs, on ONNX Runtime ({why})")
            config = WeightOnlyConfig(bits=bits)
            options = dataclasses.replace(job.options, backend="ort", weight_only=config)
            drafts = build_drafts(dataclasses.replace(job, options=options), skip=on_kernels)
            graphs = {n: dataclasses.replace(e, runtime="ort") for n, e in drafts.graphs.items()}
        graphs["target"] = self._write(job, "target", weights, rounding, kept)
        details: dict[str, object] = {
            "bits": bits,
            "block": rounding.block,
            "symmetric": rounding.symmetric,
            "output_bits": OUTPUT_BITS,
        }
        if kept.linears or kept.output:  # the source file's codes, not rounded again
            source = job.manifest.source_grid
            assert source is not None  # kept_grids keeps none without one
            details["kept_grid"] = {"file": source.file, "linears": _grid_name(kept.linears),
                                    "output": _grid_name(kept.output)}  # fmt: skip
        if head is not None and projection is not None:
            job.progress("[cpu] the EAGLE-3 head, on the kernels")
            block = rounding.block if _blocks_of(head, rounding.block) else kernels.QBLOCK
            head_rounding = dataclasses.replace(rounding, block=block)
            graphs["draft_head"] = self._write(job, "draft_head", head, head_rounding)
            graphs["draft_projection"] = self._write_projection(job, projection, head_rounding)
            details["head_block"] = block
        if drafts is not None:
            details["drafts"] = drafts.quantization.to_json()
        return BuildEntry(
            self.runtime,
            job.options.precision.name,
            graphs=graphs,
            quantization=Quantization("all", details=details),
            onnxruntime_version=None if drafts is None else drafts.onnxruntime_version,
        )

    def _write(
        self,
        job: BuildJob,
        graph: str,
        weights: DecoderWeights,
        rounding: Rounding,
        kept: KeptGrids = NONE_KEPT,
    ) -> GraphEntry:
        """`<graph>.bin` + `<graph>.json`: the weights packed, the index and constants."""
        with _Writer(job, graph, weights.constants) as writer:
            writer.add("embed", weights.embed)
            writer.add("inv_freq", weights.inv_freq)
            for name, norm in weights.norms.items():
                writer.add(name, norm)
            total = len(weights.linears)
            output = dataclasses.replace(rounding, bits=OUTPUT_BITS, symmetric=True)
            for i, (name, weight) in enumerate(weights.linears.items()):
                if name == "lm_head":
                    writer.add_linear(name, weight, output, kept.output)
                else:
                    writer.add_linear(name, weight, rounding, kept.linears)
                if i % 8 == 7 or i == total - 1:
                    job.progress(f"[cpu] {graph}: packed {i + 1}/{total} weights")
        return writer.entry

    def _write_projection(
        self, job: BuildJob, weight: np.ndarray, rounding: Rounding
    ) -> GraphEntry:
        with _Writer(job, "draft_projection", {}) as writer:
            writer.add_linear("projection", weight, rounding)
        return writer.entry


def _check_rounding(config: WeightOnlyConfig) -> None:
    """Refuses weight-only settings the kernels do not take, naming them."""
    defaults = WeightOnlyConfig(bits=config.bits)
    fixed = dataclasses.replace(config, block_size=None, symmetric=defaults.symmetric)
    if fixed != defaults:
        raise BuildError(
            "--backend cpu rounds to nearest (lm_head at 8 bits): of the weight-only settings "
            "it takes --block-size and --symmetric/--asymmetric only"
        )
    if config.block_size is not None and config.block_size not in kernels.BLOCKS:
        raise BuildError(
            f"--backend cpu takes --block-size {', '.join(map(str, kernels.BLOCKS))}; "
            f"got {config.block_size}"
        )
    if config.bits == 8 and not config.symmetric:
        raise BuildError("--backend cpu rounds int8 symmetrically: drop --asymmetric")


def _rounding(
    config: WeightOnlyConfig | None, bits: int, weights: DecoderWeights, kept: KeptGrids
) -> Rounding:
    """The layer MatMuls' rounding: the kept grid's, else the settings' over the defaults."""
    if kept.linears is not None:
        return Rounding(bits, kept.linears.block, symmetric=True)
    block = config.block_size if config and config.block_size else block_size(weights)
    if not _blocks_of(weights, block):
        raise BuildError(f"--block-size {block}: not every MatMul's inputs are whole blocks")
    symmetric = config.symmetric if config is not None else bits == 8
    return Rounding(bits, block, bool(symmetric))


def _grid_name(grid: Grid | None) -> str | None:
    return None if grid is None else grid.name


BACKEND = Cpu()
