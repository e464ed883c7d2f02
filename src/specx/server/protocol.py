"""The OpenAI wire format: request bodies checked into typed requests, responses built.

Every refusal is an `ApiError` with the HTTP status and OpenAI's error object
(`{"error": {"message", "type", "param", "code"}}`), raised before any decoding.
specx's own fields ride along as extensions: `top_k`, `drafter` (a `--drafter` spec, or
null for plain decoding; default: the server's) and `ignore_eos` in requests; each
choice's `token_ids` and a `speculative` block in responses. A field the endpoint does not
know is refused (400 naming it, as OpenAI's API does), OpenAI's that specx does not
implement too when set (`UNSUPPORTED`); `IGNORED`'s are accepted and have no effect.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specx.runtime.sampling import SamplingParams
from specx.server.events import Finished

__all__ = ["ApiError", "GenerateRequest", "parse_request", "response_body", "stream_chunk"]

_UNSET = object()
# OpenAI request fields specx does not implement: refused when set, never silently ignored.
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "logit_bias", "suffix",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "tools",
               "tool_choice", "functions", "function_call", "response_format")  # fmt: skip
# OpenAI request fields that change neither the tokens nor who may call: accepted, ignored.
IGNORED = ("user", "metadata", "store", "service_tier")
_FIELDS = ("model", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream",
           "stream_options", "stop", "drafter", "ignore_eos") + UNSUPPORTED + IGNORED  # fmt: skip
_KNOWN = {False: frozenset(_FIELDS + ("prompt",)),
          True: frozenset(_FIELDS + ("messages", "max_completion_tokens"))}  # fmt: skip


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:  # noqa: D102
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


@dataclass(frozen=True)
class GenerateRequest:
    """A checked /v1/completions or /v1/chat/completions request."""

    chat: bool
    prompt: str | list[int] | None  # completions
    messages: list[dict[str, Any]] | None  # chat
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    drafter: str | None
    ignore_eos: bool


def parse_request(body: Any, chat: bool, model: str, default_drafter: str | None):
    """The typed request, or ApiError(400/404) naming the field."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = [name for name in body if name not in _KNOWN[chat]]
    if unknown:  # as OpenAI's API does: a misspelt field must not pass as a default
        raise ApiError(400, f"unrecognized request argument(s): {', '.join(map(str, unknown))}",
                       str(unknown[0]))  # fmt: skip
    if body.get("model", model) != model:
        raise ApiError(
            404, f"model {body.get('model')!r} does not exist; this server serves {model!r}",
            "model", "model_not_found",
        )  # fmt: skip
    if _get(body, "n", int, 1) != 1:
        raise ApiError(400, "n must be 1 (one choice per request)", "n")
    for name in UNSUPPORTED:
        value = body.get(name)
        if value not in (None, False, 0, "", [], {}) and not (name == "best_of" and value == 1):
            raise ApiError(400, f"{name} is not supported by specx serve", name)
    prompt = messages = None
    if chat:
        messages = _messages(body.get("messages", _UNSET))
        max_tokens = _get(body, "max_completion_tokens", int, None)
        if max_tokens is None:
            max_tokens = _get(body, "max_tokens", int, 256)
    else:
        prompt = _prompt(body.get("prompt", _UNSET))
        max_tokens = _get(body, "max_tokens", int, 16)
    if max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be > 0, got {max_tokens}", "max_tokens")
    temperature = _get(body, "temperature", float, 1.0)
    if not temperature >= 0:
        raise ApiError(400, f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = _get(body, "top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _get(body, "top_k", int, 0)
    top_k = 0 if top_k == -1 else top_k  # vLLM's "no top-k"
    seed = _get(body, "seed", int, None)
    try:
        sampling = SamplingParams(temperature, top_k if temperature else 0, top_p, seed)
    except ValueError as e:
        raise ApiError(400, str(e)) from e
    stream = _get(body, "stream", bool, False)
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    drafter = body.get("drafter", default_drafter)
    if drafter is not None and not (isinstance(drafter, str) and drafter):
        raise ApiError(400, "drafter must be a drafter spec (e.g. ngram) or null", "drafter")
    return GenerateRequest(
        chat, prompt, messages, max_tokens, sampling, _stop(body.get("stop")), stream,
        bool(options.get("include_usage", False)), drafter, _get(body, "ignore_eos", bool, False),
    )  # fmt: skip


def response_body(request: GenerateRequest, done: Finished, model: str, rid: str) -> dict:
    """The non-streamed response."""
    if request.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": done.text}}
    else:
        choice = {"index": 0, "text": done.text, "logprobs": None}
    choice |= {"finish_reason": done.finish_reason, "token_ids": done.tokens}
    return {
        "id": rid,
        "object": "chat.completion" if request.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(done),
        "speculative": speculative(done),
    }


def stream_chunk(
    request: GenerateRequest, model: str, rid: str, text: str, tokens: Sequence[int],
    done: Finished | None = None, first: bool = False,
) -> dict:  # fmt: skip
    """One SSE chunk: a text delta, and on the last one the finish reason and stats."""
    if request.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    choice |= {"finish_reason": None if done is None else done.finish_reason,
               "token_ids": list(tokens)}  # fmt: skip
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if request.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if done is not None:
        chunk["speculative"] = speculative(done)
        if request.include_usage or not request.chat:
            chunk["usage"] = usage(done)
    return chunk


def new_id(chat: bool) -> str:  # noqa: D103
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(done: Finished) -> dict[str, int]:  # noqa: D103
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": len(done.tokens),
        "total_tokens": done.prompt_tokens + len(done.tokens),
    }


def speculative(done: Finished) -> dict[str, Any]:  # noqa: D103
    return {
        "rounds": done.rounds,
        "drafted": done.drafted,
        "accepted": done.accepted,
        "acceptance_length": done.acceptance_length,
        "acceptance_by_position": done.acceptance_by_position,
    }


def _get(body: Mapping, name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ApiError(400, f"{name} must be a {kind.__name__}, got {value!r}", name)
    if isinstance(value, float) and not math.isfinite(value):  # kind is float
        raise ApiError(400, f"{name} must be finite, got {value!r}", name)
    return value


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str) and value:
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        return value
    raise ApiError(
        400, "prompt must be a non-empty string or a non-empty list of token ids (one prompt)",
        "prompt",
    )  # fmt: skip


def _messages(value: Any) -> list[dict[str, Any]]:
    """The messages with string content (OpenAI's text content parts joined)."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role", "messages")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):  # fmt: skip
                raise ApiError(
                    400, f"messages[{i}].content: only text parts are supported", "messages"
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        messages.append({**message, "content": content})
    return messages


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ApiError(400, "stop must be a non-empty string or a list of them", "stop")
    if len(value) > 4:
        raise ApiError(400, "stop takes at most 4 strings", "stop")
    return tuple(value)
