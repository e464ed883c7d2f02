"""ONNX graph definitions: the TreeAttention op and its function body."""
