"""Spark's Python worker daemon (pyspark.daemon) for the test suite, with two changes: a reused
worker freezes the objects that survive its first tasks out of the cyclic garbage collector
(gc.freeze), and the daemon imports the executor's modules before it forks its first worker.

pyspark.daemon runs a full gc.collect() after every task of a reused worker. Once a worker has
imported numpy, pyarrow, numba and the kernels, that walk over their objects costs more CPU than
a test's tiny task itself, and the suite runs thousands of tasks. Frozen objects are still freed
by reference counting; only cycles among them are never collected.
"""
from __future__ import annotations

import gc

import pyspark.daemon as daemon

_run_task = daemon.worker
_tasks = 0


def _worker(sock, authenticated):
    global _tasks
    try:
        return _run_task(sock, authenticated)
    finally:
        _tasks += 1
        if _tasks & (_tasks - 1) == 0:   # after tasks 1, 2, 4, 8, ...: what later tasks import
            gc.collect()
            gc.freeze()


daemon.worker = _worker


def _preload() -> None:
    """Import what every worker's first task imports (numpy, pyarrow, pandas, numba, the
    executor functions and the CPU kernels' module), once, in the daemon: the suite's sessions
    fork dozens of workers, each of which paid for these imports before its first task. Nothing runs: numba compiles (and its threads start) on a kernel's
    first call, in the worker."""
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow  # noqa: F401

    import nearest_join.kernels.cpu  # noqa: F401
    import udfs.blocks  # noqa: F401
    import udfs.lists  # noqa: F401
    import udfs.probes  # noqa: F401


if __name__ == "__main__":
    _preload()
    daemon.manager()
