"""`NodeSlots`: where the tree nodes a drafter forwards live in its KV cache, and what they see."""

from __future__ import annotations

import numpy as np

__all__ = ["NodeSlots"]


class NodeSlots:
    """Per sequence: pool node -> KV slot offset (after `base`), depth and visible offsets.

    Nodes are placed in the order they are forwarded, so each call writes a contiguous
    run of slots and a node's ancestors (forwarded earlier) have smaller offsets.
    """

    def __init__(self, base: np.ndarray):
        self.base = np.asarray(base, dtype=np.int64).copy()  # [B] slot of offset 0
        batch = len(self.base)
        self.offset: list[dict[int, int]] = [{} for _ in range(batch)]
        self.depth: list[dict[int, int]] = [{} for _ in range(batch)]
        self.sees: list[dict[int, list[int]]] = [{-1: []} for _ in range(batch)]
        self.count = np.zeros(batch, dtype=np.int64)

    def place(self, nodes: np.ndarray, parents: np.ndarray):
        """Assigns slots to nodes [B, n] whose parents are [B, n] (-1 = root).

        Returns:
            write_pos [B], position offsets [B, n] (node depth), and the attention mask
            [B, 1, n, L] over the prefix and the visible node slots.
        """
        batch, n = nodes.shape
        write_pos = self.base + self.count
        depth = np.zeros((batch, n), dtype=np.int64)
        for b in range(batch):
            for i in range(n):
                node, parent = int(nodes[b, i]), int(parents[b, i])
                offset = int(self.count[b]) + i
                self.offset[b][node] = offset
                self.depth[b][node] = depth[b, i] = self.depth[b].get(parent, -1) + 1
                self.sees[b][node] = self.sees[b][parent] + [offset]
        self.count += n
        kv_len = int((self.base + self.count).max())
        mask = np.zeros((batch, 1, n, kv_len), dtype=bool)
        for b in range(batch):
            start = int(self.base[b])
            mask[b, 0, :, :start] = True
            for i in range(n):
                mask[b, 0, i, start + np.array(self.sees[b][int(nodes[b, i])])] = True
        return write_pos, depth, mask

    def forwarded_prefix(self, row: int, pool_ids: np.ndarray) -> np.ndarray:
        """Slot offsets of the leading pool nodes of a path that were forwarded."""
        offsets = []
        for node in pool_ids.tolist():
            if node not in self.offset[row]:
                break
            offsets.append(self.offset[row][node])
        return np.array(offsets, dtype=np.int64)
