"""`Speculation`: how a request asks to draft; `plan_for`: that request's drafting, resolved.

What a request leaves open comes from the artifact's calibration entry nearest its sampling
setting (`specx.runtime.calibrated`), else the drafter's defaults; what it names itself wins,
and then nothing of the calibration applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specx.artifact import Manifest
from specx.drafter_name import DrafterName
from specx.runtime.calibrated import calibrated_choice
from specx.runtime.drafters import DrafterOptions
from specx.runtime.plans import DraftPlan
from specx.runtime.sampling import SamplingParams
from specx.runtime.tree_shapes import parse_tree_spec

__all__ = ["Speculation", "plan_for"]


@dataclass(frozen=True)
class Speculation:
    """How a request drafts. Fields left None take the calibration's choice, else defaults.

    drafter: ngram | suffix | skip[:LAYERS] | draft-model:ARTIFACT | eagle3 | eagle | mtp |
    medusa.
    tree: chain:K, dynamic:TOTAL,DEPTH,TOPK, static:FILE or a JSON choice list (or a
    parsed `TreeShape`). adaptive: the per-round controller (`specx.runtime.controller`);
    False drafts the whole tree every round.
    """

    drafter: DrafterName | str  # a str is parsed at construction: an unknown kind fails here
    num_draft_tokens: int | None = None
    tree: Any = None
    ngram: tuple[int, int, int] = (1, 3, 1)  # shortest and longest n-gram, matches merged
    max_batch_spec: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafter", DrafterName.known(self.drafter))

    @property
    def drafter_name(self) -> DrafterName:
        """`drafter`, parsed (what the runtime reads)."""
        return DrafterName.parse(self.drafter)


def plan_for(
    manifest: Manifest, speculation: Speculation, sampling: SamplingParams, threads: int | None
) -> DraftPlan:
    """What a request with `speculation` at `sampling` drafts with (see `DraftPlan`)."""
    spec, name = speculation, speculation.drafter_name
    shape = parse_tree_spec(spec.tree) if isinstance(spec.tree, str) else spec.tree
    count = spec.num_draft_tokens
    calibrated = calibrated_choice(manifest, name, sampling)
    if calibrated is not None and shape is None and count is None:
        if calibrated.shape is None or name.kind == "ngram":
            count = calibrated.nodes  # n-gram's chain, suffix's node budget
        else:
            shape = calibrated.shape
    else:
        calibrated = None  # the request chose its own shape: nothing of it applies
    max_batch_spec = spec.max_batch_spec
    if max_batch_spec is None and calibrated is not None:
        max_batch_spec = calibrated.max_batch_spec
    options = DrafterOptions(count, shape, *spec.ngram, threads)
    return DraftPlan(name, options, max_batch_spec, spec.adaptive, calibrated)
