"""Numba loop of :func:`nearest_kernels.segments.knn_segments` (imported after ``cpu``,
which chooses numba's cache directory)."""
from __future__ import annotations

import numpy as np
from ._numba import import_numba

import_numba()
from numba import njit  # noqa: E402

from ._cpu_kernels import difference_sum, product_sum
from ._numba import frozen, run_split


# Query rows per iteration of the parallel loop: they share one buffer of keys.
_QUERY_CHUNK = 64


def segment_topk(queries, q_factors, q_ok, targets, t_factors, t_ok, segment_starts, probe_starts,
                 probe_segments, difference, keys, indices, threads=None):
    """Per query row (chunks of :data:`_QUERY_CHUNK` rows split over ``threads``), the ``k = keys.shape[1]`` smallest (key, target index) of
    the rankable targets of its segments, best first, into ``keys`` (pre-filled +inf) and
    ``indices`` (pre-filled -1). A key is the float64 difference-form sum (``difference``) or
    the negated product of the rows scaled by their factors. The top k is kept by insertion:
    a segment is a few rows, and k slots stay in one cache line or two.

    Each segment's keys are computed in one tight loop into a buffer first, then inserted:
    interleaved with the insertions' branches the key loop ran at about half its speed."""
    longest = int(np.diff(segment_starts).max(initial=0))
    run_split(_segment_chunks, -(-queries.shape[0] // _QUERY_CHUNK),
              *frozen(queries, q_factors, q_ok, targets, t_factors, t_ok, segment_starts, probe_starts, probe_segments),
              difference, keys, indices,
              longest, threads=threads)


@njit(nogil=True, cache=True)
def _segment_chunks(lo, hi, queries, q_factors, q_ok, targets, t_factors, t_ok, segment_starts, probe_starts,
                    probe_segments, difference, keys, indices, longest):
    """Chunks ``lo`` to ``hi`` of :func:`segment_topk`'s query rows."""
    k = keys.shape[1]
    n = queries.shape[0]
    for chunk in range(lo, hi):
        buffer = np.empty(longest)
        for i in range(chunk * _QUERY_CHUNK, min(n, (chunk + 1) * _QUERY_CHUNK)):
            if not q_ok[i]:
                continue
            query, factor = queries[i], q_factors[i]
            count = 0
            for p in range(probe_starts[i], probe_starts[i + 1]):
                s = probe_segments[p]
                lo, hi = segment_starts[s], segment_starts[s + 1]
                if difference:
                    for j in range(lo, hi):
                        buffer[j - lo] = difference_sum(query, factor, targets[j], t_factors[j])
                else:
                    for j in range(lo, hi):
                        buffer[j - lo] = -product_sum(query, factor, targets[j], t_factors[j])
                for j in range(lo, hi):
                    if not t_ok[j]:
                        continue
                    key = buffer[j - lo]
                    if count == k:
                        last_key, last_j = keys[i, k - 1], indices[i, k - 1]
                        if not (key < last_key or (key == last_key and j < last_j)):
                            continue
                        pos = k - 1
                    else:
                        pos = count
                        count += 1
                    while pos > 0 and (keys[i, pos - 1] > key or
                                       (keys[i, pos - 1] == key and indices[i, pos - 1] > j)):
                        keys[i, pos] = keys[i, pos - 1]
                        indices[i, pos] = indices[i, pos - 1]
                        pos -= 1
                    keys[i, pos] = key
                    indices[i, pos] = j
