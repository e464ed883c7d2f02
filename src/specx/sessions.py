"""ONNX Runtime sessions as every part of specx opens them: one shared thread pool.

The runtime, the build passes that evaluate subgraphs and the calibrators all open their
sessions here, so the process-wide pool is created once, before any session.
"""

from __future__ import annotations

import os

import onnxruntime as ort

__all__ = [
    "configure_threads",
    "global_pool_created",
    "load_session",
    "session_options",
    "stop_spinning",
]

_global_threads: int | None = None
_spinning = True


def global_pool_created() -> bool:
    """Whether this process has created ONNX Runtime's global pool (`configure_threads`)."""
    return _global_threads is not None


def stop_spinning() -> None:
    """Sessions opened from now on get their own thread pools, which do not spin.

    ONNX Runtime's pool spins on its cores for a while after each run. Beside another
    runtime's threads (an OpenVINO target verifying what ONNX Runtime's draft graphs
    proposed) that spinning takes the cores the other runtime's next call needs
    (docs/decisions.md#own-pools-beside-openvino); the global pool cannot be told not
    to spin from Python, so such processes open their sessions on pools of their own
    (where no session has created the global pool yet).
    """
    global _spinning
    _spinning = False


def configure_threads(threads: int | None = None) -> int:
    """Creates ONNX Runtime's global thread pool once per process; returns its size.

    Every specx session shares this pool: draft and target sessions alternate every round,
    and on per-session spinning pools they were measured markedly slower per round than on
    one shared pool (docs/decisions.md#one-global-thread-pool).
    """
    global _global_threads
    wanted = threads or os.cpu_count() or 1
    if _global_threads is None:
        ort.set_global_thread_pool_sizes(wanted, 1)
        _global_threads = wanted
    return _global_threads


def session_options(threads: int | None = None) -> ort.SessionOptions:
    """Options every specx session uses: the shared global thread pool, full optimization."""
    options = ort.SessionOptions()
    # Pools of its own only while the process has no global pool (ONNX Runtime refuses both).
    own_pool = not _spinning and _global_threads is None
    options.use_per_session_threads = own_pool
    if own_pool:
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    else:
        configure_threads(threads)
    options.log_severity_level = 3  # TensorScatter warns when a buffer is copied, not an error
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


def load_session(model: str | os.PathLike[str] | bytes, threads: int | None = None):
    """An ONNX Runtime CPU session for an ONNX file (or serialized model), `session_options`."""
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(
        source, session_options(threads), providers=["CPUExecutionProvider"]
    )
