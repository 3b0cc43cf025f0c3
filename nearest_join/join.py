"""``nearest_by_join``: Spark's ``nearestByJoin`` contract, computed by blocked kernels.

The driver validates, plans and builds a DataFrame; executors do the work in
``udfs.blocks``; the numeric core is ``nearest_join.kernels``. No SparkContext, RDD or JVM
handle is touched, so the same code runs under classic PySpark and Spark Connect.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Iterator, Tuple

import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (ArrayType, BinaryType, DoubleType, FloatType, LongType,
                               StructField, StructType)

from udfs import blocks
from udfs import columns as C
from udfs.searcher import SearchSettings

from .errors import NearestByJoinError
from .planner import (JoinPlan, choose_plan, cluster_cores, task_memory_bytes, broadcast_limit,
                      gpu_task_share, join_dimension, keep_gpu_targets, side_facts)
from .ranking import DIRECTIONS, Ranking, parse_ranking, quote

logger = logging.getLogger(__name__)

MIN_RESULTS, MAX_RESULTS = 1, 100_000
MODES = ("exact", "approx")
BACKENDS = ("auto", "cpu", "gpu", "reference")
PRECISIONS = ("fp32", "tf32", "bf16")


def _normalise_join_type(join_type) -> str:
    # Spark's own normalisation: case-insensitive, underscores ignored ("left_outer" == "leftouter").
    key = str(join_type).lower().replace("_", "")
    if key == "inner":
        return "inner"
    if key in ("left", "leftouter"):
        return "leftouter"
    raise NearestByJoinError("NEAREST_BY_JOIN.UNSUPPORTED_JOIN_TYPE", joinType=join_type)


def _validate_arguments(num_results, mode, direction, join_type, backend, precision):
    """Spark's checks, in Spark's order, raised before any job runs."""
    if isinstance(num_results, bool) or not isinstance(num_results, int):
        raise TypeError(f"num_results: expected an int between {MIN_RESULTS} and {MAX_RESULTS}, "
                        f"got {type(num_results).__name__} {num_results!r}")
    if not MIN_RESULTS <= num_results <= MAX_RESULTS:
        raise NearestByJoinError("NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE",
                                 numResults=num_results, min=MIN_RESULTS, max=MAX_RESULTS)
    if not isinstance(mode, str) or mode.lower() not in MODES:
        raise NearestByJoinError("NEAREST_BY_JOIN.UNSUPPORTED_MODE", mode=mode)
    if direction is not None and (not isinstance(direction, str)
                                  or direction.lower() not in ("distance", "similarity")):
        raise NearestByJoinError("NEAREST_BY_JOIN.UNSUPPORTED_DIRECTION", direction=direction)
    join = _normalise_join_type(join_type)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {list(PRECISIONS)}, got {precision!r}")
    return mode.lower(), (direction.lower() if direction else None), join


def _column_index(df: DataFrame, name: str) -> int:
    positions = [i for i, c in enumerate(df.columns) if c == name]
    if len(positions) != 1:
        raise ValueError(f"column {name!r}: expected exactly one column of that name, found {len(positions)}")
    return positions[0]


def _vector_itemsize(df: DataFrame, name: str, side: str) -> int:
    """Bytes per element of a supported vector column; TypeError naming anything else."""
    field = df.schema.fields[_column_index(df, name)]
    dtype = field.dataType
    if isinstance(dtype, ArrayType) and isinstance(dtype.elementType, FloatType):
        return 4
    if isinstance(dtype, ArrayType) and isinstance(dtype.elementType, DoubleType):
        return 8
    if type(dtype).__name__ == "VectorUDT":
        return 8
    raise TypeError(
        f"{side} column {name!r}: expected array<float>, array<double> or a dense "
        f"pyspark.ml VectorUDT, got {dtype.simpleString()}"
    )


def _check_direction(ranking: Ranking, direction: str | None) -> str:
    expected = DIRECTIONS[ranking.metric]
    if direction is not None and direction != expected:
        raise NearestByJoinError("NEAREST_BY_JOIN.DIRECTION_CONTRADICTS_METRIC",
                                 direction=direction, metric=ranking.metric, expected=expected)
    return expected


@functools.lru_cache(maxsize=None)
def _packed_schema() -> StructType:
    return StructType([StructField(C.BLOCK_ID, LongType(), False), StructField(C.BLOB, BinaryType(), False)])


def _partial_schema() -> StructType:
    return StructType([
        StructField(C.Q_BLOCK_ID, LongType(), False), StructField(C.T_BLOCK_ID, LongType(), False),
        StructField(C.Q_BLOB, BinaryType(), False), StructField(C.PARTIAL, BinaryType(), False),
    ])


def _prepare(query, target, ranking, num_results, mode, direction, vectors, join_type,
             distance_col, backend, precision, broadcast_limit_bytes, query_block_rows,
             target_block_rows):
    if not isinstance(query, DataFrame) or not isinstance(target, DataFrame):
        raise TypeError(f"query, target: expected DataFrames, got {type(query).__name__} and "
                        f"{type(target).__name__}")
    if not isinstance(ranking, (str, Column)):
        raise TypeError(f"ranking: expected a Column or a metric name, got {type(ranking).__name__}")
    mode, direction, join = _validate_arguments(num_results, mode, direction, join_type, backend, precision)
    if distance_col is not None and (not isinstance(distance_col, str) or not distance_col):
        raise ValueError(f"distance_col: expected a non-empty column name, got {distance_col!r}")
    parsed = parse_ranking(ranking, query, target, vectors)
    spark = query.sparkSession
    if parsed is None:
        plan = JoinPlan(
            plan="spark", reason=f"ranking {ranking} is not one of the vector functions over one "
            "column of each side, as Spark's analyzer places its columns: Spark's own "
            "nearestByJoin runs it (correct, slow)",
            metric=None, k=num_results, mode=mode, join_type=join, query_column=None,
            target_column=None, dimension=None, query_rows=None, target_rows=None,
            target_bytes=None, broadcast_limit_bytes=broadcast_limit(spark, broadcast_limit_bytes),
            task_memory_bytes=task_memory_bytes(spark), cores=cluster_cores(spark),
            query_block_rows=None, target_block_rows=None, query_blocks=None, target_blocks=None,
            query_partitions=None, target_partitions=None, backend="spark", distance_col=distance_col)
        return plan, None, direction
    direction = _check_direction(parsed, direction)
    q_item = _vector_itemsize(query, parsed.query_column, "query")
    t_item = _vector_itemsize(target, parsed.target_column, "target")
    q_facts, t_facts = side_facts(query, parsed.query_column, target, parsed.target_column)
    dimension = join_dimension(parsed, q_facts, t_facts)
    plan = choose_plan(
        spark=spark, ranking=parsed, k=num_results, mode=mode, join_type=join,
        distance_col=distance_col, backend=backend, dimension=dimension,
        itemsize=max(q_item, t_item), query_rows=q_facts.rows, target_rows=t_facts.rows,
        query_input_partitions=q_facts.partitions,
        broadcast_limit_bytes=broadcast_limit_bytes, query_block_rows=query_block_rows,
        target_block_rows=target_block_rows)
    if mode == "approx":
        plan.reason += "; approx mode runs the exact plan (a valid approximation)"
    return plan, parsed, direction


def explain_nearest_join(query: DataFrame, target: DataFrame, ranking, num_results: int = 1,
                         mode: str = "exact", direction: str | None = None, *, vectors=None,
                         join_type: str = "inner", distance_col: str | None = None,
                         backend: str = "auto", precision: str = "fp32",
                         broadcast_limit_bytes: int | None = None,
                         query_block_rows: int | None = None,
                         target_block_rows: int | None = None) -> JoinPlan:
    """The plan :func:`nearest_by_join` would take for these arguments, without running it.

    Runs only the one small job the planner needs (row counts, partitions, vector lengths).
    """
    plan, _, _ = _prepare(query, target, ranking, num_results, mode, direction, vectors,
                          join_type, distance_col, backend, precision, broadcast_limit_bytes,
                          query_block_rows, target_block_rows)
    logger.info("%s", plan)
    return plan


def nearest_by_join(query: DataFrame, target: DataFrame, ranking, num_results: int = 1,
                    mode: str = "exact", direction: str | None = None, *, vectors=None,
                    join_type: str = "inner", distance_col: str | None = None,
                    backend: str = "auto", precision: str = "fp32",
                    broadcast_limit_bytes: int | None = None,
                    query_block_rows: int | None = None,
                    target_block_rows: int | None = None) -> DataFrame:
    """For every query row, the ``num_results`` nearest target rows (Spark's ``nearestByJoin``).

    Parameters
    ----------
    query, target : DataFrame
        The query (left) side and the target (right, candidate) side.
    ranking : Column or str
        ``F.vector_l2_distance``, ``F.vector_cosine_similarity`` or ``F.vector_inner_product``
        over one column of each side (either order), or a metric name ``"l2"``,
        ``"sqeuclidean"``, ``"cosine"``, ``"inner_product"`` together with ``vectors``. Any
        other Column is handed to Spark's own ``nearestByJoin`` (correct, slow) with a warning.
    num_results : int
        k, between 1 and 100000.
    mode : {"exact", "approx"}
        ``approx`` currently runs the exact plan.
    direction : {"distance", "similarity"} or None
        Inferred from the metric when None; an error when it contradicts the metric.
    vectors : str or (str, str), keyword-only
        With a metric-name ranking: the vector column (same name on both sides) or
        ``(query_column, target_column)``.
    join_type : {"inner", "leftouter"}, keyword-only
        Spark's spellings ``"left"`` and ``"left_outer"`` are accepted too.
    distance_col : str, keyword-only
        Name of an extra float output column with the ranking value (NULL where LEFT OUTER
        found no candidate).
    backend : {"auto", "cpu", "gpu", "reference"}, keyword-only
        Kernel backend on the executors; ``auto`` takes the task's GPU when it has one.
    precision : {"fp32", "tf32", "bf16"}, keyword-only
        GPU arithmetic; results stay exact (candidates are re-ranked in fp32).
    broadcast_limit_bytes, query_block_rows, target_block_rows : int, keyword-only
        Override the planner (see :mod:`nearest_join.planner`).

    Returns
    -------
    DataFrame
        All query columns, then all target columns (original order and names, duplicates
        allowed), then ``distance_col`` if given; up to ``num_results`` rows per query row.
        Row order is unspecified.

    Raises
    ------
    NearestByJoinError
        Spark's error conditions ``NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE``,
        ``UNSUPPORTED_MODE``, ``UNSUPPORTED_DIRECTION``, ``UNSUPPORTED_JOIN_TYPE``,
        ``VECTOR_DIMENSION_MISMATCH`` (the two sides' vectors differ in length, or one
        side's rows do); raised at call time, before any output.
    ValueError
        A ranking over two different columns that both sides share (a DataFrame joined
        with itself), whose query column cannot be told from its target column.
    TypeError
        A vector column of another type (the message names the column and its type).

    Notes
    -----
    A NULL vector, or one with a NULL element, never matches; for cosine neither does a
    zero vector. INNER drops query rows without candidates; LEFT OUTER keeps them once with
    NULL target columns. Ties go to the target row met first in block order (deterministic
    for a given input partitioning).

    Examples
    --------
    >>> from pyspark.sql import functions as F
    >>> q = spark.createDataFrame([(1, [0.0, 0.0])], "id int, v array<float>")
    >>> t = spark.createDataFrame([("a", [3.0, 4.0]), ("b", [1.0, 0.0])], "name string, w array<float>")
    >>> nearest_by_join(q, t, F.vector_l2_distance(q.v, t.w), 2, distance_col="dist").show()
    +---+----------+----+----------+----+
    | id|         v|name|         w|dist|
    +---+----------+----+----------+----+
    |  1|[0.0, 0.0]|   b|[1.0, 0.0]| 1.0|
    |  1|[0.0, 0.0]|   a|[3.0, 4.0]| 5.0|
    +---+----------+----+----------+----+
    <BLANKLINE>
    """
    plan, parsed, direction = _prepare(query, target, ranking, num_results, mode, direction,
                                       vectors, join_type, distance_col, backend, precision,
                                       broadcast_limit_bytes, query_block_rows, target_block_rows)
    logger.info("%s", plan)
    if parsed is None:
        return _spark_fallback(query, target, ranking, plan, direction)
    return _execute(query, target, parsed, plan, precision)


def _spark_fallback(query, target, ranking, plan: JoinPlan, direction):
    logger.warning("nearest_by_join: %s", plan.reason)
    if direction is None:
        raise ValueError("direction: required ('distance' or 'similarity') when the ranking is "
                         "not one of the vector functions")
    out = query.nearestByJoin(target, ranking, plan.k, plan.mode, direction, joinType=plan.join_type)
    if plan.distance_col:
        out = out.withColumn(plan.distance_col, ranking.cast("float"))
    return out


def _execute(query: DataFrame, target: DataFrame, ranking: Ranking, plan: JoinPlan,
             precision: str) -> DataFrame:
    from pyspark.sql.pandas.types import to_arrow_schema

    spark = query.sparkSession
    q_name, t_name = ranking.query_column, ranking.target_column
    settings = SearchSettings(k=plan.k, metric=ranking.metric, backend=plan.backend, precision=precision,
                              keep_targets=keep_gpu_targets(spark), gpu_share=gpu_task_share(spark))
    q_layout = blocks.SideLayout(q_name, _column_index(query, q_name), plan.dimension,
                                 plan.query_block_rows, expected_from=f"target column {quote(t_name)}")
    t_layout = blocks.SideLayout(t_name, _column_index(target, t_name), plan.dimension,
                                 plan.target_block_rows, expected_from=f"query column {quote(q_name)}")
    out_fields = list(query.schema.fields) + [
        StructField(f.name, f.dataType, True if plan.join_type == "leftouter" else f.nullable)
        for f in target.schema.fields]
    if plan.distance_col:
        out_fields.append(StructField(plan.distance_col, FloatType(), True))
    out_schema = StructType([StructField(C.output_name(i), f.dataType, f.nullable)
                             for i, f in enumerate(out_fields)])
    names = [f.name for f in out_fields]

    # mapInArrow passes its input to the UDF as df[name] for every column name, and Spark
    # parses those (a dot is a field access, a backtick a syntax error): the mapped inputs get
    # plain names, those of the columns' output positions. Only positions matter below.
    n_query = len(query.columns)
    q_input = query.toDF(*[C.output_name(i) for i in range(n_query)])
    t_input = target.toDF(*[C.output_name(n_query + j) for j in range(len(target.columns))])
    timezone = spark.conf.get("spark.sql.session.timeZone", "UTC")
    target_arrow = to_arrow_schema(t_input.schema, timezone=timezone)
    ctx = blocks.JoinContext(settings, q_layout, t_layout, plan.join_type,
                             plan.distance_col is not None, target_arrow)

    packed = _packed_schema()
    if plan.plan == "broadcast" and plan.query_partitions:
        # Round-robin rows (not blocks) over the tasks: equal rows per task whatever the
        # input partitioning. Blocks get slack for the +-1 row imbalance: one block per task.
        q_input = q_input.repartition(plan.query_partitions)
        q_layout = dataclasses.replace(q_layout, block_rows=min(C.MAX_BLOCK_ROWS, q_layout.block_rows + plan.query_partitions))
    q_packed = (q_input.mapInArrow(functools.partial(blocks.pack_blocks, layout=q_layout), packed)
                .withColumnsRenamed({C.BLOCK_ID: C.Q_BLOCK_ID, C.BLOB: C.Q_BLOB}))
    empty = spark.createDataFrame([(C.EMPTY_BLOCK_ID, bytearray())], packed)
    t_packed = (t_input.mapInArrow(functools.partial(blocks.pack_blocks, layout=t_layout), packed)
                .unionByName(empty)
                .withColumnsRenamed({C.BLOCK_ID: C.T_BLOCK_ID, C.BLOB: C.T_BLOB}))
    if plan.plan == "broadcast":
        # The broadcast nested-loop join streams each query block against all target blocks.
        pairs = q_packed.crossJoin(F.broadcast(t_packed))
        joined = pairs.mapInArrow(functools.partial(blocks.search_broadcast, ctx=ctx), out_schema)
    elif plan.plan == "blocked":
        # The exchanges materialise the packed blocks once (shuffle files), so the cartesian
        # product reads the same blocks for every pair; the hint forbids a broadcast.
        q_side = q_packed.repartition(plan.query_partitions)
        t_side = t_packed.repartition(plan.target_partitions)
        pairs = q_side.hint("shuffle_replicate_nl").crossJoin(t_side)
        partials = pairs.mapInArrow(functools.partial(blocks.search_pairs, ctx=ctx), _partial_schema())
        joined = partials.groupBy(C.Q_BLOCK_ID).applyInArrow(_merge_function(ctx), out_schema)
    else:  # pragma: no cover - the planner only returns the plans above here
        raise AssertionError(plan.plan)
    return joined.toDF(*names)


def _merge_function(ctx: blocks.JoinContext):
    # Type hints select Spark's streaming (iterator of batches) grouped-map form.
    def merge(key: Tuple[pa.Scalar, ...], batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return blocks.merge_partials(key, batches, ctx)

    return merge
