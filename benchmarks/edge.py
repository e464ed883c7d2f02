"""The edge benchmark: pyref-1b at int4 on this CPU, specx against onnxruntime-genai and
OpenVINO GenAI on the same weights, in one process.

pyref-1b (benchmarks/models/pyref_wide.py: pyref-7m widened to 1.085B parameters, same logits) and
the committed pyref-7m drafters widened with it. Every runner decodes the same prompts (HumanEval
stubs and held-out stdlib files, as the suite) for exactly `--new-tokens` tokens at batch 1,
interleaved prompt by prompt, fastest of `--repeats` per prompt (benchmarks/runners.py);
decode ms/token (every token after the first) and TTFT (the prompt's forward and the first
token) are reported apart. A drafter that learns across requests (suffix) starts fresh for
every run (having seen the prompt's earlier run, it would draft its own output); the others are
made once and reused, as `specx.Engine` pools them (runners.SpecxSpeculative); OpenVINO's
prefix caching is off.

- specx: `specx export` + `specx build --precision int4` (the default int4 build) of
  pyref-1b with each head (eagle3, eagle, mtp, medusa; chains of 2, 3 and 4) and the draft
  model (its own int4 artifact); plain, n-gram and suffix on the plain artifact. On the
  OpenVINO build (`--openvino-builds`) also EAGLE-3's dynamic trees (TREES; greedy trees are
  exact on int4 builds through their spine, specx.runtime.spine).
- onnxruntime-genai: its builder's int4 (`-p int4`), plain and n-gram (ngram_size 3, 6
  draft tokens, chained lookup: benchmarks/peers.py's setting).
- OpenVINO GenAI: `optimum-cli export openvino --weight-format int4 --group-size 128 --ratio
  1.0`, plain, prompt lookup (4 draft tokens, n-grams of 3) and EAGLE-3 with the same widened
  EAGLE-3 head (exported by optimum-intel, its taps in the draft IR's `hidden_layers_list`),
  a chain of 4 draft tokens and its tree search on the same TREES. optimum-intel runs in its
  own virtual environment (`--ov-venv`; its pins clash with specx's: see
  ../shared/docs/design-notes.md section 11).

Greedy: every runner; every greedy specx output is compared with specx plain's. T=0.7
(`--sections sampled`): specx plain and the heads' chain 3 against each peer's plain.
Acceptance length (bonus counted) and acceptance by position for every specx drafter,
specx's verify curve t(N)/t(1), and for every specx chain its drafting per head step (c) and
its whole round in one-token target calls inside its loop, beside the bytes floor (the head's
streamed weights over the target's); a head's prefill of the prompt per request apart.
The target's cost per call inside each runtime's own loop, by tokens per call, the same
measure on both sides in the same run (`in_loop_costs`): specx's forwards timed around the
call, OpenVINO's main-model inference per call as its pipeline reports it.

Peers: `pip install -e ".[bench]"` (onnxruntime-genai, openvino-genai); the exporter's venv:
`python -m venv ~/.cache/specx/ov-export-venv && ~/.cache/specx/ov-export-venv/bin/pip install
torch==2.13.0 "optimum-intel[openvino]" einops && .../bin/pip uninstall -y torchvision`.

    python -m benchmarks.edge [--wide ~/.cache/specx/pyref-wide] [--prompts 6]
        [--new-tokens 64] [--repeats 3] [--sections greedy,sampled] [--only REGEX]
        [--int4-heads] [--openvino-builds] [--cpu-builds] [--llama-cpp]

`--llama-cpp`: llama.cpp's `llama-server` too (benchmarks/llama_cpp.py builds it and the GGUFs,
~30 minutes once): plain at Q4_0 and Q4_K_M, EAGLE-3 with the same widened head at Q4_0
(n-max 2-4), the draft model and n-gram lookup, token-id prompts on 127.0.0.1, the prompt
cache off; its output compared with its own plain output. It runs in processes of its own,
so it alternates with the other runners prompt by prompt rather than sharing a process.

`--openvino-builds`: the plain, EAGLE-3 and EAGLE-1 artifacts also get specx's OpenVINO int4
build (`specx build --backend openvino --precision int4`), timed as "specx-ov" rows (plain,
n-gram, the heads' chains) with their own verify curve, plain step and greedy comparison.
`--cpu-builds`: the same artifacts' build on specx's own CPU kernels (`specx build --backend
cpu --precision int4`), timed as "specx-cpu" rows alike.

`--int4-heads`: kinds with a head distilled against pyref-1b's int4 build
(`benchmarks/heads/pyref-1b-int4`, `pyref_heads --int4-twin`; what it bought:
docs/decisions.md#heads-distilled-against-fp32) draft with it, OpenVINO's EAGLE-3 included
when there is an int4-distilled EAGLE-3 head. Artifacts are rebuilt when the head they hold
changes.

Preparation (exports and builds, ~10 minutes) is kept under `--work` and reused. Writes
benchmarks/results/edge.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.inputs import RESULTS, ROOT, prompts_for
from benchmarks.models import pyref_wide
from benchmarks.runners import (
    GenaiNgram,
    GenaiPlain,
    LlamaCompletion,
    LlamaServer,
    OpenvinoGenai,
    SpecxPlain,
    SpecxSpeculative,
    build_options,
    calls_ms,
    interleave,
)

CACHE = Path.home() / ".cache" / "specx"
# Heads distilled against pyref-1b's int4 build (pyref_heads.py --int4-twin).
INT4_HEADS = ROOT / "benchmarks" / "heads" / "pyref-1b-int4"
HEADS = ("eagle3", "eagle", "mtp", "medusa")
CHAINS = (2, 3, 4)
# `--openvino-builds` / `--cpu-builds`: these artifacts also get specx's OpenVINO int4 build
# ("specx-ov" rows) / its build on specx's own CPU kernels ("specx-cpu" rows).
OV_ARTIFACTS = ("plain", "eagle3", "eagle")
OV_BUILD = "openvino-int4"
CPU_BUILD = "cpu-int4"
# A family of rows -> the build its runners open and the backend that builds it.
BUILD_FAMILIES = {"specx-ov": (OV_BUILD, "openvino"), "specx-cpu": (CPU_BUILD, "cpu")}
DRAFT_TOKENS = 4  # the peers' draft length per round
# EAGLE-2 dynamic trees both runtimes grow with the EAGLE-3 head: (nodes, draft iterations,
# top-k). OpenVINO GenAI's num_assistant_tokens, tree_depth, branching_factor; specx's
# `dynamic:nodes+1,iterations-1,top_k` (EAGLE's total_token counts the root, its depth the
# expansions after the root's children).
TREES = ((6, 4, 2), (10, 5, 2))


def specx_tree(nodes: int, iterations: int, top_k: int) -> str:
    """The `--tree` spec of the tree OpenVINO GenAI grows with these parameters."""
    return f"dynamic:{nodes + 1},{iterations - 1},{top_k}"


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Prepared:
    """Everything the runners open: specx artifacts by drafter, the peers' model folders."""

    specx: dict[str, Path]  # "plain", each head kind, "draft" (the draft model's artifact)
    genai: Path
    openvino: Path
    openvino_eagle3: Path | None
    eagle3_taps: tuple[int, ...]  # OpenVINO's numbering (outputs of layers)
    heads: dict[str, Path]  # the widened heads, by kind


def _done(directory: Path, stamp: str = "") -> bool:
    done = directory / ".complete"
    return done.is_file() and done.read_text() == stamp


def _mark(directory: Path, stamp: str = "") -> Path:
    (directory / ".complete").write_text(stamp)
    return directory


def _stamp(head: Path | None) -> str:
    """What a widened head was widened from (pyref_wide's source.json): rebuilt when it moves."""
    return (head / "source.json").read_text() if head else ""


def _build_stamp(head: Path | None) -> str:
    """A specx artifact's stamp: its head's and the int4 build's default configuration."""
    from specx.graphs.weight_only import WeightOnlyConfig

    return _stamp(head) + json.dumps(WeightOnlyConfig(bits=4).record(), sort_keys=True)


def int4_artifact(source: Path, artifact: Path, drafter: str | None, head: Path | None) -> Path:
    """`source` exported (with `drafter`) and built at int4 into `artifact`, as every runner
    here reads it; kept while `head` (a widened head, or None) is the one it was built with."""
    from specx.builders import build_artifact
    from specx.export.target_export import export_target

    if not _done(artifact, _build_stamp(head)):
        shutil.rmtree(artifact, ignore_errors=True)
        log(f"specx export + int4 build: {artifact}")
        export_target(source, artifact, max_context=1024, drafter=drafter)
        build_artifact(artifact, build_options("ort-int4"))
        _mark(artifact, _build_stamp(head))
    return artifact


def prepare_specx(target: Path, heads: dict[str, Path], work: Path) -> dict[str, Path]:
    """pyref-1b exported plain and with each head, the draft model alone; int4 builds."""
    draft = heads["draft-model"]
    jobs = {"plain": (target, None, None), "draft": (draft, None, draft)}
    jobs |= {kind: (target, f"{kind}:{heads[kind]}", heads[kind]) for kind in HEADS}
    return {
        name: int4_artifact(source, work / "specx" / name, drafter, head)
        for name, (source, drafter, head) in jobs.items()
    }


def _run(command: list[str], name: str, env: dict | None = None) -> None:
    log(f"{name}: {' '.join(command)}")
    environment = {**os.environ, **(env or {})}
    done = subprocess.run(
        command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=environment
    )
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr.decode(errors='replace')[-3000:]}")


def prepare_genai(target: Path, work: Path) -> Path:
    out = work / "genai-int4"
    if not _done(out):
        shutil.rmtree(out, ignore_errors=True)
        _run(
            [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(target),
             "-o", str(out), "-p", "int4", "-e", "cpu", "-c", str(work / "genai-cache")],
            "onnxruntime-genai builder",
        )  # fmt: skip
        _mark(out)
    return out


def prepare_openvino(target: Path, work: Path, venv: Path) -> Path:
    out = work / "openvino-int4"
    if not _done(out):
        shutil.rmtree(out, ignore_errors=True)
        _run(
            [str(venv / "bin" / "optimum-cli"), "export", "openvino", "-m", str(target),
             "--task", "text-generation-with-past", "--weight-format", "int4",
             "--group-size", "128", "--ratio", "1.0", str(out)],
            "optimum-cli export openvino",
        )  # fmt: skip
        _mark(out)
    return out


def prepare_openvino_eagle3(head: Path, taps: tuple[int, ...], work: Path, venv: Path) -> Path:
    """The EAGLE-3 head as an int4 OpenVINO IR, its taps in rt_info `hidden_layers_list`.

    optimum-intel exports the official layout itself (`LlamaForCausalLMEagle3`); with
    `--trust-remote-code` it checks that a `diffusers` package imports, which no release
    does next to transformers 5.x, so an empty one goes on PYTHONPATH (never used).
    OpenVINO GenAI shares the target's embedding with the draft at load time.
    """
    import openvino as ov

    out = work / "openvino-eagle3-int4"
    if _done(out, _stamp(head)):
        return out
    shutil.rmtree(out, ignore_errors=True)
    shim = work / "optimum-shim"
    (shim / "diffusers").mkdir(parents=True, exist_ok=True)
    (shim / "diffusers" / "__init__.py").write_text("")
    _run(
        [str(venv / "bin" / "optimum-cli"), "export", "openvino", "-m", str(head),
         "--task", "text-generation-with-past", "--trust-remote-code",
         "--disable-convert-tokenizer", "--weight-format", "int4", "--group-size", "128",
         "--ratio", "1.0", str(out)],
        "optimum-cli export openvino (EAGLE-3 head)",
        env={"PYTHONPATH": str(shim)},
    )  # fmt: skip
    xml = out / "openvino_model.xml"
    model = ov.Core().read_model(xml)
    model.set_rt_info(list(taps), ["hidden_layers_list"])
    staged = out / ".tapped"
    ov.save_model(model, staged / xml.name, compress_to_fp16=False)
    for name in (xml.name, xml.with_suffix(".bin").name):
        (staged / name).replace(out / name)
    staged.rmdir()
    return _mark(out, _stamp(head))


def extra_build(artifact: Path, backend: str) -> None:
    """specx's int4 build of `artifact` on `backend` ("openvino" or "cpu"), (re)built when the
    code that writes it changed."""
    import hashlib

    import specx.builders.cpu
    import specx.builders.cpu_read
    import specx.builders.openvino
    import specx.builders.ort
    import specx.graphs.ov_lowering
    from specx.artifact import load_manifest
    from specx.builders import BuildOptions, build_artifact

    if backend == "openvino":
        sources = [
            Path(m.__file__ or "") for m in (specx.builders.openvino, specx.graphs.ov_lowering)
        ]
    else:
        forward = Path(specx.builders.cpu.__file__ or "").parents[1] / "runtime/kernels/forward.c"
        sources = [Path(m.__file__ or "") for m in (specx.builders.cpu, specx.builders.cpu_read)]
        sources.append(forward)
    sources.append(Path(specx.builders.ort.__file__ or ""))
    code = b"".join(path.read_bytes() for path in sources)
    stamp, marker = hashlib.sha256(code).hexdigest(), artifact / f".{backend}-build"
    built = marker.is_file() and marker.read_text() == stamp
    if not built or f"{backend}-int4" not in load_manifest(artifact).builds:
        log(f"specx build --backend {backend} --precision int4: {artifact}")
        build_artifact(artifact, BuildOptions(backend=backend, precision="int4"), log)
        marker.write_text(stamp)


def prepare(
    wide: Path, work: Path, venv: Path, int4_heads: bool = False, families: Sequence[str] = ()
) -> Prepared:
    """Every artifact; `int4_heads`: kinds distilled against the int4 target use those heads;
    `families` (of BUILD_FAMILIES): OV_ARTIFACTS get their builds too."""
    shape = pyref_wide.Shape()
    target = pyref_wide.write_target(wide, shape)
    heads = pyref_wide.write_heads(wide, shape)
    if int4_heads:
        heads |= pyref_wide.write_heads(wide, shape, INT4_HEADS, "heads-int4")
    config = json.loads((heads["eagle3"] / "config.json").read_text())
    taps = tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    specx = prepare_specx(target, heads, work)
    for family in families:
        for name in OV_ARTIFACTS:
            extra_build(specx[name], BUILD_FAMILIES[family][1])
    genai = prepare_genai(target, work)
    openvino = prepare_openvino(target, work, venv)
    try:
        eagle3 = prepare_openvino_eagle3(heads["eagle3"], taps, work, venv)
    except SystemExit as e:  # reported, not fatal: the other runners still compare
        log(f"OpenVINO's EAGLE-3 could not be prepared: {e}")
        eagle3 = None
    return Prepared(specx, genai, openvino, eagle3, taps, heads)


def _factory(kind: str, target, tree: str) -> Callable:
    """A drafter factory (runners.SpecxSpeculative decides when it makes a new one)."""
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.tree_shapes import parse_tree_spec

    shape = parse_tree_spec(tree) if tree else None
    return lambda prompt: make_drafter(kind, target, DrafterOptions(tree=shape))


def specx_runners(prepared: Prepared, threads: int, sampling, chains=CHAINS) -> dict:
    from specx.artifact import load_manifest
    from specx.runtime.targets import open_decoder

    def target(name: str):
        return open_decoder(load_manifest(prepared.specx[name]).with_build("ort-int4"), threads)

    plain = target("plain")
    runners = {"specx plain": SpecxPlain(prepared.specx["plain"], "ort-int4", threads, sampling)}
    if sampling is None:
        runners["specx ngram"] = SpecxSpeculative(plain, _factory("ngram", plain, ""), sampling)
        runners["specx suffix"] = SpecxSpeculative(plain, _factory("suffix", plain, ""), sampling)
    draft_spec = f"draft-model:{prepared.specx['draft']}"
    for kind in (*HEADS, "draft-model"):
        verifier = plain if kind == "draft-model" else target(kind)
        spec = draft_spec if kind == "draft-model" else kind
        for n in chains:
            runners[f"specx {kind} chain {n}"] = SpecxSpeculative(
                verifier, _factory(spec, verifier, f"chain:{n}"), sampling
            )
    return runners


def specx_build_runners(
    prepared: Prepared, family: str, threads: int, sampling, chains=CHAINS
) -> dict:
    """A family's rows ("specx-ov", "specx-cpu"): specx's runtime on that build of
    OV_ARTIFACTS (plain, n-gram, the heads' chains, EAGLE-3's trees)."""
    from specx.artifact import load_manifest
    from specx.runtime.targets import open_decoder

    build = BUILD_FAMILIES[family][0]

    def target(name: str):
        return open_decoder(load_manifest(prepared.specx[name]).with_build(build), threads)

    plain = target("plain")
    runners = {f"{family} plain": SpecxPlain(prepared.specx["plain"], build, threads, sampling)}
    if sampling is None:
        runners[f"{family} ngram"] = SpecxSpeculative(plain, _factory("ngram", plain, ""), sampling)
    for kind in OV_ARTIFACTS[1:]:
        verifier = target(kind)
        for n in chains:
            runners[f"{family} {kind} chain {n}"] = SpecxSpeculative(
                verifier, _factory(kind, verifier, f"chain:{n}"), sampling
            )
        # Greedy trees are exact on these builds (the OpenVINO one through its spine,
        # specx.runtime.spine; the kernels' by construction); their verify is nearly flat to
        # ~8 tokens, where a tree can pay (on the ONNX Runtime build it does not).
        for tree in TREES if kind == "eagle3" and sampling is None else ():
            runners[f"{family} eagle3 tree {','.join(map(str, tree))}"] = SpecxSpeculative(
                verifier, _factory(kind, verifier, specx_tree(*tree)), sampling
            )
    return runners


def family_of(runner_name: str) -> str:
    """A row's runtime and build: "specx-ov" / "specx-cpu" for specx's OpenVINO / kernels
    build rows, "specx" for its ONNX Runtime rows, "llama.cpp" (Q4_0) or "llama.cpp-q4km",
    "openvino", "genai"."""
    return runner_name.split(" ", 1)[0]


def peer_runners(prepared: Prepared, threads: int, temperature: float) -> dict:
    runners = {
        "genai plain": GenaiPlain(prepared.genai, threads, temperature),
        "openvino plain": OpenvinoGenai(prepared.openvino, threads, temperature=temperature),
    }
    if temperature > 0:
        return runners
    runners["genai ngram"] = GenaiNgram(prepared.genai, threads)
    runners["openvino prompt lookup"] = OpenvinoGenai(
        prepared.openvino, threads, "prompt-lookup", assistant_tokens=DRAFT_TOKENS
    )
    if prepared.openvino_eagle3 is not None:
        runners["openvino eagle3"] = OpenvinoGenai(
            prepared.openvino, threads, "draft", prepared.openvino_eagle3, DRAFT_TOKENS
        )
        for nodes, iterations, top_k in TREES:
            runners[f"openvino eagle3 tree {nodes},{iterations},{top_k}"] = OpenvinoGenai(
                prepared.openvino, threads, "draft", prepared.openvino_eagle3, nodes,
                tree=(iterations, top_k),
            )  # fmt: skip
    return runners


# llama.cpp's speculative modes timed: EAGLE-3 with the same widened head (at Q4_0, as
# specx's int4 builds hold theirs; n-max 2-4), the draft model (n-max 4), n-gram lookup
# (ngram-simple). Each server holds its model in memory: 7 of them beside every other
# runtime's models fit this 24 GB machine with room for the page cache.
LLAMA_EAGLE3_N_MAX = (2, 3, 4)


def llama_servers(built, threads: int, stack: contextlib.ExitStack) -> dict[str, LlamaServer]:
    """One `llama-server` per model set and draft length: the draft model or head and its
    n-max are fixed at start (a request's `speculative.n_max` left the drafts unchanged)."""

    def server(model, draft=None, *args: str) -> LlamaServer:
        return stack.enter_context(LlamaServer(built.bin, model, threads, draft, args))

    servers = {
        "plain": server(built.target_q4_0),
        "q4km": server(built.target_q4_k_m),
        "draft": server(built.target_q4_0, built.draft, "--spec-type", "draft-simple",
                        "--spec-draft-n-max", "4"),
        "ngram": server(built.target_q4_0, None, "--spec-type", "ngram-simple"),
    }  # fmt: skip
    for n in LLAMA_EAGLE3_N_MAX:
        servers[f"eagle3 {n}"] = server(
            built.target_q4_0, built.eagle3, "--spec-type", "draft-eagle3",
            "--spec-draft-n-max", str(n),
        )  # fmt: skip
    return servers


def llama_runners(servers: dict[str, LlamaServer], temperature: float) -> dict:
    """llama.cpp's rows (its AMX setting is in the report): plain Q4_0 and Q4_K_M, and at
    T=0 its speculative modes on Q4_0."""
    runners = {
        "llama.cpp plain": LlamaCompletion(servers["plain"], temperature=temperature),
        "llama.cpp-q4km plain": LlamaCompletion(servers["q4km"], temperature=temperature),
    }
    if temperature > 0:
        return runners
    for n in LLAMA_EAGLE3_N_MAX:  # the head at Q4_0, as specx's int4 builds hold theirs
        runners[f"llama.cpp eagle3 n-max {n}"] = LlamaCompletion(servers[f"eagle3 {n}"])
    runners["llama.cpp draft-model n-max 4"] = LlamaCompletion(servers["draft"])
    runners["llama.cpp ngram-simple"] = LlamaCompletion(servers["ngram"])
    return runners


def acceptance(runner: SpecxSpeculative) -> dict:
    """Acceptance length and by position over the prompts, and drafting time per round."""
    runs = [s.acceptance for s in runner.stats.values()]
    rounds = sum(a.rounds for a in runs)
    emitted = sum(a.acceptance_length * a.rounds for a in runs)
    depth = max(len(a.acceptance_by_position) for a in runs)
    by_position = []
    for d in range(depth):
        rows = [a for a in runs if len(a.acceptance_by_position) > d]
        weight = sum(a.rounds for a in rows)
        by_position.append(sum(a.acceptance_by_position[d] * a.rounds for a in rows) / weight)
    draft = sum(s.draft_s for s in runner.stats.values())
    prefill = sum(s.draft_prefill_s for s in runner.stats.values())
    verify = sum(s.verify_s for s in runner.stats.values())
    return {
        "acceptance_length": emitted / rounds,
        "acceptance_by_position": by_position,
        "draft_ms_per_round": 1e3 * draft / rounds,
        "verify_ms_per_round": 1e3 * verify / rounds,
        # A head's prefill of the prompt, once per request before its first draft.
        "draft_prefill_ms_per_request": 1e3 * prefill / len(runs),
    }


def round_in_steps(row: dict, chain: int, step_ms: float) -> dict:
    """A chain row's round priced in the build's one-token target call inside the loop
    (`step_ms`): the drafting per head step (c) and the whole round (draft + verify)."""
    return {
        "draft_c_per_step": row["draft_ms_per_round"] / chain / step_ms,
        "round_target_steps": (row["draft_ms_per_round"] + row["verify_ms_per_round"]) / step_ms,
    }


def streamed_mb(graph: Path) -> float:
    """Megabytes of weights one call of a graph streams: every initializer a MatMul,
    MatMulNBits or Gemm takes past its input (codes, scales, zero points). An embedding's
    gathered row and a rescored top-k's rows are read a few rows at a time: not counted."""
    import onnx

    model = onnx.load(graph, load_external_data=False)
    size = {
        t.name: int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        for t in model.graph.initializer
    }
    weights = {
        name
        for node in model.graph.node
        if node.op_type in ("MatMul", "MatMulNBits", "Gemm")
        for name in node.input[1:]
        if name in size
    }
    return sum(size[name] for name in weights) / 1e6


def bytes_floor(artifact: Path) -> dict:
    """The head's weights streamed per draft step against the target's per decode step (the
    ONNX Runtime int4 build's graphs; the OpenVINO build holds the same int4 codes): the
    draft cost c a step would have if both streamed their bytes at one rate."""
    from specx.artifact import load_manifest

    manifest = load_manifest(artifact).with_build("ort-int4")
    head, target = (streamed_mb(manifest.path(manifest.runtime_graph(g).file))
                    for g in ("draft_head", "target"))  # fmt: skip
    return {"head_mb": head, "target_mb": target, "c_floor": head / target}


def section(name: str, runners: dict, prompts, args, curves: dict) -> dict:
    """One interleaved run of `runners`; per runner its times, acceptance and bound.

    A speculative row's bound is priced with its build's verify curve (`curves` by family)
    against its build's plain decode step, and its greedy output compared with that plain's.
    """
    log(f"{name}: {len(runners)} runners x {len(prompts)} prompts x {args.repeats} repeats")
    summaries = interleave(runners, prompts, args.new_tokens, args.repeats)
    rows = {n: s.report(args.new_tokens) for n, s in summaries.items()}
    loop = in_loop_costs(runners)
    for runner_name, runner in runners.items():
        row = rows[runner_name]
        row["ttft_ms"] = row.pop("prefill_ms")
        family = family_of(runner_name)
        curve = curves.get(family)
        if isinstance(runner, SpecxSpeculative) and curve is not None:
            plain = rows[f"{family} plain"]["decode_ms_per_token"]
            row.update(acceptance(runner))
            # A chain of N verifies N + 1 tokens (t from the curve); model-free drafts vary
            # in width: their measured verify time per round stands in.
            verify_ms = row["verify_ms_per_round"]
            if "chain" in runner_name:
                chain = int(runner_name.rsplit(" ", 1)[-1])
                verify_ms = 1e3 * curve(chain + 1)
                row.update(round_in_steps(row, chain, loop[family][1]))
            row["bound_vs_its_plain"] = (
                row["acceptance_length"] * plain / (verify_ms + row["draft_ms_per_round"])
            )
            row["speedup_vs_its_plain"] = plain / row["decode_ms_per_token"]
            row["of_bound"] = row["speedup_vs_its_plain"] / row["bound_vs_its_plain"]
        if isinstance(runner, LlamaCompletion) and any(d for d, _ in runner.drafts.values()):
            drafted = sum(d for d, _ in runner.drafts.values())
            row["draft_tokens_accepted_share"] = sum(a for _, a in runner.drafts.values()) / drafted
        plain_row = f"{family} plain"
        if name == "greedy" and plain_row in summaries and runner_name != plain_row:
            same = summaries[runner_name].tokens == summaries[plain_row].tokens
            row["identical_to_its_plain"] = same
    peers = {n: r for n, r in rows.items() if not n.startswith("specx")}
    fastest_peer = min(peers, key=lambda n: peers[n]["decode_ms_per_token"])
    fastest_ttft = min(r["ttft_ms"] for r in peers.values())
    exact = [n for n in rows if n.startswith("specx") and rows[n].get("identical_to_its_plain", 1)]
    best = min(exact, key=lambda n: rows[n]["decode_ms_per_token"])
    best_ms = rows[best]["decode_ms_per_token"]
    return {
        "rows": rows,
        "fastest_peer": fastest_peer,
        "specx_best": best,
        "specx_best_vs_genai_plain": rows["genai plain"]["decode_ms_per_token"]
        / rows[best]["decode_ms_per_token"],
        "specx_best_vs_fastest_peer": rows[fastest_peer]["decode_ms_per_token"]
        / rows[best]["decode_ms_per_token"],
        # TTFT of what specx's best row runs (its build and drafter), and of its plain ORT build.
        "specx_ttft_vs_fastest_peer_ttft": rows[best]["ttft_ms"] / fastest_ttft,
        "specx_plain_ttft_vs_fastest_peer_ttft": rows["specx plain"]["ttft_ms"] / fastest_ttft,
        "target_ms_per_call_in_loop": loop,
        # Each peer row's decode ms/token over specx's best exact row's: > 1, specx is faster.
        "specx_best_vs_each_peer": {
            n: r["decode_ms_per_token"] / best_ms for n, r in peers.items()
        },
        "specx_best_vs_its_plain": rows[f"{family_of(best)} plain"]["decode_ms_per_token"]
        / best_ms,
    }


def in_loop_costs(runners: dict) -> dict:
    """The target's median milliseconds per call inside each runtime's own decoding loop, by
    tokens per call: specx's every forward (TimedForwards, all its runners), OpenVINO's
    main-model inference per call as its pipeline reports it (plain: 1 token; EAGLE-3: its
    drafts + 1, a chain's or a tree's). The same measure on both sides, in the same run."""
    calls: dict[str, list[tuple[int, float]]] = {}
    for name, runner in runners.items():
        if name.startswith("specx"):
            calls.setdefault(family_of(name), []).extend(runner.calls)
    costs: dict = {family: calls_ms(timed) for family, timed in calls.items()}
    for runner in runners.values():
        if isinstance(runner, OpenvinoGenai) and runner.main_calls_ms:
            width = 1 if runner.mode == "plain" else runner.assistant_tokens + 1
            costs.setdefault("openvino", {})[width] = float(np.median(runner.main_calls_ms))
    return costs


def markdown(report: dict) -> str:
    lines = []
    for name, result in report["sections"].items():
        lines += [
            f"\n{name}: best specx = {result['specx_best']}, "
            f"{result['specx_best_vs_genai_plain']:.2f}x genai plain, "
            f"{result['specx_best_vs_fastest_peer']:.2f}x the fastest peer "
            f"({result['fastest_peer']}); TTFT / the fastest peer's: its "
            f"{result['specx_ttft_vs_fastest_peer_ttft']:.2f}, specx plain's "
            f"{result['specx_plain_ttft_vs_fastest_peer_ttft']:.2f}\n",
            "target ms per call inside each loop, by tokens per call: "
            + "; ".join(
                f"{side} " + ", ".join(f"t({n}) {ms:.1f}" for n, ms in sorted(costs.items()))
                for side, costs in result["target_ms_per_call_in_loop"].items()
            )
            + "\n",
            "| runner | decode ms/token | TTFT ms | tau | acceptance by position | of bound "
            "| c per step | round (steps) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for runner, row in sorted(
            result["rows"].items(), key=lambda r: r[1]["decode_ms_per_token"]
        ):
            tau = f"{row['acceptance_length']:.2f}" if "acceptance_length" in row else ""
            positions = ", ".join(f"{a:.2f}" for a in row.get("acceptance_by_position", []))
            bound = f"{row['of_bound']:.0%}" if "of_bound" in row else ""
            c = f"{row['draft_c_per_step']:.3f}" if "draft_c_per_step" in row else ""
            steps = f"{row['round_target_steps']:.2f}" if "round_target_steps" in row else ""
            lines.append(
                f"| {runner} | {row['decode_ms_per_token']:.2f} | {row['ttft_ms']:.0f} | {tau} "
                f"| {positions} | {bound} | {c} | {steps} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wide", type=Path, default=CACHE / "pyref-wide")
    parser.add_argument("--work", type=Path, default=CACHE / "edge")
    parser.add_argument("--ov-venv", type=Path, default=CACHE / "ov-export-venv")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sections", default="greedy,sampled")
    parser.add_argument("--only", default="", help="regex: time only the runners it matches")
    parser.add_argument("--prepare-only", action="store_true")
    parser.add_argument(
        "--int4-heads", action="store_true",
        help=f"kinds with a head under {INT4_HEADS} (distilled against the int4 target) use it",
    )  # fmt: skip
    parser.add_argument(
        "--openvino-builds", action="store_true",
        help=f"also time specx on its OpenVINO int4 build of {', '.join(OV_ARTIFACTS)} (specx-ov)",
    )  # fmt: skip
    parser.add_argument(
        "--cpu-builds", action="store_true",
        help=f"also time specx on its own kernels' int4 build of {', '.join(OV_ARTIFACTS)} "
        "(specx-cpu)",
    )  # fmt: skip
    parser.add_argument(
        "--llama-cpp", action="store_true",
        help="also time llama.cpp's llama-server (built and converted by llama_cpp.py)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "edge.json")
    args = parser.parse_args()
    if not (pyref_wide.SOURCE / "model.safetensors").is_file():
        log("skipped: shared/models/pyref-7m is absent")
        return
    from specx.calibration.costs import measure_verify_curve
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.tokenizer import TextTokenizer

    families = [
        family
        for family, wanted in (("specx-ov", args.openvino_builds), ("specx-cpu", args.cpu_builds))
        if wanted
    ]
    prepared = prepare(args.wide, args.work, args.ov_venv, args.int4_heads, families)
    built = None
    if args.llama_cpp:
        from benchmarks import llama_cpp

        built = llama_cpp.prepare(args.wide, CACHE / "llama.cpp")
    if args.prepare_only:
        return
    from specx.sessions import global_pool_created

    if families and global_pool_created():
        # The OpenVINO and kernels rows need ONNX Runtime's sessions on non-spinning pools,
        # which ONNX Runtime allows only before its global pool exists (specx.sessions).
        log("builds ran in this process (ONNX Runtime's global pool exists): run again to time")
        return
    tokenizer = TextTokenizer(pyref_wide.SOURCE / "tokenizer.json")
    prompts = prompts_for(tokenizer, args.prompts)[: args.prompts]
    report = {
        "benchmark": "edge",
        "target": "pyref-1b (pyref-7m widened x6 to 20 layers, 1.085B parameters), int4",
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "openvino_eagle3_taps": list(prepared.eagle3_taps),
        "llama_cpp": None if built is None else built.to_json(),
        "eagle3_bytes_floor": bytes_floor(prepared.specx["eagle3"]),
        "heads": {
            kind: "int4-distilled" if head.parent.name == "heads-int4" else "fp32-distilled"
            for kind, head in prepared.heads.items()
        },
        "sections": {},
    }
    keep = re.compile(args.only or ".")
    context = sum(len(p) for p in prompts) // len(prompts)
    curves = {}
    # Their builds first: an OpenVINO or kernels target makes every later ONNX Runtime session
    # non-spinning (specx.sessions.stop_spinning), which only works before the global pool exists.
    builds = {family: BUILD_FAMILIES[family][0] for family in families} | {"specx": "ort-int4"}
    curve_keys = {"specx": "specx_verify_curve", "specx-ov": "specx_openvino_verify_curve"}
    for family, build in builds.items():
        plain = SpecxPlain(prepared.specx["plain"], build, args.threads)
        widths = (1, 2, 3, 4, 5, 6, 7, 8, *(n + 1 for n, _, _ in TREES))
        curves[family] = measure_verify_curve(plain.target, widths, context, repeats=15)
        report[curve_keys.get(family, "specx_cpu_verify_curve")] = curves[family].summary()
        del plain
    settings = {"greedy": (None, 0.0), "sampled": (SamplingParams(0.7, seed=0), 0.7)}
    with contextlib.ExitStack() as stack:
        servers = None if built is None else llama_servers(built, args.threads, stack)
        for name in args.sections.split(","):
            sampling, temperature = settings[name]
            chains = CHAINS if sampling is None else (3,)
            runners = {}
            for family in families:
                runners |= specx_build_runners(prepared, family, args.threads, sampling, chains)
            runners |= specx_runners(prepared, args.threads, sampling, chains)
            runners |= peer_runners(prepared, args.threads, temperature)
            if servers is not None:
                runners |= llama_runners(servers, temperature)
            report["sections"][name] = section(name, kept(runners, keep), prompts, args, curves)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


def kept(runners: dict, keep: re.Pattern) -> dict:
    """The runners `--only` matches, each with its family's plain row (and genai's and
    specx's plain, which the summary compares with)."""
    names = {n for n in runners if keep.search(n)}
    names |= {f"{family_of(n)} plain" for n in names} | {"specx plain", "genai plain"}
    return {n: r for n, r in runners.items() if n in names}


if __name__ == "__main__":
    main()
