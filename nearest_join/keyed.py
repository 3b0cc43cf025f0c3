"""The keyed blocked plan: equal keys (``on=``) when the target is too large to broadcast.

Both sides arrive with a dense int group id per row (``udfs.columns.GROUP``; NULL: no group):
``nearest_join.join`` numbers the distinct target keys of ``on=``, and an IVF plan can number
its lists the same way, so nothing here knows what a key is. The plan:

1. :func:`layout_of` counts each group's rows on both sides (one small Spark job; the driver
   receives one row of three integers per group) and cuts them into *cells*
   (:func:`nearest_join.planner.keyed_layout`): small groups are batched into bins of a
   target block's rows, a group larger than that (a skewed key) is a bin split into target
   parts, and a bin's queries into query parts. A cell is one (bin, query part, target part).
2. :func:`keyed_blocked_join`: every query row goes to each cell of its query part (one per
   target part of its bin), every target row to each cell of its target part (one per query
   part); the two sides are cogrouped by cell, so one call of ``udfs.blocks.search_cell``
   holds one query part and one target part - bounded by the block sizes, never by a group's
   size - and returns that cell's partial top-k (``udfs.topk``).
3. The partials are grouped by query part and merged by the blocked plan's own stage 2
   (``udfs.blocks.merge_partials``: the shared merge, then the rows are emitted), exactly as
   the partials of an unkeyed blocked join are.

A row's part is drawn at random (seeded), and row ids taken before the draw order the rows
of a cell (``C.Q_ROW``, ``C.T_ROW``): every cell of a query part sees its rows in the same
order, and ties go to the target met first in (target part, input) order. Spark treats both
as non-deterministic, so a retried stage recomputes its successors rather than mixing two
draws.

The layout is computed from the inputs once (at planning) and applied when the join runs,
so both must read the same rows: as for every Spark plan that reads its inputs twice, a
source that changes between the two (a table being appended to, ``sample`` without a seed)
must be cached or written out first. A group the layout does not know loses its rows.

One group per query row: a query row in several groups (an IVF query probing several lists)
would be merged per cell, not across its groups; such a plan merges its rows' partials per
query row after stage 1.
"""
from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from udfs import blocks
from udfs import columns as C

from .planner import KeyedLayout, keyed_layout

logger = logging.getLogger(__name__)

# Seeds of the part draws (any fixed values: the same query for the same input draws alike).
QUERY_SEED, TARGET_SEED = 22, 23
# Cogroup tasks per core: several, so that cells hashed to one task even out.
CELL_TASKS_PER_CORE = 4


def group_counts(q_grouped: DataFrame, t_grouped: DataFrame) -> tuple[np.ndarray, np.ndarray, int]:
    """(target rows per group, query rows per group, query rows without a group), indexed by
    group id: one Spark job, one row per group to the driver."""
    t = t_grouped.groupBy(C.GROUP).agg(F.count(F.lit(1)).alias("t"))
    q = q_grouped.groupBy(C.GROUP).agg(F.count(F.lit(1)).alias("q"))
    table = t.join(q, C.GROUP, "full").toArrow()
    known = table.column(C.GROUP).is_valid().to_numpy(zero_copy_only=False)
    ids = table.column(C.GROUP).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)[known]
    t_counts = table.column("t").fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    q_counts = table.column("q").fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    unmatched = int(q_counts[~known].sum())
    size = int(ids.max()) + 1 if ids.size else 0
    target_counts, query_counts = np.zeros(size, np.int64), np.zeros(size, np.int64)
    target_counts[ids], query_counts[ids] = t_counts[known], q_counts[known]
    return target_counts, query_counts, unmatched


def layout_of(q_grouped: DataFrame, t_grouped: DataFrame, *, target_block_rows: int,
              query_block_rows: int, cores: int, dimension: int, join_type: str) -> KeyedLayout:
    """The cells of a keyed blocked join (:func:`group_counts`, then
    :func:`nearest_join.planner.keyed_layout`)."""
    target_counts, query_counts, unmatched = group_counts(q_grouped, t_grouped)
    return keyed_layout(target_counts, query_counts, unmatched_queries=unmatched,
                        target_block_rows=target_block_rows, query_block_rows=query_block_rows,
                        cores=cores, dimension=dimension, keep_unmatched=join_type == "leftouter")


def _cells_frame(spark, layout: KeyedLayout) -> DataFrame:
    """Group id -> (its bin's first cell, target parts, query parts), a small table."""
    table = pa.table({C.GROUP: pa.array(layout.groups.astype(np.int32)),
                      "base": pa.array(layout.base), "t_parts": pa.array(layout.t_parts),
                      "q_parts": pa.array(layout.q_parts)})
    return spark.createDataFrame(table)


def keyed_blocked_join(q_grouped: DataFrame, t_grouped: DataFrame, layout: KeyedLayout,
                       ctx: blocks.JoinContext, out_schema, partial_schema, cores: int) -> DataFrame:
    """The joined rows (positional output names, ``out_schema``) of a keyed blocked join.

    ``q_grouped`` and ``t_grouped`` are the sides' columns (as ``ctx``'s layouts place them)
    followed by ``C.GROUP``, the int group id (NULL: none; a query row of no group is kept
    only by LEFT OUTER, with NULL target columns). ``layout`` comes from :func:`layout_of`
    on the same DataFrames.
    """
    spark = q_grouped.sparkSession
    q_columns = [c for c in q_grouped.columns if c != C.GROUP]
    t_columns = [c for c in t_grouped.columns if c != C.GROUP]
    long = "bigint"
    # Each side its own copy of the cells table, and its group id re-aliased: both sides'
    # group ids come from one numbering, which Spark would call an ambiguous self-join.
    group = F.col(C.GROUP).alias(C.GROUP)

    # LEFT OUTER keeps the query rows of no group: NULL cells columns, read as the unmatched cells.
    how = "left" if ctx.join_type == "leftouter" else "inner"
    queries = q_grouped.join(F.broadcast(_cells_frame(spark, layout)), C.GROUP, how)
    queries = queries.select(
        *q_columns, group, F.monotonically_increasing_id().alias(C.Q_ROW),
        F.coalesce("base", F.lit(layout.unmatched_base).cast(long)).alias("base"),
        F.coalesce("t_parts", F.lit(1).cast(long)).alias("t_parts"),
        F.coalesce("q_parts", F.lit(max(layout.unmatched_parts, 1)).cast(long)).alias("q_parts"))
    queries = queries.withColumn("qp", (F.rand(QUERY_SEED) * F.col("q_parts")).cast(long))
    queries = queries.select(
        *q_columns, C.GROUP, C.Q_ROW, (F.col("base") + F.col("qp") * F.col("t_parts")).alias(C.Q_BLOCK_ID),
        F.explode(F.sequence(F.lit(0).cast(long), F.col("t_parts") - 1)).alias(C.T_BLOCK_ID))
    queries = queries.withColumn(C.CELL, F.col(C.Q_BLOCK_ID) + F.col(C.T_BLOCK_ID))

    targets = t_grouped.join(F.broadcast(_cells_frame(spark, layout)), C.GROUP, "inner").select(
        *t_columns, group, F.monotonically_increasing_id().alias(C.T_ROW), "base", "t_parts", "q_parts")
    targets = targets.withColumn("tp", (F.rand(TARGET_SEED) * F.col("t_parts")).cast(long))
    targets = targets.select(
        *t_columns, C.GROUP, C.T_ROW, "base", "t_parts", "tp",
        F.explode(F.sequence(F.lit(0).cast(long), F.col("q_parts") - 1)).alias("qp"))
    targets = targets.select(
        *t_columns, C.GROUP, C.T_ROW,
        (F.col("base") + F.col("qp") * F.col("t_parts") + F.col("tp")).alias(C.CELL))

    tasks = max(1, min(layout.cells, CELL_TASKS_PER_CORE * cores))
    partials = (queries.repartition(tasks, C.CELL).groupBy(C.CELL)
                .cogroup(targets.repartition(tasks, C.CELL).groupBy(C.CELL))
                .applyInArrow(blocks.cell_function(ctx), partial_schema))
    return partials.groupBy(C.Q_BLOCK_ID).applyInArrow(blocks.merge_function(ctx), out_schema)
