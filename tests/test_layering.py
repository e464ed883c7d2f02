"""The package's layers import only downward (issue 35): a scan of every import in src/."""

from __future__ import annotations

import ast
from pathlib import Path

import specx

ROOT = Path(specx.__file__).parent

# Package -> packages it must never import (lazily or not).
FORBIDDEN = {
    # The embedded runtime: numpy + onnxruntime (and the artifact it reads) only.
    "runtime": {
        *("export", "training", "calibration", "tensorrt", "cli", "build", "graphs", "server")
    },
    "graphs": {"runtime", "build", "calibration", "export", "training", "cli", "server"},
    "export": {"training", "build", "calibration", "cli", "server"},
    "build": {"calibration", "training", "cli", "server"},
    "calibration": {"build", "training", "cli", "server"},
    "training": {"build", "calibration", "cli", "server"},
}


def _imported_packages(path: Path) -> set[str]:
    packages = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        packages.update(n.split(".")[1] for n in names if n.startswith("specx."))
    return packages


def test_layers_import_only_downward():
    breaks = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for imported in sorted(_imported_packages(path) & forbidden):
                breaks.append(f"{path.relative_to(ROOT)} imports specx.{imported}")
    assert not breaks, "\n".join(breaks)


def test_the_scan_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from specx.training.corpus import x\n    import specx.cli\n")
    assert _imported_packages(module) == {"training", "cli"}
