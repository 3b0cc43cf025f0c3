"""Incremental refresh against a full recompute (issue 43), local[2]: tables ``refresh_<nq>x<nt>[_keys<G>]
[_cap<X>][_approx<R>]``, what they measure: their text in ``benchmarks/report.py``.

Usage: python benchmarks/incremental.py [--nq 200000 --nt 1000000] [--shares 0.01 0.001] [--keys G] [--cap X]
       python benchmarks/incremental.py --data minilm --nt 60000 --approx 0.95
       python benchmarks/incremental.py --job      (tables ``job_refresh_<nq>x<nt>``: the batch job, new processes)
"""
from __future__ import annotations

import argparse
import json
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

D, K = 64, 10      # the clustered data's dimension; the neighbours per query


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


def changed(rng, ids, vectors, share, next_id, new_rows):
    """A third of ``share`` of the rows deleted, a third updated, a third inserted (``new_rows(n)``:
    the vectors of n new rows)."""
    n = max(3, int(share * len(ids))) // 3
    keep = np.ones(len(ids), bool)
    keep[rng.choice(len(ids), n, replace=False)] = False
    ids, vectors = ids[keep], vectors[keep].copy()
    vectors[rng.choice(len(ids), n, replace=False)] = new_rows(n)
    ids = np.concatenate([ids, next_id + np.arange(n)])
    vectors = np.concatenate([vectors, new_rows(n)])
    return ids, vectors


def recall_at_k(got, exact) -> float:
    """Mean per-query recall@k of ``got`` against ``exact`` (rows sorted by query then value:
    :func:`main`'s ``rows``); a row as near as the exact k-th is a hit."""
    kth = exact.groupby("qid")["d"].agg(["max", "size"])
    merged = got.join(kth, on="qid", how="inner")
    hits = (merged["d"] <= merged["max"]).groupby(merged["qid"]).sum()
    per_query = np.minimum(hits.reindex(kth.index, fill_value=0), kth["size"]) / kth["size"]
    return float(per_query.mean())


SPEC = """name: nightly
query: {{path: {q}, vector: v}}
target: {{path: {t}, vector: w}}
join: {{metric: l2, k: %d, distance_col: d}}
{incremental}output: {{path: {out}, mode: overwrite}}
""" % K


def nightly_job(tmp: str, q: str, t: str, out: str, incremental: bool) -> float:
    """The seconds of ``nearest-join run`` of a spec over ``q`` and ``t`` into ``out``, in a new
    process under the default profile (conf/local.yaml), as a nightly job runs; with the
    ``incremental:`` section (the state inside ``out``) or without (a full recompute)."""
    import subprocess

    spec = os.path.join(tmp, "refresh.yaml" if incremental else "full.yaml")
    with open(spec, "w") as f:
        f.write(SPEC.format(q=q, t=t, out=out, incremental="incremental: {query_id: qid, target_id: tid}\n"
                            if incremental else ""))
    start = time.perf_counter()
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "nearest-join"), "run", spec], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nq", type=int, default=200_000)
    ap.add_argument("--nt", type=int, default=1_000_000, help="minilm: day 0's rows; the rest are inserted")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--keys", type=int, default=0, help="on= key groups (0: no keys)")
    ap.add_argument("--cap", type=float, default=None, help="max_distance on both joins")
    ap.add_argument("--approx", type=float, default=None, metavar="R",
                    help="mode approx at recall R (refresh and full recompute), recall measured against exact")
    ap.add_argument("--data", choices=["clustered", "minilm"], default="clustered",
                    help="minilm: the real sentence embeddings (benchmarks/embeddings.py), joined with themselves")
    ap.add_argument("--quick", action="store_true", help="20,000 x 100,000; results not recorded in git")
    ap.add_argument("--job", action="store_true",
                    help="each run a `nearest-join run` in a new process (the default profile), as a nightly job")
    args = ap.parse_args(argv)
    if args.job and (args.keys or args.cap is not None or args.approx is not None or args.data != "clustered"):
        ap.error("--job: the clustered exact join only")
    if args.quick:
        args.nq, args.nt = 20_000, 20_000 if args.data == "minilm" else 100_000

    from nearest_join.incremental import incremental_nearest_join
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    rng = np.random.default_rng(0)
    tmp = tempfile.mkdtemp(prefix="nj-incremental-")
    spark = None if args.job else local_spark("nearest_join-incremental", "12g")
    rec = Recorder("incremental", results_dir=SMOKE_DIR if args.quick else None)
    if args.data == "minilm":   # a self-join: the queries are the targets
        from benchmarks.embeddings import load

        embeddings = load()
        if args.nt >= len(embeddings):
            ap.error(f"--nt: at most {len(embeddings) - 1} (the rest are the inserted and updated rows)")
        args.nq, d, metric = args.nt, embeddings.shape[1], "cosine"
        pool = iter(np.concatenate([embeddings, np.zeros((len(embeddings), 1), np.float32)], axis=1)[args.nt:])

        def new_rows(n):
            return np.stack([next(pool) for _ in range(n)])
        T = np.concatenate([embeddings[:args.nt], np.zeros((args.nt, 1), np.float32)], axis=1)
        Q = T
    else:
        d, metric = D, "l2"
        centers = rng.standard_normal((1000, d)) * 3

        def new_rows(n):
            return clustered(rng, n, centers)
        Q, T = clustered(rng, args.nq, centers), clustered(rng, args.nt, centers)
    table = (("job_" if args.job else "") + f"refresh_{args.data + '_' if args.data != 'clustered' else ''}"
             f"{args.nq}x{args.nt}" + (f"_keys{args.keys}" if args.keys else "")
             + (f"_cap{args.cap:g}" if args.cap is not None else "")
             + (f"_approx{args.approx:g}" if args.approx is not None else ""))
    exact_join = dict(vectors=("v", "w"), distance_col="d", on="g" if args.keys else None,
                      **({"min_similarity": args.cap} if metric == "cosine" else {"max_distance": args.cap}))
    joined = exact_join if args.approx is None else {**exact_join, "mode": "approx", "recall": args.approx}
    q_ids, t_ids = np.arange(args.nq), np.arange(args.nt)

    def frames(day, q_ids, Q, t_ids, T):
        write_side(f"{tmp}/q{day}.parquet", q_ids, Q, "qid", "v", args.keys)
        write_side(f"{tmp}/t{day}.parquet", t_ids, T, "tid", "w", args.keys)
        if args.job:   # the paths: the jobs read them
            return f"{tmp}/q{day}.parquet", f"{tmp}/t{day}.parquet"
        return spark.read.parquet(f"{tmp}/q{day}.parquet"), spark.read.parquet(f"{tmp}/t{day}.parquet")

    def full(q, t, out, options=joined):
        # What a nightly job writes today: ids and values, no vectors (the executors emit
        # only the kept columns, as jobs.runner has them do).
        if args.job:
            return nightly_job(tmp, q, t, out, incremental=False)
        start = time.perf_counter()
        options = JoinOptions(num_results=K, **options)
        plan_join(q, t, metric, options).dataframe(query_columns=(0,), target_columns=(0,)).write.parquet(out)
        return time.perf_counter() - start

    def incremental(q, t, state, out):
        if args.job:   # the state lives inside the output: day 0's output is copied for each share
            if state != f"{tmp}/state":
                shutil.copytree(f"{tmp}/inc0", out)
            seconds = nightly_job(tmp, q, t, out, incremental=True)
            with open(f"{out}/_nearest_join_summary.json") as f:
                changes = json.load(f)["incremental"]
            return seconds, argparse.Namespace(**{k: v for k, v in changes.items() if k != "state"})
        start = time.perf_counter()
        run = incremental_nearest_join(q, t, metric, K, query_id="qid", target_id="tid", state=state, **joined)
        run.dataframe(query_columns=(0,), target_columns=(0,)).write.parquet(out)
        run.commit()
        return time.perf_counter() - start, run.changes

    def rows(path):
        table = pq.read_table(path, columns=["qid", "tid", "d"]).to_pandas()
        if metric == "cosine":   # ranked by the negated similarity: smaller is better
            table["d"] = -table["d"]
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
    sizes = dict(nq=args.nq, nt=args.nt, d=d, k=K, master="local[2]", keys=args.keys, cap=args.cap)
    rec.add(table, what="full run, writing the state", share=0.0, seconds=round(seconds, 1), **sizes)
    rec.print_tables()
    for i, share in enumerate(args.shares, start=1):
        nt_ids, nT = changed(rng, t_ids, T, share, 20 * args.nt, new_rows)
        nq_ids, nQ = (nt_ids, nT) if args.data == "minilm" else changed(rng, q_ids, Q, share, 10 * args.nt, new_rows)
        q, t = frames(i, nq_ids, nQ, nt_ids, nT)
        # each share refreshes day 0's state
        day_state = f"{tmp}/state{i}"
        if not args.job:
            shutil.copytree(state, day_state)
        seconds, changes = incremental(q, t, day_state, f"{tmp}/inc{i}")
        full_s = full(q, t, f"{tmp}/full{i}")
        figures = dict(share=share, seconds=round(seconds, 1), full_seconds=round(full_s, 1),
                       speedup=round(full_s / seconds, 1))
        if args.approx is None:
            figures["same_rows_as_full"] = check(rows(f"{tmp}/inc{i}"), rows(f"{tmp}/full{i}"))
        else:
            exact_s = full(q, t, f"{tmp}/exact{i}", exact_join)
            exact = rows(f"{tmp}/exact{i}")
            measured = changes.recall or {}
            figures.update(exact_seconds=round(exact_s, 1), speedup_vs_exact=round(exact_s / seconds, 1),
                           recall=round(recall_at_k(rows(f"{tmp}/inc{i}"), exact), 4),
                           full_recall=round(recall_at_k(rows(f"{tmp}/full{i}"), exact), 4),
                           measured_recall=measured.get("recall_estimate") and round(measured["recall_estimate"], 4),
                           measured_lower=measured.get("recall_lower") and round(measured["recall_lower"], 4),
                           nprobe=measured.get("nprobe"), nlist=measured.get("nlist"),
                           retrained=not changes.refreshed)
        rec.add(table, what="refresh", **figures,
                queries_searched_whole=changes.queries_searched_whole, queries_short=changes.queries_short,
                queries_merged=changes.queries_merged,
                targets_changed=changes.targets_inserted + changes.targets_deleted + changes.targets_changed, **sizes)
        rec.print_tables()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
