"""What a controller remembers across an engine's requests: acceptance, when asking pays."""

from __future__ import annotations

from dataclasses import dataclass, field

from specx.runtime.controller.base import learnt

__all__ = ["AcceptanceMemory", "AskingMemory"]


@dataclass
class AcceptanceMemory:
    """p_d over an engine's requests with one drafter and sampling setting: where rows start.

    An engine keeps one per drafting plan and sampling setting (`plans.PlanState`). Every
    verdict an `AdaptiveController` learns from moves it too (per depth, the mean of the
    prior and the evidence, then a moving average slower than a row's own), and a
    sequence decoded alone (a request of one, or a row of a continuous batch) starts from
    it rather than from the flat prior: where drafts mostly miss (n-gram at T = 1) a
    request that started at the prior spent its first round on a draft and its next on
    the slower step after it; where they mostly hold it drafts at once, as deep as they
    held. The rows of a batch start from the prior (docs/decisions.md#acceptance-memory).
    """

    prior: float = 0.5
    depths: int = 16
    smoothing: float = 0.05
    accept: list[float] = field(init=False)  # p_d per depth (index 0: the first)
    judged: list[int] = field(init=False)  # verdicts at each depth

    def __post_init__(self) -> None:
        # Fixed length: requests decoding in other threads update it in place.
        self.accept = [self.prior] * self.depths
        self.judged = [0] * self.depths

    def learn(self, depth: int, hit: bool) -> None:
        """The target judged a node at `depth` (0: the first) and accepted it or not."""
        if depth < self.depths:
            self.judged[depth] += 1
            self.accept[depth] = learnt(self.accept[depth], self.judged[depth], hit, self.smoothing)


@dataclass
class AskingMemory:
    """When the next window of asking opens, counted in rounds across an engine's requests.

    An engine keeps one per drafting plan, batch size and sampling setting
    (`plans.PlanState`). Where drafts do not pay (suffix drafting at T > 0 on a small
    target), each window of asking costs a few plain steps: the probe round, wider than a
    plain step, and the slower first step after it (docs/decisions.md#asking-memory).
    So the wait between windows is one countdown that goes on from request to request:
    a window that ended in a request without a round that paid doubles `interval` (up to
    `max_interval`, past one request's `max_probe_every`) and sets the next probe that many
    rounds on, whichever request plays them; a round whose accepted tokens beat its time
    sets both back to 0, and the next request asks after its first plain rounds. Short
    requests that end before the probe bring it nearer for the next ones; one that ends
    inside a window leaves the next request the interval from the window's opening.
    """

    max_interval: int = 256
    rounds: int = 0  # rounds played by the requests of this memory
    probe_at: int = 0  # the value of `rounds` at which the next window opens (0: now)
    interval: int = 0  # rounds between windows that did not pay (0: the last one paid)

    def start(self) -> int:
        """A request starts: rounds before its first window of asking (0: none to wait)."""
        return max(0, self.probe_at - self.rounds)

    def played(self, rounds: int) -> None:
        """A request played `rounds` more rounds."""
        self.rounds += rounds

    def opened(self) -> None:
        """A window opened: a request that starts before it closes waits out the interval."""
        self.probe_at = max(self.probe_at, self.rounds + self.interval)

    def paid(self) -> None:
        """A round of asking paid: the next request asks at once."""
        self.probe_at = self.interval = 0

    def lost(self, interval: int) -> int:
        """A window that paid nothing ended: the rounds until the next (at least `interval`)."""
        self.interval = min(max(2 * self.interval, interval), self.max_interval)
        self.probe_at = self.rounds + self.interval
        return self.interval
