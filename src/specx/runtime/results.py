"""What an engine returns: `Completion` per prompt, `Chunk` per streamed round, `Stats`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from specx.runtime.calibrated import CalibratedChoice
from specx.runtime.metrics import RunStats

__all__ = ["Chunk", "Completion", "FinishReason", "Stats"]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Stats:
    """One decoding run (a batch shares it): what users compare across systems.

    `run` is everything the decoding loop measured; the properties are the numbers most
    compared (plain decoding: acceptance length 1, no draft or verify time).
    """

    run: RunStats
    build: str  # the artifact's build that ran ("ort-fp32", ...; "exported": no build)
    backend: str  # the runtime that ran it: "ort" (ONNX Runtime) or "trt" (TensorRT)
    speculation: str  # "on", or why it was off
    calibrated: CalibratedChoice | None = None  # the manifest entry used, if any
    build_reason: str = ""  # why this build runs (`specx.runtime.targets.build_reason`)
    draft: str | None = None  # what was drafted each round (`describe_drafts`); None: plain

    @property
    def mode(self) -> Literal["plain", "speculative"]:
        """The run's mode: "speculative" where it drafted, else "plain"."""
        return self.run.mode

    @property
    def drafter(self) -> str | None:
        """The drafter that ran; None when the run decoded plainly."""
        return None if self.run.speculative is None else self.run.speculative.drafter

    @property
    def batch(self) -> int:
        """Sequences decoded together."""
        return self.run.batch

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over the batch."""
        return self.run.prompt_tokens

    @property
    def new_tokens(self) -> int:
        """Generated tokens over the batch."""
        return self.run.new_tokens

    @property
    def prefill_s(self) -> float:
        """Seconds of the prefill (it emits each sequence's first token)."""
        return self.run.prefill_s

    @property
    def decode_s(self) -> float:
        """Seconds after the prefill."""
        return self.run.decode_s

    @property
    def ms_per_token(self) -> float:
        """Decode time per decoded token (after each sequence's first)."""
        return self.run.ms_per_token

    @property
    def acceptance_length(self) -> float:
        """Tokens per target forward per sequence, bonus counted; 1 plain."""
        spec = self.run.speculative
        return 1.0 if spec is None else spec.acceptance.acceptance_length

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        """[depth] share of rounds whose draft reached it that accepted it."""
        spec = self.run.speculative
        return () if spec is None else spec.acceptance.acceptance_by_position

    @property
    def draft_s(self) -> float:
        """Seconds proposing drafts."""
        return 0.0 if self.run.speculative is None else self.run.speculative.draft_s

    @property
    def verify_s(self) -> float:
        """Seconds of the speculative rounds' target forwards."""
        return 0.0 if self.run.speculative is None else self.run.speculative.verify_s

    @property
    def calibration(self) -> str | None:
        """The manifest entry used (calibration[...]), if any."""
        return None if self.calibrated is None else self.calibrated.key

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, as `specx generate --json` prints it (docs/cli.md)."""
        out = self.run.to_json()
        if self.run.speculation_off is not None:
            out["speculation"] = self.speculation  # the calibration's reason, where it decided
        if self.calibrated is not None:
            out["calibration"] = self.calibrated.to_json()
        if self.draft is not None:
            out["draft"] = self.draft
        return out | {
            "build": self.build,
            "backend": self.backend,
            "build_reason": self.build_reason,
        }


@dataclass(frozen=True)
class Completion:
    """One prompt's result. `text` is None when the artifact has no tokenizer."""

    prompt_tokens: list[int]
    tokens: list[int]  # generated (eos included when hit; up to the one completing a stop)
    text: str | None  # decoded, cut before the first stop string
    finish_reason: FinishReason  # "stop": eos or a stop string; "length": max_new_tokens
    stats: Stats


@dataclass(frozen=True)
class Chunk:
    """What `Engine.stream` yields per verified round: new tokens and the text they add."""

    tokens: list[int]
    text: str
    completion: Completion | None = None  # on the last chunk: the whole result
