"""What the scheduler hands each request's client: a round's tokens, then its end.

Their own home, below the scheduler that makes them and the service, protocol and metrics
that read them, so none of those imports another for its types.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Finished", "TokensEvent"]


@dataclass(frozen=True)
class TokensEvent:
    """A round's tokens for one request and the text they made final."""

    tokens: list[int]
    text: str


@dataclass(frozen=True)
class Finished:
    """A request's end: its whole result."""

    tokens: list[int]
    text: str
    tail: str  # text held back until the end (not yet in any TokensEvent)
    finish_reason: str  # "stop" | "length" | "cancelled" | "timeout" | "shutdown" | "error"
    prompt_tokens: int
    rounds: int
    drafted: int
    accepted: int
    acceptance_length: float
    acceptance_by_position: list[float]
    error: str | None = None
