"""Which layers `--drafter skip` leaves out, measured on the user's prompts.

A skipped set S is judged by two numbers: its agreement a(S), the share of the target's own
greedy continuation of the prompts whose next token the view predicts (teacher-forced: the
view reads the target's text, as a draft reads the accepted text), and its cost c(S), a
view's decode step over the target's. A chain of n then accepts about
E = (1 - a^(n+1)) / (1 - a) tokens a round (the bonus token included, positions taken as
independent) for t(n+1)/t(1) + n c target steps (n view forwards: the catch-up of the
accepted tokens and n - 1 steps), and the predicted speedup is E over that.

Trying every set is 2^L forwards; the search makes 2L - 1 instead: each layer skipped alone
ranks the layers by how much skipping it keeps (one forward each), then the k least needed
ones are skipped together for k = 1 .. L - 1 (each measured: layers interact). SWIFT picks
sets by a Bayesian search during decoding; this is its offline, deterministic cousin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specx.calibration.costs import VerifyCurve, measure_verify_curve
from specx.progress import Progress
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.targets.base import DecoderBackend
from specx.runtime.targets.cpu import CpuTarget

__all__ = ["SkipChoice", "SkipPoint", "choose_skipped"]


@dataclass(frozen=True)
class SkipPoint:
    """One skipped set as measured: agreement, cost, and its best chain's prediction."""

    skipped: tuple[int, ...]
    agreement: float  # a(S): next tokens of the target's text the view predicts
    cost: float  # c(S): a view's decode step over the target's
    chain: int  # the chain length predicted best for it
    predicted_speedup: float

    def to_json(self) -> dict:  # noqa: D102
        return {
            "skipped": list(self.skipped),
            "agreement": self.agreement,
            "draft_cost_c": self.cost,
            "chain": self.chain,
            "predicted_speedup": self.predicted_speedup,
        }


@dataclass(frozen=True)
class SkipChoice:
    """The set the search chose, the layers ranked, and every nested set measured."""

    best: SkipPoint
    ranking: tuple[int, ...]  # layers, the one skipping costs least first
    alone: tuple[float, ...]  # agreement with each layer skipped alone, by layer
    points: tuple[SkipPoint, ...]  # the k least needed skipped, k = 1 .. L - 1

    def to_json(self) -> dict:  # noqa: D102
        return {
            "chosen": self.best.to_json(),
            "ranking": list(self.ranking),
            "agreement_skipping_alone": list(self.alone),
            "nested": [p.to_json() for p in self.points],
        }


def choose_skipped(
    target: CpuTarget,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    max_chain: int,
    progress: Progress = lambda message: None,
) -> SkipChoice:
    """The skipped set with the best predicted speedup, from 2L - 1 measured sets."""
    layers = target.num_layers
    texts = generate_plain(target, prompts, new_tokens).tokens
    texts = [list(p) + list(t) for p, t in zip(prompts, texts, strict=True)]
    starts = [len(p) for p in prompts]
    context = int(np.mean(starts)) + new_tokens // 2
    curve = measure_verify_curve(target, tuple(range(1, max_chain + 2)), context)
    progress(f"  skip: ranking {layers} layers by the agreement of each skipped alone")
    alone = tuple(_agreement(target, {i}, texts, starts) for i in range(layers))
    ranking = tuple(sorted(range(layers), key=lambda i: (-alone[i], i)))
    points = []
    for k in range(1, layers):
        skipped = frozenset(ranking[:k])
        agreement = _agreement(target, skipped, texts, starts)
        cost = _step(target.skipping(skipped), context) / curve.seconds[0]
        points.append(_point(skipped, agreement, cost, curve, max_chain))
        progress(
            f"  skip {k}/{layers - 1}: a = {agreement:.2f}, c = {cost:.2f}, "
            f"predicted {points[-1].predicted_speedup:.2f}x"
        )
    best = max(points, key=lambda p: p.predicted_speedup)
    return SkipChoice(best, ranking, alone, tuple(points))


def _agreement(target: CpuTarget, skipped, texts: list[list[int]], starts: list[int]) -> float:
    """Share of each text's continuation the view skipping `skipped` predicts, teacher-forced."""
    view = target.skipping(frozenset(skipped))
    hits = total = 0
    for text, start in zip(texts, starts, strict=True):
        cache = view.allocate_cache(1, len(text))
        output, _ = view.feed(cache, [text], np.zeros(1, dtype=np.int64))
        predicted = output.logits[0, start - 1 : len(text) - 1].argmax(-1)
        hits += int((predicted == np.asarray(text[start:])).sum())
        total += len(text) - start
    return hits / max(total, 1)


def _step(view: DecoderBackend, context: int) -> float:
    """A view's one-token forward at `context` cached tokens, in seconds."""
    return measure_verify_curve(view, (1,), context).seconds[0]


def _point(skipped, agreement: float, cost: float, curve: VerifyCurve, max_chain: int):
    """`skipped`'s best chain length and its predicted speedup."""
    step = curve.seconds[0]

    def speedup(n: int) -> float:
        expected = sum(agreement**i for i in range(n + 1))
        return expected / (curve(n + 1) / step + n * cost)

    chain = max(range(1, max_chain + 1), key=speedup)
    return SkipPoint(tuple(sorted(skipped)), agreement, cost, chain, speedup(chain))
