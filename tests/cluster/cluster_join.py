"""Run by tests/cluster/test_cluster.py in its own process: a local-cluster master (two real
executor JVMs) cannot share a process with the suite's local[2] session.

Checks both plans (the blocked one both ways: both sides shuffled into pairs, and its query
blocks broadcast) and the local plan (Parquet inputs collected from both executors) against the
float64 reference across two executors, then kills one
executor JVM while a blocked join runs and checks that the retried join still returns the
exact answer. Prints one line per check: name, OK or FAILED with a reason.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from nearest_join import explain_nearest_join, nearest_by_join  # noqa: E402
from tests.background import JVM_OPTIONS, python_workers  # noqa: E402
from tests.oracle import assert_join_true_topk, group_rows  # noqa: E402

NQ, NT, D, K = 400, 3000, 16, 5


def executor_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "CoarseGrainedExecutorBackend"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def check(name, fn) -> bool:
    try:
        fn()
        print(name, "OK", flush=True)
        return True
    except Exception as exc:  # report every check
        print(name, "FAILED", repr(exc)[:800], flush=True)
        return False


def main() -> int:
    spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("nearest_join-cluster")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executorEnv.PYTHONPATH", ROOT)
             # As the suite's session (tests/conftest.py): its JVM options, Python workers
             # from udfs/daemon.py over a Unix domain socket.
             .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
             .config("spark.executor.extraJavaOptions", JVM_OPTIONS)
             .config(map=python_workers())
             .config("spark.task.maxFailures", "4")
             .config("spark.sql.shuffle.partitions", "4")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    rng = np.random.default_rng(17)
    Q = rng.standard_normal((NQ, D)).astype(np.float32)
    T = rng.standard_normal((NT, D)).astype(np.float32)
    q = spark.createDataFrame([(i, Q[i].tolist()) for i in range(NQ)], "qid int, qv array<float>").repartition(4)
    t = spark.createDataFrame([(i, T[i].tolist()) for i in range(NT)], "tid int, tv array<float>").repartition(6)
    blocked = dict(broadcast_limit_bytes=0, query_block_rows=60, target_block_rows=500)

    def join(**options):
        rows = nearest_by_join(q, t, F.vector_l2_distance(q.qv, t.tv), K, distance_col="d", **options).collect()
        assert len(rows) == NQ * K, len(rows)
        ours = group_rows(rows, lambda r: r["qid"], lambda r: r["tid"], lambda r: float(r["d"]))
        assert_join_true_topk(ours, Q, T, K, "l2", list(range(NQ)), list(range(NT)))

    def two_executors():
        pids = executor_pids()
        assert len(pids) == 2, f"expected 2 executor JVMs, found {pids}"
        assert explain_nearest_join(q, t, "l2", K, vectors=("qv", "tv")).cores == 2

    def survives_executor_loss():
        victims = executor_pids()
        killed = []

        def kill_when_running():
            tracker = spark.sparkContext.statusTracker()
            deadline = time.time() + 120
            while time.time() < deadline:
                stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
                if any(s is not None and s.numActiveTasks > 0 and "mapInArrow" not in s.name for s in stages) \
                        or any(s is not None and s.numCompletedTasks > 2 for s in stages):
                    os.kill(victims[0], signal.SIGKILL)
                    killed.append(victims[0])
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_when_running, daemon=True)
        killer.start()
        join(**blocked)
        killer.join(5)
        assert killed, "the executor was not killed while the join ran"

    def queries_broadcast():
        # The thresholds lowered so that these sizes take it (nearest_join.planner).
        from nearest_join import planner

        saved = planner.QUERY_BROADCAST_MIN_TARGET_BYTES, planner.QUERY_BROADCAST_RATIO
        planner.QUERY_BROADCAST_MIN_TARGET_BYTES, planner.QUERY_BROADCAST_RATIO = 0, 0
        try:
            blocks = dict(query_block_rows=60, target_block_rows=500)
            assert explain_nearest_join(q, t, "l2", K, vectors=("qv", "tv"), **blocks).queries_broadcast
            join(**blocks)
        finally:
            planner.QUERY_BROADCAST_MIN_TARGET_BYTES, planner.QUERY_BROADCAST_RATIO = saved

    def local_plan():
        # Parquet inputs, which Spark estimates small: the driver collects them from the two
        # executors and searches them itself.
        with tempfile.TemporaryDirectory(prefix="nj-cluster-") as tmp:
            q.write.parquet(f"{tmp}/q")
            t.write.parquet(f"{tmp}/t")
            qp, tp = spark.read.parquet(f"{tmp}/q"), spark.read.parquet(f"{tmp}/t")
            assert explain_nearest_join(qp, tp, "l2", K, vectors=("qv", "tv")).plan == "local"
            rows = nearest_by_join(qp, tp, F.vector_l2_distance(qp.qv, tp.tv), K, distance_col="d").collect()
        ours = group_rows(rows, lambda r: r["qid"], lambda r: r["tid"], lambda r: float(r["d"]))
        assert_join_true_topk(ours, Q, T, K, "l2", list(range(NQ)), list(range(NT)))

    ok = all([
        check("two-executors", two_executors),
        check("broadcast-plan", lambda: join()),
        check("local-plan", local_plan),
        check("blocked-plan", lambda: join(**blocked)),
        check("blocked-plan-queries-broadcast", queries_broadcast),
        check("executor-killed-mid-join", survives_executor_loss),
    ])
    spark.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
