"""Killing a job mid-run the way a scheduler does: SIGKILL to its process group."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable


def kill_when(process: subprocess.Popen, ready: Callable[[], bool], what: str, timeout_s: float = 300,
              output: Callable[[], str] = lambda: "") -> None:
    """SIGKILL ``process``'s group (started with ``start_new_session``: the job's Spark JVM
    goes with it) as soon as ``ready()``; fails when the process ends first or ``what`` is not
    reached within ``timeout_s`` (with ``output()``, e.g. the tail of its stderr)."""
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert process.poll() is None, f"the run ended before {what}: {output()}"
            assert time.monotonic() < deadline, f"{what}: not reached in {timeout_s} s"
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
