"""The plugin kernel's PTX cap and scratch check, on CPU: each Triton `get_ptxas` form."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    # As tests/test_triton_kernel.py: Triton reads this when first imported, and on a machine
    # without a GPU its kernels there run in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import triton.backends.nvidia.compiler as nvidia_compiler  # noqa: E402

from specx.tensorrt import ptx  # noqa: E402
from specx.tensorrt.triton_tree_attention import check_no_scratch  # noqa: E402

FORMS = {
    # Triton <= 3.3: get_ptxas(arch) -> (path, version)
    "3.3": lambda arch: ("/opt/ptxas", "12.8"),
    # Triton 3.4-3.5: get_ptxas() -> a tool, no argument
    "3.5": lambda: SimpleNamespace(path="/opt/ptxas", version="12.8"),
    # Triton 3.6+: get_ptxas(arch) -> a tool
    "3.9": lambda arch: SimpleNamespace(path="/opt/ptxas", version="12.8"),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_the_ptx_cap_reads_every_get_ptxas_form(form, monkeypatch):
    monkeypatch.setattr(nvidia_compiler, "get_ptxas", FORMS[form])
    assert ptx.ptxas_version(90) == "12.8"
    monkeypatch.setattr(ptx, "driver_cuda_version", lambda: "12.4")
    ptx.driver_ptx_version.cache_clear()
    # min(CUDA 12.4 driver: PTX 8.4, ptxas 12.8: PTX 8.7)
    assert ptx.driver_ptx_version(90) == 84
    monkeypatch.setattr(ptx, "driver_cuda_version", lambda: None)
    ptx.driver_ptx_version.cache_clear()
    assert ptx.driver_ptx_version(90) is None  # no CUDA driver: Triton's default


def test_a_broken_get_ptxas_raises_instead_of_silently_dropping_the_cap(monkeypatch):
    monkeypatch.setattr(nvidia_compiler, "get_ptxas", lambda arch: SimpleNamespace())
    monkeypatch.setattr(ptx, "driver_cuda_version", lambda: "12.4")
    ptx.driver_ptx_version.cache_clear()
    with pytest.raises(AttributeError):
        ptx.driver_ptx_version(90)
    ptx.driver_ptx_version.cache_clear()


def test_scratch_memory_is_refused():
    check_no_scratch(SimpleNamespace(global_scratch_size=0, profile_scratch_size=0))
    check_no_scratch(SimpleNamespace())  # Triton versions without scratch fields
    with pytest.raises(RuntimeError, match="global_scratch"):
        check_no_scratch(SimpleNamespace(global_scratch_size=64, profile_scratch_size=0))
    with pytest.raises(RuntimeError, match="profile_scratch"):
        check_no_scratch(SimpleNamespace(global_scratch_size=0, profile_scratch_size=8))


def test_gpu_summary_reports_a_timed_out_file(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "test_a.code").write_text("124\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_summary", str(tmp_path), "tests/test_a.py"],
        capture_output=True, text=True, timeout=60, cwd=root,
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"] is False
    assert summary["files"]["tests/test_a.py"] == {
        "exit_code": 124,
        "error": "timed out (killed by timeout)",
    }
