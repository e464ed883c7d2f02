"""Plain (non-speculative) decoding: the reference every speculative run must equal."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specx.errors import CapacityError, GenerationError
from specx.runtime.metrics import RunStats
from specx.runtime.sampling import SamplingParams, next_tokens
from specx.runtime.targets.base import DecoderBackend

__all__ = [
    "GenerationResult",
    "Progress",
    "TokenSink",
    "check_prompts",
    "generate_plain",
    "prefill",
]

# progress(tokens emitted so far, sequences finished), called after every target forward.
Progress = Callable[[int, int], None]
# sink(row, tokens): a row's tokens as soon as they are final (streaming); returning False
# ends that row there (a stop string was found, the client went away).
TokenSink = Callable[[int, list[int]], bool]


@dataclass(frozen=True)
class GenerationResult:
    """Generated tokens per prompt (prompt excluded; eos included when hit) and stats."""

    tokens: list[list[int]]  # [batch][new]
    stats: RunStats


def check_prompts(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    capacity: int,
    vocab_size: int,
    extra_slots: int = 0,
) -> int:
    """Validates a batch of prompts; returns the KV slots it needs.

    A prompt of P tokens generating M tokens fills P + M - 1 slots (the last token is
    emitted, never fed back), plus `extra_slots` of scratch (e.g. a speculative tree).

    Raises:
        GenerationError: empty batch or prompt, token id outside the vocabulary, or a
            request that does not fit the KV capacity.
    """
    if not prompts:
        raise GenerationError("no prompts given")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise GenerationError(f"prompt {i} is empty")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise GenerationError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
    longest = max(len(p) for p in prompts)
    needed = longest + max_new_tokens - 1 + extra_slots
    if needed > capacity:
        raise CapacityError(longest, max_new_tokens, needed, capacity)
    return needed


def prefill(
    target: DecoderBackend,
    cache,
    prompts: Sequence[Sequence[int]],
    starts: np.ndarray | None = None,
):
    """Runs all prompts through the target in one forward; returns last-position logits.

    Shorter prompts are right-padded; their padding rows land past `lengths[b]`, are
    hidden by every later mask, and are overwritten by the next tokens. `starts[b]`
    (default 0) is where prompt b goes: the cache already holds its `starts[b]` tokens
    before it (a reused prefix).

    Returns:
        (logits [B, V] at each prompt's last token, full StepOutput).
    """
    starts = np.zeros(len(prompts), dtype=np.int64) if starts is None else starts
    lengths = starts + np.array([len(p) for p in prompts], dtype=np.int64)
    output, last_index = target.feed(cache, prompts, starts)
    cache.lengths[:] = lengths
    last = output.logits[np.arange(len(prompts)), last_index]
    return last, output


def generate_plain(
    target: DecoderBackend,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_ids: Sequence[int] = (),
    progress: Progress | None = None,
    sink: TokenSink | None = None,
) -> GenerationResult:
    """Decodes one token per target forward for each prompt, batched.

    Greedy takes the argmax; otherwise tokens are drawn from `sampling_probs`. A
    sequence stops after emitting an eos token, or where `sink` says so; the batch stops
    when all have.
    """
    sampling = sampling or SamplingParams()
    needed = check_prompts(prompts, max_new_tokens, target.capacity, target.vocab_size)
    rng = np.random.default_rng(sampling.seed)
    cache = target.allocate_cache(len(prompts), needed)
    eos = np.array(list(eos_token_ids), dtype=np.int64)
    started = time.perf_counter()
    logits, _ = prefill(target, cache, prompts)
    prefill_s = time.perf_counter() - started
    generated = np.zeros((len(prompts), max_new_tokens), dtype=np.int64)
    done = np.zeros(len(prompts), dtype=bool)
    stopped = np.full(len(prompts), max_new_tokens)  # where the sink ended each row
    steps = emitted = 0
    for step in range(max_new_tokens):
        tokens = next_tokens(logits, sampling, rng)
        generated[:, step] = tokens
        steps = step + 1
        emitted += int((~done).sum())
        if sink is not None:
            done |= _sink_step(sink, tokens, done, stopped, step)
        done |= (tokens[:, None] == eos).any(-1)  # np.isin costs ~30 us a step here
        last = done.all() or step == max_new_tokens - 1
        if progress is not None:
            progress(emitted, len(prompts) if last else int(done.sum()))
        if last:
            break
        logits = target.decode_step(cache, tokens).logits[:, 0]
        cache.lengths += 1
    total_s = time.perf_counter() - started
    tokens_out = [
        _until_eos(row[: min(steps, n)], eos) for row, n in zip(generated, stopped, strict=True)
    ]
    stats = RunStats.measure(prompts, tokens_out, prefill_s, total_s, steps - 1)
    return GenerationResult(tokens_out, stats)


def _sink_step(sink: TokenSink, tokens: np.ndarray, done: np.ndarray, stopped, step: int):
    """Hands each running row its token; returns the rows the sink ended (their length set)."""
    ended = np.zeros_like(done)
    for b in np.flatnonzero(~done):
        if not sink(int(b), [int(tokens[b])]):
            ended[b], stopped[b] = True, step + 1
    return ended


def _until_eos(row: np.ndarray, eos: np.ndarray) -> list[int]:
    hits = np.flatnonzero(np.isin(row, eos))
    return row[: hits[0] + 1 if hits.size else len(row)].tolist()
