"""TensorRT backend pieces: the TreeAttention plugin and its Triton kernel.

Every import of tensorrt and triton is lazy.
"""
