"""The sampling transform: logits -> the distribution a token is drawn from.

ONE function serves the target and every drafter, so that draft probabilities `q` and
target probabilities `p` are always computed under the same transform; computing them
differently is the classic way speculative sampling stops being lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["SamplingParams", "next_tokens", "sample", "sampling_probs"]


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # `not x >= 0` (rather than `x < 0`) also refuses NaN.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not self.top_k >= 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not self.seed >= 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax."""
        return self.temperature == 0.0


def sampling_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities [..., V] that `params` samples from, given logits [..., V].

    Rule (the order of Hugging Face's logits processors): greedy gives a one-hot at the
    argmax (first index on ties); otherwise divide by the temperature, keep the top_k
    largest logits (ties with the k-th kept), softmax, then keep the smallest prefix of
    tokens in descending probability whose mass reaches top_p (at least one), and
    renormalise.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        probs = np.zeros_like(logits)
        np.put_along_axis(probs, logits.argmax(-1)[..., None], 1.0, axis=-1)
        return probs
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -params.top_k, axis=-1)[..., -params.top_k, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled = scaled - scaled.max(-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(-1, keepdims=True)
    return probs


def next_tokens(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> np.ndarray:
    """One token per row of logits [..., V] under `params`: the argmax, or a draw; int64 [...]."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(sampling_probs(logits, params), rng)


def sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Draws one token per row of probs [..., V] by inverse CDF; returns int64 [...]."""
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(probs.shape[:-1])[..., None] * cdf[..., -1:]
    return np.minimum((cdf <= u).sum(-1), probs.shape[-1] - 1).astype(np.int64)
