"""One side of a paired A/B of two checkouts: a drafter's default vs plain decoding, per cell.

Run it from each checkout in turn (A, B, A, B, ...: the processes alternate, so drift in the
machine falls on both sides), with that checkout's sources first on the path:

    cd CHECKOUT && PYTHONPATH=src python /path/to/benchmarks/ab_side.py ARTIFACT \
        [--drafter suffix] [--prompts 8] [--repeats 5] >> ab.jsonl

Each cell (T 0 / 0.7 / 1.0 x batch 1 / 4) is `controller.measure_cell` with a control (plain
timed twice, interleaved): compare the sides by default/control, the speedup over the cell's
own second plain run, which cancels what the run's plain decoding drew by chance.
Prints one JSON line: the checkout, then cell -> [default speedup, control speedup].
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from controller import BATCHES, TEMPERATURES, measure_cell  # noqa: E402
from peers import load_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--drafter", default="suffix")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    import specx
    from specx.runtime.engine import load

    half = args.prompts // 2
    prompts = load_prompts("humaneval.jsonl", half) + load_prompts(
        "mt_bench.jsonl", args.prompts - half
    )
    cell_args = types.SimpleNamespace(
        new_tokens=args.new_tokens, no_fixed=True, control=True, repeats=args.repeats
    )
    engine = load(args.artifact, threads=2)
    out: dict = {"specx": str(Path(specx.__file__).parents[2])}
    for temperature in TEMPERATURES:
        for batch in BATCHES:
            cell = measure_cell(engine, args.drafter, prompts, batch, temperature, cell_args)
            key = f"T{temperature}-b{batch}"
            out[key] = [round(cell["default_speedup"], 3), round(cell["control_speedup"], 3)]
            print(key, out[key], file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
