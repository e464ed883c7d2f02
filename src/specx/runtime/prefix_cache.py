"""Prefix caching: the KV (and taps) of earlier prompts, reused by prompts that start the same.

Prompts are cut into blocks of `block_tokens`; a block's key hashes its parent's key and its
own tokens (vLLM's scheme), so a key names the whole prefix up to the block's end and equal
keys mean equal prefixes. A block holds, for its tokens, every layer's key and value rows
[2 * layers, Hkv, block, D] and, where the target exposes taps (draft heads read them), the
tap rows [block, width]: a request that reuses a prefix prefills only the rest, and its
drafter still starts from taps for the whole prompt.

What is reused was computed by the same graphs for the same tokens at the same positions,
so reuse changes no output (tests compare greedy outputs with and without the cache for
every drafter). Only blocks of prompts are kept (their KV comes from a prefill); a chat's
previous answer is prefilled once as part of the next turn's prompt and cached from then.

Memory is bounded by `max_bytes`; the least recently used block goes first. A lookup
refreshes the blocks it matched from the deepest to the first, so a block is always more
recent than its descendants and eviction takes leaves before the prefixes they extend.
At most all but the prompt's last token is reused: the target must run on at least one
token to give the logits of the first new one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specx.runtime.kv_cache import KVCache

__all__ = ["PrefixCache", "PrefixHit"]


@dataclass(frozen=True)
class _Block:
    kv: np.ndarray  # [2 * layers, Hkv, block, D]
    taps: np.ndarray | None  # [block, width]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (0 if self.taps is None else self.taps.nbytes)


@dataclass(frozen=True)
class PrefixHit:
    """The cached rows of a prompt's first `tokens` tokens."""

    tokens: int
    kv: np.ndarray  # [2 * layers, Hkv, tokens, D]
    taps: np.ndarray | None  # [tokens, width]


class PrefixCache:
    """Blocks of earlier prompts' KV rows, by prefix hash, LRU within `max_bytes`."""

    def __init__(self, max_bytes: int, block_tokens: int = 16):
        if block_tokens < 1 or max_bytes < 0:
            raise ValueError(f"block_tokens {block_tokens} < 1 or max_bytes {max_bytes} < 0")
        self.max_bytes, self.block_tokens = max_bytes, block_tokens
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.bytes = 0
        self.hits = self.lookups = self.reused_tokens = self.evictions = 0

    def _keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The key of every full block of `tokens`, in order."""
        keys, parent = [], b""
        size = self.block_tokens
        for start in range(0, len(tokens) - size + 1, size):
            block = np.asarray(tokens[start : start + size], dtype=np.int64).tobytes()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            keys.append(parent)
        return keys

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The longest cached prefix of `prompt` (all but its last token at most)."""
        self.lookups += 1
        found = []
        for key in self._keys(prompt[: len(prompt) - 1]):
            block = self._blocks.get(key)
            if block is None:
                break
            found.append((key, block))
        if not found:
            return None
        for key, _ in reversed(found):  # deepest first: parents end up more recent
            self._blocks.move_to_end(key)
        tokens = len(found) * self.block_tokens
        self.hits += 1
        self.reused_tokens += tokens
        kv = np.concatenate([b.kv for _, b in found], axis=2)
        has_taps = all(b.taps is not None for _, b in found)
        taps = np.concatenate([b.taps for _, b in found]) if has_taps else None
        return PrefixHit(tokens, kv, taps)

    def store(self, prompt: Sequence[int], row: KVCache, taps: np.ndarray | None) -> None:
        """Keeps the full blocks of `prompt` from `row` (one sequence holding it at 0..)."""
        size, keys = self.block_tokens, self._keys(prompt)
        for i, key in enumerate(keys):
            if key not in self._blocks:
                span = slice(i * size, (i + 1) * size)
                copied = None if taps is None else np.array(taps[span], copy=True)
                self._blocks[key] = _Block(_rows(row, span), copied)
                self.bytes += self._blocks[key].nbytes
        for key in reversed(keys):  # deepest first: parents end up more recent
            self._blocks.move_to_end(key)
        while self.bytes > self.max_bytes:
            _, evicted = self._blocks.popitem(last=False)
            self.bytes -= evicted.nbytes
            self.evictions += 1

    @staticmethod
    def write(row: KVCache, hit: PrefixHit) -> None:
        """Copies `hit`'s rows into slots 0 .. hit.tokens - 1 of `row` (one sequence)."""
        span = slice(0, hit.tokens)
        if row.stacked is not None:
            row.stacked[:, 0, :, span] = hit.kv
            return
        for i, buffer in enumerate((*row.keys, *row.values)):
            buffer[0, :, span] = hit.kv[i]


def _rows(row: KVCache, span: slice) -> np.ndarray:
    """Copies of one sequence's rows `span` in every layer: [2 * layers, Hkv, n, D]."""
    if row.stacked is not None:
        return np.array(row.stacked[:, 0, :, span], copy=True)
    return np.stack([buffer[0, :, span] for buffer in (*row.keys, *row.values)])
