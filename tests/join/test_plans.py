"""nearest_by_join against the float64 reference at larger sizes, for every plan."""
from __future__ import annotations

import os

import numpy as np
import pytest
from pyspark.sql import functions as F

from nearest_join import explain_nearest_join, nearest_by_join, planner
from tests.oracle import assert_join_true_topk, group_rows

NQ, NT, D, K = 300, 2_000, 33, 10
PLANS = {
    "one task": {},    # the broadcast plan of a small join: both sides read in the search's task
    "broadcast": {},   # the broadcast plan with its broadcast job (_plan_as)
    "blocked": dict(broadcast_limit_bytes=0, query_block_rows=70, target_block_rows=450),
}


def _plan_as(monkeypatch, plan: str) -> tuple[str, bool]:
    """Make these sizes plan ``plan`` (one of PLANS): the broadcast job runs for joins of
    ``ONE_TASK_WORK`` and more. Returns the plan's (``plan``, ``one_task``)."""
    if plan == "broadcast":
        monkeypatch.setattr(planner, "ONE_TASK_WORK", 0)
    return ("broadcast" if plan == "one task" else plan), plan == "one task"


@pytest.fixture(scope="module")
def data(spark):
    rng = np.random.default_rng(11)
    Q = rng.standard_normal((NQ, D)).astype(np.float32)
    T = rng.standard_normal((NT, D)).astype(np.float32)
    q = spark.createDataFrame([(i, Q[i].tolist()) for i in range(NQ)], "qid int, qv array<float>")
    t = spark.createDataFrame([(i, f"name{i}", T[i].tolist()) for i in range(NT)],
                              "tid int, name string, tv array<float>")
    return Q, T, q.repartition(3).cache(), t.repartition(4).cache()


def _check(rows, Q, T, k, metric):
    """Each query's rows are its true top k of the float64 oracle, at the operator's
    tolerance (the cpu kernel's plus float32 rounding of the k-th value: tests.oracle)."""
    ours = group_rows(rows, lambda r: r["qid"], lambda r: r["tid"], lambda r: float(r["d"]))
    assert_join_true_topk(ours, Q, T, k, metric, list(range(len(Q))), list(range(len(T))))


@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "cosine", "inner_product"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_plan_matches_reference(spark, data, monkeypatch, plan, metric):
    Q, T, q, t = data
    expected = _plan_as(monkeypatch, plan)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "16")  # many batches
    try:
        out = nearest_by_join(q, t, metric, K, vectors=("qv", "tv"), distance_col="d", **PLANS[plan])
        explained = explain_nearest_join(q, t, metric, K, vectors=("qv", "tv"), **PLANS[plan])
        assert (explained.plan, explained.one_task) == expected
        rows = out.collect()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert len(rows) == NQ * K
    _check(rows, Q, T, K, metric)


@pytest.mark.parametrize("plan", list(PLANS))
def test_executor_seconds_per_phase(data, monkeypatch, plan):
    """The executors time each phase of a join's tasks into its accumulator: nothing before
    the first evaluation, the phases after it (a search and an emit always run), more after
    a second evaluation."""
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions
    from udfs.timing import PHASES

    Q, T, q, t = data
    expected = _plan_as(monkeypatch, plan)
    planned = plan_join(q, t, "l2", JoinOptions(num_results=K, vectors=("qv", "tv"), **PLANS[plan]))
    assert (planned.plan.plan, planned.plan.one_task) == expected and planned.executor_seconds() == {}
    planned.dataframe().write.format("noop").mode("overwrite").save()
    first = planned.executor_seconds()
    assert set(first) <= set(PHASES) and {"pack", "decode", "search", "encode"} <= set(first)
    assert first["search"] > 0 and all(seconds >= 0 for seconds in first.values())
    planned.dataframe().write.format("noop").mode("overwrite").save()
    assert planned.executor_seconds()["search"] > first["search"]


def test_plans_agree_exactly(data, monkeypatch):
    Q, T, q, t = data
    results = {}
    for plan, options in PLANS.items():
        with monkeypatch.context() as patch:
            _plan_as(patch, plan)
            rows = nearest_by_join(q, t, F.vector_l2_distance(q.qv, t.tv), 5, distance_col="d",
                                   **options).collect()
        results[plan] = sorted((r["qid"], r["tid"], r["d"]) for r in rows)
    assert results["one task"] == results["broadcast"] == results["blocked"]


def test_broadcast_query_blocks_match_reference(spark, data, monkeypatch, metric="l2"):
    """The blocked plan with its query blocks broadcast (a query side much smaller than a large
    target: here the thresholds are lowered so that these sizes take it): the target streams
    past them in its own partitions. Several query and target blocks; then LEFT OUTER with a
    query without a vector and an empty target. One metric: the pairing is the plan's, the
    metrics' code (packing, kernels, merge) is the blocked plan's, tested for all four above."""
    from nearest_join import planner

    monkeypatch.setattr(planner, "QUERY_BROADCAST_MIN_TARGET_BYTES", 0)
    monkeypatch.setattr(planner, "QUERY_BROADCAST_RATIO", 0)
    Q, T, q, t = data
    options = dict(vectors=("qv", "tv"), query_block_rows=70, target_block_rows=450)
    small = q.where("qid < 140")
    plan = explain_nearest_join(small, t, metric, K, **options)
    assert plan.plan == "blocked" and plan.queries_broadcast and "broadcast to every target" in str(plan)
    rows = nearest_by_join(small, t, metric, K, distance_col="d", **options).collect()
    assert len(rows) == 140 * K
    _check(rows, Q[:140], T, K, metric)
    # LEFT OUTER: a query without a vector, and one against an empty target, keep a NULL row
    nulls = small.where("qid < 3").withColumn("qv", F.when(F.col("qid") == 0, None).otherwise(F.col("qv")))
    rows = nearest_by_join(nulls, t, metric, 2, join_type="left", distance_col="d", **options).collect()
    assert sorted((r["qid"], r["tid"] is None) for r in rows) == [(0, True), (1, False), (1, False),
                                                                  (2, False), (2, False)]
    assert explain_nearest_join(nulls, t.where("tid < 0"), metric, 2, **options).queries_broadcast
    rows = nearest_by_join(nulls, t.where("tid < 0"), metric, 2, join_type="left", distance_col="d",
                           **options).collect()
    assert sorted((r["qid"], r["tid"], r["d"]) for r in rows) == [(0, None, None), (1, None, None), (2, None, None)]


@pytest.mark.parametrize("plan", ["broadcast", "queries broadcast"])
def test_a_streamed_side_of_empty_and_skewed_partitions(spark, data, monkeypatch, plan):
    """The streamed side reaches the search as rows, each task's first row carrying the
    broadcast blocks: 64 partitions, most of them empty, one holding most rows (many Arrow
    batches); LEFT OUTER with a query without a vector; a query side without rows."""
    Q, T, q, t = data
    skewed = lambda df, name, few: df.repartition(64, F.when(F.col(name) < few, 0).otherwise(F.col(name)))
    queries = q.where("qid < 40").withColumn("qv", F.when(F.col("qid") == 7, None).otherwise(F.col("qv")))
    if plan == "broadcast":
        monkeypatch.setattr(planner, "ONE_TASK_WORK", 0)
        queries, targets = skewed(queries, "qid", 30), t
    else:
        monkeypatch.setattr(planner, "QUERY_BROADCAST_MIN_TARGET_BYTES", 0)
        monkeypatch.setattr(planner, "QUERY_BROADCAST_RATIO", 0)
        targets = skewed(t, "tid", 1500)
    options = dict(vectors=("qv", "tv"), join_type="left", target_block_rows=300)
    explained = explain_nearest_join(queries, targets, "l2", K, **options)
    assert (explained.plan, explained.queries_broadcast, explained.one_task) == \
        (("broadcast", False, False) if plan == "broadcast" else ("blocked", True, False))
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "16")
    try:
        rows = nearest_by_join(queries, targets, "l2", K, distance_col="d", **options).collect()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert sorted((r["qid"], r["tid"]) for r in rows if r["qid"] == 7) == [(7, None)]
    rows = [r for r in rows if r["qid"] != 7]
    assert len(rows) == 39 * K
    ours = group_rows(rows, lambda r: r["qid"], lambda r: r["tid"], lambda r: float(r["d"]))
    kept = [i for i in range(40) if i != 7]
    assert_join_true_topk(ours, Q[kept], T, K, "l2", kept, list(range(NT)))
    # no query rows: no broadcast block for the target's tasks to meet, and no row
    none = queries.where("qid < 0")
    assert explain_nearest_join(none, targets, "l2", K, **options).queries_broadcast == (plan != "broadcast")
    assert nearest_by_join(none, targets, "l2", K, **options).collect() == []


def test_a_small_join_runs_one_job_of_one_task(spark, data):
    """A small join of inputs cheap to read in one task runs one Spark job of one task (no
    broadcast job); an input that runs Python (an embedding model, say) is not read in one
    task."""
    Q, T, q, t = data
    options = dict(vectors=("qv", "tv"), distance_col="d")
    assert q.rdd.getNumPartitions() == 3 and q.count() == NQ and t.count() == NT   # cached, several partitions
    assert explain_nearest_join(q, t, "l2", K, **options).one_task
    out = nearest_by_join(q, t, "l2", K, **options)
    sc, group = spark.sparkContext, "test-one-task"
    sc.setJobGroup(group, "a small join")
    try:
        rows = out.collect()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    tracker = sc.statusTracker()
    jobs = tracker.getJobIdsForGroup(group)
    ran = [tracker.getStageInfo(stage) for stage in tracker.getJobInfo(jobs[0]).stageIds]
    # (the stages that built the cached inputs are listed too, skipped: no task completed)
    assert len(jobs) == 1 and [stage.numCompletedTasks for stage in ran if stage.numCompletedTasks] == [1]
    _check(rows, Q, T, K, "l2")
    python_side = t.mapInArrow(lambda batches: batches, t.schema)
    assert not explain_nearest_join(q, python_side, "l2", K, **options).one_task


def test_payload_follows_its_vector_through_a_nondeterministic_source(spark, data):
    """Target rows from a union + repartition (row order differs between evaluations):
    every output row's payload must belong to the vector that was ranked."""
    Q, T, q, _ = data
    half = NT // 2
    t1 = spark.createDataFrame([(i, T[i].tolist()) for i in range(half)], "tid int, tv array<float>")
    t2 = spark.createDataFrame([(i, T[i].tolist()) for i in range(half, NT)], "tid int, tv array<float>")
    shuffled = t1.union(t2).repartition(5)
    for options in PLANS.values():
        rows = nearest_by_join(q, shuffled, F.vector_l2_distance(q.qv, shuffled.tv), 3,
                               distance_col="d", **options).collect()
        assert len(rows) == NQ * 3
        for r in rows:
            np.testing.assert_array_equal(np.asarray(r["tv"], np.float32), T[r["tid"]])
            expected = np.linalg.norm(Q[r["qid"]].astype(np.float64) - T[r["tid"]])
            assert abs(r["d"] - expected) <= 1e-4 * max(1.0, expected)
        _check(rows, Q, T, 3, "l2")


def test_array_double_and_vector_udt(spark):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(3)
    Q = rng.standard_normal((20, 5))
    T = rng.standard_normal((50, 5))
    q = spark.createDataFrame([(i, Vectors.dense(Q[i])) for i in range(20)], ["qid", "qv"])
    rows_t = [(i, T[i].tolist()) for i in range(50)]
    t = spark.createDataFrame(rows_t, "tid int, tv array<double>")
    out = nearest_by_join(q, t, "cosine", 4, vectors=("qv", "tv"), distance_col="d")
    assert type(out.schema["qv"].dataType).__name__ == "VectorUDT"
    rows = out.collect()
    _check(rows, Q, T, 4, "cosine")
    assert all(isinstance(r["qv"], type(Vectors.dense([1.0]))) for r in rows)
    # sparse ml vectors are densified
    qs = spark.createDataFrame([(0, Vectors.sparse(5, [1, 3], [Q[0][1], Q[0][3]]))], ["qid", "qv"])
    sparse_q = np.zeros((1, 5))
    sparse_q[0, [1, 3]] = Q[0][[1, 3]]
    _check(nearest_by_join(qs, t, "l2", 3, vectors=("qv", "tv"), distance_col="d").collect(),
           sparse_q, T, 3, "l2")


def test_same_column_names_on_both_sides(spark):
    q = spark.createDataFrame([(1, "q", [0.0, 0.0])], "id int, name string, v array<float>")
    t = spark.createDataFrame([(7, "a", [1.0, 0.0]), (8, "b", [3.0, 4.0])], "id int, name string, v array<float>")
    out = nearest_by_join(q, t, F.vector_l2_distance(t.v, q.v), 2, distance_col="id")
    assert out.columns == ["id", "name", "v", "id", "name", "v", "id"]
    assert sorted(tuple(r) for r in out.collect()) == [
        (1, "q", [0.0, 0.0], 7, "a", [1.0, 0.0], 1.0),
        (1, "q", [0.0, 0.0], 8, "b", [3.0, 4.0], 5.0),
    ]


def test_non_vector_ranking_falls_back_to_spark(spark, caplog):
    users = spark.createDataFrame([(1, 10.0), (2, 20.0), (3, 30.0)], ["user_id", "score"])
    products = spark.createDataFrame([("A", 11.0), ("B", 22.0), ("C", 5.0)], ["product", "pscore"])
    with caplog.at_level("WARNING", logger="nearest_join.join"):
        out = nearest_by_join(users, products, -F.abs(users.score - products.pscore), 1,
                              "exact", "similarity")
    assert "Spark's own nearestByJoin" in caplog.text
    assert sorted((r["user_id"], r["product"]) for r in out.collect()) == [(1, "A"), (2, "B"), (3, "B")]
    plan = explain_nearest_join(users, products, -F.abs(users.score - products.pscore), 1,
                                "exact", "similarity")
    assert plan.plan == "spark"


def test_explain_reports_plan_and_blocks(data, monkeypatch):
    _, _, q, t = data
    plan = explain_nearest_join(q, t, F.vector_l2_distance(q.qv, t.tv), 7)
    d = plan.to_dict()
    assert (d["plan"], d["query_rows"], d["target_rows"], d["dimension"], d["k"]) == ("broadcast", NQ, NT, D, 7)
    assert d["target_bytes"] == NT * D * 4
    assert d["one_task"] and d["query_blocks"] == 1 and "one task" in str(plan)
    monkeypatch.setattr(planner, "ONE_TASK_WORK", 0)   # as a join of more work
    spread = explain_nearest_join(q, t, F.vector_l2_distance(q.qv, t.tv), 7).to_dict()
    assert not spread["one_task"] and spread["query_blocks"] >= 2  # enough blocks to use both cores
    blocked = explain_nearest_join(q, t, F.vector_l2_distance(q.qv, t.tv), 7, broadcast_limit_bytes=1000)
    assert blocked.plan == "blocked" and "broadcast limit 1000" in blocked.reason
    assert "blocked" in str(blocked) and str(NT) in str(blocked)


def test_approx_mode_returns_exact_results(data):
    Q, T, q, t = data
    rows = nearest_by_join(q, t, F.vector_l2_distance(q.qv, t.tv), 3, "approx", distance_col="d").collect()
    _check(rows, Q, T, 3, "l2")


def test_several_query_blocks_per_task_and_small_broadcast_target_blocks(spark, data):
    """queryBlocksPerTask > 1 (a task folds and emits block after block while the next is
    searched) and small broadcast target blocks: same exact answer."""
    Q, T, q, t = data
    settings = {"spark.nearestJoin.queryBlocksPerTask": "3",
                "spark.nearestJoin.broadcastTargetBlockBytes": str(300 * D * 4)}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        plan = explain_nearest_join(q, t, "l2", K, vectors=("qv", "tv"))
        assert plan.plan == "broadcast" and plan.target_block_rows == 300
        assert plan.query_blocks >= 3 * max(1, plan.query_partitions)
        rows = nearest_by_join(q, t, "l2", K, vectors=("qv", "tv"), distance_col="d").collect()
    finally:
        for key in settings:
            spark.conf.unset(key)
    _check(rows, Q, T, K, "l2")


@pytest.mark.parametrize("master, slots", [
    ("local", 1), ("local[2]", 2), ("local[3,4]", 3), ("local[*]", os.cpu_count()),
    ("local-cluster[2,1,1024]", 2), ("local-cluster[3, 2, 512]", 6), ("yarn", None), ("spark://h:7077", None),
])
def test_local_task_slots(master, slots):
    from nearest_join.join import local_task_slots

    assert local_task_slots(master) == slots


def test_a_local_session_starts_its_python_workers_once(spark, monkeypatch):
    """Under a local master the first join starts one empty task per slot but one (its Python
    workers; a slot stays free for the facts job) on a thread, once per application."""
    import threading

    from nearest_join import join

    started = []
    monkeypatch.setattr(join, "_workers_started", set())
    monkeypatch.setattr(threading, "Thread", lambda target, **kw: started.append(target) or _Now(target))
    sc = spark.sparkContext
    sc.setJobGroup("starting the workers", "")
    try:
        join.start_python_workers(spark)
        join.start_python_workers(spark)
    finally:
        sc.setJobGroup("", "")
    assert len(started) == 1
    tracker = sc.statusTracker()
    (job,) = tracker.getJobIdsForGroup("starting the workers")
    tasks = sum(tracker.getStageInfo(stage).numTasks for stage in tracker.getJobInfo(job).stageIds)
    assert tasks == max(1, join.local_task_slots(spark.conf.get("spark.master")) - 1) == 1   # local[2]


class _Now:
    def __init__(self, target):
        self.target = target

    def start(self):
        self.target()


def test_the_search_runs_no_python_but_the_join_s_own(spark, capsys):
    """The Python stages of a join are its packing, search and merge (mapInArrow,
    applyInArrow): no Python rows deserialised by a Python RDD (``ExistingRDD``, which also
    starts a Python worker daemon of its own in the first join of a session)."""
    q = spark.range(3).selectExpr("id", "array(cast(id as float), 0f) as v")
    t = spark.range(5).selectExpr("id as tid", "array(0f, cast(id as float)) as w")
    for options in ({}, dict(broadcast_limit_bytes=0, query_block_rows=2, target_block_rows=2)):
        nearest_by_join(q, t, "l2", 2, vectors=("v", "w"), **options).explain()
        physical = capsys.readouterr().out
        assert "MapInArrow" in physical and "ExistingRDD" not in physical, physical


def test_a_local_join_warms_the_blocked_plans_kernels_only_when_it_plans_it(spark, monkeypatch):
    """Under a local master the driver warms the broadcast plan's kernels from the start, and
    the blocked plan's once a join plans it: a join that never runs the blocked plan does not
    compile its kernels beside its facts job."""
    from nearest_join import join

    warmed = []
    monkeypatch.setattr(join, "start_warm_up", lambda warm, plans: warmed.append(plans))
    q = spark.createDataFrame([(1, [0.0, 1.0])], "id int, v array<float>")
    t = spark.createDataFrame([(2, [1.0, 1.0]), (3, [2.0, 0.0])], "id int, v array<float>")
    for limit, expected in ((None, [("broadcast",)]), (0, [("broadcast",), ("blocked",)])):
        warmed.clear()
        plan = join.explain_nearest_join(q, t, "l2", 1, vectors="v", broadcast_limit_bytes=limit)
        assert plan.plan == ("broadcast" if limit is None else "blocked") and warmed == expected
