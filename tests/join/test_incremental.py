"""The incremental join (issue 43): each day's refreshed result equals a full recompute of that
day's inputs by nearest_by_join, ties aside, after inserts, deletes and updates on both sides;
the state is used only when it answers the join; bad ids fail before anything is written."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from nearest_join import nearest_by_join
from nearest_join import incremental
from nearest_join.incremental import _previous_state, _with_vectors, explain_incremental, incremental_nearest_join

D = 4


def _frame(spark, ids, vectors, id_name, vector_name, payload=None, groups=None):
    rows = [(int(i), None if v is None else [float(x) for x in v], f"p{int(i)}" if payload is None else payload[j])
            + (() if groups is None else (None if groups[j] < 0 else int(groups[j]),))
            for j, (i, v) in enumerate(zip(ids, vectors))]
    schema = f"{id_name} long, {vector_name} array<float>, {id_name}_note string"
    return spark.createDataFrame(rows, schema + ("" if groups is None else ", g int"))


def _by_query(rows, qid, tid, value):
    out = {}
    for r in rows:
        out.setdefault(r[qid], []).append((r[value], r[tid]))
    return {q: sorted(v) for q, v in out.items()}


def _same_up_to_ties(got, want, k, descending):
    """Per query: the same values in order; the same targets except among those tied with the
    k-th value (either may be returned)."""
    assert got.keys() == want.keys()
    for q in want:
        g, w = got[q], want[q]
        assert [v for v, _ in g] == [v for v, _ in w], q
        last = w[-1][0]
        assert {t for v, t in g if v != last} == {t for v, t in w if v != last}, q


class Day:
    """One day's inputs, as numpy arrays the test edits (NaN rows: NULL vectors)."""

    def __init__(self, rng, nq, nt, groups=0):
        self.q_ids, self.t_ids = np.arange(nq), np.arange(1000, 1000 + nt)
        # integer data: many exact ties
        self.q, self.t = rng.integers(-3, 4, (nq, D)).astype(float), rng.integers(-3, 4, (nt, D)).astype(float)
        # on= keys (with groups): -1 is a NULL key
        self.groups = groups
        self.q_g, self.t_g = (rng.integers(-1, groups, nq), rng.integers(-1, groups, nt)) if groups else (None, None)
        self.next_id = 5000

    def _regroup(self, rng, keys, rows, n):
        """``n`` rows of ``keys`` (an update may change a row's key, not its vector), then the
        keys of ``rows`` new rows."""
        keys = keys.copy()
        keys[rng.choice(len(keys), n, replace=False)] = rng.integers(-1, self.groups, n)
        return np.concatenate([keys, rng.integers(-1, self.groups, rows)])

    def change(self, rng, share):
        nt, nq = len(self.t_ids), len(self.q_ids)
        n = max(1, int(share * nt))
        keep = np.ones(nt, bool)
        keep[rng.choice(nt, n, replace=False)] = False                 # deletes
        self.t_ids, self.t = self.t_ids[keep], self.t[keep]
        if self.groups:
            self.t_g = self._regroup(rng, self.t_g[keep], n, n)
        upd = rng.choice(len(self.t_ids), n, replace=False)              # updates
        self.t[upd] = rng.integers(-3, 4, (n, D))
        new = rng.integers(-3, 4, (n, D)).astype(float)                  # inserts
        self.t_ids = np.concatenate([self.t_ids, self.next_id + np.arange(n)])
        self.t = np.concatenate([self.t, new])
        self.next_id += n
        m = max(1, int(share * nq))
        keep = np.ones(nq, bool)
        keep[rng.choice(nq, m, replace=False)] = False
        self.q_ids, self.q = self.q_ids[keep], self.q[keep]
        if self.groups:
            self.q_g = self._regroup(rng, self.q_g[keep], m, m)
        self.q[rng.choice(len(self.q_ids), m, replace=False)] = rng.integers(-3, 4, (m, D))
        self.q_ids = np.concatenate([self.q_ids, self.next_id + np.arange(m)])
        self.q = np.concatenate([self.q, rng.integers(-3, 4, (m, D)).astype(float)])
        self.next_id += m

    def frames(self, spark):
        def vectors(m):
            return [None if np.isnan(row).any() else row for row in m]
        # cached: a DataFrame of Python rows is otherwise deserialised in Python by every job
        frames = (_frame(spark, self.q_ids, vectors(self.q), "qid", "v", groups=self.q_g).cache(),
                  _frame(spark, self.t_ids, vectors(self.t), "tid", "w", groups=self.t_g).cache())
        for frame in frames:
            frame.count()
        return frames


@pytest.mark.parametrize("metric, margin, days, capped", [("l2", 2, 2, False), ("cosine", 0, 3, True)])
def test_each_day_equals_a_full_recompute(spark, tmp_path, monkeypatch, metric, margin, days, capped):
    """Also: the l2 case's first refresh is discarded once, uncommitted (a run that failed
    before its commit): the state stays as it was, and the next run refreshes from it; its
    second day is explained before it runs, and its state is compacted (one generation).
    The cosine case has on= keys (NULL keys among them, rows that change their key and not
    their vector) and a cap, and refreshes a refreshed state, whose files are carried over
    (three generations, and the rows they replace dropped); a state of another cap or other
    keys is not used."""
    if not capped:
        monkeypatch.setattr(incremental, "COMPACT_GENERATIONS", 1)
    rng = np.random.default_rng(7)
    day, k = Day(rng, 60, 300, groups=3 if capped else 0), 3
    day.t[5] = np.nan     # a target without a vector
    day.q[7] = np.nan     # a query without one
    state = tmp_path / "state"
    descending = metric == "cosine"
    joined = dict(vectors=("v", "w"), distance_col="d")
    if capped:
        joined.update(min_similarity=0.5, on="g")
    for n in range(days):
        q, t = day.frames(spark)
        if n == 1 and metric == "l2":
            before = sorted(str(p.relative_to(state)) for p in state.rglob("*"))
            incremental_nearest_join(q, t, metric, k, vectors=("v", "w"), query_id="qid", target_id="tid",
                                     state=str(state), margin=margin).discard()
            assert sorted(str(p.relative_to(state)) for p in state.rglob("*")) == before
            assert [p.name for p in tmp_path.iterdir()] == ["state"]
            plan = explain_incremental(q, t, metric, k, query_id="qid", target_id="tid", state=str(state),
                                       margin=margin, **joined)
        run = incremental_nearest_join(q, t, metric, k, query_id="qid", target_id="tid", state=str(state),
                                       margin=margin, **joined)
        got = run.result.collect()
        # Ids alone (the columns a nightly job of ids writes): neither side is joined, the rows
        # are the same.
        ids_only = run.dataframe(query_columns=(0,), target_columns=(0,))
        assert ids_only.columns == ["qid", "tid", "d"]
        assert sorted(ids_only.collect()) == sorted((r["qid"], r["tid"], r["d"]) for r in got)
        if n == 1 and metric == "l2":   # the explanation said what the run did
            c = run.changes
            assert plan.refresh and plan.reason == ""
            assert plan.searched_here and c.searched_here and "in the driver" in str(plan)
            assert plan.queries == {"inserted": c.queries_inserted, "deleted": c.queries_deleted,
                                    "changed": c.queries_changed, "kept": c.queries_kept}
            assert plan.targets["inserted"] == c.targets_inserted and plan.targets["changed"] == c.targets_changed
            assert plan.queries_searched_whole == c.queries_searched_whole - c.queries_short
            assert (plan.query_rows, plan.target_rows) == (len(day.q_ids), len(day.t_ids))
            added = c.targets_inserted + c.targets_changed
            assert plan.pairs == plan.queries_searched_whole * plan.target_rows + c.queries_kept * added
            assert f"{plan.pairs:,} pairs" in str(plan) and plan.full_pairs == len(day.q_ids) * len(day.t_ids)
        key_column = ["g"] if capped else []
        assert run.result.columns == ["qid", "v", "qid_note", *key_column, "tid", "w", "tid_note", *key_column, "d"]
        full = nearest_by_join(q, t, metric, k, **joined).collect()
        if capped:   # the cap and the keys leave some queries without a row
            assert all(r["d"] >= 0.5 for r in full) and len({r["qid"] for r in full}) < len(day.q_ids)
            assert all(r[3] is not None and r[3] == r[7] for r in got)
        key = (lambda r: -r) if descending else (lambda r: r)
        _same_up_to_ties(_by_query([{**r.asDict(), "d": key(r["d"])} for r in got], "qid", "tid", "d"),
                         _by_query([{**r.asDict(), "d": key(r["d"])} for r in full], "qid", "tid", "d"),
                         k, descending)
        # payload comes from today's rows
        notes = {(r["qid"], r["tid"]): (r["qid_note"], r["tid_note"]) for r in got}
        assert all(a == f"p{qi}" and b == f"p{ti}" for (qi, ti), (a, b) in notes.items())
        assert run.changes.refreshed == (n > 0)
        if n:
            c = run.changes
            # a key change is a change too
            assert (c.targets_inserted, c.targets_deleted) == (3, 3) and c.targets_changed <= (6 if capped else 3)
            assert c.queries_deleted == 1 and c.queries_inserted == 1
            # the kept queries were not searched whole, bar those whose list ran short
            assert c.queries_searched_whole == c.queries_inserted + c.queries_changed + c.queries_short
            assert c.queries_searched_whole < len(day.q_ids)
            assert c.queries_merged >= c.queries_short
        run.commit()
        generations = sorted(p.name for p in (state / "queries").iterdir())
        if capped:
            assert generations == [f"gen={g}" for g in range(n + 1)]
            assert (state / "dropped").is_dir() == (n > 0)
        else:
            assert generations == [f"gen={n}"] and not (state / "dropped").exists()
        q.unpersist(), t.unpersist()
        day.change(rng, 0.01)
    if capped:
        meta = json.loads((state / "meta.json").read_text())
        schemas = {name: StructType.fromJson(schema) for name, schema in meta.pop("schemas").items()}
        meta.pop("dimension")
        assert _previous_state(spark, state, meta, schemas)[0] is not None
        for name, other in (("cap", 0.4), ("keys", None)):
            previous, reason = _previous_state(spark, state, {**meta, name: other}, schemas)
            assert previous is None and name in reason


@pytest.mark.parametrize("here", [True, False], ids=["in the driver", "in spark"])
def test_searches_in_the_driver_and_in_spark_equal_a_full_recompute(spark, tmp_path, monkeypatch, here):
    """An exact refresh without keys searches in the driver, on today's rows collected with
    their fingerprints, unless both sides' vectors would exceed incremental.SEARCH_HERE_BYTES;
    then Spark searches, as a keyed or approx refresh does. Both give each day the rows of a
    full recompute, ties aside: a similarity with a cap (queries with fewer than k within it),
    no margin (lists that run short), NULL vectors on both sides, three days."""
    if not here:
        monkeypatch.setattr(incremental, "SEARCH_HERE_BYTES", 0)
    rng = np.random.default_rng(11)
    day, k = Day(rng, 40, 200), 3
    day.t[3], day.q[4] = np.nan, np.nan
    joined = dict(vectors=("v", "w"), distance_col="d", min_similarity=2.0)
    for n in range(3):
        q, t = day.frames(spark)
        run = incremental_nearest_join(q, t, "inner_product", k, query_id="qid", target_id="tid",
                                       state=str(tmp_path / "state"), margin=0, join_type="left", **joined)
        got = run.dataframe(query_columns=(0,), target_columns=(0,)).collect()
        full = nearest_by_join(q, t, "inner_product", k, join_type="left", **joined).select("qid", "tid", "d").collect()
        assert sorted(r for r in got if r["tid"] is None) == sorted(r for r in full if r["tid"] is None)
        _same_up_to_ties(_by_query([{**r.asDict(), "d": -r["d"]} for r in got if r["tid"] is not None], "qid", "tid", "d"),
                         _by_query([{**r.asDict(), "d": -r["d"]} for r in full if r["tid"] is not None], "qid", "tid", "d"),
                         k, True)
        c = run.changes
        assert c.refreshed == (n > 0) and c.searched_here == (here and n > 0)
        if n:
            assert c.queries_short > 0 and c.queries_merged > 0
        run.commit()
        q.unpersist(), t.unpersist()
        day.change(rng, 0.05)


def _parquet_side(spark, path, ids, vectors, id_name, vector_name):
    """One side as Parquet files of 5, 50 and the rest of its rows, in that order of their
    names: Spark reads the largest first, pyarrow in name order, so a refresh that used the
    files' vectors in Spark's row order would pair them with the wrong ids. Read back with
    the id renamed (a plain scan still)."""
    import pyarrow.parquet as pq

    path.mkdir()
    table = pa.table({"id": pa.array(ids, pa.int64()),
                      "vec": pa.array([None if np.isnan(v).any() else v.tolist() for v in vectors],
                                      pa.list_(pa.float32()))})
    for i, (start, stop) in enumerate(((0, 5), (5, 55), (55, len(ids)))):
        pq.write_table(table.slice(start, stop - start), path / f"part-{i}.parquet")
    return spark.read.parquet(str(path)).select(F.col("id").alias(id_name), F.col("vec").alias(vector_name))


def test_sides_read_from_their_parquet_files_equal_a_full_recompute(spark, tmp_path, monkeypatch):
    """A refresh that searches in the driver reads the vectors of a side that is a plain
    Parquet scan from its files (nearest_join.parquet_scan), not through Spark's collect, and
    pairs them with Spark's ids by id: each day equals a full recompute, ties aside, with NULL
    vectors on both sides. Files that hold an id twice are no plain read: the collect's error."""
    vectors_collected = []
    today = incremental._today
    monkeypatch.setattr(incremental, "_today", lambda df, id_name, vector_name, vectors=False: (
        vectors_collected.append(vectors), today(df, id_name, vector_name, vectors))[1])
    rng = np.random.default_rng(5)
    day, k = Day(rng, 70, 300), 3
    day.t[7], day.q[60] = np.nan, np.nan
    for n in range(3):
        q = _parquet_side(spark, tmp_path / f"q{n}", day.q_ids, day.q, "qid", "v")
        t = _parquet_side(spark, tmp_path / f"t{n}", day.t_ids, day.t, "tid", "w")
        vectors_collected.clear()
        run = incremental_nearest_join(q, t, "l2", k, query_id="qid", target_id="tid", state=str(tmp_path / "state"),
                                       vectors=("v", "w"), distance_col="d")
        got = run.dataframe(query_columns=(0,), target_columns=(0,)).collect()
        full = nearest_by_join(q, t, "l2", k, vectors=("v", "w"), distance_col="d").select("qid", "tid", "d").collect()
        _same_up_to_ties(_by_query(got, "qid", "tid", "d"), _by_query(full, "qid", "tid", "d"), k, False)
        assert run.changes.searched_here == (n > 0) and vectors_collected == [False, False]
        run.commit()
        day.change(rng, 0.05)
    ids = np.concatenate([day.t_ids, day.t_ids[:1]])
    t = _parquet_side(spark, tmp_path / "twice", ids, np.concatenate([day.t, day.t[:1]]), "tid", "w")
    with pytest.raises(ValueError, match=rf"target_id.*`tid`.*id {ids[0]} on 2 rows"):
        incremental_nearest_join(q, t, "l2", k, query_id="qid", target_id="tid", state=str(tmp_path / "state"),
                                 vectors=("v", "w"), distance_col="d")


@pytest.mark.parametrize("id_type", [pa.string(), pa.decimal128(12, 2), pa.int32()], ids=str)
def test_file_vectors_pair_with_the_collected_rows_by_id_or_not_at_all(id_type):
    """_with_vectors: the collected rows (Spark's order) in the files' order with the files'
    vectors; None (the collect then carries the vectors) unless both hold the same ids once
    each with vectors of the lengths Spark read."""
    def ids(values):
        return pa.array([None if v is None else (str(v) if pa.types.is_string(id_type) else v) for v in values],
                        id_type)

    today = pa.table({"id": ids([3, 1, 2]), "h1": [30, 10, 20], "length": pa.array([2, None, 1], pa.int32())})
    vectors = pa.array([None, [2.0], [3.0, 3.5]], pa.list_(pa.float32()))
    got = _with_vectors(today, pa.table({"id": ids([1, 2, 3]), "v": vectors}))
    assert got.column_names == ["id", "h1", "length", "v"]
    assert got["h1"].to_pylist() == [10, 20, 30] and got["v"].to_pylist() == [None, [2.0], [3.0, 3.5]]
    for other_ids in ([1, 2, 4], [1, 2, 2], [1, 2, None]):
        assert _with_vectors(today, pa.table({"id": ids(other_ids), "v": vectors})) is None, other_ids
    longer = pa.array([None, [2.0], [3.0, 3.5, 4.0]], pa.list_(pa.float32()))
    assert _with_vectors(today, pa.table({"id": ids([1, 2, 3]), "v": longer})) is None
    assert _with_vectors(today, None) is None
    empty = _with_vectors(today.slice(0, 0), pa.table({"id": ids([]), "v": vectors.slice(0, 0)}))
    assert empty is not None and empty.num_rows == 0 and empty.column_names[-1] == "v"


def test_a_list_that_runs_short_is_searched_whole(spark, tmp_path):
    """Without a margin, deleting a query's nearest target leaves its list short of k: the
    query is searched against the whole target again (not answered from the short list).
    LEFT OUTER, through the refresh: a query without a vector keeps its NULL row."""
    q = _frame(spark, [1, 2, 3], [[0.0] * D, [100.0] * D, None], "qid", "v")
    t = _frame(spark, range(10, 15), [[float(i)] + [0.0] * (D - 1) for i in range(1, 6)], "tid", "w")
    kwargs = dict(vectors=("v", "w"), query_id="qid", target_id="tid", state=str(tmp_path / "s"), margin=0,
                  join_type="left", distance_col="d")
    incremental_nearest_join(q, t, "l2", 2, **kwargs).commit()
    run = incremental_nearest_join(q, t.where("tid != 10"), "l2", 2, **kwargs)
    rows = sorted((r["qid"], r["tid"], r["d"]) for r in run.result.collect())
    assert rows[:2] == [(1, 11, 2.0), (1, 12, 3.0)] and [r[:2] for r in rows[2:]] == [(2, 13), (2, 14), (3, None)]
    assert rows[4][2] is None
    # LEFT OUTER, the query side not joined (its id alone kept): the query without a vector
    # keeps its NULL row; the target side joined for its note.
    for query_columns, target_columns in (((0,), (0,)), ((0,), (2, 0))):
        kept = run.dataframe(query_columns=query_columns, target_columns=target_columns).collect()
        assert sorted((r["qid"], r["tid"], r["d"]) for r in kept) == rows
        assert all(r["tid_note"] == (None if r["tid"] is None else f"p{r['tid']}") for r in kept) \
            if len(target_columns) > 1 else len(kept[0]) == 3
    with pytest.raises(ValueError, match=r"query_columns.*positions 0 to 2 of the query's columns "
                                         r"\(qid, v, qid_note\), got 3"):
        run.dataframe(query_columns=(0, 3))
    c = run.changes
    assert (c.targets_deleted, c.queries_merged, c.queries_short, c.queries_searched_whole) == (1, 1, 1, 1)


def test_more_entering_than_searched_for_tightens_the_bound(spark, tmp_path):
    """The kept queries' search of the added targets returns a few per query
    (incremental._entering_width), not the lists' width: when all of those enter a list, the
    list's bound becomes the last of them, and a list that then holds fewer than k is searched
    whole. Here five inserted targets are nearer than every old one: four are returned, the
    list keeps those four, fewer than k=5, and the query is searched whole."""
    q = _frame(spark, [1], [[0.0] * D], "qid", "v")
    far = [[10.0 + i] + [0.0] * (D - 1) for i in range(50)]
    near = [[float(i)] + [0.0] * (D - 1) for i in range(1, 6)]
    kwargs = dict(vectors=("v", "w"), query_id="qid", target_id="tid", state=str(tmp_path / "s"), margin=5,
                  distance_col="d")
    incremental_nearest_join(q, _frame(spark, range(100, 150), far, "tid", "w"), "l2", 5, **kwargs).commit()
    assert incremental._entering_width(5, 55, 10) == 4
    t = _frame(spark, range(100, 155), far + near, "tid", "w")
    run = incremental_nearest_join(q, t, "l2", 5, **kwargs)
    assert sorted((r["tid"], r["d"]) for r in run.result.collect()) == [(150 + i, i + 1.0) for i in range(5)]
    c = run.changes
    assert (c.targets_inserted, c.queries_merged, c.queries_short, c.queries_searched_whole) == (5, 1, 1, 1)


def test_ml_vectors_refresh(spark, tmp_path):
    """pyspark.ml vectors (dense and sparse) on both sides, string ids on both sides (the
    driver's merge orders tied candidates by them): a full run, then a refresh after a
    target's vector changed and one was inserted, each equal to nearest_by_join."""
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql.types import StringType, StructField

    def schema(id_name, name):
        id_type = StringType()
        return StructType([StructField(id_name, id_type), StructField(name, VectorUDT())])

    q = spark.createDataFrame([("1", Vectors.dense([0.0, 0.0, 1.0])), ("2", Vectors.sparse(3, [0], [5.0])),
                               ("3", None)],
                              schema("qid", "v")).cache()   # cached: see Day.frames
    rows = [("10", Vectors.dense([1.0, 0.0, 1.0])), ("11", Vectors.sparse(3, [0, 2], [4.0, 1.0])),
            ("12", Vectors.dense([9.0, 9.0, 9.0]))]
    kwargs = dict(vectors=("v", "w"), query_id="qid", target_id="tid", state=str(tmp_path / "s"), margin=1,
                  distance_col="d")
    for day, targets in enumerate((rows, [rows[0], ("11", Vectors.dense([0.0, 0.0, 2.0])), rows[2],
                                          ("13", Vectors.sparse(3, [0], [5.5]))])):
        t = spark.createDataFrame(targets, schema("tid", "w")).cache()
        run = incremental_nearest_join(q, t, "l2", 2, **kwargs)
        got = sorted((r["qid"], r["tid"], r["d"]) for r in run.result.collect())
        full = sorted((r["qid"], r["tid"], r["d"]) for r in
                      nearest_by_join(q, t, "l2", 2, vectors=("v", "w"), distance_col="d").collect())
        assert got == full and len(got) == 4
        assert run.changes.refreshed == (day == 1)
        if day:
            assert (run.changes.targets_changed, run.changes.targets_inserted) == (1, 1)
        run.commit()


def test_bad_ids_and_dimensions_fail_before_anything_is_written(spark, tmp_path):
    state = tmp_path / "s"
    q = _frame(spark, [1, 1], [[0.0] * D, [1.0] * D], "qid", "v")
    t = _frame(spark, [10, 11], [[1.0] * D, [0.0] * D], "tid", "w")
    with pytest.raises(ValueError, match=r"query_id.*`qid`.*id 1 on 2 rows"):
        incremental_nearest_join(q, t, "l2", 1, vectors=("v", "w"), query_id="qid", target_id="tid", state=str(state))
    with pytest.raises(ValueError, match=r"target_id.*expected the name of a column"):
        incremental_nearest_join(q, t, "l2", 1, vectors=("v", "w"), query_id="qid", target_id="id", state=str(state))
    assert not state.exists() and not list(tmp_path.iterdir())
    q = _frame(spark, [1, 2], [[0.0] * D, [1.0] * D], "qid", "v")
    incremental_nearest_join(q, t, "l2", 1, vectors=("v", "w"), query_id="qid", target_id="tid",
                             state=str(state)).commit()
    snapshot = sorted(p.name for p in state.rglob("*"))
    t3 = spark.createDataFrame([(10, [1.0, 2.0, 3.0])], "tid long, w array<float>")
    q3 = spark.createDataFrame([(1, [1.0, 2.0, 3.0])], "qid long, v array<float>")
    with pytest.raises(ValueError, match="dimension 3.*dimension 4"):
        incremental_nearest_join(q3, t3, "l2", 1, vectors=("v", "w"), query_id="qid", target_id="tid", state=str(state))
    t_str = t.withColumn("tid", F.col("tid").cast("string"))
    with pytest.raises(ValueError, match="target_id.*type is string.*type bigint"):
        incremental_nearest_join(q, t_str, "l2", 1, vectors=("v", "w"), query_id="qid", target_id="tid",
                                 state=str(state))
    assert sorted(p.name for p in state.rglob("*")) == snapshot
    assert [p.name for p in tmp_path.iterdir()] == ["s"]
    assert json.loads((state / "meta.json").read_text())["dimension"] == D
    # A state of another join, or an unreadable one, is not used: the run is a full one.
    meta = json.loads((state / "meta.json").read_text())
    schemas = {name: StructType.fromJson(schema) for name, schema in meta.pop("schemas").items()}
    meta.pop("dimension")
    previous, reason = _previous_state(spark, state, {**meta, "num_results": 2}, schemas)
    assert previous is None and "num_results" in reason
    assert _previous_state(spark, state, meta, schemas)[0] is not None
    part = next((state / "targets").glob("*.parquet"))
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])           # a file cut short
    previous, reason = _previous_state(spark, state, meta, schemas)
    assert previous is None and "unreadable" in reason and part.name in reason
    part.write_bytes(data)
    (state / "meta.json").write_text("{not json")
    previous, reason = _previous_state(spark, state, meta, schemas)
    assert previous is None and "unreadable" in reason


def test_docstring_example_runs(spark, tmp_path):
    import doctest

    import nearest_join.incremental as module

    result = doctest.testmod(module, extraglobs={"spark": spark, "tmp": tmp_path}, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0


def test_approx_with_nprobe_given_promises_no_recall_and_does_not_retrain(spark, tmp_path):
    """mode="approx" with nprobe given: nearest_by_join estimates no recall then, and a refresh
    promises none either. It measures recall and reports it, but a measurement below the
    default target (0.95; here on all twelve queries, so the recall itself) is no reason for a
    full run: the night stays a refresh, its values exact."""
    rng = np.random.default_rng(5)
    q, t = rng.normal(0, 1, (12, D)), rng.normal(0, 1, (400, D))
    q_ids, t_ids = np.arange(12), np.arange(1000, 1400)
    kwargs = dict(vectors=("v", "w"), query_id="qid", target_id="tid", state=str(tmp_path / "state"),
                  distance_col="d", mode="approx", nlist=8, nprobe=2)
    first = incremental_nearest_join(_frame(spark, q_ids, q, "qid", "v"), _frame(spark, t_ids, t, "tid", "w"),
                                     "l2", 3, **kwargs)
    first.commit()
    assert first.changes.recall["nprobe"] == 2 and first.changes.recall["recall_estimate"] is None
    t[:20] = rng.normal(0, 1, (20, D))
    plan = explain_incremental(_frame(spark, q_ids, q, "qid", "v"), _frame(spark, t_ids, t, "tid", "w"), "l2", 3,
                               **{a: b for a, b in kwargs.items() if a != "distance_col"})
    assert "sampled queries, and reported (nprobe given: no recall promised, no re-training)" in str(plan)
    night = incremental_nearest_join(_frame(spark, q_ids, q, "qid", "v"), _frame(spark, t_ids, t, "tid", "w"),
                                     "l2", 3, **kwargs)
    rows = night.result.collect()
    night.commit()
    assert night.changes.refreshed and night.changes.reason == ""
    assert night.changes.recall["recall_queries"] == 12 and night.changes.recall["recall_lower"] < 0.95
    for r in rows:   # exact values of the pairs returned (float64, difference form)
        want = np.linalg.norm(np.float32(q[r["qid"]]).astype(np.float64) - np.float32(t[r["tid"] - 1000]))
        assert r["d"] == pytest.approx(want, rel=1e-6), (r["qid"], r["tid"])
    assert sorted({r["qid"] for r in rows}) == list(range(12))


def test_approx_keeps_its_index_and_measures_recall(spark, tmp_path, monkeypatch):
    """mode="approx": the full run's IVF index is kept in the state and reused by the refresh
    (the same centroids and nprobe), whose recall@k is measured on a sample of today's queries
    (here all of them: the measurement must equal the recall against nearest_by_join's exact
    rows) and whose every returned value is exact; a refresh measured below the target re-trains
    the index (a full run, and it says why); a state of the exact mode is not used."""
    from nearest_join.ivf_index import IVFIndex

    rng = np.random.default_rng(3)
    centres = rng.normal(0, 10, (30, D))

    def points(n):
        return centres[rng.integers(0, 30, n)] + rng.normal(0, 1, (n, D))

    q, t = points(300), points(3000)
    q_ids, t_ids = np.arange(300), np.arange(10_000, 13_000)
    state, k = tmp_path / "state", 3
    kwargs = dict(vectors=("v", "w"), query_id="qid", target_id="tid", state=str(state), distance_col="d",
                  mode="approx", nlist=16, recall=0.9)

    def frames():
        return (_frame(spark, q_ids, q, "qid", "v").cache(), _frame(spark, t_ids, t, "tid", "w").cache())

    def recall_and_values(rows, exact, q_frame, t_frame):
        by_id = dict(zip(t_ids.tolist(), t)), dict(zip(q_ids.tolist(), q))
        for r in rows:   # exact values of the pairs returned (float64 oracle, difference form)
            want = np.linalg.norm(np.float32(by_id[1][r["qid"]]).astype(np.float64)
                                  - np.float32(by_id[0][r["tid"]]).astype(np.float64))
            assert r["d"] == pytest.approx(want, rel=1e-6), (r["qid"], r["tid"])
        got, want = _by_query(rows, "qid", "tid", "d"), _by_query(exact, "qid", "tid", "d")
        per_query = [min(sum(v <= w[-1][0] for v, _ in got.get(qid, [])), len(w)) / len(w) for qid, w in want.items()]
        return float(np.mean(per_query))

    Q, T = frames()
    first = incremental_nearest_join(Q, T, "l2", k, **kwargs)
    first.result.collect()
    first.commit()
    assert first.changes.recall["nlist"] == 16 and first.changes.recall["recall_lower"] >= 0.9
    index = IVFIndex.load(state / "index")
    assert json.loads((state / "meta.json").read_text())["ivf"] == {"nlist": 16, "nprobe": first.changes.recall["nprobe"]}
    # a day's changes: targets deleted, moved and inserted, queries moved and inserted
    t = np.concatenate([np.delete(t, np.arange(60), axis=0), points(60)])
    t[rng.choice(len(t), 60, replace=False)] = points(60)
    t_ids = np.concatenate([np.delete(t_ids, np.arange(60)), 20_000 + np.arange(60)])
    q[rng.choice(300, 6, replace=False)] = points(6)
    q, q_ids = np.concatenate([q, points(6)]), np.concatenate([q_ids, 1000 + np.arange(6)])
    Q, T = frames()
    plan = explain_incremental(Q, T, "l2", k, **{a: b for a, b in kwargs.items() if a != "distance_col"})
    assert "the state's index (nlist=16)" in str(plan) and "306 sampled queries" in str(plan)
    exact = nearest_by_join(Q, T, "l2", k, vectors=("v", "w"), distance_col="d").collect()
    # The queries searched whole: with the index where the approx plan's thresholds say IVF
    # pays (here forced: the sample then has an exact search of its own), else exactly (the
    # sample joins that search).
    settings = []
    refresh_approx = incremental._Searcher.refresh_approx
    monkeypatch.setattr(incremental._Searcher, "refresh_approx",
                        lambda *a: settings.append(refresh_approx(*a)) or settings[-1])
    for ivf in (True, False):
        with monkeypatch.context() as m:
            if ivf:
                m.setattr("nearest_join.ivf.IVF_MIN_TARGET_ROWS", 0)
                m.setattr("nearest_join.ivf.IVF_MIN_WORK_PER_CORE", 0)
            run = incremental_nearest_join(Q, T, "l2", k, **kwargs)
        assert (settings[-1] is not None) == ivf and (not ivf or settings[-1]["index"].nlist == 16)
        rows = run.result.collect()
        c = run.changes
        assert c.refreshed and c.queries_searched_whole < 306 and c.recall["recall_queries"] == 306
        assert c.recall["recall_estimate"] == pytest.approx(recall_and_values(rows, exact, Q, T), abs=1e-12)
        assert c.recall["recall_estimate"] >= 0.9 and len(rows) == 306 * k
        if ivf:
            run.discard()
    run.commit()
    assert np.array_equal(IVFIndex.load(state / "index").centroids, index.centroids)
    # A first sample too small to bound the recall above the target (20 of 306 queries): a
    # second look at the others, and on all of them the measurement is the recall itself, no
    # interval. The index is kept (before the second look: a full run).
    with monkeypatch.context() as m:
        m.setattr(incremental, "RECALL_QUERIES", 20)
        m.setattr(incremental, "SECOND_LOOK_QUERIES", 1000)
        run = incremental_nearest_join(Q, T, "l2", k, **kwargs)
    c = run.changes
    assert c.refreshed and c.reason == "" and c.recall["recall_queries"] == 306, c
    assert "a second look" in c.recall["recall_of"] and c.recall["recall_lower"] == c.recall["recall_estimate"]
    assert c.recall["recall_estimate"] == pytest.approx(recall_and_values(run.result.collect(), exact, Q, T), abs=1e-12)
    run.discard()
    # measured below the target: the index is re-trained, a full run
    monkeypatch.setattr(incremental, "_measured_recall", lambda *a, **kw: {
        "recall_estimate": 0.5, "recall_lower": 0.45, "recall_queries": 306, "recall_of": "the test"})
    run = incremental_nearest_join(Q, T, "l2", k, **kwargs)
    assert not run.changes.refreshed and "0.4500 < recall=0.9: index re-trained" in run.changes.reason
    assert run.changes.recall["recall_of"].startswith("the plan's estimate")
    assert recall_and_values(run.result.collect(), exact, Q, T) >= 0.9
    run.discard()
    # a state of the exact mode, or of other approx settings, is not used
    meta = json.loads((state / "meta.json").read_text())
    schemas = {name: StructType.fromJson(schema) for name, schema in meta.pop("schemas").items()}
    for key in ("dimension", "generation", "ivf"):
        meta.pop(key)
    assert _previous_state(spark, state, meta, schemas)[0]["ivf"]["nprobe"] == first.changes.recall["nprobe"]
    for other in (None, {**meta["approx"], "recall": 0.95}):
        previous, reason = _previous_state(spark, state, {**meta, "approx": other}, schemas)
        assert previous is None and "approx differ" in reason


def test_approx_whose_full_run_ran_exact_refreshes_exactly(spark, tmp_path, monkeypatch):
    """mode="approx" on a target too small for IVF: the full run's plan runs exact, the state
    keeps no index, and the refresh searches exactly (no approx plan, no recall to measure)."""
    t_rows = [[float(i), float(i % 3)] + [0.0] * (D - 2) for i in range(30)]
    q = _frame(spark, [1, 2], [[0.0] * D, [9.0] + [0.0] * (D - 1)], "qid", "v")
    kwargs = dict(vectors=("v", "w"), query_id="qid", target_id="tid", state=str(tmp_path / "s"), margin=1,
                  distance_col="d", mode="approx", recall=0.9)
    first = incremental_nearest_join(q, _frame(spark, range(100, 130), t_rows, "tid", "w"), "l2", 2, **kwargs)
    first.result.collect()
    first.commit()
    assert first.changes.recall is None and not (tmp_path / "s" / "index").exists()
    t = _frame(spark, range(101, 131), t_rows[1:] + [[0.5] + [0.0] * (D - 1)], "tid", "w")
    q = _frame(spark, [1, 2], [[0.0] * D, [19.0] + [0.0] * (D - 1)], "qid", "v")   # query 2 moved
    plan = explain_incremental(q, t, "l2", 2, **{a: b for a, b in kwargs.items() if a != "distance_col"})
    assert "the state's lists are exact" in str(plan)
    settings = []
    candidates = incremental._Searcher.candidates
    monkeypatch.setattr(incremental._Searcher, "candidates",
                        lambda self, *a, **kw: settings.append(kw.get("approx")) or candidates(self, *a, **kw))
    run = incremental_nearest_join(q, t, "l2", 2, **kwargs)
    assert len(settings) == 2 and settings == [None, None]   # the added targets, the whole searches
    got = sorted((r["qid"], r["tid"], r["d"]) for r in run.result.collect())
    assert run.changes.refreshed and run.changes.recall is None
    assert got == sorted((r["qid"], r["tid"], r["d"]) for r in
                         nearest_by_join(q, t, "l2", 2, vectors=("v", "w"), distance_col="d").collect())


def test_the_searches_facts_count_the_ids_that_travel_with_the_vectors():
    """The planner's memory cap counts a broadcast target's other columns with its vectors
    (nearest_join.planner.choose_plan): a refresh's searches carry each side's id, and the
    facts it hands them (no facts job of their own) say how many bytes of ids a part of
    that side holds."""
    import pyarrow as pa
    from pyspark.sql.types import LongType, StringType

    def side(ids):
        n = len(ids)
        return pa.table({"id": ids, "h1": pa.array(np.zeros(n, np.int64)), "h2": pa.array(np.zeros(n, np.int64)),
                         "length": pa.array(np.full(n, 4, np.int32)), "p": pa.array(np.arange(n) % 3, pa.int32())})

    longs = pa.array(np.arange(1000, dtype=np.int64))
    names = pa.array([f"target-{i:06d}" for i in range(1000)])
    ids = incremental._Ids((side(longs), side(names)), (LongType(), StringType()))
    assert ids.facts(0, 1000).payload == 8000 and ids.facts(0, 10).payload == 80
    assert ids.facts(1, 1000).payload == names.nbytes and 13_000 < names.nbytes
    assert (ids.facts(1, 500).rows, ids.facts(1, 500).partitions, ids.facts(1, 500).longest) == (500, 3, 4)
