"""The newcomer's path: what `specx export` + `specx.load` run, against an explicit build.

Exports pyref-7m twice with the CLI: as a newcomer would (`specx export`, which ends with
the default CPU build) and with `--no-build` followed by `specx build --backend ort`. Then
decodes greedily through the public API (`specx.load(...).generate`) in one process,
interleaved prompt by prompt, fastest of --repeats: the default artifact, the explicitly
built one, and the default artifact's exported graphs (`build="exported"`). Reports decode
and total ms/token, the ratios, the build each run's stats name, and token identity.

    python benchmarks/export_default.py [--prompts 8] [--new-tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from peers import load_prompts  # noqa: E402
from runners import Timing, interleave, scratch_dir  # noqa: E402
from suite import SHARED  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "export_default.json"


class PublicApi:
    """`specx.load(artifact, build=...).generate(...)`, greedy, eos ignored."""

    def __init__(self, artifact: Path, build: str | None, threads: int):
        import specx

        self.engine = specx.load(artifact, threads=threads, build=build)
        self.builds: set[str] = set()

    def __call__(self, prompt: Sequence[int], new_tokens: int) -> Timing:  # noqa: D102
        done = self.engine.generate(list(prompt), max_new_tokens=new_tokens, ignore_eos=True)
        self.builds.add(done.stats.build)
        return Timing(done.stats.prefill_s, done.stats.decode_s, done.tokens)


def specx_cli(*args: object) -> None:
    subprocess.run([sys.executable, "-m", "specx.cli", *map(str, args)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    checkpoint = SHARED / "models" / "pyref-7m"
    if not checkpoint.is_dir():
        sys.exit(f"skipped: {checkpoint} is absent")
    work = scratch_dir("specx-export-default-")
    default, rebuilt = work / "default", work / "rebuilt"
    specx_cli("export", checkpoint, "-o", default)
    specx_cli("export", checkpoint, "-o", rebuilt, "--no-build")
    specx_cli("build", rebuilt, "--backend", "ort")
    prompts = load_prompts("humaneval.jsonl", args.prompts)
    runners = {
        "export (default)": PublicApi(default, None, args.threads),
        "export --no-build + build --backend ort": PublicApi(rebuilt, None, args.threads),
        "exported graphs (build='exported')": PublicApi(default, "exported", args.threads),
    }
    summaries = interleave(runners, prompts, args.new_tokens, args.repeats)
    reports = {name: summaries[name].report(args.new_tokens) for name in runners}
    base = reports["export (default)"]
    for name, report in reports.items():
        report["build"] = sorted(runners[name].builds)
        report["decode_ratio_to_default"] = (
            report["decode_ms_per_token"] / base["decode_ms_per_token"]
        )
        report["total_ratio_to_default"] = report["total_ms_per_token"] / base["total_ms_per_token"]
        report["tokens_equal_default"] = (
            summaries[name].tokens == summaries["export (default)"].tokens
        )
        print(name, json.dumps(report), file=sys.stderr)
    RESULTS.write_text(
        json.dumps({"setup": vars(args), "runs": reports}, indent=2, default=str) + "\n"
    )
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
