"""nearest_by_join against Spark's own nearestByJoin on small random inputs."""
from __future__ import annotations

import numpy as np
import pytest
from pyspark.sql import functions as F

from nearest_join import nearest_by_join
from tests.oracle import assert_same_neighbours, group_rows

FUNCTIONS = {
    "l2": (F.vector_l2_distance, "distance"),
    "cosine": (F.vector_cosine_similarity, "similarity"),
    "inner_product": (F.vector_inner_product, "similarity"),
}
D = 4


def _vectors(rng, n):
    return [[float(x) for x in row] for row in rng.standard_normal((n, D)).astype(np.float32)]


@pytest.fixture(scope="module")
def awkward(spark):
    """Random vectors plus every special row: NULL vectors, NULL elements, zero vectors,
    duplicate query rows, duplicate target vectors."""
    rng = np.random.default_rng(7)
    qv = _vectors(rng, 9)
    query_rows = [(i, v) for i, v in enumerate(qv)]
    query_rows += [(100, None), (101, [1.0, None, 0.5, 0.0]), (102, [0.0] * D),
                   (0, qv[0]), (3, qv[3])]  # duplicates of rows 0 and 3
    tv = _vectors(rng, 12)
    target_rows = [(f"t{i}", v) for i, v in enumerate(tv)]
    target_rows += [("tnull", None), ("tnullelem", [None, 1.0, 1.0, 1.0]), ("tzero", [0.0] * D),
                    ("tdup", tv[5])]
    q = spark.createDataFrame(query_rows, "qid int, qv array<float>")
    t = spark.createDataFrame(target_rows, "tid string, tv array<float>")
    return q, t


def _compare(q, t, name, k, join_type, **options):
    fn, direction = FUNCTIONS[name]
    ranking = fn(q.qv, t.tv)
    ours = nearest_by_join(q, t, ranking, k, "exact", join_type=join_type, distance_col="d",
                           **options).collect()
    theirs = (q.nearestByJoin(t, ranking, k, "exact", direction, joinType=join_type)
              .withColumn("d", ranking).collect())
    key = lambda r: r["qid"]  # noqa: E731
    tkey = lambda r: r["tid"]  # noqa: E731
    value = lambda r: None if r["d"] is None else float(r["d"])  # noqa: E731
    assert len(ours) == len(theirs)
    assert_same_neighbours(group_rows(ours, key, tkey, value), group_rows(theirs, key, tkey, value),
                           descending=direction == "similarity")
    return ours


@pytest.mark.parametrize("join_type", ["inner", "leftouter"])
@pytest.mark.parametrize("k", [1, 3, 40], ids=["k1", "k3", "k_gt_target"])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_matches_spark(awkward, name, k, join_type):
    q, t = awkward
    rows = _compare(q, t, name, k, join_type)
    qids = {r["qid"] for r in rows}
    assert 100 not in qids or join_type == "leftouter"  # NULL vector never matches
    assert 101 not in qids or join_type == "leftouter"  # NULL element never matches
    assert all(r["tid"] not in ("tnull", "tnullelem") for r in rows)
    if name == "cosine":
        assert all(r["tid"] != "tzero" for r in rows)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_matches_spark_blocked_plan(awkward, name):
    q, t = awkward
    _compare(q, t, name, 3, "leftouter", broadcast_limit_bytes=0, query_block_rows=4,
             target_block_rows=5)


@pytest.mark.parametrize("join_type", ["inner", "leftouter"])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_empty_target(spark, awkward, name, join_type):
    q, t = awkward
    empty = t.limit(0)
    rows = _compare(q, empty, name, 3, join_type)
    if join_type == "inner":
        assert rows == []
    else:
        assert len(rows) == q.count() and all(r["tid"] is None and r["d"] is None for r in rows)


@pytest.mark.parametrize("join_type", ["inner", "leftouter"])
def test_empty_query(awkward, join_type):
    q, t = awkward
    assert _compare(q.limit(0), t, "l2", 3, join_type) == []
