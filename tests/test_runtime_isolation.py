"""The embedded runtime needs numpy and onnxruntime only: no torch, no specx.export."""

from __future__ import annotations

import json
import subprocess
import sys

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "onnx", "onnxscript", "onnx_ir") \
                or name.startswith("specx.export"):
            raise ImportError(f"runtime imported {name}")
sys.meta_path.insert(0, Block())
from specx.cli import main
sys.exit(main())
"""


def test_generate_runs_without_torch_or_exporter(artifacts):
    args = [
        sys.executable,
        "-c",
        BLOCKER,
        "generate",
        str(artifacts["llama"]),
        "--prompt",
        "import sys",
        "--max-new-tokens",
        "4",
        "--json",
        "--threads",
        "2",
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["tokens"][0]) >= 1


def test_a_checkout_folder_named_specx_does_not_shadow_the_package(tmp_path):
    # The layout ../shared suggests puts a checkout named `specx` beside the working
    # directory; Python then sees an empty namespace package there unless the installed
    # package is a regular one found first (the src/ layout).
    (tmp_path / "specx").mkdir()
    code = "import specx; print(specx.load.__module__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "specx.runtime.engine"
