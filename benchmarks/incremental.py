"""Incremental refresh against a full recompute (issue 43), local[2]: day 0 writes
``incremental_nearest_join``'s state; per share of ``--shares`` that share of each side changes,
refreshed from day 0's state and recomputed in full, the rows checked equal.

Usage: python benchmarks/incremental.py [--nq 200000 --nt 1000000] [--shares 0.01 0.001] [--keys G] [--cap X]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from benchmarks._record import SMOKE_DIR, Recorder, local_spark, vector_table  # noqa: E402


def clustered(rng, n, centers):
    """``n`` rows around random ``centers``, each row's centre index in its last column."""
    which = rng.integers(0, len(centers), n)
    rows = (centers[which] + 0.3 * rng.standard_normal((n, centers.shape[1]))).astype(np.float32)
    return np.concatenate([rows, which[:, None].astype(np.float32)], axis=1)


def write_side(path, ids, rows, id_name, vector_name, keys):
    """Vectors (``rows`` less their centre column) and, with ``keys``, the centre modulo it."""
    table = vector_table(ids.astype(np.int64), np.ascontiguousarray(rows[:, :-1]), id_name, vector_name)
    if keys:
        table = table.append_column("g", pa.array(rows[:, -1].astype(np.int64) % keys))
    pq.write_table(table, path, row_group_size=max(1, min(len(ids), 1 << 17)))


def changed(rng, ids, vectors, share, next_id, centers):
    """A third of ``share`` of the rows deleted, a third updated, a third inserted."""
    n = max(3, int(share * len(ids))) // 3
    keep = np.ones(len(ids), bool)
    keep[rng.choice(len(ids), n, replace=False)] = False
    ids, vectors = ids[keep], vectors[keep].copy()
    vectors[rng.choice(len(ids), n, replace=False)] = clustered(rng, n, centers)
    ids = np.concatenate([ids, next_id + np.arange(n)])
    vectors = np.concatenate([vectors, clustered(rng, n, centers)])
    return ids, vectors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nq", type=int, default=200_000)
    ap.add_argument("--nt", type=int, default=1_000_000)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--keys", type=int, default=0, help="on= key groups (0: no keys)")
    ap.add_argument("--cap", type=float, default=None, help="max_distance on both joins")
    ap.add_argument("--driver-memory", default="12g")
    ap.add_argument("--quick", action="store_true", help="20,000 x 100,000; results not recorded in git")
    args = ap.parse_args(argv)
    if args.quick:
        args.nq, args.nt = 20_000, 100_000

    from nearest_join.incremental import incremental_nearest_join
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    rng = np.random.default_rng(0)
    centers = rng.standard_normal((1000, args.d)) * 3
    tmp = tempfile.mkdtemp(prefix="nj-incremental-")
    spark = local_spark("nearest_join-incremental", args.driver_memory)
    rec = Recorder("incremental", results_dir=SMOKE_DIR if args.quick else None)
    table = (f"refresh_{args.nq}x{args.nt}" + (f"_keys{args.keys}" if args.keys else "")
             + (f"_cap{args.cap:g}" if args.cap is not None else ""))
    joined = dict(vectors=("v", "w"), distance_col="d", max_distance=args.cap, on="g" if args.keys else None)
    q_ids, t_ids = np.arange(args.nq), np.arange(args.nt)
    Q, T = clustered(rng, args.nq, centers), clustered(rng, args.nt, centers)

    def frames(day, q_ids, Q, t_ids, T):
        write_side(f"{tmp}/q{day}.parquet", q_ids, Q, "qid", "v", args.keys)
        write_side(f"{tmp}/t{day}.parquet", t_ids, T, "tid", "w", args.keys)
        return spark.read.parquet(f"{tmp}/q{day}.parquet"), spark.read.parquet(f"{tmp}/t{day}.parquet")

    def full(q, t, out):
        # What a nightly job writes today: ids and values, no vectors (the executors emit
        # only the kept columns, as jobs.runner has them do).
        start = time.perf_counter()
        options = JoinOptions(num_results=args.k, **joined)
        plan_join(q, t, "l2", options).dataframe(query_columns=(0,), target_columns=(0,)).write.parquet(out)
        return time.perf_counter() - start

    def incremental(q, t, state, out):
        start = time.perf_counter()
        run = incremental_nearest_join(q, t, "l2", args.k, query_id="qid", target_id="tid", state=state, **joined)
        run.result.select("qid", "tid", "d").write.parquet(out)
        run.commit()
        return time.perf_counter() - start, run.changes

    def rows(path):
        table = pq.read_table(path, columns=["qid", "tid", "d"]).to_pandas()
        return table.sort_values(["qid", "d", "tid"]).reset_index(drop=True)

    def check(got, want):
        """Same values per query; same targets outside the ties at each query's k-th value."""
        if len(got) != len(want) or not (np.array_equal(got["qid"], want["qid"])
                                         and np.array_equal(got["d"], want["d"])):
            return False
        last = want.groupby("qid")["d"].transform("max")
        untied = want["d"] != last
        return bool(np.array_equal(got["tid"][untied], want["tid"][untied]))

    q0, t0 = frames(0, q_ids, Q, t_ids, T)
    state = f"{tmp}/state"
    seconds, changes = incremental(q0, t0, state, f"{tmp}/inc0")
    sizes = dict(nq=args.nq, nt=args.nt, d=args.d, k=args.k, master="local[2]", keys=args.keys, cap=args.cap)
    rec.add(table, what="full run, writing the state", share=0.0, seconds=round(seconds, 1), **sizes)
    rec.print_tables()
    for i, share in enumerate(args.shares, start=1):
        nq_ids, nQ = changed(rng, q_ids, Q, share, 10 * args.nt, centers)
        nt_ids, nT = changed(rng, t_ids, T, share, 20 * args.nt, centers)
        q, t = frames(i, nq_ids, nQ, nt_ids, nT)
        # each share refreshes day 0's state
        day_state = f"{tmp}/state{i}"
        shutil.copytree(state, day_state)
        seconds, changes = incremental(q, t, day_state, f"{tmp}/inc{i}")
        full_s = full(q, t, f"{tmp}/full{i}")
        same = check(rows(f"{tmp}/inc{i}"), rows(f"{tmp}/full{i}"))
        rec.add(table, what="refresh", share=share, seconds=round(seconds, 1), full_seconds=round(full_s, 1),
                speedup=round(full_s / seconds, 1), same_rows_as_full=same,
                queries_searched_whole=changes.queries_searched_whole, queries_short=changes.queries_short,
                queries_merged=changes.queries_merged,
                targets_changed=changes.targets_inserted + changes.targets_deleted + changes.targets_changed, **sizes)
        rec.print_tables()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
