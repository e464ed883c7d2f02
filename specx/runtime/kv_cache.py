"""`KVCache`: fixed-capacity per-layer key/value buffers shared with the graph in place."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: np.dtype = np.float32,
        spare_slots: int = 0,
    ) -> KVCache:
        """Zeroed buffers for `batch` sequences of up to `capacity` tokens."""
        shape = (batch, num_kv_heads, capacity + spare_slots, head_dim)
        return cls(
            keys=[np.zeros(shape, dtype) for _ in range(num_layers)],
            values=[np.zeros(shape, dtype) for _ in range(num_layers)],
            lengths=np.zeros(batch, dtype=np.int64),
            spare_slots=spare_slots,
        )

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
        return KVCache(
            keys=[k[b : b + 1] for k in self.keys],
            values=[v[b : b + 1] for v in self.values],
            lengths=self.lengths[b : b + 1],
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
        for buffer in (*self.keys, *self.values):
            buffer[row, :, dst] = buffer[row, :, src]
