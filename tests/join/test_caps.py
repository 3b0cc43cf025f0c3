"""max_distance / min_similarity through nearest_by_join and explain_nearest_join: both plans,
inner and left outer, against the float64 oracle (tests.oracle.assert_capped_topk) and against
Spark's own formulation (a cross join ranked by a window, filtered by the cap), and the errors.

Caps sit in the widest gap between oracle values near a quantile, so that neither the float64
oracle nor Spark's float32 values can put a pair on the other side of the cap; the inclusive
tie at the cap is checked on integer data.
"""
from __future__ import annotations

import numpy as np
import pytest
from pyspark.sql import Window
from pyspark.sql import functions as F

from nearest_join import explain_nearest_join, nearest_by_join
from nearest_join.errors import ArgumentError, ArgumentTypeError
from tests.oracle import (assert_capped_topk, assert_same_neighbours, group_rows, join_arrays,
                          key_values, operator_rtol, oracle_keys)

PLANS = {
    "broadcast": {},
    "blocked": dict(broadcast_limit_bytes=0, query_block_rows=16, target_block_rows=64),
}
SIMILARITY = ("cosine", "inner_product")
SPARK_FUNCTION = {"l2": F.vector_l2_distance, "cosine": F.vector_cosine_similarity,
                  "inner_product": F.vector_inner_product}
NQ, NT, D, K = 40, 150, 5, 6


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(22)
    queries = (rng.standard_normal((NQ, D)) + 1).astype(np.float32)
    targets = (rng.standard_normal((NT, D)) + 1).astype(np.float32)
    return queries, targets


@pytest.fixture(scope="module")
def frames(spark, data):
    queries, targets = data
    q = spark.createDataFrame([(i, r.tolist()) for i, r in enumerate(queries)], "qid int, qv array<float>")
    t = spark.createDataFrame([(j, r.tolist()) for j, r in enumerate(targets)], "tid int, tv array<float>")
    return q.repartition(3).cache(), t.repartition(3).cache()


def clean_cap(values: np.ndarray, quantile: float, descending: bool) -> float:
    """The middle of the widest gap between distinct values among those near ``quantile``
    (the share of pairs within the cap); 0 and 1: beyond every value."""
    distinct = np.unique(values)[::-1] if descending else np.unique(values)
    sign = -1.0 if descending else 1.0
    if quantile <= 0:   # distances: half the least one (a max_distance is >= 0)
        return float(distinct[0] / 2.0 if not descending else distinct[0] + abs(distinct[0]) + 1.0)
    if quantile >= 1:
        return float(distinct[-1] + sign * (abs(distinct[-1]) + 1.0))
    centre = int(quantile * (distinct.size - 1))
    lo, hi = max(0, centre - distinct.size // 50), min(distinct.size - 1, centre + distinct.size // 50 + 1)
    gaps = np.abs(np.diff(distinct[lo:hi + 1]))
    at = lo + int(np.argmax(gaps))
    return float((distinct[at] + distinct[at + 1]) / 2.0)


def _cap_argument(metric: str, cap: float) -> dict:
    return {"min_similarity": cap} if metric in SIMILARITY else {"max_distance": cap}


def _check(rows, queries, targets, metric, cap, join_type, case):
    grouped = group_rows(rows, lambda r: r["qid"], lambda r: r["tid"], lambda r: r["d"])
    values, indices = join_arrays(grouped, K, metric, list(range(NQ)), list(range(NT)), case)
    assert_capped_topk(queries, targets, K, metric, cap, values.astype(np.float32), indices,
                       operator_rtol, case=case)
    none = [i for i in range(NQ) if not grouped.get(i) or grouped[i] == [(None, None)]]
    within = (key_values(oracle_keys(queries, targets, metric), metric) >= cap) if metric in SIMILARITY \
        else (key_values(oracle_keys(queries, targets, metric), metric) <= cap)
    assert none == [i for i in range(NQ) if not within[i].any()], case
    if join_type == "leftouter":
        # every query once at least; one NULL row for each query with no target within the cap
        assert sorted(grouped) == list(range(NQ)), case
        assert all(grouped[i] == [(None, None)] for i in none), case
    else:
        assert sorted(grouped) == [i for i in range(NQ) if i not in none], case


# (quantile, join type) of each capped join: near 1% and 3% of the pairs within the cap cut
# some queries to fewer than k and some to none (left outer: their NULL rows; inner: dropped);
# for l2 also a cap below every value (no query keeps a row) and one above every value (the
# uncapped answer). The kernels check every metric at caps from below every value to above
# every value (tests/kernels/test_caps.py); here each metric's cap goes through its argument,
# the options and both plans.
CAP_CASES = {"l2": ((0.0, "leftouter"), (0.01, "inner"), (0.03, "leftouter"), (1.0, "inner"))}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "cosine", "inner_product"])
def test_capped_join_against_oracle(spark, data, frames, metric, plan):
    queries, targets = data
    q, t = frames
    values = key_values(oracle_keys(queries, targets, metric), metric)
    for quantile, join_type in CAP_CASES.get(metric, ((0.01, "leftouter"), (0.03, "inner"))):
        cap = clean_cap(values, quantile, metric in SIMILARITY)
        rows = nearest_by_join(q, t, metric, K, vectors=("qv", "tv"), distance_col="d",
                               join_type=join_type, **_cap_argument(metric, cap), **PLANS[plan]).collect()
        _check(rows, queries, targets, metric, cap, join_type, f"{plan} {join_type} q={quantile}")


@pytest.mark.parametrize("metric", ["l2", "cosine", "inner_product"])
def test_capped_join_matches_spark_window_formulation(spark, data, frames, metric):
    queries, targets = data
    q, t = frames
    values = key_values(oracle_keys(queries, targets, metric), metric)
    cap = clean_cap(values, 0.03, metric in SIMILARITY)
    ranking = SPARK_FUNCTION[metric](q.qv, t.tv)
    ours = nearest_by_join(q, t, ranking, K, distance_col="d", join_type="left_outer",
                           **_cap_argument(metric, cap)).collect()
    descending = metric in SIMILARITY
    order = F.col("d").desc() if descending else F.col("d").asc()
    within = F.col("d") >= cap if descending else F.col("d") <= cap
    ranked = (q.crossJoin(t).withColumn("d", SPARK_FUNCTION[metric](F.col("qv"), F.col("tv")))
              .where(within)
              .withColumn("r", F.row_number().over(Window.partitionBy("qid").orderBy(order, "tid")))
              .where(F.col("r") <= K))
    theirs = q.join(ranked.select("qid", "tid", "d"), "qid", "left").collect()
    key = (lambda r: r["qid"], lambda r: r["tid"], lambda r: r["d"])
    assert_same_neighbours(group_rows(ours, *key), group_rows(theirs, *key), descending)


@pytest.mark.parametrize("plan", list(PLANS))
def test_cap_is_inclusive(spark, plan):
    # q = (0, 0): targets at distances 5, 5, 6 and sqrt 2; a cap of 5 keeps the ties at 5.
    q = spark.createDataFrame([(0, [0.0, 0.0])], "qid int, qv array<float>")
    t = spark.createDataFrame([(j, v) for j, v in enumerate([[3.0, 4.0], [5.0, 0.0], [0.0, 6.0], [1.0, 1.0]])],
                              "tid int, tv array<float>")
    rows = nearest_by_join(q, t, "l2", 4, vectors=("qv", "tv"), distance_col="d", max_distance=5,
                           **PLANS[plan]).collect()
    assert sorted((r["tid"], r["d"]) for r in rows) == [(0, 5.0), (1, 5.0), (3, float(np.float32(np.sqrt(2))))]


def test_explain_shows_the_cap(spark, frames):
    q, t = frames
    plan = explain_nearest_join(q, t, "cosine", 3, vectors=("qv", "tv"), min_similarity=0.5)
    assert (plan.cap_argument, plan.cap, plan.backend) == ("min_similarity", 0.5, "auto")
    assert "cap: min_similarity, only targets whose cosine is >= 0.5 match" in str(plan)
    assert plan.to_dict()["cap"] == 0.5
    # Every backend takes a cap (the gpu one seeds its first candidate lists with it).
    plan = explain_nearest_join(q, t, "l2", 3, vectors=("qv", "tv"), max_distance=1.0, backend="gpu")
    assert (plan.cap_argument, plan.backend) == ("max_distance", "gpu")
    plan = explain_nearest_join(q, t, "l2", 3, vectors=("qv", "tv"))
    assert plan.cap is None and "cap:" not in str(plan)


@pytest.mark.parametrize("metric, arguments, error, argument, text", [
    ("cosine", {"max_distance": 1.0}, ArgumentError, "max_distance",
     "caps the distance metrics l2 and sqeuclidean, not the similarity 'cosine'; pass min_similarity instead"),
    ("l2", {"min_similarity": 0.1}, ArgumentError, "min_similarity",
     "caps the similarity metrics cosine and inner_product, not the distance 'l2'"),
    ("l2", {"max_distance": -1.0}, ArgumentError, "max_distance", "expected None or a finite number >= 0, got -1.0"),
    ("l2", {"max_distance": float("nan")}, ArgumentError, "max_distance", "got nan"),
    ("cosine", {"min_similarity": float("inf")}, ArgumentError, "min_similarity", "got inf"),
    ("l2", {"max_distance": "3"}, ArgumentTypeError, "max_distance", "got str '3'"),
    # a cosine lies in [-1, 1]: above it every query would lose every row, below it no cap
    ("cosine", {"min_similarity": 1.5}, ArgumentError, "min_similarity",
     "expected a cosine similarity in [-1, 1], got 1.5"),
    ("cosine", {"min_similarity": -2}, ArgumentError, "min_similarity",
     "expected a cosine similarity in [-1, 1], got -2.0"),
], ids=lambda v: str(v)[:30])
def test_bad_caps(spark, frames, metric, arguments, error, argument, text):
    q, t = frames
    for call in (nearest_by_join, explain_nearest_join):
        with pytest.raises(error, match=None) as info:
            call(q, t, metric, 3, vectors=("qv", "tv"), **arguments)
        assert info.value.argument == argument and text in str(info.value), str(info.value)


def test_cap_errors_come_before_any_spark_job(spark, frames, monkeypatch):
    import nearest_join.join

    def no_job(*args, **kwargs):
        raise AssertionError("the planner's facts job ran before the cap was checked")

    monkeypatch.setattr(nearest_join.join, "side_facts", no_job)
    q, t = frames
    for arguments in ({"min_similarity": 1.0000001}, {"max_distance": 1.0}):
        with pytest.raises(ArgumentError) as info:
            explain_nearest_join(q, t, "cosine", 3, vectors=("qv", "tv"), **arguments)
        assert info.value.argument in arguments
    # the inner product has no range: any finite cap is one
    monkeypatch.undo()
    plan = explain_nearest_join(q, t, "inner_product", 3, vectors=("qv", "tv"), min_similarity=1e6)
    assert plan.cap == 1e6


def test_cap_with_a_ranking_spark_runs_is_an_error(spark, frames):
    q, t = frames
    with pytest.raises(ArgumentError, match="max_distance: applies to the vector functions"):
        nearest_by_join(q, t, F.vector_l2_distance(q.qv, t.tv) * 2, 3, direction="distance", max_distance=1.0)
