"""`OrtTarget`: the exported target graph on ONNX Runtime (CPU), caches bound in place."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from specx.artifact import Manifest
from specx.errors import ArtifactError, GenerationError
from specx.runtime.kv_cache import KVCache
from specx.runtime.targets.base import DecoderBackend, StepOutput
from specx.sessions import configure_threads, load_session, session_options

__all__ = [
    "OrtGraph",
    "OrtTarget",
    "StepOutput",
    "configure_threads",
    "load_session",
    "open_session",
    "session_options",
]


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
    path = manifest.path(manifest.runtime_graph(graph).file)
    try:
        return load_session(path, threads)
    except Exception as e:  # onnxruntime raises its own untyped errors here
        raise ArtifactError(f"{path}: ONNX Runtime could not load the graph: {e}") from e


class OrtTarget(DecoderBackend):
    """Runs a decoder graph of an artifact: new tokens in, logits (and hidden states) out.

    `graph="target"` is the target; `"draft_head"` an autoregressive draft head (EAGLE,
    MTP), which also takes `features` and returns its `hidden` output as `taps`.
    Caches are numpy buffers wrapped as OrtValues and bound as both `past_*` and
    `present_*`, so ONNX Runtime's TensorScatter updates them in place.
    """

    def __init__(self, manifest: Manifest, threads: int | None = None, graph: str = "target"):
        super().__init__(manifest, graph)
        self.session = open_session(manifest, graph, threads)
        self._binding = self.session.io_binding()
        self._bound_cache: KVCache | None = None
        self._step: _DecodeStep | None = None
        # A row-invariant GroupQueryAttention graph reads one padding slot past its writes.
        self._spare_slots = manifest.runtime_graph(graph).kv_spare_slots

    def allocate_cache(self, batch: int, capacity: int | None = None) -> KVCache:
        """A zeroed cache for `batch` sequences; capacity defaults to the artifact's."""
        capacity = self.checked_capacity(capacity)
        return KVCache.allocate(
            self.num_layers,
            batch,
            self.num_kv_heads,
            capacity,
            self.head_dim,
            self.cache_dtype,
            self._spare_slots,
        )

    def _bind_cache(self, cache: KVCache) -> None:
        _bind_cache(self._binding, cache)
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
        self.check_step(cache, input_ids, attention_mask, write_pos)
        batch, n = input_ids.shape
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

    def _bind_new_output(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        # A fresh array per run: callers keep earlier outputs while the next forward runs.
        array = np.empty(shape, dtype=np.float32)
        _bind_array(self._binding, name, array, output=True)
        return array

    def decode_step(
        self, cache: KVCache, tokens: np.ndarray, write_pos: np.ndarray | None = None
    ) -> StepOutput:
        """`DecoderBackend.decode_step` on buffers bound once per cache (its own IOBinding).

        Plain decoding is one small run per token, so what surrounds the run counts: through
        `forward` (fresh inputs and outputs bound, mask built, shapes checked) a pyref-7m
        step spends markedly more time in Python than here
        (docs/decisions.md#decode-step-bound-buffers). A step writes the tokens, positions
        and mask into bound arrays and rebinds only the mask, whose width grows; the
        returned logits (and taps) are overwritten by the next step.
        """
        step = self._step
        if step is None or step.cache is not cache:
            step = self._step = _DecodeStep.bind(self, cache)
        np.copyto(step.write_pos, cache.lengths if write_pos is None else write_pos)
        step.input_ids[:, 0] = tokens
        step.position_ids[:, 0] = step.write_pos
        width = int(step.write_pos.max()) + 1
        if width > cache.capacity:
            raise GenerationError(
                f"writing at slot {width - 1} overflows the KV cache ({cache.capacity} slots)"
            )
        mask = step.mask[: cache.batch * width].reshape(cache.batch, 1, 1, width)
        np.less_equal(step.slots[:width], step.write_pos[:, None, None, None], out=mask)
        step.binding.bind_cpu_input("attention_mask", mask)
        self.session.run_with_iobinding(step.binding)
        return StepOutput(logits=step.logits, taps=step.taps)


def _bind_cache(binding: ort.IOBinding, cache: KVCache) -> None:
    """Binds each layer's buffers as both past and present, so the graph writes in place."""
    for i, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
        for kind, array in (("key", keys), ("value", values)):
            value = ort.OrtValue.ortvalue_from_numpy(array)
            binding.bind_ortvalue_input(f"past_{kind}_{i}", value)
            binding.bind_ortvalue_output(f"present_{kind}_{i}", value)


def _bind_array(binding: ort.IOBinding, name: str, array: np.ndarray, output: bool = False):
    """Binds `array`'s memory (it must outlive the binding, or be rebound first)."""
    bind = binding.bind_output if output else binding.bind_input
    bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


@dataclass
class _DecodeStep:
    """`OrtTarget.decode_step`'s binding and the arrays bound to it, for one cache."""

    cache: KVCache
    binding: ort.IOBinding
    input_ids: np.ndarray  # [B, 1] int64
    position_ids: np.ndarray  # [B, 1] int64
    write_pos: np.ndarray  # [B] int64
    slots: np.ndarray  # [capacity] int64: 0, 1, ...
    mask: np.ndarray  # [B * capacity] bool: the step's [B, 1, 1, L] mask is its prefix
    logits: np.ndarray  # [B, 1, V] float32
    taps: np.ndarray | None  # [B, 1, W] float32

    @classmethod
    def bind(cls, target: OrtTarget, cache: KVCache) -> _DecodeStep:
        """Arrays for `cache`'s batch, bound to a new IOBinding with the cache."""
        if target._feature_input is not None:
            raise GenerationError("decode_step feeds tokens only; a draft head needs `forward`")
        batch = cache.batch
        step = cls(
            cache=cache,
            binding=target.session.io_binding(),
            input_ids=np.zeros((batch, 1), np.int64),
            position_ids=np.zeros((batch, 1), np.int64),
            write_pos=np.zeros(batch, np.int64),
            slots=np.arange(cache.capacity, dtype=np.int64),
            mask=np.zeros(batch * cache.capacity, bool),
            logits=np.empty((batch, 1, target.vocab_size), np.float32),
            taps=np.empty((batch, 1, target.tap_width), np.float32) if target.has_taps else None,
        )
        _bind_cache(step.binding, cache)
        for name in ("input_ids", "position_ids", "write_pos"):
            _bind_array(step.binding, name, getattr(step, name))
        _bind_array(step.binding, "logits", step.logits, output=True)
        if step.taps is not None:
            _bind_array(step.binding, target._hidden_output, step.taps, output=True)
        return step
