"""The "cpu" kernel against faiss-cpu (and, with ``--compare-base``, an earlier commit's kernel):
same process, data and threads for every engine, best of ``--repeat``, with the share of the cores
other processes used meanwhile (/proc/stat) so that a disturbed number shows. On a shared machine take
the exclusive CPU lock (``flock -x /tmp/nj-cpu.lock python benchmarks/cpu_kernel.py``).

Usage: python benchmarks/cpu_kernel.py [--quick] [--dims 768 --nq 5000 --metrics l2]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
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


BASE = None   # --compare-base: another commit's kernels package, imported as base_kernels


def load_base(commit: str):
    """The kernels package of ``commit`` (``nearest_kernels``, ``nearest_join/kernels`` before
    it moved), extracted from git into a temporary directory and imported as the package
    ``base_kernels`` (its dispatcher pointed at its own backends)."""
    import importlib.util

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    folder = Path(tempfile.mkdtemp(prefix="nj-base-")) / "base_kernels"
    folder.mkdir()
    listing = (git("ls-tree", "--name-only", commit, "nearest_kernels/").split()
               or git("ls-tree", "--name-only", commit, "nearest_join/kernels/").split())
    for path in (p for p in listing if p.endswith(".py")):
        (folder / Path(path).name).write_text(git("show", f"{commit}:{path}"))
    spec = importlib.util.spec_from_file_location("base_kernels", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_kernels"] = module
    spec.loader.exec_module(module)       # its modules import each other relatively
    dispatch = importlib.import_module("base_kernels.dispatch")
    for entry in dispatch._REGISTRY.values():
        entry.module = "base_kernels." + entry.module.rsplit(".", 1)[1]
    module.commit = git("rev-parse", "--short", commit).strip()
    return module


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

    if BASE is None:
        record("nearest_join cpu", timed(ours, args.repeat))
    else:
        # Ours and the base kernels alternate call by call, so that a disturbance of the
        # machine falls on both; each keeps its best call.
        BASE.knn(queries[:10], targets[:1000], k, metric, backend="cpu", threads=args.threads)
        mine, base = (float("inf"), 0.0), (float("inf"), 0.0)
        for _ in range(args.repeat):
            mine = min(mine, timed(ours, 1))
            base = min(base, timed(lambda: result.__setitem__("base", BASE.knn(
                queries, targets, k, metric, backend="cpu", threads=args.threads)), 1))
        record("nearest_join cpu", mine)
        record(f"nearest_join at {BASE.commit}", base)
        rows[-1]["agreement"] = float((result["ours"][1] == result["base"][1]).mean())
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
    # The slow peers (scikit-learn, the float64 reference) and the compile probe (fixed_costs.py's
    # compile table measures a worker's) went after fb7aa93 (gpu_notes.md, Instruments); the
    # recorded command line still names the flags that skipped them.
    parser.add_argument("--skip-slow", action="store_true", help="no effect (kept for recorded commands)")
    parser.add_argument("--skip-compile", action="store_true", help="no effect (kept for recorded commands)")
    parser.add_argument("--quick", action="store_true", help="a small run (seconds)")
    parser.add_argument("--compare-base", metavar="COMMIT",
                        help="also time that commit's cpu kernel, alternating with ours")
    args = parser.parse_args(argv)
    if args.quick:
        args.nq, args.nt, args.repeat = 2_000, 20_000, 1
    global BASE
    if args.compare_base:
        BASE = load_base(args.compare_base)

    try:   # loaded before the record reads the machine: it names each BLAS library's kernel choice
        import faiss  # noqa: F401
    except ImportError:
        pass
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
        engine = row["method"] if " at " in row["method"] else row["method"].split()[0]
        rec.add(table, engine=engine, **row, nq=args.nq, nt=args.nt, threads=args.threads, repeat=args.repeat,
                sgemm_gflops=round(ceiling, 1), sgemm_others=round(ceiling_others, 3))
    print(f"\nsgemm ceiling (float32 matmul through numpy, same threads): {ceiling:.0f} GFLOP/s "
          f"(others {ceiling_others:.0%}); recorded {len(rows)} rows in {rec.path}")
    rec.print_tables()


if __name__ == "__main__":
    main()
