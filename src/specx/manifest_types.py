"""The manifest's sections as frozen, typed values: what the library reads of an artifact.

`specx.artifact.load_manifest` builds them once, after `specx.artifact_schema` has checked
every field they read, so `from_json` only converts (lists to tuples, absent optional
fields to their defaults) and cannot fail on a manifest that loaded.

Calibration entries are the exception. `specx calibrate` writes them and nothing checks
them at load: a stale or hand-broken entry must not keep the artifact from loading, nor
from being calibrated again. `CalibrationEntry.from_json` checks what it reads when the
entry is used, and names the entry.

Writers (export, build, calibrate) still build JSON dicts: a build record holds whatever
its backend records besides these fields (versions, lowering, quantization details).

Standard library only: the runtime imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from specx.errors import ArtifactError

__all__ = [
    "BuildEntry",
    "CalibratedSampling",
    "CalibrationEntry",
    "DecoderSpec",
    "DrafterSpec",
    "DynamicChoice",
    "GraphEntry",
    "ModelSpec",
    "TapSpec",
    "TensorSpec",
    "TreeChoice",
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
        )


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a graph, as `specx.graphs.signature` records it."""

    name: str
    dtype: str  # numpy's name: "float32", "int64", "bool"
    shape: tuple[int | str, ...]  # fixed sizes, or dynamic dims by name ("batch", "kv_len")

    @classmethod
    def from_json(cls, data: Json) -> TensorSpec:  # noqa: D102
        return cls(data["name"], data["dtype"], tuple(data["shape"]))


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


@dataclass(frozen=True)
class GraphEntry:
    """One graph of the export or of a build: its files and IO signature."""

    file: str  # relative to the artifact
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    data_files: tuple[str, ...] = ()  # external weights
    engine: str | None = None  # a TensorRT build's serialized engine
    profiles: tuple[str, ...] = ()  # the engine's optimization profiles, in engine order
    kv_spare_slots: int = 0  # cache rows past the capacity a row-invariant graph writes
    decoder: DecoderSpec | None = None  # a draft head's shapes (the target's: ModelSpec)
    ort_only: bool = False  # ONNX Runtime only (the draft chain's Loop): TensorRT skips it

    @classmethod
    def from_json(cls, data: Json) -> GraphEntry:  # noqa: D102
        decoder = data.get("decoder")
        return cls(
            file=data["file"],
            inputs=tuple(TensorSpec.from_json(v) for v in data["inputs"]),
            outputs=tuple(TensorSpec.from_json(v) for v in data["outputs"]),
            data_files=tuple(data.get("data_files", ())),
            engine=data.get("engine"),
            profiles=tuple(data.get("profiles", ())),
            kv_spare_slots=data.get("kv_spare_slots", 0),
            decoder=None if decoder is None else DecoderSpec.from_json(decoder),
            ort_only=data.get("ort_only", False),
        )


@dataclass(frozen=True)
class BuildEntry:
    """One `specx build` result: the runtime that opens it and its graphs.

    `quantization` stays the backend's JSON record (a weight-only configuration, a static
    INT8 accuracy report: its keys differ by backend and only reports read them), except
    `greedy_identity`, which the runtime reads: what of greedy speculation the build keeps
    identical to its plain decoding ("all", "chains" or "none").
    """

    backend: str  # the opener in `specx.runtime.backends.OPENERS`
    precision: str
    directory: str | None = None  # builds/<name>.<id>; None: it reuses the exported files
    graphs: Mapping[str, GraphEntry] = field(default_factory=dict)
    quantization: Json = field(default_factory=dict)  # {} for a float build
    greedy_identity: str = "all"
    tensorrt_version: str | None = None  # a TensorRT build's: what its engines need here
    compute_capability: str | None = None
    gpu: str | None = None

    @classmethod
    def from_json(cls, data: Json) -> BuildEntry:  # noqa: D102
        quantization = data.get("quantization") or {}
        return cls(
            backend=data["backend"],
            precision=data["precision"],
            directory=data.get("directory"),
            graphs={name: GraphEntry.from_json(g) for name, g in data["graphs"].items()},
            quantization=quantization,
            greedy_identity=quantization.get("greedy_identity", "all"),
            tensorrt_version=data.get("tensorrt_version"),
            compute_capability=data.get("compute_capability"),
            gpu=data.get("gpu"),
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

    @classmethod
    def from_json(cls, data: Json) -> DrafterSpec:  # noqa: D102
        return cls(
            data["kind"],
            data["graph"],
            data["taps"],
            data.get("medusa_heads"),
            data.get("projection"),
            data.get("d2t"),
        )


@dataclass(frozen=True)
class DynamicChoice:
    """EAGLE-2's tree parameters, in EAGLE's meaning (`tree_search.DynamicTree`)."""

    total_token: int  # draft nodes + 1 (it counts the root)
    depth: int  # expansions after the root's children
    top_k: int

    @classmethod
    def from_json(cls, data: Json) -> DynamicChoice:
        """Also reads entries recorded as nodes and levels (`DynamicTree.of_nodes`)."""
        if "total_tokens" in data:
            return cls(int(data["total_tokens"]) + 1, int(data["depth"]) - 1, int(data["top_k"]))
        return cls(int(data["total_token"]), int(data["depth"]), int(data["top_k"]))


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
    nodes: int = 0  # a budget's node count (a shape's is its tree's size)
    chain_length: int = 0

    @classmethod
    def from_json(cls, data: Json) -> TreeChoice:
        """The shape's own fields only; raises KeyError, TypeError or ValueError if absent."""
        label, tree = str(data["label"]), str(data["tree"])
        if tree == "static":
            return cls(label, tree, choices=tuple(tuple(map(int, c)) for c in data["choices"]))
        if tree == "dynamic":
            return cls(label, tree, dynamic=DynamicChoice.from_json(data["dynamic"]))
        if tree == "budget":
            return cls(label, tree, nodes=int(data["nodes"]))
        return cls(label, tree, chain_length=int(data["chain_length"]))


@dataclass(frozen=True)
class CalibratedSampling:
    """The sampling setting a calibration measured at (greedy: temperature 0)."""

    temperature: float = 0.0
    top_p: float = 1.0

    @classmethod
    def from_json(cls, data: Json) -> CalibratedSampling:  # noqa: D102
        return cls(float(data["temperature"]), float(data["top_p"]))


@dataclass(frozen=True)
class CalibrationEntry:
    """What `specx calibrate` recorded for a drafter at one sampling setting."""

    choice: TreeChoice
    max_batch_spec: int  # the largest batch speculation pays at; 0: it never does
    expected_speedup: float  # measured on the calibration prompts; 1.0 when off
    sampling: CalibratedSampling  # greedy for entries recorded before settings were

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
            ),
            data,
        )


def _sampling(entry: Any) -> Any:
    """An entry's recorded setting: greedy when it has none (or is no object at all)."""
    recorded = entry.get("sampling") if isinstance(entry, dict) else None
    return recorded or {"temperature": 0.0, "top_p": 1.0}


def _checked(where: str, parse: Callable[[Any], T], data: Any) -> T:
    try:
        return parse(data)
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{where} is malformed ({e!r}); run specx calibrate again") from e
