"""An autoregressive head's whole greedy round, in one ONNX Runtime call or on the kernels.

Runs the artifact's `draft_chain` graph (`specx.graphs.draft_chain`): the catch-up over the
positions whose target features arrived, then K - 1 greedy steps from the head's own
outputs. The per-depth path computes the same greedy tokens with a Python loop around one
head call per depth (node slots, masks, a sort per depth); here only the catch-up's inputs
are built in Python. Used for greedy chains on ONNX Runtime; at a temperature chains are
sampled from q (the sampled-chain rule needs q and a draw per depth), and trees and
TensorRT keep the per-depth path too.

On the kernels a head's forward is already one C call with nothing between its operators,
so `StepChain` loops in Python over the head's own forwards, the same tokens as the graph
(its positions, slots, masks and ties), with none of the per-depth path's tree bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from specx.artifact import Manifest
from specx.masks import causal_mask
from specx.runtime.kv_cache import KVCache
from specx.runtime.targets import graph_runtime
from specx.runtime.targets.base import DecoderBackend
from specx.runtime.targets.ort import open_session

__all__ = ["DraftChain", "HeadChain", "StepChain"]


class HeadChain:
    """A head's greedy round: the catch-up over the fed tokens, then `steps` greedy steps."""

    def fits(self, cache: KVCache, starts: np.ndarray, width: int, steps: int) -> bool:
        """Whether the round stays inside the cache (else the per-depth path feeds rows)."""
        return int(starts.max()) + width + steps <= cache.capacity

    def __call__(
        self,
        cache: KVCache,
        tokens: Sequence[Sequence[int]],
        features: Sequence[np.ndarray],
        starts: np.ndarray,
        steps: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Draft ids [B, steps + 1] (target vocabulary) and their softmax probabilities.

        Per row: the fed tokens, their features [n_b, d], the slot of the first (`starts`).
        """
        raise NotImplementedError


class DraftChain(HeadChain):
    """The `draft_chain` graph on ONNX Runtime, its head cache bound in place."""

    def __init__(self, manifest: Manifest, threads: int | None = None):
        self.session = open_session(manifest, "draft_chain", threads)
        self._binding = self.session.io_binding()
        self._bound: KVCache | None = None

    @staticmethod
    def available(manifest: Manifest) -> bool:
        """True when the default build (or the export) has the chain graph, on ORT."""
        build = manifest.build
        graphs = manifest.graphs if build is None else build.graphs
        return "draft_chain" in graphs and graph_runtime(manifest, "draft_chain") == "ort"

    def __call__(self, cache, tokens, features, starts, steps):  # noqa: D102 (HeadChain's)
        batch = len(tokens)
        width = max(1, max(len(t) for t in tokens))
        ids = np.zeros((batch, width), dtype=np.int64)
        padded = np.zeros((batch, width, features[0].shape[-1]), dtype=np.float32)
        for b, (row, rows) in enumerate(zip(tokens, features, strict=True)):
            ids[b, : len(row)] = row
            padded[b, : len(rows)] = rows
        starts = np.asarray(starts, dtype=np.int64)
        binding = self._binding
        if cache is not self._bound:
            for kind, array in (("key", cache.keys[0]), ("value", cache.values[0])):
                value = ort.OrtValue.ortvalue_from_numpy(array)
                binding.bind_ortvalue_input(f"past_{kind}_0", value)
                binding.bind_ortvalue_output(f"present_{kind}_0", value)
            self._bound = cache
        last = np.array([max(len(t) - 1, 0) for t in tokens], dtype=np.int64)
        inputs = {
            "input_ids": ids,
            "features": padded,
            "position_ids": starts[:, None] + np.arange(width),
            "attention_mask": causal_mask(starts, width, int(starts.max()) + width),
            "write_pos": starts,
            "last_index": last,
            "steps": np.array(steps, dtype=np.int64),
        }
        for name, value in inputs.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        draft_ids = np.empty((batch, steps + 1), dtype=np.int64)
        probs = np.empty((batch, steps + 1), dtype=np.float32)
        for name, array in (("draft_ids", draft_ids), ("draft_probs", probs)):
            binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        self.session.run_with_iobinding(binding)
        return draft_ids, probs


class StepChain(HeadChain):
    """The `draft_chain` graph's round as a loop over a head's forwards.

    For a head whose runtime runs no chain graph but makes a forward one cheap call (specx's
    kernels). `to_target` maps draft ids to target ids (EAGLE-3's d2t), None where equal.
    """

    def __init__(self, head: DecoderBackend, to_target: np.ndarray | None):
        self.head, self.to_target = head, to_target

    def _pick(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Target ids [B] and softmax probabilities of the best entries of logits [B, V]."""
        best = logits.argmax(-1)  # ties to the lowest id, as the graph's ArgMax
        top = logits[np.arange(len(best)), best]
        probs = 1.0 / np.exp(logits - top[:, None]).sum(-1)
        return (best if self.to_target is None else self.to_target[best]), probs

    def __call__(self, cache, tokens, features, starts, steps):  # noqa: D102 (HeadChain's)
        starts = np.asarray(starts, dtype=np.int64)
        output, last = self.head.feed(cache, tokens, starts, features)
        assert output.taps is not None  # a head's forward returns its hidden output
        rows = np.arange(len(tokens))
        token, prob = self._pick(output.logits[rows, last])
        hidden = output.taps[rows, last]
        ids, probs = [token], [prob]
        slot = starts + last + 1  # the graph's s_b; positions are slots here
        for j in range(steps):
            write = slot + j
            mask = causal_mask(write, 1, int(write.max()) + 1)
            output = self.head.forward(
                cache, token[:, None], write[:, None], mask, write, hidden[:, None]
            )
            assert output.taps is not None
            token, prob = self._pick(output.logits[:, 0])
            hidden = output.taps[:, 0]
            ids.append(token)
            probs.append(prob)
        return np.stack(ids, 1).astype(np.int64), np.stack(probs, 1).astype(np.float32)
