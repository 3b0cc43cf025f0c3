"""End-to-end Spark benchmark: nearest_by_join against Spark's own nearestByJoin and our kernel.

In one run, on cached DataFrames in local[2]:
1. the small case for both (2,000 x 20,000, d=64, k=10, exact L2): times, speed-up, identical rows;
2. throughput at scale (20,000 x 200,000, d=64 and d=128, k=10): pairs/s, and the ratio to
   Spark's pairs/s on the small case;
3. the Spark overhead: our operator end to end against our kernel alone on the same arrays
   (same process, all cores), on the small case (the call's fixed cost) and at 20,000 x 200,000,
   d=128.

Usage: python benchmarks/spark_join.py [--quick] [--skip-spark] [--out DIR]

Each row is recorded in ``benchmarks/results/spark_join.jsonl`` (table ``operator``; ``--quick``
runs go to ``benchmarks/out/results/``); ``make bench-report`` renders it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from benchmarks._record import SMOKE_DIR, Recorder  # noqa: E402


def make_side(path, n, d, seed, id_name, vec_name):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)).astype(np.float32)
    table = pa.table({id_name: np.arange(n, dtype=np.int64),
                      vec_name: pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), d).cast(pa.list_(pa.float32()))})
    pq.write_table(table, path, row_group_size=max(1, n // 4))
    return X


def timed(fn, repeat=1):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(df):
    df.write.format("noop").mode("overwrite").save()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--skip-spark", action="store_true", help="do not time Spark's own nearestByJoin")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", help="directory for spark_join.json (plans and all timings)")
    args = ap.parse_args(argv)

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from nearest_join import explain_nearest_join, nearest_by_join
    from nearest_kernels import knn

    spark = (SparkSession.builder.master("local[2]").appName("nearest_join-bench")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "8g").config("spark.sql.shuffle.partitions", "4")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    tmp = tempfile.mkdtemp(prefix="nj-bench-")
    small = (200, 2_000, 64) if args.quick else (2_000, 20_000, 64)
    scale = [(2_000, 20_000, 64), (2_000, 20_000, 128)] if args.quick else [(20_000, 200_000, 64), (20_000, 200_000, 128)]
    k = 10
    rows, results = [], {}
    rec = Recorder("spark_join", gpu=False, results_dir=SMOKE_DIR if args.quick else None)
    common = dict(k=k, metric="l2", master="local[2]", repeat=args.repeat)

    def load(nq, nt, d):
        qp, tp = f"{tmp}/q_{nq}_{d}.parquet", f"{tmp}/t_{nt}_{d}.parquet"
        Q = make_side(qp, nq, d, 1, "qid", "qv")
        T = make_side(tp, nt, d, 2, "tid", "tv")
        q = spark.read.parquet(qp).cache()
        t = spark.read.parquet(tp).cache()
        q.count(), t.count()
        return Q, T, q, t

    # 1. the small case, both engines
    nq, nt, d = small
    Q, T, q, t = load(nq, nt, d)
    ranking = F.vector_l2_distance(q.qv, t.tv)
    ours_df = lambda: nearest_by_join(q, t, ranking, k, "exact", "distance")  # noqa: E731
    run(ours_df())  # warm-up: JIT cache, Python workers
    ours_small = timed(lambda: run(ours_df()), args.repeat)
    ours_pairs = sorted((r["qid"], r["tid"]) for r in ours_df().select("qid", "tid").collect())
    plan = explain_nearest_join(q, t, ranking, k)
    results["small_plan"] = plan.to_dict()
    if not args.skip_spark:
        spark_df = q.nearestByJoin(t, ranking, k, "exact", "distance")
        spark_small = timed(lambda: run(spark_df), 1)
        spark_pairs = sorted((r["qid"], r["tid"]) for r in spark_df.select("qid", "tid").collect())
        identical = spark_pairs == ours_pairs
    else:
        spark_small, identical = float("nan"), None
    spark_rate = nq * nt / spark_small
    rows.append(("Spark nearestByJoin", f"{nq}x{nt}", d, spark_small, nq * nt / spark_small, 1.0))
    rows.append(("nearest_by_join", f"{nq}x{nt}", d, ours_small, nq * nt / ours_small, spark_small / ours_small))
    if not args.skip_spark:
        rec.add("operator", engine="Spark nearestByJoin", nq=nq, nt=nt, d=d, seconds=spark_small,
                pairs_per_s=nq * nt / spark_small, **common)
    rec.add("operator", engine="nearest_by_join", nq=nq, nt=nt, d=d, seconds=ours_small,
            pairs_per_s=nq * nt / ours_small, identical_rows=identical, **common)
    # the kernel alone on the same arrays: what the call costs besides the search (its fixed cost)
    knn(Q, T, k, "l2", backend="cpu")
    kernel_small = timed(lambda: knn(Q, T, k, "l2", backend="cpu"), args.repeat)
    rec.add("operator", engine="kernel alone (cpu)", nq=nq, nt=nt, d=d, seconds=kernel_small,
            pairs_per_s=nq * nt / kernel_small, **common)
    results.update(small=dict(nq=nq, nt=nt, d=d, k=k, spark_s=spark_small, ours_s=ours_small,
                              kernel_s=kernel_small, fixed_s=ours_small - kernel_small,
                              speedup=spark_small / ours_small, identical_rows=identical))
    q.unpersist(), t.unpersist()

    # 2./3. throughput at scale, and the kernel alone on the same arrays
    for nq, nt, d in scale:
        Q, T, q, t = load(nq, nt, d)
        df = lambda: nearest_by_join(q, t, F.vector_l2_distance(q.qv, t.tv), k)  # noqa: E731
        run(df())
        secs = timed(lambda: run(df()), args.repeat)
        rate = nq * nt / secs
        rows.append(("nearest_by_join", f"{nq}x{nt}", d, secs, rate, rate / spark_rate))
        kernel = None
        entry = dict(nq=nq, nt=nt, d=d, k=k, ours_s=secs, pairs_per_s=rate,
                     vs_spark_small_pairs_per_s=rate / spark_rate,
                     plan=explain_nearest_join(q, t, F.vector_l2_distance(q.qv, t.tv), k).to_dict())
        if d == 128:
            threads = len(os.sched_getaffinity(0))
            knn(Q[:256], T[:4096], k, "l2", backend="cpu", threads=threads)  # warm
            kernel = timed(lambda: knn(Q, T, k, "l2", backend="cpu", threads=threads), args.repeat)
            rows.append(("kernel alone (cpu)", f"{nq}x{nt}", d, kernel, nq * nt / kernel, float("nan")))
            entry.update(kernel_s=kernel, fraction_of_kernel=kernel / secs)
        rec.add("operator", engine="nearest_by_join", nq=nq, nt=nt, d=d, seconds=secs, pairs_per_s=rate,
                **({"fraction_of_kernel": kernel / secs} if kernel else {}), **common)
        if kernel:
            rec.add("operator", engine="kernel alone (cpu)", nq=nq, nt=nt, d=d, seconds=kernel,
                    pairs_per_s=nq * nt / kernel, **common)
        results[f"scale_d{d}"] = entry
        q.unpersist(), t.unpersist()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\n# spark_join benchmark  {time.strftime('%Y-%m-%d %H:%M')}  commit {commit}  "
          f"{platform.processor() or platform.machine()}  cores={os.cpu_count()}  "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    print(f"{'engine':<22}{'size':>16}{'d':>5}{'seconds':>10}{'pairs/s':>12}{'x Spark':>10}")
    for name, size, d, secs, rate, ratio in rows:
        print(f"{name:<22}{size:>16}{d:>5}{secs:>10.3f}{rate:>12.3g}{ratio:>10.1f}")
    s = results["small"]
    print(f"\nsmall case: {s['speedup']:.1f}x faster than Spark's nearestByJoin (target >= 50x), "
          f"identical rows: {s['identical_rows']}")
    for key in [k_ for k_ in results if k_.startswith("scale_")]:
        e = results[key]
        print(f"{key}: {e['pairs_per_s']:.3g} pairs/s = {e['vs_spark_small_pairs_per_s']:.0f}x Spark's small-case "
              f"pairs/s (target >= 300x)" + (f"; {100 * e['fraction_of_kernel']:.0f}% of the kernel alone "
                                               f"(target >= 60%)" if "kernel_s" in e else ""))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "spark_join.json"), "w") as f:
            json.dump(dict(results, commit=commit, rows=rows), f, indent=2, default=str)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
