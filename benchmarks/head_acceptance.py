"""Acceptance of every committed pyref-7m drafter at equal node counts: no timing, so it may
run beside other work.

On pyref-7m (exported with each head; the draft model as its own artifact), 18 held-out
prompts (12 HumanEval stubs + 6 stdlib files the reference split holds out, as the suite),
96 new tokens, batch 1: the acceptance length tau (tokens a round emits, the bonus counted)
and acceptance by depth, for a chain of 5 greedy and at T=0.7 and two EAGLE-2 dynamic trees
of 16 nodes greedy (`dynamic:17,5,4`: depth 5, top 4 per node; `dynamic:17,8,2`: depth 8,
top 2, the best of a sweep of 16-node shapes for EAGLE-3: benchmarks/README.md), and tau apart
for each prompt set (`tau_by_source`: HumanEval stubs, the edge benchmark's prompts, against
stdlib files, the heads' training kind of text). Medusa drafts its chain from the top-1 of
each of its heads (it has 4, so its chain stops at 4) and, drafting static trees only, its tree
from the first 16 nodes of its default tree (mc_sim_7b_63, most likely first); it has no deeper
tree. Every greedy output is compared with plain decoding's. Writes
benchmarks/results/head_acceptance.json (the kinds measured replace theirs; others are kept).

    python benchmarks/head_acceptance.py [--kinds eagle3,eagle,mtp,medusa,draft-model]
        [--heads benchmarks/heads/pyref-7m] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pyref_heads  # noqa: E402
from runners import scratch_dir  # noqa: E402
from suite import SHARED, prompt_sets, prompts_for  # noqa: E402

CONFIGS = {
    "chain 5 greedy": ("chain:5", 0.0),
    "chain 5 T=0.7": ("chain:5", 0.7),
    "tree 16 greedy": ("dynamic:17,5,4", 0.0),
    "deep tree 16 greedy": ("dynamic:17,8,2", 0.0),
}
STATIC_ONLY = {"medusa"}  # a tree from its 4 heads' default: no deeper shape to try


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def artifacts(kind: str, work: Path, heads: Path) -> tuple[Path, str]:
    """(target artifact, drafter spec) for the drafter `heads/kind` on pyref-7m."""
    from specx.export.target_export import export_target

    source = SHARED / "models" / "pyref-7m"
    if kind == "draft-model":
        draft = export_target(heads / kind, work / "draft", max_context=1024)
        return export_target(source, work / "plain", max_context=1024), f"{kind}:{draft}"
    head = f"{kind}:{heads / kind}"
    return export_target(source, work / kind, max_context=1024, drafter=head), kind


def measure(target, spec: str, tree: str, temperature: float, prompts, sources, new_tokens) -> dict:
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.drafters.medusa import MEDUSA_DEFAULT_TREE
    from specx.runtime.drafters.tree_search import parse_tree_spec
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.speculative_decoding import generate_speculative

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(pyref_heads.KINDS))
    parser.add_argument(
        "--heads", type=Path, default=pyref_heads.HEADS, help="a folder of <kind>/ drafters"
    )
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/head_acceptance.json"))
    args = parser.parse_args()
    if not (SHARED / "models" / "pyref-7m" / "model.safetensors").is_file():
        log("skipped: shared/models/pyref-7m is absent")
        return
    from specx.artifact import load_manifest
    from specx.runtime.ort_target import OrtTarget
    from specx.runtime.tokenizer import TextTokenizer

    prompts = prompts_for(TextTokenizer(SHARED / "models" / "pyref-7m" / "tokenizer.json"), 12)
    sources = prompt_sets(12)
    work = scratch_dir("specx-head-acceptance-")
    earlier = json.loads(args.out.read_text())["results"] if args.out.is_file() else {}
    report = {"benchmark": "head_acceptance", "prompts": len(prompts),
              "new_tokens": args.new_tokens, "results": earlier}  # fmt: skip
    for kind in args.kinds.split(","):
        artifact, spec = artifacts(kind, work / kind, args.heads)
        target = OrtTarget(load_manifest(artifact), threads=1)
        for name, (tree, temperature) in CONFIGS.items():
            if kind in STATIC_ONLY and name.startswith("deep"):
                continue
            row = measure(target, spec, tree, temperature, prompts, sources, args.new_tokens)
            report["results"][f"{kind} {name}"] = row
            depth = ", ".join(f"{a:.2f}" for a in row["acceptance_by_position"])
            split = ", ".join(f"{s} {v:.2f}" for s, v in row["tau_by_source"].items())
            log(f"{kind} {name}: tau {row['acceptance_length']:.2f} ({depth}; {split})")
            args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
