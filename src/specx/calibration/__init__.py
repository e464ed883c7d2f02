"""Calibration: acceptance statistics, tree/chain/batch selection by predicted speedup, INT8."""
