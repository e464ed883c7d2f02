"""Incremental text of a sequence being generated, cut at the first stop string.

What a stream may show at any point is the decoded text minus two tails: replacement
characters at the end (a multi-byte character whose remaining bytes are in tokens not yet
generated) and the longest tail that is the start of a stop string (the next tokens may
complete it). When a stop string appears, the text ends right before it and the sequence is
over. The text always equals the decoding of all tokens so far, so it equals the
non-streamed text.

Given a `tokenizers.Tokenizer` whose decoder is byte-level BPE's (GPT-2, Llama 3, Qwen),
the text grows by `tokenizers.decoders.DecodeStream` chunks: whenever DecodeStream returns
one, the chunks so far equal the full decode (checked at all 6.5k steps of
tests/test_detokenize.py's random streams, split multi-byte characters, invalid bytes and
special tokens among them, and at 160k steps once). A pushed token then costs about the
same at any length, where decoding everything again grows with it
(docs/decisions.md#decode-stream). Kept from the hand-written version:

- Other decoders (byte fallback: Llama 2, Mistral, Gemma) decode in full on every step.
  There, DecodeStream raised "Invalid prefix" on 677 of 1500 random-id streams (on none of
  1500 valid texts) and once returned a chunk unlike the full decode: a run of byte tokens
  that is not UTF-8 becomes one U+FFFD per token, so a later byte rewrites earlier text.
- DecodeStream returns nothing for a token that leaves a character unfinished or adds no
  text (a skipped special token), and has no flush; on those steps the text is the full
  decode. Without that, a token "END" plus the first byte of "é" would end a stop string
  "END" one token late, text before an unfinished character would wait for it, and a
  sequence ending mid-character would lose its U+FFFD.

tests/test_detokenize.py shows each case.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream

__all__ = ["TextStream"]


class TextStream:
    """One sequence's text as its tokens arrive (see the module docstring).

    `decoder` is the tokenizer (incremental through DecodeStream) or any function from
    token ids to text (decoded again in full on every step).
    """

    def __init__(self, decoder: Tokenizer | Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._chunks: Callable[[int], str | None] | None = None
        self._decode: Callable[[list[int]], str]
        if isinstance(decoder, Tokenizer):
            if isinstance(decoder.decoder, decoders.ByteLevel):
                self._chunks = partial(DecodeStream(skip_special_tokens=True).step, decoder)
            self._decode = partial(decoder.decode, skip_special_tokens=True)
        else:
            self._decode = decoder
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.stopped = False  # a stop string ended the text
        self._streamed = ""  # DecodeStream's chunks so far
        self._text = ""  # the text of tokens[: self._decoded]
        self._decoded = 0
        self._shown = 0  # characters of `text` handed out

    @property
    def text(self) -> str:
        """The decoding of all tokens so far (ending before the stop string, once stopped)."""
        if self._decoded < len(self.tokens):
            self._text, self._decoded = self._decode(self.tokens), len(self.tokens)
        return self._text

    def push(self, tokens: Sequence[int]) -> str:
        """Adds tokens; returns the text that became safe to show.

        With stop strings the tokens are taken one at a time and none after the one that
        completes a stop string (`tokens` then ends there).
        """
        if not self.stop:
            for token in tokens:
                self._step(token)
            return self._take(len(self.text.rstrip("\ufffd")))
        delta = ""
        for token in tokens:
            if self.stopped:
                break
            self._step(token)
            delta += self._check_stop(self.text)
        return delta

    def _step(self, token: int) -> None:
        self.tokens.append(token)
        chunk = self._chunks(token) if self._chunks else None
        if chunk is not None:
            self._streamed += chunk
            self._text, self._decoded = self._streamed, len(self.tokens)

    def _check_stop(self, text: str) -> str:
        start = max(self._shown - self._hold, 0)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self._text, self.stopped = text[: min(hits)], True
            return self._take(len(self._text))
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
