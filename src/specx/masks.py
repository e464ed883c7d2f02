"""Attention masks over [cache slots] for chains of new tokens (trees come with the loop)."""

from __future__ import annotations

import numpy as np

__all__ = ["causal_mask"]


def causal_mask(lengths: np.ndarray, num_new: int, kv_len: int) -> np.ndarray:
    """Mask [B, 1, N, L] for N new tokens appended after `lengths[b]` cached tokens.

    Rule: new token i of sequence b sees slots `[0, lengths[b] + i]`, i.e. its prefix,
    the new tokens before it and itself. Slots past that (another sequence's longer
    prefix, stale rows) are hidden.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    visible_end = lengths[:, None] + np.arange(num_new)  # [B, N] last visible slot
    mask = np.arange(kv_len)[None, None, :] <= visible_end[:, :, None]
    return mask[:, None]
