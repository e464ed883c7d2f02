"""Prompts from the command line or a JSONL file, checked by type before any decoding.

A prompts file has one JSON object per non-blank line with exactly one of:

- `"prompt"`: a non-empty string (tokenized with the artifact's tokenizer);
- `"prompt_ids"`: a non-empty list of integer token ids (JSON integers: `1.7`, `"1,2"`
  and `true` are refused, never converted);
- `"turns"`: a non-empty list of strings, as in MT-Bench and Spec-Bench; the first turn is
  the prompt.

Other keys (`question_id`, `category`, ...) are ignored. Every error names the file and
line. Whether ids fit the vocabulary is checked where the vocabulary is known
(`specx.runtime.plain_decoding.check_prompts`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specx.errors import GenerationError

__all__ = ["PROMPT_KEYS", "parse_prompt_ids", "read_prompts", "read_prompts_file"]

PROMPT_KEYS = ("prompt", "prompt_ids", "turns")

Encode = Callable[[str], list[int]]
Prompt = str | list[int]


def parse_prompt_ids(text: str) -> list[int]:
    """`--prompt-ids 1,2,3` -> [1, 2, 3].

    Raises:
        GenerationError: an item is not a non-negative integer, or there are none.
    """
    items = [item.strip() for item in text.split(",")]
    if not all(item.isascii() and item.isdigit() for item in items):
        raise GenerationError(
            f"--prompt-ids must be comma-separated non-negative integers, got {text!r}"
        )
    return [int(item) for item in items]


def read_prompts_file(path: Path) -> list[Prompt]:
    """The prompts of a JSONL file: text (str) or token ids (list[int]), in file order.

    Raises:
        GenerationError: naming the file and line: not UTF-8, not JSON, not an object,
            none or several of the prompt keys, a value of the wrong type, or no prompts.
    """
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        number = path.read_bytes()[: e.start].count(b"\n") + 1
        raise GenerationError(f"{path}:{number}: not UTF-8 text (a binary file?)") from e
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            prompts.append(_record_prompt(line, f"{path}:{number}"))
    if not prompts:
        raise GenerationError(f"{path} has no prompts (one JSON object per line)")
    return prompts


def _record_prompt(line: str, where: str) -> Prompt:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise GenerationError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(record, dict):
        raise GenerationError(f"{where}: expected a JSON object, got {_kind(record)}")
    keys = [k for k in PROMPT_KEYS if k in record]
    if len(keys) != 1:
        found = f"found {', '.join(map(repr, keys))}" if keys else "found none"
        raise GenerationError(
            f"{where}: give exactly one of 'prompt', 'prompt_ids', 'turns' ({found})"
        )
    key, value = keys[0], record[keys[0]]
    if key == "prompt_ids":
        return _token_ids(value, where)
    if key == "turns":
        if not isinstance(value, list) or not value:
            raise GenerationError(f"{where}: 'turns' must be a non-empty list of strings")
        key, value = "turns[0]", value[0]
    if not isinstance(value, str) or not value:
        raise GenerationError(f"{where}: {key!r} must be a non-empty string, got {_kind(value)}")
    return value


def _token_ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise GenerationError(
            f"{where}: 'prompt_ids' must be a non-empty list of integers, got {_kind(value)}"
        )
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise GenerationError(
                f"{where}: prompt_ids[{i}] must be a non-negative integer, got {item!r}"
            )
    return value


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "an empty string" if not value else f"the string {value[:20]!r}"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    return {dict: "an object", bool: "a boolean", type(None): "null"}.get(
        type(value), f"the number {value!r}"
    )


def read_prompts(
    prompt: str | None,
    prompt_ids: str | None,
    prompts_file: Path | None,
    encode: Encode | None,
) -> list[list[int]]:
    """Token ids of the one prompt source given (text, ids, or a JSONL file).

    Raises:
        GenerationError: not exactly one source, a malformed source, an empty text
            prompt, or text prompts without a tokenizer.
    """
    given = [x for x in (prompt, prompt_ids, prompts_file) if x is not None]
    if len(given) != 1:
        raise GenerationError("give exactly one of --prompt, --prompt-ids, --prompts-file")
    if prompt_ids is not None:
        return [parse_prompt_ids(prompt_ids)]
    if prompt is not None:
        if not prompt:
            raise GenerationError("--prompt is empty")
        items: list[Prompt] = [prompt]
    else:
        assert prompts_file is not None  # the one source given
        items = read_prompts_file(prompts_file)

    def ids(item: Prompt) -> list[int]:
        if isinstance(item, list):
            return item
        if encode is None:
            raise GenerationError(
                "text prompts need a tokenizer; the artifact has none: use --prompt-ids or "
                "'prompt_ids' lines"
            )
        return encode(item)

    return [ids(item) for item in items]
