"""Keyed search (``on=``, issue 22): the executor's grouped search against the per-group loop it replaced
(table ``executor``), and ``nearest_by_join(on="key")`` against the equi-join + window and the un-keyed join
(``spark``); what each table measures: its text in ``benchmarks/report.py``.

Usage: nice python benchmarks/keyed_join.py [--quick] [--skip-executor] [--window-queries N]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._record import SMOKE_DIR, Recorder, best_of, local_spark, noop, vector_table
from nearest_kernels import knn
from udfs.search import GroupSegments, grouped_search

D, K, METRIC = 64, 10, "l2"
THREADS = 2                     # kernel threads of the executor-level case
REPEAT = 2                      # Spark cases: each engine's best of this many calls (the window: one)


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


def executor_case(rec: Recorder, n_keys: int, n_queries: int, repeat: int, threads: int = THREADS) -> None:
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


def zipf_keys(n_keys: int, n: int, rng) -> np.ndarray:
    """Keys of ``n`` rows with Zipf-skewed group sizes: key i (from 0) has a share ~ 1 / (i + 1)."""
    p = 1.0 / np.arange(1, n_keys + 1)
    return rng.choice(n_keys, n, p=p / p.sum())


def spark_frames(spark, q_keys, t_keys, seed: int):
    """Query (qid, key, qv) and target (tid, key, tv) frames, cached, from Arrow (string keys)."""
    rng = np.random.default_rng(seed)

    def frame(ids: str, vectors: str, keys):
        v = rng.standard_normal((keys.size, D)).astype(np.float32)
        table = vector_table(np.arange(keys.size, dtype=np.int32), v, ids, vectors)
        table = table.add_column(1, "key", [[f"k{k:06d}" for k in keys]])
        df = spark.createDataFrame(table).repartition(4).cache()
        df.count()
        return df

    return frame("qid", "qv", q_keys), frame("tid", "tv", t_keys)


def spark_case(rec: Recorder, spark, case: str, q_keys, t_keys, *, peers: bool = True) -> None:
    """One data set: nearest_by_join(on=key) as it ships (planning included: each repetition
    builds the join, which runs its facts job), with ``peers`` the keyed blocked plan (forced)
    and the un-keyed join of the same rows, and the equi-join + window; the keyed results
    checked equal to the window's and the blocked plan's (same (qid, tid) rows)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from nearest_join import nearest_by_join

    q, t = spark_frames(spark, q_keys, t_keys, seed=1)

    def ours(**options):
        return nearest_by_join(q, t, METRIC, K, vectors=("qv", "tv"), distance_col="d", **options).select("qid", "tid")

    def window_join():
        return (q.join(t, "key").withColumn("d", F.vector_l2_distance(F.col("qv"), F.col("tv")))
                .withColumn("r", F.row_number().over(Window.partitionBy("qid").orderBy("d", "tid")))
                .where(f"r <= {K}").select("qid", "tid"))

    pairs = int(sum(np.bincount(q_keys, minlength=t_keys.max() + 1)[:t_keys.max() + 1]
                    * np.bincount(t_keys, minlength=t_keys.max() + 1)))
    common = {"case": case, "keys": int(np.unique(t_keys).size), "queries": int(q_keys.size),
              "targets": int(t_keys.size), "same_key_pairs": pairs, "largest_group": int(np.bincount(t_keys).max()),
              "d": D, "k": K, "metric": METRIC, "master": "local[2]"}
    expected = sorted(map(tuple, ours(on="key").collect()))            # also the warm-up
    results = {"nearest_by_join(on=key)": best_of(lambda: noop(ours(on="key")), REPEAT)}
    if peers:
        got = sorted(map(tuple, ours(on="key", broadcast_limit_bytes=0).collect()))
        assert got == expected, "the keyed blocked plan and the broadcast plan differ"
        results["nearest_by_join(on=key), blocked plan"] = best_of(
            lambda: noop(ours(on="key", broadcast_limit_bytes=0)), REPEAT)
        noop(ours())                                             # warm-up
        results["nearest_by_join (no key)"] = best_of(lambda: noop(ours()), 1)
    start = time.perf_counter()
    got = sorted(map(tuple, window_join().collect()))
    results["equi-join + row_number window"] = base = time.perf_counter() - start
    assert got == expected, "nearest_by_join(on=) and the window formulation differ"
    for engine, seconds in results.items():
        rec.add("spark", engine=engine, seconds=round(seconds, 3), speedup_vs_window=round(base / seconds, 2),
                **common)
    q.unpersist()
    t.unpersist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (seconds)")
    ap.add_argument("--skip-executor", action="store_true", help="Spark cases only")
    ap.add_argument("--window-queries", type=int, default=None,
                    help="also run the Zipf case at this many queries (and 10x the targets), with the "
                         "window formulation: the largest size it finishes in minutes")
    args = ap.parse_args()
    rec = Recorder("keyed_join", gpu=False, results_dir=SMOKE_DIR if args.quick else None)
    if not args.skip_executor:
        executor_case(rec, *((2_000, 2_000, 2) if args.quick else (100_000, 20_000, 3)))
    spark = local_spark("nearest_join-keyed-bench", "6g")
    n_queries, n_targets = (2_000, 20_000) if args.quick else (20_000, 200_000)
    rng = np.random.default_rng(0)
    spark_case(rec, spark, "100 keys, Zipf", zipf_keys(100, n_queries, rng), zipf_keys(100, n_targets, rng))
    if args.window_queries:
        spark_case(rec, spark, "100 keys, Zipf", zipf_keys(100, args.window_queries, rng),
                   zipf_keys(100, 10 * args.window_queries, rng), peers=False)
    n_keys = n_targets // 2                                      # ~2 targets per key
    t_keys = rng.integers(0, n_keys, n_targets)
    q_keys = t_keys[rng.integers(0, n_targets, n_queries)]       # every query's key has targets
    spark_case(rec, spark, f"{n_keys:,} keys of ~2", q_keys, t_keys)
    spark.stop()
    rec.print_tables()


if __name__ == "__main__":
    main()
