"""The local plan: a join small enough for one task, whose inputs Spark estimates small, is
searched in the driver on both sides collected (``nearest_join.join._collect_here``). Its rows
and schema against the one-task Spark plan of the same inputs (the suite's session turns the
local plan off: tests/conftest.py), its rows against the float64 oracle at the embedding
sizes users have, and the joins it must leave to Spark."""
from __future__ import annotations

import datetime
import decimal
import inspect
import shutil

import numpy as np
import pytest
from pyspark.sql import functions as F

from nearest_join import explain_nearest_join, nearest_by_join, planner
from nearest_join.errors import NearestByJoinError
from nearest_join.join import plan_join
from nearest_join.options import JoinOptions
from tests.adversarial import cases
from tests.oracle import assert_join_true_topk, group_rows

LIMIT = planner.CONF_PREFIX + "localLimitBytes"
RANKINGS = {
    "l2": lambda q, t: F.vector_l2_distance(q.v, t.w),
    "cosine": lambda q, t: F.vector_cosine_similarity(q.v, t.w),
    "inner_product": lambda q, t: F.vector_inner_product(q.v, t.w),
}


def options(q, t, ranking, k, **kwargs) -> JoinOptions:
    bound = inspect.signature(nearest_by_join).bind(q, t, ranking, k, **kwargs)
    bound.apply_defaults()
    return JoinOptions.from_arguments(bound.arguments)


def both_ways(spark, join):
    """``join()`` (a function returning (DataFrame, JoinPlan)) under the default local limit
    and with the local plan off: ((rows, schema, plan), (rows, schema, plan))."""
    before, out = spark.conf.get(LIMIT, None), []
    try:
        for limit in (None, "0"):
            if limit is None:
                spark.conf.unset(LIMIT)
            else:
                spark.conf.set(LIMIT, limit)
            df, plan = join()
            out.append((sorted(map(repr, df.collect())), df.schema, plan))
    finally:
        if before is None:
            spark.conf.unset(LIMIT)
        else:
            spark.conf.set(LIMIT, before)
    return out


def assert_same_as_one_task(spark, q, t, ranking, k, **kwargs):
    def join():
        planned = plan_join(q, t, ranking, options(q, t, ranking, k, **kwargs))
        return planned.dataframe(), planned.plan

    (ours, ours_schema, ours_plan), (theirs, theirs_schema, theirs_plan) = both_ways(spark, join)
    assert ours_plan.plan == "local", ours_plan
    assert theirs_plan.plan == "broadcast" and theirs_plan.one_task, theirs_plan
    assert ours_schema == theirs_schema
    assert ours == theirs
    return ours


@pytest.fixture(scope="module")
def mixed(spark):
    """Payload of many types, a NULL vector, a NaN element, a zero vector (no cosine match),
    exact duplicates among the targets (ties), under aliases (the output keeps qualifiers)."""
    q = spark.createDataFrame(
        [(1, [0.0, 0.0], datetime.datetime(2020, 1, 1, 3, 4, 5), decimal.Decimal("1.50"), {"a": 1}, ("x", 2), b"\x00"),
         (2, None, None, None, None, None, None),
         (3, [1.0, 1.0], datetime.datetime(2021, 6, 1), decimal.Decimal("2.25"), {}, ("y", None), b""),
         (4, [1.0, float("nan")], None, None, None, None, None),
         (5, [3.0, -1.0], None, decimal.Decimal("-7.00"), {"b": None}, None, b"\xff")],
        "id int, v array<float>, ts timestamp, dec decimal(10,2), m map<string,int>, "
        "s struct<a:string,b:int>, bin binary").alias("Q")
    t = spark.createDataFrame(
        [("a", [3.0, 4.0], datetime.date(2020, 1, 2)), ("b", [1.0, 0.0], None), ("c", [1.0, 0.0], None),
         ("z", [0.0, 0.0], None), ("n", None, datetime.date(1999, 12, 31)), ("e", [-2.0, 1.5], None)],
        "name string, w array<float>, dt date").alias("T")
    return q, t


EXTRAS = {"plain": {}, "distance": {"distance_col": "d"}, "no-vectors": {"keep_vectors": False}, "cap": {"cap": True}}
# Every option with l2 under both join types, and each similarity's way of matching (a zero
# vector never does) under both.
COMBINATIONS = ([("l2", join_type, extra) for join_type in ("inner", "leftouter") for extra in EXTRAS]
                + [("cosine", "leftouter", "cap"), ("cosine", "inner", "distance"),
                   ("inner_product", "leftouter", "distance"), ("inner_product", "inner", "cap")])


@pytest.mark.parametrize("metric,join_type,extra", COMBINATIONS, ids=["-".join(c) for c in COMBINATIONS])
def test_same_rows_and_schema_as_the_one_task_plan(spark, mixed, metric, join_type, extra):
    q, t = mixed
    kwargs = dict(EXTRAS[extra])
    if kwargs.pop("cap", False):
        kwargs.update({"max_distance": 2.5} if metric == "l2" else {"min_similarity": 0.5}, distance_col="d")
    rows = assert_same_as_one_task(spark, q, t, RANKINGS[metric](q, t), 3, join_type=join_type, **kwargs)
    assert rows   # every combination matches something


def test_the_output_keeps_the_sides_qualifiers(local_plan, mixed):
    q, t = mixed
    out = nearest_by_join(q, t, F.vector_l2_distance(q.v, t.w), 2, distance_col="d")
    picked = out.select("Q.id", "T.name", "d").where(F.col("Q.id") == 1).collect()
    assert sorted((r["name"], r["d"]) for r in picked) == [("b", 1.0), ("z", 0.0)]


@pytest.mark.parametrize("sides", ["no queries", "no targets", "no vectors", "k above the targets"])
@pytest.mark.parametrize("join_type", ["inner", "leftouter"])
def test_empty_and_short_sides(spark, sides, join_type):
    q_rows = [] if sides == "no queries" else [(1, [0.0, 1.0]), (2, [2.0, 2.0])]
    t_rows = [] if sides == "no targets" else [(10, [0.0, 0.0]), (11, [1.0, 1.0])]
    if sides == "no vectors":
        q_rows, t_rows = [(1, None)], [(10, None)]
    q = spark.createDataFrame(q_rows, "id int, v array<float>")
    t = spark.createDataFrame(t_rows, "tid int, w array<float>")
    k = 5 if sides == "k above the targets" else 1
    assert_same_as_one_task(spark, q, t, F.vector_l2_distance(q.v, t.w), k, join_type=join_type,
                            distance_col="d")


@pytest.mark.parametrize("d", [1, 128, 384, 768, 1024, 1536])
def test_embedding_sizes_against_the_oracle(local_plan, d):
    """Non-centred unit-ish embeddings with duplicates: the local plan's rows are each query's
    true top k of the float64 oracle."""
    rng = np.random.default_rng(d)
    T = (rng.standard_normal((300, d)) * 0.1 + 5.0).astype(np.float32)
    T[100:110] = T[0]                       # a group of identical rows
    Q = np.vstack([T[:20], rng.standard_normal((20, d)).astype(np.float32) * 0.1 + 5.0])
    q = local_plan.createDataFrame([(i, Q[i].tolist()) for i in range(len(Q))], "qid int, v array<float>")
    t = local_plan.createDataFrame([(j, T[j].tolist()) for j in range(len(T))], "tid int, w array<float>")
    for metric in ("l2", "cosine"):
        plan = explain_nearest_join(q, t, RANKINGS[metric](q, t), 10)
        assert plan.plan == "local", plan
        rows = nearest_by_join(q, t, RANKINGS[metric](q, t), 10, distance_col="d").collect()
        ours = group_rows(rows, lambda r: r["qid"], lambda r: r["tid"], lambda r: float(r["d"]))
        assert_join_true_topk(ours, Q, T, 10, metric, list(range(len(Q))), list(range(len(T))),
                              case=f"d={d} {metric}")


@pytest.mark.parametrize("case", [c for c in cases(dims=(1, 3, 64)) if c.queries.dtype == np.float32],
                         ids=repr)
def test_adversarial_inputs_against_the_oracle(local_plan, case):
    q = local_plan.createDataFrame([(i, row.tolist()) for i, row in enumerate(case.queries)], "qid int, v array<float>")
    t = local_plan.createDataFrame([(j, row.tolist()) for j, row in enumerate(case.targets)], "tid int, w array<float>")
    metric = case.metrics[0]
    ranking = {"sqeuclidean": "sqeuclidean"}.get(metric) or RANKINGS[metric](q, t)
    kwargs = {"vectors": ("v", "w")} if metric == "sqeuclidean" else {}
    assert explain_nearest_join(q, t, ranking, 5, **kwargs).plan == "local"
    rows = nearest_by_join(q, t, ranking, 5, distance_col="d", **kwargs).collect()
    ours = group_rows(rows, lambda r: r["qid"], lambda r: r["tid"], lambda r: float(r["d"]))
    assert_join_true_topk(ours, case.queries, case.targets, 5, metric, list(range(len(case.queries))),
                          list(range(len(case.targets))), case=case.name)


def test_the_jobs_columns_and_first_match_mark(spark, mixed):
    """What the batch jobs ask of ``PlannedJoin.dataframe``: kept columns and the mark on each
    query's best row, as the one-task plan emits them."""
    q, t = mixed

    def join():
        ranking = F.vector_l2_distance(q.v, t.w)
        planned = plan_join(q, t, ranking, options(q, t, ranking, 2, join_type="leftouter"))
        return planned.dataframe(first_match_column="first", query_columns=(0, 3), target_columns=(0,)), planned.plan

    (ours, ours_schema, plan), (theirs, theirs_schema, _) = both_ways(spark, join)
    assert plan.plan == "local" and ours_schema == theirs_schema and ours == theirs
    assert ours_schema.names == ["id", "dec", "name", "first"]


def test_no_query_column_kept(spark, mixed):
    q, t = mixed
    q = q.select("v")
    assert_same_as_one_task(spark, q, t, F.vector_l2_distance(q.v, t.w), 2, keep_vectors=False, distance_col="d")


def test_the_searches_seconds_are_counted(local_plan, mixed):
    q, t = mixed
    ranking = F.vector_l2_distance(q.v, t.w)
    planned = plan_join(q, t, ranking, options(q, t, ranking, 2))
    planned.dataframe().collect()
    assert planned.plan.plan == "local" and planned.executor_seconds()["search"] > 0


def test_approx_of_a_small_join_runs_exact_here(local_plan, mixed):
    """Approx without index, nlist or nprobe runs exact below IVF's sizes, which every local
    join is; the plan says why."""
    q, t = mixed
    ranking = F.vector_l2_distance(q.v, t.w)
    plan = explain_nearest_join(q, t, ranking, 2, "approx", recall=0.9)
    assert plan.plan == "local" and plan.ivf["runs"] == "exact" and "too few for IVF to win" in plan.ivf["explanation"]
    approx = nearest_by_join(q, t, ranking, 2, "approx", recall=0.9, distance_col="d").collect()
    exact = nearest_by_join(q, t, ranking, 2, distance_col="d").collect()
    assert sorted(map(repr, approx)) == sorted(map(repr, exact))


def test_the_rows_are_the_inputs_at_the_call(local_plan, tmp_path):
    """The search runs at the call: a source rewritten afterwards does not change the rows,
    and evaluating the result again reads no input (the files may be gone)."""
    t = local_plan.createDataFrame([(10, [0.0, 0.0]), (11, [5.0, 5.0])], "tid int, w array<float>")
    local_plan.createDataFrame([(1, [4.0, 4.0])], "id int, v array<float>").write.parquet(str(tmp_path / "q"))
    q = local_plan.read.parquet(str(tmp_path / "q"))
    out = nearest_by_join(q, t, F.vector_l2_distance(q.v, t.w), 1)
    rewritten = local_plan.createDataFrame([(1, [0.0, 1.0])], "id int, v array<float>")
    rewritten.write.mode("overwrite").parquet(str(tmp_path / "q"))
    assert [(r["id"], r["tid"]) for r in out.collect()] == [(1, 11)]
    shutil.rmtree(tmp_path / "q")
    assert [(r["id"], r["tid"]) for r in out.collect()] == [(1, 11)]


def test_a_ragged_side_fails_at_call_time(local_plan):
    q = local_plan.createDataFrame([(1, [0.0, 1.0]), (2, [0.0, 1.0, 2.0])], "id int, v array<float>")
    t = local_plan.createDataFrame([(10, [0.0, 0.0])], "tid int, w array<float>")
    with pytest.raises(NearestByJoinError, match="VECTOR_DIMENSION_MISMATCH"):
        nearest_by_join(q, t, F.vector_l2_distance(q.v, t.w), 1)


def test_plan_text(local_plan, mixed):
    q, t = mixed
    text = str(explain_nearest_join(q, t, F.vector_l2_distance(q.v, t.w), 2))
    assert text.startswith("nearest_by_join plan: local (both sides estimated ")
    assert "collected and searched in the driver" in text and "backend cpu searches in float32" in text


def _udf_side(spark):
    from pyspark.sql.types import ArrayType, FloatType

    double = F.udf(lambda v: [2 * x for x in v], ArrayType(FloatType()))
    return spark.createDataFrame([(10, [0.0, 0.0])], "tid int, w0 array<float>").select("tid", double("w0").alias("w"))


@pytest.mark.parametrize("why", ["limit 0", "over the limit", "keys", "approx forcing IVF", "python in the plan",
                                 "not estimated", "ml vectors", "too much work"])
def test_joins_left_to_spark(local_plan, monkeypatch, why):
    q = local_plan.createDataFrame([(1, "k", [0.0, 1.0]), (2, "k", [2.0, 2.0])], "id int, key string, v array<float>")
    t = local_plan.createDataFrame([(10, "k", [0.0, 0.0]), (11, "k", [1.0, 1.0])], "tid int, key string, w array<float>")
    kwargs = {}
    if why == "limit 0":
        local_plan.conf.set(LIMIT, "0")
    elif why == "over the limit":
        local_plan.conf.set(LIMIT, "100b")
    elif why == "keys":
        kwargs["on"] = "key"
    elif why == "approx forcing IVF":
        kwargs.update(mode="approx", nlist=2)
    elif why == "python in the plan":
        t = _udf_side(local_plan)
    elif why == "not estimated":
        rows = local_plan.sparkContext.parallelize([(10, [0.0, 0.0])])
        t = local_plan.createDataFrame(rows, "tid int, w array<float>")
    elif why == "ml vectors":
        from pyspark.ml.linalg import Vectors, VectorUDT
        from pyspark.sql.types import IntegerType, StructField, StructType

        t = local_plan.createDataFrame([(10, Vectors.dense([0.0, 0.0]))],
                                  StructType([StructField("tid", IntegerType()), StructField("w", VectorUDT())]))
    elif why == "too much work":
        monkeypatch.setattr(planner, "ONE_TASK_WORK", 0)
    ranking = F.vector_l2_distance(q.v, t.w)
    assert explain_nearest_join(q, t, ranking, 1, **kwargs).plan != "local"
    rows = nearest_by_join(q, t, ranking, 1, distance_col="d", **kwargs).collect()
    assert sorted((r["id"], r["d"]) for r in rows)[0] == (1, 1.0)
