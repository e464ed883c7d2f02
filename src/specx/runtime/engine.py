"""The public API: `specx.load(artifact)` -> an `Engine` that generates, streams and chats.

    import specx
    engine = specx.load("artifacts/llama", threads=2)
    done = engine.generate("def fib(n):", max_new_tokens=64, speculation="ngram")
    print(done.text, done.stats.acceptance_length)
    for chunk in engine.stream("def fib(n):", speculation="suffix"):
        print(chunk.text, end="", flush=True)

An engine is what `specx generate` runs: the artifact's manifest verified, its default
build opened once, and per request the default a user gets from the command line (the
calibration entry nearest the request's sampling setting and the per-round controller;
`Speculation` overrides each part). Outputs are the target's: greedy speculative
decoding equals plain decoding token for token. Results are dataclasses; `Stats.run`
keeps everything the decoding loop measured (`specx.runtime.metrics`), `Stats.to_json` the
same as JSON.

One request decodes at a time per engine (a lock): the target's KV cache and the drafters'
state are per call. Drafters are built once per configuration and reused, so a draft
model's session opens once and suffix drafting learns from the engine's earlier requests.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specx.artifact import Manifest, load_manifest
from specx.chat import ChatTemplate
from specx.errors import GenerationError
from specx.runtime.calibrated import CalibratedChoice, verify_shape
from specx.runtime.continuous import ContinuousBatch
from specx.runtime.detokenize import TextStream
from specx.runtime.drafters import describe_drafts
from specx.runtime.engine_batch import EngineBatch
from specx.runtime.metrics import RunStats
from specx.runtime.plain_decoding import (
    GenerationResult,
    Progress,
    TokenSink,
    check_prompts,
    generate_plain,
)
from specx.runtime.plans import DraftPlan, Plans
from specx.runtime.prefix_cache import PrefixCache
from specx.runtime.results import Chunk, Completion, FinishReason, Stats
from specx.runtime.sampling import SamplingParams
from specx.runtime.speculation import Speculation, plan_for
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets import (
    backend_name,
    build_for_load,
    build_name,
    build_reason,
    open_decoder,
    select_build,
)
from specx.runtime.tokenizer import TextTokenizer

__all__ = ["Engine", "Speculation", "load"]

logger = logging.getLogger("specx")
Prompt = str | Sequence[int]


@dataclass(frozen=True)
class _Request:
    prompts: list[list[int]]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    eos: tuple[int, ...]
    speculation: Speculation | None


class Engine:
    """An opened artifact (see the module docstring). Build with `load`."""

    def __init__(
        self,
        manifest: Manifest,
        threads: int | None = None,
        named_build: bool = False,
        rows: int = 1,
    ):
        """An engine over `manifest`'s default build.

        `named_build`: the caller chose the build (not the artifact's default); `rows`: the
        sequences it will decode together (`load`).
        """
        self.manifest, self.threads = manifest, threads
        self.target = open_decoder(manifest, threads=threads)
        self.build_reason = build_reason(manifest, named_build, rows)  # in every run's stats
        file = manifest.tokenizer_file
        self.tokenizer = TextTokenizer(file) if file else None
        chat = manifest.chat_template_file
        self.chat_template = ChatTemplate.load(chat) if chat else None
        self.lock = threading.Lock()  # held by whoever runs the target (one at a time)
        # Each drafting plan's drafters and learnt state (the build's calibrated verify
        # curve prices widths not yet timed)
        self.plans = Plans(self.target, threads, verify_shape(manifest))

    @property
    def name(self) -> str:
        """The artifact's directory name (the model name the server reports)."""
        return self.manifest.root.name

    @property
    def build(self) -> str:
        """The build that runs (its name; "exported": the exported graphs)."""
        return build_name(self.manifest)

    @property
    def capacity(self) -> int:
        """Prompt + generated tokens one sequence may hold."""
        return self.target.capacity

    def decode_text(self, ids: list[int]) -> str:
        """Text of generated ids (special tokens skipped); "" without a tokenizer."""
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def text_stream(self, stop: Sequence[str] = ()) -> TextStream:
        """One sequence's streamed text (`specx.runtime.detokenize`), ending at `stop`."""
        if self.tokenizer is None:
            return TextStream(self.decode_text, stop)
        return TextStream(self.tokenizer.tokenizer, stop)

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt (special tokens added), or the ids given."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise GenerationError(
                    f"{self.manifest.root} has no tokenizer: pass the prompt as token ids"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise GenerationError("a prompt of token ids must hold non-negative integers")
        if not ids:
            raise GenerationError("the prompt is empty")
        return ids

    def use_chat_template(self, template: ChatTemplate) -> None:
        """Formats chat messages with `template` instead of the artifact's (or its lack)."""
        template.check()
        self.chat_template = template

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of `messages` through the checkpoint's chat template."""
        if self.chat_template is None or self.tokenizer is None:
            # Said to HTTP clients too: no path, but the flags that supply one.
            what = "chat template" if self.tokenizer is not None else "tokenizer"
            raise GenerationError(
                f"the model {self.name} has no {what}, so it cannot format chat messages: send a "
                "plain prompt (completions), or supply a chat template (specx serve "
                "--chat-template FILE, or specx export --chat-template FILE)"
            )
        text = self.chat_template.render(messages)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompt: Prompt, **options: Any) -> Completion:
        """Completes one prompt; options as `generate_batch`."""
        return self.generate_batch([prompt], **options)[0]

    def chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> Completion:
        """Answers `messages` (the chat template's generation prompt); options as `generate`."""
        return self.generate(self.chat_prompt(messages), **options)

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        speculation: Speculation | str | None = None,
        progress: Progress | None = None,
    ) -> list[Completion]:
        """Completes prompts as one batch: plainly, or speculatively with `speculation`.

        Raises:
            GenerationError: bad prompts or options, before any decoding.
        """
        request = self._request(
            prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, speculation
        )
        texts = [self.text_stream(request.stop) for _ in request.prompts]

        def sink(row: int, tokens: list[int]) -> bool:
            texts[row].push(tokens)
            return not texts[row].stopped

        result, stats = self._decode(request, sink if request.stop else None, progress)
        return self._completions(request, result, stats, texts)

    def stream(self, prompt: Prompt, **options: Any) -> Iterator[Chunk]:
        """Yields each verified round's tokens and text; the last chunk has the `Completion`.

        Closing the iterator early ends the decoding at its next round.
        """
        request = self._request([prompt], **options)
        text = self.text_stream(request.stop)
        chunks: queue.Queue = queue.Queue()
        gone = threading.Event()

        def sink(row: int, tokens: list[int]) -> bool:
            before = len(text.tokens)
            delta = text.push(tokens)
            chunks.put(Chunk(text.tokens[before:], delta))
            return not (text.stopped or gone.is_set())

        def work() -> None:
            try:
                result, stats = self._decode(request, sink, None)
                chunks.put(self._completions(request, result, stats, [text])[0])
            except BaseException as e:  # handed to the consumer's thread
                chunks.put(e)

        worker = threading.Thread(target=work, name="specx-stream", daemon=True)
        worker.start()
        try:
            while True:
                item = chunks.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Completion):
                    yield Chunk([], text.finish(), item)
                    return
                yield item
        finally:
            gone.set()
            worker.join()

    def _request(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        speculation: Speculation | str | None = None,
    ) -> _Request:
        if isinstance(prompts, str) or not prompts:
            raise GenerationError("prompts must be a non-empty list of prompts")
        ids = [self.encode(p) for p in prompts]
        try:
            sampling = SamplingParams(temperature, top_k, top_p, seed)
        except ValueError as e:
            raise GenerationError(str(e)) from e
        if isinstance(stop, str):
            stop = (stop,)
        if stop and self.tokenizer is None:
            raise GenerationError("stop strings need the artifact's tokenizer")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(
                f"max_new_tokens must be a positive integer, got {max_new_tokens}"
            )
        if isinstance(speculation, str):
            speculation = Speculation(speculation)
        check_prompts(ids, max_new_tokens, self.target.capacity, self.target.vocab_size)
        eos = () if ignore_eos else self.manifest.model.eos_token_ids
        return _Request(ids, max_new_tokens, sampling, tuple(stop), eos, speculation)

    def _decode(
        self, request: _Request, sink: TokenSink | None, progress: Progress | None
    ) -> tuple[GenerationResult, Stats]:
        with self.lock:
            if request.speculation is None:
                result = generate_plain(
                    self.target,
                    request.prompts,
                    request.max_new_tokens,
                    request.sampling,
                    request.eos,
                    progress,
                    sink,
                )
                return result, self._stats(result.stats, "off")
            return self._speculative(request, sink, progress)

    def _stats(
        self,
        run: RunStats,
        speculation: str,
        calibrated: CalibratedChoice | None = None,
        draft: str | None = None,
    ) -> Stats:
        build, backend = build_name(self.manifest), backend_name(self.manifest)
        return Stats(run, build, backend, speculation, calibrated, self.build_reason, draft)

    def plan(self, speculation: Speculation, sampling: SamplingParams) -> DraftPlan:
        """What a request with `speculation` at `sampling` drafts with (see `DraftPlan`)."""
        return plan_for(self.manifest, speculation, sampling, self.threads)

    def check_plan(self, plan: DraftPlan) -> int:
        """Builds `plan`'s drafter once (pooled), raising SpecxError where it cannot be built.

        Returns the KV slots a sequence drafting with it needs past its history.
        """
        return self.plans.check(plan)

    def continuous_batch(self, slots: int, prefix_cache: PrefixCache | None = None) -> EngineBatch:
        """A continuous batch of `slots` sequences over this engine's target (a server's)."""
        return EngineBatch(ContinuousBatch(self.target, slots, prefix_cache), self.plans, self.lock)

    def _speculative(self, request: _Request, sink, progress) -> tuple[GenerationResult, Stats]:
        speculation = request.speculation
        assert speculation is not None  # plain requests never get here
        plan = self.plan(speculation, request.sampling)
        self.plans.warn_inexact(plan, request.sampling)
        drafter = self.plans.take(plan)
        batch = len(request.prompts)
        sampling, prompts, tokens = request.sampling, request.prompts, request.max_new_tokens
        try:
            result = generate_speculative(
                self.target,
                drafter,
                request.prompts,
                request.max_new_tokens,
                request.sampling,
                request.eos,
                plan.max_batch_spec,
                progress=progress,
                controller=self.plans.controller(plan, drafter, sampling, prompts, tokens, batch),
                sink=sink,
            )
        finally:
            self.plans.give_back(plan, drafter)
        calibrated, off = plan.calibrated, result.stats.speculation_off
        if off is not None and calibrated is not None and speculation.max_batch_spec is None:
            off = _calibrated_off(calibrated.max_batch_spec, batch)
        spec = result.stats.speculative
        if spec is not None:
            self.plans.prefilled(plan, spec.draft_prefill_s, result.stats.prompt_tokens)
        # A run that fell back to plain decoding drafted nothing.
        draft = None if spec is None else describe_drafts(drafter)
        return result, self._stats(result.stats, off or "on", calibrated, draft)

    def reset_drafters(self) -> None:
        """Drops the pooled drafters that learn across requests, and what they learnt.

        Suffix drafting's shared trie remembers earlier requests' outputs; after this the
        next request drafts as on a fresh engine. A drafter whose proposals depend on its
        request alone (`learns_across_requests` False: heads, draft models, n-gram) stays
        pooled with its sessions open, as a server keeps it (what reopening them cost each
        request: docs/decisions.md#pooled-drafters-survive-reset).
        """
        self.plans.reset_drafters()

    def forget_requests(self) -> None:
        """Forgets what earlier requests taught: the next runs as a fresh engine's first.

        `reset_drafters`, and the round costs, asking and acceptance memories the
        controllers learnt (what a new process starts without: `specx generate` always,
        a server on its first request per batch size). Sessions stay open, and the timed
        prefill with them (a fresh engine times it when it opens them).
        """
        self.plans.forget()

    def _completions(
        self, request: _Request, result: GenerationResult, stats: Stats, texts: list[TextStream]
    ) -> list[Completion]:
        completions = []
        for prompt, tokens, text in zip(request.prompts, result.tokens, texts, strict=True):
            if text.stopped:
                reason: FinishReason = "stop"
                tokens = tokens[: len(text.tokens)]
            else:
                reason = "stop" if tokens and tokens[-1] in request.eos else "length"
            if self.tokenizer is None:
                decoded = None
            elif request.stop:
                decoded = text.text if text.stopped else self.tokenizer.decode(tokens)
            else:
                decoded = self.tokenizer.decode(tokens)
            completions.append(Completion(prompt, tokens, decoded, reason, stats))
        return completions


def load(
    artifact: str | Path, threads: int | None = None, build: str | None = None, rows: int = 1
) -> Engine:
    """Opens an artifact (manifest and file hashes verified) for generation.

    `build` names the build to run (`"exported"`: the exported graphs); None runs the
    artifact's default build, the newest one built (`specx export` builds `ort-fp32`), or,
    for `rows` sequences decoding together (a server's slots), the build `specx build
    --backend auto` timed fastest at that load (`build_for_load`).

    Raises:
        ArtifactError: not a specx artifact, a file does not match its hash, or no such build.
    """
    manifest = load_manifest(artifact)
    chosen = build if build is not None else build_for_load(manifest, rows)
    return Engine(select_build(manifest, chosen), threads, build is not None, rows)


def _calibrated_off(max_batch_spec: int, batch: int) -> str:
    if max_batch_spec == 0:
        return (
            "off: the calibration (specx calibrate) found no batch size where speculation "
            "pays on this machine; max_batch_spec (--max-batch-spec) overrides it"
        )
    return (
        f"off: the calibration (specx calibrate) found that speculation pays up to batch "
        f"{max_batch_spec}, and this batch is {batch}; max_batch_spec (--max-batch-spec) "
        "overrides it"
    )
