"""End-to-end Spark benchmark: nearest_by_join against Spark's own nearestByJoin and our kernel alone on
the same arrays (table ``operator``; what it measures: its text in ``benchmarks/report.py``).

Usage: python benchmarks/spark_join.py [--quick] [--repeat N]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks._record import (SMOKE_DIR, Recorder, best_of, cached_parquet, local_spark, noop,  # noqa: E402
                                vector_table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)

    from pyspark.sql import functions as F

    from nearest_join import explain_nearest_join, nearest_by_join
    from nearest_kernels import knn

    spark = local_spark("nearest_join-bench", "8g")
    tmp = tempfile.mkdtemp(prefix="nj-bench-")
    small = (200, 2_000, 64) if args.quick else (2_000, 20_000, 64)
    scale = [(2_000, 20_000, d) for d in (64, 128)] if args.quick else [(20_000, 200_000, d) for d in (64, 128)]
    k = 10
    rec = Recorder("spark_join", gpu=False, results_dir=SMOKE_DIR if args.quick else None)

    def add(engine, nq, nt, d, seconds, **extra):
        rec.add("operator", engine=engine, nq=nq, nt=nt, d=d, seconds=seconds, pairs_per_s=nq * nt / seconds,
                **extra, k=k, metric="l2", master="local[2]", repeat=args.repeat)

    def load(nq, nt, d):
        """Gaussian float32 sides (Q, T) and their cached DataFrames (qid, qv), (tid, tv)."""
        arrays, frames = [], []
        for n, seed, side in ((nq, 1, "q"), (nt, 2, "t")):
            X = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
            table = vector_table(np.arange(n, dtype=np.int64), X, side + "id", side + "v")
            arrays.append(X)
            frames.append(cached_parquet(spark, f"{tmp}/{side}_{n}_{d}.parquet", table, max(1, n // 4)))
        return (*arrays, *frames)

    # 1. the small case, both engines
    nq, nt, d = small
    Q, T, q, t = load(nq, nt, d)
    ranking = F.vector_l2_distance(q.qv, t.tv)
    ours_df = lambda: nearest_by_join(q, t, ranking, k, "exact", "distance")  # noqa: E731
    # A warm session: numba's kernels, the Python workers and the JVM's compiled code (its JIT
    # compiles the paths of a small call over its first dozen calls or so); the small call is
    # timed over more calls than the large ones.
    small_repeat, warm_calls = max(args.repeat, 7), 15
    for _ in range(warm_calls):
        noop(ours_df())
    ours_small = best_of(lambda: noop(ours_df()), small_repeat)
    plan = explain_nearest_join(q, t, ranking, k).plan
    ours_pairs = sorted((r["qid"], r["tid"]) for r in ours_df().select("qid", "tid").collect())
    spark_df = q.nearestByJoin(t, ranking, k, "exact", "distance")
    add("Spark nearestByJoin", nq, nt, d, best_of(lambda: noop(spark_df), 1))
    identical = sorted((r["qid"], r["tid"]) for r in spark_df.select("qid", "tid").collect()) == ours_pairs
    add("nearest_by_join", nq, nt, d, ours_small, identical_rows=identical, plan=plan)
    # The same call with the local plan off: the executors' plan it takes then (one task).
    spark.conf.set("spark.nearestJoin.localLimitBytes", "0")
    for _ in range(warm_calls):
        noop(ours_df())
    add("nearest_by_join, local plan off", nq, nt, d, best_of(lambda: noop(ours_df()), small_repeat),
        plan=explain_nearest_join(q, t, ranking, k).plan)
    spark.conf.unset("spark.nearestJoin.localLimitBytes")
    # What Spark charges the local plan besides its search and output: both sides collected.
    add("Spark's floor: both sides collected", nq, nt, d, best_of(lambda: (q.toArrow(), t.toArrow()), small_repeat))
    # the kernel alone on the same arrays: what the call costs besides the search (its fixed cost)
    knn(Q, T, k, "l2", backend="cpu")
    add("kernel alone (cpu)", nq, nt, d, best_of(lambda: knn(Q, T, k, "l2", backend="cpu"), args.repeat))
    q.unpersist(), t.unpersist()

    # 2./3. throughput at scale, and the kernel alone on the same arrays
    for nq, nt, d in scale:
        Q, T, q, t = load(nq, nt, d)
        df = lambda: nearest_by_join(q, t, F.vector_l2_distance(q.qv, t.tv), k)  # noqa: E731
        noop(df())
        plan = explain_nearest_join(q, t, F.vector_l2_distance(q.qv, t.tv), k).plan
        secs = best_of(lambda: noop(df()), args.repeat)
        if d == 128:
            threads = len(os.sched_getaffinity(0))
            knn(Q[:256], T[:4096], k, "l2", backend="cpu", threads=threads)  # warm
            kernel = best_of(lambda: knn(Q, T, k, "l2", backend="cpu", threads=threads), args.repeat)
            add("nearest_by_join", nq, nt, d, secs, fraction_of_kernel=kernel / secs, plan=plan)
            add("kernel alone (cpu)", nq, nt, d, kernel)
        else:
            add("nearest_by_join", nq, nt, d, secs, plan=plan)
        q.unpersist(), t.unpersist()
    rec.print_tables()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
