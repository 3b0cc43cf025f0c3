"""The planner: broadcast or blocked (and, later, IVF), with block sizes, made visible.

The decision needs a few cheap facts, gathered by one small Spark job (:func:`side_facts`):
the row and partition counts of both sides and the shortest and longest vector of each, so
that ragged or mismatched vectors fail at call time, before any output exists
(:func:`join_dimension`). Everything else is arithmetic on configuration:

* ``broadcast`` when the target's vectors fit under the broadcast limit
  (``spark.nearestJoin.broadcastLimitBytes``, default 1 GiB): target blocks are broadcast
  once to every executor and query blocks stream through them in a single pass.
* ``blocked`` otherwise: every (query block, target block) pair is its own task, and the
  partial top-k results are merged per query block. Block sizes come from the per-task memory
  budget (``spark.nearestJoin.taskMemoryBytes``, default: a quarter of a task's share of the
  JVM's unified memory, between 64m and 4g: :func:`task_memory_bytes`), so memory per task is
  bounded by configuration, not by table size.

A third plan (IVF for ``mode="approx"``) plugs in as another value of :class:`JoinPlan.plan`.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass

import numpy as np
from pyspark.sql import functions as F

from udfs.columns import MAX_BLOCK_ROWS

from .errors import NearestByJoinError
from .options import JoinOptions
from .ranking import column, quote

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_BROADCAST_LIMIT = 1 * GiB
# Whole copies of a broadcast target one JVM holds besides those of its tasks (see
# broadcast_memory_cap): the driver's collected rows and the serialised pieces, or an
# executor's pieces and the table built from them; a local-mode JVM, driver and executor at
# once, holds the collected rows, the pieces and the table.
BROADCAST_COPIES = 2
LOCAL_COPIES = 3
# A payload value's bytes where the facts job does not measure them (types other than strings,
# binaries and fixed-width ones): Spark's own default size of a complex value.
PAYLOAD_VALUE_BYTES = 100
SPARK_MAX_BROADCAST_BYTES = 8 * GiB
# The heap Spark reserves before its unified (execution + storage) memory.
RESERVED_HEAP = 300 * MiB
# Target blocks of the broadcast plan: small enough for Arrow batches and binary values
# (2 GiB), large enough that per-block overheads vanish.
BROADCAST_TARGET_BLOCK_BYTES = 64 * MiB
CONF_PREFIX = "spark.nearestJoin."
# Multiply-adds (query rows x target rows x d) above which balancing the query blocks over
# the cores is worth a shuffle: about a second of kernel time on two cores.
SPREAD_WORK = 10**11
# Below this much work (about a tenth of a second of kernel time on two cores) and this many
# vector elements to read and emit (both sides' rows and the output's, query rows x k, times
# d: what the JVM converts to and from Arrow, serially in one task) a join whose inputs are
# cheap to read in one task runs in one task: the query blocks meet the target's, packed in
# the same task, without a broadcast (a Spark job of its own, which costs more than the search
# and the conversions it would spread over the cores).
ONE_TASK_WORK = SPREAD_WORK // 10
ONE_TASK_ELEMENTS = 1 << 23
# The blocked plan broadcasts the query blocks instead of pairing both sides through shuffles
# (and the broadcast plan yields to it) when the query side's vectors are this many times
# fewer bytes than a target of at least QUERY_BROADCAST_MIN_TARGET_BYTES: the target is then
# read once, in its own partitions, never collected, shuffled or broadcast; only the query
# blocks travel to every task (a few queries against a large table: the incremental join's
# whole searches, candidate lookups). With more queries, merging every target partition's
# partials costs more than broadcasting the target.
QUERY_BROADCAST_RATIO = 128
QUERY_BROADCAST_MIN_TARGET_BYTES = 64 * MiB
# A DataFrame whose size Spark's optimizer estimates at most this is aggregated in one task,
# one Spark job (in_one_task_when_small): reading it in one task costs less than the shuffle
# (and under adaptive execution the second job) of an aggregation over its partitions.
ONE_TASK_BYTES = 64 * MiB
# A join small enough for one task (ONE_TASK_WORK, ONE_TASK_ELEMENTS) whose inputs Spark
# estimates at most this many bytes together is searched in the driver
# (``spark.nearestJoin.localLimitBytes``; 0: never): both sides collected in two small jobs,
# instead of a facts job and then a search job whose Python stages cost more than the search.
DEFAULT_LOCAL_LIMIT = 32 * MiB

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """Spark-style sizes: ``"512m"``, ``"4g"``, ``"1024"`` (bytes)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"expected a size such as '512m' or '4g', got {text!r}")
    unit = {"": 1, "k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}[match.group(2).lower()]
    return int(float(match.group(1)) * unit)


@dataclass
class JoinPlan:
    """What the join will do and why. ``str(plan)`` explains it; ``to_dict()`` is JSON-safe."""

    plan: str                      # "broadcast" | "blocked" | "local" | "spark"
    reason: str
    metric: str | None
    k: int
    mode: str
    join_type: str
    query_column: str | None
    target_column: str | None
    dimension: int | None
    query_rows: int | None
    target_rows: int | None
    target_bytes: int | None
    broadcast_limit_bytes: int
    task_memory_bytes: int
    cores: int
    query_block_rows: int | None
    target_block_rows: int | None
    query_blocks: int | None
    target_blocks: int | None
    query_partitions: int | None
    target_partitions: int | None
    backend: str
    precision: str | None          # as asked; "auto" is resolved per executor (see describe_precision)
    distance_col: str | None
    cap_argument: str | None = None    # "max_distance" | "min_similarity" | None
    cap: float | None = None           # in the metric's units, inclusive
    # on= keys: [query column, target column, common type] per key, or None without keys
    keys: list | None = None
    key_groups: int | None = None      # distinct non-NULL target keys
    largest_group: int | None = None   # target rows of the largest of them
    # mode="approx": the IVF plan's figures, or why the exact plan runs (nearest_join.ivf)
    ivf: dict | None = None
    # the keyed blocked plan's cut of the groups into cells (KeyedLayout.summary()), or None
    key_cells: dict | None = None
    # the blocked plan's query blocks broadcast, the target streaming past them in its own
    # partitions (QUERY_BROADCAST_RATIO), instead of both sides shuffled into pairs
    queries_broadcast: bool = False
    # the broadcast plan of a small join (ONE_TASK_WORK, ONE_TASK_ELEMENTS): both sides read in
    # one task, no broadcast
    one_task: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"nearest_by_join plan: {self.plan} ({self.reason})"]
        if self.plan != "spark":
            lines += [
                f"  ranking: {self.metric} of query.{self.query_column} vs target.{self.target_column}, "
                f"k={self.k}, mode={self.mode}, join={self.join_type}, d={self.dimension}",
                f"  query: {self.query_rows} rows in {self.query_blocks} blocks of <= {self.query_block_rows} rows "
                + ("(broadcast to every target partition)" if self.queries_broadcast
                   else "(collected)" if self.plan == "local"
                   else "(one task, which reads the target too: a small join needs no broadcast)" if self.one_task
                   else f"({self.query_partitions or 'input'} partitions)"),
                f"  target: {self.target_rows} rows, {self.target_bytes} vector bytes "
                f"(broadcast limit {self.broadcast_limit_bytes}) in {self.target_blocks} blocks of "
                f"<= {self.target_block_rows} rows ("
                + ("input partitions" if self.queries_broadcast else "collected" if self.plan == "local"
                   else "read in the query's one task" if self.one_task
                   else "broadcast" if self.plan == "broadcast" else f"{self.target_partitions} partitions") + ")",
                f"  executors: {self.cores} cores, task memory budget {self.task_memory_bytes} bytes, "
                f"backend {self.backend}" if self.plan != "local"
                else f"  searched in the driver's process by the CPU kernels (backend {self.backend})",
                f"  precision: {describe_precision('cpu' if self.plan == 'local' else self.backend, self.precision)}",
            ]
            if self.cap_argument is not None:
                bound = "<=" if self.cap_argument == "max_distance" else ">="
                lines.append(f"  cap: {self.cap_argument}, only targets whose {self.metric} is {bound} "
                             f"{self.cap!r} match (a query may get fewer than k rows)")
            if self.keys is not None:
                equal = " and ".join(f"query.{q} = target.{t} (as {common})" for q, t, common in self.keys)
                groups = ("target groups not counted (the caller gave the sides' facts)" if self.key_groups is None
                          else f"{self.key_groups} target groups, the largest {self.largest_group} rows")
                lines.append(f"  keys: {equal}; {groups} (a NULL key or one absent from the target "
                             "matches nothing)")
                if self.queries_broadcast:
                    lines.append("  keyed search: each target partition's rows are grouped by key; each "
                                 "query block searches only its keys' rows there")
                elif self.plan == "broadcast":
                    lines.append("  keyed search: the broadcast target is grouped by key; each query "
                                 "block searches only its keys' target rows (small groups batched into "
                                 "one segment search, large ones one kernel call each)")
                elif self.key_cells is not None:
                    lines.append("  keyed search: " + describe_cells(self.key_cells))
        if self.ivf is not None:
            lines.append(f"  approx: {self.ivf['explanation']}")
        return "\n".join(lines)


def describe_precision(backend: str, precision: str | None) -> str:
    """What a precision setting will run, in words (the plan's explanation)."""
    if backend in ("cpu", "reference"):
        searches = "float64" if backend == "reference" else "float32 with a float64 re-rank"
        return f"{precision} asked; backend {backend} searches in {searches}"
    gpu = ("bf16 on GPUs of compute capability >= 8.0, fp32 on older GPUs" if precision == "auto"
           else f"{precision} on GPUs")
    cpu = "" if backend == "gpu" else "; CPU executors search in float32 with a float64 re-rank"
    return f"{precision}: {gpu}{cpu}; results are exact in every precision"


def describe_cells(cells: dict, group: str = "key group") -> str:
    """The keyed blocked plan's cut of the groups (``group``: what one is, in words) into
    cells, in words (the explanation)."""
    text = (f"both sides partitioned by {group}: {cells['groups']} {group}s with queries and targets "
            f"in {cells['bins']} bins of <= {cells['bin_target_rows']} target rows "
            f"(small {group}s batched, searched as segments), {cells['cells']} cells of one "
            "bin's query part x target part, each one task's memory")
    if cells["split_groups"]:
        q_parts, t_parts = cells["largest_split"]
        groups = group if cells["split_groups"] == 1 else group + "s"
        text += (f"; {cells['split_groups']} {groups} split (skew), the most into {q_parts} query x "
                 f"{t_parts} target parts, whose partial top-k are merged per query")
    else:
        text += f"; no {group} split"
    if cells["unmatched_queries"]:
        which = "none" if group == "key group" else f"no {group} or a first {group} without target rows"
        text += (f"; {cells['unmatched_queries']} query rows with {which}, in cells of their own "
                 "(LEFT OUTER emits one without candidates with NULLs)")
    return text


@dataclass(frozen=True)
class KeyedLayout:
    """The keyed blocked plan's cut of the key groups into *cells* (:func:`keyed_layout`).

    Groups are packed, in id order, into bins of at most ``bin_target_rows`` target rows; a
    group larger than that is a bin of its own, split into ``t_parts`` target parts. A bin's
    queries are split into ``q_parts`` query parts (by the memory bound, and for a bin whose
    work alone would keep one core busy far longer than the rest). A cell is one (bin, query
    part, target part): one cogroup call holds its rows, so its memory is bounded by the block
    sizes whatever the skew. Cell ids of a bin are ``base .. base + q_parts * t_parts - 1``,
    query part ``qp`` and target part ``tp`` at ``base + qp * t_parts + tp``. Query rows of
    no group (LEFT OUTER only) get cells of their own with no target part.
    """

    groups: np.ndarray          # int64 group ids with both queries and targets, ascending
    base: np.ndarray            # int64 first cell of each group's bin
    t_parts: np.ndarray         # int64 target parts of each group's bin
    q_parts: np.ndarray         # int64 query parts of each group's bin
    unmatched_base: int         # first cell of the query rows without a group
    unmatched_parts: int        # their query parts (0: none, or an inner join)
    unmatched_queries: int
    cells: int
    bins: int
    bin_target_rows: int
    split_groups: int           # groups whose target rows are split over several parts
    largest_split: tuple[int, int]   # (query parts, target parts) of the most split group

    def summary(self) -> dict:
        """JSON-safe figures for the plan (``JoinPlan.key_cells``)."""
        return {"groups": int(self.groups.size), "bins": self.bins, "cells": self.cells,
                "bin_target_rows": self.bin_target_rows, "split_groups": self.split_groups,
                "largest_split": list(self.largest_split),
                "unmatched_queries": self.unmatched_queries}


def keyed_layout(target_counts: np.ndarray, query_counts: np.ndarray, *, unmatched_queries: int,
                 target_block_rows: int, query_block_rows: int, cores: int, dimension: int,
                 keep_unmatched: bool) -> KeyedLayout:
    """Cut key groups into cells (:class:`KeyedLayout`) from their sizes.

    ``target_counts[g]`` and ``query_counts[g]`` are the rows of group ``g`` on each side
    (groups with none on either side get no cell: they cannot produce a row); a query row
    in several groups (an IVF query's probed lists) counts once in each, as its cells hold it. A bin holds
    at most ``min(target_block_rows, targets / cores)`` target rows, so the work spreads over
    the cores; a query part at most ``query_block_rows`` rows, and a bin's work (query rows x
    target rows x d) is split over more query parts when it exceeds a ``2 * cores``-th of
    the join's (and ``ONE_TASK_WORK``, below which a split costs more than it saves).
    ``keep_unmatched`` (LEFT OUTER, or queries in several groups) gives the
    ``unmatched_queries`` rows that reach no group's cell cells of their own.
    """
    target_counts = np.asarray(target_counts, np.int64)
    query_counts = np.asarray(query_counts, np.int64)
    groups = np.flatnonzero((target_counts > 0) & (query_counts > 0)).astype(np.int64)
    t_rows, q_rows = target_counts[groups], query_counts[groups]
    total_targets = int(t_rows.sum())
    # Half the row bits of a block: a cell's target part is split at random (see
    # nearest_join.keyed), so it may run a little over its expected size.
    capacity = int(max(1, min(target_block_rows, MAX_BLOCK_ROWS // 2,
                              math.ceil(total_targets / max(cores, 1)))))
    # Greedy in group order: a group joins the open bin while the bin stays within capacity;
    # a larger group is a bin of its own.
    bin_of = np.empty(groups.size, np.int64)
    bins, filled = -1, capacity
    for i, rows in enumerate(t_rows.tolist()):
        if rows > capacity or filled + rows > capacity:
            bins += 1
            filled = 0
        bin_of[i] = bins
        filled += rows
    bins += 1
    bin_targets = np.bincount(bin_of, t_rows, minlength=bins).astype(np.int64)
    bin_queries = np.bincount(bin_of, q_rows, minlength=bins).astype(np.int64)
    bin_work = np.bincount(bin_of, q_rows.astype(np.float64) * t_rows * dimension, minlength=bins)
    bin_t_parts = np.maximum(1, -(-bin_targets // capacity))
    cell_work = max(float(bin_work.sum()) / (2 * max(cores, 1)), ONE_TASK_WORK)
    by_work = np.ceil(bin_work / bin_t_parts / cell_work).astype(np.int64)
    bin_q_parts = np.minimum(np.maximum(-(-bin_queries // max(query_block_rows, 1)), by_work),
                             np.maximum(bin_queries, 1))
    bin_q_parts = np.maximum(bin_q_parts, 1)
    bin_cells = bin_q_parts * bin_t_parts
    bin_base = np.concatenate([[0], np.cumsum(bin_cells)[:-1]]).astype(np.int64) if bins else np.zeros(0, np.int64)
    cells = int(bin_cells.sum())
    unmatched_parts = (int(math.ceil(unmatched_queries / max(query_block_rows, 1)))
                       if keep_unmatched and unmatched_queries else 0)
    split = bin_t_parts > 1
    largest = int(np.argmax(bin_cells)) if bins else -1
    return KeyedLayout(
        groups=groups, base=bin_base[bin_of], t_parts=bin_t_parts[bin_of], q_parts=bin_q_parts[bin_of],
        unmatched_base=cells, unmatched_parts=unmatched_parts,
        unmatched_queries=int(unmatched_queries) if keep_unmatched else 0,
        cells=cells + unmatched_parts, bins=bins, bin_target_rows=capacity,
        split_groups=int(split.sum()),
        largest_split=(int(bin_q_parts[largest]), int(bin_t_parts[largest])) if split.any() else (1, 1))


@dataclass(frozen=True)
class SideFacts:
    """What the planner knows of one side: rows, input partitions, the lengths of its
    non-NULL vectors (None when it has none), and the bytes of its other columns (a
    broadcast side's travel with its vectors: :func:`payload_bytes`)."""

    rows: int
    partitions: int
    shortest: int | None
    longest: int | None
    payload: int = 0


_FIXED_WIDTH = {"boolean": 1, "byte": 1, "short": 2, "integer": 4, "long": 8, "float": 4, "double": 8,
                "date": 4, "timestamp": 8, "timestamp_ntz": 8, "void": 0}


def payload_bytes(df, vector_column: str):
    """A Column: the bytes of a row's columns other than ``vector_column``, as Arrow holds
    them: a fixed-width value its width, a string or binary its bytes and offset, an array of
    fixed-width elements its elements and offset, any other value :data:`PAYLOAD_VALUE_BYTES`."""
    total = F.lit(0).cast("long")
    for field in df.schema.fields:
        if field.name == vector_column:
            continue
        name = field.dataType.typeName()
        if name in _FIXED_WIDTH:
            size = F.lit(_FIXED_WIDTH[name])
        elif name == "decimal":
            size = F.lit(16)
        elif name in ("string", "binary"):
            size = F.coalesce(F.octet_length(column(df, field.name)), F.lit(0)) + 4
        elif name == "array" and field.dataType.elementType.typeName() in _FIXED_WIDTH:
            values = column(df, field.name)
            width = _FIXED_WIDTH[field.dataType.elementType.typeName()]
            size = F.when(values.isNotNull(), F.size(values) * width).otherwise(0) + 4
        else:
            size = F.lit(PAYLOAD_VALUE_BYTES)
        total = total + size
    return total


def vector_length(df, name: str):
    """The length of column ``name``'s vectors (array or ML VectorUDT), NULL for a NULL vector."""
    col = column(df, name)
    if type(df.schema[name].dataType).__name__ == "VectorUDT":
        from pyspark.ml.functions import vector_to_array

        # SQL cannot read a UDT's fields; vector_to_array gives a sparse vector its full size.
        length = F.size(vector_to_array(col))
    else:
        length = F.size(col)
    # size(NULL) is -1 unless ANSI mode is on, and vector_to_array fails on NULL: CASE WHEN
    # evaluates its branch only for rows that pass the test.
    return F.when(col.isNotNull(), length)


@dataclass(frozen=True)
class KeyFacts:
    """What the planner knows of the target's ``on=`` keys: its groups of non-NULL keys."""

    groups: int
    largest: int


def side_facts(query, query_column: str, target, target_column: str,
               target_keys: list | None = None):
    """Rows, partitions and vector lengths of both sides, in one small Spark query; with
    ``target_keys`` (Columns of the target) also the number of distinct non-NULL keys and
    the rows of the largest group, as a third item (:class:`KeyFacts`).

    Both sides' facts come from one aggregation over their union, grouped by side: one
    shuffle (two aggregations joined would be two, and a third stage for the join). With keys,
    the union is first grouped by side and key (the query's rows carry NULL keys: one group
    per side), and that is grouped by side: two shuffles and one scan of each side. Inputs
    that Spark estimates small are read in one task instead, with no shuffle
    (:func:`in_one_task_when_small`)."""
    names = [f"k{i}" for i in range(len(target_keys or ()))]

    def projected(df, name: str, side: int, keys):
        # Spark forbids the non-deterministic partition id inside an aggregate: project first.
        return df.select(F.lit(side).alias("side"), vector_length(df, name).alias("n"),
                         F.spark_partition_id().alias("p"), payload_bytes(df, name).alias("b"),
                         *[key.alias(n) for key, n in zip(keys, names)])

    null_keys = [F.lit(None).cast(field.dataType) for field in _key_types(target, target_keys)]
    union = projected(query, query_column, 0, null_keys).unionByName(
        projected(target, target_column, 1, target_keys or []))
    # The partition ids were taken below, in each side's own partitions.
    union = in_one_task_when_small(union)
    if target_keys is None:
        both = union.groupBy("side").agg(
            F.count(F.lit(1)).alias("rows"), F.min("n").alias("shortest"), F.max("n").alias("longest"),
            (F.max("p") + 1).alias("partitions"), F.sum("b").alias("payload"))
    else:
        keyed = " AND ".join(f"{n} IS NOT NULL" for n in names)
        both = (union.groupBy("side", *names)
                .agg(F.count(F.lit(1)).alias("rows"), F.min("n").alias("shortest"), F.max("n").alias("longest"),
                     F.max("p").alias("p"), F.sum("b").alias("b"))
                .withColumn("keyed", F.expr(keyed) & (F.col("side") == 1))
                .groupBy("side")
                .agg(F.sum("rows").alias("rows"), F.min("shortest").alias("shortest"),
                     F.max("longest").alias("longest"), (F.max("p") + 1).alias("partitions"),
                     F.sum("b").alias("payload"), F.count(F.when(F.col("keyed"), 1)).alias("groups"),
                     F.max(F.when(F.col("keyed"), F.col("rows"))).alias("largest")))
    rows = {row["side"]: row for row in both.collect()}
    # A side without rows has no group: no row of its own.
    sides = tuple(
        SideFacts(rows=int(row["rows"]), partitions=int(row["partitions"] or 0),
                  shortest=row["shortest"], longest=row["longest"], payload=int(row["payload"] or 0))
        if row is not None
        else SideFacts(rows=0, partitions=0, shortest=None, longest=None)
        for row in (rows.get(0), rows.get(1)))
    if target_keys is None:
        return sides
    target_row = rows.get(1)
    if target_row is None:   # no target row: no key
        return sides + (KeyFacts(groups=0, largest=0),)
    return sides + (KeyFacts(groups=int(target_row["groups"]), largest=int(target_row["largest"] or 0)),)


def estimated_bytes(df) -> int | None:
    """Spark's estimate of ``df``'s size in bytes (its optimizer's statistics: a cached or
    local relation's, a file source's files), without a Spark job; None when Spark has none
    (its default for an unknown source is far beyond any real table) or under Spark Connect,
    whose client cannot ask."""
    try:
        size = int(df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes())
    except Exception:   # noqa: BLE001 (Spark Connect: no JVM handle; any other failure: no estimate)
        return None
    return size if size < 1 << 62 else None


def known_rows(df) -> int | None:
    """``df``'s rows when they are known without a Spark job: its optimized plan is
    projections over a cached relation Spark has built (its row count), over local rows, or
    over a Parquet relation on the local file system (its files' footers,
    :func:`nearest_join.parquet_scan.footer_rows`); else None (a filter, a join, any other
    source, Spark Connect). The facts job counts the rows anyway: a caller may start work that
    needs the count beside it, and checks the count against the facts'."""
    if getattr(df, "_jdf", None) is None:   # Spark Connect: no plan to look into
        return None
    from py4j.protocol import Py4JError

    from .parquet_scan import footer_rows

    try:
        plan = df._jdf.queryExecution().optimizedPlan()
        while plan.getClass().getSimpleName() == "Project":
            plan = plan.child()
        name = plan.getClass().getSimpleName()
        if name == "InMemoryRelation":
            rows = plan.stats().rowCount()   # defined once the cache is built
            return int(str(rows.get())) if rows.isDefined() else None
        if name == "LocalRelation":
            return int(plan.data().size())
        if (name == "LogicalRelation" and not plan.isStreaming()
                and plan.relation().getClass().getSimpleName() == "HadoopFsRelation"):
            return footer_rows(plan.relation())
    except Py4JError:   # a plan of a shape this reading does not know
        return None
    return None


# Words of Spark's plan nodes that run Python (UDFs, mapInArrow, applyInPandas, Python data
# sources): such a DataFrame may be small and yet costly to compute (an embedding model).
_PYTHON_NODES = ("Python", "Pandas", "Arrow")


def cheap_in_one_task(df) -> bool:
    """Whether Spark estimates ``df`` at most :data:`ONE_TASK_BYTES` (as :func:`estimated_bytes`
    reads it) and its plan runs no Python: all of its work after its last shuffle may then run
    in one task. A few small scans and projections cost less there than a shuffle or a job of
    their own; a Python UDF (an embedding model, say) would not, whatever its output's size.
    False under Spark Connect, whose client cannot ask."""
    size = cheap_size(df)
    return size is not None and size <= ONE_TASK_BYTES


def cheap_size(df) -> int | None:
    """Spark's estimate of ``df``'s bytes when its plan runs no Python (see
    :func:`cheap_in_one_task`), else None; None under Spark Connect, whose client cannot ask."""
    try:
        plan = df._jdf.queryExecution().optimizedPlan()
        size, text = int(plan.stats().sizeInBytes()), plan.toString()
    except Exception:   # noqa: BLE001 (Spark Connect: no JVM handle; any other failure: no)
        return None
    return None if any(word in text for word in _PYTHON_NODES) else size


def local_limit_bytes(spark) -> int:
    """The inputs' estimated bytes, both sides together, up to which a one-task join is
    searched in the driver (``spark.nearestJoin.localLimitBytes``, :data:`DEFAULT_LOCAL_LIMIT`;
    0: never)."""
    return parse_bytes(_conf(spark, CONF_PREFIX + "localLimitBytes", DEFAULT_LOCAL_LIMIT))


def arrow_side_facts(table, vector_index: int) -> SideFacts:
    """:class:`SideFacts` of one side collected as an Arrow table (a list column of vectors at
    ``vector_index``): what :func:`side_facts` counts in Spark, one partition."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(table.column(vector_index))
    shortest, longest = pc.min(lengths).as_py(), pc.max(lengths).as_py()
    return SideFacts(rows=table.num_rows, partitions=1 if table.num_rows else 0,
                     shortest=shortest, longest=longest)


# Bytes of a fixed-width value in a side's other columns, by Arrow type (as _FIXED_WIDTH, a
# boolean one byte).
_ARROW_WIDTH = {"bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float": 4, "double": 8}


def file_side_facts(source, vector_index: int, partitions: int) -> SideFacts:
    """:class:`SideFacts` of a side read from its files (a ``udfs.files.FileRows``), counted
    by pyarrow here: what :func:`side_facts` counts in Spark (rows, the shortest and longest
    non-NULL vector, :func:`payload_bytes`), a batch at a time; ``partitions``: the shares the
    side's tasks read. Raises ``pyarrow.ArrowException`` or ``OSError`` where pyarrow cannot
    read a file (the caller lets Spark count and report it)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    shortest = longest = None
    payload = 0
    for batch in source.rows_between(0, source.rows):
        lengths = pc.min_max(pc.list_value_length(batch.column(vector_index))).as_py()
        if lengths["min"] is not None:
            shortest = lengths["min"] if shortest is None else min(shortest, lengths["min"])
            longest = lengths["max"] if longest is None else max(longest, lengths["max"])
        for i, values in enumerate(batch.columns):
            if i == vector_index:
                continue
            kind = values.type
            if str(kind) in _ARROW_WIDTH:
                payload += _ARROW_WIDTH[str(kind)] * len(values)
            elif pa.types.is_string(kind) or pa.types.is_binary(kind):
                payload += (pc.sum(pc.binary_length(values)).as_py() or 0) + 4 * len(values)
            elif str(kind.value_type) in _ARROW_WIDTH:
                elements = pc.sum(pc.list_value_length(values)).as_py() or 0
                payload += elements * _ARROW_WIDTH[str(kind.value_type)] + 4 * len(values)
            else:
                payload += PAYLOAD_VALUE_BYTES * len(values)
    return SideFacts(rows=source.rows, partitions=partitions, shortest=shortest, longest=longest,
                     payload=payload)


def in_one_task_when_small(df):
    """``df`` in one partition when it is :func:`cheap_in_one_task`, else as it is. One
    partition satisfies every aggregation's distribution: an aggregation over it needs no
    exchange."""
    return df.coalesce(1) if cheap_in_one_task(df) else df


def _key_types(target, target_keys: list | None) -> list:
    """The Spark types of the target's key Columns (the query's NULL keys take them)."""
    if not target_keys:
        return []
    return list(target.select(*target_keys).schema.fields)


def _describe(label: str, facts: SideFacts) -> str:
    if facts.shortest is None:
        return f"{label} has no non-NULL vector"
    if facts.shortest == facts.longest:
        return f"{label} has dimension {facts.shortest}"
    return f"{label} has vectors of dimension {facts.shortest} and of dimension {facts.longest}"


def join_dimension(ranking, query: SideFacts, target: SideFacts) -> int | None:
    """The one vector length of both sides (None when neither has a vector).

    Raises
    ------
    NearestByJoinError
        ``VECTOR_DIMENSION_MISMATCH`` when a side's vectors differ in length (a ragged
        column) or the two sides' lengths differ; the message names the columns and lengths.
    """
    q_label = f"query column {quote(ranking.query_column)}"
    t_label = f"target column {quote(ranking.target_column)}"
    lengths = {n for side in (query, target) for n in (side.shortest, side.longest) if n is not None}
    if len(lengths) <= 1:
        return next(iter(lengths), None)
    # Spark names two lengths that differ: a ragged side's own two, else one from each side.
    ragged = next((side for side in (query, target) if side.shortest != side.longest), None)
    left, right = (ragged.shortest, ragged.longest) if ragged else (query.shortest, target.shortest)
    raise NearestByJoinError("VECTOR_DIMENSION_MISMATCH", function=ranking.source, left=left, right=right,
                             detail=f"{_describe(q_label, query)}, {_describe(t_label, target)}")


def _conf(spark, key: str, default=None):
    try:
        value = spark.conf.get(key, None)
    except Exception:  # some Connect servers refuse unknown keys
        value = None
    return default if value is None else value


def cluster_cores(spark) -> int:
    """Cores available to tasks, from configuration alone (no SparkContext: works on Connect)."""
    forced = _conf(spark, CONF_PREFIX + "parallelism")
    if forced:
        return max(1, int(forced))
    master = str(_conf(spark, "spark.master", "local[*]"))
    task_cpus = int(_conf(spark, "spark.task.cpus", 1))
    match = re.match(r"local\[(\d+|\*)", master)
    if match:
        n = (os.cpu_count() or 1) if match.group(1) == "*" else int(match.group(1))
        return max(1, n // task_cpus)
    if master == "local":
        return 1
    match = re.match(r"local-cluster\[(\d+),\s*(\d+)", master)
    if match:
        return max(1, int(match.group(1)) * int(match.group(2)) // task_cpus)
    instances = int(_conf(spark, "spark.executor.instances", 2))
    cores = int(_conf(spark, "spark.executor.cores", 1))
    return max(1, instances * cores // task_cpus)


def task_memory_bytes(spark) -> int:
    """Memory one task may spend on its blocks: configured, or a quarter of a task's share of
    the JVM's unified memory, (heap - 300 MiB) x ``spark.memory.fraction`` / concurrent tasks,
    of the executors (in local mode: of the driver, whose heap the local tasks share).

    The JVM holds a few copies of each packed block a task ships (shuffle, the grouped Arrow
    input), so the blocks must fit its memory as well as the Python worker's: with a 1g
    ``local[2]`` driver, 128m per task ran the JVM out of heap and 64m did not
    (benchmarks/memory.py).
    """
    forced = _conf(spark, CONF_PREFIX + "taskMemoryBytes")
    if forced:
        return parse_bytes(forced)
    master = str(_conf(spark, "spark.master", ""))
    if master.startswith("local[") or master == "local":
        heap = parse_bytes(_conf(spark, "spark.driver.memory", "1g"))
        cores = cluster_cores(spark)
    else:
        heap = parse_bytes(_conf(spark, "spark.executor.memory", "1g"))
        # tasks at once in one executor
        cores = int(_conf(spark, "spark.executor.cores", 1)) // int(_conf(spark, "spark.task.cpus", 1))
    fraction = float(_conf(spark, "spark.memory.fraction", 0.6))
    unified = max(heap - RESERVED_HEAP, 0) * fraction
    return int(min(max(unified / max(cores, 1) / 4, 64 * MiB), 4 * GiB))


def broadcast_memory_cap(spark) -> tuple[int, str]:
    """(bytes, why): the largest target the driver and the executors can hold as a broadcast.

    One JVM holds a broadcast target whole several times over. The driver collects it and
    serialises it into the broadcast's pieces; an executor keeps the pieces and the table
    built from them (:data:`BROADCAST_COPIES`); a local-mode JVM is both, with the collected
    rows, the pieces and the table (:data:`LOCAL_COPIES`); and each task running there copies
    it once more, because the broadcast nested-loop join copies every joined row of one query
    block before the Arrow writer hands them to Python. Every copy holds the target's other
    columns too (the caller adds their bytes: ``choose_plan``'s ``target_payload``). Those
    copies must fit the JVM's unified memory, (heap - 300 MiB) x ``spark.memory.fraction``:
    the cap is the smallest quotient over
    the driver and an executor, and never more than Spark's own limit on a broadcast table.
    In local mode the executors are the driver; ``local-cluster[n, cores, MiB]`` names its
    executors' heap.
    """
    master = str(_conf(spark, "spark.master", "local[*]"))
    driver = parse_bytes(_conf(spark, "spark.driver.memory", "1g"))
    task_cpus = max(1, int(_conf(spark, "spark.task.cpus", 1)))
    if master.startswith("local[") or master == "local":
        jvms = [("spark.driver.memory", driver, cluster_cores(spark), LOCAL_COPIES)]
    else:
        match = re.match(r"local-cluster\[\d+,\s*(\d+),\s*(\d+)", master)
        if match:
            executor, name = int(match.group(2)) * MiB, "spark.master's executors"
            executor_cores = int(match.group(1))
        else:
            executor, name = parse_bytes(_conf(spark, "spark.executor.memory", "1g")), "spark.executor.memory"
            executor_cores = int(_conf(spark, "spark.executor.cores", 1))
        jvms = [("spark.driver.memory", driver, 0, BROADCAST_COPIES),
                (name, executor, max(1, executor_cores // task_cpus), BROADCAST_COPIES)]
    fraction = float(_conf(spark, "spark.memory.fraction", 0.6))
    cap, why = None, ""
    for name, heap, tasks, held in jvms:
        copies = held + tasks
        fits = int(max(heap - RESERVED_HEAP, 0) * fraction) // copies
        if cap is None or fits < cap:
            cap, why = fits, (f"{copies} copies of it ({held}, and one per task of {tasks} at once) "
                              f"in the unified memory of {name} {heap} B")
    if cap >= SPARK_MAX_BROADCAST_BYTES:
        return SPARK_MAX_BROADCAST_BYTES, "Spark's 8 GiB limit on a broadcast table"
    return cap, why


def broadcast_limit(spark, override: int | None) -> int:
    """The target size (vector bytes) up to which the broadcast plan is chosen: the
    argument, else ``spark.nearestJoin.broadcastLimitBytes``, never above what memory allows
    (:func:`broadcast_memory_cap`)."""
    return min(_configured_broadcast_limit(spark, override), broadcast_memory_cap(spark)[0])


def _configured_broadcast_limit(spark, override: int | None) -> int:
    """The argument, else ``spark.nearestJoin.broadcastLimitBytes``."""
    if override is not None:
        return int(override)
    return parse_bytes(_conf(spark, CONF_PREFIX + "broadcastLimitBytes", DEFAULT_BROADCAST_LIMIT))


def broadcast_target_block_bytes(spark) -> int:
    """Vector bytes per broadcast target block (``spark.nearestJoin.broadcastTargetBlockBytes``).

    Larger blocks mean fewer, larger searches (a GPU wants them: see conf/cluster-gpu.yaml);
    at most 1 GiB, since a packed block travels as one Arrow binary value (< 2 GiB with its
    payload columns).
    """
    key = CONF_PREFIX + "broadcastTargetBlockBytes"
    try:
        value = parse_bytes(_conf(spark, key, BROADCAST_TARGET_BLOCK_BYTES))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    if not 1 <= value <= GiB:
        raise ValueError(f"{key}: expected a size between 1 byte and 1g, got {value} bytes")
    return value


def query_blocks_per_task(spark) -> int:
    """Query blocks each broadcast task splits its rows into (``spark.nearestJoin.queryBlocksPerTask``).

    A task searches its next query block while it emits the rows of the previous one, so
    several blocks per task overlap the host's row emission with the (GPU) search.
    """
    key = CONF_PREFIX + "queryBlocksPerTask"
    raw = _conf(spark, key, 1)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = 0
    if value < 1 or str(raw).strip() != str(value):
        raise ValueError(f"{key}: expected an integer >= 1, got {raw!r}")
    return value


def keep_gpu_targets(spark) -> bool:
    """Whether GPU executors keep broadcast target blocks for the stage's next task
    (``spark.nearestJoin.gpu.keepTargets``, default true; see ``udfs.gpu_search``)."""
    key = CONF_PREFIX + "gpu.keepTargets"
    raw = str(_conf(spark, key, "true")).strip().lower()
    if raw not in ("true", "false"):
        raise ValueError(f"{key}: expected true or false, got {raw!r}")
    return raw == "true"


def gpu_tasks(spark, backend: str) -> str | None:
    """Why the join's tasks will search on GPUs, or None: ``backend="gpu"``; under ``"auto"``,
    executors given GPUs (``spark.executor.resource.gpu.amount``), or a local master on a host
    with an NVIDIA device and torch (its tasks run on this host). Looked up without importing
    torch (seconds)."""
    if backend == "gpu":
        return "backend='gpu'"
    if backend != "auto":
        return None
    key = "spark.executor.resource.gpu.amount"
    amount = _conf(spark, key)
    try:
        if amount is not None and float(amount) > 0:
            return f"{key}={amount}"
    except ValueError:
        pass
    if str(_conf(spark, "spark.master", "")).startswith("local"):
        import importlib.util

        from udfs.context import cuda_may_exist

        if cuda_may_exist() and importlib.util.find_spec("torch") is not None:
            return "a local master on a host with an NVIDIA device and torch"
    return None


def gpu_task_share(spark) -> float:
    """The share of a GPU one task holds (``spark.task.resource.gpu.amount``, default 1): with
    0.5 two tasks share each GPU, and each GPU searcher budgets half of its memory.
    Amounts above 1 count as 1 (a task searches on the first GPU it is given)."""
    key = "spark.task.resource.gpu.amount"
    raw = _conf(spark, key, 1)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{key}: expected a number > 0, got {raw!r}")
    return min(1.0, value)


def _clamp_rows(rows: float) -> int:
    return int(min(max(1, rows), MAX_BLOCK_ROWS))


def choose_plan(*, spark, ranking, options: JoinOptions, dimension: int | None, itemsize: int,
                query_rows: int, target_rows: int,
                query_input_partitions: int | None = None, keys: list | None = None,
                key_facts: KeyFacts | None = None, inputs_cheap: bool = False,
                query_payload: int = 0, target_payload: int = 0) -> JoinPlan:
    """Pick the plan and block sizes from the sizes, the options and configuration.

    ``query_payload``, ``target_payload``: the bytes of each side's other columns
    (:attr:`SideFacts.payload`), which a broadcast side carries with its vectors: the two
    together must fit the memory cap (:func:`broadcast_memory_cap`), the vectors alone the
    broadcast limit.

    ``inputs_cheap``: both inputs are :func:`cheap_in_one_task` (a small join of them may then
    run in one task, ``one_task``).

    ``keys`` (the resolved ``on=``, :class:`nearest_join.ranking.JoinKey`) are searched in
    either plan; the keyed blocked plan's cells (``key_cells``) are cut afterwards, from the
    groups' sizes (:func:`keyed_layout`, ``nearest_join.keyed``)."""
    k = options.k
    query_block_rows, target_block_rows = options.query_block_rows, options.target_block_rows
    cores = cluster_cores(spark)
    budget = task_memory_bytes(spark)
    # (broadcast_limit's parts, the cap computed once: each side's other columns meet it too)
    memory_cap, cap_why = broadcast_memory_cap(spark)
    limit = min(_configured_broadcast_limit(spark, options.broadcast_limit_bytes), memory_cap)
    d = max(dimension or 1, 1)
    row_bytes = d * itemsize
    target_bytes = target_rows * row_bytes
    # Per query row a task holds its vector plus k slots of state (value, key, payload ref).
    query_row_bytes = row_bytes + k * 16
    memory_q_rows = budget // 4 // query_row_bytes
    spread = one_task = False
    query_bytes = query_rows * row_bytes
    queries_broadcast = (options.mode == "exact" and query_bytes <= limit
                         and query_bytes + query_payload <= memory_cap
                         and target_bytes >= QUERY_BROADCAST_MIN_TARGET_BYTES
                         and query_bytes * QUERY_BROADCAST_RATIO <= target_bytes)
    if queries_broadcast:
        plan = "blocked"
        reason = (f"query vectors {query_bytes} B, at most 1/{QUERY_BROADCAST_RATIO} of the target's "
                  f"{target_bytes} B: the query blocks are broadcast, the target streams past them")
        q_rows = query_block_rows or _clamp_rows(memory_q_rows)
        t_rows = target_block_rows or _clamp_rows(budget // 2 // row_bytes)
    elif target_bytes <= limit and target_bytes + target_payload <= memory_cap:
        plan, reason = "broadcast", f"target vectors {target_bytes} B <= broadcast limit {limit} B"
        # One query block per task, as few tasks as the cores and the memory budget allow:
        # every query block receives the whole broadcast target through Arrow, so fewer,
        # larger blocks amortise that transfer.
        per_task = query_blocks_per_task(spark)
        q_parts = cores * max(1, math.ceil(query_rows / (cores * max(memory_q_rows, 1))))
        q_rows = query_block_rows or _clamp_rows(math.ceil(query_rows / (q_parts * per_task)) or 1)
        t_rows = target_block_rows or _clamp_rows(broadcast_target_block_bytes(spark) // row_bytes)
        # Balance the query rows over the tasks with a (cheap, row-level) shuffle when the
        # join is large, or when the input has fewer partitions than the cores and the join
        # is not so small that one task searches it faster than a shuffle round starts.
        work = query_rows * target_rows * d
        few_partitions = query_input_partitions is None or query_input_partitions < cores
        spread = work >= SPREAD_WORK or (few_partitions and work >= ONE_TASK_WORK)
        elements = (query_rows + target_rows + query_rows * k) * d
        one_task = inputs_cheap and work < ONE_TASK_WORK and elements <= ONE_TASK_ELEMENTS
        if one_task:   # (those few elements keep the task's top-k state far below its budget)
            q_rows = query_block_rows or _clamp_rows(math.ceil(query_rows / per_task))
    else:
        if target_bytes <= limit:
            reason = (f"target vectors {target_bytes} B and its other columns {target_payload} B > the "
                      f"broadcast's memory cap {memory_cap} B ({cap_why})")
        else:
            reason = f"target vectors {target_bytes} B > broadcast limit {limit} B"
            if limit == memory_cap:
                reason += f" ({cap_why})"
        plan = "blocked"
        q_rows = query_block_rows or _clamp_rows(memory_q_rows)
        t_rows = target_block_rows or _clamp_rows(budget // 2 // row_bytes)
    q_blocks = math.ceil(query_rows / q_rows) if query_rows else 0
    t_blocks = math.ceil(target_rows / t_rows) if target_rows else 0
    if plan == "broadcast":
        # 0 means "keep the input partitioning"
        q_parts = max(1, math.ceil(query_rows / (q_rows * per_task))) if spread and query_rows else 0
        t_parts = None
    elif queries_broadcast:
        q_parts, t_parts = 0, None
    else:
        q_parts, t_parts = max(1, q_blocks), max(1, t_blocks + 1)
    cap = options.cap(ranking.metric)
    cap_argument = None if cap is None else (
        "max_distance" if options.max_distance is not None else "min_similarity")
    backend = options.backend
    return JoinPlan(
        plan=plan, reason=reason, metric=ranking.metric, k=k, mode=options.mode,
        join_type=options.join_type, query_column=ranking.query_column,
        target_column=ranking.target_column, dimension=dimension, query_rows=query_rows,
        target_rows=target_rows, target_bytes=target_bytes, broadcast_limit_bytes=limit,
        task_memory_bytes=budget, cores=cores, query_block_rows=q_rows, target_block_rows=t_rows,
        query_blocks=q_blocks, target_blocks=t_blocks, query_partitions=q_parts,
        target_partitions=t_parts, backend=backend, precision=options.precision,
        distance_col=options.distance_col, cap_argument=cap_argument, cap=cap,
        keys=None if keys is None else [[k.query_column, k.target_column, k.common] for k in keys],
        key_groups=None if key_facts is None else key_facts.groups,
        largest_group=None if key_facts is None else key_facts.largest,
        queries_broadcast=queries_broadcast, one_task=one_task,
    )


def spark_plan(spark, ranking, options: JoinOptions) -> JoinPlan:
    """The plan of a ranking the fast path cannot run: Spark's own ``nearestByJoin`` runs it."""
    return JoinPlan(
        plan="spark", reason=f"ranking {ranking} is not one of the vector functions over one "
        "column of each side, as Spark's analyzer places its columns: Spark's own "
        "nearestByJoin runs it (correct, slow)",
        metric=None, k=options.k, mode=options.mode, join_type=options.join_type,
        query_column=None, target_column=None, dimension=None, query_rows=None,
        target_rows=None, target_bytes=None,
        broadcast_limit_bytes=broadcast_limit(spark, options.broadcast_limit_bytes),
        task_memory_bytes=task_memory_bytes(spark), cores=cluster_cores(spark),
        query_block_rows=None, target_block_rows=None, query_blocks=None, target_blocks=None,
        query_partitions=None, target_partitions=None, backend="spark", precision=None,
        distance_col=options.distance_col)
