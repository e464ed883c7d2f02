"""Progress messages of the long commands: export, build and calibrate.

One home for their type and for the heartbeat of a step that cannot report its own progress.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["Progress", "heartbeat"]

Progress = Callable[[str], None]  # one line per message, e.g. the CLI's stderr


@contextmanager
def heartbeat(progress: Progress, what: str, every_s: float = 5.0) -> Iterator[None]:
    """Says `what` is still running every `every_s` seconds until the block ends.

    For steps that run inside a library with no progress of its own (torch's tracing of a
    large model takes tens of seconds): silence that long reads as a hang.
    """
    done = threading.Event()
    started = time.perf_counter()

    def beat() -> None:
        while not done.wait(every_s):
            progress(f"  still {what}: {time.perf_counter() - started:.0f}s")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
