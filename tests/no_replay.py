"""A drafter without its `replay`: every decision to ask it is a real probe."""

from __future__ import annotations


class NoReplay:
    """Wraps a drafter and hides `replay`, so tests exercise probes, trims and idle rows."""

    def __init__(self, drafter):
        self._drafter = drafter

    def __getattr__(self, name):
        if name == "replay":
            raise AttributeError(name)
        return getattr(self._drafter, name)
