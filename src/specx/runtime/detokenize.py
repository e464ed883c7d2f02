"""Incremental text of a sequence being generated, cut at the first stop string.

What a stream may show at any point is the decoded text minus two tails: replacement
characters at the end (a multi-byte character whose remaining bytes are in tokens not yet
generated) and the longest tail that is the start of a stop string (the next tokens may
complete it). When a stop string appears, the text ends
right before it and the sequence is over. The text is always the decoding of all tokens so
far (never of pieces decoded separately), so it equals the non-streamed text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]


class TextStream:
    """One sequence's text as its tokens arrive (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string ended the text
        self._shown = 0  # characters of `text` handed out

    def push(self, tokens: Sequence[int]) -> str:
        """Adds tokens; returns the text that became safe to show.

        With stop strings the tokens are taken one at a time and none after the one that
        completes a stop string (`tokens` then ends there).
        """
        if not self.stop:
            self.tokens.extend(tokens)
            self.text = self._decode(self.tokens)
            return self._take(len(self.text.rstrip("\ufffd")))
        delta = ""
        for token in tokens:
            if self.stopped:
                break
            self.tokens.append(token)
            delta += self._check_stop(self._decode(self.tokens))
        return delta

    def _check_stop(self, text: str) -> str:
        start = max(self._shown - self._hold, 0)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped = text[: min(hits)], True
            return self._take(len(self.text))
        self.text = text
        safe = text.rstrip("\ufffd")
        return self._take(len(safe) - self._held(safe))

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that begins a stop string."""
        for k in range(min(self._hold, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0

    def finish(self) -> str:
        """The text still held back, once the sequence has ended (nothing more will come)."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta = self.text[self._shown : upto] if upto > self._shown else ""
        self._shown = max(self._shown, upto)
        return delta
