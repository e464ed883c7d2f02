"""What an engine keeps per drafting plan across its requests, in one place.

A plan (`engine.DraftPlan`, keyed by the drafter it builds) owns its pooled drafters and
what its requests taught the controllers: round costs per batch size (the machine's),
when asking pays per batch size and sampling setting, the acceptance per sampling setting
(the target's verdicts), and what the drafter's prefill of a prompt costs. Each outlives a
request; `reset_drafters` drops only the drafters that learn across requests,
`forget` everything learnt (but the drafter's timed costs: a property of its sessions).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from specx.runtime.controller import AcceptanceMemory, AskingMemory, RoundCosts, Trial
from specx.runtime.drafters.base import prepare_drafter
from specx.runtime.sampling import SamplingParams
from specx.runtime.speculative_decoding import scratch_of

__all__ = ["ASKING_SETTINGS", "DrafterCosts", "PlanState", "time_drafter"]

# Sampling settings a plan remembers `AskingMemory` and `AcceptanceMemory` for at once (a
# server's clients may send any temperature); past it the plan starts over.
ASKING_SETTINGS = 256

# Tokens of the dummy history a drafter is first timed on (`time_drafter`).
TIMED_PREFILL_TOKENS = 16

Remembered = TypeVar("Remembered")


def _setting(sampling: SamplingParams) -> tuple:
    """What a request's sampling setting is for what a plan remembers: the seed aside."""
    return sampling.temperature, sampling.top_k, sampling.top_p


def _remembered(
    store: dict[tuple, Remembered], key: tuple, make: Callable[[], Remembered]
) -> Remembered:
    """`store[key]`, made if absent; a store full of `ASKING_SETTINGS` starts over."""
    if key not in store and len(store) >= ASKING_SETTINGS:
        store.clear()  # bounded, whatever settings clients send
    return store.setdefault(key, make())


@dataclass
class PlanState:
    """One plan's pooled drafters and learnt state (the engine's pool lock guards it)."""

    idle: list[Any] = field(default_factory=list)  # drafters not in use
    costs: dict[int, RoundCosts] = field(default_factory=dict)  # per batch size
    asking: dict[tuple, AskingMemory] = field(default_factory=dict)  # (batch, setting)
    acceptance: dict[tuple, AcceptanceMemory] = field(default_factory=dict)  # setting
    # The drafter's prefill per prompt token and one draft step, timed once on a dummy
    # history; the prefill then as each request found it (None: not timed yet).
    drafter_costs: DrafterCosts | None = None
    warned: bool = False  # the inexact-build warning was given for this plan

    def round_costs(self, batch: int, shape: Callable[[int], float] | None) -> RoundCosts:
        """The round costs requests of `batch` sequences time and share."""
        return self.costs.setdefault(batch, RoundCosts(shape=shape))

    def asking_memory(self, batch: int, sampling: SamplingParams) -> AskingMemory:
        """When requests of `batch` sequences at this sampling setting start asking."""
        return _remembered(self.asking, (batch, *_setting(sampling)), AskingMemory)

    def acceptance_memory(self, sampling: SamplingParams) -> AcceptanceMemory:
        """The acceptance requests at this sampling setting learn and start from."""
        return _remembered(self.acceptance, _setting(sampling), AcceptanceMemory)

    def trial(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Trial | None:
        """What a request's first draft costs before any (None: the drafter is not timed)."""
        costs = self.drafter_costs
        if costs is None:
            return None
        tokens = sum(map(len, prompts))
        return Trial(costs.prefill_s_per_token * tokens, max_new_tokens, costs.step_s)

    def prefilled(self, seconds: float, tokens: int) -> None:
        """A request's drafter prefilled `tokens` prompt tokens in `seconds`."""
        if seconds > 0 and tokens > 0 and self.drafter_costs is not None:
            self.drafter_costs = replace(self.drafter_costs, prefill_s_per_token=seconds / tokens)

    def drop_learning_drafters(self) -> None:
        """Drops the idle drafters that learn across requests (suffix drafting's trie)."""
        self.idle[:] = [d for d in self.idle if not getattr(d, "learns_across_requests", True)]

    def forget(self) -> PlanState:
        """A state that learnt nothing, with the idle drafters that learn nothing kept."""
        self.drop_learning_drafters()
        return PlanState(idle=self.idle, drafter_costs=self.drafter_costs)


@dataclass(frozen=True)
class DrafterCosts:
    """A drafter's costs as timed on a dummy history (`time_drafter`)."""

    prefill_s_per_token: float  # its deferred prefill (`prepare`); 0 without one
    step_s: float  # one proposal of one node for one sequence


def time_drafter(drafter, tap_width: int) -> DrafterCosts:
    """`drafter`'s prefill per prompt token and one draft step, on a dummy history.

    A history of `TIMED_PREFILL_TOKENS` tokens (taps zeros where it reads them), prefilled
    and drafted from twice, the second timed: the first pays a session's first run at the
    shapes. A short history's per-call overhead makes the prefill dearer per token than a
    prompt's: the estimate errs dear. A drafter without a prefill is not run (model-free
    drafters propose in microseconds).
    """
    if getattr(drafter, "prepare", None) is None:
        return DrafterCosts(0.0, 0.0)
    history = [1] * (TIMED_PREFILL_TOKENS + 1)
    taps = None
    if drafter.taps != "none":
        taps = [np.zeros((TIMED_PREFILL_TOKENS, tap_width), np.float32)]
    rng, active = np.random.default_rng(0), np.ones(1, dtype=bool)
    prefill = step = 0.0
    for _ in range(2):
        drafter.start([history[:-1]], len(history) + scratch_of(drafter), taps)
        prefill = prepare_drafter(drafter, [history])
        started = time.perf_counter()
        drafter.propose([history], active, SamplingParams(), rng, budget=1)
        step = time.perf_counter() - started
    return DrafterCosts(prefill / TIMED_PREFILL_TOKENS, step)
