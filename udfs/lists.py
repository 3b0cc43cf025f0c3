"""The IVF plan's executor passes (``mapInArrow``): list columns, packed listed blocks, and
the recall estimate's sample search.

Each side gets its routing appended as the group column (``C.GROUP``) that the keyed search
reads (``udfs.groups``): a target row its list (nearest centroid, int; NULL when its vector
cannot rank), a query row the ``nprobe`` lists it probes, nearest first (``list<int>``;
empty when its vector cannot rank). Both come from
:func:`nearest_join.kernels.kmeans.route`, the one exact assignment the driver trained and
estimated recall with, so a row's lists are the same wherever they are computed.
:func:`pack_listed` routes and packs in one pass (``udfs.packing.pack_blocks`` on the routed
batches), so a side's rows cross between the JVM and Python once.

:func:`sample_topk` is the recall estimate's one scan of the target: the exact top k of a
few sampled query rows (captured in the closure) against every target row of the
partition, folded batch by batch with the shared merge, and at the end the *lists* of the
k neighbours found (the driver needs nothing else of them), one small row per slot.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

from . import columns as C
from .packing import SideLayout, pack_blocks
from .vectors import decode_vectors

# The sample search's output: (sampled query, value, list of the neighbour, order key).
# ``order`` (partition << 40 | row in the partition) breaks ties between partitions alike
# for the same partitioning.
SAMPLE_SCHEMA = pa.schema([("query", pa.int32()), ("value", pa.float32()), ("list", pa.int32()),
                           ("order", pa.int64())])
_ROW_BITS = 40
# Target rows per search of the estimate's scan: Spark's Arrow batches gathered into fewer,
# larger searches, since each search and each merge into the running top k has a fixed cost
# (the operands' set-up, a pass over the (queries, 2 k) state and its neighbours' vectors).
SCAN_ROWS = 1 << 16


def list_type(nprobe: int | None) -> pa.DataType:
    """The group column's Arrow type: int32 for targets (``nprobe`` None), list<int32> for queries."""
    return pa.int32() if nprobe is None else pa.list_(pa.int32())


def list_column(lists: np.ndarray, probes: bool) -> pa.Array:
    """Arrow column of :func:`route`'s output: the first list (NULL when -1) or, with
    ``probes``, each row's valid lists (all -1 when it cannot rank: an empty list)."""
    if not probes:
        first = lists[:, 0] if lists.shape[1] else np.full(lists.shape[0], -1, np.int64)
        return pa.array(first.astype(np.int32), mask=first < 0, type=pa.int32())
    valid = lists >= 0
    offsets = np.zeros(lists.shape[0] + 1, np.int32)
    np.cumsum(valid.sum(axis=1), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(lists[valid].astype(np.int32)))


def _vectors(batch: pa.RecordBatch, layout: SideLayout, dimension: int) -> np.ndarray:
    """A batch's vectors; a batch with no element (all NULL) reads as NaN rows (never rank)."""
    vectors = decode_vectors(batch.column(layout.vector_index), layout.dimension, label=layout.label,
                             expected_from=layout.expected_from)
    if vectors.shape[1] != dimension:
        vectors = np.full((vectors.shape[0], dimension), np.nan, vectors.dtype)
    return vectors


def append_lists(batches: Iterable[pa.RecordBatch], *, layout: SideLayout, centroids: np.ndarray,
                 metric: str, nprobe: int | None) -> Iterator[pa.RecordBatch]:
    """Every batch with its rows' lists appended as ``C.GROUP`` (``nprobe`` None: a target
    row's one list; else a query row's ``nprobe`` probed lists)."""
    from nearest_join.kernels.kmeans import route  # numba: on executors only

    from .searcher import task_cpus

    threads = task_cpus()
    for batch in batches:
        vectors = _vectors(batch, layout, centroids.shape[1])
        lists = route(vectors, centroids, metric, nprobe or 1, threads=threads)
        column = list_column(lists, probes=nprobe is not None)
        yield pa.RecordBatch.from_arrays(list(batch.columns) + [column],
                                         names=list(batch.schema.names) + [C.GROUP])


def pack_listed(batches: Iterable[pa.RecordBatch], *, layout: SideLayout, centroids: np.ndarray,
                metric: str, nprobe: int | None) -> Iterator[pa.RecordBatch]:
    """mapInArrow function: user rows -> packed blocks (``udfs.packing.pack_blocks``) whose
    rows carry their lists (:func:`append_lists`) as the last column. ``layout`` is the
    side's layout before routing (its ``block_rows`` and vector position)."""
    yield from pack_blocks(append_lists(batches, layout=layout, centroids=centroids, metric=metric,
                                        nprobe=nprobe), layout)


def _scan_chunks(batches: Iterable[pa.RecordBatch], layout: SideLayout, dimension: int) -> Iterator[np.ndarray]:
    """A partition's vectors, in row order, in chunks of at least :data:`SCAN_ROWS` rows
    (the last one may be smaller)."""
    pending, rows = [], 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        pending.append(_vectors(batch, layout, dimension))
        rows += batch.num_rows
        if rows >= SCAN_ROWS:
            yield pending[0] if len(pending) == 1 else np.concatenate(pending)
            pending, rows = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else np.concatenate(pending)


def sample_topk(batches: Iterable[pa.RecordBatch], *, layout: SideLayout, queries: np.ndarray,
                centroids: np.ndarray, k: int, metric: str, index_metric: str,
                cap: float | None) -> Iterator[pa.RecordBatch]:
    """mapInArrow function over the target: the exact top ``k`` of ``queries`` (the recall
    estimate's sample) against this partition's rows, emitted once at the end as
    ``SAMPLE_SCHEMA`` rows: one per filled slot, with the list of the neighbour
    (:func:`~nearest_join.kernels.kmeans.route` for the index's metric, ``index_metric``).

    The running state is (queries, k) values, partition row numbers and vectors: the
    partition's rows are searched :data:`SCAN_ROWS` at a time, and each search's top k is
    merged into it (:func:`nearest_join.kernels.merge_topk`, ties to the
    lower row) and only the k neighbours left at the end are routed.
    """
    from nearest_join.kernels import knn, merge_topk
    from nearest_join.kernels.kmeans import route

    from .packing import _task_partition
    from .searcher import task_cpus

    threads = task_cpus()
    nq, d = queries.shape
    values = rows = held = None
    seen = 0
    for vectors in _scan_chunks(batches, layout, d):
        if vectors.dtype != queries.dtype:   # one precision for both: the wider
            wide = np.promote_types(vectors.dtype, queries.dtype)
            vectors, queries = vectors.astype(wide), queries.astype(wide)
        v, local = knn(queries, vectors, k, metric, backend="cpu", threads=threads, cap=cap)
        found = vectors[np.maximum(local, 0)]                        # (nq, k, d)
        if values is None:
            values, rows, held = v, np.where(local >= 0, local + seen, -1), found
        else:
            values, rows, sources = merge_topk([values, v], [rows, local], k, metric,
                                               offsets=[0, seen], return_sources=True)
            pool = np.concatenate([held, found], axis=1)
            held = np.take_along_axis(pool, np.maximum(sources, 0)[:, :, None], axis=1)
        seen += vectors.shape[0]
    if values is None:
        return
    query, slot = np.nonzero(rows >= 0)
    if query.size == 0:
        return
    lists = route(held[query, slot], centroids, index_metric, 1, threads=threads)[:, 0]
    order = (np.int64(_task_partition()) << _ROW_BITS) | rows[query, slot]
    yield pa.RecordBatch.from_arrays(
        [pa.array(query.astype(np.int32)), pa.array(values[query, slot].astype(np.float32)),
         pa.array(lists.astype(np.int32)), pa.array(order)], schema=SAMPLE_SCHEMA)
