"""Held-out acceptance vs training tokens for every committed pyref-7m drafter.

Reads the learning curve each `benchmarks/heads/pyref-7m/<kind>/train_report.json` carries
(first-position acceptance `sum min(p, q)` on held-out target-generated windows, by draft
depth, and the chain-5 acceptance length those rates imply, measured every `eval_every`
steps during training) and writes benchmarks/results/learning_curves.{json,png}. The
extrapolation fits acceptance = a + b * log(tokens) to each curve's second half and reads
it at the tokens 3 hours of this machine's training would reach (the heads' measured
tokens/s): where a goal is not reached, this is the estimate of what more steps would buy.

    python benchmarks/learning_curves.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from pyref_heads import HEADS, KINDS, stages  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BUDGET_S = 3 * 3600
# Tokens/s measured alone, for runs whose train_seconds counts pauses (SIGSTOP while other
# work was timed): EAGLE-3's 3000-step run spans two sessions; 40 steps of its recipe, two
# threads, nothing else running, read 1,137 tokens/s (pyref_heads.NOTES).
RATE_ALONE = {"eagle3": 1137.0}


def extrapolate(curve: list[dict], key: str, tokens: float) -> float | None:
    """`key` at `tokens` from a log-linear fit to the curve's second half (None: too short)."""
    points = [c for c in curve if c["tokens"] > 0][len(curve) // 2 - 1 :]
    if len(points) < 3:
        return None
    x = np.log([c["tokens"] for c in points])
    b, a = np.polyfit(x, [c[key] for c in points], 1)
    return float(a + b * np.log(tokens))


def joined_curve(runs: list[dict]) -> list[dict]:
    """One curve over a head's training stages, each later stage's tokens counted on from the
    earlier ones' (its step-0 point, the earlier stage's last head, left out)."""
    curve: list[dict] = []
    for run in runs:
        offset = curve[-1]["tokens"] if curve else 0
        points = run["learning_curve"][1:] if curve else run["learning_curve"]
        curve += [{**c, "tokens": c["tokens"] + offset} for c in points]
    return curve


def main() -> None:
    report = {"benchmark": "learning_curves", "budget_seconds": BUDGET_S, "heads": {}}
    for kind in KINDS:
        path = HEADS / kind / "train_report.json"
        if not path.is_file():
            continue
        runs = stages(json.loads(path.read_text()))
        curve = joined_curve(runs)
        seconds = sum(run["train_seconds"] for run in runs)
        rate = RATE_ALONE.get(kind, curve[-1]["tokens"] / seconds)
        at_budget = rate * BUDGET_S
        report["heads"][kind] = {
            "curve": curve,
            "tokens_per_s": rate,
            "budget_tokens": at_budget,
            "acceptance_at_budget": extrapolate(curve, "acceptance", at_budget),
            "tau_chain5_at_budget": extrapolate(curve, "tau_chain5_estimate", at_budget),
        }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "learning_curves.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report)
    for kind, head in report["heads"].items():
        last = head["curve"][-1]
        print(
            f"{kind}: {last['tokens'] / 1e6:.1f}M tokens, acceptance {last['acceptance']:.3f}, "
            f"chain-5 tau ~{last['tau_chain5_estimate']:.2f}; at 3 h "
            f"({head['budget_tokens'] / 1e6:.0f}M tokens) ~{head['acceptance_at_budget']}"
        )


def plot(report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind, head in report["heads"].items():
        tokens = [c["tokens"] / 1e6 for c in head["curve"]]
        axes[0].plot(tokens, [c["acceptance"] for c in head["curve"]], marker=".", label=kind)
        axes[1].plot(tokens, [c["tau_chain5_estimate"] for c in head["curve"]], marker=".")
    axes[0].set(xlabel="training tokens (M)", ylabel="held-out first-position acceptance")
    axes[1].set(xlabel="training tokens (M)", ylabel="chain-5 acceptance length (estimate)")
    axes[0].legend()
    fig.suptitle("pyref-7m drafters: held-out acceptance vs training tokens")
    fig.tight_layout()
    fig.savefig(RESULTS / "learning_curves.png", dpi=110)


if __name__ == "__main__":
    main()
