"""Text <-> token ids through the artifact's `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

from pathlib import Path

from specx.errors import ArtifactError

__all__ = ["TextTokenizer"]


class TextTokenizer:
    """Encodes like HF's fast tokenizer with `add_special_tokens=True` (BOS where configured)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ArtifactError(f"{path}: not a valid tokenizer.json: {e}") from e

    @property
    def tokenizer(self):
        """The `tokenizers.Tokenizer` itself (streaming detokenization steps through it)."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, special tokens added as the post-processor says (if asked)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self._tokenizer.decode(ids, skip_special_tokens=True)
