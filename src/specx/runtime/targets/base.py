"""`DecoderBackend`: what every backend's decoder graph shares (shapes from the manifest, `feed`).

A decoder graph takes new tokens at cache slots and returns logits (and hidden states),
writing its keys and values into a fixed-capacity cache in place. The ONNX Runtime and
TensorRT backends implement `allocate_cache` and `forward` (ONNX Runtime also a faster
`decode_step`); the rest is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specx.artifact import MANIFEST_NAME, Manifest
from specx.errors import ArtifactError, GenerationError
from specx.masks import causal_mask
from specx.runtime.kv_cache import KVCache

__all__ = ["DecoderBackend", "StepOutput"]


@dataclass(frozen=True)
class StepOutput:
    """What one decoder forward returns besides the in-place cache update."""

    logits: np.ndarray  # [B, N, V] float32
    taps: np.ndarray | None  # [B, N, W]: the target's taps, or a draft head's hidden output


class DecoderBackend:
    """Shapes of a decoder graph (`"target"` or `"draft_head"`) and the ragged `feed`.

    Subclasses implement `allocate_cache(batch, capacity)` and `forward(...)`.
    """

    def __init__(self, manifest: Manifest, graph: str = "target"):
        self.manifest = manifest
        model = manifest.model
        self.capacity = model.kv_capacity
        self.max_tree_tokens = model.max_tree_tokens
        if graph == "target":
            self.num_layers, self.num_kv_heads = model.num_layers, model.num_kv_heads
            self.head_dim, self.vocab_size = model.head_dim, model.vocab_size
            self.taps, self.tap_width = model.taps.kind, model.taps.width
            self._hidden_output, self._feature_input = "hidden_taps", None
        else:
            decoder = manifest.graph(graph).decoder
            if decoder is None:
                where = manifest.root / MANIFEST_NAME
                raise ArtifactError(f"{where}: graphs.{graph} has no decoder section")
            self.num_layers, self.num_kv_heads = decoder.num_layers, decoder.num_kv_heads
            self.head_dim, self.vocab_size = decoder.head_dim, decoder.vocab_size
            self.taps, self.tap_width = "hidden", decoder.hidden_size
            self._hidden_output, self._feature_input = "hidden", "features"
        self.has_taps = self.taps != "none"
        inputs = manifest.runtime_graph(graph).inputs
        self.cache_dtype = np.dtype(next(i.dtype for i in inputs if i.name == "past_key_0"))

    def allocate_cache(self, batch: int, capacity: int | None = None) -> KVCache:
        """A zeroed cache for `batch` sequences; capacity defaults to the artifact's."""
        raise NotImplementedError

    def forward(
        self,
        cache: KVCache,
        input_ids: np.ndarray,
        position_ids: np.ndarray,
        attention_mask: np.ndarray,
        write_pos: np.ndarray,
        features: np.ndarray | None = None,
    ) -> StepOutput:
        """One forward over N new tokens per sequence, written at `write_pos` in `cache`."""
        raise NotImplementedError

    def decode_step(
        self, cache: KVCache, tokens: np.ndarray, write_pos: np.ndarray | None = None
    ) -> StepOutput:
        """One token per sequence (`tokens` [B]) at slot and position `write_pos[b]`.

        The plain decoding step: a causal chain of one, by default at `cache.lengths`.
        Outputs are [B, 1, ...]; a backend may reuse their arrays on its next `decode_step`.
        Does not change `cache.lengths`.
        """
        write_pos = cache.lengths.copy() if write_pos is None else write_pos
        mask = causal_mask(write_pos, 1, int(write_pos.max()) + 1)
        return self.forward(cache, tokens[:, None], write_pos[:, None], mask, write_pos)

    def checked_capacity(self, capacity: int | None) -> int:
        """`capacity` (default: the artifact's), refused when the artifact holds fewer slots."""
        capacity = capacity or self.capacity
        if capacity > self.capacity:
            raise GenerationError(
                f"a KV cache of {capacity} slots exceeds the artifact's capacity {self.capacity}"
            )
        return capacity

    @staticmethod
    def check_step(
        cache: KVCache, input_ids: np.ndarray, attention_mask: np.ndarray, write_pos: np.ndarray
    ) -> None:
        """Refuses a forward whose mask is not [B, 1, N, L] or whose writes overflow the cache."""
        batch, n = input_ids.shape
        if attention_mask.shape != (batch, 1, n, attention_mask.shape[3]):
            raise GenerationError(f"attention_mask shape {attention_mask.shape} != [B, 1, N, L]")
        if int(write_pos.max()) + n > cache.capacity or attention_mask.shape[3] > cache.capacity:
            raise GenerationError(
                f"writing {n} tokens at slot {int(write_pos.max())} overflows the KV cache "
                f"({cache.capacity} slots)"
            )

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
        starts = np.asarray(starts, dtype=np.int64)
        if len(sequences) > 1 and int(starts.max()) + width > cache.capacity:
            return self._feed_rows(cache, sequences, starts, features, width)
        ids = np.zeros((len(sequences), width), dtype=np.int64)
        for b, tokens in enumerate(sequences):
            ids[b, : len(tokens)] = tokens
        padded = None
        if features is not None:
            padded = np.zeros((len(sequences), width, self.tap_width), dtype=np.float32)
            for b, rows in enumerate(features):
                padded[b, : len(rows)] = rows
        positions = starts[:, None] + np.arange(width)
        mask = causal_mask(starts, width, int(starts.max()) + width)
        output = self.forward(cache, ids, positions, mask, starts, padded)
        return output, np.array([max(len(s) - 1, 0) for s in sequences])

    def _feed_rows(self, cache, sequences, starts, features, width):
        """`feed` one row at a time: right-padding the batch would write past the cache's end."""
        logits = np.zeros((len(sequences), width, self.vocab_size), dtype=np.float32)
        taps = None
        if self.has_taps:
            taps = np.zeros((len(sequences), width, self.tap_width), dtype=np.float32)
        for b, tokens in enumerate(sequences):
            if not len(tokens):
                continue
            row_features = None if features is None else [features[b]]
            output, _ = self.feed(cache.row(b), [tokens], starts[b : b + 1], row_features)
            logits[b, : len(tokens)] = output.logits[0, : len(tokens)]
            if taps is not None:
                assert output.taps is not None  # has_taps: every forward returns them
                taps[b, : len(tokens)] = output.taps[0, : len(tokens)]
        return StepOutput(logits, taps), np.array([max(len(s) - 1, 0) for s in sequences])
