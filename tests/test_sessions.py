"""ONNX Runtime sessions: one shared pool, or non-spinning pools of their own beside OpenVINO."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
from specx import sessions
{before}
sessions.stop_spinning()
options = sessions.session_options(2)
print(options.use_per_session_threads, options.get_session_config_entry(
    "session.intra_op.allow_spinning") if options.use_per_session_threads else "-")
"""


def _probe(before: str) -> str:
    code = PROBE.format(before=before)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_sessions_opened_after_stop_spinning_get_pools_that_do_not_spin():
    assert _probe("") == "True 0"


def test_once_the_global_pool_exists_sessions_keep_using_it():
    # ONNX Runtime refuses per-session pools in a process that has created its global pool.
    assert _probe("sessions.configure_threads(2)") == "False -"
