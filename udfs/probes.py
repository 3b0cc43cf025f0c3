"""Query rows in several groups at once: the IVF plan's probed lists.

In the IVF plan (``nearest_join.ivf``) the group of a target row is its list (nearest
centroid) and a query row carries the ``nprobe`` lists it probes, as an Arrow ``list<int>``
column: :class:`udfs.decode.Probes` is that column as CSR (row ``i`` probes
``groups[starts[i]:starts[i + 1]]``). :func:`probed_search` is
:func:`udfs.groups.grouped_search` for such rows (``grouped_search`` hands them over): the
same target block sorted by group once per task (:class:`udfs.groups.GroupSegments`), the
same split of the work,

* probes of small segments in one :func:`~nearest_kernels.segments.knn_segments` call,
  a query's small segments ranked together (float64 keys, exact for every metric);
* the large segments (dense lists: queries x rows x d above ``udfs.groups.SEGMENT_WORK``): on
  a CPU task all of them in one :func:`~nearest_kernels.segments.knn_probed` call (one
  operand set-up for the block, each list multiplied once for the queries that probe it,
  each query ranked once: a probed pair costs about what an exact one does); on a GPU task
  one call of its searcher per list, for all the queries that probe it, each list's
  results folded into its queries' top k by the shared
  :func:`nearest_kernels.merge_topk` (a running (queries, k) state, whatever nprobe is);

and the two parts merged by the same ``merge_topk``. Every pair searched is exact; only
which lists a query probes is approximate. Ties between targets of equal value go to the
lower block row, except within one segment call (``knn_segments``, ``knn_probed``), where
they go to the lower list first (the segments' order); both are deterministic for a given
input.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .decode import Probes

__all__ = ["probed_search"]


def probed_search(search: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
                  query_vectors: np.ndarray, probes: Probes, sorted_targets: np.ndarray, segments,
                  k: int, metric: str, *, segment_work: int, cap: float | None = None,
                  threads: int = 1, wide: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(values, rows) of a query block against a target block, each query row searched
    against the segments of all its groups (the contract of
    :func:`udfs.groups.grouped_search`, with :class:`Probes` for the query groups).

    ``wide`` (the task searches on the CPU): the large segments go to one
    :func:`~nearest_kernels.segments.knn_probed` call instead of one ``search`` call
    per segment. ``segment_work``: the work (queries x rows x d) above which a segment is large
    (``grouped_search`` passes ``udfs.groups.SEGMENT_WORK``).
    """
    from nearest_kernels import merge_topk, resolve_metric
    from nearest_kernels.segments import knn_probed, knn_segments  # numba: on executors only

    nq, d = query_vectors.shape
    if probes.rows != nq:
        raise RuntimeError(f"internal error: {probes.rows} probe rows for {nq} query rows")
    worst = resolve_metric(metric).worst
    values = np.full((nq, k), worst, np.float32)
    rows = np.full((nq, k), -1, np.int64)
    if nq == 0 or segments.groups.size == 0 or probes.groups.size == 0:
        return values, rows
    # Each probe's segment; probes of groups the block lacks are dropped.
    owner = np.repeat(np.arange(nq, dtype=np.int64), np.diff(probes.starts))
    at = np.minimum(np.searchsorted(segments.groups, probes.groups), segments.groups.size - 1)
    present = (probes.groups >= 0) & (segments.groups[at] == probes.groups)
    owner, segment = owner[present], at[present]
    if segment.size == 0:
        return values, rows
    sizes = np.diff(segments.starts)
    large = np.bincount(segment, minlength=sizes.size) * sizes * d > segment_work
    small = ~large[segment]
    if small.any():
        # The queries in the order of their first small segment: queries of one list run one
        # after another and find its rows in cache (a block's lists, taken in query order, are
        # read from memory once per query). owner is non-decreasing (CSR order), so the small
        # probes are CSR too, and stay so when whole rows are permuted.
        s_owner, s_segment = owner[small], segment[small]
        counts = np.bincount(s_owner, minlength=nq)
        starts = np.zeros(nq + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        first = np.full(nq, segments.groups.size, np.int64)   # rows without one: last
        first[counts > 0] = s_segment[starts[:-1][counts > 0]]
        by_segment = np.argsort(first, kind="stable")
        moved = np.repeat(starts[by_segment], counts[by_segment]) + (
            np.arange(s_owner.size) - np.repeat(np.cumsum(counts[by_segment]) - counts[by_segment],
                                                counts[by_segment]))
        probe_starts = np.zeros(nq + 1, np.int64)
        np.cumsum(counts[by_segment], out=probe_starts[1:])
        v, local = knn_segments(query_vectors[by_segment], sorted_targets, segments.starts, probe_starts,
                                s_segment[moved], k, metric, cap=cap, threads=threads)
        values[by_segment] = v
        rows[by_segment] = np.where(local >= 0, segments.order[np.maximum(local, 0)], -1)

    big = np.flatnonzero(~small)
    if big.size and wide:
        # Every query's large segments in one call: one operand set-up for the block, each
        # segment multiplied once for all its queries, each query ranked once.
        b_owner = owner[big]
        starts = np.zeros(nq + 1, np.int64)
        np.cumsum(np.bincount(b_owner, minlength=nq), out=starts[1:])
        v, local = knn_probed(query_vectors, sorted_targets, segments.starts, starts, segment[big], k,
                              metric, cap=cap, threads=threads)
        found = np.where(local >= 0, segments.order[np.maximum(local, 0)], -1)
        values, rows = merge_topk([values, v], [rows, found], k, metric)
    elif big.size:
        b_owner, b_segment = owner[big], segment[big]
        by_segment = np.argsort(b_segment, kind="stable")
        bounds = np.flatnonzero(np.diff(b_segment[by_segment])) + 1
        for chunk in np.split(by_segment, bounds):
            # One call for every query probing this list, folded into those queries' top k
            # (memory: the running (nq, k) state, whatever nprobe is).
            s = int(b_segment[chunk[0]])
            members = b_owner[chunk]
            lo, hi = segments.starts[s], segments.starts[s + 1]
            v, local = search(query_vectors[members], sorted_targets[lo:hi])
            block_rows = segments.order[lo:hi]
            found = np.where(local >= 0, block_rows[np.maximum(local, 0)], -1)
            values[members], rows[members] = merge_topk([values[members], v], [rows[members], found], k, metric)
    return values, rows
