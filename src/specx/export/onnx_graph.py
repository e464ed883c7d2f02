"""Shared ONNX export steps: trace a torch module, attach TreeAttention, save, describe."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import torch

from specx.errors import ExportError
from specx.export.checkpoint import CheckpointTensors
from specx.export.streamed_weights import FoldWeightTransposesPass, bind_checkpoint_weights
from specx.export.tree_attention_op import ONNX_TRANSLATIONS
from specx.graphs.model_io import TensorSink, save_streamed
from specx.graphs.packed_matmuls import PackSiblingMatMulsPass
from specx.graphs.signature import graph_signature
from specx.graphs.tree_attention import attach_function_ir

__all__ = [
    "EXPORT_OPSET",
    "export_module",
    "export_streamed",
    "graph_signature",
    "save_graph",
    "save_graph_streamed",
]

EXPORT_OPSET = 23  # torch emits Attention/RMSNormalization at 23; the function raises it to 24


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silences the exporter's chatter on every export, keeping its errors.

    torch logs one "torchvision is not installed" warning per torchvision op it could
    translate, which says nothing about the model being exported.
    """
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _trace(
    module: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    dynamic_shapes: tuple[Any, ...],
    input_names: list[str],
    output_names: list[str],
    what: str,
    optimize: bool,
) -> ir.Model:
    with _quiet_exporter(), torch.no_grad():
        try:
            program = torch.onnx.export(
                module,
                example_inputs,
                dynamo=True,
                opset_version=EXPORT_OPSET,
                custom_translation_table=ONNX_TRANSLATIONS,
                dynamic_shapes=dynamic_shapes,
                input_names=input_names,
                output_names=output_names,
                verbose=False,
                optimize=optimize,
            )
        except Exception as e:  # torch raises many unrelated types from deep in the tracer
            raise ExportError(f"torch.onnx.export of {what} failed: {e}") from e
    assert program is not None  # None only from the legacy (dynamo=False) exporter
    return program.model


def export_module(
    module: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    dynamic_shapes: tuple[Any, ...],
    input_names: list[str],
    output_names: list[str],
    what: str,
) -> onnx.ModelProto:
    """`torch.onnx.export(dynamo=True)` with the TreeAttention translation attached.

    Sibling MatMuls (q/k/v, gate/up) come out packed (`specx.graphs.packed_matmuls`).
    The weights are the module's, in memory: for draft heads; targets stream theirs
    (`export_streamed`).

    Raises:
        ExportError: the tracer failed (its message is kept).
    """
    model = _trace(module, example_inputs, dynamic_shapes, input_names, output_names, what, True)
    model = attach_function_ir(model)
    return ir.to_proto(PackSiblingMatMulsPass()(model).model)


def export_streamed(
    module: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    dynamic_shapes: tuple[Any, ...],
    input_names: list[str],
    output_names: list[str],
    what: str,
    tensors: CheckpointTensors,
) -> ir.Model:
    """Like `export_module`, for a module with placeholder parameters named like `tensors`.

    The graph's weights are `StreamedTensor`s of the checkpoint, read when the model is
    saved (`save_graph_streamed`): the export never holds the weights in memory. The
    exporter's constant folding is off (it would compute every transposed weight in
    memory); weight transposes are folded lazily, then the usual optimizer runs.

    Raises:
        ExportError: the tracer failed, or a parameter has no checkpoint tensor.
    """
    import onnxscript

    model = _trace(module, example_inputs, dynamic_shapes, input_names, output_names, what, False)
    unbound = [name for name, _ in module.named_parameters() if name not in tensors]
    if unbound:
        raise ExportError(f"{what}: no checkpoint tensor for parameters {unbound[:5]}")
    bind_checkpoint_weights(model, tensors)
    FoldWeightTransposesPass()(model)
    onnxscript.optimizer.optimize(model)
    attach_function_ir(model)
    return PackSiblingMatMulsPass()(model).model


def save_graph_streamed(
    model: ir.Model,
    directory: Path,
    name: str,
    progress: Callable[[str], None],
    data: TensorSink | None = None,
    reuse: Callable[[ir.TensorProtocol], ir.ExternalTensor | None] = lambda tensor: None,
) -> tuple[onnx.ModelProto, str, str, str]:
    """Saves `name.onnx` + `name.onnx.data` tensor by tensor (into `data` if already open).

    Returns:
        The graph (without weights), both file names, and the data file's sha256.
    """
    graph_file, data_file = f"{name}.onnx", f"{name}.onnx.data"
    target = data or data_file
    digest = save_streamed(model, directory / graph_file, target, progress, reuse)
    graph = onnx.load(directory / graph_file, load_external_data=False)
    return graph, graph_file, data_file, digest


def save_graph(model: onnx.ModelProto, directory: Path, name: str) -> tuple[str, str]:
    """Saves `name.onnx` with its weights in `name.onnx.data`; returns both file names."""
    graph_file, data_file = f"{name}.onnx", f"{name}.onnx.data"
    onnx.save_model(
        model,
        directory / graph_file,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_file,
        size_threshold=1024,
    )
    return graph_file, data_file
