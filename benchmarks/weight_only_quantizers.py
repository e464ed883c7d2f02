"""Weight-only int4 of one exported target: specx's pass against onnxruntime's quantizer.

`specx.graphs.weight_only.WeightOnlyQuantizePass` hand-writes MatMulNBits quantization;
onnxruntime ships `MatMulNBitsQuantizer`. Both quantize the same exported target (random
weights, `--preset`) at 4 bits, blocks of 32, symmetric, accuracy level 4, the lm_head
included; each run is a fresh subprocess that loads the graph, quantizes it and saves it
with its weights in one data file. Measured per run: wall time (load + quantize + save,
imports excluded) and the resident memory after the imports and at its peak during the
work (Linux: VmRSS, then VmHWM after resetting it through /proc/self/clear_refs; not
`ru_maxrss`, which keeps the RSS of the parent it was forked from). Fastest time and
largest peak of `--repeats` runs, interleaved. Then the saved weights are compared to
specx's: codes (value - zero point) and scales.

Quantizers: specx (its lm_head in 4 bits, no rescoring: like for like), specx-rescored
(the int4 build's default: the lm_head's top 16 logits recomputed from an 8-bit copy),
ort-default (`DefaultWeightOnlyQuantizer`: ONNX Runtime's C++ RTN) and ort-rtn
(`RTNWeightOnlyQuantConfig`: the Intel Neural Compressor port).

    python benchmarks/weight_only_quantizers.py [--preset bench-27m] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "weight_only_quantizers.json"
QUANTIZERS = ("specx", "specx-rescored", "ort-default", "ort-rtn")
BITS, BLOCK, LEVEL = 4, 32, 4


def _memory_mb(field: str) -> float:
    """VmRSS (resident now) or VmHWM (peak resident) of this process, in MB."""
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:")) / 1024


def _after_imports() -> float:
    """The resident MB now; the peak counts from here on."""
    Path("/proc/self/clear_refs").write_text("5")
    return _memory_mb("VmRSS")


def quantize_specx(source: Path, output: Path, rescore: int) -> tuple[float, float]:
    """Loads (weights memory-mapped), quantizes and saves as a specx build does.

    Returns:
        Seconds from load to saved, and the resident MB before the load.
    """
    import onnx_ir as ir

    from specx.graphs.model_io import save_streamed
    from specx.graphs.weight_only import WeightOnlyConfig, WeightOnlyQuantizePass

    config = WeightOnlyConfig(BITS, BLOCK, True, LEVEL, output_bits=4, output_rescore=rescore)
    imported = _after_imports()
    start = time.perf_counter()
    model = ir.load(source)
    WeightOnlyQuantizePass(config)(model)
    save_streamed(model, output, f"{output.name}.data")
    return time.perf_counter() - start, imported


def quantize_ort(source: Path, output: Path, algorithm: str) -> tuple[float, float]:
    """ONNX Runtime's quantizer as its command line runs it: `onnx.load`, then quantize, save.

    Returns:
        Seconds from load to saved, and the resident MB before the load.
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        MatMulNBitsQuantizer,
        RTNWeightOnlyQuantConfig,
    )

    algo = RTNWeightOnlyQuantConfig() if algorithm == "rtn" else None
    imported = _after_imports()
    start = time.perf_counter()
    quantizer = MatMulNBitsQuantizer(
        onnx.load(source), BITS, BLOCK, is_symmetric=True, accuracy_level=LEVEL, algo_config=algo
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(output), use_external_data_format=True)
    return time.perf_counter() - start, imported


def child(name: str, source: Path, output: Path) -> None:
    """One quantizer in this process; writes its time and memory to `output`.json."""
    if name.startswith("specx"):
        seconds, imported = quantize_specx(source, output, 16 if name == "specx-rescored" else 0)
    else:
        seconds, imported = quantize_ort(source, output, name.removeprefix("ort-"))
    run = {"seconds": seconds, "peak_rss_mb": _memory_mb("VmHWM"), "imports_rss_mb": imported}
    output.with_suffix(".json").write_text(json.dumps(run))


def run_child(name: str, source: Path, output: Path) -> dict:
    command = [sys.executable, __file__, "--child", name, str(source), str(output)]
    subprocess.run(command, capture_output=True, check=True)
    return json.loads(output.with_suffix(".json").read_text())


def weights(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per MatMulNBits, by its float weight's name: codes - zero [N, K] and scales [N, blocks]."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    tensors = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = {}
    for node in (n for n in model.graph.node if n.op_type == "MatMulNBits"):
        k = next(a.i for a in node.attribute if a.name == "K")
        scales = tensors[node.input[2]]
        n, blocks = scales.shape[0], scales.size // scales.shape[0]
        packed = tensors[node.input[1]]
        codes = np.stack([packed & 15, packed >> 4], -1).reshape(n, -1).astype(np.int16)
        zeros = np.full((n, blocks), 8, np.int16)
        if len(node.input) > 3 and node.input[3]:
            packed_zeros = tensors[node.input[3]]
            zeros = np.stack([packed_zeros & 15, packed_zeros >> 4], -1).reshape(n, -1)[:, :blocks]
        signed = codes - np.repeat(zeros, codes.shape[1] // blocks, axis=1)
        out[node.input[1].rsplit("_", 1)[0]] = (signed[:, :k], scales.reshape(n, blocks))
    return out


def floats(path: Path) -> dict[str, np.ndarray]:
    """The float32 initializers of the graph at `path`."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    return {
        t.name: numpy_helper.to_array(t)
        for t in model.graph.initializer
        if t.data_type == onnx.TensorProto.FLOAT
    }


def error(source: dict[str, np.ndarray], quantized: dict) -> float:
    """RMS of dequantized - float over RMS of float, all quantized weights together."""
    squared = norm = 0.0
    for name, (signed, scales) in quantized.items():
        weight = source[name].T  # [N, K]
        block = -(-weight.shape[1] // scales.shape[1])
        values = signed * np.repeat(scales, block, axis=1)[:, : weight.shape[1]]
        squared += float(((values - weight) ** 2).sum())
        norm += float((weight**2).sum())
    return (squared / norm) ** 0.5


def agreement(ours: dict, theirs: dict) -> dict:
    """How far `theirs` is from specx's codes, over the weights both quantized (K rows only,
    not the last block's padding, which MatMulNBits never reads)."""
    common = sorted(set(ours) & set(theirs))
    differing = total = 0
    scale_diff, step_diff = 0.0, 0
    for name in common:
        (a, scales_a), (b, scales_b) = ours[name], theirs[name]
        differing += int((a != b).sum())
        total += a.size
        scale_diff = max(scale_diff, float(np.abs(scales_a - scales_b).max()))
        step_diff = max(step_diff, int(np.abs(a - b).max()))
    return {
        "weights_compared": len(common),
        "weights_only_specx": len(set(ours) - set(theirs)),
        "weights_only_theirs": len(set(theirs) - set(ours)),
        "codes": total,
        "codes_differing": differing,
        "codes_max_diff_steps": step_diff,
        "scales_max_abs_diff": scale_diff,
    }


def exported_target(preset: str, workdir: Path) -> Path:
    """A random-weight llama of `preset`, exported (reused when already in `workdir`)."""
    artifact = workdir / f"llama-{preset}"
    if not (artifact / "target.onnx").exists():
        from specx.export.random_checkpoint import write_random_checkpoint
        from specx.export.target_export import export_target

        checkpoint = write_random_checkpoint(workdir / f"checkpoint-{preset}", "llama", preset)
        export_target(checkpoint, artifact, max_context=256, overwrite=True)
    return artifact / "target.onnx"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="bench-27m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "specx-woq")
    parser.add_argument("--child", nargs=3, metavar=("QUANTIZER", "SOURCE", "OUTPUT"))
    args = parser.parse_args()
    if args.child:
        name, source, output = args.child
        child(name, Path(source), Path(output))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    source = exported_target(args.preset, args.workdir)
    load = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in QUANTIZERS}
    for repeat in range(args.repeats):
        for name in QUANTIZERS:
            output = args.workdir / name / "target.onnx"
            shutil.rmtree(output.parent, ignore_errors=True)  # onnx appends to a data file
            output.parent.mkdir()
            runs[name].append(run_child(name, source, output))
            print(repeat, name, runs[name][-1], file=sys.stderr)
    import onnxruntime

    ours = weights(args.workdir / "specx" / "target.onnx")
    source_floats = floats(source)
    report = {
        "benchmark": "weight_only_quantizers",
        "command": f"python benchmarks/weight_only_quantizers.py --preset {args.preset} "
        f"--repeats {args.repeats}",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_1m_at_start": load[0],
        },
        "onnxruntime": onnxruntime.__version__,
        "target": f"llama {args.preset}, random weights",
        "float_weights_mb": round(Path(f"{source}.data").stat().st_size / 2**20, 1),
        "config": {"bits": BITS, "block_size": BLOCK, "symmetric": True, "accuracy_level": LEVEL},
        "quantizers": {},
    }
    for name in QUANTIZERS:
        output = args.workdir / name / "target.onnx"
        quantized = weights(output)
        kept = floats(output)
        report["quantizers"][name] = {
            "seconds": round(min(r["seconds"] for r in runs[name]), 3),
            "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs[name]), 1),
            "imports_rss_mb": round(max(r["imports_rss_mb"] for r in runs[name]), 1),
            "output_mb": round(Path(f"{output}.data").stat().st_size / 2**20, 1),
            "matmulnbits": len(quantized),
            "weight_relative_rms_error": round(error(source_floats, quantized), 5),
            "float_weights_kept_intact": all(
                np.array_equal(array, source_floats[name])
                for name, array in kept.items()
                if name in source_floats
            ),
            "codes_vs_specx": agreement(ours, quantized),
        }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["quantizers"], indent=2), file=sys.stderr)
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
