"""The drafters training distils: one object per kind behind `DrafterKind`, and their registry.

Everything `train_drafter` does differently for a kind is its object's: which
`TrainConfig` fields apply to it, what it needs of the target, how a new one is built (or
a saved one loaded to train on), its loss, its distributions by draft depth for the
held-out acceptance estimate, and how it is written in its public format. The loop
(`specx.training.loop`) is the same for every kind; `specx train KIND` looks KIND up here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from specx.errors import SpecxError
from specx.export.checkpoint import Checkpoint
from specx.export.config import TargetConfig
from specx.training.draft_model import DraftModelKind
from specx.training.eagle3 import Eagle3Kind
from specx.training.heads import EagleKind, MedusaKind, MTPKind
from specx.training.teacher import TeacherOutput

if TYPE_CHECKING:
    from specx.training.config import Inputs, TrainConfig

__all__ = ["KINDS", "KIND_OPTIONS", "DrafterKind", "drafter_kind"]


class DrafterKind(Protocol):
    """One kind of drafter, as training builds, trains, measures and saves it."""

    name: str  # as `specx train KIND` and the report name it
    options: frozenset[str]  # the TrainConfig fields, of KIND_OPTIONS, that apply to it

    def check(self, target: TargetConfig) -> None:
        """Refuses a target this kind cannot be trained for, before any weights are read."""
        ...

    def load(self, directory: Path, checkpoint: Checkpoint) -> torch.nn.Module:
        """A saved drafter of this kind (public format) to train on, checked against the target."""
        ...

    def build(
        self, given: Inputs, init: torch.nn.Module | None
    ) -> tuple[torch.nn.Module, dict[str, Any]]:
        """The drafter to train (`init`, or a new one) and what the report says of it."""
        ...

    def loss(
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, cfg: TrainConfig
    ) -> torch.Tensor:
        """The distillation loss of a batch of windows [B, T]."""
        ...

    def depths(
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, depth: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(q, p) per draft depth, up to `depth`: the drafter's and the target's distributions.

        Depth d's q is the drafter's distribution of x_{t+d+1} for a chain rooted after x_t
        whose first d - 1 tokens were accepted (they are the window's own tokens), on the
        target's vocabulary; p is the target's.
        """
        ...

    def save(self, model: Any, directory: Path, checkpoint: Checkpoint, tokenizer: Path) -> None:
        """Writes the trained drafter in its public format (what `specx export` reads)."""
        ...


KINDS: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (Eagle3Kind(), EagleKind(), MedusaKind(), MTPKind(), DraftModelKind())
}
# The TrainConfig fields that apply to some kinds only.
KIND_OPTIONS = frozenset().union(*(kind.options for kind in KINDS.values()))


def drafter_kind(name: str) -> DrafterKind:
    """The kind called `name`.

    Raises:
        SpecxError: no kind has that name (the message lists those that do).
    """
    try:
        return KINDS[name]
    except KeyError:
        raise SpecxError(f"unknown drafter {name!r}; choose one of {', '.join(KINDS)}") from None
