"""Keyed search (``on=``, issue 22) with many tiny groups: batched segments against a kernel call
per group, and the Spark formulation at a small size.

1. executor level (no Spark): a query block against a broadcast target block of N_KEYS groups
   of ~10 targets, d=64, k=10: ``udfs.groups.grouped_search`` as it ships (small groups in one
   ``knn_segments`` call) against the per-group loop it replaced (one ``knn`` call per group
   present in the query block), on the same sorted block; both results are checked equal;
2. Spark ``local[2]`` at a small size: ``nearest_by_join(on=...)`` against the equi-join +
   ``row_number`` window formulation of the issue (same rows checked).

Usage: python benchmarks/keyed_join.py [--quick] [--skip-spark]

Records go to ``benchmarks/results/keyed_join.jsonl`` (tables ``executor`` and ``spark``;
``--quick`` runs to ``benchmarks/out/results/``); ``make bench-report`` renders them.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._record import SMOKE_DIR, Recorder
from nearest_join.kernels import knn
from udfs.groups import GroupSegments, grouped_search

D, K, METRIC = 64, 10, "l2"


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def data(n_keys: int, n_queries: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    sizes = rng.poisson(10, n_keys).clip(1)                    # ~10 targets per key
    t_groups = rng.permutation(np.repeat(np.arange(n_keys), sizes))
    q_groups = rng.integers(0, n_keys, n_queries)
    targets = rng.standard_normal((t_groups.size, D)).astype(np.float32)
    queries = rng.standard_normal((n_queries, D)).astype(np.float32)
    return queries, q_groups, targets, t_groups


def per_group_loop(queries, q_groups, sorted_targets, segments: GroupSegments, threads: int):
    """The search as b6555db shipped it: one knn call per group present in the query block."""
    values = np.full((queries.shape[0], K), np.inf, np.float32)
    rows = np.full((queries.shape[0], K), -1, np.int64)
    order = np.argsort(q_groups, kind="stable")
    present, first = np.unique(q_groups[order], return_index=True)
    bounds = np.append(first, queries.shape[0])
    at = np.searchsorted(segments.groups, present)
    for i in range(present.size):
        members = order[bounds[i]:bounds[i + 1]]
        lo, hi = segments.starts[at[i]], segments.starts[at[i] + 1]
        v, local = knn(queries[members], sorted_targets[lo:hi], K, METRIC, backend="cpu", threads=threads)
        values[members] = v
        rows[members] = np.where(local >= 0, segments.order[lo:hi][np.maximum(local, 0)], -1)
    return values, rows


def executor_case(rec: Recorder, n_keys: int, n_queries: int, threads: int, repeat: int) -> None:
    queries, q_groups, targets, t_groups = data(n_keys, n_queries)
    segments = GroupSegments.of(t_groups)
    sorted_targets = np.ascontiguousarray(targets[segments.order])

    def search(q, t):
        return knn(q, t, K, METRIC, backend="cpu", threads=threads)

    def batched():
        return grouped_search(search, queries, q_groups, sorted_targets, segments, K, METRIC, threads=threads)

    def looped():
        return per_group_loop(queries, q_groups, sorted_targets, segments, threads)

    (bv, br), (lv, lr) = batched(), looped()   # also the JIT warm-up
    assert (br == lr).all() and np.allclose(bv, lv, rtol=1e-6), "batched and per-group results differ"
    t_batched, t_loop = best_of(batched, repeat), best_of(looped, max(1, repeat // 2))
    common = {"keys": n_keys, "queries": n_queries, "targets": int(targets.shape[0]), "d": D, "k": K,
              "metric": METRIC, "threads": threads, "groups_searched": int(np.unique(q_groups).size)}
    for engine, seconds in (("grouped_search (batched segments)", t_batched),
                            ("knn per group (b6555db)", t_loop)):
        rec.add("executor", engine=engine, seconds=round(seconds, 4),
                speedup_vs_per_group=round(t_loop / seconds, 2), **common)
        print(f"{engine:36s} {seconds:8.3f} s  ({t_loop / seconds:6.1f}x the per-group loop)")


def spark_case(rec: Recorder, n_keys: int, n_queries: int) -> None:
    from pyspark.sql import SparkSession, Window
    from pyspark.sql import functions as F

    from nearest_join import nearest_by_join

    spark = (SparkSession.builder.master("local[2]").appName("nearest_join-keyed-bench")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "4").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    queries, q_groups, targets, t_groups = data(n_keys, n_queries, seed=1)
    q = spark.createDataFrame([(i, int(g), v.tolist()) for i, (g, v) in enumerate(zip(q_groups, queries))],
                              "qid int, key int, qv array<float>").cache()
    t = spark.createDataFrame([(j, int(g), v.tolist()) for j, (g, v) in enumerate(zip(t_groups, targets))],
                              "tid int, key int, tv array<float>").cache()
    q.count(), t.count()
    ours = nearest_by_join(q, t, METRIC, K, vectors=("qv", "tv"), distance_col="d", on="key").select("qid", "tid")
    window = (q.join(t, "key").withColumn("d", F.vector_l2_distance(F.col("qv"), F.col("tv")))
              .withColumn("r", F.row_number().over(Window.partitionBy("qid").orderBy("d", "tid")))
              .where(f"r <= {K}").select("qid", "tid"))
    a, b = sorted(map(tuple, ours.collect())), sorted(map(tuple, window.collect()))   # warm-up
    assert a == b, "nearest_by_join(on=) and the window formulation differ"
    t_ours = best_of(lambda: ours.collect(), 3)
    t_window = best_of(lambda: window.collect(), 3)
    common = {"keys": n_keys, "queries": n_queries, "targets": int(targets.shape[0]), "d": D, "k": K,
              "metric": METRIC, "master": "local[2]"}
    for engine, seconds in (("nearest_by_join(on=key)", t_ours), ("equi-join + row_number window", t_window)):
        rec.add("spark", engine=engine, seconds=round(seconds, 3),
                speedup_vs_window=round(t_window / seconds, 2), **common)
        print(f"{engine:36s} {seconds:8.3f} s  ({t_window / seconds:6.2f}x the window)")
    spark.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (seconds)")
    ap.add_argument("--skip-spark", action="store_true", help="executor level only")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rec = Recorder("keyed_join", gpu=False, results_dir=SMOKE_DIR if args.quick else None)
    if args.quick:
        executor_case(rec, 2_000, 2_000, args.threads, 2)
    else:
        executor_case(rec, 100_000, 20_000, args.threads, 3)
    if not args.skip_spark:
        spark_case(rec, 200 if args.quick else 2_000, 500 if args.quick else 4_000)


if __name__ == "__main__":
    main()
