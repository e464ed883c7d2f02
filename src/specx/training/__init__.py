"""Distilling draft heads and draft models against a frozen target (torch; the export extra)."""
