"""A `specx build --backend cpu` build's graphs on specx's own kernels (`runtime.kernels`).

`CpuTarget` runs the target, or an EAGLE-3 head (`draft_head`: one Llama layer over
[embedding, features]); `CpuProjection` the head's projection of the taps. The build's
`<graph>.bin` is mapped read-only (its weights are never copied into the process's own
memory) and described to the kernels by ctypes structures built once from `<graph>.json`.
A forward is one call: the kernels write the new keys and values into specx's numpy
`KVCache` in place and return logits and taps. Rows are independent by construction
(forward.c), so a one-token forward needs no pad row, the cache no spare slots, and trees are
exact without the spine rule. The call releases the GIL (ctypes), so a server's other threads
run while the target computes.
"""

from __future__ import annotations

import copy
import ctypes
import json
import os

import numpy as np

from specx.artifact import Manifest
from specx.errors import ArtifactError, GenerationError
from specx.runtime import kernels
from specx.runtime.kv_cache import KVCache
from specx.runtime.targets.base import DecoderBackend, StepOutput
from specx.sessions import stop_spinning

__all__ = ["CpuProjection", "CpuTarget"]

_TAP_KINDS = {"none": 0, "last": 1, "eagle3": 2, "hidden": 3}


def _library(manifest: Manifest) -> kernels.Library:
    lib = kernels.library()
    if lib is None:
        raise ArtifactError(
            f"{manifest.root}: its default build runs on specx's CPU kernels, which do not "
            f"run here ({kernels.unavailable()}); choose another build with --build"
        )
    stop_spinning()  # the drafts' ONNX Runtime sessions must leave the cores to the kernels
    return lib


class _Mapped:
    """A cpu graph's tensors (`<graph>.json` indexing `<graph>.bin`), mapped read-only."""

    def __init__(self, manifest: Manifest, graph: str):
        entry = manifest.runtime_graph(graph)
        index = json.loads(manifest.path(entry.file).read_text())
        data = np.memmap(manifest.path(entry.data_files[0]), dtype=np.uint8, mode="r")
        self.constants: dict = index["constants"]
        self.specs: dict[str, dict] = index["tensors"]
        self.tensors = {
            name: np.ndarray(spec["shape"], np.dtype(spec["dtype"]), data, spec["offset"])
            for name, spec in self.specs.items()
        }

    def linear(self, name: str) -> kernels.Linear:
        """The kernels' `spx_linear` of a packed weight (kept alive by `self.tensors`)."""
        spec = self.specs[name]
        weight = self.tensors[name].ctypes.data
        zero_points = int(spec.get("zero_points", False))  # absent before asymmetric int4
        return kernels.Linear(
            weight, None, spec["bits"], spec["k"], spec["n"], spec["block"], zero_points
        )


class CpuProjection:
    """An EAGLE-3 head's projection of the taps (`draft_projection`), one packed linear."""

    def __init__(self, manifest: Manifest, graph: str, threads: int | None = None):
        self._lib = _library(manifest)
        self._mapped = _Mapped(manifest, graph)
        self._weight = self._mapped.linear("projection")
        self.threads = threads or os.cpu_count() or 1

    def __call__(self, taps: np.ndarray) -> np.ndarray:
        """Taps [B, N, k] -> features [B, N, n]."""
        rows = taps.reshape(-1, taps.shape[-1])
        out = kernels.linear_forward(self._lib, self._weight, rows, self.threads)
        return out.reshape(*taps.shape[:-1], -1)


class CpuTarget(DecoderBackend):
    """The target of a `cpu-int4` / `cpu-int8` build, or its EAGLE-3 head (`draft_head`)."""

    def __init__(self, manifest: Manifest, threads: int | None = None, graph: str = "target"):
        super().__init__(manifest, graph)
        self._lib = _library(manifest)
        if self.cache_dtype != np.float32:
            raise ArtifactError(f"{manifest.root}: the cpu build keeps its cache in float32")
        self._mapped = _Mapped(manifest, graph)
        self._tensors = self._mapped.tensors
        self._embedded = self._tensors["embed"].shape[0]  # token ids the graph reads
        self._head = graph != "target"
        self._threads = threads or os.cpu_count() or 1
        self._kept = tuple(range(self._mapped.constants["layers"]))
        self._model = self._describe(self._mapped.constants, self._threads)
        self._workspace = np.empty(0, dtype=np.uint8)

    def skipping(self, layers: frozenset[int]) -> CpuTarget:
        """This target with `layers` skipped: a self-drafting view (`drafters.layer_skip`).

        The view's `spx_model` lists the kept layers' structures, which point into the same
        mapped weights (one copy of them in memory, the file's read-only pages); its cache
        holds the kept layers only, and it reads no taps.
        """
        if self._head or len(self._kept) != self.num_layers:
            raise GenerationError("only a whole target can skip layers")
        view = copy.copy(self)
        view._kept = tuple(i for i in self._kept if i not in layers)
        view.num_layers = len(view._kept)
        view.taps, view.tap_width, view.has_taps = "none", 0, False
        view._model = view._describe(self._mapped.constants, self._threads)
        view._workspace = np.empty(0, dtype=np.uint8)
        return view

    def _describe(self, constants: dict, threads: int) -> kernels.Model:
        """The kernels' `spx_model` over the mapped tensors (kept alive by `self._tensors`)."""
        t, linear = self._tensors, self._mapped.linear
        layers = len(self._kept)
        self._layers = (kernels.Layer * layers)(
            *(
                kernels.Layer(
                    t[f"input_norm.{i}"].ctypes.data,
                    t[f"post_norm.{i}"].ctypes.data,
                    linear(f"qkv.{i}"),
                    linear(f"o.{i}"),
                    linear(f"gate_up.{i}"),
                    linear(f"down.{i}"),
                )
                for i in self._kept
            )
        )
        tap_kind, tap_layers = "hidden", tuple[int, ...]()
        if not self._head and self.has_taps:
            tap_kind, tap_layers = self.taps, self.manifest.model.taps.layers
        elif not self._head:
            tap_kind = "none"  # a target without taps, or a view skipping layers
        return kernels.Model(
            hidden=constants["hidden"],
            layers=layers,
            heads=constants["heads"],
            kv_heads=constants["kv_heads"],
            head_dim=constants["head_dim"],
            inter=constants["inter"],
            vocab=constants["vocab"],
            rotary_half=t["inv_freq"].shape[0],
            eps=constants["eps"],
            attn_scale=constants["attn_scale"],
            rope_scaling=1.0,
            embed_scale=1.0,
            embed=t["embed"].ctypes.data,
            inv_freq=t["inv_freq"].ctypes.data,
            final_norm=t["final_norm"].ctypes.data,
            lm_head=linear("lm_head"),
            layer=self._layers,
            tap_kind=_TAP_KINDS[tap_kind],
            n_taps=len(tap_layers),
            tap_layers=(ctypes.c_int32 * 8)(*tap_layers),
            threads=threads,
            hidden_norm=t["hidden_norm"].ctypes.data if self._head else None,
        )

    def allocate_cache(self, batch: int, capacity: int | None = None) -> KVCache:
        """A zeroed cache for `batch` sequences; capacity defaults to the artifact's."""
        capacity = self.checked_capacity(capacity)
        return KVCache.allocate(
            self.num_layers, batch, self.num_kv_heads, capacity, self.head_dim, np.float32
        )

    def forward(
        self,
        cache: KVCache,
        input_ids: np.ndarray,  # [B, N] int64
        position_ids: np.ndarray,  # [B, N] int64
        attention_mask: np.ndarray,  # [B, 1, N, L] bool, L <= capacity
        write_pos: np.ndarray,  # [B] int64
        features: np.ndarray | None = None,
    ) -> StepOutput:
        """One forward over N new tokens per sequence, written at `write_pos` in `cache`."""
        self.check_step(cache, input_ids, attention_mask, write_pos)
        stacked = cache.stacked
        if stacked is None or stacked.dtype != np.float32 or not stacked[0, 0].flags.c_contiguous:
            raise GenerationError("the cpu build needs a cache from its own allocate_cache")
        batch, n = input_ids.shape
        if input_ids.size and (input_ids.min() < 0 or input_ids.max() >= self._embedded):
            # The kernels read the embedding row of each id without a bound of their own.
            raise GenerationError(f"token ids must lie in [0, {self._embedded})")
        if self._head:
            if features is None or features.shape != (batch, n, self.tap_width):
                raise GenerationError(f"a head's forward needs features [B, N, {self.tap_width}]")
            features = np.ascontiguousarray(features, dtype=np.float32)
        slots = attention_mask.shape[3]
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        positions = np.ascontiguousarray(position_ids, dtype=np.int64)
        mask = np.ascontiguousarray(attention_mask, dtype=bool)
        starts = np.ascontiguousarray(write_pos, dtype=np.int64)
        logits = np.empty((batch, n, self.vocab_size), dtype=np.float32)
        taps = np.empty((batch, n, self.tap_width), dtype=np.float32) if self.has_taps else None
        workspace = self._scratch(batch * n, slots)
        item = stacked.itemsize
        self._lib.handle.spx_forward(
            ctypes.byref(self._model),
            ctypes.c_int(batch),
            ctypes.c_int(n),
            _ptr(ids),
            _ptr(positions),
            _ptr(mask),
            ctypes.c_int(slots),
            _ptr(starts),
            ctypes.c_void_p(stacked.ctypes.data),
            ctypes.c_int64(stacked.strides[0] // item),
            ctypes.c_int64(stacked.strides[1] // item),
            ctypes.c_int(stacked.shape[3]),
            None if features is None else _ptr(features),
            _ptr(logits),
            None if taps is None else _ptr(taps),
            _ptr(workspace),
        )
        return StepOutput(logits=logits, taps=taps)

    def _scratch(self, rows: int, slots: int) -> np.ndarray:
        """The kernels' workspace, grown to what `rows` x `slots` needs and kept."""
        size = self._lib.handle.spx_workspace_bytes(ctypes.byref(self._model), rows, slots)
        if self._workspace.nbytes < size:
            self._workspace = np.empty(size, dtype=np.uint8)
        return self._workspace


def _ptr(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)
