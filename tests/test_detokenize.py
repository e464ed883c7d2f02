"""TextStream: through DecodeStream on byte-level BPE the same deltas as decoding every token
again; other decoders (byte fallback) decode in full."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from tokenizers.decoders import DecodeStream

from specx.runtime.detokenize import TextStream

WORDS = ["a", "é", "€", "你好", "🙂", " café", "ENDé", "x€y", "END", "\n"]
EOT = 0  # <|endoftext|>, skipped when decoding


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what decoders.ByteLevel undoes)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in keep]
    return {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(moved)}


CHARS = _byte_chars()


def _spell(piece: bytes) -> str:
    return "".join(CHARS[b] for b in piece)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """Every byte, and every 1-4 byte piece of the words: characters split across tokens."""
    pieces = [bytes([b]) for b in range(256)]
    for word in map(str.encode, WORDS):
        pieces += [word[i : i + n] for i in range(len(word)) for n in range(1, 5)]
    vocab = {"<|endoftext|>": EOT}
    for piece in pieces:
        vocab.setdefault(_spell(piece), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def _ids(tok: Tokenizer, rng: random.Random, n_words: int) -> list[int]:
    """A valid text cut into random 1-4 byte tokens, with special tokens between words."""
    ids = []
    for word in (rng.choice(WORDS).encode() for _ in range(n_words)):
        i = 0
        while i < len(word):
            j = min(len(word), i + rng.randint(1, 4))
            ids.append(tok.token_to_id(_spell(word[i:j])))
            i = j
        if rng.random() < 0.1:
            ids.append(EOT)
    return ids


def _streams(tok: Tokenizer, count: int) -> list[list[int]]:
    """Valid texts, the same cut mid-character, and random ids (invalid UTF-8 included)."""
    rng = random.Random(0)
    streams = []
    for _ in range(count):
        ids = _ids(tok, rng, rng.randint(1, 20))
        streams += [ids, ids[: rng.randint(1, len(ids))]]
        streams.append([rng.randrange(tok.get_vocab_size()) for _ in range(rng.randint(1, 60))])
    return streams


def _pushes(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        j = i + rng.randint(1, 4)
        out.append(ids[i:j])
        i = j
    return out


@pytest.mark.parametrize("stop", [(), ("END",), ("€", "\n", "fé")])
def test_the_tokenizer_stream_shows_what_decoding_everything_again_shows(tokenizer, stop):
    rng = random.Random(1)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for ids in _streams(tokenizer, 100):
        fast, slow = TextStream(tokenizer, stop), TextStream(decode, stop)
        for tokens in _pushes(ids, rng):
            assert fast.push(tokens) == slow.push(tokens)
            assert (fast.text, fast.tokens, fast.stopped) == (slow.text, slow.tokens, slow.stopped)
        assert fast.finish() == slow.finish()
        full = decode(fast.tokens)
        cut = min([i for i in (full.find(s) for s in stop) if i >= 0], default=len(full))
        assert fast.text == full[:cut]


def test_decode_stream_chunks_equal_the_full_decode_whenever_it_returns_one(tokenizer):
    # The rule detokenize.py builds on; None steps are left to the full decode.
    for ids in _streams(tokenizer, 100):
        stream, text = DecodeStream(skip_special_tokens=True), ""
        for k, token in enumerate(ids, 1):
            chunk = stream.step(tokenizer, token)
            if chunk is not None:
                text += chunk
                assert text == tokenizer.decode(ids[:k], skip_special_tokens=True)


def test_a_stop_string_ends_at_the_token_that_completes_it_mid_character(tokenizer):
    # DecodeStream alone withholds "END" while the token's "é" is unfinished: one token late.
    ids = [tokenizer.token_to_id(_spell(p)) for p in (b"x", b"END\xc3", b"\xa9")]
    alone = DecodeStream(skip_special_tokens=True)
    assert [alone.step(tokenizer, t) for t in ids] == ["x", None, "ENDé"]
    stream = TextStream(tokenizer, ["END"])
    assert stream.push(ids) == "x" and stream.stopped and stream.tokens == ids[:2]
    free = TextStream(tokenizer)  # text before an unfinished character shows at once
    assert free.push(ids[:1]) == "x" and free.push(ids[1:2]) == "END"
    assert free.text == "xEND\ufffd" and free.finish() == "\ufffd"


@pytest.fixture(scope="module")
def byte_fallback() -> Tokenizer:
    """A Llama 2 / Gemma style vocabulary: byte tokens <0xNN> and "▁" for a space."""
    pieces = ["<unk>", "<s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁a", "a", "»"]
    model = models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True)
    tok = Tokenizer(model)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(["<s>"])
    return tok


def test_other_decoders_decode_in_full_where_decode_stream_fails(byte_fallback):
    # C3 82 is "Â"; with E2 after it, the run is not UTF-8 and decodes as three U+FFFD.
    ids = [byte_fallback.token_to_id(p) for p in ("<0xC3>", "<0x82>", "<0xE2>", "▁a")]
    alone = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        [alone.step(byte_fallback, t) for t in ids]
    stream = TextStream(byte_fallback)
    for token in ids:
        stream.push([token])
    assert stream.text == byte_fallback.decode(ids, skip_special_tokens=True) == "\ufffd" * 3 + " a"
