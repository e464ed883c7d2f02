"""`OvTarget`: an OpenVINO build's decoder graph on OpenVINO's CPU plugin.

Imported only when the manifest's default build is an OpenVINO one (`specx build --backend
openvino`). The cache stays specx's numpy `KVCache`: its buffers are bound to the request's
inputs without a copy, once per cache (each forward then passes only its few small inputs),
the graph reads the `L` slots its mask covers and returns the N new rows of every layer
(`specx.graphs.ov_lowering`), and this module copies them from the request's own output
memory to `write_pos`, which is where the graph's rule puts them. Activations stay
float32 (`INFERENCE_PRECISION_HINT`): the plugin's default on CPUs with bf16 would round
them to bf16, another model than the artifact's. A compressed MatMul quantizes its
activations to int8 per group of the build's `activation_group` (as ONNX Runtime's int4
builds do per weight block), which the build records.

Row invariance: greedy speculation is lossless when a token's logits are the same alone (a
decode step) and among a verify chunk's rows. OpenVINO's compressed-weight kernels compute a
single row on another path than several (at int4 enough to move logits visibly:
docs/decisions.md#ov-pad-row), while rows of chunks of 2 or more come out bit-identical whatever the
chunk. So a one-token forward runs as two rows (a copy of the token at the next position,
seeing itself: `_with_pad_row`), its second row's outputs dropped and its key and value never
written; the cache has a spare slot for it (`KVCache.spare_slots`).

OpenVINO prepares its nodes again whenever an input's shape changes, and the mask's width
(the slots a forward reads) grows by one every decoding step; the mask is padded with
unseen slots to a multiple of `MASK_QUANTUM`, so its shape changes once per that many tokens.
That width also decides how attention's sums run, so it must not depend on the cache: a cache
holds slots to the next multiple of `MASK_QUANTUM` past its capacity (spare, never written).
Padded only up to the cache's last slot, a token near the end of a short request's cache read
another width than the same token in a cache with room to spare (a speculative request's
scratch, a larger token budget), and its keys and values came out other in a last bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specx.artifact import Manifest
from specx.errors import ArtifactError, GenerationError
from specx.runtime.kv_cache import KVCache
from specx.runtime.targets.base import DecoderBackend, StepOutput
from specx.sessions import stop_spinning

__all__ = ["MASK_QUANTUM", "OvTarget", "compile_graph"]

MASK_QUANTUM = 32  # slots: the mask's width is padded to a multiple of this
PAD_SINGLE_ROWS = True  # one-token forwards run as two rows (module docstring); tests turn it off


def compile_graph(manifest: Manifest, graph: str, threads: int | None) -> Any:
    """The build's IR of `graph`, compiled for the CPU (`openvino.CompiledModel`)."""
    try:
        import openvino as ov
    except ImportError as e:
        raise ArtifactError(
            f"{manifest.root}: its default build runs on OpenVINO: pip install openvino"
        ) from e
    stop_spinning()  # the drafts' ONNX Runtime sessions must leave the cores to OpenVINO
    path = manifest.path(manifest.runtime_graph(graph).file)
    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
    group = manifest.build.quantization.activation_group if manifest.build else None
    if group is not None:  # the build's rule for compressed MatMuls' activations
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = group
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    try:
        return ov.Core().compile_model(str(path), "CPU", config)
    except RuntimeError as e:
        raise ArtifactError(f"{path}: OpenVINO could not compile the graph: {e}") from e


class OvTarget(DecoderBackend):
    """A decoder graph (`"target"` or `"draft_head"`) of an OpenVINO build."""

    def __init__(self, manifest: Manifest, threads: int | None = None, graph: str = "target"):
        super().__init__(manifest, graph)
        compiled = compile_graph(manifest, graph, threads)
        self._request = compiled.create_infer_request()
        # An output can carry several names (OpenVINO drops Identity nodes): index them all.
        self._outputs = {
            name: i for i, output in enumerate(compiled.outputs) for name in output.get_names()
        }
        self._cache_names = [
            (f"past_{kind}_{i}", f"new_{kind}_{i}")  # the lowering's names for the new rows
            for i in range(self.num_layers)
            for kind in ("key", "value")
        ]
        self._bound: list[np.ndarray] = []  # the cache buffers bound as inputs (`_bind`)

    def allocate_cache(self, batch: int, capacity: int | None = None) -> KVCache:
        """A zeroed cache for `batch` sequences; capacity defaults to the artifact's."""
        capacity = self.checked_capacity(capacity)
        spare = -(-(capacity + 1) // MASK_QUANTUM) * MASK_QUANTUM - capacity  # the pad row's too
        return KVCache.allocate(
            self.num_layers, batch, self.num_kv_heads, capacity, self.head_dim, self.cache_dtype,
            spare,
        )  # fmt: skip

    def forward(
        self,
        cache: KVCache,
        input_ids: np.ndarray,  # [B, N] int64
        position_ids: np.ndarray,  # [B, N] int64
        attention_mask: np.ndarray,  # [B, 1, N, L] bool, L <= capacity
        write_pos: np.ndarray,  # [B] int64
        features: np.ndarray | None = None,  # [B, N, d] for draft heads
    ) -> StepOutput:
        """One forward over N new tokens per sequence, written at `write_pos` in `cache`."""
        self.check_step(cache, input_ids, attention_mask, write_pos)
        n = input_ids.shape[1]
        if int(write_pos.max()) + n > attention_mask.shape[3]:
            raise GenerationError(
                f"the mask covers {attention_mask.shape[3]} slots; the new rows reach slot "
                f"{int(write_pos.max()) + n - 1}"
            )
        if self._feature_input is not None and features is None:
            raise GenerationError("this draft-head graph needs `features` [B, N, d]")
        if n == 1 and PAD_SINGLE_ROWS:
            input_ids, position_ids, attention_mask, features = _with_pad_row(
                input_ids, position_ids, attention_mask, write_pos, features
            )
        slots = cache.keys[0].shape[2]  # the spare slot included
        feeds: dict[str, np.ndarray] = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
            "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64),
            "attention_mask": _padded(attention_mask, slots),
            "write_pos": np.ascontiguousarray(write_pos, dtype=np.int64),
        }
        if self._feature_input is not None:
            feeds[self._feature_input] = np.ascontiguousarray(features, dtype=np.float32)
        buffers = [b for pair in zip(cache.keys, cache.values, strict=True) for b in pair]
        self._bind(buffers)
        # Shared outputs: the request's own memory, valid until its next call; what is kept
        # is copied out below.
        results = self._request.infer(feeds, share_inputs=True, share_outputs=True)
        for (_, new), buffer in zip(self._cache_names, buffers, strict=True):
            rows = results[self._outputs[new]]
            for b, start in enumerate(write_pos):
                buffer[b, :, start : start + n] = rows[b, :, :n]
        logits = np.array(results[self._outputs["logits"]][:, :n])
        taps = None
        if self.has_taps:
            taps = np.array(results[self._outputs[self._hidden_output]][:, :n])
        return StepOutput(logits=logits, taps=taps)

    def _bind(self, buffers: list[np.ndarray]) -> None:
        """Binds the cache's buffers as the `past_*` inputs, unless they already are.

        Bound once per cache rather than passed with every call, which wraps 2 x layers
        arrays each time (what that costs: docs/decisions.md#ov-bind-cache). The bound arrays
        are kept, so their memory cannot go to another array while bound.
        """
        if len(buffers) == len(self._bound) and all(
            a is b for a, b in zip(buffers, self._bound, strict=True)
        ):
            return
        import openvino as ov

        for (past, _), buffer in zip(self._cache_names, buffers, strict=True):
            self._request.set_tensor(past, ov.Tensor(buffer, shared_memory=True))
        self._bound = buffers


def _with_pad_row(input_ids, position_ids, mask, write_pos, features):
    """A one-token forward as two rows: the token again at the next slot and position."""
    width = max(mask.shape[3], int(write_pos.max()) + 2)
    padded = np.zeros((mask.shape[0], 1, 2, width), dtype=bool)
    padded[:, :, :, : mask.shape[3]] = mask
    padded[np.arange(len(write_pos)), 0, 1, write_pos + 1] = True  # the copy sees itself too
    twice = None if features is None else np.concatenate([features, features], axis=1)
    ids = np.concatenate([input_ids, input_ids], axis=1)
    return ids, np.concatenate([position_ids, position_ids + 1], axis=1), padded, twice


def _padded(mask: np.ndarray, capacity: int) -> np.ndarray:
    """`mask` [B, 1, N, L] widened with unseen slots to a multiple of MASK_QUANTUM (<= capacity)."""
    width = mask.shape[3]
    padded = min(-(-width // MASK_QUANTUM) * MASK_QUANTUM, capacity)
    if padded == width:
        return np.ascontiguousarray(mask, dtype=bool)
    out = np.zeros((*mask.shape[:3], padded), dtype=bool)
    out[..., :width] = mask
    return out
