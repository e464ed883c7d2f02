"""The benchmark suite: every drafter on the reference target, against plain decoding and peers.

    python -m benchmarks.suite [--prompts 12] [--new-tokens 96] [--retrain]
    python -m benchmarks.suite --acceptance [--kinds eagle3,eagle,mtp,medusa,draft-model]
        [--heads benchmarks/heads/pyref-7m] [--out FILE]

Target: pyref-7m (`shared/models/pyref-7m`). Drafters: the committed ones under
benchmarks/heads/pyref-7m (benchmarks/models/pyref_heads.py; `--retrain` trains and ships them
again). Prompts: HumanEval stubs plus held-out stdlib files (`inputs.prompts_for`). In one run:
plain decoding vs n-gram, draft model, Medusa, EAGLE-1, EAGLE-3 (chain / static / dynamic) and
MTP, greedy and T=0.7; the dynamic-tree size sweep; the batch curve; transformers plain,
assisted generation and prompt lookup on the same weights; onnxruntime-genai when it can run.
specx rows keep each prompt's fastest of 3 runs (single runs moved by 15-20% on the shared
2-core machine). Writes `benchmarks/results/suite.json`, `suite.md` and PNG plots.

`--acceptance`: no timing, so it may run beside other work. Every committed drafter (`--kinds`
of `--heads`) on pyref-7m (exported with each head; the draft model as its own artifact), the
same prompts, batch 1: the acceptance length tau (tokens a round emits, the bonus counted) and
acceptance by depth, for a chain of 5 greedy and at T=0.7 and two EAGLE-2 dynamic trees of 16
nodes greedy (`dynamic:17,5,4`: depth 5, top 4 per node; `dynamic:17,8,2`: depth 8, top 2, the
best of a sweep of 16-node shapes for EAGLE-3), and tau apart for each prompt set
(`tau_by_source`: HumanEval stubs, the edge benchmark's prompts, against stdlib files, the
heads' training kind of text). Medusa drafts its chain from the top-1 of each of its heads (it
has 4, so its chain stops at 4) and, drafting static trees only, its tree from the first 16
nodes of its default tree (mc_sim_7b_63, most likely first); it has no deeper tree. Every greedy
output is compared with plain decoding's. Writes benchmarks/results/head_acceptance.json (the
kinds measured replace theirs; others are kept).

Skips cleanly (exit 0) when shared/ is absent.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.inputs import PYREF_7M, RESULTS, log, prompt_sets, prompts_for
from benchmarks.models import pyref_heads
from benchmarks.runners import scratch_dir

HEADS = ("eagle3", "eagle", "medusa", "mtp")
# --acceptance: name -> (tree, temperature)
CONFIGS = {
    "chain 5 greedy": ("chain:5", 0.0),
    "chain 5 T=0.7": ("chain:5", 0.7),
    "tree 16 greedy": ("dynamic:17,5,4", 0.0),
    "deep tree 16 greedy": ("dynamic:17,8,2", 0.0),
}
STATIC_ONLY = {"medusa"}  # a tree from its 4 heads' default: no deeper shape to try


def run_config(target, drafter, prompts, new_tokens, sampling, repeats: int = 3) -> dict:
    """Each prompt decoded `repeats` times; its fastest run counts (interference only adds time).

    Sampling uses a fixed seed, so every repeat emits the same tokens.
    """
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.speculative_decoding import generate_speculative

    rows = []
    for prompt in prompts:
        runs = []
        for _ in range(repeats):
            if drafter is None:
                runs.append(generate_plain(target, [prompt], new_tokens, sampling))
            else:
                runs.append(generate_speculative(target, drafter, [prompt], new_tokens, sampling))
        rows.append(min(runs, key=lambda r: r.stats.ms_per_token))
    stats = [r.stats for r in rows]
    out = {
        "ms_per_token": statistics.mean(s.ms_per_token for s in stats),
        "tokens_per_s": statistics.mean(s.tokens_per_s for s in stats),
        "tokens": [r.tokens[0] for r in rows],
    }
    if drafter is not None:
        spec = [s.speculative for s in stats if s.speculative is not None]  # all: no fallback
        acceptance = [s.acceptance for s in spec]
        out["acceptance_length"] = statistics.mean(a.acceptance_length for a in acceptance)
        depth = max(len(a.acceptance_by_position) for a in acceptance)
        out["acceptance_by_position"] = [
            statistics.mean(
                a.acceptance_by_position[d] for a in acceptance if len(a.acceptance_by_position) > d
            )
            for d in range(depth)
        ]
        out["draft_s_per_round"] = statistics.mean(
            s.draft_s / max(s.acceptance.rounds, 1) for s in spec
        )
    return out


def peers(model_dir: Path, draft_dir: Path, prompts, new_tokens: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    results = {}
    runs = {
        "transformers plain": {},
        "transformers assisted (draft model)": {"assistant_model": assistant},
        "transformers prompt lookup": {"prompt_lookup_num_tokens": 6},
    }
    for name, extra in runs.items():
        times = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                started = time.perf_counter()
                target.generate(
                    ids,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                    **extra,
                )
                times.append(time.perf_counter() - started)
        results[name] = {"ms_per_token": 1e3 * statistics.mean(times) / new_tokens}
    return results


def genai_peer(model_dir: Path, work: Path, prompts, new_tokens: int, threads: int) -> dict:
    """onnxruntime-genai plain and n-gram decoding, or the reason it could not run."""
    import subprocess

    try:
        import onnxruntime_genai as og
    except ImportError as e:
        return {"skipped": f"onnxruntime-genai is not installed: {e}"}
    out = work / "genai"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            str(model_dir),
            "-o",
            str(out),
            "-p",
            "fp32",
            "-e",
            "cpu",
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return {"skipped": f"the genai builder failed: {done.stderr[-400:]}"}
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config))
    model = og.Model(str(out))
    results = {}
    for name, ngram in (("onnxruntime-genai plain", False), ("onnxruntime-genai ngram", True)):
        times = []
        for prompt in prompts:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
            if ngram:
                params.set_speculative_options(
                    ngram_size=3, max_draft_tokens=6, ngram_chained_lookup=True
                )
            generator = og.Generator(model, params)
            started = time.perf_counter()
            generator.append_tokens(prompt)
            while not generator.is_done():
                generator.generate_next_token()
            times.append(time.perf_counter() - started)
        results[name] = {"ms_per_token": 1e3 * statistics.mean(times) / new_tokens}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--acceptance", action="store_true", help="acceptance only, no timing")
    parser.add_argument("--kinds", default=",".join(pyref_heads.KINDS), help="with --acceptance")
    parser.add_argument("--heads", type=Path, default=pyref_heads.HEADS,
                        help="with --acceptance: a folder of <kind>/ drafters")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "head_acceptance.json",
                        help="with --acceptance")  # fmt: skip
    args = parser.parse_args()
    if not (PYREF_7M / "model.safetensors").is_file():
        log(f"skipped: {PYREF_7M} is absent")
        return
    if args.acceptance:
        acceptance(args)
    else:
        timed(args)


def timed(args: argparse.Namespace) -> None:
    """The timed suite (the module docstring's first paragraph)."""
    model_dir = PYREF_7M
    from specx.artifact import load_manifest
    from specx.export.target_export import export_target
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.drafters.medusa import MEDUSA_DEFAULT_TREE
    from specx.runtime.tree_shapes import DynamicTree, StaticTree

    # 12 nodes on 5 levels, top-k 3 (EAGLE-2's total_token 13, depth 4), as in earlier runs
    DYNAMIC_12_5_3 = DynamicTree.of_nodes(12, 5, 3)  # noqa: N806
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.targets.ort import OrtTarget
    from specx.runtime.tokenizer import TextTokenizer

    started = time.perf_counter()
    drafters_dir = pyref_heads.trained_drafters(args.retrain)
    work = scratch_dir("specx-suite-")
    log("exporting the target with each head, and the draft model")
    arts = {
        kind: export_target(
            model_dir, work / kind, max_context=1024, drafter=f"{kind}:{drafters_dir[kind]}"
        )
        for kind in HEADS
    }
    arts["draft-model"] = export_target(
        drafters_dir["draft-model"], work / "draft", max_context=1024
    )
    targets = {kind: OrtTarget(load_manifest(arts[kind]), args.threads) for kind in HEADS}
    tokenizer = TextTokenizer(model_dir / "tokenizer.json")
    prompts = prompts_for(tokenizer, args.prompts)
    base = targets["eagle"]
    small_tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
    configs = {
        "ngram chain 6": (base, "ngram", DrafterOptions(6)),
        "draft-model chain 4": (base, f"draft-model:{arts['draft-model']}", DrafterOptions(4)),
        "medusa static mc_sim_7b_63": (
            targets["medusa"],
            "medusa",
            DrafterOptions(tree=StaticTree.from_choices(MEDUSA_DEFAULT_TREE)),
        ),
        "medusa static 7": (
            targets["medusa"],
            "medusa",
            DrafterOptions(tree=StaticTree.from_choices(small_tree)),
        ),
        "eagle chain 4": (base, "eagle", DrafterOptions(4)),
        "eagle static 7": (base, "eagle", DrafterOptions(tree=StaticTree.from_choices(small_tree))),
        "eagle dynamic 12,5,3": (base, "eagle", DrafterOptions(tree=DYNAMIC_12_5_3)),
        "eagle3 chain 4": (targets["eagle3"], "eagle3", DrafterOptions(4)),
        "eagle3 static 7": (
            targets["eagle3"],
            "eagle3",
            DrafterOptions(tree=StaticTree.from_choices(small_tree)),
        ),
        "eagle3 dynamic 12,5,3": (
            targets["eagle3"],
            "eagle3",
            DrafterOptions(tree=DYNAMIC_12_5_3),
        ),
        "mtp chain 3": (targets["mtp"], "mtp", DrafterOptions(3)),
        "mtp dynamic 12,5,3": (targets["mtp"], "mtp", DrafterOptions(tree=DYNAMIC_12_5_3)),
    }
    report = {
        "benchmark": "suite",
        "target": "pyref-7m",
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "drafter_training": {
            k: json.loads((v / "train_report.json").read_text()) for k, v in drafters_dir.items()
        },
        "results": {},
    }
    for label, sampling in (("greedy", SamplingParams()), ("T=0.7", SamplingParams(0.7, seed=0))):
        log(f"[{label}] plain")
        plain = run_config(base, None, prompts, args.new_tokens, sampling)
        report["results"][f"plain/{label}"] = {k: v for k, v in plain.items() if k != "tokens"}
        for name, (target, spec, options) in configs.items():
            log(f"[{label}] {name}")
            entry = run_config(
                target, make_drafter(spec, target, options), prompts, args.new_tokens, sampling
            )
            if sampling.greedy:
                entry["identical_to_plain"] = entry["tokens"] == plain["tokens"]
            entry["speedup"] = plain["ms_per_token"] / entry["ms_per_token"]
            entry["draft_cost_c"] = entry.pop("draft_s_per_round") / (plain["ms_per_token"] / 1e3)
            del entry["tokens"]
            report["results"][f"{name}/{label}"] = entry
    log("tree size sweep (eagle3 dynamic, greedy)")
    sweep = {}
    plain_ms = report["results"]["plain/greedy"]["ms_per_token"]
    for total in (2, 4, 8, 16, 32, 60):
        options = DrafterOptions(tree=DynamicTree.of_nodes(total, 6, 4))
        entry = run_config(
            targets["eagle3"],
            make_drafter("eagle3", targets["eagle3"], options),
            prompts,
            args.new_tokens,
            SamplingParams(),
        )
        sweep[total] = {
            "acceptance_length": entry["acceptance_length"],
            "speedup": plain_ms / entry["ms_per_token"],
        }
    report["tree_size_sweep"] = sweep
    log("batch curve (eagle3 dynamic 12,5,3, greedy)")
    curve = {}
    for batch in (1, 2, 4, 8):
        chunk = (prompts * 8)[:batch]
        drafter = make_drafter("eagle3", targets["eagle3"], DrafterOptions(tree=DYNAMIC_12_5_3))
        from specx.runtime.speculative_decoding import generate_speculative

        t0 = time.perf_counter()
        generate_plain(targets["eagle3"], chunk, args.new_tokens)
        t1 = time.perf_counter()
        generate_speculative(targets["eagle3"], drafter, chunk, args.new_tokens)
        t2 = time.perf_counter()
        curve[batch] = {
            "plain_s": t1 - t0,
            "speculative_s": t2 - t1,
            "speedup": (t1 - t0) / (t2 - t1),
        }
    report["batch_curve"] = curve
    losing = [b for b, v in curve.items() if v["speedup"] < 1.0]
    report["batch_where_speculation_stops_paying"] = min(losing) if losing else None
    log("peers: transformers, onnxruntime-genai")
    report["peers"] = peers(
        model_dir, drafters_dir["draft-model"], prompts[:6], args.new_tokens, args.threads
    )
    try:
        report["peers"].update(
            genai_peer(model_dir, work, prompts[:6], args.new_tokens, args.threads)
        )
    except Exception as e:  # a peer failing must not lose the rest of the run
        report["peers"]["onnxruntime-genai"] = {"skipped": f"{type(e).__name__}: {e}"}
    report["wall_s"] = time.perf_counter() - started
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "suite.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "suite.md").write_text(markdown(report))
    plots(report)
    print(markdown(report))


def acceptance_artifacts(kind: str, work: Path, heads: Path) -> tuple[Path, str]:
    """(target artifact, drafter spec) for the drafter `heads/kind` on pyref-7m."""
    from specx.export.target_export import export_target

    source = PYREF_7M
    if kind == "draft-model":
        draft = export_target(heads / kind, work / "draft", max_context=1024)
        return export_target(source, work / "plain", max_context=1024), f"{kind}:{draft}"
    head = f"{kind}:{heads / kind}"
    return export_target(source, work / kind, max_context=1024, drafter=head), kind


def measure(target, spec: str, tree: str, temperature: float, prompts, sources, new_tokens) -> dict:
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.drafters.medusa import MEDUSA_DEFAULT_TREE
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.speculative_decoding import generate_speculative
    from specx.runtime.tree_shapes import parse_tree_spec

    shape = parse_tree_spec(tree)
    if spec == "medusa" and tree.startswith("chain"):
        shape = parse_tree_spec("chain:4")
    elif spec == "medusa":  # static trees only: the 16 most likely nodes of its default tree
        shape = parse_tree_spec(json.dumps(MEDUSA_DEFAULT_TREE[:16]))
    drafter = make_drafter(spec, target, DrafterOptions(tree=shape))
    rounds = emitted = 0
    by_source: dict[str, list[float]] = {s: [0, 0] for s in sources}  # [rounds, emitted]
    reached: list[int] = []
    accepted: list[int] = []
    identical = True
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(temperature, seed=i)
        out = generate_speculative(target, drafter, [prompt], new_tokens, sampling)
        assert out.stats.speculative is not None  # no max_batch_spec: it speculated
        stats = out.stats.speculative.acceptance
        rounds += stats.rounds
        emitted += stats.acceptance_length * stats.rounds
        by_source[sources[i]][0] += stats.rounds
        by_source[sources[i]][1] += stats.acceptance_length * stats.rounds
        for d, rate in enumerate(stats.acceptance_by_position):
            while len(reached) <= d:
                reached.append(0)
                accepted.append(0)
            reached[d] += stats.rounds
            accepted[d] += rate * stats.rounds
        if sampling.greedy:
            identical &= out.tokens == generate_plain(target, [prompt], new_tokens).tokens
    return {
        "tree": tree if spec != "medusa" else "medusa chain:4 / mc_sim_7b_63[:16]",
        "acceptance_length": emitted / rounds,
        "acceptance_by_position": [a / r for a, r in zip(accepted, reached, strict=True)],
        "tau_by_source": {s: e / r for s, (r, e) in by_source.items()},
        "identical_to_plain": identical if temperature == 0 else None,
    }


def acceptance(args: argparse.Namespace) -> None:
    """`--acceptance` (the module docstring's second paragraph)."""
    from specx.artifact import load_manifest
    from specx.runtime.targets.ort import OrtTarget
    from specx.runtime.tokenizer import TextTokenizer

    prompts = prompts_for(TextTokenizer(PYREF_7M / "tokenizer.json"), args.prompts)
    sources = prompt_sets(args.prompts)
    work = scratch_dir("specx-head-acceptance-")
    earlier = json.loads(args.out.read_text())["results"] if args.out.is_file() else {}
    report = {"benchmark": "head_acceptance", "prompts": len(prompts),
              "new_tokens": args.new_tokens, "results": earlier}  # fmt: skip
    for kind in args.kinds.split(","):
        artifact, spec = acceptance_artifacts(kind, work / kind, args.heads)
        target = OrtTarget(load_manifest(artifact), threads=1)
        for name, (tree, temperature) in CONFIGS.items():
            if kind in STATIC_ONLY and name.startswith("deep"):
                continue
            row = measure(target, spec, tree, temperature, prompts, sources, args.new_tokens)
            report["results"][f"{kind} {name}"] = row
            depth = ", ".join(f"{a:.2f}" for a in row["acceptance_by_position"])
            split = ", ".join(f"{s} {v:.2f}" for s, v in row["tau_by_source"].items())
            log(f"{kind} {name}: tau {row['acceptance_length']:.2f} ({depth}; {split})")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")


def markdown(report: dict) -> str:
    lines = [
        "| drafter / decoding | acceptance length | acceptance @1,2,3 | c | ms/token | speedup "
        "| identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, e in report["results"].items():
        accept = ", ".join(f"{a:.2f}" for a in e.get("acceptance_by_position", [])[:3])
        lines.append(
            f"| {name} | {e.get('acceptance_length', 1.0):.2f} | {accept} | "
            f"{e.get('draft_cost_c', 0.0):.2f} | {e['ms_per_token']:.2f} | "
            f"{e.get('speedup', 1.0):.2f}x | {e.get('identical_to_plain', '')} |"
        )
    lines += ["", "| peer | ms/token |", "|---|---|"]
    for name, e in report["peers"].items():
        lines.append(
            f"| {name} | {e['ms_per_token']:.2f} |"
            if "ms_per_token" in e
            else f"| {name} | not run: {e['skipped'][:200]} |"
        )
    return "\n".join(lines) + "\n"


def plots(report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, e in report["results"].items():
        if name.endswith("/greedy") and "acceptance_by_position" in e:
            ax.plot(
                range(1, len(e["acceptance_by_position"]) + 1),
                e["acceptance_by_position"],
                marker="o",
                label=name.removesuffix("/greedy"),
            )
    ax.set(
        xlabel="draft position", ylabel="acceptance rate", title="Acceptance by position (greedy)"
    )
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(RESULTS / "acceptance_by_position.png", dpi=120)
    for key, xlabel, file in (
        ("tree_size_sweep", "dynamic tree nodes", "speedup_vs_tree_size.png"),
        ("batch_curve", "batch size", "speedup_vs_batch.png"),
    ):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = [int(x) for x in report[key]]
        ax.plot(xs, [report[key][x]["speedup"] for x in report[key]], marker="o")
        ax.axhline(1.0, color="grey", linestyle="--")
        ax.set(xlabel=xlabel, ylabel="speedup vs plain", xscale="log", title=key.replace("_", " "))
        fig.tight_layout()
        fig.savefig(RESULTS / file, dpi=120)


if __name__ == "__main__":
    main()
