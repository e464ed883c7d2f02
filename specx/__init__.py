"""specx: compile lossless speculative decoding to ONNX Runtime and TensorRT."""

__version__ = "0.1.0"
__all__ = ["__version__"]
