"""Which task a GPU searcher serves: the GPU Spark assigned to it and the scope of its kept blocks.

Inside Spark both come from the task context (``TaskContext.resources()["gpu"]``, the SQL
execution and stage); outside Spark (tests, benchmarks that simulate executors,
``udfs.local.local_join``) from :func:`local_task`. pyspark is imported lazily (the GPU
benchmark machines have none).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass


def _task_context():
    """This task's ``pyspark.TaskContext``, or None outside Spark (or without pyspark)."""
    try:
        from pyspark import TaskContext  # only present inside Spark
    except ImportError:
        return None
    return TaskContext.get()


@dataclass(frozen=True)
class LocalTask:
    """What a Spark task context tells the searcher, for searches run outside Spark
    (:func:`local_task`): the task's GPU address and the scope of kept target blocks."""

    gpu: str | None = None
    scope: str | None = None


# Outside Spark: the task this process (all its threads) simulates; see local_task.
_LOCAL_TASK = LocalTask()


@contextlib.contextmanager
def local_task(gpu: str | None = None, scope: str | None = None):
    """Searchers opened inside run as a Spark task with GPU address ``gpu`` in a stage named
    ``scope`` would (tests, benchmarks that simulate executors, ``udfs.local.local_join``).
    Process-wide, not per thread: a simulated task's searches may run on a worker thread.
    Inside Spark the task context decides and this is ignored."""
    global _LOCAL_TASK
    before = _LOCAL_TASK
    _LOCAL_TASK = LocalTask(gpu, scope)
    try:
        yield
    finally:
        _LOCAL_TASK = before


def task_gpu_address() -> str | None:
    """The GPU address Spark assigned to this task, else the :func:`local_task`'s, else None."""
    ctx = _task_context()
    if ctx is not None:
        gpu = ctx.resources().get("gpu")
        if gpu is not None and gpu.addresses:
            return str(gpu.addresses[0])
        return None
    return _LOCAL_TASK.gpu


def task_scope() -> str | None:
    """What the tasks that may share kept target blocks have in common.

    Inside Spark the SQL execution and the stage: all tasks of a broadcast stage read the
    same broadcast target (a retried stage keeps its id and its broadcast), and stage ids do
    not repeat within an application (a re-run of the same DataFrame is a new execution and
    new stages). Outside Spark the :func:`local_task`'s scope, else None (nothing is kept
    past the searcher).
    """
    ctx = _task_context()
    if ctx is not None:
        return f"execution {ctx.getLocalProperty('spark.sql.execution.id')} stage {ctx.stageId()}"
    return _LOCAL_TASK.scope


def address_to_ordinal(address: str) -> int:
    """CUDA ordinal of a Spark GPU address.

    ``conf/gpu_discovery.sh`` reports CUDA ordinals as the executor sees them (already
    renumbered when the cluster manager set ``CUDA_VISIBLE_DEVICES``), so the address is the
    ordinal.
    """
    try:
        return int(address)
    except ValueError:
        raise ValueError(f"GPU address: expected a CUDA ordinal, got {address!r}") from None
