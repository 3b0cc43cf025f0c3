"""The incremental nearest join: today's complete result from yesterday's, at the cost of what
changed (:func:`incremental_nearest_join`).

A full exact join costs the same whether 0.1% or 100% of the rows changed. This one keeps a
*state* beside its result: for every query row, a fingerprint of its vector and its
``num_results + margin`` nearest targets with their values (a candidate list), and for every
target row a fingerprint of its vector. The next run compares today's inputs with the state by
their id columns and searches only what the change requires:

* a query whose vector is unchanged keeps its list less the targets deleted or changed since,
  merged with its search of the inserted and changed targets only;
* a new or changed query, and one whose list ran short (more of its neighbours removed than
  the margin covers), is searched against the whole target;
* a deleted query leaves.

Why that is exact. Each list ``L`` carries a *bound* ``b``: every target outside ``L`` ranks
no better than ``b`` (``b`` is the last entry's value when the list is full, +inf when ``L``
holds every target). Removing targets keeps that true. The search of the added targets
returns their best ``num_results + margin`` with a bound of its own; every target of today's
table is then either in the union of the two lists or ranks no better than the lower bound.
The merged list keeps its entries up to that bound (and at most ``num_results + margin``), and
it is complete for the query when it holds at least ``num_results`` entries or its bound is
+inf; otherwise the query is searched whole. The values are those of the exact search (the
same kernels as :func:`nearest_join.nearest_by_join`), so the result equals a full
recompute's, ties aside: among targets of equal value either may be returned.

Values are kept as ranking keys where smaller is better: the distance, or the negated
similarity for ``cosine`` and ``inner_product``.

The state lives in one directory (``state``): ``meta.json`` (what the lists answer: metric,
k, margin, columns, id types, dimension), ``queries/`` and ``targets/`` (Parquet). A run
writes the new state into a hidden staging directory beside it (the searches run then, once),
reads its result from there, and :meth:`IncrementalJoin.commit` makes it the state in one step
(:func:`nearest_join.publish.replace_directory`): a run that fails or is killed before the
commit leaves the previous state as it was, and the next run starts from it again.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType

from .errors import ArgumentError, ArgumentTypeError
from .join import plan_join
from .options import JoinOptions
from .publish import replace_directory, sibling
from .ranking import DIRECTIONS, column, parse_ranking, quote

logger = logging.getLogger(__name__)

STATE_VERSION = 1
META_FILE = "meta.json"
_STAGING = ".nj-state-staging-"

# Internal column names: reserved, so that no input column can clash with them.
_QID, _TID, _QV, _TV = "__nj_qid", "__nj_tid", "__nj_qv", "__nj_tv"
_H1, _H2, _KEY = "__nj_h1", "__nj_h2", "__nj_key"
_OLD_H1, _OLD_H2 = "__nj_old_h1", "__nj_old_h2"
_LIST, _BOUND, _SOURCE, _COMPLETE = "candidates", "bound", "__nj_source", "complete"


def default_margin(num_results: int) -> int:
    """The further candidates a list keeps when ``margin`` is not given: as many as the
    results, at least 10. A query is searched whole again only when more of its list than
    that was deleted or changed."""
    return max(10, num_results)


@dataclass(frozen=True)
class Changes:
    """What a run found and did. ``refreshed`` False: a full run (``reason`` says why)."""

    refreshed: bool
    reason: str
    queries_inserted: int = 0
    queries_deleted: int = 0
    queries_changed: int = 0
    queries_kept: int = 0
    targets_inserted: int = 0
    targets_deleted: int = 0
    targets_changed: int = 0
    queries_searched_whole: int = 0   # new, changed and short-listed queries: against all targets
    queries_short: int = 0            # kept queries whose list ran short
    queries_merged: int = 0           # kept queries whose list met a removed or an entering target
    query_rows: int = 0               # today's rows
    target_rows: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class IncrementalJoin:
    """A run of :func:`incremental_nearest_join`: its ``result`` (a DataFrame), ``changes``
    (:class:`Changes`) and :meth:`commit`, which makes this run's state the one the next run
    starts from."""

    def __init__(self, result: DataFrame, changes: Changes, staging: Path, state: Path | None):
        self.result = result
        self.changes = changes
        self._staging, self._state = staging, state
        self._committed = False

    def commit(self) -> None:
        """Publish this run's state in one step (after the result has been written: a run
        whose result is lost then refreshes from this state, not from yesterday's)."""
        if self._state is None:
            raise RuntimeError(f"this run wrote its state to {self._staging}: its caller publishes it")
        if self._committed:
            raise RuntimeError(f"state {self._state}: this run's state is committed already")
        replace_directory(self._staging, self._state)
        self._committed = True

    def discard(self) -> None:
        """Delete this run's staged state; the previous one stays."""
        if not self._committed and self._state is not None:
            shutil.rmtree(self._staging, ignore_errors=True)


def incremental_nearest_join(query: DataFrame, target: DataFrame, ranking, num_results: int = 1, *,
                             query_id: str, target_id: str, state, new_state=None, margin: int | None = None,
                             vectors=None, join_type: str = "inner", distance_col: str | None = None,
                             backend: str = "auto", precision: str = "auto") -> IncrementalJoin:
    """Today's :func:`~nearest_join.nearest_by_join` result, refreshed from the last run's state.

    Parameters
    ----------
    query, target : DataFrame
        Today's complete inputs (snapshots), each with a unique, non-NULL id column.
    ranking, num_results, vectors, join_type, distance_col, backend, precision
        As :func:`~nearest_join.nearest_by_join` (exact mode; a vector function or a metric
        name over ``array<float>`` / ``array<double>`` columns).
    query_id, target_id : str
        The id column of each side. A row's identity across runs: a row whose id is new was
        inserted, one whose id is gone was deleted, one whose vector differs was changed.
    state : str or path
        A directory on a local (or shared POSIX) filesystem: the last committed run's state is
        read from it (none, or one for another join: a full run, logged), and this run's is
        staged beside it until :meth:`IncrementalJoin.commit`.
    new_state : str or path, optional
        Where to write this run's state instead (a directory that does not exist yet), for a
        caller that publishes it itself: the batch jobs write it inside the output's staging
        directory, so that the output and its state are published in one step. No commit
        then.
    margin : int, optional
        Candidates kept per query beyond ``num_results`` (default :func:`default_margin`).

    Returns
    -------
    IncrementalJoin
        ``result``: the query's columns, the target's columns and ``distance_col``, the rows a
        full :func:`~nearest_join.nearest_by_join` of today's inputs returns (ties aside).
        The searches have run when this returns (the new state is written); ``result`` reads
        it and today's inputs.

    Raises
    ------
    ValueError
        A missing id column, a NULL or duplicate id (the column and the value are named), an
        id column whose type differs from the state's, vectors whose dimension differs from
        the state's; nothing is written then.

    Examples
    --------
    >>> q = spark.createDataFrame([(1, [0.0, 0.0]), (2, [4.0, 3.0])], "qid int, v array<float>")
    >>> t = spark.createDataFrame([(10, [4.0, 0.0]), (11, [4.0, 4.0])], "tid int, w array<float>")
    >>> run = incremental_nearest_join(q, t, "l2", 1, vectors=("v", "w"), query_id="qid",
    ...                                target_id="tid", state=str(tmp / "state"), distance_col="d")
    >>> sorted((r.qid, r.tid, r.d) for r in run.result.collect())
    [(1, 10, 4.0), (2, 11, 1.0)]
    >>> run.commit()

    The next run refreshes from this state: docs/incremental.md shows a second night.
    """
    options = JoinOptions(num_results=num_results, vectors=vectors, join_type=join_type,
                          distance_col=distance_col, backend=backend, precision=precision)
    parsed = parse_ranking(ranking, query, target, options.vectors)
    if parsed is None:
        raise ArgumentError("ranking", f"an incremental join needs a vector function over one column of "
                                       f"each side (or a metric name and vectors), got {ranking}")
    k = options.num_results
    if margin is None:
        margin = default_margin(k)
    elif not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ArgumentError("margin", f"expected None or an int >= 0, got {margin!r}")
    width = k + margin
    _check_id_column(query, query_id, "query_id")
    _check_id_column(target, target_id, "target_id")
    for df, name, side in ((query, parsed.query_column, "query"), (target, parsed.target_column, "target")):
        if not isinstance(df.schema[name].dataType, ArrayType):
            raise ArgumentTypeError("vectors", f"{side} column {quote(name)}: an incremental join takes "
                                               f"array<float> or array<double> vectors, got "
                                               f"{df.schema[name].dataType.simpleString()}")
    similarity = DIRECTIONS[parsed.metric] == "similarity"
    spark = query.sparkSession
    state_dir = Path(state)
    meta = {
        "version": STATE_VERSION, "metric": parsed.metric, "num_results": k, "margin": margin,
        "query_id": query_id, "target_id": target_id,
        "query_vector": parsed.query_column, "target_vector": parsed.target_column,
        "query_id_type": query.schema[query_id].dataType.simpleString(),
        "target_id_type": target.schema[target_id].dataType.simpleString(),
    }
    q_now = _fingerprinted(query, query_id, parsed.query_column, _QID, _QV)
    t_now = _fingerprinted(target, target_id, parsed.target_column, _TID, _TV)
    _check_unique(q_now, query_id, t_now, target_id)
    dimension = _dimension(q_now, _QV, t_now, _TV)
    meta["dimension"] = dimension
    previous, reason = _previous_state(spark, state_dir, meta)

    search = _Searcher(options, parsed.metric, width, similarity)
    if new_state is None:
        staging = sibling(state_dir, _STAGING, uuid.uuid4().hex[:12])
        state_dir.parent.mkdir(parents=True, exist_ok=True)
    else:
        staging = Path(new_state)
    try:
        # Today's target fingerprints first: the refresh compares the written ones with the
        # state's, rather than hashing every vector a second time.
        t_now.select(_TID, _H1, _H2).write.parquet(str(staging / "targets"))
        t_prints = spark.read.parquet(str(staging / "targets"))
        if previous is None:
            changes = _full_run(spark, q_now, t_now, t_prints, search, staging, reason)
        else:
            changes = _refresh(spark, q_now, t_now, t_prints, previous, search, staging, k)
        (staging / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("incremental join: %s", changes)
    lists = _complete_lists(spark, staging)
    result = _result(query, target, query_id, target_id, lists, k, options, similarity)
    return IncrementalJoin(result, changes, staging, None if new_state is not None else state_dir)


# ---------------------------------------------------------------------------- inputs and state
def _check_id_column(df: DataFrame, name, argument: str) -> None:
    if not isinstance(name, str) or name not in df.columns:
        raise ArgumentError(argument, f"expected the name of a column of the {argument.split('_')[0]} "
                                      f"({', '.join(df.columns)}), got {name!r}")


def _fingerprinted(df: DataFrame, id_name: str, vector_name: str, id_as: str, vector_as: str) -> DataFrame:
    """(id, vector, h1, h2): two 64-bit hashes of the vector, so that a changed vector goes
    unnoticed only when both collide. A NULL vector has a fingerprint of its own."""
    vector = column(df, vector_name)
    return df.select(column(df, id_name).alias(id_as), vector.alias(vector_as),
                     F.xxhash64(vector).alias(_H1), F.xxhash64(F.lit("nearest_join"), vector).alias(_H2))


def _check_unique(q_now: DataFrame, query_id: str, t_now: DataFrame, target_id: str) -> None:
    """Both sides' ids unique and non-NULL, in one query (ids compared as strings: the two
    sides' types may differ)."""
    ids = (q_now.select(F.lit(0).alias("side"), F.col(_QID).cast("string").alias("id"))
           .unionByName(t_now.select(F.lit(1).alias("side"), F.col(_TID).cast("string").alias("id"))))
    bad = (ids.groupBy("side", "id").count().where((F.col("count") > 1) | F.col("id").isNull())
           .limit(1).collect())
    if bad:
        side, value, count = bad[0]
        argument, name = ("query_id", query_id) if side == 0 else ("target_id", target_id)
        found = "a NULL id" if value is None else f"id {value} on {count} rows"
        raise ArgumentError(argument, f"column {quote(name)}: expected a unique, non-NULL id on every row, "
                                      f"found {found}")


def _dimension(q_now: DataFrame, q_vector: str, t_now: DataFrame, t_vector: str) -> int | None:
    """The length of a first non-NULL vector of either side (the searches check every row)."""
    for side, name in ((t_now, t_vector), (q_now, q_vector)):
        row = side.where(F.col(name).isNotNull()).select(F.size(name)).limit(1).collect()
        if row:
            return int(row[0][0])
    return None


def _previous_state(spark, state_dir: Path, meta: dict) -> tuple[dict | None, str]:
    """The committed state's DataFrames and meta when it answers this join; else None and why.

    A state of another join (metric, k, margin, columns) or an unreadable one is not used: a
    full run replaces it. An id type or a dimension that changed is an error: the inputs are
    not what the state's runs joined."""
    path = state_dir / META_FILE
    if not path.exists():
        return None, f"no state at {state_dir}"
    try:
        old = json.loads(path.read_text())
        queries = _complete_lists(spark, state_dir)
        targets = spark.read.parquet(str(state_dir / "targets"))
        queries.schema, targets.schema   # noqa: B018 (unreadable Parquet fails here)
    except Exception as exc:   # noqa: BLE001 (a corrupt state: say so and run in full)
        logger.warning("state %s is unreadable (%s): a full run replaces it", state_dir, exc)
        return None, f"the state at {state_dir} is unreadable: {type(exc).__name__}"
    if old.get("version") != STATE_VERSION:
        return None, f"the state at {state_dir} has version {old.get('version')!r}, not {STATE_VERSION}"
    for side in ("query", "target"):
        key = f"{side}_id_type"
        if old.get(f"{side}_id") == meta[f"{side}_id"] and old.get(key) != meta[key]:
            raise ArgumentError(f"{side}_id", f"column {quote(meta[f'{side}_id'])}: its type is {meta[key]}, "
                                              f"the state at {state_dir} holds ids of type {old.get(key)}")
    if old.get("dimension") is not None and meta["dimension"] is not None and old["dimension"] != meta["dimension"]:
        raise ArgumentError("vectors", f"the vectors have dimension {meta['dimension']}, the state at "
                                       f"{state_dir} was built on dimension {old['dimension']}")
    differing = sorted(key for key in meta if key != "dimension" and old.get(key) != meta[key])
    if differing:
        logger.warning("state %s answers another join (%s differ): a full run replaces it",
                       state_dir, ", ".join(differing))
        return None, f"the state at {state_dir} answers another join ({', '.join(differing)} differ)"
    return {"queries": queries, "targets": targets}, ""


def _complete_lists(spark, state_dir: Path) -> DataFrame:
    """The state's query rows: one per query, its complete list."""
    return spark.read.parquet(str(state_dir / "queries")).where(F.col(_COMPLETE)).drop("part")


# ---------------------------------------------------------------------------- searches
class _Searcher:
    """The exact search of ``width`` candidates per query (the kernels of nearest_by_join),
    as (query id, candidate struct(key, target id)) rows."""

    def __init__(self, options: JoinOptions, metric: str, width: int, similarity: bool):
        self.options = JoinOptions(num_results=width, vectors=(_QV, _TV), distance_col=_KEY,
                                   backend=options.backend, precision=options.precision)
        self.metric, self.width, self.similarity = metric, width, similarity

    def candidates(self, queries: DataFrame, targets: DataFrame, query_extra: str | None = None) -> DataFrame:
        """(query id, x: struct(key, target)), and ``query_extra``, a column of the queries
        each of its rows carries."""
        extra = () if query_extra is None else (query_extra,)
        planned = plan_join(queries.select(_QID, _QV, *extra), targets.select(_TID, _TV), self.metric, self.options)
        rows = planned.dataframe(query_columns=(0, 2) if extra else (0,), target_columns=(0,))
        key = -F.col(_KEY) if self.similarity else F.col(_KEY)
        return rows.select(_QID, *extra, F.struct(key.alias("key"), F.col(_TID).alias("target")).alias("x"))


def _lists(candidates: DataFrame, width: int) -> DataFrame:
    """(query id, its best ``width`` candidates in order, their bound) from a whole search."""
    grouped = candidates.groupBy(_QID).agg(F.array_sort(F.collect_list("x")).alias(_LIST))
    return grouped.select(_QID, F.slice(_LIST, 1, width).alias(_LIST),
                          F.when(F.size(_LIST) >= width, F.element_at(_LIST, width)["key"])
                          .otherwise(F.lit(math.inf)).alias(_BOUND))


def _full_run(spark, q_now: DataFrame, t_now: DataFrame, t_prints: DataFrame, search: _Searcher,
              staging: Path, reason: str) -> Changes:
    lists = _lists(search.candidates(q_now, t_now), search.width)
    path = staging / "queries" / "part=searched"
    _write_lists(q_now, lists, path)
    # Counted from the files written (their footers), not by a second pass over the inputs.
    # (An Observation on the write is no use here: Spark drops it from a plan it finds empty.)
    queries, targets = spark.read.parquet(str(path)).count(), t_prints.count()
    return Changes(refreshed=False, reason=reason, queries_inserted=queries, targets_inserted=targets,
                   queries_searched_whole=queries, query_rows=queries, target_rows=targets)


def _write_lists(q_rows: DataFrame, lists: DataFrame, path: Path) -> None:
    """Every query row of ``q_rows`` with its list (none found: an empty list holding every
    target there is, bound +inf), under today's fingerprint; complete, as a whole search's."""
    empty = F.array().cast(lists.schema[_LIST].dataType)
    (q_rows.select(_QID, _H1, _H2).join(lists, _QID, "left")
     .select(_QID, _H1, _H2, F.coalesce(_LIST, empty).alias(_LIST),
             F.coalesce(_BOUND, F.lit(math.inf)).alias(_BOUND), F.lit(True).alias(_COMPLETE))
     .write.parquet(str(path)))


def _refresh(spark, q_now: DataFrame, t_now: DataFrame, t_prints: DataFrame, previous: dict, search: _Searcher,
             staging: Path, k: int) -> Changes:
    """Today's lists from the state's: see the module notes. Only the kept queries whose list
    meets a change are merged: those holding a removed target, and those that an added target
    enters at or within their bound (the search of the added targets carries each query's
    bound and keeps nothing beyond it). The others' state rows are kept as they are."""
    width = search.width
    t_all = _diff(t_prints, previous["targets"], _TID).cache()
    q_diff = _diff(q_now, previous["queries"], _QID).cache()
    both = (q_diff.select(F.lit("q").alias("side"), "status")
            .unionByName(t_all.select(F.lit("t").alias("side"), "status")))
    counts = {(row["side"], row["status"]): row["count"] for row in both.groupBy("side", "status").count().collect()}
    t_diff = t_all.where(F.col("status") != "kept")
    try:
        removed = F.broadcast(t_diff.where(F.col("status") != "inserted").select(_TID))
        kept = previous["queries"].join(q_diff.where(F.col("status") == "kept").select(_QID), _QID, "left_semi")
        touched = (kept.select(_QID, F.explode(F.col(_LIST)["target"]).alias(_TID))
                   .join(removed, _TID, "left_semi").select(_QID))
        entering = None
        if counts.get(("t", "inserted"), 0) + counts.get(("t", "changed"), 0):
            added = t_now.join(t_diff.where(F.col("status") != "deleted").select(_TID), _TID, "left_semi")
            kept_vectors = q_now.join(kept.select(_QID, _BOUND), _QID)
            entering = (search.candidates(kept_vectors, added, query_extra=_BOUND)
                        .where(F.col("x.key") <= F.col(_BOUND)).select(_QID, "x")
                        .cache())
            touched = touched.unionByName(entering.select(_QID))
        affected = touched.distinct().cache()
        n_affected = affected.count()
        # The untouched kept rows, as the state holds them (their fingerprints are today's).
        kept.join(F.broadcast(affected), _QID, "left_anti").write.parquet(str(staging / "queries" / "part=kept"))
        old = kept.join(F.broadcast(affected), _QID, "left_semi")
        parts = (old.select(_QID, F.explode(_LIST).alias("x"))
                 .join(removed, F.col("x.target") == F.col(_TID), "left_anti")
                 .select(_QID, "x", F.lit(0).alias(_SOURCE)))
        if entering is not None:
            parts = parts.unionByName(entering.withColumn(_SOURCE, F.lit(1)))
        merged = parts.groupBy(_QID).agg(
            F.array_sort(F.collect_list("x")).alias("all"),
            F.count(F.when(F.col(_SOURCE) == 1, 1)).alias("added"),
            F.max(F.when(F.col(_SOURCE) == 1, F.col("x.key"))).alias("worst_added"))
        # An added target beyond its query's bound was dropped by the search: then fewer than
        # the width entered, and the bound of the added targets is beyond the list's own.
        bound = F.least(
            F.col(_BOUND),
            F.when(F.col("added") >= width, F.col("worst_added")).otherwise(F.lit(math.inf)),
            F.when(F.size("all") > width, F.element_at("all", width + 1)["key"]).otherwise(F.lit(math.inf)))
        all_list = F.coalesce("all", F.array().cast(kept.schema[_LIST].dataType))
        refreshed = (old.select(_QID, _H1, _H2, _BOUND).join(merged, _QID, "left")
                     .withColumn("all", all_list).withColumn("added", F.coalesce("added", F.lit(0)))
                     .withColumn("b", bound)
                     .select(_QID, _H1, _H2,
                             F.filter(F.slice("all", 1, width), lambda x: x["key"] <= F.col("b")).alias(_LIST),
                             F.col("b").alias(_BOUND)))
        complete = (F.size(_LIST) >= k) | (F.col(_BOUND) == math.inf)
        merged_path = staging / "queries" / "part=merged"
        refreshed.withColumn(_COMPLETE, complete).write.parquet(str(merged_path))
        # A short list stays in the merged part, marked incomplete: its query's whole search
        # is the searched part's, and only complete lists are read (_complete_lists).
        short = spark.read.parquet(str(merged_path)).where(~F.col(_COMPLETE)).select(_QID)
        whole = q_diff.where(F.col("status").isin("inserted", "changed")).select(_QID).unionByName(short)
        whole_rows = q_now.join(whole, _QID, "left_semi")
        _write_lists(whole_rows, _lists(search.candidates(whole_rows, t_now), width),
                     staging / "queries" / "part=searched")
        n_short = short.count()
    finally:
        for frame in (t_all, q_diff) + (() if entering is None else (entering,)):
            frame.unpersist()
        if "affected" in locals():
            affected.unpersist()
    return Changes(refreshed=True, reason="", queries_inserted=counts.get(("q", "inserted"), 0),
                   queries_deleted=counts.get(("q", "deleted"), 0), queries_changed=counts.get(("q", "changed"), 0),
                   queries_kept=counts.get(("q", "kept"), 0), targets_inserted=counts.get(("t", "inserted"), 0),
                   targets_deleted=counts.get(("t", "deleted"), 0), targets_changed=counts.get(("t", "changed"), 0),
                   queries_searched_whole=counts.get(("q", "inserted"), 0) + counts.get(("q", "changed"), 0) + n_short,
                   queries_short=n_short, queries_merged=n_affected,
                   query_rows=sum(counts.get(("q", s), 0) for s in ("inserted", "changed", "kept")),
                   target_rows=sum(counts.get(("t", s), 0) for s in ("inserted", "changed", "kept")))


def _diff(now: DataFrame, old: DataFrame, id_as: str) -> DataFrame:
    """(id, status) of every id of either: inserted, deleted, changed (its fingerprint) or kept."""
    old = old.select(id_as, F.col(_H1).alias(_OLD_H1), F.col(_H2).alias(_OLD_H2), F.lit(True).alias("old"))
    return (now.select(id_as, _H1, _H2, F.lit(True).alias("now")).join(old, id_as, "full_outer")
            .select(id_as, F.when(F.col("old").isNull(), "inserted").when(F.col("now").isNull(), "deleted")
                    .when((F.col(_H1) != F.col(_OLD_H1)) | (F.col(_H2) != F.col(_OLD_H2)), "changed")
                    .otherwise("kept").alias("status")))


# ---------------------------------------------------------------------------- the result
def _result(query: DataFrame, target: DataFrame, query_id: str, target_id: str, lists: DataFrame, k: int,
            options: JoinOptions, similarity: bool) -> DataFrame:
    """The query's columns, the target's and the value column: each query's first ``k``
    candidates, joined to today's rows by their ids."""
    q_names, t_names = query.columns, target.columns
    q_cols = [f"__nj_q{i}" for i in range(len(q_names))]
    t_cols = [f"__nj_t{i}" for i in range(len(t_names))]
    q = query.toDF(*q_cols).withColumn(_QID, F.col(q_cols[q_names.index(query_id)]))
    t = target.toDF(*t_cols).withColumn(_TID, F.col(t_cols[t_names.index(target_id)]))
    pairs = (lists.select(_QID, F.posexplode(_LIST).alias("rank", "x")).where(F.col("rank") < k)
             .select(_QID, F.col("x.target").alias(_TID), F.col("x.key").alias(_KEY)))
    how = "inner" if options.join_type == "inner" else "left"
    joined = q.join(pairs, _QID, how).join(t, _TID, how)
    value = (-F.col(_KEY) if similarity else F.col(_KEY)).cast("float")
    out = [F.col(c).alias(n) for c, n in zip(q_cols, q_names)] + [F.col(c).alias(n) for c, n in zip(t_cols, t_names)]
    if options.distance_col is not None:
        out.append(value.alias(options.distance_col))
    return joined.select(*out)
