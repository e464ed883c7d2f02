"""Torch side: checkpoints, the exported modules, draft heads and ONNX export (export extra)."""
