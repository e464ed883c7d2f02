"""The embedded runtime: numpy and onnxruntime only (never torch, never specx.export)."""
