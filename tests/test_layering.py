"""The package's layers import only downward (issue 35): a scan of every import in src/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import specx

ROOT = Path(specx.__file__).parent

# Package -> packages it must never import (lazily or not).
FORBIDDEN = {
    # The embedded runtime: numpy + onnxruntime (and the artifact it reads) only.
    "runtime": {
        *("export", "training", "calibration", "tensorrt", "cli", "builders", "graphs", "server")
    },
    "graphs": {"runtime", "builders", "calibration", "export", "training", "cli", "server"},
    "export": {"runtime", "training", "builders", "calibration", "cli", "server"},
    # Builds read ONNX graphs, never torch: what export shares with them lives in graphs.
    "builders": {"runtime", "export", "calibration", "training", "cli", "server"},
    "calibration": {"builders", "export", "training", "cli", "server"},
    "training": {"builders", "calibration", "cli", "server"},
}


# Stated exceptions: (module, package it may import, why).
ALLOWED = {
    # A backend registers under the name of the runtime opener that runs its builds, and
    # registering checks that opener exists.
    ("builders/registry.py", "runtime"),
    # The kernels' weight layout has one home, beside the kernels that read it
    # (runtime/kernels: pack_codes); the build writes it, and checks the kernels run here.
    ("builders/cpu.py", "runtime"),
}

# The modules at the package's top (the artifact format, the manifest's types, shared
# helpers such as the chat template and masks) sit below every layer; `__init__.py` is the
# lazy public API.
LAYERS = {"runtime", "graphs", "export", "builders", "calibration", "training", "tensorrt",
          "cli", "server"}  # fmt: skip


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def _imported_packages(path: Path) -> set[str]:
    names = _imported_modules(path)
    return {n.split(".")[1] for n in names if n.startswith("specx.")}


def test_layers_import_only_downward():
    breaks = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            for imported in sorted(_imported_packages(path) & forbidden):
                if (name, imported) not in ALLOWED:
                    breaks.append(f"{name} imports specx.{imported}")
    for path in sorted(ROOT.glob("*.py")):
        if path.name != "__init__.py":
            for imported in sorted(_imported_packages(path) & LAYERS):
                breaks.append(f"{path.name} imports specx.{imported}")
    assert not breaks, "\n".join(breaks)


def test_torch_is_imported_only_by_export_training_and_tensorrt():
    """torch is the export and training extras' dependency; builds, calibration, the server
    and what products embed run on ONNX graphs, numpy and onnxruntime.

    Stated exceptions, both imported only with a TensorRT build: `runtime/targets/trt.py`
    holds a TensorRT engine's inputs and outputs as torch CUDA tensors, and `publish.py`
    reads the GPU's compute capability to check an engine matches the machine.
    """
    torch_free = [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0]
                  not in {"export", "training", "tensorrt"}]  # fmt: skip
    users = [
        path.relative_to(ROOT).as_posix()
        for path in torch_free
        if any(m == "torch" or m.startswith("torch.") for m in _imported_modules(path))
    ]
    assert users == ["publish.py", "runtime/targets/trt.py"]


def test_the_scan_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from specx.training.corpus import x\n    import specx.cli\n")
    assert _imported_packages(module) == {"training", "cli"}


def test_the_backend_map_names_every_backend_and_only_modules_that_exist():
    """`specx/builders/__init__.py` maps each backend's lowering, build and runtime target: the
    one place a newcomer finds a backend's files, kept true here."""
    import specx.builders
    from specx.builders.registry import BACKENDS

    doc = specx.builders.__doc__ or ""
    table = doc[doc.index("    backend ") : doc.index("\n\n", doc.index("    backend "))]
    rows = table.splitlines()[1:]
    named = {line.split()[0] for line in rows if not line.startswith("     ")}
    assert named == set(BACKENDS)
    lowering, build = slice(17, 47), slice(47, 69)
    modules = set()
    for line in rows:
        modules |= {f"graphs/{m}" for m in re.findall(r"\w+", line[lowering])}
        modules |= {
            f"builders/{m}" for m in re.findall(r"\w+", re.sub(r"tensorrt\.\w+", "", line[build]))
        }
        modules |= {f"runtime/targets/{m}" for m in re.findall(r"\w+", line[69:])}
        modules |= {m.replace(".", "/") for m in re.findall(r"tensorrt\.\w+", line)}
    missing = sorted(m for m in modules if not (ROOT / f"{m}.py").is_file())
    assert not missing, missing


def _module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The specx modules `path` imports at its top level, `if TYPE_CHECKING:` blocks included."""
    body = ast.parse(path.read_text()).body
    statements = body + [s for node in body if isinstance(node, ast.If) for s in node.body]
    names = set()
    for node in statements:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names & modules


def test_no_module_imports_round_a_circle():
    """Modules import one another as a DAG, type-only imports counted: a type two stages
    share has a home below both (server/events.py, training/config.py). Packages'
    `__init__` files, which re-export their modules, are left out."""
    from graphlib import CycleError, TopologicalSorter

    files = {
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts): p
        for p in ROOT.rglob("*.py")
        if p.name != "__init__.py"
    }
    graph = {name: _module_level_imports(path, set(files)) - {name} for name, path in files.items()}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:
        pytest.fail(f"an import circle: {' -> '.join(e.args[1])}")


def test_the_server_reaches_the_engine_only_through_its_api():
    """No `engine.target`, `.lock` or `.plans` in the server or the CLI (issue 71): they go
    through `Engine.continuous_batch` and `Engine.check_plan`."""
    internals = {"target", "lock", "plans"}
    reaches = []
    for package in ("server", "cli"):
        for path in sorted((ROOT / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Attribute) and node.attr in internals):
                    continue
                owner = node.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name == "engine":
                    reaches.append(f"{package}/{path.name}:{node.lineno} engine.{node.attr}")
    assert not reaches, reaches
