"""Numba kernels of the "cpu" backend: tiled GEMM fused with a per-query running top-k.

Import this module only through :mod:`nearest_join.kernels.cpu`, which points numba's cache at a
writable directory before numba is imported.

Every metric is reduced to one problem: for each query row ``i`` keep the ``k`` targets ``j``
with the smallest ``score[i, j] = (Q' T^T)[i, j] + bias[j]``, ties to the lower ``j``, where the
caller has prepared ``Q'`` (queries scaled by -2 for squared L2, by -1 for similarities) and
``bias`` (|t|^2 for squared L2, 0 for similarities). One code path, one compiled kernel.

Work is split into items, each a (query tile, target split) pair, run one per numba thread;
inside an item the target tiles are visited in index order. For each target tile the item
computes the score tile with one single-threaded BLAS sgemm (numba's ``np.dot`` calls scipy's
BLAS) into a buffer of at most ``query_tile * target_tile`` float32 values (512 x 1024 x 4 B =
2 MiB, one core's L2 here), then folds it into the running top-k while it is still in cache: the
distance matrix never reaches main memory. Memory traffic per item is the query tile once plus
each target tile once (d * target_tile * 4 B, read by the GEMM's packing).

The fold: each query keeps a max-heap of its best ``k`` (value, index) pairs, worst on top. A
candidate enters only if its value is strictly below the heap top. Because targets arrive in
increasing index order, a candidate equal to the top has a higher index than everything kept,
so the strict test is exactly the "lower index wins" rule. The test runs on blocks of
``_BLOCK`` candidates at a time as a branch-free count that LLVM vectorises; only a block with
at least one candidate under the threshold is scanned one by one (after the first tile, almost
none are).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

# Candidates tested per vectorised threshold check. A compile-time constant trip count lets LLVM
# unroll and vectorise the count loop (a run-time bound measured 5x slower); 64 float32 are four
# AVX-512 vectors.
_BLOCK = 64

# An index larger than any target index marks an empty heap slot, so the (value, index) order
# puts empty slots last without a special case; the caller maps it to -1.
EMPTY_INDEX = np.iinfo(np.int64).max


@njit(inline="always", cache=True)
def _worse(v_a, i_a, v_b, i_b):
    """(v_a, i_a) ranks after (v_b, i_b): larger value, or equal value and larger index."""
    return v_a > v_b or (v_a == v_b and i_a > i_b)


@njit(inline="always", cache=True)
def _sift_down(heap_v, heap_i, v, idx, pos, size):
    """Place (v, idx) at ``pos`` of the max-heap heap[:size] and sift it down."""
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        right = child + 1
        if right < size and _worse(heap_v[right], heap_i[right], heap_v[child], heap_i[child]):
            child = right
        if _worse(heap_v[child], heap_i[child], v, idx):
            heap_v[pos] = heap_v[child]
            heap_i[pos] = heap_i[child]
            pos = child
        else:
            break
    heap_v[pos] = v
    heap_i[pos] = idx


@njit(cache=True)
def _fold_row(row, bias, t0, heap_v, heap_i):
    """Fold one score-tile row (targets t0, t0+1, ...) into one query's heap."""
    width = row.shape[0]
    k = heap_v.shape[0]
    threshold = heap_v[0]
    n_full = width // _BLOCK
    for block in range(n_full + 1):
        start = block * _BLOCK
        if block < n_full:
            hits = 0
            for j in range(_BLOCK):
                hits += (row[start + j] + bias[start + j]) < threshold
            if hits == 0:
                continue
            stop = start + _BLOCK
        else:
            stop = width
        for j in range(start, stop):
            v = row[j] + bias[j]
            if v < threshold:
                _sift_down(heap_v, heap_i, v, t0 + j, 0, k)
                threshold = heap_v[0]


@njit(parallel=True, cache=True)
def search_tiles(queries, targets, bias, heap_v, heap_i, query_tile, target_tile):
    """Fill ``heap_v/heap_i`` (n_split, nq, k) with per-split max-heaps of the best scores.

    ``queries`` (nq, d) and ``targets`` (nt, d) are C-contiguous float32, ``bias`` (nt,)
    float32; the heaps arrive filled with (+inf, EMPTY_INDEX). Split ``s`` covers an equal share
    of the target tiles, in order. Call with BLAS limited to one thread: each numba thread runs
    its own sgemm.
    """
    nq = queries.shape[0]
    nt = targets.shape[0]
    n_split = heap_v.shape[0]
    n_qtiles = (nq + query_tile - 1) // query_tile
    n_ttiles = (nt + target_tile - 1) // target_tile
    tiles_per_split = (n_ttiles + n_split - 1) // n_split
    for item in prange(n_qtiles * n_split):
        qt = item // n_split
        split = item % n_split
        q0 = qt * query_tile
        q1 = min(nq, q0 + query_tile)
        rows = q1 - q0
        query_block = queries[q0:q1]
        # One flat buffer per item, viewed as (rows, width) so the last, narrower target tile
        # still gets a C-contiguous output, as np.dot's out= requires.
        buffer = np.empty(rows * target_tile, dtype=np.float32)
        for tt in range(split * tiles_per_split, min(n_ttiles, (split + 1) * tiles_per_split)):
            t0 = tt * target_tile
            t1 = min(nt, t0 + target_tile)
            scores = buffer[: rows * (t1 - t0)].reshape((rows, t1 - t0))
            np.dot(query_block, targets[t0:t1].T, scores)
            tile_bias = bias[t0:t1]
            for r in range(rows):
                _fold_row(scores[r], tile_bias, t0, heap_v[split, q0 + r], heap_i[split, q0 + r])


@njit(parallel=True, cache=True)
def finish_heaps(heap_v, heap_i):
    """Merge the splits into split 0 and sort each query's heap ascending by (value, index).

    Returns views of split 0: values (nq, k) and indices (nq, k), best first.
    """
    n_split, nq, k = heap_v.shape
    for q in prange(nq):
        top_v = heap_v[0, q]
        top_i = heap_i[0, q]
        for split in range(1, n_split):
            for slot in range(k):
                v = heap_v[split, q, slot]
                idx = heap_i[split, q, slot]
                if _worse(top_v[0], top_i[0], v, idx):
                    _sift_down(top_v, top_i, v, idx, 0, k)
        # In-place heapsort: move the worst to the end, shrink, repeat.
        for end in range(k - 1, 0, -1):
            v = top_v[end]
            idx = top_i[end]
            top_v[end] = top_v[0]
            top_i[end] = top_i[0]
            _sift_down(top_v, top_i, v, idx, 0, end)
    return heap_v[0], heap_i[0]
