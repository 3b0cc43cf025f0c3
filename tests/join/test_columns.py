"""Which side a ranking's columns are on, and column names Spark would parse.

The oracle is Spark's own nearestByJoin on the same tiny inputs, or, where Spark itself
cannot tell the sides apart (a DataFrame joined with itself), the same join written with
aliases, which Spark does resolve.
"""
from __future__ import annotations

import logging

import pytest
from pyspark.sql import functions as F

from nearest_join import explain_nearest_join, nearest_by_join
from tests.oracle import assert_same_neighbours, group_rows

# Blocked with several blocks per side, so names also travel through the merge. Naming and
# placing columns is planning code, the same for both plans: the tests of it run one plan each.
PLANS = {"broadcast": {}, "blocked": dict(broadcast_limit_bytes=0, query_block_rows=2, target_block_rows=3)}


def _same(ours, theirs, qkey, tkey, descending=False):
    value = lambda r: None if r["d"] is None else float(r["d"])  # noqa: E731
    assert len(ours) == len(theirs), (ours, theirs)
    assert_same_neighbours(group_rows(ours, qkey, tkey, value), group_rows(theirs, qkey, tkey, value),
                           descending=descending)


@pytest.fixture(scope="module")
def two_vector_target(spark):
    """A query with `v` and a target with `v` and `w`: nearest by |t.v - t.w| (the same for
    every query) and nearest by |q.v - t.w| pick different targets."""
    q = spark.createDataFrame([(1, [0.0, 0.0]), (2, [10.0, 0.0])], "qid int, v array<float>")
    t = spark.createDataFrame([("a", [0.0, 0.0], [9.0, 0.0]),    # |v-w| = 9, near query 2
                               ("b", [5.0, 5.0], [5.0, 6.0]),    # |v-w| = 1
                               ("c", [3.0, 0.0], [0.0, 1.0]),    # |v-w| = sqrt(10), near query 1
                               ("d", [1.0, 1.0], [1.0, 3.0])],   # |v-w| = 2
                              "tid string, v array<float>, w array<float>")
    return q, t


def test_ranking_over_two_target_columns_is_spark_s(two_vector_target, caplog):
    q, t = two_vector_target
    ranking = F.vector_l2_distance(t.v, t.w)
    assert explain_nearest_join(q, t, ranking, 2, direction="distance").plan == "spark"
    with caplog.at_level(logging.WARNING, logger="nearest_join.join"):
        ours = nearest_by_join(q, t, ranking, 2, direction="distance", distance_col="d").collect()
    assert any("Spark's own nearestByJoin runs it" in r.getMessage() for r in caplog.records)
    theirs = q.nearestByJoin(t, ranking, 2, "exact", "distance").withColumn("d", ranking).collect()
    _same(ours, theirs, lambda r: r["qid"], lambda r: r["tid"])
    # the same two targets for every query, by |t.v - t.w|: not query.v against target.w
    assert {(r["qid"], r["tid"]) for r in ours} == {(1, "b"), (1, "d"), (2, "b"), (2, "d")}


def test_query_column_named_like_a_target_column(two_vector_target):
    q, t = two_vector_target
    ranking = F.vector_l2_distance(t.w, q.v)  # target column first; `v` is on both sides
    plan = explain_nearest_join(q, t, ranking, 1)
    assert (plan.plan, plan.query_column, plan.target_column) == ("broadcast", "v", "w")
    ours = nearest_by_join(q, t, ranking, 1, distance_col="d").collect()
    theirs = q.nearestByJoin(t, ranking, 1, "exact", "distance").withColumn("d", ranking).collect()
    _same(ours, theirs, lambda r: r["qid"], lambda r: r["tid"])
    assert {(r["qid"], r["tid"]) for r in ours} == {(1, "c"), (2, "a")}


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


def test_unquoted_column_function_names(awkward_names):
    q, t = awkward_names
    # F.col("`w``x`") prints as w`x in classic PySpark: the analyzer, not the text, decides
    ranking = F.vector_l2_distance(F.col("`emb.v1`"), F.col("`w``x`"))
    rows = nearest_by_join(q, t, ranking, 1, distance_col="d").collect()
    assert {(r["q.id"], r["t`id"], r["d"]) for r in rows} == {(1, "a", 1.0), (2, "b", 1.0)}


@pytest.fixture(scope="module")
def items(spark):
    """One table with two vector columns: v (what a row looks for), w (what it offers)."""
    return spark.createDataFrame([(1, [0.0, 0.0], [1.0, 1.0]), (2, [5.0, 5.0], [0.0, 0.1]),
                                  (3, [1.0, 1.0], [5.0, 5.0]), (4, [0.9, 1.2], [4.0, 4.0])],
                                 "id int, v array<float>, w array<float>")


def test_self_join_over_two_columns_says_what_to_do(items):
    S = items
    for ranking in (F.vector_l2_distance(S.v, S.w), F.vector_l2_distance(S.w, S.v),
                    F.vector_cosine_similarity(S.alias("a").v, S.alias("b").w)):
        with pytest.raises(ValueError, match=r"columns `[vw]` and `[vw]` resolve on both the query and the "
                                             r"target .* vectors=\('[vw]', '[vw]'\)\) \(query column first\)"):
            nearest_by_join(S, S, ranking, 2)
    # a derived DataFrame shares the attributes (classic) too
    with pytest.raises(ValueError, match="resolve on both the query and the target"):
        explain_nearest_join(S, S.filter("id > 1"), F.vector_l2_distance(S.v, S.w), 2)


def test_self_join_ways_the_error_names(items):
    S = items
    a, b = S.alias("a"), S.alias("b")
    aliased = F.vector_l2_distance(F.col("a.v"), F.col("b.w"))  # Spark resolves this one
    theirs = a.nearestByJoin(b, aliased, 2, "exact", "distance").collect()
    assert len(theirs) == 8
    expected = {(r[0], r[3]) for r in theirs}  # (query id, target id)
    assert {(1, 2), (2, 4), (3, 1)} <= expected
    by_vectors = nearest_by_join(S, S, "l2", 2, vectors=("v", "w"), distance_col="d").collect()
    assert explain_nearest_join(a, b, aliased, 2).plan == "broadcast"
    by_alias = nearest_by_join(a, b, aliased, 2, distance_col="d").collect()
    for rows in (by_vectors, by_alias):
        assert {(r[0], r[3]) for r in rows} == expected


def test_self_join_over_one_column(items):
    S = items
    ours = nearest_by_join(S, S, F.vector_l2_distance(S.v, S.v), 2, distance_col="d").collect()
    a, b = S.alias("a"), S.alias("b")
    theirs = a.nearestByJoin(b, F.vector_l2_distance(F.col("a.v"), F.col("b.v")), 2, "exact",
                             "distance").collect()
    assert {(r[0], r[3]) for r in ours} == {(r[0], r[3]) for r in theirs}
    assert {(r[0], r[3]) for r in ours if r[0] == 3} == {(3, 3), (3, 4)}


# The same cases through Spark Connect: tests/join/connect_parity.py (column_cases).


def test_vector_functions_over_double_columns(spark, plan="broadcast"):
    """Spark's vector functions refuse array<double>; the join runs them (as it runs the metric
    names over such columns). Oracle: Spark's own join of float copies (every value here is
    exact in float32, so the copies rank alike)."""
    q = spark.createDataFrame([(1, [0.0, 0.5]), (2, [10.0, 0.0]), (3, None)], "qid int, v array<double>")
    t = spark.createDataFrame([("a", [0.0, 0.0]), ("b", [5.0, 5.5]), ("c", [3.0, 0.0]), ("d", [1.0, 1.0])],
                              "tid string, w array<double>")
    qf = q.select("qid", q.v.cast("array<float>").alias("v"))
    tf = t.select("tid", t.w.cast("array<float>").alias("w"))
    for function, descending in ((F.vector_l2_distance, False), (F.vector_inner_product, True),
                                 (F.vector_cosine_similarity, True)):
        ours = nearest_by_join(q, t, function(t.w, q.v), 2, join_type="left", distance_col="d",
                               **PLANS[plan]).collect()
        ranking = function(qf.v, tf.w)
        theirs = (qf.nearestByJoin(tf, ranking, 2, "exact", "similarity" if descending else "distance",
                                   joinType="left").withColumn("d", ranking).collect())
        _same(ours, theirs, lambda r: r["qid"], lambda r: r["tid"], descending=descending)


def test_the_output_keeps_the_aliases_the_ranking_names(spark, plan="blocked"):
    """A self-join through aliases: Spark's own join keeps the sides' qualifiers, so `a.id` and
    `b.id` tell the two `id` columns apart; so does ours (a NULL vector: LEFT OUTER's NULL row)."""
    S = spark.createDataFrame([(1, [0.0, 1.0]), (2, [1.0, 1.0]), (3, [5.0, 5.0]), (4, None)], "id int, v array<float>")
    a, b = S.alias("a"), S.alias("b")
    ranking = F.vector_l2_distance(F.col("a.v"), F.col("b.v"))
    for join_type in ("inner", "left"):
        ours = nearest_by_join(a, b, ranking, 2, join_type=join_type, distance_col="d", **PLANS[plan])
        assert ours.columns == ["id", "v", "id", "v", "d"]
        got = ours.select(F.col("a.id").alias("q"), F.col("b.id").alias("t"), "d").collect()
        theirs = (a.nearestByJoin(b, ranking, 2, "exact", "distance", joinType=join_type)
                  .select(F.col("a.id").alias("q"), F.col("b.id").alias("t"), ranking.alias("d")).collect())
        _same(got, theirs, lambda r: r["q"], lambda r: r["t"])
        assert (4, None, None) in [tuple(r) for r in got] if join_type == "left" else len(got) == 6
    # one side aliased: its columns keep the alias, the other side's keep their names
    q = spark.createDataFrame([(7, [0.0, 0.0])], "id int, v array<float>").alias("x")
    t = S.toDF("tid", "w")
    out = nearest_by_join(q, t, F.vector_l2_distance(F.col("x.v"), t.w), 1, **PLANS[plan])
    assert [tuple(r) for r in out.select("x.id", "tid").collect()] == [(7, 1)]


def test_double_vectors_of_a_self_join_through_aliases(spark, plan="blocked"):
    """array<double> columns of one DataFrame joined with itself through aliases: the aliases
    place the columns (Spark's analyzer refuses the function over them) and stay on the output.
    Oracle: Spark's own join of float copies (every value is exact in float32)."""
    S = spark.createDataFrame([(1, [0.0, 1.0], [1.0, 1.0]), (2, [1.0, 1.0], [5.0, 5.5]),
                               (3, [5.0, 5.0], [0.0, 1.5]), (4, [0.5, 0.0], [4.0, 4.0])],
                              "id int, v array<double>, w array<double>")
    Sf = S.select("id", *[S[c].cast("array<float>").alias(c) for c in ("v", "w")])
    for function, descending in ((F.vector_l2_distance, False), (F.vector_inner_product, True),
                                 (F.vector_cosine_similarity, True)):
        ours = nearest_by_join(S.alias("a"), S.alias("b"), function(F.col("a.v"), F.col("b.w")), 2,
                               distance_col="d", **PLANS[plan])
        got = ours.select(F.col("a.id").alias("q"), F.col("b.id").alias("t"), "d").collect()
        ranking = function(F.col("a.v"), F.col("b.w"))
        theirs = (Sf.alias("a").nearestByJoin(Sf.alias("b"), ranking, 2, "exact",
                                              "similarity" if descending else "distance")
                  .select(F.col("a.id").alias("q"), F.col("b.id").alias("t"), ranking.alias("d")).collect())
        _same(got, theirs, lambda r: r["q"], lambda r: r["t"], descending=descending)


def test_the_output_keeps_each_side_s_qualifier(spark, plan="broadcast"):
    """Spark's own join keeps each side's qualifier (its alias, a view's name) whatever the
    ranking names its columns through; so does ours, the metric-name form included."""
    q = spark.createDataFrame([(1, [0.0, 0.0]), (2, [10.0, 0.0]), (3, None)], "id int, v array<float>")
    t = spark.createDataFrame([("a", [0.0, 1.0]), ("b", [9.0, 0.0]), ("c", [4.0, 4.0])],
                              "name string, w array<float>")
    x, y = q.alias("x"), t.alias("y")
    t.createOrReplaceTempView("nj_view_targets")
    view = spark.table("nj_view_targets")
    try:
        for query, target, how, vectors, names in (
                (x, y, F.vector_l2_distance(q.v, t.w), None, ("x.id", "y.name")),  # the frames before aliasing
                (x, y, "l2", ("v", "w"), ("x.id", "y.name")),
                (x, view, F.vector_l2_distance(x.v, view.w), None, ("x.id", "nj_view_targets.name"))):
            ranking = F.vector_l2_distance(query.v, target.w)
            for join_type in ("inner",) if target is view else ("inner", "leftouter"):
                ours = nearest_by_join(query, target, how, 2, vectors=vectors, join_type=join_type,
                                       distance_col="d", **PLANS[plan])
                assert ours.columns == ["id", "v", "name", "w", "d"]
                got = ours.select(F.col(names[0]).alias("q"), F.col(names[1]).alias("t"), "d").collect()
                theirs = (query.nearestByJoin(target, ranking, 2, "exact", "distance", joinType=join_type)
                          .select(F.col(names[0]).alias("q"), F.col(names[1]).alias("t"),
                                  ranking.alias("d")).collect())
                _same(got, theirs, lambda r: r["q"], lambda r: r["t"])
        # a self-join through aliases by the metric name: `a.id` and `b.id` are the two `id` columns
        out = nearest_by_join(q.alias("a"), q.alias("b"), "l2", 1, vectors="v", **PLANS[plan])
        assert sorted(tuple(r) for r in out.select("a.id", "b.id").collect()) == [(1, 1), (2, 2)]
    finally:
        spark.catalog.dropTempView("nj_view_targets")


def test_qualifiers_cost_no_exchange(spark, capsys):
    """The target's qualifier comes from a lateral inline over each output row: a Generate in
    the same stage, no join and no exchange beyond those of the unqualified output."""
    q = spark.createDataFrame([(1, [0.0, 0.0])], "id int, v array<float>")
    t = spark.createDataFrame([("a", [0.0, 1.0])], "name string, w array<float>")

    def physical(out) -> str:
        out.explain()
        return capsys.readouterr().out

    for options in PLANS.values():
        plain = physical(nearest_by_join(q, t, "l2", 1, vectors=("v", "w"), **options))
        qualified = physical(nearest_by_join(q.alias("x"), t.alias("y"), "l2", 1, vectors=("v", "w"), **options))
        assert "Generate inline" in qualified and "Generate" not in plain
        for node in ("Exchange", "Join", "MapInArrow", "ArrowEvalPython", "FlatMapGroupsInArrow"):
            assert qualified.count(node) == plain.count(node), (node, plain, qualified)
