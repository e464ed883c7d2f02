"""Chat prompts: the checkpoint's own Jinja chat template, carried into the artifact at export.

Rendered the way Hugging Face's `apply_chat_template` renders it (a sandboxed Jinja
environment with `trim_blocks`/`lstrip_blocks`, loop controls, `raise_exception`, a
`tojson` filter that keeps non-ASCII, `strftime_now`, and the tokenizer's `bos_token`/
`eos_token`), then tokenized without adding special tokens: the template writes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from specx.errors import ArtifactError, GenerationError

__all__ = ["CHAT_TEMPLATE_FILE", "ChatTemplate", "read_checkpoint_template"]

CHAT_TEMPLATE_FILE = "chat_template.json"


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it refers to."""

    template: str
    bos_token: str | None = None
    eos_token: str | None = None

    @classmethod
    def load(cls, path: Path) -> ChatTemplate:
        """The artifact's `chat_template.json`."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(data["template"], data.get("bos_token"), data.get("eos_token"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ArtifactError(f"{path}: not a specx chat template ({e!r})") from e

    @classmethod
    def from_file(cls, path: Path) -> ChatTemplate:
        """A template supplied by hand: a Jinja file, or JSON with `chat_template`.

        The JSON form is what a tokenizer_config.json holds (`bos_token` / `eos_token` too).

        Raises:
            ArtifactError: the file cannot be read, or the template does not compile.
        """
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ArtifactError(f"cannot read the chat template {path}: {e}") from e
        if path.suffix == ".json":
            template = _from_config(_read_config(path), path)
            if template is None:
                raise ArtifactError(f"{path} has no chat_template")
        else:
            template = cls(text)
        template.check()
        return template

    def check(self) -> None:
        """Compiles the template now rather than on the first chat request.

        Raises:
            ArtifactError: the template does not compile.
        """
        self._compiled  # noqa: B018

    def to_json(self) -> str:  # noqa: D102
        fields = {"template": self.template, "bos_token": self.bos_token}
        return json.dumps({**fields, "eos_token": self.eos_token}, ensure_ascii=False, indent=1)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt=True) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        Raises:
            GenerationError: malformed messages, or the template refused them.
        """
        import jinja2

        _check_messages(messages)
        try:
            return self._compiled.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise GenerationError(f"the chat template refused the messages: {e}") from e

    @cached_property
    def _compiled(self):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise jinja2.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)  # fmt: skip

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.template)
        except jinja2.TemplateError as e:
            raise ArtifactError(f"the chat template does not compile: {e}") from e


def read_checkpoint_template(checkpoint_dir: Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face checkpoint directory, or None when it has none.

    Looks where transformers saves it: `chat_template.jinja`, else `tokenizer_config.json`'s
    `chat_template` (a string, or a list of named templates: the one named "default").
    """
    config_path = checkpoint_dir / "tokenizer_config.json"
    config = _read_config(config_path) if config_path.is_file() else {}
    jinja = checkpoint_dir / "chat_template.jinja"
    if jinja.is_file():
        config = {**config, "chat_template": jinja.read_text(encoding="utf-8")}
    return _from_config(config, config_path)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ArtifactError(f"{path}: not JSON ({e})") from e
    if not isinstance(config, dict):
        raise ArtifactError(f"{path}: not a JSON object")
    return config


def _from_config(config: dict[str, Any], where: Path) -> ChatTemplate | None:
    """The template a tokenizer_config.json-like object holds, with its special tokens."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str):
        raise ArtifactError(f"{where}: chat_template is neither a string nor named templates")
    return ChatTemplate(template, _token(config.get("bos_token")), _token(config.get("eos_token")))


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise GenerationError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise GenerationError(f"messages[{i}] is not an object")
        if not isinstance(message.get("role"), str):
            raise GenerationError(f"messages[{i}].role must be a string")
        if not isinstance(message.get("content"), str):
            raise GenerationError(f"messages[{i}].content must be a string")
