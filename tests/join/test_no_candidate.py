"""Query rows without any candidate (issue 19), against Spark's own nearestByJoin.

A NULL query vector, a NULL element, a zero vector under cosine or a target whose vectors are
all NULL leave a query row with no candidate. LEFT OUTER keeps it once with NULL target
columns and a NULL distance; INNER drops it. The target has several blocks in every case
here (a query block's empty top-k states are merged across them), and in the blocked plan
some query blocks have no candidate at all.
"""
from __future__ import annotations

import pytest
from pyspark.sql import functions as F

from nearest_join import nearest_by_join
from tests.oracle import assert_same_neighbours, group_rows

FUNCTIONS = {
    "l2": (F.vector_l2_distance, "distance"),
    "cosine": (F.vector_cosine_similarity, "similarity"),
    "inner_product": (F.vector_inner_product, "similarity"),
}
PLANS = {
    # Small broadcast target blocks: a query block folds several of them in one task. One-row
    # query blocks (one per task): a NULL row's block has no candidate at all.
    "broadcast": dict(query_block_rows=1, target_block_rows=2),
    "blocked": dict(broadcast_limit_bytes=0, query_block_rows=2, target_block_rows=2),
}
JOIN_TYPES = ["inner", "leftouter"]


def _join(q, t, name, k, join_type, plan):
    fn, direction = FUNCTIONS[name]
    ranking = fn(q.v, t.w)
    ours = nearest_by_join(q, t, ranking, k, join_type=join_type, distance_col="d",
                           **PLANS[plan]).collect()
    theirs = (q.nearestByJoin(t, ranking, k, "exact", direction, joinType=join_type)
              .withColumn("d", ranking).collect())
    return ours, theirs, direction == "similarity"


def _assert_same_as_spark(ours, theirs, descending):
    key = lambda r: r["id"]  # noqa: E731
    tkey = lambda r: r["name"]  # noqa: E731
    value = lambda r: None if r["d"] is None else float(r["d"])  # noqa: E731
    assert len(ours) == len(theirs), (ours, theirs)
    assert_same_neighbours(group_rows(ours, key, tkey, value), group_rows(theirs, key, tkey, value),
                           descending)


def _unmatched(rows):
    """The query ids of rows with NULL target columns (and distance)."""
    return sorted(r["id"] for r in rows if r["name"] is None and r["w"] is None and r["d"] is None)


@pytest.fixture(scope="module")
def two_partition_target(spark):
    t = spark.createDataFrame([("a", [1.0, 0.0]), ("b", [3.0, 4.0]), ("c", [0.0, 2.0])],
                              "name string, w array<float>")
    return t.repartitionByRange(2, "name").cache()


@pytest.mark.parametrize("plan", ["broadcast", "blocked"])
def test_one_null_query_row_against_a_two_partition_target(spark, two_partition_target, plan):
    """The issue's reproduction, with the default options (broadcast: one target block per
    input partition)."""
    t = two_partition_target
    assert [n > 0 for n in t.rdd.glom().map(len).collect()] == [True, True]
    q = spark.createDataFrame([(1, None)], "id int, v array<float>")
    options = {"broadcast": {}, "blocked": dict(broadcast_limit_bytes=0)}[plan]
    rows = nearest_by_join(q, t, F.vector_l2_distance(q.v, t.w), 2, join_type="leftouter",
                           distance_col="d", **options).collect()
    assert [tuple(r) for r in rows] == [(1, None, None, None, None)]


@pytest.fixture(scope="module")
def awkward(spark):
    """Queries without a candidate (NULL, NULL element, zero vector under cosine) among
    ordinary ones; targets with NULL, NULL-element and zero vectors, over more partitions
    than some of them fill (empty partitions). One query partition, in this order: the
    blocked plan's second query block of two rows has no candidate under any metric."""
    query = [(0, [1.0, 0.5]), (1, None), (2, [None, 1.0]), (5, None), (3, [0.0, 0.0]),
             (4, [-2.0, 1.0])]
    target = [("a", [1.0, 0.0]), ("b", None), ("c", [0.0, 0.0]), ("d", [3.0, -1.0]),
              ("e", [None, 2.0]), ("f", [-1.0, -1.0])]
    q = spark.createDataFrame(query, "id int, v array<float>").coalesce(1).cache()
    t = spark.createDataFrame(target, "name string, w array<float>").repartition(8).cache()
    assert 0 in t.rdd.glom().map(len).collect()
    return q, t


@pytest.mark.parametrize("name, k, join_type", [
    ("l2", 2, "leftouter"), ("l2", 10, "inner"), ("cosine", 10, "leftouter"),
    ("inner_product", 2, "inner")], ids=["l2-k2-leftouter", "l2-k_gt_target-inner",
                                         "cosine-k_gt_target-leftouter", "ip-k2-inner"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_queries_without_candidates_match_spark(awkward, plan, name, k, join_type):
    q, t = awkward
    ours, theirs, descending = _join(q, t, name, k, join_type, plan)
    _assert_same_as_spark(ours, theirs, descending)
    none = [1, 2, 3, 5] if name == "cosine" else [1, 2, 5]
    assert _unmatched(ours) == (none if join_type == "leftouter" else [])


@pytest.mark.parametrize("plan", list(PLANS))
def test_target_whose_vectors_are_all_null(spark, awkward, plan):
    q, _ = awkward
    t = spark.createDataFrame([("a", None), ("b", None), ("c", [None, 1.0]), ("d", None),
                               ("e", [1.0, None])], "name string, w array<float>").repartition(3)
    ours, theirs, descending = _join(q, t, "l2", 3, "leftouter", plan)
    _assert_same_as_spark(ours, theirs, descending)
    assert len(ours) == 6 and _unmatched(ours) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("join_type", JOIN_TYPES)
@pytest.mark.parametrize("plan", list(PLANS))
def test_all_null_vectors_on_both_sides(spark, plan, join_type):
    """No vector anywhere: no dimension to know (this used to fail decoding the blocks)."""
    q = spark.createDataFrame([(1, None), (2, None), (3, None)], "id int, v array<float>")
    t = spark.createDataFrame([("a", None), ("b", None), ("c", None)], "name string, w array<float>")
    t = t.repartition(2)
    ours, theirs, descending = _join(q, t, "l2", 2, join_type, plan)
    _assert_same_as_spark(ours, theirs, descending)
    assert [tuple(r) for r in sorted(ours)] == (
        [(i, None, None, None, None) for i in (1, 2, 3)] if join_type == "leftouter" else [])


@pytest.mark.parametrize("plan, name", [("broadcast", "l2"), ("blocked", "cosine"),
                                        ("blocked", "inner_product")])
def test_empty_vectors(spark, plan, name):
    """Vectors of dimension 0 (the same decoding case as all-NULL columns): Spark gives l2 and
    the inner product 0 and cosine NULL, so they match under l2/inner product only; a NULL
    vector still never does."""
    q = spark.createDataFrame([(1, []), (2, None), (3, [])], "id int, v array<float>")
    t = spark.createDataFrame([("a", []), ("b", None), ("c", [])], "name string, w array<float>")
    ours, theirs, descending = _join(q, t, name, 2, "leftouter", plan)
    _assert_same_as_spark(ours, theirs, descending)
    if name == "cosine":
        assert _unmatched(ours) == [1, 2, 3]
    else:
        assert _unmatched(ours) == [2]
        assert sorted((r["id"], r["name"], r["d"]) for r in ours if r["name"]) == [
            (1, "a", 0.0), (1, "c", 0.0), (3, "a", 0.0), (3, "c", 0.0)]
