"""What the driver hands a task, and what the task has: the values every executor module reads.

The driver captures plain, picklable values in the UDF closures: :class:`SideLayout` (where a
side's vectors are), :class:`SearchSettings` (k, metric, backend) and :class:`JoinContext`
(both sides and the output). What the task has comes from Spark's task context: its share of
cores (:func:`task_cpus`), its partition (:func:`task_partition`), its GPU
(:func:`task_gpu_address`, :func:`cuda_may_exist`) and the stage whose kept target blocks it
may reuse (:func:`task_scope`). Outside Spark (tests, benchmarks that simulate executors,
``udfs.local.local_join``) the GPU and the stage come from :func:`local_task`.

This module sits below every other one of ``udfs`` and imports none of them. pyspark is
imported lazily (the GPU benchmark machines have none).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import pyarrow as pa


@dataclass(frozen=True)
class SideLayout:
    """Where one side's vectors are and what they must look like (plain picklable values)."""

    label: str              # the user's column name, for errors
    vector_index: int       # position of the vector column among the side's columns
    dimension: int | None   # expected vector length; None = take the first vector's
    block_rows: int         # rows per packed block
    expected_from: str = "the other side"
    group_index: int | None = None   # on= keys: position of the int group id column (the last)


@dataclass(frozen=True)
class SearchSettings:
    """Plain, picklable search settings the driver captures in the executor closure."""

    k: int
    metric: str
    backend: str = "auto"       # "auto" | "cpu" | "gpu" | "reference"
    precision: str = "auto"     # GPU only: "auto" | "fp32" | "tf32" | "bf16" (results stay exact)
    keep_targets: bool = True   # GPU only: keep broadcast blocks for the stage's next task
    gpu_share: float = 1.0      # GPU only: the task's share of its GPU (spark.task.resource.gpu.amount)
    # GPU only: (query rows, target rows, dimension, query dtype, target dtype) of the plan's
    # full block pair, or None: a GPU searcher compiles that configuration once per worker
    # process before its first block (udfs.gpu_search.GpuBlockSearcher.warm_up).
    warm_shape: tuple | None = None


@dataclass(frozen=True)
class JoinContext:
    """Everything an executor needs, captured by value in the UDF closures."""

    settings: SearchSettings
    query: SideLayout
    target: SideLayout
    join_type: str                      # "inner" | "leftouter"
    with_distance: bool
    target_schema: pa.Schema            # Arrow schema of the target's columns (NULL padding)
    output_names: tuple[str, ...] = field(default=())
    cap: float | None = None            # knn's cap (the metric's units, inclusive) or None
    # A last int8 output column, 1 on a query row's best match and 0 elsewhere (the batch
    # jobs count the queries that found a candidate from it, without a second pass).
    mark_first: bool = False
    # Positions of each side's columns the output keeps (None: all). The batch jobs leave the
    # vectors out here, not after: a vector column is most of the rows' bytes, and every byte
    # emitted crosses to the JVM.
    query_columns: tuple[int, ...] | None = None
    target_columns: tuple[int, ...] | None = None
    # The join's Spark accumulator of executor seconds per phase (udfs.timing), or None.
    timings: object = None

    @property
    def k(self) -> int:
        return self.settings.k

    @property
    def keyed(self) -> bool:
        """Whether rows carry a group id (``on=`` keys): each query row meets only its group."""
        return self.query.group_index is not None


# -- what the task has ---------------------------------------------------------------------------

def _task_context():
    """This task's ``pyspark.TaskContext``, or None outside Spark (or without pyspark)."""
    try:
        from pyspark import TaskContext  # only present inside Spark
    except ImportError:
        return None
    return TaskContext.get()


def task_cpus() -> int:
    """This task's share of cores: ``spark.task.cpus`` inside Spark, else the cores this
    process may run on (outside Spark, e.g. in a benchmark, set it with ``taskset``)."""
    ctx = _task_context()
    if ctx is not None:
        return max(1, int(ctx.cpus()))
    return max(1, len(os.sched_getaffinity(0)))


def task_partition() -> int:
    """This task's partition id inside Spark (0 outside it): the high bits of the ids this
    task gives its blocks (and ``udfs.ivf.sample_topk`` its rows)."""
    ctx = _task_context()
    if ctx is not None:
        return int(ctx.partitionId())
    return 0


def cuda_may_exist() -> bool:
    """A cheap look for an NVIDIA device before paying for ``import torch`` (seconds).

    True when Spark assigned the task a GPU resource or the driver's device nodes exist.
    """
    ctx = _task_context()
    if ctx is not None and "gpu" in (ctx.resources() or {}):
        return True
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


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
