"""The keyed blocked plan: groups of rows (``on=`` keys, IVF lists) when the target is too
large to broadcast.

Both sides arrive with their group ids (``udfs.columns.GROUP``): a dense int per target row
(NULL: no group), and per query row an int (``on=`` keys: ``nearest_join.join`` numbers the
distinct target keys) or a ``list<int>`` of several groups (an IVF query's ``nprobe`` probed
lists, nearest first: ``nearest_join.ivf`` numbers the lists), so nothing here knows what a
group is. The plan:

1. :func:`layout_of` counts each group's rows on both sides (one small Spark job; the driver
   receives one row of a few integers per group) and cuts them into *cells*
   (:func:`nearest_join.planner.keyed_layout`): small groups are batched into bins of a
   target block's rows, a group larger than that (a skewed key, a huge list) is a bin split
   into target parts, and a bin's queries into query parts. A cell is one (bin, query part,
   target part). A query row in several groups counts once in each.
2. :func:`keyed_blocked_join`: every query row gets a row id and a *stage-2 block* first,
   then becomes one row per group (its *probes*); each goes to each cell of its bin's query
   part (one per target part of the bin), every target row to each cell of its target part
   (one per query part). The two sides are cogrouped by cell, so one call of
   ``udfs.blocks.search_cell`` holds one query part and one target part - bounded by the
   block sizes, never by a group's size - and returns that cell's partial top-k per stage-2
   block among its rows (``udfs.merge``).
3. The partials are grouped by stage-2 block and merged per query row by the shared merge
   (``udfs.blocks.merge_cells``): a query's partials from all its groups' cells meet there.

The stage-2 block of a query row of one group is its bin's query part (all its partials, one
per target part, hold the same rows); of a query in several groups, a block of
``query_block_rows`` consecutive row ids, since its groups lie in different bins. Only the
copy of probe rank 0 in target part 0 carries the query row's columns; the others carry its
vector, so its payload crosses the cells once, not once per group and target part.

Parts are drawn from the row ids (a hash: every group of a query in one bin falls in the same
query part, where ``search_cell`` searches them together; a target's part at random), and the
row ids (``C.Q_ROW``, ``C.T_ROW``) order a cell's rows: a target's key in the partials is its
row id, so ties go to the target met first in input order, whichever bin and part it is in.
Spark treats row ids as non-deterministic, so a retried stage recomputes its successors
rather than mixing two numberings.

The layout is computed from the inputs once (at planning) and applied when the join runs,
so both must read the same rows: as for every Spark plan that reads its inputs twice, a
source that changes between the two (a table being appended to, ``sample`` without a seed)
must be cached or written out first. A group the layout does not know loses its rows.
"""
from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType

from udfs import blocks
from udfs import columns as C
from udfs.context import JoinContext

from .planner import KeyedLayout, keyed_layout

logger = logging.getLogger(__name__)

# Seed of the target part draw (any fixed value: the same input draws alike).
TARGET_SEED = 23
# Cogroup tasks per core: several, so that cells hashed to one task even out.
CELL_TASKS_PER_CORE = 4


def _probes(q_grouped: DataFrame) -> bool:
    """Whether the query rows carry several groups each (a ``list<int>`` group column)."""
    return isinstance(q_grouped.schema[C.GROUP].dataType, ArrayType)


def _query_groups(q_grouped: DataFrame, columns: list, join_type: str) -> DataFrame:
    """``columns``, then one row per (query row, group) with its rank ``C.PROBE`` (0 for a query
    of one group; NULL group and rank for one of none, kept by LEFT OUTER only)."""
    if not _probes(q_grouped):
        return q_grouped.select(*columns, C.GROUP, F.lit(0).alias(C.PROBE))
    explode = F.posexplode_outer if join_type == "leftouter" else F.posexplode
    return q_grouped.select(*columns, explode(C.GROUP).alias(C.PROBE, C.GROUP))


def group_counts(q_grouped: DataFrame, t_grouped: DataFrame,
                 join_type: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(target rows per group, query rows per group, query rows that reach no group's cell),
    indexed by group id: one Spark job, one row per group to the driver. A query row in
    several groups counts in each; it reaches no cell when its first group (the one that
    carries its payload) has no target rows, or it has none."""
    t = t_grouped.groupBy(C.GROUP).agg(F.count(F.lit(1)).alias("t"))
    first = F.coalesce(F.col(C.PROBE), F.lit(0)) == 0
    q = (_query_groups(q_grouped, [], join_type).groupBy(C.GROUP)
         .agg(F.count(F.lit(1)).alias("q"), F.count(F.when(first, 1)).alias("c")))
    table = t.join(q, C.GROUP, "full").toArrow()
    known = table.column(C.GROUP).is_valid().to_numpy(zero_copy_only=False)
    ids = table.column(C.GROUP).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)[known]
    t_counts = table.column("t").fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    q_counts = table.column("q").fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    carriers = table.column("c").fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    unmatched = int(carriers[~known | (t_counts == 0)].sum())
    size = int(ids.max()) + 1 if ids.size else 0
    target_counts, query_counts = np.zeros(size, np.int64), np.zeros(size, np.int64)
    target_counts[ids], query_counts[ids] = t_counts[known], q_counts[known]
    return target_counts, query_counts, unmatched


def layout_of(q_grouped: DataFrame, t_grouped: DataFrame, *, target_block_rows: int,
              query_block_rows: int, cores: int, dimension: int, join_type: str) -> KeyedLayout:
    """The cells of a keyed blocked join (:func:`group_counts`, then
    :func:`nearest_join.planner.keyed_layout`). Query rows that reach no group's cell get
    cells of their own under LEFT OUTER, and always when a query row has several groups
    (its payload must reach stage 2 for its other groups' partials)."""
    target_counts, query_counts, unmatched = group_counts(q_grouped, t_grouped, join_type)
    return keyed_layout(target_counts, query_counts, unmatched_queries=unmatched,
                        target_block_rows=target_block_rows, query_block_rows=query_block_rows,
                        cores=cores, dimension=dimension,
                        keep_unmatched=join_type == "leftouter" or _probes(q_grouped))


def _cells_frame(spark, layout: KeyedLayout) -> DataFrame:
    """Group id -> (its bin's first cell, target parts, query parts), a small table."""
    table = pa.table({C.GROUP: pa.array(layout.groups.astype(np.int32)),
                      "base": pa.array(layout.base), "t_parts": pa.array(layout.t_parts),
                      "q_parts": pa.array(layout.q_parts)})
    return spark.createDataFrame(table)


def keyed_blocked_join(q_grouped: DataFrame, t_grouped: DataFrame, layout: KeyedLayout,
                       ctx: JoinContext, out_schema, partial_schema, cores: int) -> DataFrame:
    """The joined rows (positional output names, ``out_schema``) of a keyed blocked join.

    ``q_grouped`` and ``t_grouped`` are the sides' columns (as ``ctx``'s layouts place them)
    followed by ``C.GROUP``: the target's int group id (NULL: none), the query's int group id
    or ``list<int>`` of groups (a query row of no group is kept only by LEFT OUTER, with NULL
    target columns). ``layout`` comes from :func:`layout_of` on the same DataFrames. A query
    row of several groups gets ``ctx.query.block_rows`` rows per stage-2 block.
    """
    spark = q_grouped.sparkSession
    q_columns = [c for c in q_grouped.columns if c != C.GROUP]
    t_columns = [c for c in t_grouped.columns if c != C.GROUP]
    long = "bigint"
    probes = _probes(q_grouped)
    # Each side its own copy of the cells table, and its group id re-aliased: both sides'
    # group ids come from one numbering, which Spark would call an ambiguous self-join.
    group = F.col(C.GROUP).alias(C.GROUP)

    queries = q_grouped.select(*q_columns, C.GROUP, F.monotonically_increasing_id().alias(C.Q_ROW))
    queries = _query_groups(queries, [*q_columns, C.Q_ROW], ctx.join_type)
    # A query's rows without a cell: the one carrying its payload goes to the unmatched
    # cells (LEFT OUTER, or a query of several groups), the others nowhere.
    keep = ctx.join_type == "leftouter" or probes
    queries = queries.join(F.broadcast(_cells_frame(spark, layout)), C.GROUP, "left" if keep else "inner")
    rank = F.coalesce(F.col(C.PROBE), F.lit(0))
    if probes:
        queries = queries.where(F.col("base").isNotNull() | (rank == 0))
    queries = queries.select(
        *q_columns, group, C.Q_ROW, rank.alias(C.PROBE),
        F.coalesce("base", F.lit(layout.unmatched_base).cast(long)).alias("base"),
        F.coalesce("t_parts", F.lit(1).cast(long)).alias("t_parts"),
        F.coalesce("q_parts", F.lit(max(layout.unmatched_parts, 1)).cast(long)).alias("q_parts"))
    # The query part from the row id: every group of a query in one bin in the same part.
    part = F.col("base") + F.pmod(F.xxhash64(C.Q_ROW), F.col("q_parts")) * F.col("t_parts")
    block = F.expr(f"{C.Q_ROW} div {max(int(ctx.query.block_rows), 1)}") if probes else part
    queries = queries.select(
        *q_columns, C.GROUP, C.Q_ROW, C.PROBE, part.alias("part"), block.alias(C.Q_BLOCK_ID),
        F.explode(F.sequence(F.lit(0).cast(long), F.col("t_parts") - 1)).alias(C.T_BLOCK_ID))
    # Only the copy of rank 0 in target part 0 carries the columns; the others the vector.
    carrier = (F.col(C.PROBE) == 0) & (F.col(C.T_BLOCK_ID) == 0)
    payload = [c if i == ctx.query.vector_index else F.when(carrier, F.col(c)).alias(c)
               for i, c in enumerate(q_columns)]
    queries = queries.select(*payload, C.GROUP, C.Q_ROW, C.PROBE, C.Q_BLOCK_ID, C.T_BLOCK_ID,
                             (F.col("part") + F.col(C.T_BLOCK_ID)).alias(C.CELL))

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
    return partials.groupBy(C.Q_BLOCK_ID).applyInArrow(blocks.cells_merge_function(ctx), out_schema)
