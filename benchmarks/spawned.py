"""Benchmark processes started together: one per rank, as Spark's Python workers or one per GPU."""
from __future__ import annotations

import multiprocessing as mp


def run_spawned(target, rank_args: list[tuple], timeout: float) -> list:
    """Run ``target(*args, barrier, results)`` in one spawned process per ``args`` of
    ``rank_args``; each passes ``barrier`` (all ranks) before its timed part and puts one
    result on ``results``. Returns the results (in arrival order); raises when a process
    exits with an error."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(rank_args)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, results)) for args in rank_args]
    for proc in procs:
        proc.start()
    got = [results.get(timeout=timeout) for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"benchmark process exited with {proc.exitcode}")
    return got
