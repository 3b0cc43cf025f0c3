"""The IVF plan's search on each block searcher, at the Arrow-batch level (no pyspark).

Both sides are routed and packed as the approx plan packs them (``udfs.ivf.pack_listed``,
the functions ``nearest_join.ivf.IvfSearch.packers`` hands the plan), the pairs run through the broadcast plan's loop
(``udfs.blocks.search_broadcast``: ``udfs.search.grouped_search`` hands the probed lists to
``udfs.search.probed_search``), and the joined rows are checked against the float64 oracle
restricted to each query's probed lists. One list is dense enough that its work is above
``udfs.search.SEGMENT_WORK``: it goes to the task's searcher, which is the CPU kernel, the
GPU searcher's torch path on a CPU device, or (``pytest -m gpu``, on a CUDA machine) the GPU
searcher on the GPU; the other lists go to the batched segment search. With
``nprobe == nlist`` the rows are the exact result. Sized to run in seconds; imports no
pyspark (``nearest_join.ivf`` does, through ``nearest_join.errors``), so that it runs on a
GPU machine without Spark.
"""
from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa
import pytest

from nearest_kernels import rankable_rows, resolve_metric, segments
from nearest_kernels.kmeans import route
from tests.oracle import assert_true_topk, operator_rtol
from udfs import blocks as B
from udfs.context import SearchSettings, SideLayout
from udfs.ivf import pack_listed
from udfs.local import pair_batches
from udfs.packing import PACKED_SCHEMA, empty_target_block
from udfs.search import SEGMENT_WORK, BlockSearcher

try:
    import torch
except ImportError:  # the torch searchers skip with a reason
    torch = None

D, K, NLIST = 32, 6, 8
DENSE_ROWS, DENSE_QUERIES = 3000, 60
T_BLOCK_ROWS, Q_BLOCK_ROWS = 3200, 64
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
SEARCHERS = [
    pytest.param("cpu", id="cpu-kernel"),
    pytest.param("torch-cpu", id="gpu-searcher-on-cpu", marks=needs_torch),
    pytest.param("cuda", id="gpu-searcher-on-cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                                            reason="needs a CUDA device (run on the GPU machine: pytest -m gpu)")]),
]


def _data():
    """Clustered float32 rows and the clusters' centres (the index's centroids): one dense
    cluster (its list's work is above SEGMENT_WORK in one target block) and seven small
    ones, a NaN query row."""
    rng = np.random.default_rng(23)
    centres = rng.standard_normal((NLIST, D)).astype(np.float32) * 20
    sizes = [DENSE_ROWS] + [180] * (NLIST - 1)
    targets = np.concatenate([c + rng.standard_normal((n, D), dtype=np.float32) for c, n in zip(centres, sizes)])
    targets = targets[rng.permutation(targets.shape[0])]
    q_centre = np.concatenate([np.zeros(DENSE_QUERIES, np.int64), rng.integers(1, NLIST, 60)])
    queries = centres[q_centre] + rng.standard_normal((q_centre.size, D), dtype=np.float32)
    queries[5] = np.nan
    return queries[rng.permutation(queries.shape[0])], targets, centres


def _table(ids: str, name: str, vectors: np.ndarray, null_row: int | None = None) -> pa.Table:
    rows = [None if i == null_row else v for i, v in enumerate(vectors.tolist())]
    return pa.table({ids: np.arange(vectors.shape[0]), name: pa.array(rows, pa.list_(pa.float32()))})


def _searcher(kind: str, settings: SearchSettings):
    if kind == "cpu":
        return BlockSearcher(settings)
    from udfs.gpu_search import GpuBlockSearcher

    return GpuBlockSearcher(settings, torch.device("cpu" if kind == "torch-cpu" else "cuda"))


@pytest.mark.parametrize("searcher", SEARCHERS)
@pytest.mark.parametrize("metric", ["l2", "cosine", "inner_product"])
@pytest.mark.parametrize("nprobe", [2, NLIST], ids=["nprobe2", "all-lists"])
def test_ivf_search_on_the_block_searcher_matches_the_oracle(monkeypatch, searcher, metric, nprobe):
    queries, targets, centres = _data()
    null_target = 11
    ranked = targets.copy()
    ranked[null_target] = np.nan                   # a NULL vector never ranks
    # The clusters' own centres as the lists (k-means could split the dense one).
    centroids = np.ascontiguousarray(centres, np.float32)
    q_table, t_table = _table("qid", "qv", queries), _table("tid", "tv", targets, null_target)
    settings = SearchSettings(K, metric, "cpu" if searcher == "cpu" else "gpu")
    calls = []

    def open_searcher(s):
        opened = _searcher(searcher, s)
        search = opened.search

        def counted(q, t, **options):
            calls.append((q.shape[0], t.shape[0]))
            return search(q, t, **options)

        opened.search = counted
        return opened

    monkeypatch.setattr(B, "open_block_searcher", open_searcher)
    probed = []
    real_probed = segments.knn_probed

    def counted_probed(q, t, starts, probe_starts, probe_segments, *args, **options):
        sizes = np.diff(starts)[probe_segments]
        owners = np.repeat(np.arange(q.shape[0]), np.diff(probe_starts))
        probed.extend((int((owners[probe_segments == s] >= 0).sum()), int(sizes[probe_segments == s][0]))
                      for s in np.unique(probe_segments))
        return real_probed(q, t, starts, probe_starts, probe_segments, *args, **options)

    monkeypatch.setattr(segments, "knn_probed", counted_probed)
    q_layout = SideLayout("qv", 1, D, Q_BLOCK_ROWS, group_index=2)
    t_layout = SideLayout("tv", 1, D, T_BLOCK_ROWS, group_index=2)
    q_pack, t_pack = (functools.partial(pack_listed, centroids=centroids, metric=metric, nprobe=p)
                      for p in (nprobe, None))
    q_packed = pa.Table.from_batches(list(q_pack(q_table.to_batches(max_chunksize=50), layout=q_layout)),
                                     schema=PACKED_SCHEMA)
    t_packed = pa.Table.from_batches(list(t_pack(t_table.to_batches(max_chunksize=1000), layout=t_layout))
                                     + [empty_target_block()], schema=PACKED_SCHEMA)
    ctx = B.JoinContext(settings, q_layout, t_layout, "leftouter", True, t_table.schema)
    out = pa.Table.from_batches(list(B.search_broadcast(pair_batches(q_packed, t_packed), ctx)))

    # The large list went to the task's searcher (on the CPU: one knn_probed call for the
    # block), the other lists to the segment search.
    if searcher == "cpu":
        assert not calls and any(nq * nt * D > SEGMENT_WORK for nq, nt in probed), (calls, probed)
    else:
        assert any(nq * nt * D > SEGMENT_WORK for nq, nt in calls) and not probed, (calls, probed)
    qid, tid, value = (out.column(i).to_numpy(zero_copy_only=False) for i in (0, 2, 4))
    m = resolve_metric(metric)
    t_lists = route(targets, centroids, metric)[:, 0]
    probes = route(queries, centroids, metric, nprobe)
    ok = rankable_rows(ranked, m)
    for i in range(queries.shape[0]):
        mine = qid == i
        allowed = np.flatnonzero(ok & np.isin(t_lists, probes[i][probes[i] >= 0]))
        if nprobe == NLIST:
            allowed = np.flatnonzero(ok)                 # every list: the exact result
        if not rankable_rows(queries[i:i + 1], m)[0]:
            assert mine.sum() == 1 and np.isnan(tid[mine].astype(float)).all(), f"row {i}: no candidate"
            continue
        width = min(K, allowed.size)
        found = tid[mine].astype(np.int64)
        assert found.size == width, f"row {i}: {found.size} rows, expected {width}"
        local = np.searchsorted(allowed, found)
        assert (allowed[np.minimum(local, allowed.size - 1)] == found).all(), f"row {i}: rows outside its lists"
        order = np.argsort(-value[mine] if m.descending else value[mine], kind="stable")
        rtol = operator_rtol(queries[i:i + 1], ranked[allowed], width, metric,
                             backend="cpu" if searcher == "cpu" else "gpu")
        assert_true_topk(queries[i:i + 1], ranked[allowed], width, metric,
                         value[mine][order][None, :].astype(np.float32), local[order][None, :], rtol,
                         case=f"{searcher} {metric} nprobe={nprobe} row {i}")
