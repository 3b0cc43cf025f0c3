"""Benchmark the "cpu" kernel against faiss-cpu, scikit-learn and the float64 reference.

Same process, same data, same thread count for every method. Prints one table per run:
time, pairs/s, effective GFLOP/s (2 nq nt d / time), ratio to faiss, fraction of the machine's
sgemm rate measured in the same run (a 4096^3 float32 matmul through numpy, best of several),
and the agreement of our indices with faiss's. The slow peers (scikit-learn brute force and the
float64 reference) are timed on the first ``--subset`` / ``--reference-subset`` queries only and
marked so; their pairs/s are comparable, their times are not. Also reports the first-call
(compile) time of the kernel in a fresh interpreter with an empty numba cache, then again with
that cache warm.

Usage::

    python benchmarks/cpu_kernel.py                      # nq=20000 nt=200000 d=128, k=10,100
    python benchmarks/cpu_kernel.py --dims 768 --nq 5000 --metrics l2
    python benchmarks/cpu_kernel.py --quick                # smoke run

Each row is recorded in ``benchmarks/results/cpu_kernel.jsonl`` (table
``OPENBLAS_CORETYPE=<value or unset>``: a run replaces the records of its BLAS selection;
``--quick`` runs go to ``benchmarks/out/results/``); ``make bench-report`` renders them.

Run it alone on the machine: on a shared machine take the exclusive CPU lock
(``flock -x /tmp/nj-cpu.lock python benchmarks/cpu_kernel.py``). Each timing records the share
of the cores that other processes used meanwhile (/proc/stat), so a disturbed number shows.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._record import SMOKE_DIR, Recorder, import_base_kernels
from nearest_kernels import knn

FAISS_INDEX = {"l2": "IndexFlatL2", "inner_product": "IndexFlatIP"}
SKLEARN_METRIC = {"l2": "euclidean", "cosine": "cosine"}

COMPILE_PROBE = """
import time
start = time.perf_counter()
import numpy as np
from nearest_kernels import knn
q = np.random.default_rng(0).standard_normal((300, 16)).astype(np.float32)
for metric in ("l2", "cosine"):
    knn(q, q, 5, metric, backend="cpu", threads=1)
print(time.perf_counter() - start)
"""


def _busy_cpu_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (Linux /proc/stat)."""
    fields = open("/proc/stat").readline().split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed(call, repeat: int) -> tuple[float, float]:
    """Best wall time of ``repeat`` calls, and the share of the machine's cores that other
    processes kept busy during that best call (0 on a quiet machine)."""
    best, others = float("inf"), 0.0
    cores = os.cpu_count() or 1
    for _ in range(repeat):
        busy, mine, start = _busy_cpu_seconds(), time.process_time(), time.perf_counter()
        call()
        seconds = time.perf_counter() - start
        foreign = (_busy_cpu_seconds() - busy) - (time.process_time() - mine)
        if seconds < best:
            best, others = seconds, max(0.0, foreign) / (seconds * cores)
    return best, others


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


def compile_times() -> dict:
    """First call in a fresh interpreter: empty numba cache, then the same cache warm."""
    with tempfile.TemporaryDirectory(prefix="nj-numba-cache-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
        out = {}
        for label in ("cold_cache_s", "warm_cache_s"):
            result = subprocess.run([sys.executable, "-c", COMPILE_PROBE], env=env, cwd=ROOT,
                                    capture_output=True, text=True, check=True)
            out[label] = float(result.stdout.strip().splitlines()[-1])
    return out


def run_faiss(queries, targets, k, metric, threads):
    import faiss

    faiss.omp_set_num_threads(threads)
    index = getattr(faiss, FAISS_INDEX[metric])(targets.shape[1])
    index.add(targets)
    return lambda: index.search(queries, k)


def run_sklearn(queries, targets, k, metric, threads):
    from sklearn.neighbors import NearestNeighbors

    model = NearestNeighbors(n_neighbors=k, algorithm="brute", metric=SKLEARN_METRIC[metric],
                             n_jobs=threads).fit(targets)
    return lambda: model.kneighbors(queries)


BASE = None   # --compare-base: another commit's kernels package, imported as base_kernels


def load_base(commit: str):
    """The kernels package of ``commit`` (``nearest_kernels``, ``nearest_join/kernels`` before
    it moved), extracted from git into a temporary directory and imported as the package
    ``base_kernels`` (its dispatcher pointed at its own backends)."""
    import importlib

    folder = Path(tempfile.mkdtemp(prefix="nj-base-")) / "base_kernels"
    folder.mkdir()
    for package in ("nearest_kernels/", "nearest_join/kernels/"):
        listing = subprocess.run(["git", "ls-tree", "--name-only", commit, package],
                                 cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        if listing:
            break
    for path in listing:
        if path.endswith(".py"):
            source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True,
                                    text=True, check=True).stdout
            (folder / Path(path).name).write_text(source)
    module = import_base_kernels(folder)
    dispatch = importlib.import_module("base_kernels.dispatch")
    for entry in dispatch._REGISTRY.values():
        entry.module = "base_kernels." + entry.module.rsplit(".", 1)[1]
    module.commit = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT,
                                   capture_output=True, text=True, check=True).stdout.strip()
    return module


def make_rows(kind: str, n: int, d: int, rng) -> np.ndarray:
    """float32 rows: ``gaussian`` N(0, 1); ``embedding`` unit rows around a direction both
    sides share, with power-law variances (sentence embeddings have a large common component:
    random pairs at cosine ~0.4; the same form as gpu_kernel.py's)."""
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
    subset = queries[: args.subset]
    rows = []

    def record(method, n_queries, timing, note="", agreement=None):
        seconds, others = timing
        pairs = n_queries * args.nt / seconds
        rows.append({
            "data": data, "d": d, "metric": metric, "k": k, "method": method, "queries": n_queries,
            "seconds": seconds, "pairs_per_s": pairs, "gflops": 2.0 * pairs * d / 1e9,
            "of_sgemm": 2.0 * pairs * d / 1e9 / ceiling, "agreement": agreement, "note": note,
            "others": others,
        })

    knn(queries[:10], targets[:1000], k, metric, backend="cpu", threads=args.threads)  # compiled
    result = {}

    def ours():
        result["ours"] = knn(queries, targets, k, metric, backend="cpu", threads=args.threads)

    if BASE is None:
        record("nearest_join cpu", args.nq, timed(ours, args.repeat))
    else:
        # Ours and the base kernels alternate call by call, so that a disturbance of the
        # machine falls on both; each keeps its best call.
        BASE.knn(queries[:10], targets[:1000], k, metric, backend="cpu", threads=args.threads)
        mine, base = (float("inf"), 0.0), (float("inf"), 0.0)
        for _ in range(args.repeat):
            mine = min(mine, timed(ours, 1))
            base = min(base, timed(lambda: result.__setitem__("base", BASE.knn(
                queries, targets, k, metric, backend="cpu", threads=args.threads)), 1))
        record("nearest_join cpu", args.nq, mine)
        record(f"nearest_join at {BASE.commit}", args.nq, base)
        rows[-1]["agreement"] = float((result["ours"][1] == result["base"][1]).mean())
    if metric in FAISS_INDEX:
        search = run_faiss(queries, targets, k, metric, args.threads)
        timing = timed(lambda: result.__setitem__("faiss", search()), args.repeat)
        record(f"faiss {FAISS_INDEX[metric]}", args.nq, timing)
        rows[0]["agreement"] = float((result["ours"][1] == result["faiss"][1]).mean())
    if metric in SKLEARN_METRIC and not args.skip_slow:
        with threadpool_limits(limits=args.threads, user_api="blas"):
            search = run_sklearn(subset, targets, k, metric, args.threads)
            record("sklearn brute", len(subset), timed(search, 1), note="subset")
    if not args.skip_slow:
        with threadpool_limits(limits=args.threads, user_api="blas"):
            few = queries[: args.reference_subset]
            timing = timed(lambda: knn(few, targets, k, metric, backend="reference"), 1)
        record("reference float64", len(few), timing, note="subset")
    faiss_rate = next((r["pairs_per_s"] for r in rows if r["method"].startswith("faiss")), None)
    for row in rows:
        row["vs_faiss"] = row["pairs_per_s"] / faiss_rate if faiss_rate else None
    return rows


def print_table(rows, ceiling, ceiling_others):
    print(f"\nsgemm ceiling (float32 matmul through numpy, same threads): {ceiling:.0f} GFLOP/s "
          f"(others {ceiling_others:.0%})")
    header = (f"| {'d':>4} | {'metric':<13} | {'k':>3} | {'method':<20} | {'queries':>7} | "
              f"{'time s':>7} | {'pairs/s':>8} | {'GFLOP/s':>7} | {'vs faiss':>8} | "
              f"{'of sgemm':>8} | {'agree':>6} | {'others':>6} |")
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for r in rows:
        queries = f"{r['queries']}" + ("*" if r["note"] == "subset" else "")
        vs = f"{r['vs_faiss']:.2f}x" if r["vs_faiss"] else "-"
        agree = f"{r['agreement']:.4f}" if r["agreement"] is not None else "-"
        label = r['metric'] + (' (emb)' if r['data'] == 'embedding' else '')
        print(f"| {r['d']:>4} | {label:<13} | {r['k']:>3} | {r['method']:<20} | "
              f"{queries:>7} | {r['seconds']:>7.2f} | {r['pairs_per_s']:>8.2e} | "
              f"{r['gflops']:>7.1f} | {vs:>8} | {r['of_sgemm']:>8.0%} | {agree:>6} | "
              f"{r['others']:>6.0%} |")
    if any(r["note"] == "subset" for r in rows):
        print("* timed on the first queries only (slow peers); compare pairs/s, not time.")
    print("agree: fraction of (query, slot) where our index equals faiss's (near ties differ).")
    print("others: share of the cores other processes used during the timing (0% = quiet).")


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
    parser.add_argument("--subset", type=int, default=2_000,
                        help="queries timed for scikit-learn")
    parser.add_argument("--reference-subset", type=int, default=200,
                        help="queries timed for the float64 reference (it sorts whole rows)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeat", type=int, default=2, help="best of this many timings")
    parser.add_argument("--skip-slow", action="store_true", help="no sklearn / reference")
    parser.add_argument("--skip-compile", action="store_true", help="no compile-time probe")
    parser.add_argument("--quick", action="store_true", help="a small run (seconds)")
    parser.add_argument("--compare-base", metavar="COMMIT",
                        help="also time that commit's cpu kernel, alternating with ours")
    args = parser.parse_args(argv)
    if args.quick:
        args.nq, args.nt, args.repeat = 2_000, 20_000, 1
        args.subset, args.reference_subset = 200, 50
    global BASE
    if args.compare_base:
        BASE = load_base(args.compare_base)

    try:   # loaded before the record reads the machine: it names each BLAS library's kernel choice
        import faiss  # noqa: F401
    except ImportError:
        pass
    rec = Recorder("cpu_kernel", gpu=False, results_dir=SMOKE_DIR if args.quick else None)
    print(json.dumps({"commit": rec.commit, "command": rec.command, **rec.machine, "threads": args.threads}, indent=1))
    compile_info = {} if args.skip_compile else compile_times()
    if compile_info:
        print(f"first call (import + compile), fresh interpreter: empty numba cache "
              f"{compile_info['cold_cache_s']:.1f} s, "
              f"warm cache {compile_info['warm_cache_s']:.1f} s")
    ceiling, ceiling_others = sgemm_rate(args.threads, 1024 if args.quick else 4096, 5)
    rng = np.random.default_rng(12345)
    rows = []
    for d in args.dims:
        for metric in args.metrics:
            for k in args.ks:
                rows += bench_config(d, metric, k, args, ceiling, rng)
                print(f"done d={d} {metric} k={k}", file=sys.stderr, flush=True)
    for d in args.embedding_dims:
        for k in args.ks:
            rows += bench_config(d, "cosine", k, args, ceiling, rng, data="embedding")
            print(f"done embedding d={d} cosine k={k}", file=sys.stderr, flush=True)
    print_table(rows, ceiling, ceiling_others)
    table = f"OPENBLAS_CORETYPE={rec.machine['blas']['OPENBLAS_CORETYPE']}"
    for row in rows:
        rec.add(table, engine=row["method"] if " at " in row["method"] else row["method"].split()[0], **row, nq=args.nq, nt=args.nt, threads=args.threads,
                repeat=args.repeat, sgemm_gflops=round(ceiling, 1), sgemm_others=round(ceiling_others, 3),
                **compile_info)
    print(f"recorded {len(rows)} rows in {rec.path}")


if __name__ == "__main__":
    main()
