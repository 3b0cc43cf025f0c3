"""The IVF plan's executor passes (``mapInArrow``), each of which routes rows to their lists:
list columns, packed listed blocks, the keyed plan's (key, list) pairs, and the recall
estimate's sample search. The driver's half of the plan is ``nearest_join.ivf`` (and
``nearest_join.ivf_keys`` with ``on=`` keys).

Each side gets its routing appended as the group column (``C.GROUP``) that the keyed search
reads (``udfs.search``): a target row its list (nearest centroid, int; NULL when its vector
cannot rank), a query row the ``nprobe`` lists it probes, nearest first (``list<int>``;
empty when its vector cannot rank). Both come from
:func:`nearest_kernels.kmeans.route`, the one exact assignment the driver trained and
estimated recall with, so a row's lists are the same wherever they are computed.
:func:`pack_listed` routes and packs in one pass (``udfs.packing.pack_blocks`` on the routed
batches), so a side's rows cross between the JVM and Python once.

:func:`sample_topk` is the recall estimate's one scan of the target: the exact top k of a
few sampled query rows (captured in the closure) against every target row of the
partition, folded batch by batch with the shared merge, and at the end the *lists* of the
k neighbours found (the driver needs nothing else of them), one small row per slot.

With ``on=`` keys (``nearest_join.ivf``'s keyed plan) the rows arrive with their key group
as the last column, and :func:`pack_key_listed` *replaces* it by the IVF group ids: the
index of a row's (key, list) pair among the sorted codes the driver counted
(:func:`count_key_lists`) for a key searched by lists, or one id for a key searched whole
(:func:`target_key_ids`, :func:`key_probes`: a query probes its nearest lists among those
its key's targets occupy). :func:`sample_topk` takes the sampled queries' key groups and
ranks each against its own key's rows only.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

from . import columns as C
from .context import SideLayout, task_cpus, task_partition
from .decode import decode_vectors, group_ids
from .packing import pack_blocks

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
    from nearest_kernels.kmeans import route  # numba: on executors only

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


def _scan_chunks(batches: Iterable[pa.RecordBatch], layout: SideLayout,
                 dimension: int) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """A partition's (vectors, group ids) in row order, in chunks of at least
    :data:`SCAN_ROWS` rows (the last one may be smaller); the ids (``udfs.decode.group_ids``
    of the ``layout.group_index`` column) None without one."""
    pending, groups, rows = [], [], 0

    def chunk():
        vectors = pending[0] if len(pending) == 1 else np.concatenate(pending)
        return vectors, None if layout.group_index is None else np.concatenate(groups)

    for batch in batches:
        if batch.num_rows == 0:
            continue
        pending.append(_vectors(batch, layout, dimension))
        if layout.group_index is not None:
            groups.append(group_ids(batch.column(layout.group_index)))
        rows += batch.num_rows
        if rows >= SCAN_ROWS:
            yield chunk()
            pending, groups, rows = [], [], 0
    if pending:
        yield chunk()


def sample_topk(batches: Iterable[pa.RecordBatch], *, layout: SideLayout, queries: np.ndarray,
                centroids: np.ndarray, k: int, metric: str,
                cap: float | None, query_groups: np.ndarray | None = None) -> Iterator[pa.RecordBatch]:
    """mapInArrow function over the target: the exact top ``k`` of ``queries`` (the recall
    estimate's sample) against this partition's rows, emitted once at the end as
    ``SAMPLE_SCHEMA`` rows: one per filled slot, with the list of the neighbour
    (:func:`~nearest_kernels.kmeans.route` under the join's ``metric``, as the search routes).

    The running state is (queries, k) values, partition row numbers and vectors: the
    partition's rows are searched :data:`SCAN_ROWS` at a time, and each search's top k is
    merged into it (:func:`nearest_kernels.merge_topk`, ties to the
    lower row) and only the k neighbours left at the end are routed.

    ``query_groups`` (``on=`` keys: each sampled query's key group, -1 none): each query is
    ranked against the rows of its own group only, the batches' ``layout.group_index``
    column holding the target rows' groups (:func:`udfs.search.grouped_search`).
    """
    from nearest_kernels import knn, merge_topk
    from nearest_kernels.kmeans import route

    threads = task_cpus()
    nq, d = queries.shape
    values = rows = held = None
    seen = 0
    for vectors, target_groups in _scan_chunks(batches, layout, d):
        if vectors.dtype != queries.dtype:   # one precision for both: the wider
            wide = np.promote_types(vectors.dtype, queries.dtype)
            vectors, queries = vectors.astype(wide), queries.astype(wide)
        if query_groups is None:
            v, local = knn(queries, vectors, k, metric, backend="cpu", threads=threads, cap=cap)
        else:
            v, local = _grouped_knn(queries, query_groups, vectors, target_groups, k, metric, cap, threads)
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
    lists = route(held[query, slot], centroids, metric, 1, threads=threads)[:, 0]
    order = (np.int64(task_partition()) << _ROW_BITS) | rows[query, slot]
    yield pa.RecordBatch.from_arrays(
        [pa.array(query.astype(np.int32)), pa.array(values[query, slot].astype(np.float32)),
         pa.array(lists.astype(np.int32)), pa.array(order)], schema=SAMPLE_SCHEMA)


def _grouped_knn(queries: np.ndarray, query_groups: np.ndarray, vectors: np.ndarray,
                 target_groups: np.ndarray, k: int, metric: str, cap: float | None,
                 threads: int) -> tuple[np.ndarray, np.ndarray]:
    """knn's (values, chunk rows) of ``queries`` against ``vectors`` (of group ids
    ``target_groups``), each query ranked against the rows of its own group only
    (:func:`udfs.search.grouped_search`)."""
    from nearest_kernels import knn

    from .search import GroupSegments, grouped_search

    segments = GroupSegments.of(target_groups)
    return grouped_search(lambda q, t: knn(q, t, k, metric, backend="cpu", threads=threads, cap=cap),
                          queries, query_groups, np.ascontiguousarray(vectors[segments.order]), segments,
                          k, metric, cap=cap, threads=threads)


# ----------------------------------------------------------------------------- on= keys
# The target's (key group, list) pairs: the rows of each that a partition holds.
KEY_LIST_SCHEMA = pa.schema([("group", pa.int64()), ("list", pa.int64()), ("rows", pa.int64())])


def count_key_lists(batches: Iterable[pa.RecordBatch], *, layout: SideLayout, centroids: np.ndarray,
                    metric: str) -> Iterator[pa.RecordBatch]:
    """mapInArrow function over the keyed target (its vectors, its key group at
    ``layout.group_index``): the rows of each (key group, list) pair in the partition, one
    ``KEY_LIST_SCHEMA`` row per pair, emitted at the end. A row of no group, or whose vector
    cannot rank, counts nowhere."""
    from nearest_kernels.kmeans import route  # numba: on executors only

    threads = task_cpus()
    nlist = centroids.shape[0]
    codes = []
    for batch in batches:
        if batch.num_rows == 0:
            continue
        lists = route(_vectors(batch, layout, centroids.shape[1]), centroids, metric, 1, threads=threads)[:, 0]
        groups = group_ids(batch.column(layout.group_index))
        ok = (lists >= 0) & (groups >= 0)
        codes.append(groups[ok] * nlist + lists[ok])
    if not codes:
        return
    pairs, rows = np.unique(np.concatenate(codes), return_counts=True)
    if pairs.size:
        yield pa.RecordBatch.from_arrays([pa.array(pairs // nlist), pa.array(pairs % nlist),
                                          pa.array(rows.astype(np.int64))], schema=KEY_LIST_SCHEMA)


def _key_ranges(groups: np.ndarray, key_lists: np.ndarray, nlist: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's range of ``key_lists`` (its key's pairs; empty for a key searched whole)."""
    return np.searchsorted(key_lists, groups * nlist), np.searchsorted(key_lists, groups * nlist + nlist)


def key_probes(vectors: np.ndarray, groups: np.ndarray, key_lists: np.ndarray, centroids: np.ndarray,
               metric: str, nprobe: int, threads: int | None = None) -> np.ndarray:
    """The group ids each query row probes inside its key, nearest first, -1 padded
    (int64 (rows, width)): the IVF plan with ``on=`` keys (``nearest_join.ivf``).

    ``key_lists`` are the sorted codes ``key group * nlist + list`` of the (key, list)
    pairs of the keys searched by lists; pair ``i``'s group id is ``i``. A row of such a key
    probes its ``nprobe`` nearest lists *among those its key's targets occupy*
    (:func:`~nearest_kernels.kmeans.route` over those centroids, ties to the lower
    list; all of them when the key has fewer; none when its vector cannot rank). A row of
    any other key group ``g`` (one searched whole) probes the one id
    ``len(key_lists) + g``; a row of no group (-1) probes nothing.
    """
    from nearest_kernels.kmeans import route  # numba: on executors only

    nlist = centroids.shape[0]
    lo, hi = _key_ranges(groups, key_lists, nlist)
    listed = (groups >= 0) & (hi > lo)
    width = int(min(nprobe, (hi - lo)[listed].max())) if listed.any() else 1
    out = np.full((groups.shape[0], width), -1, np.int64)
    whole = (groups >= 0) & ~listed
    out[whole, 0] = key_lists.size + groups[whole]
    rows = np.flatnonzero(listed)
    rows = rows[np.argsort(groups[rows], kind="stable")]
    for members in np.split(rows, np.flatnonzero(np.diff(groups[rows])) + 1):
        if members.size == 0:
            continue
        first, last = lo[members[0]], hi[members[0]]
        lists = key_lists[first:last] - groups[members[0]] * nlist
        near = route(vectors[members], centroids[lists], metric, nprobe, threads=threads)
        out[members, :near.shape[1]] = np.where(near >= 0, first + near, -1)
    return out


def target_key_ids(groups: np.ndarray, lists: np.ndarray, key_lists: np.ndarray, nlist: int) -> np.ndarray:
    """Each target row's group id (the ids :func:`key_probes` probes): its (key, list)
    pair's index in ``key_lists`` for a key searched by lists, ``len(key_lists)`` + its key
    group for one searched whole, -1 for a row of no group, or of a listed key whose vector
    cannot rank (list -1) or whose pair ``key_lists`` lacks (the input changed since planning)."""
    lo, hi = _key_ranges(groups, key_lists, nlist)
    listed = (groups >= 0) & (hi > lo)
    codes = groups * nlist + lists
    at = np.minimum(np.searchsorted(key_lists, codes), max(key_lists.size - 1, 0))
    found = listed & (lists >= 0) & (key_lists[at] == codes) if key_lists.size else listed
    ids = np.where(groups >= 0, key_lists.size + groups, -1)
    return np.where(listed, np.where(found, at, -1), ids)


def _id_column(ids: np.ndarray, probes: bool) -> pa.Array:
    """Arrow column of group ids: int64 (NULL for -1) or, with ``probes``, each row's valid
    ids of a -1 padded (rows, width) matrix as ``list<int64>``."""
    if not probes:
        return pa.array(ids, mask=ids < 0, type=pa.int64())
    valid = ids >= 0
    offsets = np.zeros(ids.shape[0] + 1, np.int32)
    np.cumsum(valid.sum(axis=1), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids[valid], pa.int64()))


def replace_key_groups(batches: Iterable[pa.RecordBatch], *, layout: SideLayout, centroids: np.ndarray,
                       metric: str, nprobe: int | None, key_lists: np.ndarray) -> Iterator[pa.RecordBatch]:
    """Every batch with its key group column (``layout.group_index``, ``C.GROUP``) replaced
    by the IVF group ids: a target row's one id (``nprobe`` None, :func:`target_key_ids`),
    a query row's probed ids (:func:`key_probes`)."""
    from nearest_kernels.kmeans import route  # numba: on executors only

    threads = task_cpus()
    at = layout.group_index
    for batch in batches:
        vectors = _vectors(batch, layout, centroids.shape[1])
        groups = group_ids(batch.column(at))
        if nprobe is None:
            lists = route(vectors, centroids, metric, 1, threads=threads)[:, 0]
            column = _id_column(target_key_ids(groups, lists, key_lists, centroids.shape[0]), probes=False)
        else:
            column = _id_column(key_probes(vectors, groups, key_lists, centroids, metric, nprobe, threads),
                                probes=True)
        columns = list(batch.columns)
        columns[at] = column
        yield pa.RecordBatch.from_arrays(columns, names=list(batch.schema.names))


def pack_key_listed(batches: Iterable[pa.RecordBatch], *, layout: SideLayout, centroids: np.ndarray,
                    metric: str, nprobe: int | None, key_lists: np.ndarray) -> Iterator[pa.RecordBatch]:
    """mapInArrow function: keyed user rows -> packed blocks whose last column is their IVF
    group ids (:func:`replace_key_groups`), routed and packed in one pass."""
    yield from pack_blocks(replace_key_groups(batches, layout=layout, centroids=centroids, metric=metric,
                                              nprobe=nprobe, key_lists=key_lists), layout)
