"""Spark's Python worker daemon (pyspark.daemon) for the test suite, with one change: a reused
worker freezes the objects that survive its first tasks out of the cyclic garbage collector
(gc.freeze).

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

if __name__ == "__main__":
    daemon.manager()
