"""What a verify of N rows costs at int4: ONNX Runtime's MatMulNBits by rows, block and level.

Speculation at int4 pays only if verifying N tokens costs little more than decoding one.
pyref-1b's int4 build (edge.py) measured t(N)/t(1) = 1.30 / 1.50 / 1.75 for N = 2 / 3 / 4,
far from the flat curve of a memory-bound step. This times one MatMulNBits per pyref-1b
projection shape (hidden 1920, 6 KV heads of 80, 7680 MLP units, vocabulary 4096; packed
q/k/v and gate/up as the exporter writes them) for M = 1..9 rows, at block sizes 32 and 128
and accuracy levels 0 (float activations) and 4 (int8 activations), and sums a layer's
projections times 20 layers plus the lm_head: the MatMul part of t(M) per configuration;
the same with 8-bit weights (accuracy level 4).
Fastest of --repeats per point, interleaved configuration by configuration.

One projection timed in a loop keeps its weights in cache, so M = 1 there is far cheaper than
in a decode step. `--streamed` times what a step does instead: a chain of `--layers` MLP
layers of pyref-1b's shapes (gate/up packed, down; distinct weights, larger than the caches),
median per point with the row counts taking turns, for the int4 default build (asymmetric,
blocks of 128, level 4), 8-bit MatMulNBits, and int8 weights per column through ONNX
Runtime's DynamicQuantizeMatMul (MLAS's packed int8 GEMM, which reads each weight once for
all rows).

    python benchmarks/matmulnbits_rows.py [--repeats 30] [--threads 2] [--streamed --layers 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir

from specx.graphs.weight_only import WeightOnlyConfig, WeightOnlyQuantizePass
from specx.sessions import load_session

RESULTS = Path(__file__).parent / "results" / "matmulnbits_rows.json"
STREAMED = RESULTS.with_name("matmulnbits_rows_streamed.json")
HIDDEN, KV, MLP, VOCAB, LAYERS = 1920, 6 * 80, 7680, 4096, 20
# (name, K, N, times per model)
SHAPES = (
    ("qkv", HIDDEN, HIDDEN + 2 * KV, LAYERS),
    ("o", HIDDEN, HIDDEN, LAYERS),
    ("gate_up", HIDDEN, 2 * MLP, LAYERS),
    ("down", MLP, HIDDEN, LAYERS),
    ("lm_head", HIDDEN, VOCAB, 1),
)
ROWS = range(1, 10)


def matmul(k: int, n: int, config: WeightOnlyConfig):
    """A session running x[M, k] @ W[k, n] as MatMulNBits."""
    weight = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32) * 0.02
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["m", k]))
    w = ir.Value(name="w", const_value=ir.tensor(weight))
    node = ir.node("MatMul", [x, w], name="mm")
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 21})
    model = ir.Model(graph, ir_version=10)
    WeightOnlyQuantizePass(config)(model)
    return load_session(ir.to_proto(model).SerializeToString())


def mlp_chain(layers: int, config: WeightOnlyConfig | None):
    """A session running x[M, HIDDEN] through `layers` x (gate_up, down) MatMuls: MatMulNBits
    under `config`, or (None) int8 per-column weights through DynamicQuantizeMatMul."""
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["m", HIDDEN]))
    nodes, initializers, value = [], [], x
    for layer in range(layers):
        for name, k, n in (("gate_up", HIDDEN, 2 * MLP), ("down", 2 * MLP, HIDDEN)):
            weight = rng.standard_normal((k, n)).astype(np.float32) * 0.02
            if config is None:
                scale = (np.abs(weight).max(0) / 127).astype(np.float32)
                codes = np.round(weight / scale).astype(np.int8)
                inputs = [ir.Value(name=f"{name}{layer}_{part}", const_value=ir.tensor(array))
                          for part, array in (("q", codes), ("scale", scale))]  # fmt: skip
                node = ir.node("DynamicQuantizeMatMul", [value, *inputs], domain="com.microsoft")
            else:
                inputs = [ir.Value(name=f"{name}{layer}", const_value=ir.tensor(weight))]
                node = ir.node("MatMul", [value, *inputs])
            node.name = f"{name}{layer}"
            initializers += inputs
            nodes.append(node)
            value = node.outputs[0]
    value.name = "y"
    opsets = {"": 21, "com.microsoft": 1}
    graph = ir.Graph([x], [value], nodes=nodes, initializers=initializers, opset_imports=opsets)
    model = ir.Model(graph, ir_version=10)
    if config is not None:
        WeightOnlyQuantizePass(config)(model)
    return load_session(ir.to_proto(model).SerializeToString())


def streamed(layers: int, repeats: int) -> dict:
    """Median ms of the MLP chain per row count M, per configuration (rows taking turns)."""
    configs: dict[str, WeightOnlyConfig | None] = {
        "int4-b128-level4-asymmetric": WeightOnlyConfig(4, 128, False, 4, 4, output_rescore=0),
        "int8-b128-level4": WeightOnlyConfig(8, 128, True, 4, 8),
        "int8-per-column-DynamicQuantizeMatMul": None,
    }
    report = {}
    for label, config in configs.items():
        session = mlp_chain(layers, config)
        feeds = {m: {"x": np.random.default_rng(m).standard_normal((m, HIDDEN), np.float32)}
                 for m in ROWS}  # fmt: skip
        times: dict[int, list[float]] = {m: [] for m in ROWS}
        for m in ROWS:
            session.run(None, feeds[m])
        for _ in range(repeats):
            for m in ROWS:
                start = time.perf_counter()
                session.run(None, feeds[m])
                times[m].append(time.perf_counter() - start)
        ms = [1e3 * float(np.median(times[m])) for m in ROWS]
        report[label] = {"ms": [round(t, 3) for t in ms],
                         "ratio_to_one_row": [round(t / ms[0], 3) for t in ms]}  # fmt: skip
        print(label, [round(t, 1) for t in ms], file=sys.stderr)
        del session
    return {"layers": layers, "weights": layers * 3 * HIDDEN * MLP, "configs": report}


def fastest(session, rows: int, repeats: int) -> float:
    x = np.random.default_rng(rows).standard_normal((rows, session.get_inputs()[0].shape[1]))
    feed = {"x": x.astype(np.float32)}
    session.run(None, feed)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feed)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streamed", action="store_true", help="the MLP chain (docstring)")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    from specx.sessions import configure_threads

    configure_threads(args.threads)
    if args.streamed:
        report = {"rows": list(ROWS), "threads": args.threads, "repeats": args.repeats}
        report |= streamed(args.layers, args.repeats)
        STREAMED.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {STREAMED}", file=sys.stderr)
        return
    configs = {
        f"b{block}-level{level}": WeightOnlyConfig(4, block, True, level, 4, output_rescore=0)
        for block in (32, 128)
        for level in (0, 4)
    }
    # 8-bit weights: twice the bytes, but no nibble unpacking per row.
    configs |= {
        f"b{block}-level4-8bit": WeightOnlyConfig(8, block, True, 4, 8) for block in (32, 128)
    }
    sessions = {
        (label, name): matmul(k, n, config)
        for label, config in configs.items()
        for name, k, n, _ in SHAPES
    }
    ms: dict[str, dict[str, list[float]]] = {label: {} for label in configs}
    for name, _, _, _ in SHAPES:
        for label in configs:
            ms[label][name] = [1e3 * fastest(sessions[label, name], m, args.repeats) for m in ROWS]
        print(name, {label: round(ms[label][name][0], 3) for label in configs}, file=sys.stderr)
    report = {"rows": list(ROWS), "threads": args.threads, "repeats": args.repeats, "configs": {}}
    for label in configs:
        total = [
            sum(ms[label][name][i] * times for name, _, _, times in SHAPES)
            for i in range(len(ROWS))
        ]
        report["configs"][label] = {
            "per_shape_ms": ms[label],
            "model_matmul_ms": [round(t, 3) for t in total],
            "ratio_to_one_row": [round(t / total[0], 3) for t in total],
        }
        print(label, "model ms", [round(t, 1) for t in total], file=sys.stderr)
        print(label, "t(M)/t(1)", [round(t / total[0], 2) for t in total], file=sys.stderr)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
