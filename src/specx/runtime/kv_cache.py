"""`KVCache`: fixed-capacity per-layer key/value buffers shared with the graph in place."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["KVCache"]


@dataclass
class KVCache:
    """Keys and values [B, Hkv, CAP, D] per layer plus each sequence's valid length.

    The arrays are bound as both the past and the present input/output of the graph,
    so a forward writes its new rows in place and nothing is concatenated per step.
    `lengths[b]` counts the rows of sequence b that hold real tokens.
    """

    keys: list[np.ndarray]
    values: list[np.ndarray]
    lengths: np.ndarray  # [B] int64
    spare_slots: int = 0  # slots past `capacity` a graph may need as scratch, never written
    # [2 * layers, B, Hkv, CAP, D]: every key buffer then every value buffer, where one
    # array holds them all (`allocate`), so `keep_path` moves a path in one copy, not one
    # per buffer (64 on a 32-layer target).
    stacked: np.ndarray | None = None

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: npt.DTypeLike = np.float32,
        spare_slots: int = 0,
    ) -> KVCache:
        """Zeroed buffers for `batch` sequences of up to `capacity` tokens."""
        shape = (2 * num_layers, batch, num_kv_heads, capacity + spare_slots, head_dim)
        return cls._of(np.zeros(shape, dtype), np.zeros(batch, dtype=np.int64), spare_slots)

    @classmethod
    def _of(cls, stacked: np.ndarray, lengths: np.ndarray, spare_slots: int) -> KVCache:
        """The cache whose layers are views of `stacked` [2 * layers, B, Hkv, CAP, D]."""
        layers = len(stacked) // 2
        return cls(list(stacked[:layers]), list(stacked[layers:]), lengths, spare_slots, stacked)

    @property
    def batch(self) -> int:
        """Number of sequences."""
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        """Slots per sequence."""
        return self.keys[0].shape[2] - self.spare_slots

    def row(self, b: int) -> KVCache:
        """Sequence b alone, as views of the same buffers: writes land in this cache."""
        return self.rows(b, b + 1)

    def rows(self, start: int, stop: int) -> KVCache:
        """Sequences start .. stop - 1, as views of the same buffers."""
        if self.stacked is not None:
            stacked = self.stacked[:, start:stop]
            return KVCache._of(stacked, self.lengths[start:stop], self.spare_slots)
        return KVCache(
            keys=[k[start:stop] for k in self.keys],
            values=[v[start:stop] for v in self.values],
            lengths=self.lengths[start:stop],
            spare_slots=self.spare_slots,
        )

    def keep_path(self, row: int, start: int, nodes: np.ndarray) -> None:
        """Moves rows `start + nodes[i]` to `start + i` for sequence `row`, in every layer.

        After verification the accepted root-to-leaf path is compacted right after the
        prefix; rejected branches are left behind as stale rows past `lengths[row]`.
        Nodes are increasing and `nodes[i] >= i`, so no move overwrites a later source.
        Only the path's rows are copied, never the whole cache.
        """
        nodes = np.asarray(nodes, dtype=np.int64)
        moved = np.flatnonzero(nodes != np.arange(len(nodes)))
        if moved.size == 0:
            return
        src, dst = start + nodes[moved], start + moved
        if self.stacked is not None:
            self.stacked[:, row, :, dst] = self.stacked[:, row, :, src]
            return
        for buffer in (*self.keys, *self.values):
            buffer[row, :, dst] = buffer[row, :, src]
