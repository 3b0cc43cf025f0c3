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

With ``on=`` keys every list, search and bound is one of the query's key group: a row's key is
part of its fingerprint (a row whose key changed is a changed row), and the searches are the
keyed join's. With a cap (``max_distance`` / ``min_similarity``) a target beyond the cap is, for
every list and bound, as if it did not exist: the searches never return one, a list holds every
target within the cap up to ``num_results + margin``, and a bound of +inf means that the list
holds every target within the cap.

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

Change detection runs on the driver: each side's ids, fingerprints and vector lengths are
collected (one Spark job per side, about 30 bytes a row) and joined with the state's (pyarrow),
so that the statuses, the id checks and the planner's facts cost no shuffle; the changed ids go
back to Spark as broadcast local relations. The lists are merged on the driver too: the state's
live lists are read with pyarrow (about 12 bytes per candidate), the kept queries' search of the
added targets is collected (a few rows per query), and the lists a change meets are merged
(numpy) and written (pyarrow), with no Spark shuffle. The searches are Spark's, or, for an exact
refresh without ``on=`` keys whose vectors fit :data:`SEARCH_HERE_BYTES`, the driver's: its
change detection reads today's vectors from a side's Parquet files when the side is a plain scan
of them (:mod:`nearest_join.parquet_scan`; paired with the collected rows by id), else collects
them with the fingerprints, and the local plan's functions search them
(:meth:`_Searcher.candidates_here`), no Spark job.

The state lives in one directory (``state``): ``meta.json`` (what the lists answer: metric,
k, margin, columns, id types, dimension, generation), ``queries/``, ``targets/`` and
``dropped/`` (Parquet). Each run is a *generation*: the full run writes ``queries/gen=0``; a
refresh links the state's query files into the new state as they are (they are never written
again) and writes only its own rows, the merged, short and searched lists, to
``queries/gen=<g>``; ``dropped/`` holds each query whose earlier rows a later generation
replaced or deleted, with that generation, and a list is live when no drop of its query is
newer than it. Once the files hold more than ``COMPACT_ROWS_PER_QUERY`` rows per live query, or
more than ``COMPACT_GENERATIONS`` generations, the refresh rewrites them as the live lists
alone. ``targets/`` is today's target fingerprints, written by the driver.

A run writes the new state into a hidden staging directory beside it (the searches run then,
once), reads its result from there, and :meth:`IncrementalJoin.commit` makes it the state in
one step (:func:`nearest_join.publish.replace_directory`): a run that fails or is killed
before the commit leaves the previous state as it was, and the next run starts from it again.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import math
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DoubleType,
    IntegerType,
    FloatType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from .errors import ArgumentError
from .ivf_index import IVFIndex
from .join import plan_join
from .options import JoinOptions
from .parquet_scan import plain_parquet_scan
from .planner import MiB, SideFacts, cluster_cores, join_dimension, parse_bytes, vector_length
from .publish import replace_directory, sibling
from .ranking import DIRECTIONS, column, parse_keys, parse_ranking, quote
from .recall import RECALL_QUERIES, wilson_interval

logger = logging.getLogger(__name__)

STATE_VERSION = 3
# A refresh carries the state's query files over (hard links) and writes only what changed;
# the files are rewritten once they hold this many rows per live query, or this many runs.
COMPACT_ROWS_PER_QUERY, COMPACT_GENERATIONS = 2, 16
META_FILE = "meta.json"
_STAGING = ".nj-state-staging-"

# Internal column names: reserved, so that no input column can clash with them.
_QID, _TID, _QV, _TV = "__nj_qid", "__nj_tid", "__nj_qv", "__nj_tv"
_H1, _H2, _KEY = "__nj_h1", "__nj_h2", "__nj_key"
_LIST, _BOUND, _COMPLETE = "candidates", "bound", "complete"
_GEN, _DROPPED_AT = "gen", "__nj_dropped_at"
_INDEX = "index"   # mode="approx": the state's IVF index (nearest_join.ivf_index.IVFIndex.save)
# mode="approx" with a recall target: a refresh's measurement keeps the index when its lower
# bound meets the target, on RECALL_QUERIES sampled queries or, when that look falls short, on
# SECOND_LOOK_QUERIES more with the first (a second look is an exact search of a few thousand
# queries; a re-trained index is a full run). Two looks, each at the z of a two-sided 97.5%
# interval: the chance of keeping an index whose recall is below the target stays within the
# 2.5% of one look at the planner's 95% interval (a union bound).
SECOND_LOOK_QUERIES = 4 * RECALL_QUERIES
_Z_TWO_LOOKS = 2.241402727604947
# An exact refresh without on= keys searches in the driver (the local plan's functions, on
# today's rows of both sides collected with their fingerprints) when both sides' vectors come to
# at most this, and to half of spark.driver.maxResultSize (the collect's bound): the searches of
# a refresh are small, and streaming a whole side through the Python workers costs more than
# collecting it beside the fingerprints that are collected anyway.
SEARCH_HERE_BYTES = 512 * MiB


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
    searched_here: bool = False       # the refresh's searches ran in the driver (_searches_here)
    query_rows: int = 0               # today's rows
    target_rows: int = 0
    # mode="approx" with an IVF index: its nlist and nprobe, and recall@k (recall_estimate,
    # recall_lower: its lower bound, the plan's 95% one or a refresh's (SECOND_LOOK_QUERIES),
    # recall_queries, recall_of: what measured it); None when every list is exact.
    recall: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class IncrementalJoin:
    """A run of :func:`incremental_nearest_join`: its ``result`` (a DataFrame; :meth:`dataframe`
    keeps some of each side's columns), ``changes`` (:class:`Changes`) and :meth:`commit`,
    which makes this run's state the one the next run starts from."""

    def __init__(self, rows, changes: Changes, staging: Path, state: Path | None):
        self._rows = rows   # (query_columns, target_columns) -> DataFrame
        self.changes = changes
        self._staging, self._state = staging, state
        self._committed = False

    @property
    def result(self) -> DataFrame:
        """Every column of both sides and ``distance_col``: :meth:`dataframe` of all."""
        return self._rows(None, None)

    def dataframe(self, query_columns=None, target_columns=None) -> DataFrame:
        """The result with the positions ``query_columns`` and ``target_columns`` of each
        side's columns, in their order (default: all), as
        :meth:`nearest_join.join.PlannedJoin.dataframe` keeps them. A side whose columns kept
        are its id alone (or none) is not joined: the lists hold its ids, and only today's."""
        return self._rows(query_columns, target_columns)

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


def remove_staged_states(state) -> int:
    """Delete the states staged beside ``state`` by runs that were never committed or
    discarded (a killed process's); returns how many. Only while no run of this state is in
    progress: its staging directory would go too (the batch jobs call it under the output's
    lock)."""
    state = Path(state)
    stale = list(state.parent.glob(f".{state.name}{_STAGING}*")) if state.parent.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return len(stale)


def incremental_nearest_join(query: DataFrame, target: DataFrame, ranking, num_results: int = 1, *,
                             query_id: str, target_id: str, state, new_state=None, margin: int | None = None,
                             vectors=None, join_type: str = "inner", distance_col: str | None = None,
                             backend: str = "auto", precision: str = "auto", max_distance: float | None = None,
                             min_similarity: float | None = None, on=None, mode: str = "exact", recall=None,
                             nlist: int | None = None, nprobe: int | None = None,
                             seed: int | None = None) -> IncrementalJoin:
    """Today's :func:`~nearest_join.nearest_by_join` result, refreshed from the last run's state.

    Parameters
    ----------
    query, target : DataFrame
        Today's complete inputs (snapshots), each with a unique, non-NULL id column.
    ranking, num_results, vectors, join_type, distance_col, backend, precision, max_distance, min_similarity, on
        As :func:`~nearest_join.nearest_by_join` (a vector function or a metric name over
        ``array<float>``, ``array<double>`` or ML ``VectorUDT`` columns). A state answers one join: a
        run with another metric, k, margin, cap, keys or mode than the state's is a full run.
    mode, recall, nlist, nprobe, seed
        As :func:`~nearest_join.nearest_by_join`. ``mode="approx"``: the full run's IVF plan
        (its index is kept in the state); a refresh searches the added targets exactly, the
        queries searched whole with the state's index and nprobe where IVF pays (else
        exactly), then measures recall@k on a sample of today's queries (a larger one when
        the first's lower bound falls short) and re-trains (a full run) when its lower bound is
        below ``recall`` (not with ``nprobe`` given: no recall is promised then): see
        docs/incremental.md.
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
    run = _prepare(query, target, ranking, num_results, query_id=query_id, target_id=target_id, state=state,
                   margin=margin, vectors=vectors, join_type=join_type, distance_col=distance_col,
                   backend=backend, precision=precision, max_distance=max_distance,
                   min_similarity=min_similarity, on=on, mode=mode, recall=recall, nlist=nlist, nprobe=nprobe,
                   seed=seed, vectors_here=True)
    spark, state_dir, ids, search, schemas = query.sparkSession, run.state_dir, run.ids, run.search, run.schemas
    if new_state is None:
        staging = sibling(state_dir, _STAGING, uuid.uuid4().hex[:12])
        state_dir.parent.mkdir(parents=True, exist_ok=True)
    else:
        staging = Path(new_state)
    try:
        # Today's target fingerprints, from change detection (no second hash of the vectors).
        ids.write_targets(staging / "targets")
        if run.previous is None:
            generation = 0
            changes, ivf = _full_run(run.q_now, run.t_now, ids, search, staging, run.reason)
        else:
            generation = run.previous["generation"] + 1
            ivf = run.previous["ivf"]
            # With an index some lists are approximate: recall is measured on a sample.
            sample = None if ivf is None else _recall_sample(spark, ids, search.approx["seed"], generation, 0)
            changes, truth = _refresh(spark, run.q_now, run.t_now, ids, run.previous, search, staging, schemas,
                                      run.k, generation, sample)
            if ivf is not None:
                shutil.copytree(state_dir / _INDEX, staging / _INDEX)

                def exact_truth(picked: tuple[DataFrame, int]) -> pa.Table:
                    # the sampled queries' exact search of their own against today's target
                    found, _ = search.candidates(run.q_now.join(picked[0], _QID, "left_semi"), run.t_now,
                                                 (ids.facts(0, picked[1]), ids.facts(1, ids.today_rows(1))),
                                                 width=run.k)
                    return _sample_truth(found, picked[0])

                if truth is None:   # the whole searches ran IVF: the sample's exact search of its own
                    truth = exact_truth(sample)
                promised = search.approx["nprobe"] is None
                measured = _measured_recall(spark, staging, schemas, sample, truth, run.k, ids.today_rows(0))
                if promised and measured["recall_lower"] < search.approx["recall"]:
                    # A second look before a full run: the first sample's bound may fall
                    # short of a recall that meets the target.
                    more = _recall_sample(spark, ids, search.approx["seed"], generation, 1)
                    if more[1]:
                        truth = pa.concat_tables([truth, exact_truth(more)])
                        sample = (F.broadcast(sample[0].unionByName(more[0])), sample[1] + more[1])
                        measured = _measured_recall(spark, staging, schemas, sample, truth, run.k,
                                                    ids.today_rows(0), looks=2)
                changes = replace(changes, recall={"nlist": ivf["nlist"], "nprobe": ivf["nprobe"], **measured})
                # (With nprobe given no recall is promised, as nearest_by_join promises none:
                # measured and reported, never a reason to re-train.)
                if promised and measured["recall_lower"] < search.approx["recall"]:
                    # The lists answer today's data worse than the target: a new index and a
                    # full run (the planner estimates nprobe again on today's data).
                    reason = (f"recall@{run.k} re-measured on the refresh: {measured['recall_estimate']:.4f}, "
                              f"lower bound {measured['recall_lower']:.4f} < recall={search.approx['recall']}"
                              f": index re-trained")
                    logger.info("incremental join: %s", reason)
                    shutil.rmtree(staging)
                    ids.write_targets(staging / "targets")
                    generation = 0
                    changes, ivf = _full_run(run.q_now, run.t_now, ids, search, staging, reason)
        run.meta["generation"] = generation
        run.meta["ivf"] = None if ivf is None else {"nlist": ivf["nlist"], "nprobe": ivf["nprobe"]}
        (staging / META_FILE).write_text(json.dumps({**run.meta, "schemas": {
            name: json.loads(schema.json()) for name, schema in schemas.items()}}, indent=1, sort_keys=True))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("incremental join: %s", changes)
    lists = _complete_lists(spark, staging, schemas)
    rows = functools.partial(_result, query, target, query_id, target_id, lists, run.k, run.options,
                             run.search.similarity)
    return IncrementalJoin(rows, changes, staging, None if new_state is not None else state_dir)


@dataclass(frozen=True)
class RefreshPlan:
    """What :func:`incremental_nearest_join` would do with these inputs and this state
    (:func:`explain_incremental`): a refresh or a full run (``reason``), the rows inserted,
    deleted, changed and kept on each side, and the searches' size.

    ``queries_searched_whole`` counts the new and changed queries; a kept query whose list
    runs short is searched whole too, which only the run finds out. ``pairs`` is what the
    searches compare (the kept queries against the added targets, the queries searched whole
    against every target; with ``on=`` keys an upper bound, the keys prune), against
    ``full_pairs``, what a full recompute compares."""

    refresh: bool
    reason: str
    query_rows: int
    target_rows: int
    queries: dict
    targets: dict
    queries_searched_whole: int
    pairs: int
    full_pairs: int
    approx: str | None = None   # mode="approx": how the run searches and measures recall
    searched_here: bool = False   # a refresh whose searches run in the driver (_searches_here)

    def __str__(self) -> str:
        def side(counts: dict) -> str:
            return ", ".join(f"{n:,} {status}" for status, n in counts.items())

        what = "refresh" if self.refresh else f"full run ({self.reason})"
        share = f"{self.pairs / self.full_pairs:.2%} of a full run's" if self.full_pairs else "a full run's"
        kept = (f", {self.queries['kept']:,} kept against {self.targets['inserted'] + self.targets['changed']:,} "
                f"added targets" if self.refresh else "")
        return "\n".join([
            f"incremental {what}",
            f"  queries  {self.query_rows:,} rows today: {side(self.queries)}",
            f"  targets  {self.target_rows:,} rows today: {side(self.targets)}",
            f"  search   {self.queries_searched_whole:,} queries against every target{kept}: "
            f"{self.pairs:,} pairs ({share} {self.full_pairs:,})"
            + (", in the driver (today's vectors collected with the fingerprints)" if self.searched_here else ""),
            *([] if self.approx is None else [f"  approx   {self.approx}"])])


def explain_incremental(query: DataFrame, target: DataFrame, ranking, num_results: int = 1, *, query_id: str,
                        target_id: str, state, margin: int | None = None, vectors=None, join_type: str = "inner",
                        distance_col: str | None = None, backend: str = "auto", precision: str = "auto",
                        max_distance: float | None = None, min_similarity: float | None = None,
                        on=None, mode: str = "exact", recall=None, nlist: int | None = None,
                        nprobe: int | None = None, seed: int | None = None) -> RefreshPlan:
    """What :func:`incremental_nearest_join` would do with these arguments (its own), without
    searching or writing: one Spark job per side (today's ids and fingerprints, which the run
    starts with). Raises what the run raises before it writes.

    Examples
    --------
    >>> q = spark.createDataFrame([(1, [0.0, 0.0]), (2, [4.0, 3.0])], "qid int, v array<float>")
    >>> t = spark.createDataFrame([(10, [4.0, 0.0]), (11, [4.0, 4.0])], "tid int, w array<float>")
    >>> print(explain_incremental(q, t, "l2", 1, vectors=("v", "w"), query_id="qid", target_id="tid",
    ...                           state=str(tmp / "none")))   # doctest: +ELLIPSIS
    incremental full run (no state at .../none)
      queries  2 rows today: 2 inserted, 0 deleted, 0 changed, 0 kept
      targets  2 rows today: 2 inserted, 0 deleted, 0 changed, 0 kept
      search   2 queries against every target: 4 pairs (100.00% of a full run's 4)
    """
    run = _prepare(query, target, ranking, num_results, query_id=query_id, target_id=target_id, state=state,
                   margin=margin, vectors=vectors, join_type=join_type, distance_col=distance_col,
                   backend=backend, precision=precision, max_distance=max_distance,
                   min_similarity=min_similarity, on=on, mode=mode, recall=recall, nlist=nlist, nprobe=nprobe,
                   seed=seed)
    counted = run.ids
    statuses = _Ids.STATUSES
    queries, targets = counted.today_rows(0), counted.today_rows(1)
    if run.previous is None:
        whole, pairs = queries, queries * targets
    else:
        whole = counted(0, "inserted", "changed")
        pairs = whole * targets + counted(0, "kept") * counted(1, "inserted", "changed")
    return RefreshPlan(refresh=run.previous is not None, reason=run.reason, query_rows=queries, target_rows=targets,
                       queries={s: counted(0, s) for s in statuses}, targets={s: counted(1, s) for s in statuses},
                       queries_searched_whole=whole, pairs=pairs, full_pairs=queries * targets,
                       approx=_approx_plan(run, queries),
                       searched_here=run.previous is not None and _searches_here(
                           query.sparkSession, run.search, run.q_now, run.t_now, run.state_dir,
                           run.previous["dimension"]))


def _approx_plan(run, queries: int) -> str | None:
    """The explanation's ``approx`` line (None in exact mode)."""
    approx = run.search.approx
    if approx is None:
        return None
    given = approx["nprobe"] is not None   # no recall promised (nearest_by_join estimates none)
    if run.previous is None:
        if given:
            return f"the full run's IVF plan trains its index, searched at the given nprobe={approx['nprobe']}"
        return (f"the full run's IVF plan trains its index and chooses nprobe for recall={approx['recall']} "
                "(or runs exact, and says why)")
    ivf = run.previous["ivf"]
    if ivf is None:
        return "the state's lists are exact (its full run's approx plan ran exact): the refresh searches exactly"
    return (f"the state's index (nlist={ivf['nlist']}) at nprobe={ivf['nprobe']} for the queries searched whole, "
            f"the added targets searched exactly; recall@{run.k} then measured on {min(RECALL_QUERIES, queries):,} "
            "sampled queries, and " + ("reported (nprobe given: no recall promised, no re-training)" if given else
                                       "a full run re-trains the index when its lower bound is below "
                                       f"recall={approx['recall']} (after a second look at up to "
                                       f"{SECOND_LOOK_QUERIES:,} more)"))


@dataclass
class _Prepared:
    """What a run and its explanation share: the checked arguments, today's fingerprinted
    inputs, the state (None: a full run, ``reason`` says why), and the ids' statuses (``ids``)."""

    options: JoinOptions
    k: int
    state_dir: Path
    meta: dict
    q_now: DataFrame
    t_now: DataFrame
    search: "_Searcher"
    schemas: dict
    previous: dict | None
    reason: str
    ids: "_Ids"


def _prepare(query: DataFrame, target: DataFrame, ranking, num_results: int, *, query_id: str, target_id: str,
             state, margin, vectors, join_type, distance_col, backend, precision, max_distance, min_similarity,
             on, mode, recall, nlist, nprobe, seed, vectors_here: bool = False) -> _Prepared:
    """The checks and the change detection (:func:`incremental_nearest_join`'s arguments, its
    errors); nothing written. ``vectors_here``: a refresh that searches in the driver
    (:func:`_searches_here`) collects today's vectors with the fingerprints."""
    options = JoinOptions(num_results=num_results, vectors=vectors, join_type=join_type,
                          distance_col=distance_col, backend=backend, precision=precision,
                          max_distance=max_distance, min_similarity=min_similarity, on=on, mode=mode,
                          recall=recall, nlist=nlist, nprobe=nprobe, seed=seed)
    parsed = parse_ranking(ranking, query, target, options.vectors)
    if parsed is None:
        raise ArgumentError("ranking", f"an incremental join needs a vector function over one column of "
                                       f"each side (or a metric name and vectors), got {ranking}")
    cap = options.cap(parsed.metric)
    keys = None if options.on is None else parse_keys(options.on, query, target)
    k = options.num_results
    if margin is None:
        margin = default_margin(k)
    elif not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ArgumentError("margin", f"expected None or an int >= 0, got {margin!r}")
    width = k + margin
    _check_id_column(query, query_id, "query_id")
    _check_id_column(target, target_id, "target_id")
    similarity = DIRECTIONS[parsed.metric] == "similarity"
    spark = query.sparkSession
    state_dir = Path(state)
    meta = {
        "version": STATE_VERSION, "metric": parsed.metric, "num_results": k, "margin": margin,
        "query_id": query_id, "target_id": target_id,
        "query_vector": parsed.query_column, "target_vector": parsed.target_column,
        "query_id_type": query.schema[query_id].dataType.simpleString(),
        "target_id_type": target.schema[target_id].dataType.simpleString(),
        "cap": cap,
        "keys": None if keys is None else [[k.query_column, k.target_column, k.common] for k in keys],
    }
    q_now = _fingerprinted(query, query_id, parsed.query_column, _QID, _QV,
                           [] if keys is None else [(k.query_column, k.common) for k in keys], "q")
    t_now = _fingerprinted(target, target_id, parsed.target_column, _TID, _TV,
                           [] if keys is None else [(k.target_column, k.common) for k in keys], "t")
    search = _Searcher(options, parsed.metric, width, similarity, 0 if keys is None else len(keys))
    # mode="approx": its settings (a state of other settings, or of the exact mode, is not used)
    meta["approx"] = search.approx
    schemas = _state_schemas(q_now, t_now, search)
    previous, reason = _previous_state(spark, state_dir, meta, schemas)
    here = vectors_here and previous is not None and _searches_here(spark, search, q_now, t_now, state_dir,
                                                                     previous["dimension"])
    # Change detection: today's ids and fingerprints against the state's, and the checks
    # (unique non-NULL ids, one dimension) that must pass before anything is written.
    # The two sides' jobs and the state's reads at once: each is mostly waiting (on Spark, on
    # the files), and pyarrow reads without the GIL. A side that is a plain scan of Parquet
    # files has its vectors read from them (pyarrow decodes them faster than Spark converts
    # them), paired with the collected rows by id.
    scans = [plain_parquet_scan(df, [name, vector]) if here else None
             for df, name, vector in ((query, query_id, parsed.query_column),
                                      (target, target_id, parsed.target_column))]
    with concurrent.futures.ThreadPoolExecutor(5, thread_name_prefix="nj-detect") as pool:
        state = None if previous is None else (pool.submit(_state_lists, state_dir),
                                               pool.submit(_state_fingerprints, state_dir))
        files = [None if scan is None else pool.submit(scan.read, ["id", "v"]) for scan in scans]
        query_side = pool.submit(_today, q_now, _QID, _QV, here and scans[0] is None)
        target_side = _today(t_now, _TID, _TV, here and scans[1] is None)
        today = [query_side.result(), target_side]
        for side, (now, id_name, vector_name) in enumerate(((q_now, _QID, _QV), (t_now, _TID, _TV))):
            if files[side] is not None:
                aligned = _with_vectors(today[side], files[side].result())
                today[side] = _today(now, id_name, vector_name, vectors=True) if aligned is None else aligned
        before = None
        if state is not None:
            lists, targets = state[0].result(), state[1].result()
            lists = lists.set_column(0, _QID, lists[_QID].cast(today[0]["id"].type))
            previous["lists"] = lists
            before = (pa.table({"id": lists[_QID], "old_h1": lists[_H1], "old_h2": lists[_H2]}),
                      targets.set_column(0, "id", targets["id"].cast(today[1]["id"].type)))
    ids = _Ids(today, (q_now.schema[_QID].dataType, t_now.schema[_TID].dataType))
    ids.check(query_id, target_id)
    if before is not None:
        ids.compare(before)
    dimension = ids.dimension(parsed)
    if previous is not None and None not in (previous["dimension"], dimension) \
            and previous["dimension"] != dimension:
        raise ArgumentError("vectors", f"the vectors have dimension {dimension}, the state at {state_dir} "
                                       f"was built on dimension {previous['dimension']}")
    meta["dimension"] = dimension if dimension is not None else (previous or {}).get("dimension")
    return _Prepared(options, k, state_dir, meta, q_now, t_now, search, schemas, previous, reason, ids)


# ---------------------------------------------------------------------------- inputs and state
def _check_id_column(df: DataFrame, name, argument: str) -> None:
    if not isinstance(name, str) or name not in df.columns:
        raise ArgumentError(argument, f"expected the name of a column of the {argument.split('_')[0]} "
                                      f"({', '.join(df.columns)}), got {name!r}")


def _key_name(side: str, i: int) -> str:
    return f"__nj_{side}k{i}"


def _fingerprinted(df: DataFrame, id_name: str, vector_name: str, id_as: str, vector_as: str,
                   keys: list[tuple[str, str]], side: str) -> DataFrame:
    """(id, vector, h1, h2, keys...): two 64-bit hashes of the vector and the ``on=`` keys (each
    cast to the type the join compares it in), so that a changed row goes unnoticed only when
    both collide. A NULL vector has a fingerprint of its own; so has a NULL key (Spark's hash
    skips a NULL value: which keys are NULL is hashed too)."""
    vector = column(df, vector_name)
    key_columns = [column(df, name).cast(common).alias(_key_name(side, i)) for i, (name, common) in enumerate(keys)]
    hashed = [vector, *key_columns]
    if keys:
        hashed.append(F.array(*[c.isNull() for c in key_columns]))
    return df.select(column(df, id_name).alias(id_as), vector.alias(vector_as),
                     F.xxhash64(*hashed).alias(_H1), F.xxhash64(F.lit("nearest_join"), *hashed).alias(_H2),
                     *key_columns)


def _state_schemas(q_now: DataFrame, t_now: DataFrame, search: "_Searcher") -> dict:
    """The state's Parquet schemas, known before anything is read: the state is read with
    them (Spark would otherwise run a job per read to infer them from the files)."""
    q_id, t_id = q_now.schema[_QID].dataType, t_now.schema[_TID].dataType
    candidate = StructType([StructField("key", search.key_type), StructField("target", t_id)])
    return {
        "queries": StructType([StructField(_QID, q_id), StructField(_H1, LongType()), StructField(_H2, LongType()),
                               StructField(_LIST, ArrayType(candidate, False)), StructField(_BOUND, DoubleType()),
                               StructField(_COMPLETE, BooleanType()), StructField(_GEN, IntegerType()),
                               StructField("part", StringType())]),
        "dropped": StructType([StructField(_QID, q_id), StructField(_DROPPED_AT, IntegerType())]),
        "targets": StructType([StructField(_TID, t_id), StructField(_H1, LongType()), StructField(_H2, LongType())]),
    }


def _today(df: DataFrame, id_name: str, vector_name: str, vectors: bool = False) -> pa.Table:
    """Today's ids of one side with their fingerprints, vector lengths and input partitions,
    collected to the driver (one Spark job; about 30 bytes a row); with ``vectors``, the
    vectors too (column ``v``)."""
    return df.select(F.col(id_name).alias("id"), F.col(_H1).alias("h1"), F.col(_H2).alias("h2"),
                     vector_length(df, vector_name).alias("length"), F.spark_partition_id().alias("p"),
                     *([F.col(vector_name).alias("v")] if vectors else [])).toArrow()


def _with_vectors(today: pa.Table, files: pa.Table | None) -> pa.Table | None:
    """One side's collected rows (:func:`_today` without vectors) in the order of its files'
    rows (``files``: id, v, read by :class:`nearest_join.parquet_scan.ParquetScan`) with their
    vectors as column ``v``; None when the files do not hold the collected ids, each once, with
    vectors of the lengths Spark read (then the caller collects the vectors through Spark)."""
    n = today.num_rows
    if files is None or files.num_rows != n:
        return None
    try:   # an id type pyarrow cannot cast or join on: the collect's
        joined = (pa.table({"id": files["id"].cast(today["id"].type), "row": np.arange(n)})
                  .join(pa.table({"id": today["id"], "at": np.arange(n)}), keys="id", join_type="inner"))
    except pa.ArrowException:
        return None
    row, at = joined["row"].to_numpy(), joined["at"].to_numpy()
    # Each row of each side met once: the join pairs equal ids one to one (NULL ids meet none).
    if len(row) != n or np.bincount(row, minlength=n).max(initial=0) > 1 \
            or np.bincount(at, minlength=n).max(initial=0) > 1:
        return None
    order = np.empty(n, np.int64)
    order[row] = at
    aligned = today.take(order)
    lengths = pc.fill_null(pc.list_value_length(files["v"]), -1)
    if not pc.all(pc.equal(lengths, pc.fill_null(aligned["length"], -1)), min_count=0).as_py():
        return None
    return aligned.append_column("v", files["v"])


def _searches_here(spark, search: "_Searcher", q_now: DataFrame, t_now: DataFrame, state_dir: Path,
                   dimension: int | None) -> bool:
    """Whether a refresh searches in the driver (:data:`SEARCH_HERE_BYTES`): exact, without
    ``on=`` keys or the GPU backend asked for, over ``array<float>`` or ``array<double>`` vectors
    whose bytes, at the state's rows and dimension, fit the bound."""
    if search.approx is not None or search.q_keys or search.options.backend == "gpu":
        return False
    itemsizes = []
    for df, name in ((q_now, _QV), (t_now, _TV)):
        data_type = df.schema[name].dataType
        if not isinstance(data_type, ArrayType) or not isinstance(data_type.elementType, (FloatType, DoubleType)):
            return False
        itemsizes.append(4 if isinstance(data_type.elementType, FloatType) else 8)
    limit = SEARCH_HERE_BYTES
    results = parse_bytes(spark.conf.get("spark.driver.maxResultSize", "1g"))
    if results > 0:
        limit = min(limit, results // 2)
    rows = (_footer_rows(state_dir / "queries"), _footer_rows(state_dir / "targets"))
    return sum(n * (dimension or 0) * size for n, size in zip(rows, itemsizes)) <= limit


def _state_fingerprints(state_dir: Path) -> pa.Table:
    """The state's target (id, h1, h2), read on the driver."""
    table = pq.read_table(state_dir / "targets", columns=[_TID, _H1, _H2])
    return pa.table({"id": table[_TID], "old_h1": table[_H1], "old_h2": table[_H2]})


def _state_lists(state_dir: Path) -> pa.Table:
    """The state's live complete lists (id, h1, h2, candidates, bound), read on the driver:
    the queries' fingerprints, and what a refresh merges (a short list's query has a
    searched row too)."""
    import pyarrow.dataset as ds

    table = _live(ds.dataset(str(state_dir / "queries"), format="parquet", partitioning="hive")
                  .to_table(columns=[_QID, _H1, _H2, _LIST, _BOUND, _GEN], filter=ds.field(_COMPLETE)), state_dir)
    return pa.table({_QID: table[_QID], _H1: table[_H1], _H2: table[_H2], _LIST: table[_LIST],
                     _BOUND: table[_BOUND]})


def _dropped(state_dir: Path) -> pa.Table | None:
    """The state's ``dropped/`` (query id, generation), None when it has none."""
    return pq.read_table(state_dir / "dropped") if _footer_rows(state_dir / "dropped") else None


def _live(rows: pa.Table, state_dir: Path) -> pa.Table:
    """The query rows (with their generation) that ``dropped/`` leaves live."""
    dropped = _dropped(state_dir)
    if dropped is None:
        return rows
    dropped = dropped.cast(pa.schema([(_QID, rows.schema.field(_QID).type), (_DROPPED_AT, pa.int32())]))
    # The join on the ids and generations alone (pyarrow joins no list column).
    probe = pa.table({_QID: rows[_QID], _GEN: rows[_GEN], "row": np.arange(len(rows))})
    joined = probe.join(dropped, keys=_QID, join_type="left outer")
    live = joined.filter(pc.or_kleene(pc.is_null(joined[_DROPPED_AT]),
                                      pc.greater_equal(joined[_GEN], joined[_DROPPED_AT])))["row"]
    return rows.take(np.sort(live.to_numpy()))


class _Ids:
    """Both sides' ids by status (inserted, deleted, changed, kept), found on the driver: a
    full outer join (pyarrow) of today's ids and fingerprints with the state's, per side, no
    shuffle. Also what must hold before anything is written (unique, non-NULL ids) and the
    planner's facts of each side (its partitions and vector lengths)."""

    STATUSES = ("inserted", "deleted", "changed", "kept")

    def __init__(self, today: tuple[pa.Table, pa.Table], types: tuple):
        self.today, self.types = today, types
        # Before any comparison (a full run), every row of today's is inserted.
        self.ids = {(side, status): now["id"] if status == "inserted" else now["id"].slice(0, 0)
                    for side, now in enumerate(today) for status in self.STATUSES}

    def check(self, query_id: str, target_id: str) -> None:
        for side, argument, name in ((0, "query_id", query_id), (1, "target_id", target_id)):
            ids = self.today[side]["id"]
            if ids.null_count:
                found = "a NULL id"
            else:
                counts = pc.value_counts(ids)
                many = counts.filter(pc.greater(counts.field("counts"), 1))
                if not len(many):
                    continue
                found = f"id {many[0]['values'].as_py()} on {many[0]['counts'].as_py()} rows"
            raise ArgumentError(argument, f"column {quote(name)}: expected a unique, non-NULL id on every row, "
                                          f"found {found}")

    def compare(self, before: tuple[pa.Table, pa.Table]) -> None:
        """The statuses against the state's ids and fingerprints (``before``, per side)."""
        for side, (now, was) in enumerate(zip(self.today, before)):
            joined = (now.select(["id", "h1", "h2"]).append_column("now", pa.array(np.ones(len(now), bool)))
                      .join(was, keys="id", join_type="full outer"))
            today, earlier = pc.is_valid(joined["now"]), pc.is_valid(joined["old_h1"])
            differs = pc.or_(pc.not_equal(joined["h1"], joined["old_h1"]),
                             pc.not_equal(joined["h2"], joined["old_h2"]))
            both = pc.and_(today, earlier)
            for status, mask in (("inserted", pc.invert(earlier)), ("deleted", pc.invert(today)),
                                 ("changed", pc.and_(both, differs)), ("kept", pc.and_(both, pc.invert(differs)))):
                self.ids[(side, status)] = joined["id"].filter(mask)

    def __call__(self, side: int, *statuses: str) -> int:
        return sum(len(self.ids[(side, s)]) for s in statuses)

    @property
    def here(self) -> bool:
        """Whether today's vectors were collected (the searches run in the driver)."""
        return "v" in self.today[0].column_names

    def rows(self, side: int, ids: pa.Array) -> pa.Table:
        """Today's collected rows of one side (id, h1, h2, length, p, v) whose ids are ``ids``."""
        now = self.today[side]
        return now.filter(pc.is_in(now["id"], value_set=ids))

    def today_rows(self, side: int) -> int:
        return len(self.today[side])

    def array(self, side: int, *statuses: str) -> pa.Array:
        """The ids of these statuses on one side, as one array."""
        return pa.concat_arrays([chunk for s in statuses for chunk in self.ids[(side, s)].chunks]
                                or [pa.array([], self.today[side]["id"].type)])

    def frame(self, spark, side: int, *statuses: str, ids: pa.Array | None = None) -> DataFrame:
        """The ids of these statuses (or ``ids``, of this side's type), broadcast (a local
        relation: no job of its own)."""
        name = _QID if side == 0 else _TID
        ids = self.array(side, *statuses) if ids is None else ids
        return F.broadcast(spark.createDataFrame(pa.table({name: ids}),
                                                 schema=StructType([StructField(name, self.types[side])])))

    def facts(self, side: int, rows: int) -> SideFacts:
        """The planner's facts of a part of today's side of ``rows`` rows (its partitions and
        vector lengths: the whole side's; the bytes of its ids, the one column the searches
        carry beside the vectors and keys, in proportion)."""
        now = self.today[side]
        lengths = pc.min_max(now["length"])
        ids = now["id"].nbytes * rows // max(1, len(now))
        return SideFacts(rows=rows, partitions=pc.max(now["p"]).as_py() + 1 if len(now) else 0,
                         shortest=lengths["min"].as_py(), longest=lengths["max"].as_py(), payload=ids)

    def dimension(self, parsed) -> int | None:
        """Today's one vector length (raises the join's error when the sides' lengths differ)."""
        return join_dimension(parsed, self.facts(0, self.today_rows(0)), self.facts(1, self.today_rows(1)))

    def write_targets(self, path: Path) -> None:
        """Today's target fingerprints: the next run's ``targets/``."""
        path.mkdir(parents=True)
        now = self.today[1]
        pq.write_table(pa.table({_TID: now["id"], _H1: now["h1"], _H2: now["h2"]}), path / "part-00000.parquet")


def _previous_state(spark, state_dir: Path, meta: dict, schemas: dict) -> tuple[dict | None, str]:
    """The committed state's DataFrames and meta when it answers this join; else None and why.

    A state of another join (metric, k, margin, columns) or an unreadable one is not used: a
    full run replaces it. An id type that changed is an error: the inputs are not what the
    state's runs joined (so is a dimension that changed: checked once today's is known)."""
    path = state_dir / META_FILE
    if not path.exists():
        return None, f"no state at {state_dir}"
    try:
        old = json.loads(path.read_text())
        if not isinstance(old, dict):
            raise ValueError("meta.json holds no object")
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
    # (a state written before the approx mode existed has no "approx": None, as an exact one's)
    differing = sorted(key for key in meta if old.get(key) != meta[key])
    if not differing and old.get("schemas") != {name: json.loads(s.json()) for name, s in schemas.items()}:
        differing = ["schemas"]
    if differing:
        logger.warning("state %s answers another join (%s differ): a full run replaces it",
                       state_dir, ", ".join(differing))
        return None, f"the state at {state_dir} answers another join ({', '.join(differing)} differ)"
    unreadable = _unreadable_file(state_dir)
    if unreadable:
        logger.warning("state %s is unreadable (%s): a full run replaces it", state_dir, unreadable)
        return None, f"the state at {state_dir} is unreadable: {unreadable}"
    ivf = old.get("ivf")
    if ivf is not None:
        try:
            ivf = {**ivf, "index": IVFIndex.load(state_dir / _INDEX)}
        except ValueError as exc:
            logger.warning("state %s is unreadable (%s): a full run replaces it", state_dir, exc)
            return None, f"the state at {state_dir} is unreadable: its index: {exc}"
    return {"dimension": old.get("dimension"),
            "generation": old.get("generation", 0), "dir": state_dir, "ivf": ivf}, ""


def _unreadable_file(state_dir: Path) -> str:
    """Why the state's Parquet cannot be read ('' when it can): each file's footer, read here
    (a corrupt file would otherwise fail the run's first Spark job instead of giving a full run)."""
    import pyarrow.parquet as pq

    for part in ("queries", "targets", "dropped"):
        if not (state_dir / part).is_dir():
            if part == "dropped":   # a state of one generation has none
                continue
            return f"{part}/ is missing"
        for path in (state_dir / part).rglob("*.parquet"):
            try:
                pq.read_metadata(path)
            except Exception as exc:   # noqa: BLE001 (any unreadable footer: a full run)
                return f"{path.relative_to(state_dir)}: {type(exc).__name__}"
    return ""


def _cached(df: DataFrame) -> DataFrame:
    """``df`` cached in one partition per core. Spark keeps a cached plan's partitions as its
    last shuffle made them (spark.sql.shuffle.partitions, 200 by default: adaptive execution
    does not coalesce a cached plan), and every later scan of it would run that many tasks."""
    return df.coalesce(cluster_cores(df.sparkSession)).cache()


def _footer_rows(path: Path) -> int:
    """The rows of the Parquet files under ``path`` (0 when there is none), from their footers."""
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(file).num_rows for file in path.rglob("*.parquet")) if path.is_dir() else 0


def _complete_lists(spark, state_dir: Path, schemas: dict) -> DataFrame:
    """The state's query rows: one per query, its complete list (the rows of ``dropped/``
    left out: a row of a query dropped at a later generation than the row's)."""
    rows = spark.read.schema(schemas["queries"]).parquet(str(state_dir / "queries")).where(F.col(_COMPLETE))
    if _footer_rows(state_dir / "dropped"):
        dropped = spark.read.schema(schemas["dropped"]).parquet(str(state_dir / "dropped"))
        dropped = F.broadcast(dropped.select(F.col(_QID).alias("__nj_dq"), _DROPPED_AT))
        rows = rows.join(dropped, (F.col(_QID) == F.col("__nj_dq")) & (F.col(_GEN) < F.col(_DROPPED_AT)),
                         "left_anti")
    return rows.drop("part", _GEN)


# ---------------------------------------------------------------------------- searches
class _Searcher:
    """The search of ``width`` candidates per query (the kernels of nearest_by_join), as
    (query id, its fingerprint, candidate struct(key, target id)) rows: LEFT OUTER, so that a
    query without a candidate has a row too (its candidate's target NULL). Exact, or the IVF
    plan of ``approx`` (the settings of ``mode="approx"``; None in exact mode)."""

    def __init__(self, options: JoinOptions, metric: str, width: int, similarity: bool, n_keys: int):
        self.q_keys = [_key_name("q", i) for i in range(n_keys)]
        self.t_keys = [_key_name("t", i) for i in range(n_keys)]
        self.options = JoinOptions(num_results=width, vectors=(_QV, _TV), distance_col=_KEY, join_type="left",
                                   backend=options.backend, precision=options.precision,
                                   max_distance=options.max_distance, min_similarity=options.min_similarity,
                                   on=list(zip(self.q_keys, self.t_keys)) or None)
        self.approx = None if options.mode == "exact" else {
            "recall": options.recall, "nlist": options.nlist, "nprobe": options.nprobe, "seed": options.seed}
        self.metric, self.width, self.similarity = metric, width, similarity
        self.key_type = FloatType()   # the value column of the vector functions

    def refresh_approx(self, spark, ivf: dict | None, queries: int, targets: int, dimension: int) -> dict | None:
        """The settings of a refresh's search of ``queries`` against the whole target (None:
        exact). With the state's index (``ivf``, as :func:`_previous_state` read it): that
        index at its nprobe, no training and no recall estimate, where the approx plan's own
        rules would run IVF (enough work for its fixed costs, a CPU task: the same thresholds);
        else the exact search, which costs less then and finds every neighbour. Without one
        (exact mode, or a full run whose approx plan ran exact: IVF would not pay) exact."""
        if self.approx is None or ivf is None:
            return None
        from .ivf import IVF_MIN_TARGET_ROWS, IVF_MIN_WORK_PER_CORE
        from .planner import gpu_tasks

        if (targets < IVF_MIN_TARGET_ROWS or queries * targets * dimension < IVF_MIN_WORK_PER_CORE * cluster_cores(spark)
                or gpu_tasks(spark, self.options.backend) is not None):
            return None
        return {**self.approx, "nlist": None, "nprobe": ivf["nprobe"], "index": ivf["index"]}

    def candidates(self, queries: DataFrame, targets: DataFrame, facts: tuple[SideFacts, SideFacts],
                   width: int | None = None, approx: dict | None = None) -> tuple[DataFrame, object]:
        """The rows and their ``PlannedJoin``. ``facts``: both sides' (no facts job; with keys,
        no count of the target's key groups; an approx plan with keys counts them, it sizes
        its lists by the largest group); ``width``: candidates per query, when not the lists'
        width, and then no fingerprints (the entering candidates need none: the query's state
        row keeps its own); ``approx``: the IVF settings (:attr:`approx`), None: exact."""
        options = self.options if width is None else replace(self.options, num_results=width)
        if approx is not None:
            options = replace(options, mode="approx", **approx)
            if self.q_keys:
                facts = None
        fingerprints = [_H1, _H2] if width is None else []
        planned = plan_join(queries.select(_QID, _QV, *fingerprints, *self.q_keys),
                            targets.select(_TID, _TV, *self.t_keys), self.metric, options,
                            facts=facts)
        rows = planned.dataframe(query_columns=(0, *range(2, 2 + len(fingerprints))), target_columns=(0,))
        key = (-F.col(_KEY) if self.similarity else F.col(_KEY)).cast(self.key_type)
        return (rows.select(_QID, *fingerprints, F.struct(key.alias("key"), F.col(_TID).alias("target")).alias("x")),
                planned)

    def candidates_here(self, queries: DataFrame, targets: DataFrame, q_rows: pa.Table, t_rows: pa.Table,
                        width: int | None = None) -> pa.Table:
        """:meth:`candidates` of rows collected to the driver (``q_rows``, ``t_rows``:
        :meth:`_Ids.rows`), searched there by the local plan's functions, no Spark job: an
        Arrow table of (query id, with ``width`` None its fingerprints, key, target), a row of
        NULL key and target for a query without a candidate. ``queries`` and ``targets``:
        today's DataFrames, for the plan (no job)."""
        options = self.options if width is None else replace(self.options, num_results=width)
        fingerprints = [_H1, _H2] if width is None else []
        q_table = pa.table({_QID: q_rows["id"], _QV: q_rows["v"],
                            **{name: q_rows[name.replace("__nj_", "")] for name in fingerprints}})
        planned = plan_join(queries.select(_QID, _QV, *fingerprints), targets.select(_TID, _TV), self.metric,
                            options, arrow=(q_table, pa.table({_TID: t_rows["id"], _TV: t_rows["v"]})))
        rows = planned.arrow_rows(query_columns=(0, *range(2, 2 + len(fingerprints))), target_columns=(0,))
        value = rows.column(rows.num_columns - 1)
        return pa.table({_QID: rows.column(0), **{name: rows.column(1 + i) for i, name in enumerate(fingerprints)},
                         "key": pc.negate(value) if self.similarity else value,
                         "target": rows.column(1 + len(fingerprints))})


def _recall_sample(spark, ids: _Ids, seed: int, generation: int, look: int) -> tuple[DataFrame, int]:
    """The ids of the queries a refresh measures recall on, broadcast, and their count: of a
    seeded order of today's queries (drawn anew each generation), the first
    :data:`RECALL_QUERIES` (``look`` 0) or the next :data:`SECOND_LOOK_QUERIES` (``look`` 1;
    none when the first took them all)."""
    today = ids.today[0]["id"]
    # (a draw of both looks' queries in order, not a permutation of all of today's)
    order = np.random.default_rng([seed, generation]).choice(
        len(today), min(len(today), RECALL_QUERIES + SECOND_LOOK_QUERIES), replace=False)
    start, stop = (0, RECALL_QUERIES) if look == 0 else (RECALL_QUERIES, RECALL_QUERIES + SECOND_LOOK_QUERIES)
    picked = today.take(pa.array(np.sort(order[start:stop])))
    return ids.frame(spark, 0, ids=picked), len(picked)


def _sample_truth(found: DataFrame, sample: DataFrame) -> pa.Table:
    """The (query id, value) rows of an exact search (``found``, :meth:`_Searcher.candidates`'
    rows) of the sampled queries, collected."""
    return (found.join(sample, _QID, "left_semi").where(F.col("x.target").isNotNull())
            .select(_QID, F.col("x.key").alias("key")).toArrow())


def _measured_recall(spark, staging: Path, schemas: dict, sample: tuple[DataFrame, int], truth: pa.Table, k: int,
                     population: int, looks: int = 1) -> dict:
    """recall@k of the staged lists of the sampled queries (``sample``: :func:`_recall_sample`'s,
    drawn from ``population`` queries) against their exact search (``truth``:
    :func:`_sample_truth`): each query's recall is the share of its exact top k that the first
    k of its list match or beat (a tie with the k-th is a hit); the mean and its lower bound
    (:func:`nearest_join.recall.wilson_interval` at :data:`_Z_TWO_LOOKS`, with the
    finite-population correction: a sample of every query is the recall itself). Queries
    without an exact row are left out (of the population too, in proportion, rounded up:
    more than the sample unless it drew every query). ``looks``: the
    second look's pooled sample says so."""
    lists = (_complete_lists(spark, staging, schemas).join(sample[0], _QID, "left_semi")
             .select(_QID, F.explode(F.slice(_LIST, 1, k)).alias("x")).select(_QID, F.col("x.key").alias("key"))
             .toArrow())

    truth = truth.sort_by([(_QID, "ascending"), ("key", "ascending")])
    # Per query: the k-th exact value (or the last, with fewer) and how many exact rows.
    t_ids, t_keys = truth[_QID].to_pylist(), truth["key"].to_numpy(zero_copy_only=False)
    exact: dict = {}
    for qid, key in zip(t_ids, t_keys):
        m = exact.get(qid, (None, 0))[1]
        if m < k:
            exact[qid] = (key, m + 1)
    hits = dict.fromkeys(exact, 0)
    for qid, key in zip(lists[_QID].to_pylist(), lists["key"].to_numpy(zero_copy_only=False)):
        if qid in exact and key <= exact[qid][0]:
            hits[qid] += 1
    per_query = np.array([min(hits[q], m) / m for q, (_, m) in exact.items()])
    queries = len(per_query)
    estimate = float(per_query.mean()) if queries else 1.0
    lower = wilson_interval(estimate, queries, float(per_query.var(ddof=1)) if queries >= 2 else None,
                            population=-(-population * queries // max(1, sample[1])), z=_Z_TWO_LOOKS)[0] \
        if queries else 1.0
    of = f"the refreshed lists, measured on {queries} sampled queries against exact search"
    if looks == 2:
        of += " (a second look: the first sample's bound fell short)"
    return {"recall_estimate": estimate, "recall_lower": lower, "recall_queries": queries, "recall_of": of}


def _lists(candidates: DataFrame, width: int) -> DataFrame:
    """Each query's row of the state from a whole search: its best ``width`` candidates in
    order and their bound (+inf when it holds every target there is), complete."""
    found = F.when(F.col("x.target").isNotNull(), F.col("x"))
    grouped = candidates.groupBy(_QID).agg(F.first(_H1).alias(_H1), F.first(_H2).alias(_H2),
                                           F.array_sort(F.collect_list(found)).alias(_LIST))
    return grouped.select(_QID, _H1, _H2, F.slice(_LIST, 1, width).alias(_LIST),
                          F.when(F.size(_LIST) >= width, F.element_at(_LIST, width)["key"].cast("double"))
                          .otherwise(F.lit(math.inf)).alias(_BOUND), F.lit(True).alias(_COMPLETE))


def _lists_here(found: pa.Table, width: int, list_type: pa.DataType) -> pa.Table:
    """:func:`_lists` of a search in the driver (:meth:`_Searcher.candidates_here`'s rows,
    with fingerprints), as an Arrow table of the state's ``queries/`` columns (``list_type``:
    the state's candidate lists')."""
    rows = found.sort_by([(_QID, "ascending"), ("key", "ascending"), ("target", "ascending")])   # NULLs last
    n = rows.num_rows
    ids = rows[_QID].combine_chunks()
    new_query = np.ones(n, bool)
    if n > 1:
        new_query[1:] = pc.not_equal(ids.slice(1), ids.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(new_query)
    group = np.cumsum(new_query) - 1
    # A query's rows with a candidate come first (a NULL target sorts last), in (key, target) order.
    position = np.arange(n) - starts[group]
    taken = pc.is_valid(rows["target"]).to_numpy(zero_copy_only=False) & (position < width)
    lengths = np.bincount(group[taken], minlength=len(starts))
    key = rows["key"].combine_chunks()
    bound = np.full(len(starts), np.inf)
    full = lengths >= width
    bound[full] = key.take(pa.array(starts[full] + width - 1)).to_numpy(zero_copy_only=False)
    mask = pa.array(taken)
    entries = pa.StructArray.from_arrays([key.filter(mask), rows["target"].combine_chunks().filter(mask)],
                                         fields=list(list_type.value_type))
    first = pa.array(starts)
    return pa.table({_QID: ids.take(first), _H1: rows[_H1].combine_chunks().take(first),
                     _H2: rows[_H2].combine_chunks().take(first),
                     _LIST: pa.ListArray.from_arrays(pa.array(np.r_[0, np.cumsum(lengths)].astype(np.int32)), entries,
                                                     type=list_type),
                     _BOUND: pa.array(bound, pa.float64()), _COMPLETE: pa.array(np.ones(len(starts), bool))})


def _full_run(q_now: DataFrame, t_now: DataFrame, ids: _Ids, search: _Searcher, staging: Path,
              reason: str) -> tuple[Changes, dict | None]:
    """Every query searched whole. Returns what it did and, when its approx plan ran IVF, the
    index's lists and nprobe with the plan's recall estimate (the index saved in ``index/``)."""
    queries, targets = ids.today_rows(0), ids.today_rows(1)
    facts = (ids.facts(0, queries), ids.facts(1, targets))
    rows, planned = search.candidates(q_now, t_now, facts, approx=search.approx)
    _lists(rows, search.width).write.parquet(str(staging / "queries" / f"{_GEN}=0" / "part=searched"))
    ivf = None
    if planned.ivf is not None:
        planned.ivf.index.save(staging / _INDEX)
        info = planned.plan.ivf
        ivf = {"nlist": planned.ivf.index.nlist, "nprobe": planned.ivf.nprobe,
               "recall_estimate": info.get("recall_estimate"),
               "recall_lower": (info.get("recall_interval") or [None])[0],
               "recall_queries": info.get("recall_queries"),
               "recall_of": f"the plan's estimate, of recall@{search.width}"}
    changes = Changes(refreshed=False, reason=reason, queries_inserted=queries, targets_inserted=targets,
                      queries_searched_whole=queries, query_rows=queries, target_rows=targets, recall=ivf)
    return changes, ivf


def _refresh(spark, q_now: DataFrame, t_now: DataFrame, counted: _Ids, previous: dict, search: _Searcher,
             staging: Path, schemas: dict, k: int, generation: int,
             sample: tuple[DataFrame, int] | None) -> tuple[Changes, pa.Table | None]:
    """Today's lists from the state's: see the module notes. Only the kept queries whose list
    meets a change are merged: those holding a removed target, and those that an added target
    enters at or within their bound. The state's query files are carried over as they are
    (hard links); this run's rows go to ``queries/gen=<generation>``, and ``dropped/`` says
    which earlier rows they replace (:func:`_write_dropped`).

    ``sample``: the queries to measure recall on (:func:`_recall_sample`), or None. When the
    search against the whole target is exact, they join it (one pass over the target) and
    their exact rows are returned (:func:`_sample_truth`); else None."""
    width = search.width

    def ids_of(side: int, *statuses: str) -> DataFrame:
        return counted.frame(spark, side, *statuses)

    # The state's lists of the queries kept (those deleted or changed leave), on the driver.
    lists = previous["lists"]
    gone = counted.array(0, "deleted", "changed")
    kept = lists.filter(pc.invert(pc.is_in(lists[_QID], value_set=gone)))
    n_added = counted(1, "inserted", "changed")
    n_kept = counted(0, "kept")
    entering, whole, truth = None, None, None
    entering_width = _entering_width(n_added, counted.today_rows(1), width)
    here = counted.here
    # The ids of the queries Spark's searches search whole (a driver's search takes them as Arrow).
    searched_whole = None if here else ids_of(0, "inserted", "changed")
    if n_added and n_kept and here:
        found = search.candidates_here(q_now, t_now, counted.rows(0, counted.array(0, "kept")),
                                       counted.rows(1, counted.array(1, "inserted", "changed")), entering_width)
        entering = found.filter(pc.is_valid(found["target"])).select([_QID, "key", "target"])
    elif n_added and n_kept:
        added = t_now.join(ids_of(1, "inserted", "changed"), _TID, "left_semi")
        kept_rows = q_now.join(searched_whole, _QID, "left_anti")
        found, _ = search.candidates(kept_rows, added, (counted.facts(0, n_kept), counted.facts(1, n_added)),
                                     entering_width)
        entering = (found.where(F.col("x.target").isNotNull())
                    .select(_QID, F.col("x.key").alias("key"), F.col("x.target").alias("target")).toArrow())
    queries = staging / "queries"
    rows = queries / f"{_GEN}={generation}"
    _carry(previous["dir"] / "queries", queries)
    try:
        # A list that ran short goes to part=short, marked incomplete: its query's whole
        # search is the searched part's, and only complete lists are read (_complete_lists).
        merged = _merged(kept, entering, counted.array(1, "deleted", "changed"), width, k, entering_width)
        for part, mask in (("merged", merged[_COMPLETE]), ("short", pc.invert(merged[_COMPLETE]))):
            chosen = merged.filter(mask)
            if len(chosen):
                (rows / f"part={part}").mkdir(parents=True)
                pq.write_table(chosen, rows / f"part={part}" / "part-00000.parquet")
        short = merged[_QID].filter(pc.invert(merged[_COMPLETE]))
        n_short, n_affected = len(short), merged.num_rows
        if n_short and not here:
            searched_whole = F.broadcast(searched_whole.unionByName(counted.frame(spark, 0, ids=short)))
        n_whole = counted(0, "inserted", "changed") + n_short
        approx = search.refresh_approx(spark, previous["ivf"], n_whole, counted.today_rows(1),
                                       previous["dimension"] or 1)
        fold = sample is not None and approx is None
        if n_whole and here:
            whole_ids = pa.concat_arrays([counted.array(0, "inserted", "changed"), *short.chunks])
            found = search.candidates_here(q_now, t_now, counted.rows(0, whole_ids), counted.today[1])
            (rows / "part=searched").mkdir(parents=True)
            pq.write_table(_lists_here(found, width, kept.schema.field(_LIST).type),
                           rows / "part=searched" / "part-00000.parquet")
        elif n_whole or fold:
            wanted = F.broadcast(searched_whole.unionByName(sample[0])) if fold else searched_whole
            whole_rows = q_now.join(wanted, _QID, "left_semi")
            facts = (counted.facts(0, n_whole + (sample[1] if fold else 0)), counted.facts(1, counted.today_rows(1)))
            found, _ = search.candidates(whole_rows, t_now, facts, approx=approx)
            if fold:
                found = whole = _cached(found)
                truth = _sample_truth(found, sample[0])
                found = found.join(searched_whole, _QID, "left_semi")
            if n_whole:
                _lists(found, width).write.parquet(str(rows / "part=searched"))
    finally:
        if whole is not None:
            whole.unpersist()
    _write_dropped(staging, previous["dir"], rows, counted.ids[(0, "deleted")], generation)
    if (_footer_rows(queries) > COMPACT_ROWS_PER_QUERY * max(1, counted.today_rows(0))
            or len(list(queries.iterdir())) > COMPACT_GENERATIONS):
        _compact(spark, staging, schemas, generation)
    return Changes(refreshed=True, reason="", queries_inserted=counted(0, "inserted"),
                   queries_deleted=counted(0, "deleted"), queries_changed=counted(0, "changed"),
                   queries_kept=n_kept, targets_inserted=counted(1, "inserted"),
                   targets_deleted=counted(1, "deleted"), targets_changed=counted(1, "changed"),
                   queries_searched_whole=n_whole, queries_short=n_short, queries_merged=n_affected,
                   searched_here=here,
                   query_rows=counted.today_rows(0), target_rows=counted.today_rows(1)), truth


def _carry(old: Path, new: Path) -> None:
    """The state's query files, as they are, into the new state: hard links (the files are
    never written again), copies where the filesystem has none."""
    for file in old.rglob("*.parquet"):
        to = new / file.relative_to(old)
        to.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(file, to)
        except OSError:
            shutil.copyfile(file, to)


def _write_dropped(staging: Path, previous: Path, rows: Path, deleted: pa.ChunkedArray, generation: int) -> None:
    """The new state's ``dropped/``: the state's, and each query that this run wrote a row of
    (``rows``) or deleted, dropped at ``generation``: its rows of earlier generations are
    replaced (a query keeps the latest generation it was dropped at)."""
    written = pq.read_table(rows, columns=[_QID])[_QID] if _footer_rows(rows) else deleted.slice(0, 0)
    ids = pa.chunked_array(written.cast(deleted.type).chunks + deleted.chunks, type=deleted.type)
    now = pa.table({_QID: ids, _DROPPED_AT: pa.array(np.full(len(ids), generation, np.int32))})
    before = _dropped(previous)
    if before is not None:
        now = pa.concat_tables([before.cast(now.schema), now])
    # By name: the order of group_by's output columns differs between pyarrow versions.
    latest = now.group_by(_QID).aggregate([(_DROPPED_AT, "max")])
    (staging / "dropped").mkdir()
    pq.write_table(pa.table({_QID: latest[_QID], _DROPPED_AT: latest[f"{_DROPPED_AT}_max"]}),
                   staging / "dropped" / "part-00000.parquet")


def _compact(spark, staging: Path, schemas: dict, generation: int) -> None:
    """Rewrite the staged state's query files as its live complete lists alone (no dropped
    rows, one generation): when the carried files hold too many replaced rows, or too many
    generations."""
    compacted = staging / "compacted"
    _complete_lists(spark, staging, schemas).write.parquet(str(compacted / f"{_GEN}={generation}" / "part=kept"))
    shutil.rmtree(staging / "queries")
    shutil.rmtree(staging / "dropped")
    compacted.rename(staging / "queries")


def _entering_width(added: int, targets: int, width: int) -> int:
    """How many of the added targets the kept queries' search returns per query. A list holds
    its query's nearest ``width`` of ``targets``, so about ``added * width / targets`` of the
    added ones enter it: four times that, at least 3, at most ``width``. A query that more
    enter has its bound tightened to the last returned one (:func:`_merged`), and is searched
    whole when its list then runs short; every other query emits that few rows, not ``width``."""
    return min(width, max(3, math.ceil(4 * added * width / max(1, targets))))


def _merged(kept: pa.Table, entering: pa.Table | None, removed: pa.Array, width: int, k: int,
            entering_width: int) -> pa.Table:
    """The lists of the kept queries that a change meets (on the driver): those holding a
    removed target, and those that an added target enters (``entering``: the kept queries'
    search of the added targets, ``entering_width`` rows per query, as (query id, key,
    target)), within their bound. Each list less its removed targets, merged with its
    entering ones in (key, target) order; its bound; whether it is complete: the rows of the
    state's ``queries/`` (without the partition columns), in ``kept``'s schema."""
    candidates = kept[_LIST].combine_chunks() if kept.num_rows else pa.array([], kept.schema.field(_LIST).type)
    flat = pc.list_flatten(candidates)
    owner = pc.list_parent_indices(candidates).to_numpy(zero_copy_only=False).astype(np.int64)
    old_removed = pc.is_in(flat.field("target"), value_set=removed).to_numpy(zero_copy_only=False)
    bounds = kept[_BOUND].to_numpy(zero_copy_only=False)
    row_of = np.empty(0, np.int64)
    if entering is not None and len(entering):
        at = pc.index_in(entering[_QID], value_set=kept[_QID].combine_chunks()).to_numpy(zero_copy_only=False)
        keys = entering["key"].to_numpy(zero_copy_only=False).astype(np.float64)
        # (every entering query is kept: the search's queries are today's kept ones)
        within = keys <= bounds[at]
        entering, row_of = entering.filter(pa.array(within)), at[within].astype(np.int64)
    affected = np.union1d(owner[old_removed], row_of)
    n = len(affected)
    # The pool: the affected lists' entries not removed (source 0), and the entering (source 1).
    keep_old = ~old_removed & np.isin(owner, affected)

    def both(name: str) -> pa.Array:
        """The pool's column: the old entries' field, then the entering rows' column."""
        old = flat.field(name).filter(pa.array(keep_old))
        new = entering[name].combine_chunks().cast(old.type) if len(row_of) else pa.array([], old.type)
        return pa.concat_arrays([old, new])

    pool = pa.table({
        "row": np.concatenate([owner[keep_old], row_of]), "key": both("key"),
        "target": both("target"),
        "source": np.concatenate([np.zeros(int(keep_old.sum()), np.int8), np.ones(len(row_of), np.int8)]),
    }).sort_by([("row", "ascending"), ("key", "ascending"), ("target", "ascending")])
    group = np.searchsorted(affected, pool["row"].to_numpy())
    sizes = np.bincount(group, minlength=n)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    position = np.arange(len(group)) - starts[group]
    key = pool["key"].to_numpy(zero_copy_only=False).astype(np.float64)
    source = pool["source"].to_numpy()
    added = np.bincount(group, weights=source, minlength=n)
    worst_added = np.full(n, -np.inf)
    np.maximum.at(worst_added, group[source == 1], key[source == 1])
    # The search returned the best entering_width added targets: when all of them entered,
    # the rest of the added rank no better than the last (the bound of the added targets);
    # when fewer entered, the last returned was beyond the list's own bound.
    beyond = np.full(n, np.inf)
    over = sizes > width
    beyond[over] = key[starts[over] + width]
    bound = np.minimum(np.minimum(bounds[affected], np.where(added >= entering_width, worst_added, np.inf)), beyond)
    kept_entry = (position < width) & (key <= bound[group])
    lengths = np.bincount(group[kept_entry], minlength=n)
    entries = pa.StructArray.from_arrays([pool["key"].combine_chunks().filter(pa.array(kept_entry)),
                                          pool["target"].combine_chunks().filter(pa.array(kept_entry))],
                                         fields=list(flat.type))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    rows = pa.array(affected)
    return pa.table({_QID: kept[_QID].take(rows), _H1: kept[_H1].take(rows), _H2: kept[_H2].take(rows),
                     _LIST: pa.ListArray.from_arrays(offsets, entries, type=candidates.type),
                     _BOUND: pa.array(bound, pa.float64()),
                     _COMPLETE: pa.array((lengths >= k) | (bound == np.inf))})


# ---------------------------------------------------------------------------- the result
def _result(query: DataFrame, target: DataFrame, query_id: str, target_id: str, lists: DataFrame, k: int,
            options: JoinOptions, similarity: bool, query_columns=None, target_columns=None) -> DataFrame:
    """The query's columns at ``query_columns``, the target's at ``target_columns`` (None:
    all) and the value column: each query's first ``k`` candidates, joined to today's rows by
    their ids. A side whose only column kept is its id is not joined: every query of today has
    a list (an empty one when it has no candidate), and a list holds today's targets only."""
    q_names, t_names = query.columns, target.columns
    q_kept = list(range(len(q_names)) if query_columns is None else query_columns)
    t_kept = list(range(len(t_names)) if target_columns is None else target_columns)
    for argument, kept, names in (("query_columns", q_kept, q_names), ("target_columns", t_kept, t_names)):
        bad = [c for c in kept
               if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c < len(names)]
        if bad:
            raise ArgumentError(argument, f"expected positions 0 to {len(names) - 1} of the {argument.split('_')[0]}'s "
                                          f"columns ({', '.join(names)}), got {bad[0]!r}")
    q_cols = [f"__nj_q{i}" for i in range(len(q_names))]
    t_cols = [f"__nj_t{i}" for i in range(len(t_names))]
    q_id, t_id = q_cols[q_names.index(query_id)], t_cols[t_names.index(target_id)]
    q_joined = not {q_cols[i] for i in q_kept} <= {q_id}
    t_joined = not {t_cols[i] for i in t_kept} <= {t_id}
    how = "inner" if options.join_type == "inner" else "left"
    # Sliced before the explode: the lists hold k + margin, and the margin's rows would be
    # made only to be filtered out. LEFT OUTER without the query's rows: an empty list is a row.
    explode = F.explode_outer if how == "left" and not q_joined else F.explode
    pairs = (lists.select(_QID, explode(F.slice(_LIST, 1, k)).alias("x"))
             .select(_QID, F.col("x.target").alias(_TID), F.col("x.key").alias(_KEY)))
    if q_joined:
        joined = query.toDF(*q_cols).withColumn(_QID, F.col(q_id)).join(pairs, _QID, how)
    else:
        joined = pairs.withColumn(q_id, F.col(_QID))
    if t_joined:
        joined = joined.join(target.toDF(*t_cols).withColumn(_TID, F.col(t_id)), _TID, how)
    else:
        joined = joined.withColumn(t_id, F.col(_TID))
    value = (-F.col(_KEY) if similarity else F.col(_KEY)).cast("float")
    out = ([F.col(q_cols[i]).alias(q_names[i]) for i in q_kept]
           + [F.col(t_cols[i]).alias(t_names[i]) for i in t_kept])
    if options.distance_col is not None:
        out.append(value.alias(options.distance_col))
    return joined.select(*out)
