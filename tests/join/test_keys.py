"""on= keys through nearest_by_join and explain_nearest_join (issue 22): each query row's k
nearest target rows among those whose keys are equal, checked against the float64 oracle one
query at a time over its key group (tests.oracle.assert_capped_topk, with or without a cap),
and against Spark's own formulation (an equi-join ranked by a window); then the errors.

Keys are small sets with NULLs on both sides, a key only the query has and one only the
target has, so every case of "no candidate" occurs; k exceeds some groups.
"""
from __future__ import annotations

import datetime

import numpy as np
import pytest
from pyspark.sql import Window
from pyspark.sql import functions as F

from nearest_join import explain_nearest_join, nearest_by_join
from nearest_join.errors import ArgumentError
from nearest_join.options import JoinOptions
from tests.oracle import (
    assert_capped_topk,
    assert_same_neighbours,
    group_rows,
    join_arrays,
    operator_rtol,
)
from udfs.search import GroupSegments, grouped_search

SIMILARITY = ("cosine", "inner_product")
SPARK_FUNCTION = {"l2": F.vector_l2_distance, "cosine": F.vector_cosine_similarity,
                  "inner_product": F.vector_inner_product}
NQ, NT, D, K = 36, 90, 3, 4
# Query keys: "d" only on the query side; target keys: "e" only on the target side.
Q_KEYS = ["a", "b", "c", "d", None]
T_KEYS = ["a", "a", "a", "b", "b", "c", "e", None]


def _vectors(seed: int):
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((NQ, D)) + 0.5).astype(np.float32),
            (rng.standard_normal((NT, D)) + 0.5).astype(np.float32))


def _keys(seed: int):
    rng = np.random.default_rng(seed)
    q_keys = [Q_KEYS[i] for i in rng.integers(0, len(Q_KEYS), NQ)]
    t_keys = [T_KEYS[i] for i in rng.integers(0, len(T_KEYS), NT)]
    # group "c" smaller than k: its queries get fewer than k rows
    c_rows = [j for j, key in enumerate(t_keys) if key == "c"]
    for j in c_rows[2:]:
        t_keys[j] = "a"
    return q_keys, t_keys


@pytest.fixture(scope="module")
def data():
    queries, targets = _vectors(23)
    q_keys, t_keys = _keys(24)
    return queries, targets, q_keys, t_keys


@pytest.fixture(scope="module")
def frames(spark, data):
    queries, targets, q_keys, t_keys = data
    q = spark.createDataFrame([(i, q_keys[i], r.tolist()) for i, r in enumerate(queries)],
                              "qid int, k string, qv array<float>")
    t = spark.createDataFrame([(j, t_keys[j], r.tolist()) for j, r in enumerate(targets)],
                              "tid int, k string, tv array<float>")
    return q.repartition(3).cache(), t.repartition(2).cache()


def _equal(a, b) -> bool:
    """SQL equality of keys (tuples for composite keys): a NULL part matches nothing."""
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return None not in a and None not in b and a == b


def _cap_argument(metric: str, cap: float | None) -> dict:
    if cap is None:
        return {}
    return {"min_similarity": cap} if metric in SIMILARITY else {"max_distance": cap}


def check_keyed(rows, queries, targets, q_keys, t_keys, metric, k, join_type, cap=None, case=""):
    """Every query against the oracle over its own key group (within the cap, if any)."""
    grouped = group_rows(rows, lambda r: r["qid"], lambda r: r["tid"], lambda r: r["d"])
    assert set(grouped) <= set(range(len(q_keys))), case
    unbounded = -np.inf if metric in SIMILARITY else np.inf
    for i, key in enumerate(q_keys):
        allowed = [j for j, t_key in enumerate(t_keys) if _equal(key, t_key)]
        mine = grouped.get(i, [])
        if allowed:
            values, indices = join_arrays({i: mine}, k, metric, [i], allowed, case)
            assert_capped_topk(queries[i:i + 1], targets[allowed], k, metric,
                               unbounded if cap is None else cap, values.astype(np.float32), indices,
                               operator_rtol, case=f"{case} query {i} key {key!r}")
            found = [t for _, t in mine if t is not None]
        else:
            found = []
        if not found:   # no candidate (no group, NULL key, or none within the cap)
            expected = [(None, None)] if join_type == "leftouter" else []
            assert mine == expected, f"{case} query {i} key {key!r}: {mine}"


@pytest.mark.parametrize("join_type", ["inner", "leftouter"])
@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "cosine", "inner_product"])
def test_keyed_join_against_oracle(spark, data, frames, metric, join_type):
    queries, targets, q_keys, t_keys = data
    q, t = frames
    rows = nearest_by_join(q, t, metric, K, vectors=("qv", "tv"), distance_col="d", join_type=join_type,
                           on="k").collect()
    check_keyed(rows, queries, targets, q_keys, t_keys, metric, K, join_type, case=join_type)
    # not vacuous: some queries get k rows, some fewer (group "c" is smaller than k), some none
    found = group_rows([r for r in rows if r["tid"] is not None], lambda r: r["qid"], lambda r: r["tid"],
                       lambda r: r["d"])
    sizes = {len(v) for v in found.values()}
    assert K in sizes and min(sizes) < K and len(found) < NQ


@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "cosine", "inner_product"])
def test_keyed_join_with_a_cap(spark, data, frames, metric):
    queries, targets, q_keys, t_keys = data
    q, t = frames
    # A cap near the median pair value: some queries keep fewer than k of their group, some none.
    from tests.oracle import key_values, oracle_keys

    values = np.sort(key_values(oracle_keys(queries, targets, metric), metric).ravel())
    mid = values.size // 4 if metric in SIMILARITY else values.size // 8
    at = (values.size - 1 - mid) if metric in SIMILARITY else mid
    cap = float((values[at] + values[at + 1]) / 2)
    rows = nearest_by_join(q, t, metric, K, vectors=("qv", "tv"), distance_col="d", join_type="leftouter",
                           on=["k"], **_cap_argument(metric, cap)).collect()
    check_keyed(rows, queries, targets, q_keys, t_keys, metric, K, "leftouter", cap=cap, case=f"cap {cap}")


def _typed_frames(spark, data, q_type, t_type, convert):
    queries, targets, q_keys, t_keys = data
    q = spark.createDataFrame([(i, convert(q_keys[i]), r.tolist()) for i, r in enumerate(queries)],
                              f"qid int, qk {q_type}, qv array<float>")
    t = spark.createDataFrame([(j, convert(t_keys[j]), r.tolist()) for j, r in enumerate(targets)],
                              f"tid int, tk {t_type}, tv array<float>")
    return q.repartition(2).cache(), t


CODES = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}


@pytest.mark.parametrize("q_type, t_type, convert", [
    ("int", "int", lambda key: CODES.get(key)),
    ("int", "bigint", lambda key: CODES.get(key)),       # cast to bigint, as SQL's = would
    ("date", "date", lambda key: None if key is None else datetime.date(2024, 1, CODES[key])),
], ids=["int", "int-bigint", "date"])
def test_key_types(spark, data, q_type, t_type, convert):
    queries, targets, q_keys, t_keys = data
    q, t = _typed_frames(spark, data, q_type, t_type, convert)
    rows = nearest_by_join(q, t, F.vector_l2_distance(q.qv, t.tv), K, distance_col="d", on=[("qk", "tk")],
                           join_type="left").collect()
    check_keyed(rows, queries, targets, q_keys, t_keys, "l2", K, "leftouter", case=q_type)


def test_two_column_key_and_the_column_forms(spark, data):
    queries, targets, q_keys, t_keys = data
    rng = np.random.default_rng(25)
    q_second = [int(v) for v in rng.integers(0, 2, NQ)]
    t_second = [None if v == 2 else int(v) for v in rng.integers(0, 3, NT)]
    q = spark.createDataFrame([(i, q_keys[i], q_second[i], r.tolist()) for i, r in enumerate(queries)],
                              "qid int, k string, n int, qv array<float>")
    t = spark.createDataFrame([(j, t_keys[j], t_second[j], r.tolist()) for j, r in enumerate(targets)],
                              "tid int, tk string, m int, tv array<float>")
    composite_q = list(zip(q_keys, q_second))
    composite_t = list(zip(t_keys, t_second))
    ranking = F.vector_cosine_similarity(q.qv, t.tv)
    for on in ([("k", "tk"), ("n", "m")], (q.k == t.tk) & (q.n == t.m), (t.m == q.n) & (q.k == t.tk)):
        rows = nearest_by_join(q, t, ranking, K, distance_col="d", on=on, join_type="left").collect()
        check_keyed(rows, queries, targets, composite_q, composite_t, "cosine", K, "leftouter", case=str(on))
    # one equality as a Column
    rows = nearest_by_join(q, t, ranking, K, distance_col="d", on=q.k == t.tk).collect()
    check_keyed(rows, queries, targets, q_keys, t_keys, "cosine", K, "inner", case="q.k == t.tk")


@pytest.mark.parametrize("metric, capped", [("l2", False), ("l2", True), ("cosine", True), ("inner_product", False)])
def test_matches_spark_window_formulation(spark, frames, metric, capped):
    q, t = frames
    descending = metric in SIMILARITY
    cap = None
    if capped:
        cap = {"l2": 1.5, "cosine": 0.6, "inner_product": 0.8}[metric]
    ranking = SPARK_FUNCTION[metric](q.qv, t.tv)
    ours = nearest_by_join(q, t, ranking, K, distance_col="d", join_type="left_outer", on=q.k == t.k,
                           **_cap_argument(metric, cap)).collect()
    order = F.col("d").desc() if descending else F.col("d").asc()
    pairs = q.join(t, "k").withColumn("d", SPARK_FUNCTION[metric](F.col("qv"), F.col("tv")))
    if cap is not None:
        pairs = pairs.where(F.col("d") >= cap if descending else F.col("d") <= cap)
    ranked = (pairs.withColumn("r", F.row_number().over(Window.partitionBy("qid").orderBy(order, "tid")))
              .where(F.col("r") <= K))
    theirs = q.join(ranked.select("qid", "tid", "d"), "qid", "left").collect()
    key = (lambda r: r["qid"], lambda r: r["tid"], lambda r: r["d"])
    assert_same_neighbours(group_rows(ours, *key), group_rows(theirs, *key), descending)


def test_explain_shows_the_keys(spark, data, frames):
    _, _, _, t_keys = data
    q, t = frames
    plan = explain_nearest_join(q, t, "l2", 3, vectors=("qv", "tv"), on="k")
    sizes = {key: t_keys.count(key) for key in set(t_keys) if key is not None}
    assert (plan.keys, plan.key_groups, plan.largest_group) == ([["k", "k", "string"]], len(sizes),
                                                                max(sizes.values()))
    text = str(plan)
    assert (f"keys: query.k = target.k (as string); {len(sizes)} target groups, the largest "
            f"{max(sizes.values())} rows") in text
    assert "the broadcast target is grouped by key" in text
    assert plan.to_dict()["keys"] == [["k", "k", "string"]]
    plain = explain_nearest_join(q, t, "l2", 3, vectors=("qv", "tv"))
    assert plain.keys is None and "keys:" not in str(plain)


@pytest.mark.parametrize("on, text", [
    (3, "expected None, a column name present on both sides"),
    ([], "got []"),
    ([("k",)], "(item ('k',))"),
    (["k", "k"], "each pair once"),
    ("", "got ''"),
])
def test_bad_on_shapes(on, text):
    with pytest.raises(ArgumentError) as info:
        JoinOptions(on=on)
    assert info.value.argument == "on" and text in str(info.value), str(info.value)


def test_on_normalised():
    assert JoinOptions(on="k").on == (("k", "k"),)
    assert JoinOptions(on=["a", ("b", "c")]).on == (("a", "a"), ("b", "c"))


def test_bad_on_against_the_frames(spark, frames):
    q, t = frames
    maps_q = spark.createDataFrame([(0, {"a": 1}, [0.0])], "qid int, mk map<string,int>, qv array<float>")
    maps_t = spark.createDataFrame([(0, {"a": 1}, [0.0])], "tid int, mk map<string,int>, tv array<float>")
    cases = [
        (q, t, "missing", "query column 'missing' not found (query columns: ['qid', 'k', 'qv'])"),
        (q, t, [("k", "nope")], "target column 'nope' not found (target columns: ['tid', 'k', 'tv'])"),
        (q, t, q.k > t.k, "expected an equality between one query column and one target column"),
        (q, t, q.k == q.qid, "whose columns all resolve on the query alone"),
        (q, t, t.k == F.lit("a"), "expected an equality between one query column and one target column"),
        (maps_q, maps_t, "mk", ("expected key columns Spark can compare for equality, got query column 'mk' "
                                "of type map<string,int>")),
    ]
    for query, target, on, text in cases:
        for call in (nearest_by_join, explain_nearest_join):
            with pytest.raises(ArgumentError) as info:
                call(query, target, "l2", 2, vectors=("qv", "tv"), on=on)
            assert info.value.argument == "on" and text in str(info.value), str(info.value)


def test_keys_take_the_blocked_plan_too(spark, data, frames):
    # A target too large to broadcast takes the keyed blocked plan (tests/join/test_keyed_blocked.py
    # forces its split path); here its plain case: the same rows as the broadcast plan's.
    queries, targets, q_keys, t_keys = data
    q, t = frames
    rows = nearest_by_join(q, t, "l2", K, vectors=("qv", "tv"), distance_col="d", on="k",
                           join_type="left", broadcast_limit_bytes=0).collect()
    check_keyed(rows, queries, targets, q_keys, t_keys, "l2", K, "leftouter", case="blocked")


@pytest.mark.parametrize("metric, capped", [("l2", False), ("cosine", True), ("inner_product", False)])
def test_keys_with_the_query_blocks_broadcast(spark, data, frames, monkeypatch, metric, capped):
    """Few queries against a large target (the thresholds lowered so that these sizes take it):
    the query blocks are broadcast, each target partition's streamed rows are grouped by key
    and searched there, and the partials merged; the target in 64 partitions, most empty, one
    holding most rows, several blocks per task; left outer, a cap."""
    from nearest_join import planner

    monkeypatch.setattr(planner, "QUERY_BROADCAST_MIN_TARGET_BYTES", 0)
    monkeypatch.setattr(planner, "QUERY_BROADCAST_RATIO", 0)
    queries, targets, q_keys, t_keys = data
    q, t = frames
    t = t.repartition(64, F.when(F.col("tid") < NT // 2, 0).otherwise(F.col("tid")))
    cap = None
    if capped:
        from tests.oracle import key_values, oracle_keys

        values = np.sort(key_values(oracle_keys(queries, targets, metric), metric).ravel())
        at = values.size - 1 - values.size // 4 if metric in SIMILARITY else values.size // 8
        cap = float((values[at] + values[at + 1]) / 2)
    options = dict(vectors=("qv", "tv"), on="k", join_type="left", query_block_rows=20, target_block_rows=15,
                   **_cap_argument(metric, cap))
    plan = explain_nearest_join(q, t, metric, K, **options)
    assert plan.plan == "blocked" and plan.queries_broadcast and plan.keys is not None
    rows = nearest_by_join(q, t, metric, K, distance_col="d", **options).collect()
    check_keyed(rows, queries, targets, q_keys, t_keys, metric, K, "leftouter", cap=cap, case=f"{metric} {cap}")


def test_keys_with_a_ranking_spark_runs_is_an_error(spark, frames):
    q, t = frames
    with pytest.raises(ArgumentError, match="on: applies to the vector functions"):
        nearest_by_join(q, t, F.vector_l2_distance(q.qv, t.tv) * 2, 3, direction="distance", on="k")


def test_grouped_search_keeps_block_rows_and_order():
    # Targets of groups 1 and 0 interleaved (and one without a group); queries of groups 0, 1,
    # 2 (absent) and none: each gets its own group's rows, as block rows, best first.
    targets = np.array([[0.0], [10.0], [1.0], [11.0], [2.0], [5.0]], np.float32)
    t_groups = np.array([0, 1, 0, 1, 0, -1])
    queries = np.array([[1.2], [10.9], [0.0], [5.0]], np.float32)
    q_groups = np.array([0, 1, 2, -1])
    segments = GroupSegments.of(t_groups)
    assert segments.groups.tolist() == [0, 1] and segments.order.tolist() == [0, 2, 4, 1, 3]

    def search(q, t):
        d = np.abs(q - t.T)
        rows = np.argsort(d, axis=1, kind="stable")[:, :3]
        values = np.take_along_axis(d, rows, axis=1)
        pad = 3 - rows.shape[1]
        return (np.pad(values, ((0, 0), (0, pad)), constant_values=np.inf).astype(np.float32),
                np.pad(rows, ((0, 0), (0, pad)), constant_values=-1))

    values, rows = grouped_search(search, queries, q_groups, targets[segments.order], segments, 3, "l2")
    assert rows.tolist() == [[2, 4, 0], [3, 1, -1], [-1, -1, -1], [-1, -1, -1]]
    np.testing.assert_allclose(values[:2, :2], [[0.2, 0.8], [0.1, 0.9]], atol=1e-6)
    assert np.isinf(values[1, 2]) and np.isinf(values[2:]).all()
