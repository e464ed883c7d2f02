"""Decoders timed the same way in one process: specx and onnxruntime-genai, plus measured builds.

Every runner decodes one prompt greedily for exactly `new_tokens` tokens and reports the
prefill (prompt forward and the first token) apart from the decode loop (every later token),
so decode ms/token means the same on both sides. `interleave` runs all runners prompt by
prompt, `repeats` times each, rotating their order, and keeps each prompt's fastest
prefill and fastest decode per runner (on a shared machine interference only adds time).
`measured_run` runs a command in a child process and returns its wall time and peak RSS
(GNU time's, /usr/bin/time); `build_options` names the ONNX Runtime builds the benchmarks
make. `scratch_dir` is every benchmark's working folder.
"""

from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from specx.runtime.metrics import SpeculativeStats


@dataclass(frozen=True)
class Timing:
    """One decode: prompt forward + first token, the loop for the rest, the tokens."""

    prefill_s: float
    decode_s: float
    tokens: list[int]


class Runner(Protocol):
    """Decodes `new_tokens` greedy tokens after `prompt`."""

    def __call__(self, prompt: Sequence[int], new_tokens: int) -> Timing: ...


class TimedForwards:
    """A specx target whose `forward` and `decode_step` calls are timed into `calls` as
    (tokens per sequence, seconds): the target's cost measured inside the decoding loop, as
    OpenVINO GenAI's pipeline reports its own (`OpenvinoGenai.main_calls_ms`). The prompt's
    `feed` passes through untimed."""

    def __init__(self, target, calls: list[tuple[int, float]]):
        self._target, self._calls = target, calls

    def __getattr__(self, name: str):
        return getattr(self._target, name)

    def forward(self, cache, input_ids, *rest, **named):  # noqa: D102
        started = time.perf_counter()
        output = self._target.forward(cache, input_ids, *rest, **named)
        self._calls.append((int(input_ids.shape[1]), time.perf_counter() - started))
        return output

    def decode_step(self, cache, tokens, write_pos=None):  # noqa: D102
        started = time.perf_counter()
        output = self._target.decode_step(cache, tokens, write_pos)
        self._calls.append((1, time.perf_counter() - started))
        return output


def calls_ms(calls: list[tuple[int, float]]) -> dict[int, float]:
    """Median milliseconds of a target call, by tokens per call."""
    import numpy as np

    widths = sorted({n for n, _ in calls})
    return {n: 1e3 * float(np.median([s for w, s in calls if w == n])) for n in widths}


class SpecxPlain:
    """specx plain decoding of an artifact's build (None: the exported fp32 graphs).

    `sampling` (a specx SamplingParams; None: greedy) samples with its fixed seed.
    """

    def __init__(self, artifact: Path, build: str | None, threads: int, sampling=None):
        from specx.artifact import load_manifest
        from specx.runtime.targets import open_decoder

        self.target = open_decoder(load_manifest(artifact).with_build(build), threads=threads)
        self.sampling = sampling
        self.calls: list[tuple[int, float]] = []  # TimedForwards

    def __call__(self, prompt: Sequence[int], new_tokens: int) -> Timing:  # noqa: D102
        from specx.runtime.plain_decoding import generate_plain

        target = TimedForwards(self.target, self.calls)
        result = generate_plain(target, [list(prompt)], new_tokens, self.sampling)
        return Timing(result.stats.prefill_s, result.stats.decode_s, result.tokens[0])


class SpecxSpeculative:
    """specx speculative decoding; `drafter(prompt)` makes a drafter.

    A drafter that learns across requests (suffix drafting's trie) is made fresh for every
    run, or a repeated prompt would be drafted from its own earlier output. One that does
    not (heads, draft models, n-gram) is made once and reused, as `Engine` pools it: a fresh
    one opens new ONNX Runtime sessions every run, whose first calls (the head's prefill,
    the first draft) run slower than any later call, a cost no served request pays.
    """

    def __init__(self, target, drafter: Callable, sampling=None):
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.stats: dict[tuple[int, ...], SpeculativeStats] = {}  # per prompt, its last run
        self.calls: list[tuple[int, float]] = []  # TimedForwards
        self._kept = None  # the reused drafter, once made, when it does not learn

    def _drafter(self, prompt: Sequence[int]):
        if self._kept is not None:
            return self._kept
        drafter = self.drafter(prompt)
        if not drafter.learns_across_requests:
            self._kept = drafter
        return drafter

    def __call__(self, prompt: Sequence[int], new_tokens: int) -> Timing:  # noqa: D102
        from specx.runtime.speculative_decoding import generate_speculative

        target = TimedForwards(self.target, self.calls)
        result = generate_speculative(
            target, self._drafter(prompt), [list(prompt)], new_tokens, self.sampling
        )
        assert result.stats.speculative is not None  # no max_batch_spec: it speculated
        self.stats[tuple(prompt)] = result.stats.speculative
        return Timing(result.stats.prefill_s, result.stats.decode_s, result.tokens[0])


class GenaiPlain:
    """onnxruntime-genai's decoding of a model its builder wrote (greedy; or `temperature`)."""

    def __init__(self, model_dir: Path, threads: int, temperature: float = 0.0):
        import onnxruntime_genai as og

        config_path = model_dir / "genai_config.json"
        config = json.loads(config_path.read_text())
        options = config["model"]["decoder"].setdefault("session_options", {})
        options["intra_op_num_threads"] = threads
        config_path.write_text(json.dumps(config, indent=4))
        self.og, self.model = og, og.Model(str(model_dir))
        self.temperature, self.vocab = temperature, int(config["model"]["vocab_size"])

    def configure(self, params) -> None:
        """Options beyond greedy search (subclasses: speculative modes)."""

    def __call__(self, prompt: Sequence[int], new_tokens: int) -> Timing:  # noqa: D102
        params = self.og.GeneratorParams(self.model)
        length = len(prompt) + new_tokens
        # top_k = the vocabulary: no truncation, as specx's and OpenVINO's default
        sampled = {"temperature": self.temperature, "top_k": self.vocab, "random_seed": 0}
        params.set_search_options(
            max_length=length,
            min_length=length,
            do_sample=self.temperature > 0,
            **(sampled if self.temperature > 0 else {}),
        )
        self.configure(params)
        generator = self.og.Generator(self.model, params)
        started = time.perf_counter()
        generator.append_tokens(list(prompt))
        generator.generate_next_token()  # the first token comes from the prompt's forward
        prefilled = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        done = time.perf_counter()
        tokens = list(generator.get_sequence(0))[len(prompt) :][:new_tokens]
        return Timing(prefilled - started, done - prefilled, tokens)


class GenaiNgram(GenaiPlain):
    """onnxruntime-genai's n-gram (prompt lookup) speculative mode."""

    def configure(self, params) -> None:  # noqa: D102
        params.set_speculative_options(ngram_size=3, max_draft_tokens=6, ngram_chained_lookup=True)


# One pipeline per model, mode and draft model: a chain and its tree search differ only in
# the request's settings, and each pipeline holds its model and a 1 GB cache in memory.
_OPENVINO_PIPELINES: dict[tuple, object] = {}


class OpenvinoGenai:
    """OpenVINO GenAI's LLMPipeline: plain, prompt lookup or a draft model (EAGLE-3).

    Prefix caching is off (its default scheduler caches prefixes, so a repeated prompt
    would time a cached prefill). The first token's time is the pipeline's own TTFT
    (perf_metrics); the decode time is the call's wall time less it, as specx's.
    `mode`: "plain", "prompt-lookup" or "draft" (then `draft_dir`, an IR optimum-intel
    wrote); `assistant_tokens` is the draft length per round, or with `tree` (its tree
    search's `tree_depth`, draft iterations, and `branching_factor`, top-k per node and
    level: EAGLE-2's dynamic tree) the tree's nodes (the root not counted). `main_calls_ms`
    gathers the pipeline's own inference time of each main-model call after the prompt's
    (plain: a decode step; draft: a verify of the round's drafts): its target's cost inside
    its own loop.
    """

    def __init__(
        self,
        model_dir: Path,
        threads: int,
        mode: str = "plain",
        draft_dir: Path | None = None,
        assistant_tokens: int = 4,
        temperature: float = 0.0,
        tree: tuple[int, int] | None = None,
    ):
        import openvino_genai as ov_genai

        key = (model_dir, threads, mode, draft_dir)
        if key not in _OPENVINO_PIPELINES:
            scheduler = ov_genai.SchedulerConfig()
            scheduler.enable_prefix_caching = False
            scheduler.max_num_batched_tokens = 4096
            scheduler.cache_size = 1
            properties = {"INFERENCE_NUM_THREADS": threads}
            extra: dict = {}
            if mode == "prompt-lookup":
                extra["prompt_lookup"] = True
            elif mode == "draft":
                extra["draft_model"] = ov_genai.draft_model(str(draft_dir), "CPU", **properties)
            _OPENVINO_PIPELINES[key] = ov_genai.LLMPipeline(
                str(model_dir), "CPU", scheduler_config=scheduler, **extra, **properties
            )
        self.pipe = _OPENVINO_PIPELINES[key]
        self.ov_genai, self.mode = ov_genai, mode
        self.assistant_tokens, self.temperature, self.tree = assistant_tokens, temperature, tree
        self.main_calls_ms: list[float] = []

    def __call__(self, prompt: Sequence[int], new_tokens: int) -> Timing:  # noqa: D102
        import numpy as np
        import openvino as ov

        config = self.ov_genai.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = new_tokens
        config.ignore_eos = True
        if self.temperature > 0:
            config.do_sample, config.temperature, config.rng_seed = True, self.temperature, 0
        if self.mode != "plain":
            config.num_assistant_tokens = self.assistant_tokens
        if self.mode == "prompt-lookup":
            config.max_ngram_size = 3
        if self.tree is not None:
            config.tree_depth, config.branching_factor = self.tree
        ids = np.array([list(prompt)], dtype=np.int64)
        inputs = self.ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        started = time.perf_counter()
        result = self.pipe.generate(inputs, config)
        wall = time.perf_counter() - started
        ttft = result.perf_metrics.get_ttft().mean / 1e3
        if self.mode == "plain":  # the first entry is the prompt's forward
            calls = result.perf_metrics.raw_metrics.token_infer_durations[1:]
        elif self.mode == "draft":  # the main model's steps; the first is the prompt's
            calls = result.extended_perf_metrics.main_model_metrics.raw_metrics.m_durations[1:]
        else:
            calls = []
        self.main_calls_ms += [d / 1e3 for d in calls]  # microseconds
        tokens = [int(t) for t in result.tokens[0]][:new_tokens]
        return Timing(ttft, wall - ttft, tokens)


class LlamaServer:
    """llama.cpp's `llama-server` on 127.0.0.1, a process of its own (a context manager).

    `slots` sequences decoded together (continuous batching; 1,024 tokens of context each),
    the prompt cache off (`--cache-ram 0`, and `cache_prompt: false` on every
    request: a repeated prompt would time a cached prefill); `draft` and `args` start it
    with a draft model or head (`-md`, `--spec-type ...`). A server that dies (SIGILL in a
    kernel its build cannot run) raises RuntimeError naming its exit status.
    """

    def __init__(self, bin_dir: Path, model: Path, threads: int, draft: Path | None = None,
                 args: Sequence[str] = (), slots: int = 1):  # fmt: skip
        import socket

        with socket.socket() as probe:  # a free port, released for the server to take
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.command = [
            str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
            "--port", str(self.port), "-t", str(threads), "-tb", str(threads),
            "-c", str(1024 * slots), "-np", str(slots), "--cache-ram", "0", "--no-webui", *args,
        ]  # fmt: skip
        if draft is not None:
            self.command += ["-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            self._alive()
            try:
                if self._request("GET", "/health", None).get("status") == "ok":
                    return self
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"llama-server did not start in 300 s: {self.command}")

    def __exit__(self, *_) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)
        self.log.close()

    def _alive(self) -> None:
        assert self.process is not None
        code = self.process.poll()
        if code is not None:
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace")[-1500:]
            raise RuntimeError(f"llama-server exited with {code} (signal {-code}):\n{tail}")

    def _request(self, method: str, path: str, body: dict | None) -> dict:
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data, method=method,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def complete(self, prompt: Sequence[int], new_tokens: int, options: dict) -> dict:
        """A completion of exactly `new_tokens` tokens after the token ids `prompt`."""
        body = {
            "prompt": list(prompt), "n_predict": new_tokens, "ignore_eos": True,
            "cache_prompt": False, "return_tokens": True, "temperature": 0.0, **options,
        }  # fmt: skip
        try:
            return self._request("POST", "/completion", body)
        except OSError:
            self._alive()  # a dead server says why
            raise


class LlamaCompletion:
    """One llama.cpp mode on a running `LlamaServer`: greedy, or `temperature` over the
    whole distribution (top-k, top-p and min-p off, as specx's and OpenVINO's defaults),
    `options` the request's speculative settings (`speculative.n_max`, ...).

    TTFT is the server's own prompt time; the decode time is the request's wall time less
    it (HTTP included, as specx's decode includes its Python). `draft_tokens` and
    `accepted` sum the server's draft counts over runs (its last run per prompt kept).
    """

    def __init__(self, server: LlamaServer, options: dict | None = None, temperature=0.0):
        self.server, self.options = server, dict(options or {})
        if temperature > 0:
            self.options |= {"temperature": temperature, "top_k": 0, "top_p": 1.0,
                             "min_p": 0.0, "seed": 0}  # fmt: skip
        self.drafts: dict[tuple[int, ...], tuple[int, int]] = {}  # prompt -> (drafted, accepted)

    def __call__(self, prompt: Sequence[int], new_tokens: int) -> Timing:  # noqa: D102
        started = time.perf_counter()
        result = self.server.complete(prompt, new_tokens, self.options)
        wall = time.perf_counter() - started
        timings = result["timings"]
        ttft = timings["prompt_ms"] / 1e3
        self.drafts[tuple(prompt)] = (timings.get("draft_n", 0), timings.get("draft_n_accepted", 0))
        return Timing(ttft, wall - ttft, [int(t) for t in result["tokens"]][:new_tokens])


@dataclass
class Summary:
    """Each prompt's fastest prefill and decode for one runner, and its tokens."""

    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)

    def report(self, new_tokens: int) -> dict:
        """decode ms/token (tokens after the first), total ms/token (all), both fastest-of-N."""
        prompts = len(self.decode_s)
        decode = sum(self.decode_s)
        return {
            "decode_ms_per_token": 1e3 * decode / (prompts * (new_tokens - 1)),
            "total_ms_per_token": 1e3 * (decode + sum(self.prefill_s)) / (prompts * new_tokens),
            "prefill_ms": 1e3 * sum(self.prefill_s) / prompts,
        }


def interleave(
    runners: dict[str, Runner], prompts: Sequence[Sequence[int]], new_tokens: int, repeats: int
) -> dict[str, Summary]:
    """Runs every runner on every prompt `repeats` times, interleaved; fastest per prompt."""
    summaries = {name: Summary() for name in runners}
    names = list(runners)
    for p, prompt in enumerate(prompts):
        best: dict[str, Timing] = {}
        fastest_prefill: dict[str, float] = {}
        for r in range(repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                timing = runners[name](prompt, new_tokens)
                if len(timing.tokens) != new_tokens:
                    raise RuntimeError(
                        f"{name} emitted {len(timing.tokens)} tokens, not {new_tokens}"
                    )
                if name not in best or timing.decode_s < best[name].decode_s:
                    best[name] = timing
                fastest_prefill[name] = min(fastest_prefill.get(name, 1e9), timing.prefill_s)
        for name in names:
            summaries[name].decode_s.append(best[name].decode_s)
            summaries[name].prefill_s.append(fastest_prefill[name])
            summaries[name].tokens.append(best[name].tokens)
        print(f"  prompt {p + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    return summaries


@dataclass(frozen=True)
class Measured:
    """A child process: wall time, peak resident memory, exit code, end of its stderr."""

    seconds: float
    peak_rss_gb: float
    returncode: int
    stderr_tail: str


def measured_run(command: Sequence[str]) -> Measured:
    """Runs `command` under GNU time for its own peak RSS.

    Not os.wait4's: a child's ru_maxrss includes the pages it shared with its parent before
    exec, so a benchmark holding models would inflate every child's number.
    """
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        started = time.perf_counter()
        done = subprocess.run(
            ["/usr/bin/time", "-f", "%M", "-o", rss.name, *command],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        seconds = time.perf_counter() - started
        kib = int(rss.read().strip().splitlines()[-1] or 0)
    return Measured(
        seconds, kib / 2**20, done.returncode, done.stderr.decode(errors="replace")[-2000:]
    )


# A named ONNX Runtime build: precision and what a weight-only build quantizes ("draft": the
# head alone, the target stays fp32).
BUILDS = {
    "ort-fp32": ("fp32", None),
    "ort-int4": ("int4", "all"),
    "ort-int8-draft": ("int8", "draft"),
    "ort-int4-draft": ("int4", "draft"),
}


def build_options(name: str):
    """`specx.builders.BuildOptions` for a build in `BUILDS`."""
    from specx.builders import BuildOptions
    from specx.graphs.weight_only import WeightOnlyConfig

    precision, scope = BUILDS[name]
    config = WeightOnlyConfig(bits=int(precision[3:]), scope=scope) if scope else None
    return BuildOptions("ort", precision, weight_only=config)


def directory_gb(path: Path) -> float:
    """Bytes of all files under `path`, in GB (1e9)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e9


def scratch_dir(prefix: str) -> Path:
    """A new temporary folder, removed when the process exits (after an error too).

    Benchmarks export and build hundreds of MB per run; a folder per run left in /tmp filled
    the disk over a few runs.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
