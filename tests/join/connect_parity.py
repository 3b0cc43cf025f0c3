"""Run by tests/join/test_connect.py in its own process: a Spark Connect session cannot share
a process with the suite's classic session. Prints one line per case: name, OK or a reason."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import numpy as np  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from nearest_join import explain_nearest_join, nearest_by_join  # noqa: E402
from nearest_join.errors import NearestByJoinError  # noqa: E402
from tests.background import JVM_OPTIONS, python_workers  # noqa: E402
from tests.oracle import assert_same_neighbours, group_rows  # noqa: E402


def main() -> int:
    # The local server as the suite's session (tests/conftest.py): UI off, C1-compiled driver,
    # Python workers from udfs/daemon.py over a Unix domain socket.
    spark = (SparkSession.builder.remote("local[2]")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
             .config(map=python_workers())
             .config("spark.executorEnv.PYTHONPATH", ROOT)
             .getOrCreate())
    assert type(spark).__module__.startswith("pyspark.sql.connect"), type(spark)
    rng = np.random.default_rng(5)
    Q = rng.standard_normal((40, 6)).astype(np.float32)
    T = rng.standard_normal((90, 6)).astype(np.float32)
    q = spark.createDataFrame([(i, Q[i].tolist()) for i in range(40)] + [(99, None)], "qid int, v array<float>")
    t = spark.createDataFrame([(i, T[i].tolist()) for i in range(90)], "tid int, v array<float>")
    cases = [
        ("l2", F.vector_l2_distance, "distance"),
        ("cosine", F.vector_cosine_similarity, "similarity"),
        ("inner_product", F.vector_inner_product, "similarity"),
    ]
    failures = 0
    for name, fn, direction in cases:
        for join_type in ("inner", "leftouter"):
            for plan, options in (("broadcast", {}), ("blocked", dict(broadcast_limit_bytes=0,
                                                                    query_block_rows=9, target_block_rows=25))):
                case = f"{name}-{join_type}-{plan}"
                try:
                    ranking = fn(q.v, t.v)  # same column name on both sides: resolved by plan id
                    assert explain_nearest_join(q, t, ranking, 3, join_type=join_type, **options).plan == plan
                    ours = nearest_by_join(q, t, ranking, 3, join_type=join_type, distance_col="d",
                                           **options).collect()
                    theirs = (q.nearestByJoin(t, ranking, 3, "exact", direction, joinType=join_type)
                              .withColumn("d", ranking).collect())
                    key = lambda r: r["qid"]  # noqa: E731
                    tkey = lambda r: r["tid"]  # noqa: E731
                    val = lambda r: None if r["d"] is None else float(r["d"])  # noqa: E731
                    assert len(ours) == len(theirs), (len(ours), len(theirs))
                    assert_same_neighbours(group_rows(ours, key, tkey, val), group_rows(theirs, key, tkey, val),
                                           descending=direction == "similarity")
                    print(case, "OK", flush=True)
                except Exception as exc:  # report every case, then fail
                    failures += 1
                    print(case, "FAILED", repr(exc)[:500], flush=True)
    failures += queries_broadcast_case(q, t)
    try:
        nearest_by_join(q, t, F.vector_l2_distance(q.v, t.v), 0)
        print("error-num-results FAILED: no error", flush=True)
        failures += 1
    except NearestByJoinError as exc:
        ok = exc.getCondition() == "NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE"
        print("error-num-results", "OK" if ok else f"FAILED {exc}", flush=True)
        failures += not ok
    failures += approx_case(q, t)
    failures += column_cases(spark)
    spark.stop()
    return 1 if failures else 0


def queries_broadcast_case(q, t) -> int:
    """The blocked plan with its query blocks broadcast (thresholds lowered so that these
    sizes take it), LEFT OUTER (a query without a vector), against Spark's own join."""
    from nearest_join import planner

    saved = planner.QUERY_BROADCAST_MIN_TARGET_BYTES, planner.QUERY_BROADCAST_RATIO
    planner.QUERY_BROADCAST_MIN_TARGET_BYTES, planner.QUERY_BROADCAST_RATIO = 0, 0
    try:
        ranking = F.vector_l2_distance(q.v, t.v)
        options = dict(join_type="leftouter", query_block_rows=9, target_block_rows=25)
        assert explain_nearest_join(q, t, ranking, 3, **options).queries_broadcast
        ours = nearest_by_join(q, t, ranking, 3, distance_col="d", **options).collect()
        theirs = q.nearestByJoin(t, ranking, 3, "exact", "distance", joinType="leftouter").withColumn("d", ranking)
        val = lambda r: None if r["d"] is None else float(r["d"])  # noqa: E731
        assert_same_neighbours(group_rows(ours, lambda r: r["qid"], lambda r: r["tid"], val),
                               group_rows(theirs.collect(), lambda r: r["qid"], lambda r: r["tid"], val),
                               descending=False)
        print("l2-leftouter-queries-broadcast OK", flush=True)
        return 0
    except Exception as exc:  # report, then fail
        print("l2-leftouter-queries-broadcast FAILED", repr(exc)[:500], flush=True)
        return 1
    finally:
        planner.QUERY_BROADCAST_MIN_TARGET_BYTES, planner.QUERY_BROADCAST_RATIO = saved


def approx_case(q, t) -> int:
    """mode="approx" through Connect: the IVF plan forced on the small input (its sample,
    k-means on the driver, routed packing), every list probed: the exact result; then nprobe
    left to the recall estimate."""
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    try:
        ranking = F.vector_l2_distance(q.v, t.v)
        planned = plan_join(q, t, ranking, JoinOptions(num_results=3, mode="approx", nlist=4, nprobe=4,
                                                       join_type="leftouter", distance_col="d"))
        assert planned.plan.ivf["runs"] == "ivf" and planned.plan.ivf["nlist"] == 4, planned.plan.ivf
        ours = planned.dataframe().collect()
        exact = nearest_by_join(q, t, ranking, 3, join_type="leftouter", distance_col="d").collect()
        key, tkey = (lambda r: r["qid"]), (lambda r: r["tid"])  # noqa: E731
        val = lambda r: None if r["d"] is None else float(r["d"])  # noqa: E731
        assert len(ours) == len(exact) == 40 * 3 + 1, (len(ours), len(exact))
        assert_same_neighbours(group_rows(ours, key, tkey, val), group_rows(exact, key, tkey, val), descending=False)
        # No nprobe: the screen's query sample and the training sample are drawn at once (two
        # Spark jobs from two threads of one Connect client), then the estimate picks nprobe
        # (3 of the 4 lists here: the plan says IVF would not pay and runs exact).
        screened = plan_join(q, t, ranking, JoinOptions(num_results=3, mode="approx", nlist=4, recall=0.9,
                                                        join_type="leftouter", distance_col="d"))
        assert screened.plan.ivf["recall_queries"] == 40 and screened.plan.ivf["recall_estimate"] >= 0.9, \
            screened.plan.ivf
        assert len(screened.dataframe().collect()) == 40 * 3 + 1
        print("approx-all-lists", "OK", flush=True)
        return 0
    except Exception as exc:  # report every case, then fail
        print("approx-all-lists", "FAILED", repr(exc)[:500], flush=True)
        return 1


def column_cases(spark) -> int:
    """Which side a ranking's columns are on, and names Spark would parse, through Connect
    (tests/join/test_columns.py checks them in the classic session): columns of frames the
    sides derive from, sides found by plan id, dotted and backquoted names, a self-join,
    ragged vectors. Prints one line per case; returns the number that failed."""
    q = spark.createDataFrame([(1, [0.0, 0.0]), (2, [10.0, 0.0])], "qid int, v array<float>")
    t = spark.createDataFrame([("a", [0.0, 0.0], [9.0, 0.0]), ("b", [5.0, 5.0], [5.0, 6.0]),
                               ("c", [3.0, 0.0], [0.0, 1.0])], "tid string, v array<float>, w array<float>")

    def two_target_columns():
        # columns of the frames the joined ones derive from: their plan ids are not the sides' own
        ranking = F.vector_l2_distance(t.v, t.w)
        assert explain_nearest_join(q.filter("qid > 0"), t.filter("tid > ''"), ranking, 1).plan == "spark"

    def sides_by_plan_id():
        plan = explain_nearest_join(q.filter("qid > 0"), t, F.vector_l2_distance(t.w, q.v), 1)
        assert (plan.plan, plan.query_column, plan.target_column) == ("broadcast", "v", "w"), plan
        rows = nearest_by_join(q, t, F.vector_l2_distance(t.w, q.v), 1).collect()
        assert {(r["qid"], r["tid"]) for r in rows} == {(1, "c"), (2, "a")}, rows

    def dotted_names():
        qd = q.withColumnsRenamed({"qid": "q.id", "v": "emb.v1"})
        td = t.withColumnsRenamed({"w": "w`x"})
        rows = nearest_by_join(qd, td, F.vector_l2_distance(qd["`emb.v1`"], td["`w``x`"]), 1).collect()
        assert {(r["q.id"], r["tid"]) for r in rows} == {(1, "c"), (2, "a")}, rows

    def self_join():
        try:
            nearest_by_join(t, t, F.vector_l2_distance(t.v, t.w), 1)
        except ValueError as exc:
            assert "resolve on both the query and the target" in str(exc), exc
        else:
            raise AssertionError("no error")
        rows = nearest_by_join(t, t, F.vector_l2_distance(t.v, t.v), 2).collect()
        assert {(r[0], r[3]) for r in rows if r[0] == "c"} == {("c", "c"), ("c", "a")}, rows

    def aliases_kept():
        # the sides' aliases the ranking names stay on the output (a lateral inline under Connect too)
        a, b = t.alias("a"), t.alias("b")
        out = nearest_by_join(a, b, F.vector_l2_distance(F.col("a.v"), F.col("b.w")), 1, distance_col="d")
        rows = out.select("a.tid", "b.tid", "d").collect()
        assert {(r[0], r[1]) for r in rows} == {("a", "c"), ("b", "b"), ("c", "c")}, rows

    def double_vectors():
        qd = q.select("qid", q.v.cast("array<double>").alias("v"))
        rows = nearest_by_join(qd, t, F.vector_l2_distance(qd.v, t.w), 1).collect()
        assert {(r["qid"], r["tid"]) for r in rows} == {(1, "c"), (2, "a")}, rows

    def aliases_of_the_sides():
        # the sides' qualifiers stay on the output whatever names the vectors: here columns of the
        # aliased frames, which print without their alias under Connect
        a, b = t.alias("a"), t.alias("b")
        out = nearest_by_join(a, b, F.vector_l2_distance(a.v, b.w), 1, distance_col="d")
        rows = out.select("a.tid", "b.tid", "d").collect()
        assert {(r[0], r[1]) for r in rows} == {("a", "c"), ("b", "b"), ("c", "c")}, rows

    def double_vectors_placed():
        # over array<double> each argument is placed by its plan id or its qualifier, not its name
        td = t.select("tid", *[t[c].cast("array<double>").alias(c) for c in ("v", "w")])
        qd = q.select("qid", q.v.cast("array<double>").alias("v"))
        a, b = td.alias("a"), td.alias("b")
        for ranking in (F.vector_l2_distance(F.col("a.v"), F.col("b.w")), F.vector_l2_distance(b.w, a.v)):
            plan = explain_nearest_join(a, b, ranking, 1)
            assert (plan.plan, plan.query_column, plan.target_column) == ("broadcast", "v", "w"), plan
        # td.v against td.w, the query having a `v` too: two target columns, not qd.v vs td.w
        plan = explain_nearest_join(qd, td, F.vector_l2_distance(td.v, td.w), 1, direction="distance")
        assert plan.plan == "spark", plan
        rows = nearest_by_join(qd, td, F.vector_l2_distance(qd.v, td.w), 1).collect()
        assert {(r["qid"], r["tid"]) for r in rows} == {(1, "c"), (2, "a")}, rows

    def ragged():
        r = spark.createDataFrame([(0, [1.0, 0.0]), (1, [1.0, 0.0, 2.0])], "rid int, rv array<float>")
        try:
            nearest_by_join(q, r, F.vector_l2_distance(q.v, r.rv), 1)
        except NearestByJoinError as exc:
            assert exc.getCondition() == "VECTOR_DIMENSION_MISMATCH", exc
            assert "target column `rv` has vectors of dimension 2 and of dimension 3" in str(exc), exc
        else:
            raise AssertionError("no error")

    failures = 0
    for name, check in [("columns-two-target-columns", two_target_columns),
                        ("columns-sides-by-plan-id", sides_by_plan_id), ("columns-dotted-names", dotted_names),
                        ("columns-self-join", self_join), ("columns-aliases-kept", aliases_kept),
                        ("columns-double-vectors", double_vectors),
                        ("columns-aliases-of-the-sides", aliases_of_the_sides),
                        ("columns-double-vectors-placed", double_vectors_placed), ("columns-ragged", ragged)]:
        try:
            check()
            print(name, "OK", flush=True)
        except Exception as exc:  # report every case, then fail
            failures += 1
            print(name, "FAILED", repr(exc)[:500], flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
