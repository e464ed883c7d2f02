"""The protocol every drafter implements."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from specx.runtime.sampling import SamplingParams
from specx.runtime.trees import DraftTree

__all__ = ["Drafter", "IndexesTexts", "Prepares", "Replays", "prepare_drafter"]


class Drafter(Protocol):
    """Proposes a draft tree per sequence each round and follows what was accepted.

    `histories[b]` is sequence b's prompt plus every emitted token; its last token is
    the root the draft hangs off.
    """

    name: str
    max_nodes: int  # the most draft nodes proposed for one sequence in one round
    taps: str  # the target taps it reads: "none", "last" or "eagle3"
    scratch_slots: int  # KV slots its own model writes past the history while drafting
    # Proposing costs microseconds and every draft is deterministic, best first, with
    # confidences: a controller trims the whole draft (`ConfidenceController`) rather than
    # asking for a size before it. Optional: absent means False.
    sizes_own_drafts: bool
    # Its proposals depend on earlier requests (suffix drafting's shared trie), so
    # `Engine.reset_drafters` drops it. Optional: absent means True (it may remember).
    learns_across_requests: bool
    # Optional capabilities, each a protocol below: `Prepares`, `Replays`, `IndexesTexts`.

    def start(
        self, prompts: Sequence[Sequence[int]], capacity: int, taps: list[np.ndarray] | None
    ) -> None:
        """Resets state for a new batch needing up to `capacity` slots.

        `taps[b]` [P_b, W] are the target's hidden-state taps of prompt b (None when the
        target exports none).
        """
        ...

    def propose(
        self,
        histories: Sequence[Sequence[int]],
        active: np.ndarray,  # [B] bool; inactive sequences get an empty draft
        sampling: SamplingParams,
        rng: np.random.Generator,
        budget: int | None = None,
    ) -> list[DraftTree]:
        """One draft tree per sequence.

        `budget`: the most nodes of any row the caller will keep this round (it keeps a
        prefix of each tree); a drafter may stop there, drafting the same prefix it would
        have drafted anyway. None: no limit.
        """
        ...

    def accept(
        self, row: int, draft: DraftTree, accepted: list[int], taps: np.ndarray | None
    ) -> None:
        """Tells the drafter which nodes of `draft` the target accepted for `row`.

        `taps` [n, W] are the target's taps of the tokens whose KV the target kept since
        the last call: the root and the accepted nodes (n = 1 + len(accepted)) or, after a
        stretch of plain steps (`draft` empty), the root of each step. The caller does not
        reuse `taps`' memory, so a drafter may keep the array rather than copy it.
        """
        ...


@runtime_checkable
class Prepares(Protocol):
    """A drafter whose `start` defers work (a model's prefill of the prompts) to `prepare`.

    The loops call it once per request, before its first proposal and outside that round's
    timing: a request that never drafts never pays it, its first token does not wait for it,
    and a controller prices a round's drafting, not a prefill.
    """

    def prepare(self, histories: Sequence[Sequence[int]]) -> None: ...  # noqa: D102


@runtime_checkable
class Replays(Protocol):
    """A drafter whose drafts are deterministic functions of the history (n-gram, suffix).

    `replay(row, history, positions)` -> [(position, draft)]: the draft it would have
    proposed for `row` had the history ended before each position (ascending), from
    `history[:position]` alone, for the positions past what it has seen; it then stands as
    after seeing them. Plain steps then judge its drafts for free (`controller.Replay`).
    """

    def replay(  # noqa: D102
        self, row: int, history: Sequence[int], positions: Sequence[int]
    ) -> list[tuple[int, DraftTree]]: ...


@runtime_checkable
class IndexesTexts(Protocol):
    """A drafter that indexes a batch's texts at its first proposal (suffix drafting).

    `time_indexing()`: the seconds a token of a row's text costs, timed on a dummy; a
    controller prices that first ask with it (`ConfidenceController._first_batch_window`).
    """

    def time_indexing(self) -> float: ...  # noqa: D102


def prepare_drafter(drafter: Drafter, histories: Sequence[Sequence[int]]) -> float:
    """Runs the drafter's deferred prefill (`prepare`, optional); the seconds it took.

    The loops call it once per request, before its first proposal, and keep the seconds out
    of that round's drafting time.
    """
    if not isinstance(drafter, Prepares):
        return 0.0
    started = time.perf_counter()
    drafter.prepare(histories)
    return time.perf_counter() - started
