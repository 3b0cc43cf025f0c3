"""The "cpu" kernel against faiss-cpu (table per BLAS kernel selection; what it measures: its text in
``benchmarks/report.py``), with the share of the cores other processes used meanwhile (/proc/stat) so that
a disturbed number shows. On a shared machine take the exclusive CPU lock
(``flock -x /tmp/nj-cpu.lock python benchmarks/cpu_kernel.py``).

Usage: python benchmarks/cpu_kernel.py [--quick] [--dims 768 --nq 5000 --metrics l2]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._record import SMOKE_DIR, Recorder, timed
from nearest_kernels import knn

FAISS_INDEX = {"l2": "IndexFlatL2", "inner_product": "IndexFlatIP"}


def sgemm_rate(threads: int, size: int, repeat: int) -> tuple[float, float]:
    """GFLOP/s of a size^3 float32 matmul through numpy's BLAS on ``threads`` threads, and
    the share of the cores other processes used meanwhile."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    with threadpool_limits(limits=threads, user_api="blas"):
        a @ b
        seconds, others = timed(lambda: a @ b, repeat)
    return 2.0 * size**3 / seconds / 1e9, others


def run_faiss(queries, targets, k, metric, threads):
    import faiss

    faiss.omp_set_num_threads(threads)
    index = getattr(faiss, FAISS_INDEX[metric])(targets.shape[1])
    index.add(targets)
    return lambda: index.search(queries, k)


def make_rows(kind: str, n: int, d: int, rng) -> np.ndarray:
    """float32 rows: ``gaussian`` N(0, 1); ``embedding`` unit rows around a direction both
    sides share, with power-law variances (sentence embeddings have a large common component:
    random pairs at cosine ~0.4)."""
    x = rng.standard_normal((n, d), dtype=np.float32)
    if kind == "embedding":
        mean = np.random.default_rng(1234).standard_normal(d)
        decay = np.arange(1, d + 1) ** -0.5
        x = 0.8 * mean / np.linalg.norm(mean) + x * (decay / np.linalg.norm(decay))
        x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return x


def bench_config(d, metric, k, args, ceiling, rng, data="gaussian") -> list[dict]:
    """All methods on one (data, d, metric, k). Rows: one dict per method."""
    queries = make_rows(data, args.nq, d, rng)
    targets = make_rows(data, args.nt, d, rng)
    rows = []

    def record(method, timing):
        seconds, others = timing
        pairs = args.nq * args.nt / seconds
        rows.append({
            "data": data, "d": d, "metric": metric, "k": k, "method": method, "queries": args.nq,
            "seconds": seconds, "pairs_per_s": pairs, "gflops": 2.0 * pairs * d / 1e9,
            "of_sgemm": 2.0 * pairs * d / 1e9 / ceiling, "agreement": None, "note": "",
            "others": others,
        })

    knn(queries[:10], targets[:1000], k, metric, backend="cpu", threads=args.threads)  # compiled
    result = {}

    def ours():
        result["ours"] = knn(queries, targets, k, metric, backend="cpu", threads=args.threads)

    record("nearest_join cpu", timed(ours, args.repeat))
    if metric in FAISS_INDEX:
        search = run_faiss(queries, targets, k, metric, args.threads)
        timing = timed(lambda: result.__setitem__("faiss", search()), args.repeat)
        record(f"faiss {FAISS_INDEX[metric]}", timing)
        rows[0]["agreement"] = float((result["ours"][1] == result["faiss"][1]).mean())
    faiss_rate = next((r["pairs_per_s"] for r in rows if r["method"].startswith("faiss")), None)
    for row in rows:
        row["vs_faiss"] = row["pairs_per_s"] / faiss_rate if faiss_rate else None
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nq", type=int, default=20_000)
    parser.add_argument("--nt", type=int, default=200_000)
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--metrics", nargs="+", default=["l2", "inner_product"],
                        choices=["l2", "sqeuclidean", "inner_product", "cosine"])
    parser.add_argument("--embedding-dims", type=int, nargs="*", default=[384],
                        help="also cosine on embedding-like unit rows at these d")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeat", type=int, default=2, help="best of this many timings")
    parser.add_argument("--quick", action="store_true", help="a small run (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.nq, args.nt, args.repeat = 2_000, 20_000, 1
    with contextlib.suppress(ImportError):   # loaded before the record reads the machine's BLAS libraries
        import faiss  # noqa: F401
    rec = Recorder("cpu_kernel", gpu=False, results_dir=SMOKE_DIR if args.quick else None)
    ceiling, ceiling_others = sgemm_rate(args.threads, 1024 if args.quick else 4096, 5)
    rng = np.random.default_rng(12345)
    rows = []
    configs = [("gaussian", d, metric, k) for d in args.dims for metric in args.metrics for k in args.ks]
    configs += [("embedding", d, "cosine", k) for d in args.embedding_dims for k in args.ks]
    for data, d, metric, k in configs:
        rows += bench_config(d, metric, k, args, ceiling, rng, data)
        print(f"done {data} d={d} {metric} k={k}", file=sys.stderr, flush=True)
    table = f"OPENBLAS_CORETYPE={rec.machine['blas']['OPENBLAS_CORETYPE']}"
    for row in rows:
        rec.add(table, engine=row["method"].split()[0], **row, nq=args.nq, nt=args.nt, threads=args.threads,
                repeat=args.repeat, sgemm_gflops=round(ceiling, 1), sgemm_others=round(ceiling_others, 3))
    print(f"\nsgemm ceiling (float32 matmul through numpy, same threads): {ceiling:.0f} GFLOP/s "
          f"(others {ceiling_others:.0%}); recorded {len(rows)} rows in {rec.path}")
    rec.print_tables()


if __name__ == "__main__":
    main()
