"""Compile the executor functions' numba kernels once, in the test run's own process, before
any Spark worker needs them.

numba caches each compiled kernel on disk (``cache=True``), but on a fresh clone the cache is
empty, and the suite's sessions (the main run's, each lane's, the local-cluster and Spark
Connect suites') start Python workers at about the same time: each of them would compile the
same kernels, two at a time per session. :func:`warm` runs the executor functions in-process
(``udfs.local.local_join``: the packing, decoding, search, merge and emit Spark's tasks run)
over each metric, plan, element type, with and without a cap, and calls the kernels that only
some data or plans reach (:func:`_rare_paths`), so the workers load the kernels from the cache
instead. With the cache already filled it only loads them.
"""
from __future__ import annotations

from pathlib import Path

METRICS = ("l2", "sqeuclidean", "cosine", "inner_product")


def warm() -> None:
    # imported here: tests/conftest.py imports this module before it sets the environment
    # the OpenMP runtime reads
    import subprocess
    import sys

    import numpy as np
    import pyarrow as pa

    from udfs.context import JoinContext, SearchSettings, SideLayout
    from udfs.local import local_join

    # the rare paths compile in a process of their own meanwhile: the machine's second core
    rare = subprocess.Popen([sys.executable, "-c", "from tests import warm_kernels; warm_kernels._rare_paths()"],
                            cwd=str(Path(__file__).resolve().parents[1]))
    try:
        rng = np.random.default_rng(0)
        d = 3
        for dtype, element in ((np.float32, pa.float32()), (np.float64, pa.float64())):
            queries = rng.standard_normal((9, d)).astype(dtype)
            targets = rng.standard_normal((11, d)).astype(dtype)
            query = pa.table({"qid": np.arange(9), "qv": pa.array(list(queries), type=pa.list_(element))})
            target = pa.table({"tid": np.arange(11), "tv": pa.array(list(targets), type=pa.list_(element))})
            for metric in METRICS:
                for cap in (None, 1.0):
                    ctx = JoinContext(SearchSettings(3, metric, "auto"), SideLayout("qv", 1, d, 4),
                                      SideLayout("tv", 1, d, 5), "leftouter", True, target.schema, cap=cap)
                    for plan in ("broadcast", "blocked"):
                        local_join(query, target, ctx, plan=plan, partitions=2)
    except BaseException:
        rare.kill()   # no orphan compiling on after a failed warm-up
        raise
    if rare.wait() != 0:
        raise RuntimeError(f"tests/warm_kernels.py: the rare paths' process exited with {rare.returncode}")


def _rare_paths() -> None:
    """The kernels the small joins above do not reach, each with the argument types the code
    passes (numba compiles per type; the kernels' wrappers pass every array they only read
    read-only, so the caller's flags make no other type): the CPU search of each metric, of
    mixed element types (float32 queries against float64 targets, and the reverse) and of
    heaps wide enough to seed, the segment and probed searches of keyed and IVF plans,
    k-means, the parallel row gathers (of strided rows too), the norms of targets searched as
    they are and the float64 search of rows the bound did not prove, in either key form."""
    import numpy as np

    from nearest_kernels import _cpu_kernels, gather, kmeans, knn, segments

    rng = np.random.default_rng(1)
    d = 3
    for dtype in (np.float32, np.float64):
        queries = rng.standard_normal((9, d)).astype(dtype)
        targets = rng.standard_normal((11, d)).astype(dtype)
        for metric in METRICS:
            knn(queries, targets, 3, metric, backend="cpu")
        segments.knn_segments(queries, targets, np.array([0, 5, 11]), np.arange(10),
                              np.arange(9) % 2, 3)
        segments.knn_probed(queries, targets, np.array([0, 5, 11]), np.arange(0, 19, 2), np.arange(18) % 2, 3)
        wide = rng.standard_normal((11, d + 2)).astype(dtype)[:, :d]   # strided rows
        rows = np.arange(5, dtype=np.int64)
        gather.take_rows_at(wide, rows, rows, np.empty((5, d), dtype), threads=2)
    for q_type, t_type in ((np.float32, np.float64), (np.float64, np.float32)):
        for metric in ("l2", "inner_product"):
            knn(rng.standard_normal((9, d)).astype(q_type), rng.standard_normal((11, d)).astype(t_type), 3, metric,
                backend="cpu")
    many = rng.standard_normal((200, d)).astype(np.float32)
    for metric in ("l2", "inner_product"):   # heaps of SEED_WIDTH and more: the seeded search
        knn(many[:9], many, _cpu_kernels.SEED_WIDTH, metric, backend="cpu")
    kmeans.kmeans(rng.standard_normal((40, d)).astype(np.float32), 4)
    matrix = rng.standard_normal((11, d)).astype(np.float32)
    rows = np.arange(5, dtype=np.int64)
    gather.take_rows(matrix, rows, np.empty((5, d), np.float32), threads=2)
    gather.take_rows_at(matrix, rows, rows, np.empty((5, d), np.float32), threads=2)
    queries = rng.standard_normal((9, d)).astype(np.float32)
    _cpu_kernels.row_peaks(matrix, np.ones(11), np.zeros(d), out_sq=np.zeros(11))
    for difference in (True, False):
        _cpu_kernels.all_keys(queries, rows, np.ones(9), matrix, np.ones(11), difference, False, np.empty((5, 11)))
