"""What a speculative round costs on this machine and backend, measured, and the speedup model.

    predicted speedup = E[tokens per round] * t_plain / (v(N + 1) + d(tree))

- E[tokens per round] = 1 + E[accepted | tree] (the bonus/correction token counted);
- t_plain: a plain decoding step, per token, measured with `generate_plain`;
- v(n): a verify step of n tokens (root + N nodes), the target forward `t(n)` measured at
  the calibration context length plus the loop's per-round overhead, measured on the
  calibration runs;
- d(tree) = a + b * depth + c * nodes: the drafter's time per round, fitted on runs of
  different shapes (autoregressive heads pay per depth, every drafter per node).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specx.runtime.targets.base import DecoderBackend

__all__ = ["DraftCost", "VerifyCurve", "fit_draft_cost", "measure_verify_curve"]


@dataclass(frozen=True)
class VerifyCurve:
    """Measured target forward time t(n) in seconds for n new tokens at a fixed batch."""

    batch: int
    context: int
    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, n: int) -> float:
        """t(n), linearly interpolated between measured sizes (extrapolated past the last)."""
        xs, ys = np.array(self.tokens, float), np.array(self.seconds)
        if n > xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            return float(ys[-1] + slope * (n - xs[-1]))
        return float(np.interp(n, xs, ys))

    def summary(self) -> dict:
        """JSON-ready, with t(n)/t(1)."""
        return {
            "batch": self.batch,
            "context": self.context,
            "tokens": list(self.tokens),
            "ms": [1e3 * s for s in self.seconds],
            "relative": [s / self.seconds[0] for s in self.seconds],
        }


def measure_verify_curve(
    target: DecoderBackend,
    tokens: tuple[int, ...],
    context: int,
    batch: int = 1,
    repeats: int = 7,
) -> VerifyCurve:
    """Median time of a target forward of n tokens over `context` cached ones, per n.

    The sizes take turns (one forward of each per pass), so a slow stretch of the machine
    lands on every n alike instead of bending the curve at the sizes it happened to hit.
    Each timed forward follows an untimed one of the same size: a backend that prepares
    itself again when a shape changes (OpenVINO) pays that once per new shape, while a
    speculative loop repeats one verify size round after round.
    """
    rng = np.random.default_rng(0)
    cache = target.allocate_cache(batch, min(target.capacity, context + max(tokens)))
    write_pos = np.full(batch, context, dtype=np.int64)
    steps = []
    for n in tokens:
        ids = rng.integers(0, target.vocab_size, size=(batch, n))
        positions = context + np.arange(n)[None].repeat(batch, 0)
        mask = np.ones((batch, 1, n, context + n), dtype=bool)
        mask[:, 0, :, context:] = np.tril(np.ones((n, n), dtype=bool))
        steps.append((ids, positions, mask))
        target.forward(cache, ids, positions, mask, write_pos)  # warm-up
    runs: list[list[float]] = [[] for _ in tokens]
    for _ in range(repeats):
        for step, times in zip(steps, runs, strict=True):
            target.forward(cache, *step, write_pos)  # the size's first call after a change
            started = time.perf_counter()
            target.forward(cache, *step, write_pos)
            times.append(time.perf_counter() - started)
    seconds = [float(np.median(times)) for times in runs]
    return VerifyCurve(batch, context, tuple(tokens), tuple(seconds))


@dataclass(frozen=True)
class DraftCost:
    """d(tree) = per_round + per_depth * depth + per_node * nodes, in seconds."""

    per_round: float
    per_depth: float
    per_node: float

    def __call__(self, depth: int, nodes: int) -> float:
        """Predicted draft time of one round for a tree of this depth and size."""
        return self.per_round + self.per_depth * depth + self.per_node * nodes


def fit_draft_cost(samples: list[tuple[int, int, float]]) -> DraftCost:
    """Least-squares fit of (depth, nodes, seconds per round) samples, coefficients >= 0.

    A coefficient the fit makes negative (noise) is dropped and the rest refitted.
    """
    design = np.array([[1.0, depth, nodes] for depth, nodes, _ in samples])
    seconds = np.array([s for *_, s in samples])
    active = [0, 1, 2]
    while True:
        coefficients, *_ = np.linalg.lstsq(design[:, active], seconds, rcond=None)
        negative = [a for a, c in zip(active, coefficients, strict=True) if c < 0]
        if not negative:
            break
        active.remove(negative[0])
    full = np.zeros(3)
    full[active] = coefficients
    return DraftCost(*map(float, full))
