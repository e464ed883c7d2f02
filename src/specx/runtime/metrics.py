"""What a decoding run measured, in the units users compare across systems.

Typed end to end: the decoding loops build a `RunStats` (counts and timings, the same rule
for plain and speculative decoding), whose `speculative` part (`SpeculativeStats`) holds a
speculative run's acceptance (`AcceptanceSummary`, merged and per row), its draft and
verify time and what its controller chose (`ControllerSummary`). `to_json` gives the
JSON-ready dict `specx generate --json` and the benchmarks print (docs/cli.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = [
    "AcceptanceStats",
    "AcceptanceSummary",
    "ControllerSummary",
    "RunStats",
    "SpeculativeStats",
]


@dataclass(frozen=True)
class AcceptanceSummary:
    """A sequence's (or a batch's merged) rounds and what the target accepted of them."""

    rounds: int
    rounds_with_draft: int
    acceptance_length: float  # tau: mean tokens emitted per round, bonus counted; 0 unrun
    accepted_tokens: int
    acceptance_by_position: tuple[float, ...]  # [depth]
    conditional_acceptance_by_position: tuple[float, ...]  # [depth]

    def to_json(self) -> dict[str, Any]:
        """JSON-ready numbers."""
        return {
            "rounds": self.rounds,
            "rounds_with_draft": self.rounds_with_draft,
            "acceptance_length": self.acceptance_length,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_by_position": list(self.acceptance_by_position),
            "conditional_acceptance_by_position": list(self.conditional_acceptance_by_position),
        }


@dataclass
class AcceptanceStats:
    """Per round: the draft's depth and how many draft tokens the target accepted.

    acceptance length (tau) = mean tokens emitted per round = mean(accepted) + 1, the
    bonus/correction token counted, so plain decoding has tau = 1.
    acceptance_by_position[d-1] = P(accepted >= d | the draft reached depth d).
    conditional_acceptance_by_position[d-1] = P(accepted >= d | accepted >= d-1, depth >= d).
    """

    depths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def record(self, draft_depth: int, accepted: int) -> None:
        """Adds one round."""
        self.depths.append(draft_depth)
        self.accepted.append(accepted)

    def record_plain(self, rounds: int) -> None:
        """Adds `rounds` rounds without a draft."""
        self.depths += [0] * rounds
        self.accepted += [0] * rounds

    @classmethod
    def merge(cls, parts: Iterable[AcceptanceStats]) -> AcceptanceStats:
        """All rounds of several sequences."""
        merged = cls()
        for part in parts:
            merged.depths += part.depths
            merged.accepted += part.accepted
        return merged

    def summary(self) -> AcceptanceSummary:
        """The rounds so far, summed up."""
        depths, accepted = np.array(self.depths, int), np.array(self.accepted, int)
        rounds = len(depths)
        max_depth = int(depths.max()) if rounds else 0
        by_position, conditional = [], []
        for d in range(1, max_depth + 1):
            reached = depths >= d
            by_position.append(float((accepted[reached] >= d).mean()))
            tried = reached & (accepted >= d - 1)
            conditional.append(float((accepted[tried] >= d).mean()) if tried.any() else 0.0)
        return AcceptanceSummary(
            rounds=rounds,
            rounds_with_draft=int((depths > 0).sum()),
            acceptance_length=float(accepted.mean() + 1) if rounds else 0.0,
            accepted_tokens=int(accepted.sum()),
            acceptance_by_position=tuple(by_position),
            conditional_acceptance_by_position=tuple(conditional),
        )


@dataclass(frozen=True)
class ControllerSummary:
    """What a per-round controller (`specx.runtime.controller`) chose over a run."""

    name: str  # "fixed" | "adaptive" | "confidence"
    sizes_chosen: Mapping[int, int]  # draft size -> rows given it, summed over rounds

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: the controller's name and its sizes (keys become strings in JSON)."""
        return {"controller": self.name, "sizes_chosen": dict(self.sizes_chosen)}


@dataclass(frozen=True)
class SpeculativeStats:
    """What a speculative run measured besides `RunStats`' counts and timings."""

    drafter: str
    draft_s: float  # proposing, over every round
    # The drafter's deferred prefill of the prompt (`Drafter.prepare`, once per request): a
    # cost of the request, like the target's prefill, not of any round.
    draft_prefill_s: float
    verify_s: float  # the rounds' target forwards (verify forwards and plain steps)
    acceptance: AcceptanceSummary  # every row's rounds, merged
    controller: ControllerSummary | None  # None: every draft kept whole
    per_request: tuple[AcceptanceSummary, ...] = field(repr=False)  # [batch]


@dataclass(frozen=True)
class RunStats:
    """One decoding run (a batch shares it): the same rule for plain and speculative decoding.

    The prefill emits each sequence's first token; every later token is a decoded one.
    `ms_per_token` = decode time / decoded tokens over the whole batch (so at batch 1 the
    time per token one user waits, and at batch B its batch-wide rate); `ms_per_step` =
    decode time / target forwards after the prefill (one token per sequence for plain
    decoding, one verified tree per sequence for speculative decoding).
    """

    batch: int
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    target_forwards: int  # after the prefill
    decode_s: float
    total_s: float
    tokens_per_s: float
    ms_per_token: float
    ms_per_step: float
    speculative: SpeculativeStats | None = None  # None: decoded plainly
    speculation_off: str | None = None  # why a speculative request decoded plainly ("off: ...")

    @classmethod
    def measure(
        cls,
        prompts: Sequence[Sequence[int]],
        tokens: Sequence[Sequence[int]],
        prefill_s: float,
        total_s: float,
        decode_forwards: int,
        speculative: SpeculativeStats | None = None,
    ) -> RunStats:
        """The stats of a run that generated `tokens` [batch][new] for `prompts` [batch][P]."""
        batch, new_tokens = len(prompts), sum(len(t) for t in tokens)
        decode_s = total_s - prefill_s
        return cls(
            batch=batch,
            prompt_tokens=sum(len(p) for p in prompts),
            new_tokens=new_tokens,
            prefill_s=prefill_s,
            target_forwards=decode_forwards,
            decode_s=decode_s,
            total_s=total_s,
            tokens_per_s=new_tokens / total_s,
            ms_per_token=1e3 * decode_s / max(new_tokens - batch, 1),
            ms_per_step=1e3 * decode_s / max(decode_forwards, 1),
            speculative=speculative,
        )

    @property
    def mode(self) -> Literal["plain", "speculative"]:
        """The run's mode: "speculative" where it drafted (`speculative`), else "plain"."""
        return "plain" if self.speculative is None else "speculative"

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: the keys `specx generate --json` prints (docs/cli.md), in its order."""
        spec = self.speculative
        out: dict[str, Any] = {"mode": self.mode}
        if spec is not None:
            out["drafter"] = spec.drafter
        out |= {
            "batch": self.batch,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "prefill_s": self.prefill_s,
        }
        if spec is not None:
            out |= {
                "draft_s": spec.draft_s,
                "draft_prefill_s": spec.draft_prefill_s,
                "verify_s": spec.verify_s,
            }
        out |= {
            "target_forwards": self.target_forwards,
            "decode_s": self.decode_s,
            "total_s": self.total_s,
            "tokens_per_s": self.tokens_per_s,
            "ms_per_token": self.ms_per_token,
            "ms_per_step": self.ms_per_step,
        }
        if spec is not None:
            out |= spec.acceptance.to_json()
            if spec.controller is not None:
                out |= spec.controller.to_json()
            out["per_request"] = [s.to_json() for s in spec.per_request]
        if self.speculation_off is not None:
            out["speculation"] = self.speculation_off
        return out
