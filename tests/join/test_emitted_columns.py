"""PlannedJoin.dataframe's batch-job options: the executors emit only the columns asked for
(``query_columns`` / ``target_columns``) and a first-match marker, in both plans, with keys,
qualifiers and NULL padding; the rows are those of the full output. ``keep_vectors=False``
leaves the vector columns out the same way."""
from __future__ import annotations

import pytest

from nearest_join import nearest_by_join
from nearest_join.errors import ArgumentError
from nearest_join.join import plan_join
from nearest_join.options import JoinOptions

PLANS = {"broadcast": {}, "blocked": {"broadcast_limit_bytes": 0, "query_block_rows": 2, "target_block_rows": 3}}


@pytest.fixture(scope="module")
def sides(spark):
    query = spark.createDataFrame(
        [(1, "a", [0.0, 0.0], 7), (2, "b", [10.0, 0.0], 7), (3, "c", None, 8), (4, "d", [5.0, 5.0], 9)],
        "id int, tag string, v array<float>, key int")
    target = spark.createDataFrame(
        [(10, [0.0, 1.0], "x", 7), (11, [9.0, 0.0], "y", 7), (12, [4.0, 4.0], "z", 8), (13, [1.0, 1.0], "w", 7)],
        "tid int, w array<float>, label string, key int")
    return query.alias("q"), target.alias("t")


# The emit path is shared by every plan; these two cover both plans and both kinds of rows
# (plain blocks, and keyed blocks with their group column).
@pytest.mark.parametrize("plan, keyed", [("broadcast", True), ("blocked", False)],
                         ids=["keyed-broadcast", "blocked"])
def test_only_the_kept_columns_are_emitted(sides, plan, keyed):
    query, target = sides
    options = JoinOptions(num_results=2, vectors=("v", "w"), join_type="leftouter", distance_col="d",
                          on=[("key", "key")] if keyed else None, **PLANS[plan])
    planned = plan_join(query, target, "l2", options)
    assert planned.plan.plan == plan
    full = planned.dataframe()
    marked = planned.dataframe(first_match_column="first", query_columns=[3, 0], target_columns=[2, 0])
    assert marked.columns == ["key", "id", "label", "tid", "d", "first"]
    # The same rows as the full output's columns, and the alias still qualifies each side's.
    expected = sorted(tuple(r) for r in full.select("q.key", "q.id", "t.label", "t.tid", "d").collect())
    got = marked.select("q.key", "q.id", "t.label", "t.tid", "d", "first").collect()
    assert sorted(tuple(r)[:5] for r in got) == expected
    # One first match per query row that has a candidate, none for the others.
    firsts = {}
    for r in got:
        firsts[r["id"]] = firsts.get(r["id"], 0) + r["first"]
    matched = {r["id"] for r in got if r["tid"] is not None}
    assert firsts == {i: int(i in matched) for i in {1, 2, 3, 4}}
    # The vectors were never emitted: the executors' rows carry the kept columns only.
    assert "v" not in marked.columns and "w" not in marked.columns


# The emission of kept columns is the test above's; these check which columns keep_vectors keeps.
@pytest.mark.parametrize("options", [{"join_type": "leftouter", "on": "key", **PLANS["blocked"]},
                                     {"mode": "approx", "nlist": 2, "nprobe": 1}],
                         ids=["keyed-blocked-leftouter", "approx"])
def test_keep_vectors_false_leaves_the_vector_columns_out(sides, options):
    query, target = sides
    full = nearest_by_join(query, target, "l2", 2, vectors=("v", "w"), distance_col="d", **options)
    lean = nearest_by_join(query, target, "l2", 2, vectors=("v", "w"), distance_col="d", keep_vectors=False,
                           **options)
    assert lean.columns == [c for c in full.columns if c not in ("v", "w")]
    kept = ["q.id", "q.tag", "q.key", "t.tid", "t.label", "t.key", "d"]
    rows = [sorted(map(tuple, df.select(*kept).collect()), key=repr) for df in (full, lean)]
    assert rows[0] == rows[1] and len(rows[0]) >= 4


def test_spark_plans_refuse_the_job_options(spark, sides):
    from pyspark.sql import functions as F

    query, target = sides
    # A ranking over two columns of the target: Spark's own nearestByJoin runs it.
    planned = plan_join(query, target, F.vector_l2_distance(target.w, target.w),
                        JoinOptions(num_results=1, direction="distance"))
    assert planned.plan.plan == "spark"
    with pytest.raises(ValueError, match="query_columns"):
        planned.dataframe(query_columns=[0])
    # Spark prunes its own join's columns: keep_vectors=False is an error there, not a no-op.
    with pytest.raises(ArgumentError, match="keep_vectors: expected True with a ranking Spark's own"):
        nearest_by_join(query, target, F.vector_l2_distance(target.w, target.w), 1, direction="distance",
                        keep_vectors=False)
