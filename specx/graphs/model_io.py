"""Saving onnx-ir models with their weights in one external data file, one tensor at a time.

Lazy initializers (weights streamed from a checkpoint, quantized weights) are computed as
they are written, and at most `_IN_FLIGHT_BYTES` besides the tensor being written are held,
so peak memory does not grow with the model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

__all__ = ["save_streamed"]

_IN_FLIGHT_BYTES = 64 << 20


def save_streamed(
    model: ir.Model, path: Path, data_file: str, progress: Callable[[str], None] = lambda m: None
) -> None:
    """Saves the graph with every initializer over 1 KiB in `data_file`, one tensor at a time."""
    written = [0]

    def report(tensor: ir.TensorProtocol, info) -> None:
        written[0] += 1
        if written[0] == 1 or written[0] % 20 == 0 or written[0] == info.total:
            progress(f"  writing weights: {written[0]}/{info.total} tensors ({tensor.name})")

    ir.save(
        model,
        path,
        external_data=data_file,
        size_threshold_bytes=1024,
        callback=report,
        max_workers=1,
        max_in_flight_bytes=_IN_FLIGHT_BYTES,
    )
