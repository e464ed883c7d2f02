"""`RoundCosts`: round time as a function of the draft size, learnt from the loop's rounds."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["UNTIMED_VERIFY_ROUND", "RoundCosts", "replayed_guess"]


class RoundCosts:
    """Round time as a function of the draft size k, learnt from the loop's own rounds.

    T(k) = verify(1 + k) + draft [k > 0], each a smoothed measurement: verify(n) at the
    widths timed, a line through the narrowest and widest timed in between, and the build's
    curve f(n) = t(n) / t(1) scaled to the nearest timed width outside them (in units of a
    plain step until anything is timed); `draft` the smoothed drafting time of rounds that
    drafted. f is `shape`, the curve a calibration measured on the build (`Engine` passes
    it at batch 1, where it was measured), else 1 + 0.05 (n - 1).

    An engine's requests share one (costs are the machine's), so an estimate may live far
    longer than a request, and the rule only re-times a width it picks: a width priced too
    high is never picked again (shared without guards, one stall kept a benchmark cell on
    1-node drafts throughout: docs/decisions.md#shared-round-costs). Two guards, both erring
    cheap (a width priced too low is picked, so re-timed at once):
    - a timing counts at most `rise` x the width's estimate (for a width not yet timed, what
      the other widths predict): one slow outlier moves an estimate a little, never out of
      the rule. The first two timings of a width replace its estimate (the first is capped,
      the second confirms it), later ones are smoothed;
    - a width not timed for `horizon` rounds is forgotten and priced from the others until
      it is timed again (a forgotten plain step makes the next request start plain).
    """

    def __init__(
        self,
        smoothing: float = 0.2,
        rise: float = 1.5,
        horizon: int = 128,
        shape: Callable[[int], float] | None = None,
    ):
        self.smoothing, self.rise, self.horizon = smoothing, rise, horizon
        self.shape = shape or _guess  # t(n) / t(1) where nothing timed says otherwise
        self.by_width: dict[int, float] = {}
        self._seen: list[int] = []  # the widths timed, sorted
        self._timed: dict[int, tuple[int, int]] = {}  # width -> (times timed, last round)
        self._round = 0
        self._stretched = False  # a plain step was priced from a stretch (`record_stretch`)
        self.draft = 0.0
        self.ask = 0.0  # a round whose drafter found nothing to draft (0: none timed)

    def record(self, width: int, verify_s: float, draft_s: float) -> None:
        """A round's verify time at `width` tokens per row and its drafting time.

        A round of width 1 prices a plain step only until a stretch of them has
        (`record_stretch`): such a round follows a verify forward or a proposal that found
        nothing, and costs more than plain decoding's steps.
        """
        if width == 1 and self._stretched:
            return
        self._round += 1
        old = self.by_width.get(width)
        if old is None:
            old = self.verify(width) if self.by_width else verify_s
            self._seen = sorted((*self.by_width, width))
        verify_s = min(verify_s, self.rise * old)
        timings = self._timed.get(width, (0, 0))[0] + 1
        step = 1.0 if timings <= 2 else self.smoothing
        self.by_width[width] = old + step * (verify_s - old)
        self._timed[width] = timings, self._round
        self._forget(self._round - self.horizon)
        if width > 1:  # a round that drafted (a plain round's "draft" is the controller's own)
            step = 1.0 if not self.draft else self.smoothing
            self.draft += step * (draft_s - self.draft)
            self._cap_plain(verify_s)

    def _cap_plain(self, seconds: float) -> None:
        """A plain step costs at most what a wider forward or an ask just cost.

        A request's steps run up to twice as slow for its first ten or so (pyref-7m, ONNX
        Runtime: 2.0 ms falling to 0.7), so a plain step priced then, and not re-priced
        while the row drafts or asks, made later rounds look cheaper than plain steps.
        """
        if 1 in self.by_width:
            self.by_width[1] = min(self.by_width[1], seconds)

    def record_stretch(self, step_s: float) -> None:
        """A plain step's time, from a stretch of them: from now on the plain step's price.

        The latest stretch replaces the price rather than moving an average: a request's
        steps grow faster over its first few dozen, so an earlier stretch overprices a step,
        and rounds that ask a drafter for nothing would look free against it
        (docs/decisions.md#latest-stretch-prices-step).
        """
        self._stretched = False
        if 1 in self._timed:  # timed before: this timing replaces it, as a first one would
            self._timed[1] = (0, self._timed[1][1])
        self.record(1, step_s, 0.0)
        self._stretched = True

    def record_ask(self, seconds: float) -> None:
        """A round that asked the drafter and found no draft, the proposal included.

        A plain step through the speculative loop: dearer than a stretch's step.
        """
        step = 1.0 if not self.ask else self.smoothing
        self.ask += step * (seconds - self.ask)
        self._cap_plain(seconds)

    def _forget(self, before: int) -> None:
        stale = [w for w, (_, last) in self._timed.items() if last <= before]
        for width in stale:
            del self.by_width[width], self._timed[width]
        if stale:
            self._seen = sorted(self.by_width)

    @property
    def widest(self) -> int:
        """The widest verify forward timed (0: none yet)."""
        return self._seen[-1] if self._seen else 0

    @property
    def drafted(self) -> bool:
        """Whether a round with a draft has been timed."""
        return self.draft > 0

    @property
    def plain_timed(self) -> bool:
        """Whether a plain step has been timed."""
        return 1 in self.by_width

    @property
    def known(self) -> bool:
        """Whether both a plain step and a round with a draft have been timed."""
        return 1 in self.by_width and self.drafted

    def time(self, size: int) -> float:
        """T(k): a round keeping `size` draft nodes per row (0: a plain step)."""
        return self.verify(1 + size) + (self.draft if size else 0.0)

    def verify(self, width: int) -> float:
        """A verify forward's time at `width` tokens per row (1: a plain step)."""
        if width in self.by_width:
            return self.by_width[width]
        if not self.by_width:
            return self.shape(width)
        low, high = self._seen[0], self._seen[-1]
        if width < low or low == high:
            near = low if width < low else high
            return self.by_width[near] * self.shape(width) / self.shape(near)
        if width > high:
            return self.by_width[high] * self.shape(width) / self.shape(high)
        slope = (self.by_width[high] - self.by_width[low]) / (high - low)
        return self.by_width[low] + slope * (width - low)


def _guess(width: int) -> float:
    """t(n) / t(1) before anything is timed, where no calibration measured the build's.

    Cheap, so that a drafter that learns only by drafting (a head) tries its first draft.
    """
    return 1.0 + 0.05 * (width - 1)


# A verify round over a plain step before one is timed, for a drafter that replays judge:
# a round leaves plain decoding's loop (fresh inputs and mask, the verification, the slower
# step after it), 1.7 plain steps at width 2 on pyref-7m at batch 1, where `_guess`'s 1.05
# kept n-gram asking for drafts at T = 1 round after round
# (docs/decisions.md#untimed-rounds-dear).
UNTIMED_VERIFY_ROUND = 1.5


def replayed_guess(width: int) -> float:
    """`_guess` for a drafter whose drafts replays judge for free (`Drafter.replay`).

    Dear: such a drafter need not pay a round to learn what drafting earns, so no round
    is drafted until what replays show pays at this price; the first one timed replaces it.
    """
    return 1.0 if width <= 1 else UNTIMED_VERIFY_ROUND + 0.05 * (width - 2)
