"""A verify cost curve fixed in advance, so that what a controller keeps is host-independent."""

from __future__ import annotations


class FixedCurve:
    """T(k) = 1 + slope k plain steps, whatever the host does (a `RoundCosts` stand-in)."""

    widest = 10**6  # every width counts as timed: the rule's reach is not limited
    plain_timed = True

    def __init__(self, slope: float):
        self.slope = slope

    def verify(self, width: int) -> float:
        return 1.0 + self.slope * (width - 1)

    def record(self, width: int, verify_s: float, draft_s: float) -> None:
        pass

    def record_stretch(self, step_s: float) -> None:
        pass
