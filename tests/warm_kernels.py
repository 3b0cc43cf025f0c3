"""Compile the executor functions' numba kernels once, in the test run's own process, before
any Spark worker needs them.

numba caches each compiled kernel on disk (``cache=True``), but on a fresh clone the cache is
empty, and the suite's sessions (the main run's, each lane's, the local-cluster and Spark
Connect suites') start Python workers at about the same time: each of them would compile the
same kernels, two at a time per session. :func:`warm` runs the executor functions in-process
(``udfs.local.local_join``: the packing, decoding, search, merge and emit Spark's tasks run)
over each metric, plan, element type, with and without a cap, so the workers load the
kernels from the cache instead. With the cache already filled it only loads them.
"""
from __future__ import annotations

METRICS = ("l2", "sqeuclidean", "cosine", "inner_product")


def warm() -> None:
    # imported here: tests/conftest.py imports this module before it sets the environment
    # the OpenMP runtime reads
    import numpy as np
    import pyarrow as pa

    from udfs.blocks import JoinContext
    from udfs.local import local_join
    from udfs.packing import SideLayout
    from udfs.searcher import SearchSettings

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
