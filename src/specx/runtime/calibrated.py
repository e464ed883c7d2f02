"""The tree, chain length and batch threshold `specx calibrate` recorded for a drafter.

`specx generate` uses them when the user does not choose (`--tree`, `--num-draft-tokens`,
`--max-batch-spec`), and reports the predicted speedup next to the measured one. A drafter
may be calibrated at several sampling settings (`calibration_key`); generation uses the
one nearest its own: the closest temperature, then the closest top_p (an entry without a
recorded setting is greedy, as every calibration was before settings were recorded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specx.artifact import MANIFEST_NAME, Manifest
from specx.drafter_name import DrafterName
from specx.errors import ArtifactError
from specx.manifest_types import CalibratedSampling, GreedyIdentity, TreeChoice, VerifyShape
from specx.runtime.sampling import SamplingParams
from specx.runtime.targets import build_name
from specx.runtime.tree_shapes import DynamicTree, StaticTree, TreeShape
from specx.runtime.trees import TreeError

__all__ = [
    "CalibratedChoice",
    "calibrated_choice",
    "calibration_key",
    "choice_shape",
    "greedy_identity",
    "row_exact",
    "verify_shape",
]


@dataclass(frozen=True)
class CalibratedChoice:
    """A calibration's choice for one drafter."""

    shape: TreeShape | None  # None: a drafter that sizes its own trees (suffix), see `nodes`
    nodes: int  # the draft's node budget
    max_batch_spec: int
    predicted_speedup: float  # measured on the calibration prompts; 1.0 when speculation is off
    description: str
    key: str  # the manifest entry: calibration[key]
    measured_on: str | None = None  # the build it was measured on (None: not recorded)

    def to_json(self) -> dict[str, Any]:
        """What `specx generate --json` reports of it, as `stats.calibration`."""
        return {
            "entry": self.key,
            "tree": self.description,
            "max_batch_spec": self.max_batch_spec,
            "predicted_speedup": self.predicted_speedup,
            "measured_on": self.measured_on,
        }


def calibration_key(drafter: str, sampling: SamplingParams) -> str:
    """The manifest key of a drafter's calibration at a sampling setting.

    The drafter's name for greedy (the key calibrations always had), else the name with
    the temperature, and top_p where it truncates: "eagle@T=0.7,top_p=0.9".
    """
    if sampling.greedy:
        return drafter
    key = f"{drafter}@T={sampling.temperature:g}"
    return key + (f",top_p={sampling.top_p:g}" if sampling.top_p < 1.0 else "")


def choice_shape(choice: TreeChoice) -> TreeShape | None:
    """The tree shape a recorded choice (or candidate) describes; None for a node budget.

    Raises:
        TreeError: the recorded shape is not a tree (ranks, parameters out of range).
    """
    if choice.tree == "budget":
        return None
    if choice.tree == "static":
        return StaticTree.from_choices(choice.choices)
    if choice.dynamic is not None:
        dynamic = choice.dynamic
        return DynamicTree(dynamic.total_token, dynamic.depth, dynamic.top_k)
    return StaticTree.chain(choice.chain_length)


def calibrated_choice(
    manifest: Manifest, drafter: str | DrafterName, sampling: SamplingParams | None = None
) -> CalibratedChoice | None:
    """The recorded choice for `drafter` (its name before any `:`) nearest `sampling`, or None."""
    name = DrafterName.parse(drafter).kind
    recorded = {
        key: manifest.calibration(key)
        for key in manifest.calibration_keys
        if key.partition("@")[0] == name
    }
    if not recorded:
        return None
    wanted = sampling or SamplingParams()
    key = min(recorded, key=lambda k: _distance(recorded[k].sampling, wanted))
    entry = recorded[key]
    try:
        shape = choice_shape(entry.choice)
    except TreeError as e:
        raise ArtifactError(
            f"{manifest.root / MANIFEST_NAME}: calibration.{key} is malformed ({e!r}); "
            f"run specx calibrate again"
        ) from e
    label = entry.choice.label
    if key != name:
        label += f" (calibrated at {key.partition('@')[2]})"
    if entry.max_batch_spec == 0:
        label += " (calibration: speculation does not pay off here, decoding plainly)"
    measured_on = entry.measured_build
    running = build_name(manifest)
    if measured_on is not None and measured_on != running:
        # Its costs (and so its choice) are another build's: said, not silently applied.
        label += (
            f" (calibrated on the {measured_on} build; this is {running}: run specx calibrate "
            "again to measure it)"
        )
    nodes = entry.choice.nodes if shape is None else shape.max_nodes
    return CalibratedChoice(
        shape, nodes, entry.max_batch_spec, entry.expected_speedup, label, key, measured_on
    )


def _distance(setting: CalibratedSampling, wanted: SamplingParams) -> tuple[float, float]:
    """(|temperature difference|, |top_p difference|) of an entry's setting from `wanted`."""
    top_p_wanted = 1.0 if wanted.greedy else wanted.top_p
    return abs(setting.temperature - wanted.temperature), abs(setting.top_p - top_p_wanted)


def greedy_identity(manifest: Manifest) -> GreedyIdentity:
    """What of greedy speculation the default build keeps identical to its plain decoding.

    "all" (float builds: up to last-bit near-ties, see docs/speculative.md), "chains" (INT8 and
    weight-only int8-compute builds: chain drafts), or "none" (a weight-only build whose
    kernels treat a row alone differently from rows together on the build machine).
    """
    build = manifest.build
    return "all" if build is None else build.quantization.greedy_identity


def row_exact(manifest: Manifest) -> bool:
    """True when the default build keeps greedy speculation identical to plain by rows alone.

    An INT8 or int8-compute build (greedy identity "chains") computes a token's logits
    bit-identically alone or in a verify chunk while its keys sit where plain decoding puts
    them: chains as they are, trees only along their spine. Greedy decoding there verifies
    trees through their spine (`specx.runtime.spine`).
    """
    return greedy_identity(manifest) == "chains"


def verify_shape(manifest: Manifest) -> VerifyShape | None:
    """The default build's verify curve t(n) / t(1) as a calibration measured it there.

    Any drafter's entry will do (the curve is the target's); one measured on another build
    is not this build's and is not used.
    """
    build = build_name(manifest)
    shapes = (manifest.calibration(key).verify_shape for key in manifest.calibration_keys)
    return next((s for s in shapes if s is not None and s.build == build), None)
