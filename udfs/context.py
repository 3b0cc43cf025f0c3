"""What the driver hands a task, and what the task has: the values every executor module reads.

:class:`SearchSettings` and :class:`JoinContext` are plain, picklable values the driver
captures in the UDF closures (k, metric, backend, the sides' layouts); :func:`task_cpus` is
the task's share of cores. They sit below the loops (``udfs.blocks``), the searchers
(``udfs.searcher``, ``udfs.gpu``) and the row gathers (``udfs.rows``) that all read them, so
that none of those has to import another to learn them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pyarrow as pa

from .packing import SideLayout


def task_cpus() -> int:
    """This task's share of cores: ``spark.task.cpus`` inside Spark, else the cores this
    process may run on (outside Spark, e.g. in a benchmark, set it with ``taskset``)."""
    try:
        from pyspark import TaskContext  # only present inside Spark

        ctx = TaskContext.get()
        if ctx is not None:
            return max(1, int(ctx.cpus()))
    except ImportError:
        pass
    return max(1, len(os.sched_getaffinity(0)))


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
    # process before its first block (udfs.gpu.GpuBlockSearcher.warm_up).
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

    @property
    def k(self) -> int:
        return self.settings.k

    @property
    def keyed(self) -> bool:
        """Whether rows carry a group id (``on=`` keys): each query row meets only its group."""
        return self.query.group_index is not None
