"""`LOOKUP+KIND` drafting: a model-free continuation where the text has one, a model elsewhere.

`ngram+eagle3`, `suffix+eagle3`, `ngram+skip`, ...: the seed's section 7.1 (n-gram with
EAGLE). Copied text (RAG answers, edits, summaries, code rewritten) is drafted by looking it
up, for free and often many tokens deep; free text by the model. Each round and row the
lookup drafts first; a row it drafts for verifies that draft, the rest the model's. The
model still follows every row (its `accept` gets the target's taps of whatever was accepted,
whoever drafted it), so it drafts from the right features when the lookup falls silent.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specx.runtime.drafters.base import Drafter, prepare_drafter
from specx.runtime.sampling import SamplingParams
from specx.runtime.trees import DraftTree

__all__ = ["CombinedDrafter"]


class CombinedDrafter:
    """`lookup`'s draft for the rows it finds one for, `model`'s for the others."""

    sizes_own_drafts = False

    def __init__(self, lookup: Drafter, model: Drafter):
        self.lookup, self.model = lookup, model
        self.name = f"{lookup.name}+{model.name}"
        self.taps = model.taps
        self.max_nodes = max(lookup.max_nodes, model.max_nodes)
        self.scratch_slots = max(lookup.scratch_slots, model.scratch_slots)
        self.learns_across_requests = any(
            getattr(d, "learns_across_requests", True) for d in (lookup, model)
        )
        self.shape = getattr(model, "shape", None)  # what the model drafts, for the stats
        self.looked_up = self.modelled = 0  # rows drafted by each, for the stats
        self._modelled = np.zeros(0, bool)  # rows whose last draft was the model's

    def start(
        self, prompts: Sequence[Sequence[int]], capacity: int, taps: list[np.ndarray] | None
    ) -> None:
        """Starts both on the batch."""
        self.lookup.start(prompts, capacity, taps)
        self.model.start(prompts, capacity, taps)

    def prepare(self, histories: Sequence[Sequence[int]]) -> None:
        """Both drafters' deferred prefills (the model's, usually)."""
        prepare_drafter(self.lookup, histories)
        prepare_drafter(self.model, histories)

    def propose(
        self,
        histories: Sequence[Sequence[int]],
        active: np.ndarray,
        sampling: SamplingParams,
        rng: np.random.Generator,
        budget: int | None = None,
    ) -> list[DraftTree]:
        """The lookup's drafts, and the model's for the active rows it left empty."""
        found = self.lookup.propose(histories, active, sampling, rng, budget)
        rest = np.array([a and not len(t) for a, t in zip(active, found, strict=True)], bool)
        self.looked_up += int(np.asarray(active, bool).sum() - rest.sum())
        self._modelled = rest
        if not rest.any():
            return found
        self.modelled += int(rest.sum())
        modelled = self.model.propose(histories, rest, sampling, rng, budget)
        return [m if r else f for f, m, r in zip(found, modelled, rest, strict=True)]

    def accept(
        self, row: int, draft: DraftTree, accepted: list[int], taps: np.ndarray | None
    ) -> None:
        """Both follow the row.

        The model is told of a draft it did not make as of a plain step: it keeps the
        target's taps, and its own catch-up reads the accepted tokens from the history.
        """
        self.lookup.accept(row, draft, accepted, taps)
        if row < len(self._modelled) and self._modelled[row]:
            self.model.accept(row, draft, accepted, taps)
        else:
            self.model.accept(row, DraftTree.empty(), [], taps)
