"""Drafting plans: what a request drafts with, and what an engine keeps per plan.

A plan (`DraftPlan`, keyed by the drafter it builds) owns its pooled drafters and what its
requests taught the controllers: round costs per batch size (the machine's), when asking
pays per batch size and sampling setting, the acceptance per sampling setting (the
target's verdicts), and what the drafter's prefill of a prompt costs. Each outlives a
request; `Plans.reset_drafters` drops only the drafters that learn across requests,
`Plans.forget` everything learnt (but the drafter's timed costs: a property of its
sessions). An engine holds one `Plans`; a server's scheduler draws drafters and
controllers from it too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from specx.drafter_name import DrafterName
from specx.runtime.calibrated import CalibratedChoice, greedy_identity
from specx.runtime.controller import (
    AcceptanceMemory,
    AskingMemory,
    Controller,
    RoundCosts,
    Trial,
    controller_for,
    replayed_guess,
    replays,
)
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.drafters.base import Drafter, IndexesTexts, Prepares, prepare_drafter
from specx.runtime.sampling import SamplingParams
from specx.runtime.speculative_decoding import scratch_of
from specx.runtime.targets.base import DecoderBackend

__all__ = [
    "ASKING_SETTINGS",
    "DraftPlan",
    "DrafterCosts",
    "PlanState",
    "Plans",
    "time_drafter",
]

logger = logging.getLogger("specx")

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


@dataclass(frozen=True)
class DraftPlan:
    """A request's drafting, resolved: drafter options, batch threshold, controller.

    What a request's `Speculation` leaves open comes from the calibration entry nearest
    its sampling setting (`calibrated`, None when none applies): `Engine.plan`.
    """

    drafter: DrafterName
    options: DrafterOptions
    max_batch_spec: int | None
    adaptive: bool
    calibrated: CalibratedChoice | None

    @property
    def key(self) -> tuple:
        """Equal for plans that build the same drafter."""
        return (self.drafter, repr(self.options))


@dataclass
class PlanState:
    """One plan's pooled drafters and learnt state (`Plans`' lock guards it)."""

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
        prefill_s = costs.prefill_s_per_token * tokens
        return Trial(prefill_s, max_new_tokens, costs.step_s, costs.index_s_per_token, tokens)

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
    index_s_per_token: float = 0.0  # a batch row's text indexed at its first ask (suffix)


def time_drafter(drafter: Drafter, tap_width: int) -> DrafterCosts:
    """`drafter`'s prefill per prompt token and one draft step, on a dummy history.

    A history of `TIMED_PREFILL_TOKENS` tokens (taps zeros where it reads them), prefilled
    and drafted from twice, the second timed: the first pays a session's first run at the
    shapes. A short history's per-call overhead makes the prefill dearer per token than a
    prompt's: the estimate errs dear. A drafter without a prefill is not run (model-free
    drafters propose in microseconds); one that indexes a batch's texts at their first ask
    times that itself (`Drafter.time_indexing`).
    """
    index_s = drafter.time_indexing() if isinstance(drafter, IndexesTexts) else 0.0
    prepares = isinstance(drafter, Prepares)  # a flag: the drafter stays typed a Drafter
    if not prepares:
        return DrafterCosts(0.0, 0.0, index_s)
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
    return DrafterCosts(prefill / TIMED_PREFILL_TOKENS, step, index_s)


class Plans:
    """An engine's plans and their states, shared by the threads that decode with them.

    `target`: the engine's decoder, which drafters draft for; `shape`: the build's
    calibrated verify curve, which prices widths not yet timed at batch 1.
    """

    def __init__(self, target: DecoderBackend, threads: int | None, shape=None):
        self.target, self.threads, self.shape = target, threads, shape
        self._states: dict[tuple, PlanState] = {}
        self._lock = threading.Lock()  # guards `_states` and what they hold

    def _state(self, plan: DraftPlan) -> PlanState:
        """`plan`'s state (the caller holds the lock)."""
        return self._states.setdefault(plan.key, PlanState())

    def take(self, plan: DraftPlan):
        """A drafter for `plan` not in use: a pooled one, else a new one (`give_back` it).

        The plan's first drafter is timed (`time_drafter`): what its first draft costs a
        request.
        """
        with self._lock:
            state = self._state(plan)
            if state.idle:
                return state.idle.pop()
            timed = state.drafter_costs is not None
        drafter = make_drafter(plan.drafter, self.target, plan.options)
        if not timed:
            costs = time_drafter(drafter, self.target.tap_width)
            with self._lock:
                state = self._state(plan)
                state.drafter_costs = state.drafter_costs or costs
        return drafter

    def give_back(self, plan: DraftPlan, drafter) -> None:
        """Returns a drafter to the pool for the next request with the same plan."""
        with self._lock:
            self._state(plan).idle.append(drafter)

    def check(self, plan: DraftPlan) -> int:
        """Builds `plan`'s drafter once (pooled), raising SpecxError if it cannot be built.

        Returns the KV slots it needs past a sequence's history (`scratch_of`).
        """
        drafter = self.take(plan)
        self.give_back(plan, drafter)
        return scratch_of(drafter)

    def state(self, plan: DraftPlan) -> PlanState:
        """`plan`'s state, for reading (tests, tools): decoding goes through the methods."""
        with self._lock:
            return self._state(plan)

    def round_costs(self, plan: DraftPlan, batch: int, *, replayed: bool) -> RoundCosts:
        """The round costs `plan`'s requests of `batch` sequences time and share.

        The machine's, not a request's: they outlive `reset_drafters`. The calibrated curve
        prices widths not yet timed at batch 1, where it was measured; elsewhere a guess,
        dear for a drafter that plain steps judge for free (`replayed`: what
        `controller.replays` says of the plan's drafter; the first call makes the costs).
        """
        shape = (self.shape if batch == 1 else None) or (replayed_guess if replayed else None)
        with self._lock:
            return self._state(plan).round_costs(batch, shape)

    def controller(
        self,
        plan: DraftPlan,
        drafter,
        sampling: SamplingParams,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        batch: int | None,
    ) -> Controller | None:
        """A fresh per-round controller for a request (None where drafts are kept whole).

        It starts from what the plan's earlier requests learnt: the round costs of
        `batch`-sequence requests (None: a sequence of a continuous batch, whose rounds
        share forwards with its peers, times none the plan keeps), when asking paid and the
        acceptance at this sampling setting; and it knows what its first draft costs the
        request (`Trial`: the drafter's prefill of `prompts`).
        """
        if not plan.adaptive:
            return None
        costs = None if batch is None else self.round_costs(plan, batch, replayed=replays(drafter))
        with self._lock:
            state = self._state(plan)
            memory = state.asking_memory(batch or 1, sampling)
            acceptance = state.acceptance_memory(sampling)
            trial = state.trial(prompts, max_new_tokens)
        return controller_for(drafter, costs, memory, acceptance, trial)

    def prefilled(self, plan: DraftPlan, seconds: float, tokens: int) -> None:
        """A request's drafter prefilled `tokens` prompt tokens in `seconds`: the new price."""
        with self._lock:
            self._state(plan).prefilled(seconds, tokens)

    def warn_inexact(self, plan: DraftPlan, sampling: SamplingParams) -> None:
        """Warns a greedy request, once per plan, on a build exact for no draft.

        That is a build of greedy identity "none": no draft keeps greedy speculation
        identical to its plain decoding there. Builds exact by rows ("chains") verify
        greedy trees through their spine; sampled decoding promises the target's
        distribution, not its plain run's tokens.
        """
        manifest = self.target.manifest
        if not sampling.greedy or greedy_identity(manifest) != "none":
            return
        with self._lock:
            state = self._state(plan)
            if state.warned:
                return
            state.warned = True
        build = manifest.build
        precision = "" if build is None else f" ({build.precision})"
        logger.warning(
            "the %s build%s keeps greedy speculation identical to its plain decoding for no "
            "draft: its kernels quantize activations on the fly and compute a row alone other "
            "than rows together, so a token can differ where that rounding flips a near-tie "
            "(build with --block-size 32, or --accuracy-level 0)",
            manifest.default_build,
            precision,
        )

    def reset_drafters(self) -> None:
        """Drops the pooled drafters that learn across requests (`Engine.reset_drafters`)."""
        with self._lock:
            for state in self._states.values():
                state.drop_learning_drafters()

    def forget(self) -> None:
        """Forgets what earlier requests taught (`Engine.forget_requests`)."""
        with self._lock:
            self._states = {key: state.forget() for key, state in self._states.items()}
