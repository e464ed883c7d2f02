"""The IO signature of an ONNX graph as the manifest records it."""

from __future__ import annotations

from typing import Any

import onnx

__all__ = ["graph_signature"]


def graph_signature(model: onnx.ModelProto) -> dict[str, list[dict[str, Any]]]:
    """The IO signature of a graph: name, element type and shape (ints or symbolic names)."""

    def describe(value: onnx.ValueInfoProto) -> dict[str, Any]:
        tensor = value.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        return {"name": value.name, "dtype": dtype, "shape": shape}

    return {
        "inputs": [describe(v) for v in model.graph.input],
        "outputs": [describe(v) for v in model.graph.output],
    }
