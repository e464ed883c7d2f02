"""specx: compile lossless speculative decoding to ONNX Runtime and TensorRT.

The embedding API (`specx.runtime.engine`): `specx.load(artifact)` -> `Engine` with
`generate`, `generate_batch`, `stream` and `chat`; `Speculation` says how to draft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "Chunk",
    "Completion",
    "Engine",
    "Speculation",
    "Stats",
    "__version__",
    "load",
]

if TYPE_CHECKING:
    from specx.runtime.engine import Engine, Speculation, load
    from specx.runtime.results import Chunk, Completion, Stats

_RESULTS = ("Chunk", "Completion", "Stats")


def __getattr__(name: str) -> Any:
    # Lazy: `import specx` (the CLI, the exporter) does not load onnxruntime until asked.
    if name in __all__ and name != "__version__":
        from specx.runtime import engine, results

        return getattr(results if name in _RESULTS else engine, name)
    raise AttributeError(f"module 'specx' has no attribute {name!r}")
