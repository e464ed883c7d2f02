"""The manifest's sections as frozen, typed values, which the library reads and writes.

`specx.artifact.load_manifest` builds them once, after `specx.artifact_schema` has checked
every field they read, so `from_json` only converts (lists to tuples, absent optional
fields to their defaults) and cannot fail on a manifest that loaded.

Calibration entries are the exception. `specx calibrate` writes them and nothing checks
them at load: a stale or hand-broken entry must not keep the artifact from loading, nor
from being calibrated again. `CalibrationEntry.from_json` checks what it reads when the
entry is used, and names the entry.

Writers (export, build, calibrate) build these values and write them with `to_json`, the
inverse of `from_json`: `X.from_json(x.to_json()) == x`, and a section as a writer wrote it
reads back and writes out unchanged (older forms, e.g. an entry without its sampling
setting, are written in the current one). Optional fields at their defaults are left out,
as the writers always left them. What only people and reports read stays a JSON mapping in
the value that records it: a build's quantization `details` (their keys differ by backend),
the drafter's `source`, a calibration's `report`.

Standard library only: the runtime imports this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from specx.errors import ArtifactError

__all__ = [
    "BuildChoice",
    "BuildEntry",
    "BuildTiming",
    "CalibratedSampling",
    "CalibrationEntry",
    "CandidateTiming",
    "DecoderSpec",
    "DrafterSpec",
    "DynamicChoice",
    "GraphEntry",
    "GreedyIdentity",
    "ModelSpec",
    "SourceGrid",
    "Quantization",
    "ShapeMeasures",
    "TapSpec",
    "TensorSpec",
    "TreeChoice",
    "VerifyShape",
]

Json = Mapping[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class TapSpec:
    """The target's hidden states returned beside its logits, which draft heads read."""

    kind: str  # "none", "last" (the final layer) or "eagle3" (three layers, concatenated)
    width: int  # W of the taps output [B, N, W]
    layers: tuple[int, ...]  # the layers whose inputs are captured

    @classmethod
    def from_json(cls, data: Json) -> TapSpec:  # noqa: D102
        return cls(data["kind"], data["width"], tuple(data["layers"]))

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {"kind": self.kind, "width": self.width, "layers": list(self.layers)}


@dataclass(frozen=True)
class ModelSpec:
    """The exported target's shapes, which caches, checks and builds are sized by."""

    vocab_size: int  # V: logits are [B, N, V]
    hidden_size: int  # d
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_capacity: int  # cache slots per sequence: prompt, output and draft scratch
    max_tree_tokens: int  # most tokens one verify forward takes (root + draft)
    eos_token_ids: tuple[int, ...]
    taps: TapSpec
    # What the export records for people (no code reads them); None where not recorded.
    family: str | None = None  # the checkpoint's architecture family, e.g. "llama"
    kv_dtype: str | None = None  # the caches' numpy dtype
    bos_token_id: int | None = None  # None also when the checkpoint has none

    @classmethod
    def from_json(cls, data: Json) -> ModelSpec:  # noqa: D102
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            num_layers=data["num_layers"],
            num_heads=data["num_heads"],
            num_kv_heads=data["num_kv_heads"],
            head_dim=data["head_dim"],
            kv_capacity=data["kv_capacity"],
            max_tree_tokens=data["max_tree_tokens"],
            eos_token_ids=tuple(data["eos_token_ids"]),
            taps=TapSpec.from_json(data["taps"]),
            family=data.get("family"),
            kv_dtype=data.get("kv_dtype"),
            bos_token_id=data.get("bos_token_id"),
        )

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {
            **dataclasses.asdict(self),
            "eos_token_ids": list(self.eos_token_ids),
            "taps": self.taps.to_json(),
        }


@dataclass(frozen=True)
class SourceGrid:
    """The quantization grid a quantized source file's weights are on (`specx.export.gguf`).

    A build at the matching width keeps those codes and scales rather than rounding the
    de-quantized weights again (`specx.builders.grid`).
    """

    format: str  # "gguf"
    file: str  # the source file's name
    linears: str | None  # every layer MatMul's tensor type (e.g. "Q4_0"); None when mixed
    output: str | None  # the output projection's type; None when tied to the embeddings

    @classmethod
    def from_json(cls, data: Json) -> SourceGrid:  # noqa: D102
        return cls(data["format"], data["file"], data.get("linears"), data.get("output"))

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a graph, as `specx.graphs.signature` records it."""

    name: str
    dtype: str  # numpy's name: "float32", "int64", "bool"
    shape: tuple[int | str, ...]  # fixed sizes, or dynamic dims by name ("batch", "kv_len")

    @classmethod
    def from_json(cls, data: Json) -> TensorSpec:  # noqa: D102
        return cls(data["name"], data["dtype"], tuple(data["shape"]))

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class DecoderSpec:
    """A draft head's own decoder shapes (its cache and outputs are not the target's)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int  # width of its `hidden` output, the features it feeds itself
    vocab_size: int  # its logits' width: a draft vocabulary may be smaller (EAGLE-3 d2t)

    @classmethod
    def from_json(cls, data: Json) -> DecoderSpec:  # noqa: D102
        return cls(
            data["num_layers"],
            data["num_kv_heads"],
            data["head_dim"],
            data["hidden_size"],
            data["vocab_size"],
        )

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class GraphEntry:
    """One graph of the export or of a build: its files and IO signature."""

    file: str  # relative to the artifact
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    data_files: tuple[str, ...] = ()  # external weights
    opset: int | None = None  # the default domain's, recorded by the export (builds do not)
    engine: str | None = None  # a TensorRT build's serialized engine
    engine_sha256: str | None = None  # recorded when it was built
    profiles: tuple[str, ...] = ()  # the engine's optimization profiles, in engine order
    kv_spare_slots: int = 0  # cache rows past the capacity a row-invariant graph writes
    decoder: DecoderSpec | None = None  # a draft head's shapes (the target's: ModelSpec)
    ort_only: bool = False  # ONNX Runtime only (the draft chain's Loop): TensorRT skips it
    runtime: str | None = None  # its opener, where not the build's (OpenVINO builds' drafts)

    @classmethod
    def from_json(cls, data: Json) -> GraphEntry:  # noqa: D102
        decoder = data.get("decoder")
        return cls(
            file=data["file"],
            inputs=tuple(TensorSpec.from_json(v) for v in data["inputs"]),
            outputs=tuple(TensorSpec.from_json(v) for v in data["outputs"]),
            data_files=tuple(data.get("data_files", ())),
            opset=data.get("opset"),
            engine=data.get("engine"),
            engine_sha256=data.get("engine_sha256"),
            profiles=tuple(data.get("profiles", ())),
            kv_spare_slots=data.get("kv_spare_slots", 0),
            decoder=None if decoder is None else DecoderSpec.from_json(decoder),
            ort_only=data.get("ort_only", False),
            runtime=data.get("runtime"),
        )

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {
            "file": self.file,
            "inputs": [v.to_json() for v in self.inputs],
            "outputs": [v.to_json() for v in self.outputs],
            "data_files": list(self.data_files),
        } | _present(
            opset=self.opset,
            engine=self.engine,
            engine_sha256=self.engine_sha256,
            profiles=list(self.profiles) or None,
            kv_spare_slots=self.kv_spare_slots or None,
            decoder=None if self.decoder is None else self.decoder.to_json(),
            ort_only=self.ort_only or None,
            runtime=self.runtime,
        )


# What of greedy speculation a build keeps identical to its own plain decoding: "all" (a
# float build), "chains" (rows invariant: chains as they are, trees through their spine,
# `specx.runtime.spine`) or "none" (`specx generate` warns for any drafter).
GreedyIdentity = Literal["all", "chains", "none"]
_QUANTIZATION_FIELDS = ("greedy_identity", "padding_row", "activation_group")


@dataclass(frozen=True)
class Quantization:
    """A build's quantization: the fields the runtime and the builds decide by, typed.

    `details` is the rest of the backend's record, which only people and reports read: a
    weight-only configuration and its MatMul counts per graph, a static INT8 accuracy
    report, an OpenVINO build's weight form and its draft graphs' record (`drafts`). The
    JSON is one object, the typed fields beside the details, as the builds always wrote it.
    A float build's is empty.
    """

    greedy_identity: GreedyIdentity = "all"  # left out of the JSON at "all", as builds leave it
    # An ONNX Runtime target with int8-compute MatMulNBits (accuracy level 4): True where its
    # whole graph runs a padding row (`PadRowPass`), False where its attention alone pads.
    # None: no such target.
    padding_row: bool | None = None
    # OpenVINO: the group a compressed MatMul's activations are quantized over to int8
    # (`specx.runtime.targets.openvino` compiles with it). None: uncompressed, the plugin's default.
    activation_group: int | None = None
    details: Json = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Json) -> Quantization:  # noqa: D102
        return cls(
            greedy_identity=data.get("greedy_identity") or "all",  # null: absent, as checked
            padding_row=data.get("padding_row"),
            activation_group=data.get("activation_group"),
            details=_rest(data, _QUANTIZATION_FIELDS),
        )

    def to_json(self) -> dict[str, Any]:
        """The record as the builds write it ({} for a float build)."""
        identity = None if self.greedy_identity == "all" else self.greedy_identity
        return {**self.details} | _present(
            greedy_identity=identity,
            padding_row=self.padding_row,
            activation_group=self.activation_group,
        )

    def with_details(self, **details: Any) -> Quantization:
        """This record with `details` added (replacing any of the same name)."""
        return dataclasses.replace(self, details={**self.details, **details})


@dataclass(frozen=True)
class BuildEntry:
    """One `specx build` result: the runtime that opens it and its graphs."""

    backend: str  # the opener in `specx.runtime.targets.OPENERS`
    precision: str
    directory: str | None = None  # builds/<name>.<id>; None: it reuses the exported files
    graphs: Mapping[str, GraphEntry] = field(default_factory=dict)
    quantization: Quantization = field(default_factory=Quantization)  # empty: a float build
    onnxruntime_version: str | None = None  # an ONNX Runtime build's, for reports
    lowering: Mapping[str, str] = field(default_factory=dict)  # graph -> "gqa" where lowered
    tensorrt_version: str | None = None  # a TensorRT build's: what its engines need here
    compute_capability: str | None = None
    gpu: str | None = None

    def engine_mismatches(
        self, tensorrt_version: str | None, compute_capability: str | None
    ) -> list[str]:
        """Reasons this TensorRT build cannot run with this TensorRT and GPU (empty: it can).

        A serialized engine runs only on the TensorRT version that built it (major.minor)
        and on a GPU of the same compute capability; `specx verify`, `specx publish` and the
        TensorRT backend refuse a mismatch with these messages instead of failing inside
        TensorRT. `None` for either means "unknown here" and that check is skipped.
        """
        problems = []
        built_with = self.tensorrt_version
        if tensorrt_version is not None and built_with is not None:
            if built_with.split(".")[:2] != tensorrt_version.split(".")[:2]:
                problems.append(
                    f"engines were built with TensorRT {built_with}, this is TensorRT "
                    f"{tensorrt_version}: rebuild them with `specx build --backend trt`"
                )
        built_for = self.compute_capability
        if compute_capability is not None and built_for is not None:
            if built_for != compute_capability:
                problems.append(
                    f"engines were built for GPU compute capability {built_for} "
                    f"({self.gpu or 'unknown GPU'}), this GPU is {compute_capability}"
                )
        return problems

    @classmethod
    def from_json(cls, data: Json) -> BuildEntry:  # noqa: D102
        return cls(
            backend=data["backend"],
            precision=data["precision"],
            directory=data.get("directory"),
            graphs={name: GraphEntry.from_json(g) for name, g in data["graphs"].items()},
            quantization=Quantization.from_json(data.get("quantization") or {}),
            onnxruntime_version=data.get("onnxruntime_version"),
            lowering=data.get("lowering") or {},
            tensorrt_version=data.get("tensorrt_version"),
            compute_capability=data.get("compute_capability"),
            gpu=data.get("gpu"),
        )

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {
            "backend": self.backend,
            "precision": self.precision,
            "directory": self.directory,  # null, not absent: the build has no files of its own
            "graphs": {name: g.to_json() for name, g in self.graphs.items()},
        } | _present(
            quantization=self.quantization.to_json() or None,
            onnxruntime_version=self.onnxruntime_version,
            lowering=dict(self.lowering) or None,
            tensorrt_version=self.tensorrt_version,
            compute_capability=self.compute_capability,
            gpu=self.gpu,
        )


@dataclass(frozen=True)
class DrafterSpec:
    """The draft head exported with the target (`specx export --drafter`)."""

    kind: str  # eagle3 | eagle | mtp | medusa
    graph: str  # its graph ("draft_head")
    taps: str  # the target taps it reads (`TapSpec.kind`)
    medusa_heads: int | None = None  # Medusa: the number of heads, the deepest tree + 1
    projection: str | None = None  # EAGLE-3: the graph projecting taps to features
    d2t: str | None = None  # a .npy of draft id -> target id offsets (a smaller draft vocab)
    source: Json = field(default_factory=dict)  # for people: its spec, directory, weight sha256s

    @classmethod
    def from_json(cls, data: Json) -> DrafterSpec:  # noqa: D102
        return cls(
            kind=data["kind"],
            graph=data["graph"],
            taps=data["taps"],
            medusa_heads=data.get("medusa_heads"),
            projection=data.get("projection"),
            d2t=data.get("d2t"),
            source=data.get("source") or {},
        )

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {"kind": self.kind, "graph": self.graph, "taps": self.taps} | _present(
            medusa_heads=self.medusa_heads,
            projection=self.projection,
            d2t=self.d2t,
            source=dict(self.source) or None,
        )


@dataclass(frozen=True)
class DynamicChoice:
    """EAGLE-2's tree parameters, in EAGLE's meaning (`specx.runtime.tree_shapes.DynamicTree`)."""

    total_token: int  # draft nodes + 1 (it counts the root)
    depth: int  # expansions after the root's children
    top_k: int

    @classmethod
    def from_json(cls, data: Json) -> DynamicChoice:
        """Also reads entries recorded as nodes and levels (`DynamicTree.of_nodes`)."""
        if "total_tokens" in data:
            return cls(int(data["total_tokens"]) + 1, int(data["depth"]) - 1, int(data["top_k"]))
        return cls(int(data["total_token"]), int(data["depth"]), int(data["top_k"]))

    def to_json(self) -> dict[str, Any]:
        """In EAGLE's meaning, whichever form it was read from."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class CandidateTiming:
    """One shape calibration timed: what the cost model predicted of it, what it measured."""

    label: str
    model_speedup: float
    measured_speedup: float

    @classmethod
    def from_json(cls, data: Json) -> CandidateTiming:  # noqa: D102
        speedups = (_number(data, "model_speedup"), _number(data, "measured_speedup"))
        return cls(str(data["label"]), *speedups)

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return dataclasses.asdict(self)


_MEASURES = ("depth", "expected_accepted", "model_speedup", "measured_speedup", "candidates")


@dataclass(frozen=True)
class ShapeMeasures:
    """What calibration recorded of a shape besides the shape, for people and reports.

    None where not recorded: a budget records its measured speedup alone, a candidate has
    none until it is timed, and entries of older calibrations lack some. The chosen shape
    lists every candidate timed.
    """

    depth: int | None = None  # the tree's depth, a chain's length
    expected_accepted: float | None = None  # draft tokens a round accepts, by the cost model
    model_speedup: float | None = None  # the cost model's prediction
    measured_speedup: float | None = None  # over plain decoding, on the calibration prompts
    candidates: tuple[CandidateTiming, ...] = ()
    other: Json = field(default_factory=dict)  # what other versions recorded besides: kept

    @classmethod
    def from_json(cls, data: Json) -> ShapeMeasures:
        """Raises ValueError naming a measure that is no number; KeyError, a candidate's gap."""
        return cls(
            depth=_optional_number(data, "depth", integer=True),
            expected_accepted=_optional_number(data, "expected_accepted"),
            model_speedup=_optional_number(data, "model_speedup"),
            measured_speedup=_optional_number(data, "measured_speedup"),
            candidates=tuple(map(CandidateTiming.from_json, data.get("candidates", ()))),
            other=_rest(data, _MEASURES),
        )

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {**self.other} | _present(
            depth=self.depth,
            expected_accepted=self.expected_accepted,
            model_speedup=self.model_speedup,
            measured_speedup=self.measured_speedup,
            candidates=[c.to_json() for c in self.candidates] or None,
        )


_NOT_CHAINS = ("static", "dynamic", "budget")


@dataclass(frozen=True)
class TreeChoice:
    """A calibration's draft shape: the one chosen, or a candidate it measured.

    `tree` says which field describes it: "static" `choices`, "dynamic" `dynamic`, "budget"
    `nodes` (a drafter that sizes its own trees), anything else a chain of `chain_length`.
    """

    label: str  # what `specx generate` reports, e.g. "static 7 nodes, depth 3"
    tree: str
    choices: tuple[tuple[int, ...], ...] = ()  # Medusa-style rank paths
    dynamic: DynamicChoice | None = None
    nodes: int = 0  # its draft nodes; all a budget records (0: not recorded)
    chain_length: int = 0
    measured: ShapeMeasures = field(default_factory=ShapeMeasures)

    @classmethod
    def from_json(cls, data: Json) -> TreeChoice:
        """The shape's own fields; the rest of `data` becomes `measured`.

        Raises KeyError, TypeError or ValueError if a field of the shape or a measured
        number is absent or malformed.
        """
        tree = str(data["tree"])
        choice = cls(
            str(data["label"]),
            tree,
            choices=tuple(tuple(map(int, c)) for c in data["choices"]) if tree == "static" else (),
            dynamic=DynamicChoice.from_json(data["dynamic"]) if tree == "dynamic" else None,
            nodes=int(data["nodes"] if tree == "budget" else data.get("nodes", 0)),
            chain_length=0 if tree in _NOT_CHAINS else int(data["chain_length"]),
        )
        measured = ShapeMeasures.from_json(_rest(data, choice._shape_json()))
        return dataclasses.replace(choice, measured=measured)

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {**self.measured.to_json(), **self._shape_json()}

    def _shape_json(self) -> dict[str, Any]:
        """The label and the fields `tree` says describe the shape."""
        out: dict[str, Any] = {"label": self.label, "tree": self.tree}
        if self.tree == "static":
            out["choices"] = [list(c) for c in self.choices]
        elif self.tree == "dynamic":
            out["dynamic"] = None if self.dynamic is None else self.dynamic.to_json()
        elif self.tree != "budget":
            out["chain_length"] = self.chain_length
        if self.nodes or self.tree == "budget":
            out["nodes"] = self.nodes
        return out


@dataclass(frozen=True)
class CalibratedSampling:
    """The sampling setting a calibration measured at (greedy: temperature 0)."""

    temperature: float = 0.0
    top_p: float = 1.0

    @classmethod
    def from_json(cls, data: Json) -> CalibratedSampling:  # noqa: D102
        return cls(float(data["temperature"]), float(data["top_p"]))

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class VerifyShape:
    """A build's verify forward of n tokens per row relative to its one-token step.

    t(n) / t(1) at batch 1, as `specx calibrate` measured it on `build`: what a controller
    prices a width it has not timed by (ONNX Runtime's int4 build grows ~17% a token on a
    2-core CPU, OpenVINO's ~3%; docs/decisions.md#ov-backend).
    """

    build: str
    tokens: tuple[int, ...]  # widths measured, ascending, the first 1
    relative: tuple[float, ...]  # t(n) / t(1) at each

    @classmethod
    def from_json(cls, data: Json) -> VerifyShape:  # noqa: D102
        shape = cls(
            str(data["build"]), tuple(map(int, data["tokens"])), tuple(map(float, data["relative"]))
        )
        if len(shape.tokens) != len(shape.relative) or shape.tokens[:1] != (1,):
            raise ValueError(f"tokens {shape.tokens} must start at 1, one relative time each")
        return shape

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {"build": self.build, "tokens": list(self.tokens), "relative": list(self.relative)}

    def __call__(self, width: int) -> float:
        """t(width) / t(1): interpolated, and past the widest measured on its last slope."""
        tokens, relative = self.tokens, self.relative
        if width >= tokens[-1]:
            slope = 0.0
            if len(tokens) > 1:
                slope = (relative[-1] - relative[-2]) / (tokens[-1] - tokens[-2])
            return relative[-1] + slope * (width - tokens[-1])
        upper = next(i for i, n in enumerate(tokens) if n > width)
        low, high = tokens[upper - 1], tokens[upper]
        share = (width - low) / (high - low)
        return relative[upper - 1] + share * (relative[upper] - relative[upper - 1])


_ENTRY_FIELDS = (
    "choice", "max_batch_spec", "expected_speedup", "sampling", "verify_shape", "skipped_layers"
)  # fmt: skip


@dataclass(frozen=True)
class CalibrationEntry:
    """What `specx calibrate` recorded for a drafter at one sampling setting."""

    choice: TreeChoice
    max_batch_spec: int  # the largest batch speculation pays at; 0: it never does
    expected_speedup: float  # measured on the calibration prompts; 1.0 when off
    sampling: CalibratedSampling  # greedy for entries recorded before settings were
    # The measurements behind the choice, for people and reports: the drafter spec, how and
    # where it was measured, acceptance, costs, the trees and chains ranked, batch curve.
    report: Json = field(default_factory=dict)
    verify_shape: VerifyShape | None = None  # None: recorded before calibrate measured it
    skipped_layers: tuple[int, ...] = ()  # `skip`'s chosen layers (its entry only)

    @property
    def measured_build(self) -> str | None:
        """The build the entry was measured on (`report.measured_on.build`; None: unrecorded)."""
        measured_on = self.report.get("measured_on")
        return measured_on.get("build") if isinstance(measured_on, Mapping) else None

    @classmethod
    def from_json(cls, where: str, data: Any) -> CalibrationEntry:
        """Checks the entry while reading it (nothing did at load).

        Raises:
            ArtifactError: naming `where` (the manifest and `calibration.<key>`) and the
                problem, and telling to calibrate again.
        """
        sampling = _checked(f"{where}.sampling", CalibratedSampling.from_json, _sampling(data))
        return _checked(
            where,
            lambda d: cls(
                TreeChoice.from_json(d["choice"]),
                int(d["max_batch_spec"]),
                float(d["expected_speedup"]),
                sampling,
                _rest(d, _ENTRY_FIELDS),  # `d` is an object once the fields above read
                VerifyShape.from_json(d["verify_shape"]) if "verify_shape" in d else None,
                tuple(int(i) for i in d.get("skipped_layers", ())),
            ),
            data,
        )

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {
            **self.report,
            "choice": self.choice.to_json(),
            "max_batch_spec": self.max_batch_spec,
            "expected_speedup": self.expected_speedup,
            "sampling": self.sampling.to_json(),
            **_present(
                verify_shape=self.verify_shape and self.verify_shape.to_json(),
                skipped_layers=list(self.skipped_layers) or None,
            ),
        }


@dataclass(frozen=True)
class BuildTiming:
    """One build as `specx build --backend auto` measured it on the machine that built it.

    Milliseconds at batch 1 over `BuildChoice.context` cached tokens; `decode_ms_per_token`
    is the decode rate predicted from them for `BuildChoice.basis`. `batch_step_ms`: a plain
    step of B sequences at once, by B, for a server's load (empty in older records).
    """

    build: str
    step_ms: float  # a plain decode step
    verify_ms: tuple[float, ...]  # t(n) for n = 1, 2, ...: a verify of n tokens
    draft_step_ms: float | None  # one step of the artifact's head (None: it has none)
    ttft_ms: float  # the prompt's forward
    decode_ms_per_token: float
    batch_step_ms: Mapping[int, float] = field(default_factory=dict)  # rows -> ms a step

    @classmethod
    def from_json(cls, data: Json) -> BuildTiming:  # noqa: D102
        draft = data.get("draft_step_ms")
        return cls(
            str(data["build"]),
            float(data["step_ms"]),
            tuple(map(float, data["verify_ms"])),
            None if draft is None else float(draft),
            float(data["ttft_ms"]),
            float(data["decode_ms_per_token"]),
            {int(b): float(ms) for b, ms in data.get("batch_step_ms", {}).items()},
        )

    def ms_per_token_at(self, rows: int) -> float:
        """Decode ms per token with `rows` sequences running.

        One row: the predicted batch-1 rate; more: the plain step of the largest timed batch
        up to `rows` (the smallest where none is) over its rows.
        """
        if rows <= 1 or not self.batch_step_ms:
            return self.decode_ms_per_token
        batch = max((b for b in self.batch_step_ms if b <= rows), default=min(self.batch_step_ms))
        return self.batch_step_ms[batch] / batch

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {
            "build": self.build,
            "step_ms": self.step_ms,
            "verify_ms": list(self.verify_ms),
            **_present(draft_step_ms=self.draft_step_ms),
            "ttft_ms": self.ttft_ms,
            "decode_ms_per_token": self.decode_ms_per_token,
            **({"batch_step_ms": {str(b): ms for b, ms in self.batch_step_ms.items()}}
               if self.batch_step_ms else {}),
        }  # fmt: skip


@dataclass(frozen=True)
class BuildChoice:
    """Which build `specx build --backend auto` made the default, and the timings why.

    Checked when read, as calibration entries are: a broken record costs the stats their
    reason, never the artifact its loading.
    """

    picked: str
    basis: str  # what the predicted rate is of: "plain decoding" or "a head's chain of K"
    context: int  # cached tokens the forwards were timed over
    timings: tuple[BuildTiming, ...]

    @classmethod
    def from_json(cls, where: str, data: Any) -> BuildChoice:
        """Raises ArtifactError naming `where` and the problem."""
        try:
            return cls(
                str(data["picked"]),
                str(data["basis"]),
                int(data["context"]),
                tuple(BuildTiming.from_json(t) for t in data["timings"]),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ArtifactError(
                f"{where} is malformed ({e!r}); run specx build --backend auto again"
            ) from e

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {
            "picked": self.picked,
            "basis": self.basis,
            "context": self.context,
            "timings": [t.to_json() for t in self.timings],
        }

    @property
    def reason(self) -> str:
        """One line: the measured rates the choice rests on, the picked build first."""
        ranked = sorted(self.timings, key=lambda t: t.decode_ms_per_token)
        rates = ", ".join(f"{t.build} {t.decode_ms_per_token:.1f}" for t in ranked)
        return f"fastest measured here for {self.basis} (decode ms/token: {rates})"

    def for_load(self, rows: int) -> tuple[str, str]:
        """The build fastest per token with `rows` sequences decoding together, and why.

        One row, or a record without batch timings: the picked build and `reason`.
        """
        if rows <= 1 or not all(t.batch_step_ms for t in self.timings):
            return self.picked, self.reason
        ranked = sorted(self.timings, key=lambda t: t.ms_per_token_at(rows))
        rates = ", ".join(f"{t.build} {t.ms_per_token_at(rows):.2f}" for t in ranked)
        return ranked[0].build, f"fastest measured here at {rows} rows (plain ms/token: {rates})"


def _present(**fields: Any) -> dict[str, Any]:
    """The optional fields given (None: at its default, left out of the JSON)."""
    return {name: value for name, value in fields.items() if value is not None}


def _rest(data: Json, typed: Iterable[str]) -> dict[str, Any]:
    """The fields of `data` besides `typed`: kept, so that a value writes back what it read."""
    typed = set(typed)
    return {name: value for name, value in data.items() if name not in typed}


def _number(data: Json, key: str, integer: bool = False) -> Any:
    """`data[key]` as recorded: a JSON number (an integer where `integer`), else ValueError."""
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        expected = "an integer" if integer else "a number"
        raise ValueError(f"{key} must be {expected}, got {value!r:.60}")
    return value


def _optional_number(data: Json, key: str, integer: bool = False) -> Any:
    """`_number`, None where `data` has no `key`."""
    return _number(data, key, integer) if key in data else None


def _sampling(entry: Any) -> Any:
    """An entry's recorded setting: greedy when it has none (or is no object at all)."""
    recorded = entry.get("sampling") if isinstance(entry, dict) else None
    return recorded or {"temperature": 0.0, "top_p": 1.0}


def _checked(where: str, parse: Callable[[Any], T], data: Any) -> T:
    try:
        return parse(data)
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{where} is malformed ({e!r}); run specx calibrate again") from e
