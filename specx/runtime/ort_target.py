"""`OrtTarget`: the exported target graph on ONNX Runtime (CPU), caches bound in place."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from specx.artifact import Manifest
from specx.errors import ArtifactError, GenerationError
from specx.runtime.kv_cache import KVCache
from specx.runtime.masks import causal_mask

__all__ = ["OrtGraph", "OrtTarget", "StepOutput", "configure_threads", "open_session"]

_global_threads: int | None = None


def configure_threads(threads: int | None = None) -> int:
    """Creates ONNX Runtime's global thread pool once per process; returns its size.

    Every specx session shares this pool: draft and target sessions alternating on
    per-session spinning pools were measured about 2x slower per round.
    """
    global _global_threads
    wanted = threads or os.cpu_count() or 1
    if _global_threads is None:
        ort.set_global_thread_pool_sizes(wanted, 1)
        _global_threads = wanted
    return _global_threads


@dataclass(frozen=True)
class StepOutput:
    """What one decoder forward returns besides the in-place cache update."""

    logits: np.ndarray  # [B, N, V] float32
    taps: np.ndarray | None  # [B, N, W]: the target's taps, or a draft head's hidden output


class OrtGraph:
    """A stateless graph of the artifact (Medusa heads, a feature projection): one input."""

    def __init__(self, manifest: Manifest, graph: str, threads: int | None = None):
        self.session = open_session(manifest, graph, threads)
        self.input_name = self.session.get_inputs()[0].name

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The graph's first output for input `x`."""
        return self.session.run(None, {self.input_name: np.ascontiguousarray(x, np.float32)})[0]


def open_session(manifest: Manifest, graph: str, threads: int | None) -> ort.InferenceSession:
    """An ONNX Runtime CPU session for one of the artifact's graphs, on the global pool."""
    configure_threads(threads)
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    options.log_severity_level = 3  # TensorScatter warns when a buffer is copied, not an error
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    path = manifest.path(manifest.graph(graph)["file"])
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own untyped errors here
        raise ArtifactError(f"{path}: ONNX Runtime could not load the graph: {e}") from e


class OrtTarget:
    """Runs a decoder graph of an artifact: new tokens in, logits (and hidden states) out.

    `graph="target"` is the target; `"draft_head"` an autoregressive draft head (EAGLE,
    MTP), which also takes `features` and returns its `hidden` output as `taps`.
    Caches are numpy buffers wrapped as OrtValues and bound as both `past_*` and
    `present_*`, so ONNX Runtime's TensorScatter updates them in place.
    """

    def __init__(self, manifest: Manifest, threads: int | None = None, graph: str = "target"):
        self.manifest = manifest
        model = manifest.model
        self.capacity: int = model["kv_capacity"]
        self.max_tree_tokens: int = model["max_tree_tokens"]
        if graph == "target":
            self.num_layers: int = model["num_layers"]
            self.num_kv_heads: int = model["num_kv_heads"]
            self.head_dim: int = model["head_dim"]
            self.vocab_size: int = model["vocab_size"]
            self.taps: str = model["taps"]["kind"]
            self.tap_width: int = model["taps"]["width"]
            self._hidden_output, self._feature_input = "hidden_taps", None
        else:
            decoder = manifest.graph(graph)["decoder"]
            self.num_layers, self.num_kv_heads = decoder["num_layers"], decoder["num_kv_heads"]
            self.head_dim, self.vocab_size = decoder["head_dim"], decoder["vocab_size"]
            self.taps, self.tap_width = "hidden", decoder["hidden_size"]
            self._hidden_output, self._feature_input = "hidden", "features"
        self.has_taps = self.taps != "none"
        self.session = open_session(manifest, graph, threads)
        self._binding = self.session.io_binding()
        self._bound_cache: KVCache | None = None

    def allocate_cache(self, batch: int, capacity: int | None = None) -> KVCache:
        """A zeroed cache for `batch` sequences; capacity defaults to the artifact's."""
        capacity = capacity or self.capacity
        if capacity > self.capacity:
            raise GenerationError(
                f"a KV cache of {capacity} slots exceeds the artifact's capacity {self.capacity}"
            )
        return KVCache.allocate(self.num_layers, batch, self.num_kv_heads, capacity, self.head_dim)

    def _bind_cache(self, cache: KVCache) -> None:
        for i, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
            for kind, array in (("key", keys), ("value", values)):
                value = ort.OrtValue.ortvalue_from_numpy(array)
                self._binding.bind_ortvalue_input(f"past_{kind}_{i}", value)
                self._binding.bind_ortvalue_output(f"present_{kind}_{i}", value)
        self._bound_cache = cache

    def forward(
        self,
        cache: KVCache,
        input_ids: np.ndarray,  # [B, N] int64
        position_ids: np.ndarray,  # [B, N] int64
        attention_mask: np.ndarray,  # [B, 1, N, L] bool, L <= capacity
        write_pos: np.ndarray,  # [B] int64
        features: np.ndarray | None = None,  # [B, N, d] for draft heads
    ) -> StepOutput:
        """One forward over N new tokens per sequence, written at `write_pos` in `cache`.

        Does not change `cache.lengths`: the caller decides which new rows are kept.
        """
        batch, n = input_ids.shape
        if attention_mask.shape != (batch, 1, n, attention_mask.shape[3]):
            raise GenerationError(f"attention_mask shape {attention_mask.shape} != [B, 1, N, L]")
        if int(write_pos.max()) + n > cache.capacity or attention_mask.shape[3] > cache.capacity:
            raise GenerationError(
                f"writing {n} tokens at slot {int(write_pos.max())} overflows the KV cache "
                f"({cache.capacity} slots)"
            )
        if cache is not self._bound_cache:
            self._bind_cache(cache)
        binding = self._binding
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, dtype=bool))
        binding.bind_cpu_input("write_pos", np.ascontiguousarray(write_pos, dtype=np.int64))
        if self._feature_input is not None:
            if features is None:
                raise GenerationError("this draft-head graph needs `features` [B, N, d]")
            binding.bind_cpu_input(
                self._feature_input, np.ascontiguousarray(features, dtype=np.float32)
            )
        logits = self._bind_new_output("logits", (batch, n, self.vocab_size))
        taps = (
            self._bind_new_output(self._hidden_output, (batch, n, self.tap_width))
            if self.has_taps
            else None
        )
        self.session.run_with_iobinding(binding)
        return StepOutput(logits=logits, taps=taps)

    def feed(
        self,
        cache: KVCache,
        sequences: Sequence[Sequence[int]],
        starts: np.ndarray,  # [B] slot of each sequence's first token
        features: Sequence[np.ndarray] | None = None,  # per sequence [n_b, d], draft heads
    ) -> tuple[StepOutput, np.ndarray]:
        """Feeds each sequence as a causal chain at `starts[b]`, positions = slots.

        Rows are right-padded; padding lands past each sequence and no later mask shows
        it. Does not change `cache.lengths`.

        Returns:
            The output and each row's index of its last real token (0 for an empty row).
        """
        width = max(1, max(len(s) for s in sequences))
        ids = np.zeros((len(sequences), width), dtype=np.int64)
        for b, tokens in enumerate(sequences):
            ids[b, : len(tokens)] = tokens
        padded = None
        if features is not None:
            padded = np.zeros((len(sequences), width, self.tap_width), dtype=np.float32)
            for b, rows in enumerate(features):
                padded[b, : len(rows)] = rows
        starts = np.asarray(starts, dtype=np.int64)
        positions = starts[:, None] + np.arange(width)
        mask = causal_mask(starts, width, int(starts.max()) + width)
        output = self.forward(cache, ids, positions, mask, starts, padded)
        return output, np.array([max(len(s) - 1, 0) for s in sequences])

    def _bind_new_output(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        # A fresh array per run: callers keep earlier outputs while the next forward runs.
        array = np.empty(shape, dtype=np.float32)
        self._binding.bind_output(name, "cpu", 0, np.float32, list(shape), array.ctypes.data)
        return array
