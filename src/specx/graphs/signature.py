"""The IO signature of an ONNX graph as the manifest records it, and a saved graph's entry."""

from __future__ import annotations

import onnx

from specx.manifest_types import GraphEntry, TensorSpec

__all__ = ["graph_entry", "graph_signature"]


def graph_signature(
    model: onnx.ModelProto,
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The graph's inputs and outputs: name, element type and shape (ints or symbolic names)."""

    def describe(value: onnx.ValueInfoProto) -> TensorSpec:
        tensor = value.type.tensor_type
        shape = tuple(d.dim_param or d.dim_value for d in tensor.shape.dim)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        return TensorSpec(value.name, dtype, shape)

    return (
        tuple(describe(v) for v in model.graph.input),
        tuple(describe(v) for v in model.graph.output),
    )


def graph_entry(model: onnx.ModelProto, graph_file: str, data_file: str) -> GraphEntry:
    """The manifest entry of a saved graph."""
    inputs, outputs = graph_signature(model)
    return GraphEntry(
        graph_file,
        inputs,
        outputs,
        data_files=(data_file,),
        opset=next(o.version for o in model.opset_import if o.domain == ""),
    )
