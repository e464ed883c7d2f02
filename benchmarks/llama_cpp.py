"""llama.cpp as a peer: built from a pinned source, pyref-1b and its drafters in GGUF.

Never a dependency of specx: the benchmarks (edge.py, real_size.py) time its `llama-server`
beside specx.

- Source: the sdist of llama-cpp-python (PINNED) vendors llama.cpp with its converter
  (`convert_hf_to_gguf.py`, gguf-py) and every tool; `pip download` fetches it from PyPI.
- Build: cmake + ninja, `-DGGML_NATIVE=ON` (the host's instruction sets), targets
  llama-server and llama-quantize, ~25 minutes on 2 cores. Where the native build's AMX
  kernels fault (a host seen here advertised AMX and ran a standalone AMX test, yet every
  llama.cpp binary died with SIGILL in ggml's AMX matmul), `prepare` sees the smoke run die
  with SIGILL and rebuilds ggml without AMX (`-mno-amx-*`); `Built.amx` says which ran.
- Models: pyref-1b at Q4_0 and Q4_K_M (from an f16 GGUF: llama-quantize), the widened
  EAGLE-3 head (`--target-model-dir`) in f16 and at Q4_0, and the widened draft model at Q4_0. The
  converter does not know pyref's pre-tokenizer hash: it is read as GPT-2's (prompts go in
  as token ids, and llama.cpp's /tokenize matched the HF ids). It reads EAGLE-3's taps from
  the config's top level only: the head is converted from a copy whose config has them
  there (nested under `eagle_config` the converter fell back to its default layers).

    python -m benchmarks.llama_cpp [--wide ~/.cache/specx/pyref-wide]
        [--work ~/.cache/specx/llama.cpp]

Everything is kept under `--work` and reused (a stamp per step); prints the paths as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PINNED = "llama-cpp-python==0.3.36"
CACHE = Path.home() / ".cache" / "specx"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Built:
    """A llama.cpp build and the GGUF files its benchmarks run."""

    bin: Path  # llama-server, llama-quantize
    amx: str  # "native" (as -march=native gives it) or "off: faulted (SIGILL)"
    target_q4_0: Path
    target_q4_k_m: Path
    eagle3: Path  # the widened EAGLE-3 head, Q4_0 (as specx's int4 builds hold it)
    eagle3_f16: Path  # the same head as converted, f16
    draft: Path  # the widened draft model, Q4_0

    def to_json(self) -> dict:  # noqa: D102
        return {k: str(v) for k, v in asdict(self).items()}


def _run(command: list[str], what: str, **kwargs) -> None:
    log(f"{what}: {' '.join(command)}")
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        sys.exit(f"{what} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _stamped(path: Path, stamp: str) -> bool:
    marker = path.with_name(path.name + ".stamp")
    return path.exists() and marker.is_file() and marker.read_text() == stamp


def _stamp(path: Path, stamp: str) -> None:
    path.with_name(path.name + ".stamp").write_text(stamp)


def source(work: Path) -> Path:
    """The vendored llama.cpp of the pinned sdist, unpacked under `work`."""
    name = PINNED.replace("==", "-").replace("-", "_", 2)  # llama_cpp_python-0.3.36
    tree = work / name / "vendor" / "llama.cpp"
    if tree.is_dir():
        return tree
    work.mkdir(parents=True, exist_ok=True)
    archive = work / f"{name}.tar.gz"
    if not archive.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              PINNED, "-d", str(work)], "pip download")  # fmt: skip
    with tarfile.open(archive) as sdist:
        sdist.extractall(work, filter="data")
    return tree


def build(tree: Path, work: Path, amx: bool) -> Path:
    """llama-server and llama-quantize for this host (`amx` False: AMX compiled out)."""
    folder = work / ("build" if amx else "build-no-amx")
    server = folder / "bin" / "llama-server"
    stamp = f"{PINNED} native amx={amx}"
    if _stamped(server, stamp):
        return server.parent
    flags = [] if amx else [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    _run(["cmake", "-S", str(tree), "-B", str(folder), "-G", "Ninja",
          "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF", *flags],
         "cmake")  # fmt: skip
    jobs = str(os.cpu_count() or 1)
    _run(["ninja", "-C", str(folder), "-j", jobs, "llama-server", "llama-quantize"],
         "ninja (~25 minutes on 2 cores)")  # fmt: skip
    _stamp(server, stamp)
    return server.parent


def bench_tool(work: Path) -> Path | None:
    """`llama-bench` of the host's build (linked on first use), or None where none is built.

    The build without AMX exists only where the native one faulted (`host_build`).
    """
    for folder in (work / "build-no-amx", work / "build"):
        server = folder / "bin" / "llama-server"
        if not _stamped(server, f"{PINNED} native amx={folder.name == 'build'}"):
            continue
        tool = folder / "bin" / "llama-bench"
        if not tool.is_file():
            _run(["ninja", "-C", str(folder), "llama-bench"], "ninja llama-bench")
        return tool
    return None


# Runs the vendored converter with one change: a pre-tokenizer hash it does not know is
# read as GPT-2's (pyref's BPE pre-tokenizes as GPT-2's does).
CONVERT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
TextModel.get_vocab_base_pre = get_vocab_base_pre
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def convert(tree: Path, model: Path, out: Path, outtype: str, *extra: str) -> Path:
    """An HF checkpoint to GGUF with the vendored converter (stamped with its source)."""
    stamp = f"{PINNED} {outtype} {extra} " + (model / "config.json").read_text()
    if _stamped(out, stamp):
        return out
    partial = out.with_name(out.name + ".partial")
    _run([sys.executable, "-c", CONVERT, str(tree), str(model), "--outfile", str(partial),
          "--outtype", outtype, *extra], f"convert {model.name}")  # fmt: skip
    partial.replace(out)
    _stamp(out, stamp)
    return out


def quantize(bin_dir: Path, source_gguf: Path, out: Path, kind: str) -> Path:
    """`llama-quantize` to `kind` (Q4_0, Q4_K_M)."""
    stamp = f"{PINNED} {kind} {source_gguf.stat().st_size}"
    if _stamped(out, stamp):
        return out
    partial = out.with_name(out.name + ".partial")
    _run(
        [str(bin_dir / "llama-quantize"), str(source_gguf), str(partial), kind], f"quantize {kind}"
    )
    partial.replace(out)
    _stamp(out, stamp)
    return out


def eagle3_layout(head: Path, work: Path) -> Path:
    """A copy of the widened EAGLE-3 head whose config holds its taps at the top level."""
    folder = work / "eagle3-head"
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((head / "config.json").read_text())
    config |= config.get("eagle_config", {})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("model.safetensors", "tokenizer.json"):
        if (head / name).is_file() and not (folder / name).exists():
            os.symlink(head / name, folder / name)
    return folder


def faults(bin_dir: Path, model: Path) -> bool:
    """Whether a short completion on `model` dies with SIGILL (the faulting AMX kernels)."""
    from benchmarks.runners import LlamaServer

    try:
        with LlamaServer(bin_dir, model, threads=2) as server:
            server.complete([1, 2, 3, 4], 4, {})
    except RuntimeError as e:
        return f"signal {signal.SIGILL.value}" in str(e) or "SIGILL" in str(e)
    return False


def host_build(tree: Path, work: Path, f16: Path, q4_0: Path) -> tuple[Path, str, Path]:
    """The build that runs on this host, its AMX state, and `f16` quantized to Q4_0 at `q4_0`.

    Built natively; where a smoke completion on the Q4_0 model dies with SIGILL, ggml is
    rebuilt without AMX.
    """
    bin_dir = build(tree, work, amx=True)
    quantized = quantize(bin_dir, f16, q4_0, "Q4_0")
    if not faults(bin_dir, quantized):
        return bin_dir, "native", quantized
    log("llama.cpp's native build died with SIGILL: rebuilding ggml without AMX")
    return build(tree, work, amx=False), "off: faulted (SIGILL)", quantized


def prepare(wide: Path, work: Path) -> Built:
    """Builds llama.cpp and converts pyref-1b and its drafters (kept and reused)."""
    tree = source(work)
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    target = wide / "pyref-1b"
    f16 = convert(tree, target, models / "pyref-1b-f16.gguf", "f16")
    layout = eagle3_layout(wide / "heads" / "eagle3", work)
    head = convert(
        tree, layout, models / "eagle3-f16.gguf", "f16", "--target-model-dir", str(target)
    )
    draft_f16 = convert(tree, wide / "heads" / "draft-model", models / "draft-f16.gguf", "f16")
    bin_dir, amx, q4_0 = host_build(tree, work, f16, models / "pyref-1b-q4_0.gguf")
    return Built(
        bin=bin_dir,
        amx=amx,
        target_q4_0=q4_0,
        target_q4_k_m=quantize(bin_dir, f16, models / "pyref-1b-q4_k_m.gguf", "Q4_K_M"),
        eagle3=quantize(bin_dir, head, models / "eagle3-q4_0.gguf", "Q4_0"),
        eagle3_f16=head,
        draft=quantize(bin_dir, draft_f16, models / "draft-q4_0.gguf", "Q4_0"),
    )


def plain_q4_0(checkpoint: Path, work: Path) -> tuple[Path, Path, str]:
    """Any HF checkpoint at Q4_0 for this host's build: (bin dir, the GGUF, AMX state)."""
    tree = source(work)
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    f16 = convert(tree, checkpoint, models / f"{checkpoint.name}-f16.gguf", "f16")
    bin_dir, amx, q4_0 = host_build(tree, work, f16, models / f"{checkpoint.name}-q4_0.gguf")
    return bin_dir, q4_0, amx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wide", type=Path, default=CACHE / "pyref-wide")
    parser.add_argument("--work", type=Path, default=CACHE / "llama.cpp")
    args = parser.parse_args()
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        sys.exit("llama.cpp's build needs cmake and ninja (apt install cmake ninja-build)")
    print(json.dumps(prepare(args.wide, args.work).to_json(), indent=2))


if __name__ == "__main__":
    main()
