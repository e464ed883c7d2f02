"""Calibration: acceptance statistics, tree/gamma selection, quantization (not built yet)."""
