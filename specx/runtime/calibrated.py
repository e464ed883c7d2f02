"""The tree, chain length and batch threshold `specx calibrate` recorded for a drafter.

`specx generate` uses them when the user does not choose (`--tree`, `--num-draft-tokens`,
`--max-batch-spec`), and reports the predicted speedup next to the measured one.
"""

from __future__ import annotations

from dataclasses import dataclass

from specx.artifact import Manifest
from specx.runtime.drafters.tree_search import StaticTree

__all__ = ["CalibratedChoice", "calibrated_choice"]


@dataclass(frozen=True)
class CalibratedChoice:
    """A calibration's choice for one drafter."""

    shape: StaticTree
    max_batch_spec: int
    predicted_speedup: float
    description: str


def calibrated_choice(manifest: Manifest, drafter: str) -> CalibratedChoice | None:
    """The recorded choice for `drafter` (its name before any `:`), or None."""
    entry = manifest.data.get("calibration", {}).get(drafter.partition(":")[0])
    if entry is None:
        return None
    choice = entry["choice"]
    if choice["tree"] == "static":
        shape = StaticTree.from_choices(choice["choices"])
        description = f"static tree, {choice['nodes']} nodes, depth {choice['depth']}"
    else:
        shape = StaticTree.chain(choice["chain_length"])
        description = f"chain of {choice['chain_length']}"
    return CalibratedChoice(
        shape, entry["max_batch_spec"], choice["predicted_speedup"], description
    )
