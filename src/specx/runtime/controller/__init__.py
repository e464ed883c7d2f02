"""Per-round draft sizes: speculation that backs off where it does not pay, and comes back.

A drafter proposes up to `max_nodes` nodes per sequence; a controller decides each round
how many of them each sequence keeps: 0 (no draft: the sequence takes a plain step) up to
all. The kept nodes are a prefix of the draft (parents precede children, so a prefix is a
tree, and a chain's prefix is a shorter chain). `controller_for` picks one of two rules by
the drafter: a drafter that costs a forward per depth is sized before it drafts
(`AdaptiveController`); one that drafts in microseconds with confidences (suffix decoding,
`sizes_own_drafts`) drafts whole and is trimmed after (`ConfidenceController`).

Lossless whatever the sizes: a size depends only on rounds already verified, the draft's
shape and, for a deterministic draft (itself a function of the history), its confidences;
never on what the target will say about it. Verification is unchanged, and dropping nodes
chosen independently of their tokens' draws leaves the rest drafted as the rule assumes.
`tests/test_controller.py` forces a switch every round and checks greedy identity;
`tests/test_distribution.py` the sampled distribution, with switching and with trimming.

`AdaptiveController`, per sequence b and round: with p_d the running acceptance at depth d
given depth d - 1 accepted (over b's own rounds: the mean of a weak prior and the evidence
at first, then an exponential moving average) and a round cost model T(k) learnt from the
loop's own timings (an engine's requests share one),

    k* = argmax_k (1 + q sum_{d <= k} p_1 ... p_d) / (q T(k) + (1 - q) T_ask),
    T(0) = a plain step, q the share of b's asks that found a draft (1 for a model),
    T_ask a round whose ask found none,

over k in {0, 1, 2, 4, ...} up to the drafter's budget. In a batch every row uses the
lowest p_d among the active rows: the batch finishes with its slowest row, so a draft
size pays only if it pays for that one. With P peers (sequences of the same forward that
have controllers of their own, as in continuous batching), the rate is the forward's:
(P + 1 + sum ...) / T(k) against (P + 1) / T(0), since every peer waits for this draft.
A sequence at k = 0 is probed with a one-node draft now and then, so one that becomes
predictable gets speculation back.

A drafter whose drafts are functions of the history alone (n-gram, suffix decoding) is
replayed instead at the last plain steps of each stretch (`Replay`, `Drafter.replay`): its
draft there, judged by the tokens the steps emitted, is learnt from as a verified round
(greedily the same verdict; when sampling, the same law), and its rows decide at their
probe without paying for one (suffix decoding's rows only where they decode alone: see
`ConfidenceController.idled`). On pyref-7m's first requests at T = 1, batch 1, where most
asks had found nothing or been rejected, n-gram went from 0.87x to 0.94x plain and suffix
decoding from 0.88x to 0.94x (docs/decisions.md#replays).

Never losing without calibration is the controllers' job, from a request's first round:
what they assume before measuring is cheap to be wrong about (plain first rounds, one-node
first drafts, a weak prior that the first misses overrule, a batch's first probe or window
of asking only once it is affordable, the indexing of every row's text it forces included
where the drafter defers that (suffix drafting), a drafter's prefill paid only where the
request's rest is expected to repay it twice: `Trial`; where replays judge the drafter for
free, a round with a draft priced dear until one is timed: `costs.replayed_guess`), and
rounds in which no row drafts are played by plain decoding's own loop (`idle_rounds`), so an
idle speculative request costs what a plain one does. Both rules remember across an engine's
requests at one setting: the sized rule the acceptance its rows start from
(`AcceptanceMemory`), suffix drafting's rule when asking last paid (`AskingMemory`), so
that a setting where drafts lose stops paying for them.
Calibration adds the batch threshold and the tree. Starting from a calibration's recorded
acceptance and costs instead was measured worse (docs/decisions.md#no-start-from-calibration): its
prompts misjudge a given request more than a measured plain round and a one-node probe.
"""

from __future__ import annotations

from specx.runtime.controller.adaptive import AdaptiveController
from specx.runtime.controller.base import (
    Controller,
    FixedSizes,
    Replay,
    Schedule,
    Stretch,
    Trial,
    truncated,
)
from specx.runtime.controller.confidence import ConfidenceController
from specx.runtime.controller.costs import RoundCosts, replayed_guess
from specx.runtime.controller.memories import AcceptanceMemory, AskingMemory
from specx.runtime.drafters.base import Replays

__all__ = [
    "AcceptanceMemory",
    "AdaptiveController",
    "AskingMemory",
    "ConfidenceController",
    "Controller",
    "FixedSizes",
    "Replay",
    "RoundCosts",
    "Schedule",
    "Stretch",
    "Trial",
    "controller_for",
    "replayed_guess",
    "replays",
    "truncated",
]


def controller_for(
    drafter,
    costs: RoundCosts | None = None,
    memory: AskingMemory | None = None,
    acceptance: AcceptanceMemory | None = None,
    trial: Trial | None = None,
) -> Controller:
    """A fresh per-round controller suited to `drafter` (see the two rules above).

    `costs`: round costs earlier requests timed, which `AdaptiveController` starts from and
    goes on updating (suffix drafting's rule learns its own). `memory`: when earlier
    requests' windows of asking last paid, for suffix drafting's rule only
    (`AdaptiveController` with it lost n-gram's greedy gains: docs/decisions.md#asking-memory).
    `acceptance`: the p_d earlier requests found, where `AdaptiveController`'s lone rows start.
    A drafter that `replays` prices a round not yet timed dear (`costs.replayed_guess`):
    `costs` are made so by `Plans`, suffix drafting's own here.
    `trial`: what the request's first draft costs it (a drafter that sizes its own drafts has
    no prefill, but may index a batch's texts at its first ask).
    """
    if getattr(drafter, "sizes_own_drafts", False):  # absent on drafters written before it
        own = RoundCosts(shape=replayed_guess if replays(drafter) else None)
        return ConfidenceController(memory=memory, costs=own, trial=trial)
    return AdaptiveController(costs=costs, acceptance=acceptance, trial=trial)


def replays(drafter) -> bool:
    """Whether plain steps judge `drafter`'s drafts for free (`Drafter.replay`)."""
    return isinstance(drafter, Replays)
