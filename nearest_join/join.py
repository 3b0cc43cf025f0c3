"""``nearest_by_join``: Spark's ``nearestByJoin`` contract, computed by blocked kernels.

The driver validates the arguments once into a :class:`~nearest_join.options.JoinOptions`,
plans (:func:`plan_join`: one facts job) and builds a DataFrame; executors do the work in
``udfs`` (packing, the plan loops of ``udfs.blocks``, emission); the numeric core is
``nearest_kernels``. A small join of inputs Spark estimates small runs the same ``udfs``
functions here instead, on both sides collected (the local plan). Only Spark's size estimates
(and so the local plan) reach for a JVM handle; without one (Spark Connect) the plans are the
executors', so the same code runs under classic PySpark and Spark Connect.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import os
import weakref
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DateType,
    FloatType,
    LongType,
    MapType,
    NumericType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from nearest_kernels import seeds_heaps
from udfs import blocks, context, files, packing
from udfs import columns as C
from udfs.context import JoinContext, SearchSettings
from udfs.timing import PHASES, SecondsParam, timed_map
from udfs.warm import WarmUp, start_warm_up, warm_up_seconds, warming

from . import keyed
from .errors import ArgumentError, ArgumentTypeError, NearestByJoinError
from .inputs import positional_inputs
from .options import JoinOptions
from .parquet_scan import file_rows
from .planner import (
    ONE_TASK_BYTES,
    JoinPlan,
    KeyedLayout,
    SideFacts,
    arrow_side_facts,
    cheap_size,
    choose_plan,
    cluster_cores,
    file_side_facts,
    gpu_task_share,
    join_dimension,
    keep_gpu_targets,
    local_limit_bytes,
    parse_bytes,
    side_facts,
    spark_plan,
)
from .ranking import (
    DIRECTIONS,
    JoinKey,
    Ranking,
    column,
    column_index,
    parse_keys,
    parse_ranking,
    quote,
    side_qualifiers,
    vector_itemsize,
)

logger = logging.getLogger(__name__)


def _check_direction(ranking: Ranking, direction: str | None) -> str:
    expected = DIRECTIONS[ranking.metric]
    if direction is not None and direction != expected:
        raise NearestByJoinError("NEAREST_BY_JOIN.DIRECTION_CONTRADICTS_METRIC",
                                 direction=direction, metric=ranking.metric, expected=expected)
    return expected


def _check_inputs(query, target, ranking) -> None:
    if not isinstance(query, DataFrame) or not isinstance(target, DataFrame):
        raise ArgumentTypeError("query, target", f"expected DataFrames, got {type(query).__name__} and "
                                                 f"{type(target).__name__}")
    if not isinstance(ranking, (str, Column)):
        raise ArgumentTypeError("ranking", f"expected a Column or a metric name, got {type(ranking).__name__}")


@functools.lru_cache(maxsize=None)
def _packed_schema(block_id: str, blob: str) -> StructType:
    """The packed blocks of one side, under that side's names (``udfs.packing``'s batches
    carry generic ones: mapInArrow takes a batch's columns by position)."""
    return StructType([StructField(block_id, LongType(), False), StructField(blob, BinaryType(), False)])


_empty_blocks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _empty_target_block(spark) -> DataFrame:
    """The empty target block (one row, computed in the JVM: a DataFrame of Python rows would
    be deserialised by Python tasks, which start a Python worker daemon of their own), built
    once per session: every DataFrame operation costs an analysis in Spark."""
    empty = _empty_blocks.get(spark)
    if empty is None:
        empty = _empty_blocks[spark] = spark.range(1, numPartitions=1).select(
            F.lit(C.EMPTY_BLOCK_ID).cast("long").alias(C.T_BLOCK_ID), F.lit(bytearray()).cast("binary").alias(C.T_BLOB))
    return empty


def _partial_schema() -> StructType:
    return StructType([
        StructField(C.Q_BLOCK_ID, LongType(), False), StructField(C.T_BLOCK_ID, LongType(), False),
        StructField(C.Q_BLOB, BinaryType(), False), StructField(C.PARTIAL, BinaryType(), False),
    ])


@dataclass(frozen=True)
class PlannedJoin:
    """A join whose inputs have been read for facts and whose plan is chosen.

    :func:`plan_join` builds it with the planner's one facts job; :meth:`dataframe` builds the
    join's DataFrame from it without reading the inputs again. ``explain_nearest_join``
    returns its ``plan``; the job runner uses one for the explanation, the summary and the run.
    """

    query: DataFrame
    target: DataFrame
    ranking: object            # what the user passed (a Column or a metric name)
    options: JoinOptions
    plan: JoinPlan
    parsed: Ranking | None     # None: Spark's own nearestByJoin runs the ranking
    direction: str | None
    keys: tuple[JoinKey, ...] | None = None   # on=, resolved against both sides
    layout: KeyedLayout | None = None         # the keyed blocked plan's cells
    ivf: object = None   # mode="approx" running IVF: its nearest_join.ivf.IvfSearch
    # The sides' qualifiers (aliases, table names: ranking.side_qualifiers), kept by the output.
    qualifiers: tuple[str | None, str | None] = (None, None)
    # The executors' seconds per phase (udfs.timing): a Spark accumulator; None under Spark
    # Connect, whose client has no SparkContext.
    timings: object = None
    # The local plan (JoinPlan.plan "local"): both sides as the driver collected them, Arrow tables
    # under positional names (_collect_here).
    collected: tuple | None = None
    # Each side's udfs.files.FileRows where its tasks read it from its Parquet files (None: Spark
    # reads it), from the footers planning read; None when planning did not look (on= keys).
    files: tuple | None = None

    def executor_seconds(self) -> dict[str, float]:
        """Seconds the executors spent in each phase (udfs.timing.PHASES) of this
        join's DataFrames, summed over their tasks and threads and over every evaluation so
        far ({} before the first, and under Spark Connect)."""
        if self.timings is None:
            return {}
        value = self.timings.value
        return {phase: round(value[phase], 3) for phase in PHASES if phase in value}

    def dataframe(self, first_match_column: str | None = None, query_columns=None,
                  target_columns=None) -> DataFrame:
        """The joined rows (lazy: the search runs when the DataFrame is evaluated; under the
        local plan, now, in this process, on the rows collected at planning).

        For the batch jobs, not for Spark's own plan: ``first_match_column``, a last int8
        column of this name, 1 on each query row's best match and 0 on its other rows and on
        a query row without one (the jobs count the queries that matched from it as they
        write); ``query_columns`` / ``target_columns``, the positions of each side's columns
        the output keeps, in their order (default: all; the vector columns left out under
        ``keep_vectors=False``). The executors then never emit the others: a column dropped
        after the join would still cross from Python to the JVM."""
        if self.parsed is None:
            if first_match_column is not None or query_columns is not None or target_columns is not None:
                raise ValueError("first_match_column, query_columns, target_columns: the fast path's plans "
                                 "only, not Spark's own")
            return _spark_fallback(self)
        if not self.options.keep_vectors:
            query_columns = _without(self.query, self.parsed.query_column, query_columns)
            target_columns = _without(self.target, self.parsed.target_column, target_columns)
        return _execute(self, first_match_column,
                        None if query_columns is None else tuple(int(c) for c in query_columns),
                        None if target_columns is None else tuple(int(c) for c in target_columns))

    def arrow_rows(self, query_columns: tuple[int, ...], target_columns: tuple[int, ...]) -> "pa.Table":
        """The local plan's joined rows as an Arrow table in this process, not a DataFrame (the
        incremental join's searches of sides it holds: :func:`plan_join`'s ``arrow``): the
        query's columns at ``query_columns``, the target's at ``target_columns``, then the
        value when the plan has a ``distance_col``, under positional names."""
        from pyspark.sql.pandas.types import to_arrow_schema

        from udfs.local import local_join

        if self.collected is None:
            raise ValueError(f"arrow_rows: the local plan's rows only, this join's plan is {self.plan.plan!r}")
        ctx, out_schema, _, _ = _join_context(self, None, tuple(query_columns), tuple(target_columns))
        rows = local_join(*self.collected, ctx)
        if rows is None:
            return to_arrow_schema(out_schema).empty_table()
        return rows


def _without(df: DataFrame, vector_column: str, kept) -> tuple[int, ...]:
    """The positions of ``kept`` (default: every column of ``df``) less the vector column's."""
    vector = column_index(df, vector_column)
    return tuple(c for c in (range(len(df.columns)) if kept is None else kept) if c != vector)


def plan_join(query: DataFrame, target: DataFrame, ranking, options: JoinOptions, *,
              facts: tuple[SideFacts, SideFacts] | None = None, arrow: tuple | None = None) -> PlannedJoin:
    """Resolve the ranking against both sides, read their facts (one Spark job; the local
    plan's: both sides collected, two) and plan.

    ``facts``: both sides' facts when the caller has counted them already (the incremental
    join counts its inputs on the driver): no facts job then. With ``on=`` keys (exact mode
    only) the target's key groups are then not counted: the plan says so. ``arrow``: both
    sides' rows as Arrow tables in this process already (``query``'s and ``target``'s columns,
    in order, as their ``toArrow`` gives them; the incremental join's refresh): the local plan
    searches them, whatever their size (:meth:`PlannedJoin.arrow_rows`), and no Spark job
    runs; not with ``on=`` keys, IVF or the GPU backend.

    Raises what :func:`nearest_by_join` documents, before any output exists. The plan is
    logged at INFO.
    """
    with contextlib.ExitStack() as stack:   # (the early samples' wait: no job outlives planning)
        return _plan_join(query, target, ranking, options, facts, arrow, stack)


def _plan_join(query: DataFrame, target: DataFrame, ranking, options: JoinOptions, facts, arrow,
               stack: contextlib.ExitStack) -> PlannedJoin:
    early = None
    _check_inputs(query, target, ranking)
    parsed = parse_ranking(ranking, query, target, options.vectors)
    spark = query.sparkSession
    if parsed is None:
        if options.max_distance is not None or options.min_similarity is not None:
            argument = "max_distance" if options.max_distance is not None else "min_similarity"
            raise ArgumentError(argument, f"applies to the vector functions over one column of each "
                                          f"side, got the ranking {ranking}")
        if options.on is not None:
            raise ArgumentError("on", f"applies to the vector functions over one column of each side "
                                      f"(Spark's own nearestByJoin takes no keys), got the ranking {ranking}")
        if not options.keep_vectors:
            raise ArgumentError("keep_vectors", f"expected True with a ranking Spark's own nearestByJoin runs "
                                                f"(select the columns you need from its output: Spark prunes "
                                                f"the rest), got False with the ranking {ranking}")
        planned = PlannedJoin(query, target, ranking, options, spark_plan(spark, ranking, options),
                              None, options.direction)
    else:
        direction = _check_direction(parsed, options.direction)
        options.cap(parsed.metric)   # a cap that does not fit the metric, before any Spark job
        if options.index is not None:   # an index of the other metric family, likewise
            options.index.check_join(parsed.metric, None)
        q_item = vector_itemsize(query, parsed.query_column, "query")
        t_item = vector_itemsize(target, parsed.target_column, "target")
        _warm_up_here(spark, parsed, options, _decoded_dtypes(query, parsed.query_column, target,
                                                             parsed.target_column))
        keys = None if options.on is None else tuple(parse_keys(options.on, query, target))
        files = _file_sides(query, target, cluster_cores(spark)) if arrow is None and keys is None else None
        if arrow is not None:
            if keys is not None or options.backend == "gpu" or options.mode != "exact":
                raise ValueError("arrow: the local plan's sides, exact and without on= keys or the GPU backend")
            n_query = len(query.columns)
            collected = (arrow[0].rename_columns([C.output_name(i) for i in range(n_query)]),
                         arrow[1].rename_columns([C.output_name(n_query + j) for j in range(len(target.columns))]))
            sizes, limit = (None, None), None
        else:
            # Spark's estimates of both sides, once: the local plan's bound and the one-task rule's.
            sizes, limit = (cheap_size(query), cheap_size(target)), local_limit_bytes(spark)
            collected = None if facts is not None else _collect_here(query, target, options, keys, sizes, limit,
                                                                     files)
        if collected is None:
            # The workers start while the facts job runs, and this process plans and builds
            # the search (the local plan runs no Python worker).
            start_python_workers(spark)
        if collected is not None:   # the facts of the collected sides
            q_facts = arrow_side_facts(collected[0], column_index(query, parsed.query_column))
            t_facts = arrow_side_facts(collected[1], column_index(target, parsed.target_column))
            key_facts = None
        elif facts is not None:
            if keys is not None and options.mode != "exact":
                raise ValueError("facts with on= keys: exact mode only (an approx plan sizes its lists by the "
                                 "largest key group)")
            (q_facts, t_facts), key_facts = facts, None
        elif keys is None:
            if options.mode == "approx":
                from .ivf import EarlySamples

                # The IVF plan's samples beside the facts job, where the rows are known without it.
                early = EarlySamples.start(query, target, parsed, options, files)
                if early is not None:
                    stack.callback(early.wait)
            counted = _file_facts(files, query, parsed.query_column, target, parsed.target_column)
            q_facts, t_facts = counted or side_facts(query, parsed.query_column, target, parsed.target_column)
            key_facts = None
        else:
            q_facts, t_facts, key_facts = side_facts(
                query, parsed.query_column, target, parsed.target_column,
                target_keys=[column(target, k.target_column).cast(k.common) for k in keys])
        plan = choose_plan(
            spark=spark, ranking=parsed, options=options,
            dimension=join_dimension(parsed, q_facts, t_facts), itemsize=max(q_item, t_item),
            query_rows=q_facts.rows, target_rows=t_facts.rows,
            query_input_partitions=q_facts.partitions, keys=keys, key_facts=key_facts,
            inputs_cheap=all(size is not None and size <= ONE_TASK_BYTES for size in sizes),
            query_payload=q_facts.payload, target_payload=t_facts.payload)
        if collected is not None and not plan.one_task and arrow is None:
            # Small inputs, but too much work for one task: the plans that spread it, on the
            # input's own partitions, with the Python workers they run.
            start_python_workers(spark)
            q_facts = dataclasses.replace(q_facts, partitions=_partitions(query))
            plan = choose_plan(
                spark=spark, ranking=parsed, options=options,
                dimension=plan.dimension, itemsize=max(q_item, t_item), query_rows=q_facts.rows,
                target_rows=t_facts.rows, query_input_partitions=q_facts.partitions,
                query_payload=q_facts.payload, target_payload=t_facts.payload)
            collected = None
        elif arrow is not None:
            plan = dataclasses.replace(plan, plan="local", reason=(
                "both sides' rows given in the driver: searched there, no Spark task"))
        elif collected is not None:
            plan = dataclasses.replace(plan, plan="local", reason=(
                f"both sides estimated {sum(sizes)} B <= local limit {limit} B and a join "
                "small enough for one task: collected and searched in the driver, no Spark task"))
        if options.index is not None:   # its dimension, known from the facts job, before any other job
            options.index.check_join(parsed.metric, plan.dimension)
        if plan.plan == "blocked":
            _warm_up_here(spark, parsed, options, _decoded_dtypes(query, parsed.query_column, target,
                                                                 parsed.target_column), ("blocked",))
        layout = None
        if keys is not None and plan.plan == "blocked" and not plan.queries_broadcast:
            # The cells need the groups' sizes: a second small job (one row per group).
            layout = keyed.layout_of(*positional_inputs(query, target, keys), target_block_rows=plan.target_block_rows,
                                     query_block_rows=plan.query_block_rows, cores=plan.cores,
                                     dimension=max(plan.dimension or 1, 1), join_type=plan.join_type)
            plan = dataclasses.replace(plan, key_cells=layout.summary())
        planned = PlannedJoin(query, target, ranking, options, plan, parsed, direction, keys, layout,
                              qualifiers=side_qualifiers(query, target, parsed), timings=_timings(spark),
                              collected=collected, files=files)
    if options.mode == "approx" and planned.parsed is not None:
        from .ivf import plan_approx

        planned = plan_approx(planned, early)
    logger.info("%s", planned.plan)
    return planned


def _file_sides(query: DataFrame, target: DataFrame, shares: int) -> tuple:
    """Each side's ``udfs.files.FileRows`` under its positional names (``positional_inputs``'),
    in ``shares`` shares until the plan says how many; None for a side Spark reads."""
    n_query = len(query.columns)
    return (file_rows(query, [C.output_name(i) for i in range(n_query)], shares),
            file_rows(target, [C.output_name(n_query + j) for j in range(len(target.columns))], shares))


def _file_facts(files, query: DataFrame, q_name: str, target: DataFrame, t_name: str) -> tuple | None:
    """Both sides' facts counted from their files (``planner.file_side_facts``) when both are
    read from them: no facts job. None otherwise, or where pyarrow cannot read a file (Spark's
    facts job then reads it, and reports what it finds)."""
    if files is None or None in files:
        return None
    import pyarrow as pa

    try:
        return tuple(file_side_facts(side, column_index(df, name), side.tasks)
                     for side, df, name in zip(files, (query, target), (q_name, t_name)))
    except (pa.ArrowException, OSError) as error:
        logger.info("counting the sides' facts in Spark: pyarrow cannot read their files (%s)", error)
        return None


def _collect_here(query: DataFrame, target: DataFrame, options: JoinOptions, keys,
                  sizes: tuple[int | None, int | None], limit: int, files=None) -> tuple | None:
    """Both sides as Arrow tables in this process (positional names, each in its partitions'
    order, as the one-task plan reads them: the same ties; read from their Parquet files where
    both are, ``files`` as :func:`_file_sides` gives them, with no Spark job, in the files'
    order, as the one-task plan reads them then), for the local plan; None when the
    join is not one for it: ``on=`` keys, IVF forced (``index``, ``nlist``, ``nprobe``; approx
    without them runs exact at any size the local plan takes: ``nearest_join.ivf``), the GPU
    asked for, a streaming input, a column type outside :func:`_collectable`, or inputs that
    Spark cannot estimate or that it estimates (``sizes``: :func:`nearest_join.planner.cheap_size`,
    which also refuses a plan running Python) above ``limit`` (``local_limit_bytes``) together.
    Whether the join itself is small enough is the planner's one-task rule, on the collected
    facts."""
    forced_ivf = any(getattr(options, name) is not None for name in ("index", "nlist", "nprobe"))
    if keys is not None or forced_ivf or options.backend == "gpu":
        return None
    if limit <= 0 or not all(_collectable(f.dataType) for f in query.schema.fields + target.schema.fields):
        return None
    if None in sizes or sum(sizes) > limit or query.isStreaming or target.isStreaming:
        return None
    if files is not None and None not in files:
        import pyarrow as pa

        try:
            return tuple(side.table() for side in files)
        except (pa.ArrowException, OSError) as error:   # Spark's collect reads it, and reports it
            logger.info("collecting the sides through Spark: pyarrow cannot read their files (%s)", error)
    q_input, t_input = positional_inputs(query, target, None)
    # Both collects at once: each small job is mostly Spark's latency, not work.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nj-collect") as pool:
        t_table = pool.submit(t_input.toArrow)
        q_table = q_input.toArrow()
        return q_table, t_table.result()


def _collectable(data_type) -> bool:
    """Types that cross to Arrow and back as the executors' rows do: numbers, strings, binary,
    booleans, dates, timestamps, and arrays, maps and structs (of unique field names) of them;
    not a user-defined type (ML vectors), a variant, an interval or a time."""
    if isinstance(data_type, ArrayType):
        return _collectable(data_type.elementType)
    if isinstance(data_type, MapType):
        return _collectable(data_type.keyType) and _collectable(data_type.valueType)
    if isinstance(data_type, StructType):
        names = [f.name for f in data_type.fields]
        return len(set(names)) == len(names) and all(_collectable(f.dataType) for f in data_type.fields)
    return isinstance(data_type, (NumericType, StringType, BinaryType, BooleanType, DateType, TimestampType,
                                  TimestampNTZType))


def _partitions(df: DataFrame) -> int:
    """``df``'s partitions, from its physical plan (classic Spark; no job)."""
    return int(df._jdf.rdd().getNumPartitions())


def explain_nearest_join(query: DataFrame, target: DataFrame, ranking, *args, **kwargs) -> JoinPlan:
    """The plan :func:`nearest_by_join` would take for these arguments, without running it.

    Takes :func:`nearest_by_join`'s arguments (its signature, shown by ``help``, is this
    function's) and raises its errors. Runs only the one small job the planner needs (row
    counts, partitions, vector lengths), or, for the local plan, the two that collect both
    sides (the facts are read from them; the search does not run); an approx plan that runs
    IVF also trains its lists (unless ``index`` is given) and estimates its recall (a sample
    job and a scan of the target for the sampled queries' exact neighbours; with ``on=`` keys,
    first a scan of the target counting its (key, list) pairs). ``print(plan)`` says, among
    the rest, what ``precision="auto"`` will run.
    """
    bound = inspect.signature(nearest_by_join).bind(query, target, ranking, *args, **kwargs)
    bound.apply_defaults()
    _check_inputs(query, target, ranking)
    options = JoinOptions.from_arguments(bound.arguments)
    return plan_join(query, target, ranking, options).plan


def nearest_by_join(query: DataFrame, target: DataFrame, ranking, num_results: int = 1,
                    mode: str = "exact", direction: str | None = None, *, vectors=None,
                    join_type: str = "inner", distance_col: str | None = None,
                    keep_vectors: bool = True, backend: str = "auto", precision: str = "auto",
                    broadcast_limit_bytes: int | None = None,
                    query_block_rows: int | None = None,
                    target_block_rows: int | None = None,
                    max_distance: float | None = None,
                    min_similarity: float | None = None, on=None,
                    recall: float | None = None, nlist: int | None = None,
                    nprobe: int | None = None, seed: int | None = None, index=None) -> DataFrame:
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
        ``approx``: the IVF plan (:mod:`nearest_join.ivf`): the target is grouped into
        ``nlist`` lists around k-means centroids of a sample, each query searches the
        ``nprobe`` lists nearest to it, exactly; the values returned are exact for the rows
        returned, only the candidate set is approximate. With ``on=`` keys, one index over
        the whole target and each query probes the ``nprobe`` nearest lists among those its
        key's targets occupy (small keys are searched whole). Below a size where IVF cannot
        win, or for a target too large to broadcast, it runs the exact plan; the plan says
        which and why (``explain_nearest_join``).
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
    keep_vectors : bool, keyword-only
        False: the output leaves out the two vector columns the ranking reads (every other
        column stays). Spark cannot prune a column from this join's output once it is
        built: a vector column dropped after the join has still crossed from the Python
        workers to the JVM, row by row, for every one of the k rows per query. Drop other
        columns from the inputs before the join as usual. Only with a vector-function or
        metric-name ranking.
    backend : {"auto", "cpu", "gpu", "reference"}, keyword-only
        Kernel backend on the executors; ``auto`` takes the task's GPU when it has one.
    precision : {"auto", "fp32", "tf32", "bf16"}, keyword-only
        GPU arithmetic; results stay exact in every precision (candidates are re-ranked).
        ``auto`` (the default) is resolved by each executor for its device: bf16 on a GPU of
        compute capability 8.0 or more, fp32 on older GPUs. CPU executors search in float32
        and re-rank in float64 whatever the precision.
    broadcast_limit_bytes, query_block_rows, target_block_rows : int, keyword-only
        Override the planner (see :mod:`nearest_join.planner`).
    max_distance : float, keyword-only
        With ``l2`` or ``sqeuclidean`` (for sqeuclidean a squared distance), >= 0: only
        targets at most this far match (inclusive, ``<=``, as Sedona's ``max_distance``).
    min_similarity : float, keyword-only
        With ``cosine`` or ``inner_product``: only targets at least this similar match
        (inclusive, ``>=``). Under either cap a query may get fewer than ``num_results``
        rows; INNER drops a query with none, LEFT OUTER keeps it once with NULL target
        columns. The cap prunes inside the kernels (CPU and GPU) from their first pass;
        it is not a filter afterwards.
    on : str, list or Column, keyword-only
        Equality keys: for each query row, the nearest target rows *whose keys are equal*. A
        column name present on both sides, a list of them, a list of ``(query_column,
        target_column)`` pairs, or a Column equality between one query and one target column
        (``q.country == t.country``, or ``&`` of such equalities; each column's side is
        found by Spark's analyzer). SQL equality: both sides are cast to the common type
        Spark's ``=`` would use, and a NULL key matches nothing, so a query with a NULL key
        or a key absent from the target has no candidate. In the blocked plan both sides are
        partitioned by key group: small groups batched, a group larger than a target block
        (a skewed key) split into parts whose partial top-k are merged (:mod:`nearest_join.keyed`);
        its cut is planned from the groups' sizes, so both inputs must read the same rows at
        planning and at the run (cache a source that may change between the two).
    recall : float in (0, 1], keyword-only
        ``mode="approx"``: the recall@k to reach (default 0.95). The planner estimates recall
        on a sample of the queries against their exact search and probes the fewest lists
        whose estimate's lower 95% bound meets it; the estimate and its interval are in the
        plan. ``recall``, ``nlist``, ``nprobe``, ``seed`` and ``index`` are errors in exact
        mode (a forgotten ``mode="approx"``).
    nlist, nprobe : int, keyword-only
        ``mode="approx"``: lists of the index (default about sqrt(q t / (q + t)) for q query
        and t target rows: what routing costs and what it saves balance) and lists
        probed per query (default: chosen by ``recall``); ``nprobe == nlist`` searches
        every list (the exact result). Either forces the IVF plan at any size.
    seed : int, keyword-only
        ``mode="approx"``: seeds the samples and k-means (default 0); the same input and seed
        give the same lists and rows.
    index : IVFIndex, keyword-only
        ``mode="approx"``: lists built before (:func:`nearest_join.build_ivf_index`,
        ``IVFIndex.load``) instead of training them in this call; of the join's metric
        family and dimension.

    Returns
    -------
    DataFrame
        All query columns, then all target columns (original order and names, duplicates
        allowed; the vector columns left out with ``keep_vectors=False``), then
        ``distance_col`` if given; up to ``num_results`` rows per query row.
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
        with itself), whose query column cannot be told from its target column; a cap that
        does not fit the metric (``max_distance`` with a similarity, ``min_similarity``
        with a distance), is negative (``max_distance``) or not finite, or comes with a
        ranking Spark's own ``nearestByJoin`` runs; an ``on`` of another shape, naming a
        missing column, of a type Spark cannot compare for equality (a map), or with a ranking
        Spark's own ``nearestByJoin`` runs.
    TypeError
        A vector column of another type (the message names the column and its type), or an
        argument of the wrong type.

    Every error about an argument carries ``argument``, the name of the keyword argument
    to change (:mod:`nearest_join.errors`).

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
    _check_inputs(query, target, ranking)
    options = JoinOptions.from_arguments(locals())
    return plan_join(query, target, ranking, options).dataframe()


explain_nearest_join.__signature__ = inspect.signature(nearest_by_join).replace(return_annotation=JoinPlan)


def _spark_fallback(planned: PlannedJoin) -> DataFrame:
    plan, ranking = planned.plan, planned.ranking
    logger.warning("nearest_by_join: %s", plan.reason)
    if planned.direction is None:
        raise ArgumentError("direction", "required ('distance' or 'similarity') when the ranking is "
                                         "not one of the vector functions, got None")
    out = planned.query.nearestByJoin(planned.target, ranking, plan.k, plan.mode, planned.direction,
                                      joinType=plan.join_type)
    if plan.distance_col:
        out = out.withColumn(plan.distance_col, ranking.cast("float"))
    return out


def _search_settings(spark, ranking: Ranking, options: JoinOptions, plan: JoinPlan,
                     itemsizes: tuple[int, int] = (4, 4)) -> SearchSettings:
    """The executors' search settings: the options the kernels need, as plain values (the
    backend is the plan's), and the shape of the plan's full block pair, which a GPU
    executor compiles before its first block (``itemsizes``: bytes per query and target
    element, as the executors decode them: float32 or float64)."""
    warm = None
    if plan.dimension and plan.query_rows and plan.target_rows:
        warm = (min(plan.query_block_rows, plan.query_rows), min(plan.target_block_rows, plan.target_rows),
                plan.dimension, *("float32" if size == 4 else "float64" for size in itemsizes))
    return SearchSettings(k=options.k, metric=ranking.metric, backend=plan.backend,
                          precision=options.precision, keep_targets=keep_gpu_targets(spark),
                          gpu_share=gpu_task_share(spark), warm_shape=warm)


def _join_context(planned: PlannedJoin, first_match_column: str | None,
                  query_columns: tuple[int, ...] | None,
                  target_columns: tuple[int, ...] | None) -> tuple[JoinContext, StructType, list[str], int]:
    """What the executors' functions take (the context, its layouts without group ids), the
    schema of their rows (positional names), the output's names and the query's columns among
    them."""
    from pyspark.sql.pandas.types import to_arrow_schema

    query, target, ranking, plan = planned.query, planned.target, planned.parsed, planned.plan
    spark = query.sparkSession
    q_name, t_name = ranking.query_column, ranking.target_column
    settings = _search_settings(spark, ranking, planned.options, plan,
                                (vector_itemsize(query, q_name, "query"), vector_itemsize(target, t_name, "target")))
    q_layout = context.SideLayout(q_name, column_index(query, q_name), plan.dimension,
                                 plan.query_block_rows, expected_from=f"target column {quote(t_name)}")
    t_layout = context.SideLayout(t_name, column_index(target, t_name), plan.dimension,
                                 plan.target_block_rows, expected_from=f"query column {quote(q_name)}")
    q_fields, t_fields = query.schema.fields, target.schema.fields
    q_kept = range(len(q_fields)) if query_columns is None else query_columns
    t_kept = range(len(t_fields)) if target_columns is None else target_columns
    out_fields = [q_fields[c] for c in q_kept] + [
        StructField(t_fields[c].name, t_fields[c].dataType, True if plan.join_type == "leftouter" else t_fields[c].nullable)
        for c in t_kept]
    if plan.distance_col:
        out_fields.append(StructField(plan.distance_col, FloatType(), True))
    if first_match_column is not None:
        out_fields.append(StructField(first_match_column, ByteType(), False))
    out_schema = StructType([StructField(C.output_name(i), f.dataType, f.nullable)
                             for i, f in enumerate(out_fields)])
    names = [f.name for f in out_fields]

    timezone = spark.conf.get("spark.sql.session.timeZone", "UTC")
    target_arrow = to_arrow_schema(StructType([
        StructField(C.output_name(len(q_fields) + j), f.dataType, f.nullable, f.metadata)
        for j, f in enumerate(t_fields)]), timezone=timezone)

    ctx = JoinContext(settings, q_layout, t_layout, plan.join_type, plan.distance_col is not None,
                      target_arrow, cap=plan.cap, mark_first=first_match_column is not None,
                      query_columns=query_columns, target_columns=target_columns, timings=planned.timings)
    return ctx, out_schema, names, len(q_kept)


def _execute(planned: PlannedJoin, first_match_column: str | None = None,
             query_columns: tuple[int, ...] | None = None,
             target_columns: tuple[int, ...] | None = None) -> DataFrame:
    query, target, ranking, plan = planned.query, planned.target, planned.parsed, planned.plan
    spark = query.sparkSession
    q_name, t_name = ranking.query_column, ranking.target_column
    ctx, out_schema, names, n_query = _join_context(planned, first_match_column, query_columns, target_columns)
    q_layout, t_layout = ctx.query, ctx.target
    if planned.collected is not None:   # the local plan (no keys, no IVF lists)
        return _output(_searched_here(planned, ctx, out_schema, n_query), names, planned, n_query)
    q_input, t_input = positional_inputs(query, target, planned.keys)
    if planned.keys is not None:
        # The group id is each side's last column; the executors drop it from the blocks'
        # rows before they search or emit them.
        q_layout = dataclasses.replace(q_layout, group_index=len(query.columns))
        t_layout = dataclasses.replace(t_layout, group_index=len(target.columns))
    q_pack = t_pack = packing.pack_blocks
    if planned.ivf is not None:
        # The IVF lists take the place of the keyed plan's group ids: a target row's list,
        # a query row's probed lists, as each side's last column, routed as the rows are
        # packed (nearest_join.ivf).
        q_pack, t_pack = planned.ivf.packers()
        if plan.plan == "blocked":   # the keyed blocked plan's grouped inputs (nearest_join.keyed)
            q_input, t_input = planned.ivf.listed(q_input, t_input, q_layout, t_layout)
        q_layout = dataclasses.replace(q_layout, group_index=len(query.columns))
        t_layout = dataclasses.replace(t_layout, group_index=len(target.columns))
    ctx = dataclasses.replace(ctx, query=q_layout, target=t_layout)

    if plan.plan == "blocked" and planned.layout is not None:   # on= keys or IVF lists
        joined = keyed.keyed_blocked_join(q_input, t_input, planned.layout, ctx, out_schema,
                                          _partial_schema(), plan.cores)
        return _output(joined, names, planned, n_query)
    # A side that is a plain scan of local Parquet files has its rows read from them in its
    # tasks (udfs.files), not handed over by Spark: a range of task ids takes its place.
    q_files = t_files = None
    if planned.files is not None:   # (planning looks wherever there are no on= keys)
        # As many tasks as cores, or as Spark's file splits of the side's vectors would make;
        # one for a join in one task (all the rows in the files' order, as the local plan's).
        split = parse_bytes(spark.conf.get("spark.sql.files.maxPartitionBytes", "128m"))

        def shares(rows: int | None) -> int:
            return max(plan.cores, math.ceil((rows or 0) * max(plan.dimension or 1, 1) * 4 / split))

        tasks = (1, 1) if plan.one_task else (plan.query_partitions or shares(plan.query_rows),
                                              shares(plan.target_rows))
        q_files, t_files = planned.files
        q_files = q_files and dataclasses.replace(q_files, tasks=tasks[0])
        t_files = t_files and dataclasses.replace(t_files, tasks=tasks[1])
    if plan.one_task:
        q_input = q_input.coalesce(1)
    elif plan.plan == "broadcast" and plan.query_partitions:
        # Round-robin rows (not blocks) over the tasks: equal rows per task whatever the
        # input partitioning. Blocks get slack for the +-1 row imbalance: one block per task.
        q_input = q_input.repartition(plan.query_partitions)
        q_layout = dataclasses.replace(q_layout, block_rows=min(C.MAX_BLOCK_ROWS, q_layout.block_rows + plan.query_partitions))
    q_pack = functools.partial(q_pack, layout=q_layout)
    t_pack = functools.partial(t_pack, layout=t_layout)
    if planned.timings is not None:
        q_pack, t_pack = (functools.partial(timed_map, planned.timings, "pack", pack) for pack in (q_pack, t_pack))
    if not _executors_share_this_machine(spark):
        # The first packing task of each executor process starts compiling the search's
        # kernels (udfs.warm); under a local master this process has (_warm_up_here).
        warm = WarmUp.of(ctx, _decoded_dtypes(query, q_name, target, t_name))
        q_pack, t_pack = warming(q_pack, warm, plan.plan), warming(t_pack, warm, plan.plan)
    # Each side packed by a stage of its own where a plan pairs its blocks (built only there:
    # every DataFrame operation costs an analysis in Spark).
    def q_packed() -> DataFrame:
        if q_files is not None:
            return _file_tasks(spark, q_files).mapInArrow(
                functools.partial(files.read_then, function=q_pack, source=q_files),
                _packed_schema(C.Q_BLOCK_ID, C.Q_BLOB))
        return q_input.mapInArrow(q_pack, _packed_schema(C.Q_BLOCK_ID, C.Q_BLOB))

    def t_packed() -> DataFrame:
        # The empty target block comes first: the broadcast plan's query blocks travel with it.
        if t_files is not None:
            t_blocks = _file_tasks(spark, t_files).mapInArrow(
                functools.partial(files.read_then, function=t_pack, source=t_files),
                _packed_schema(C.T_BLOCK_ID, C.T_BLOB))
        else:
            t_blocks = (t_input.coalesce(1) if plan.one_task else t_input).mapInArrow(
                t_pack, _packed_schema(C.T_BLOCK_ID, C.T_BLOB))
        return _empty_target_block(spark).unionByName(t_blocks)

    if plan.plan == "broadcast":
        if plan.one_task:
            # A small join in one task: the target is packed there too, in one partition with
            # the empty block, and the cartesian product streams each query block against its
            # rows (the hint forbids a broadcast, a job of its own). That partition's order is
            # not the union's: every pair carries its query block's rows (a few target blocks:
            # a few copies).
            pairs = q_packed().hint("shuffle_replicate_nl").crossJoin(t_packed().coalesce(1))
            joined = pairs.mapInArrow(functools.partial(blocks.search_broadcast, ctx=ctx), out_schema)
        else:
            # The query's rows stream into the search as they are (packed into blocks there),
            # each task's first row carrying the broadcast target blocks, in the broadcast's
            # order: the empty block first.
            streamed = q_input if q_files is None else _file_tasks(spark, q_files)
            search = functools.partial(blocks.search_streamed_queries, ctx=ctx, pack=q_pack,
                                       width=len(streamed.columns), source=q_files)
            joined = _first_row_meets(streamed, t_packed()).mapInArrow(search, out_schema)
    elif plan.plan == "blocked":
        if plan.queries_broadcast:
            # The target's rows stream into the search as they are, each task's first row
            # carrying the (broadcast) query blocks; the empty target block's partials, which
            # carry each query block's rows to the merge, are a small task of their own.
            streamed = t_input if t_files is None else _file_tasks(spark, t_files)
            search = functools.partial(blocks.search_streamed_targets, ctx=ctx, pack=t_pack,
                                       width=len(streamed.columns), queries=plan.query_rows != 0, source=t_files)
            queries = q_packed()
            empty = _empty_target_block(spark).crossJoin(F.broadcast(queries)).select(
                C.Q_BLOCK_ID, C.Q_BLOB, C.T_BLOCK_ID, C.T_BLOB)
            partials = _first_row_meets(streamed, queries).mapInArrow(search, _partial_schema()).unionByName(
                empty.mapInArrow(functools.partial(blocks.search_pairs, ctx=ctx), _partial_schema()))
        else:
            # The exchanges materialise the packed blocks once (shuffle files), so the cartesian
            # product reads the same blocks for every pair; the hint forbids a broadcast.
            q_side = q_packed().repartition(plan.query_partitions)
            t_side = t_packed().repartition(plan.target_partitions)
            pairs = q_side.hint("shuffle_replicate_nl").crossJoin(t_side)
            partials = pairs.mapInArrow(functools.partial(blocks.search_pairs, ctx=ctx), _partial_schema())
        joined = partials.groupBy(C.Q_BLOCK_ID).applyInArrow(_merge_function(ctx), out_schema)
    else:  # pragma: no cover - the planner only returns the plans above here
        raise AssertionError(plan.plan)
    return _output(joined, names, planned, n_query)


def _file_tasks(spark, source) -> DataFrame:
    """One row per task of a side read from its files (``udfs.files.FileRows``): its id, in a
    partition of its own."""
    return spark.range(source.tasks, numPartitions=source.tasks)


def _first_row_meets(streamed: DataFrame, broadcast: DataFrame) -> DataFrame:
    """``streamed``'s rows, each task's first row joined to every row of ``broadcast`` (its
    packed blocks), the others to none (NULLs), in the streamed partitions' order: a side's
    rows reach the search once, as they are, with the blocks of the broadcast side once per
    task (``udfs.blocks.streamed_blocks``). A task's first row is the one whose
    ``monotonically_increasing_id`` has a row number of 0 (its lower 33 bits), computed above
    a coalesce that keeps the partitions as they are: over a local relation the optimizer
    would otherwise evaluate it once, as one partition, before the relation is split into
    tasks (the search fails a task whose first row met no block)."""
    first = (F.monotonically_increasing_id().bitwiseAND((1 << 33) - 1) == 0).alias(C.FIRST_ROW)
    return (streamed.coalesce(1 << 30).select("*", first)
            .join(F.broadcast(broadcast), F.col(C.FIRST_ROW), "left").drop(C.FIRST_ROW))


def _searched_here(planned: PlannedJoin, ctx: JoinContext, out_schema: StructType, n_query: int) -> DataFrame:
    """The local plan's rows: the executors' functions run in this process on the collected
    sides (``udfs.local``), as the one-task plan's task would run them. The first ``n_query``
    columns of ``out_schema`` are the query's.

    The rows go to Spark as a local relation of one row per query row that has output, its
    rows' other columns in an array of structs, which Spark's ``inline`` unnests: each query
    row's columns (its vector, say) cross to the JVM once, not once per match."""
    import numpy as np
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    from udfs.local import local_join

    q_table, t_table = planned.collected
    width = q_table.num_columns
    kept = list(range(width)) if ctx.query_columns is None else list(ctx.query_columns)
    # The output's only query column is the row's query row; each query row's own columns are
    # taken once, below, not gathered for each of its matches.
    rows = local_join(q_table.append_column(C.Q_ROW, pa.array(np.arange(q_table.num_rows, dtype=np.int64))),
                      t_table, dataclasses.replace(ctx, query_columns=(width,)))
    fields = out_schema.fields
    matches = StructType(fields[n_query:])
    schema = StructType(fields[:n_query] + [StructField(C.MATCHES, ArrayType(matches, False), False)])
    if rows is None or rows.num_rows == 0:
        table = to_arrow_schema(schema, timezone=planned.query.sparkSession.conf.get(
            "spark.sql.session.timeZone", "UTC")).empty_table()
    else:
        rows = rows.combine_chunks()
        row_ids = rows.column(0).to_numpy()
        firsts = np.flatnonzero(np.r_[True, row_ids[1:] != row_ids[:-1]])
        inner = pa.StructArray.from_arrays([rows.column(i).chunk(0) for i in range(1, rows.num_columns)],
                                           names=matches.names)
        nested = pa.ListArray.from_arrays(pa.array(np.r_[firsts, rows.num_rows], pa.int32()), inner)
        taken = q_table.select(kept).take(row_ids[firsts]).columns   # (a table of no column keeps no row)
        table = pa.Table.from_arrays([*taken, nested], names=[f.name for f in fields[:n_query]] + [C.MATCHES])
    joined = planned.query.sparkSession.createDataFrame(table, schema=schema)
    return joined.select(*[F.col(f.name) for f in fields[:n_query]], F.inline(C.MATCHES))


def _output(joined: DataFrame, names: list[str], planned: PlannedJoin, n_query: int) -> DataFrame:
    """The executors' rows under the output's names and each side's qualifier, as Spark's own
    join keeps them (``a.id`` and ``b.id`` after a self-join through ``S.alias("a")`` and
    ``S.alias("b")``).

    The rows come out of ``mapInArrow`` as a new relation, which carries no qualifier. The
    query's columns get the query's alias; the target's (and ``distance_col``) are packed in
    a struct and unpacked by a lateral ``inline`` under the target's alias, the one cheap
    way to give some columns another qualifier: Spark plans it as a Generate over the same
    rows, no join and no exchange. The columns of the inputs' own DataFrames (``q.id``) do
    not resolve on the output, whose rows are new attributes: names do. The first ``n_query``
    columns are the query's.
    """
    q_alias, t_alias = planned.qualifiers
    if q_alias is None and t_alias is None:
        return joined.toDF(*names)
    if q_alias == t_alias:   # one qualifier for every column: no generator needed
        return joined.toDF(*names).alias(q_alias)
    internal = joined.columns
    target_struct = F.struct(*[F.col(c).alias(n) for c, n in zip(internal[n_query:], names[n_query:])])
    left = joined.select(*[F.col(c).alias(n) for c, n in zip(internal[:n_query], names[:n_query])],
                         target_struct.alias(C.TARGET_STRUCT))
    right = planned.query.sparkSession.tvf.inline(F.array(F.col(C.TARGET_STRUCT).outer()))
    if q_alias is not None:
        left = left.alias(q_alias)
    if t_alias is not None:
        right = right.alias(t_alias)
    return left.lateralJoin(right).drop(C.TARGET_STRUCT)


def _decoded_dtypes(query: DataFrame, q_name: str, target: DataFrame, t_name: str) -> tuple[str, str]:
    """The element types the executors decode each side's vectors to."""
    return tuple("float32" if vector_itemsize(df, name, side) == 4 else "float64"
                 for df, name, side in ((query, q_name, "query"), (target, t_name, "target")))


def warm_up_kernels(metric: str, dtypes: tuple[str, str], options: JoinOptions,
                    plans: tuple[str, ...] = ("broadcast",)) -> None:
    """Compile the CPU kernels a join of ``metric`` over vectors decoded as ``dtypes``
    ("float32"/"float64", query then target) with ``options`` runs in ``plans``, on a thread
    of this process, into numba's cache (``udfs.warm``): for executors that share this machine
    (a ``local`` master), whose first search then loads them. The job runner starts it before
    Spark's session; a join under a local master does at planning (once per process). Before
    the plan is known, the broadcast plan's (a local master's usual plan); the blocked plan's
    own kernels once a join plans it, so that a join that never runs it does not compile them
    beside its session start and its facts job."""
    keyed = options.on is not None
    warm = WarmUp(metric, options.backend, tuple(dtypes), keyed=keyed,
                  capped=options.max_distance is not None or options.min_similarity is not None,
                  wide=seeds_heaps(options.num_results))
    start_warm_up(warm, plans)
    if options.mode == "approx" and not keyed:   # the IVF plan searches lists as groups
        start_warm_up(dataclasses.replace(warm, keyed=True), ("broadcast",))


_workers_started: set[str] = set()


def local_task_slots(master: str) -> int | None:
    """Tasks a local master runs at once: ``local`` 1, ``local[N]`` (or ``local[N,F]``) N,
    ``local[*]`` the machine's cores, ``local-cluster[E,C,M]`` E x C; None for another master."""
    import re

    match = re.fullmatch(r"local(?:\[(\d+|\*)(?:,\d+)?\])?|local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]",
                         master)
    if match is None:
        return None
    if match.group(2):
        return int(match.group(2)) * int(match.group(3))
    if match.group(1) is None:
        return 1
    return os.cpu_count() or 1 if match.group(1) == "*" else int(match.group(1))


def start_python_workers(spark) -> None:
    """Under a local master, start the executors' Python workers now, with a job of empty
    tasks on a thread of this process: Spark starts them (its daemon, then one process per
    task) only at a join's first Python stage, a second on the critical path of a session's
    first join. One task per task slot but one, which stays free for the JVM's own jobs (a
    join's facts) meanwhile; the daemon forks the last worker when a stage asks for it. The
    join's stages reuse them. Once per application; not for the local plan, which runs no
    Python worker."""
    import threading

    if not _executors_share_this_machine(spark):
        return
    slots = local_task_slots(spark.conf.get("spark.master", ""))
    app = spark.conf.get("spark.app.id", "")
    if not slots or app in _workers_started:
        return
    _workers_started.add(app)
    tasks = max(1, slots - 1)
    from udfs.warm import started_worker

    def run():
        try:
            spark.range(tasks, numPartitions=tasks).mapInArrow(started_worker, "id long").collect()
        except Exception:   # noqa: BLE001 (an optimisation: a join's own stages start workers anyway)
            logger.debug("starting the Python workers failed", exc_info=True)

    threading.Thread(target=run, daemon=True, name="nj-start-workers").start()


def kernel_warm_up_seconds() -> tuple[float, float]:
    """(seconds, of which compiling) this process's kernel warm-ups spent on kernels; the rest
    is loading them from numba's cache."""
    return warm_up_seconds()


def _warm_up_here(spark, ranking: Ranking, options: JoinOptions, dtypes: tuple[str, str],
                  plans: tuple[str, ...] = ("broadcast",)) -> None:
    """Under a local master the executors' Python workers share this machine and numba's
    cache: :func:`warm_up_kernels` while Spark plans (and :func:`start_python_workers` beside
    the facts job). Spark Connect's client may be elsewhere: it leaves the warm-up to the
    executors (their first packing task starts it)."""
    if _executors_share_this_machine(spark):
        warm_up_kernels(ranking.metric, dtypes, options, plans)


def _timings(spark):
    """A new accumulator of executor seconds per phase (udfs.timing); None under Spark
    Connect."""
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        return None
    return spark.sparkContext.accumulator({}, SecondsParam())


def _executors_share_this_machine(spark) -> bool:
    """A classic session under a local master: its executors' Python workers run on this
    machine, with this process's numba cache."""
    return (not type(spark).__module__.startswith("pyspark.sql.connect")
            and spark.conf.get("spark.master", "").startswith("local"))


def _merge_function(ctx: JoinContext):
    return blocks.merge_function(ctx)
