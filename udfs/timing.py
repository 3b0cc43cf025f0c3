"""Where an executor's seconds go: the packing of each side's rows into blocks (``pack``:
reading the input batches from the JVM included) and each phase of the block loops (decode,
search, merge, encode) timed as it runs and added to the join's Spark accumulator (``JoinContext.timings``),
which the driver reads after the job (``nearest_join.join.PlannedJoin.executor_seconds``; the
batch jobs' summary shows it).

A phase's seconds are summed over the task's threads (the search runs on a worker thread
while the task's own thread decodes or emits; output batches are built on helper threads),
so the phases of a task may add up to more than its wall time. Without an accumulator (a
Spark Connect session, ``udfs.local.local_join``, the kernel warm-up) nothing is recorded.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator

PHASES = ("pack", "decode", "search", "merge", "encode")

_lock = threading.Lock()


class SecondsParam:
    """The accumulator's algebra: {phase: seconds} dicts, added phase by phase (an
    ``AccumulatorParam`` by duck typing: this module imports no pyspark)."""

    def zero(self, value: dict) -> dict:
        return {}

    def addInPlace(self, total: dict, more: dict) -> dict:   # noqa: N802 (pyspark's name)
        for phase, seconds in more.items():
            total[phase] = total.get(phase, 0.0) + seconds
        return total


@contextlib.contextmanager
def timed(accumulator, phase: str) -> Iterator[None]:
    """Add the block's wall seconds to ``accumulator`` (None: time nothing) under ``phase``."""
    if accumulator is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - start
        with _lock:   # the task's threads share the worker's one accumulator
            accumulator.add({phase: seconds})


def timed_map(accumulator, phase: str, function, batches: Iterable) -> Iterator:
    """``function(batches)`` (a ``mapInArrow`` function) with the seconds spent producing each
    of its output batches added to ``accumulator`` under ``phase`` (not those the consumer
    spends between them)."""
    output = iter(function(batches))
    while True:
        with timed(accumulator, phase):
            batch = next(output, None)
        if batch is None:
            return
        yield batch
