"""Which side a ranking's columns are on, and column names Spark would parse.

The oracle is Spark's own nearestByJoin on the same tiny inputs, or, where Spark itself
cannot tell the sides apart (a DataFrame joined with itself), the same join written with
aliases, which Spark does resolve.
"""
from __future__ import annotations

import pytest
from pyspark.sql import functions as F

from nearest_join import explain_nearest_join, nearest_by_join

from .helpers import assert_same_neighbours, group_rows

# Blocked with several blocks per side, so names also travel through the merge.
PLANS = {"broadcast": {}, "blocked": dict(broadcast_limit_bytes=0, query_block_rows=2, target_block_rows=3)}


def _same(ours, theirs, qkey, tkey, descending=False):
    value = lambda r: None if r["d"] is None else float(r["d"])  # noqa: E731
    assert len(ours) == len(theirs), (ours, theirs)
    assert_same_neighbours(group_rows(ours, qkey, tkey, value), group_rows(theirs, qkey, tkey, value),
                           descending=descending)


@pytest.fixture(scope="module")
def awkward_names(spark):
    q = spark.createDataFrame([(1, [0.0, 0.0]), (2, [4.0, 4.0]), (3, None)],
                              "`q.id` int, `emb.v1` array<float>")
    t = spark.createDataFrame([("a", [1.0, 0.0]), ("b", [3.0, 4.0]), ("c", [0.0, 3.0]), ("d", [5.0, 5.0])],
                              "`t``id` string, `w``x` array<float>")
    return q, t


@pytest.mark.parametrize("plan", list(PLANS))
def test_names_with_dots_and_backticks(awkward_names, plan):
    q, t = awkward_names
    ranking = F.vector_l2_distance(q["`emb.v1`"], t["`w``x`"])
    # LEFT OUTER: query 3 (NULL vector) comes back once, its target columns NULL
    theirs = (q.nearestByJoin(t, ranking, 2, "exact", "distance", joinType="leftouter")
              .withColumn("d", ranking).collect())
    qkey, tkey = (lambda r: r["q.id"]), (lambda r: r["t`id"])
    for how, vectors in ((ranking, None), ("l2", ("emb.v1", "w`x"))):
        assert explain_nearest_join(q, t, how, 2, vectors=vectors, **PLANS[plan]).plan == plan
        out = nearest_by_join(q, t, how, 2, vectors=vectors, join_type="leftouter", distance_col="d",
                              **PLANS[plan])
        assert out.columns == ["q.id", "emb.v1", "t`id", "w`x", "d"]
        _same(out.collect(), theirs, qkey, tkey)
