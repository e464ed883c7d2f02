"""Measured speedup of a drafter over plain decoding, robust to a busy machine.

    speedup = sum_p min_r plain(p, r) / sum_p min_r speculative(p, r)

Each prompt (or batch of prompts) is decoded plainly and then speculatively, back to back,
`repeats` times; each keeps its fastest decode time. Interference from other work on the
machine only ever adds time, so the minimum is the least disturbed run, and decoding the
pair back to back keeps slow drifts (thermal, background load) out of the ratio. Greedy
decoding emits the same tokens in both modes, so the two times are per the same tokens.
On this project's 2-core machine single runs of the same candidate moved widely; the
fastest of three moved far less (docs/decisions.md#timing-back-to-back).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specx.runtime.controller import Controller
from specx.runtime.drafters.base import Drafter
from specx.runtime.metrics import AcceptanceSummary
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.sampling import SamplingParams
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets.base import DecoderBackend

__all__ = ["PairedTiming", "measure_speedup"]


@dataclass(frozen=True)
class PairedTiming:
    """Plain and speculative decode time of the same prompts, fastest of the repeats."""

    plain_s: float
    speculative_s: float
    tokens: int  # emitted after each prompt's first token (what the decode times cover)
    acceptance_length: float  # mean tokens per round, bonus token counted
    identical: bool  # the speculative tokens equal the plain ones, every repeat

    @property
    def speedup(self) -> float:
        """Plain time over speculative time for the same tokens."""
        return self.plain_s / self.speculative_s

    @property
    def plain_ms_per_token(self) -> float:  # noqa: D102
        return 1e3 * self.plain_s / self.tokens

    @property
    def speculative_ms_per_token(self) -> float:  # noqa: D102
        return 1e3 * self.speculative_s / self.tokens


def measure_speedup(
    target: DecoderBackend,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    repeats: int = 3,
    batch: int = 1,
    sampling: SamplingParams | None = None,
    new_drafter: Callable[[], Drafter] | None = None,
    new_controller: Callable[[Drafter, Sequence[Sequence[int]]], Controller | None] | None = None,
) -> PairedTiming:
    """Plain vs speculative decoding of `prompts`, `batch` at a time (see module doc).

    Greedy by default; with `sampling` both sides sample with its seed (`identical` then
    compares the sampled tokens, which a lossless loop need not reproduce). `new_drafter`:
    a fresh drafter for every speculative run instead of `drafter` (one that learns across
    requests, as suffix drafting does, would otherwise have seen the prompt's output in an
    earlier repeat); `drafter` may then be None. `new_controller(drafter, prompts)`: a fresh
    controller for every speculative run, sizing its drafts as the engine's do (without
    one every round keeps its whole draft).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    groups = [list(prompts[i : i + batch]) for i in range(0, len(prompts), batch)]
    plain_s = [float("inf")] * len(groups)
    speculative_s = [float("inf")] * len(groups)
    tokens, identical = 0, True
    acceptance: list[AcceptanceSummary] = []  # each group's, of the first repeat
    for repeat in range(repeats):
        for g, group in enumerate(groups):
            plain = generate_plain(target, group, max_new_tokens, sampling)
            fresh = drafter if new_drafter is None else new_drafter()
            if fresh is None:
                raise ValueError("measure_speedup needs a drafter or new_drafter")
            controller = None if new_controller is None else new_controller(fresh, group)
            spec = generate_speculative(
                target, fresh, group, max_new_tokens, sampling, controller=controller
            )
            plain_s[g] = min(plain_s[g], plain.stats.decode_s)
            speculative_s[g] = min(speculative_s[g], spec.stats.total_s - spec.stats.prefill_s)
            identical &= spec.tokens == plain.tokens
            if repeat == 0:
                tokens += max(plain.stats.new_tokens - len(group), 1)
                assert spec.stats.speculative is not None  # no max_batch_spec: it speculated
                acceptance.append(spec.stats.speculative.acceptance)
    # Mean tokens per round over every row's rounds (AcceptanceStats' rule, merged).
    rounds = sum(a.rounds for a in acceptance)
    emitted = sum(a.acceptance_length * a.rounds for a in acceptance)
    return PairedTiming(
        plain_s=sum(plain_s),
        speculative_s=sum(speculative_s),
        tokens=tokens,
        acceptance_length=emitted / rounds if rounds else 0.0,
        identical=identical,
    )
