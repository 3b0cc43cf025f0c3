"""nearest_by_join on adversarial data (tests/adversarial.py) in both plans, against the
float64 difference-form oracle, and against Spark's own nearestByJoin on small cases.

Target blocks are searched on their own (each with its own shift and scale) and their
partials merged on the float32 values the operator returns, so two targets whose values round
to one float32 value are a tie there (broken by block order): the operator's rank tolerance is
float32's rounding of the k-th value (tests.oracle.operator_rtol; for cosine near 1 that is
2^-24 of the similarity, which is as far as a float32 similarity can tell nearly parallel
vectors apart). Values beyond
float32's range (squared distances of 1e20-sized vectors, inner products of 1e-24-sized ones)
read +-inf or 0 and tie the same way.
"""
from __future__ import annotations

import numpy as np
import pytest
from pyspark.sql import functions as F

from nearest_join import nearest_by_join
from tests import adversarial
from tests.oracle import assert_join_true_topk, group_rows

PLANS = {
    "broadcast": {},
    "blocked": dict(broadcast_limit_bytes=0, query_block_rows=16, target_block_rows=128),
}
# (case, the metrics it stresses): each join costs a Spark job, so not every metric everywhere.
CASES = [
    (adversarial.offset_case(3, 1e4, 1.0, nq=30, nt=400, seed=1), ("l2", "cosine")),  # map coordinates
    (adversarial.offset_case(48, 10.0, 0.1, nq=30, nt=400, seed=2), ("sqeuclidean", "inner_product")),
    (adversarial.offset_case(2, 1e3, 0.1, nq=20, nt=300, seed=3, dtype=np.float64), ("l2",)),
    (adversarial.magnitude_case(1e20, d=4, nq=20, nt=200, seed=4), ("l2", "cosine")),
    (adversarial.magnitude_case(1e-24, d=4, nq=20, nt=200, seed=5), ("l2", "cosine")),
    (adversarial.magnitude_case(1e30, d=4, nq=20, nt=200, seed=6, dtype=np.float64), ("l2",)),
    (adversarial.parallel_case(16, nq=20, nt=300, seed=7), ("inner_product", "l2")),
    (adversarial.integer_case(4, nq=20, nt=300, seed=8), ("l2", "inner_product")),
]
K = 7


def _frames(spark, case):
    element = "double" if case.queries.dtype == np.float64 else "float"
    q = spark.createDataFrame([(i, row.tolist()) for i, row in enumerate(case.queries)],
                              f"qid int, qv array<{element}>").repartition(3).cache()
    t = spark.createDataFrame([(j, row.tolist()) for j, row in enumerate(case.targets)],
                              f"tid int, tv array<{element}>").repartition(3).cache()
    return q, t


def _assert_exact(case, metric, rows, k):
    """Every query's rows are its true top k at the operator's tolerance (float32 values:
    tests.oracle.operator_rtol); a query with no rows fails."""
    grouped = group_rows(rows, lambda r: r["qid"], lambda r: r["tid"], lambda r: r["d"])
    assert_join_true_topk(grouped, case.queries, case.targets, k, metric,
                          list(range(case.queries.shape[0])), list(range(case.targets.shape[0])),
                          case=case.name)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("case, metrics", CASES, ids=[c.name for c, _ in CASES])
def test_operator_is_exact_on_adversarial_data(spark, case, metrics, plan):
    q, t = _frames(spark, case)
    for metric in metrics:
        rows = nearest_by_join(q, t, metric, K, vectors=("qv", "tv"), distance_col="d",
                               **PLANS[plan]).collect()
        _assert_exact(case, metric, rows, K)


def test_values_beyond_float32_are_infinite_and_no_query_is_dropped(spark):
    """Squared distances of 1e20-sized float32 vectors (~1e40) exceed float32: every query
    still gets its k rows, with +inf values (documented: such values tie)."""
    case = adversarial.magnitude_case(1e20, d=4, nq=10, nt=60, seed=9)
    q, t = _frames(spark, case)
    rows = nearest_by_join(q, t, "sqeuclidean", 3, vectors=("qv", "tv"), distance_col="d").collect()
    by_query: dict[int, list] = {}
    for r in rows:
        by_query.setdefault(r["qid"], []).append(r["d"])
    assert sorted(by_query) == list(range(10))
    keys = np.sort(adversarial.oracle_keys(case.queries, case.targets, "sqeuclidean"), axis=1)[:, :3]
    with np.errstate(over="ignore"):
        expected = keys.astype(np.float32)
    assert np.isinf(expected).any() and np.isfinite(expected).any()
    for qid, found in by_query.items():
        np.testing.assert_array_equal(np.sort(np.array(found, np.float32)), expected[qid])


SPARK_FUNCTIONS = {
    "l2": (F.vector_l2_distance, "distance"),
    "cosine": (F.vector_cosine_similarity, "similarity"),
    "inner_product": (F.vector_inner_product, "similarity"),
}


@pytest.mark.parametrize("metric", list(SPARK_FUNCTIONS))
def test_operator_matches_spark_on_offset_data(spark, metric):
    """Spark's own nearestByJoin is right on offset data: so are we, in both plans, to the
    rounding of float32 values. Its answer passes the same oracle check; the pairs are the
    same where float32 values can tell them apart (cosines on this data all read ~1.0, so
    Spark's choice among the tied rows and ours may differ)."""
    case = adversarial.offset_case(3, 1e4, 1.0, nq=12, nt=90, seed=12, duplicates=False)
    q, t = _frames(spark, case)
    fn, direction = SPARK_FUNCTIONS[metric]
    ranking = fn(q.qv, t.tv)
    theirs = (q.nearestByJoin(t, ranking, 4, "exact", direction)
              .withColumn("d", ranking).collect())
    _assert_exact(case, metric, theirs, 4)
    spark_pairs = {(r["qid"], r["tid"]) for r in theirs}
    for plan, options in PLANS.items():
        ours = nearest_by_join(q, t, ranking, 4, distance_col="d", **options).collect()
        _assert_exact(case, metric, ours, 4)
        if metric != "cosine":
            assert {(r["qid"], r["tid"]) for r in ours} == spark_pairs, plan
