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
BLAS) into a buffer of ``query_tile * target_tile`` float32 values (1024 x 512 x 4 B = 2 MiB,
one core's L2 here), then folds it into the running top-k while it is still in cache: the
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
    """(v_a, i_a) ranks after (v_b, i_b): larger value, or equal value and larger index.

    Bitwise, not short-circuit, operators: the outcome is data-dependent and unpredictable
    while sifting, and a select is cheaper than a mispredicted branch (measured ~20% of the
    fold at k=100).
    """
    return (v_a > v_b) | ((v_a == v_b) & (i_a > i_b))


@njit(inline="always", cache=True)
def _sift_down(heap_v, heap_i, v, idx, pos, size):
    """Place (v, idx) at ``pos`` of the max-heap heap[:size] and sift it down."""
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        right = child + 1
        if right < size:
            take_right = _worse(heap_v[right], heap_i[right], heap_v[child], heap_i[child])
            child = right if take_right else child
        child_v = heap_v[child]
        child_i = heap_i[child]
        if _worse(child_v, child_i, v, idx):
            heap_v[pos] = child_v
            heap_i[pos] = child_i
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
def search_tiles(queries, targets, bias, tail_targets, tail_bias, heap_v, heap_i, query_tile):
    """Fill ``heap_v/heap_i`` (n_split, nq, k) with per-split max-heaps of the best scores.

    ``queries`` (nq, d) and ``targets`` (nt, d) are C-contiguous float32, ``bias`` (nt,)
    float32. Every sgemm call has the same shape (query tile x target tile x d), because the
    same shape is what makes duplicate target rows score bit-identically: OpenBLAS computes the
    columns of a call in lanes of one micro-kernel, but a tail narrower than the micro-kernel,
    or a differently shaped call, may take another code path with another rounding (measured:
    a 1031-wide call scores copies of one row differently). So the target tile width is a
    multiple of 64 and the last, partial tile is ``tail_targets`` (target_tile, d): the
    remaining targets padded with zero rows whose ``tail_bias`` is +inf, so they never enter.
    The heaps arrive filled with (+inf, EMPTY_INDEX). Split ``s`` covers an equal share of the
    target tiles, in order. Call with BLAS limited to one thread: each numba thread runs its
    own sgemm.
    """
    nq = queries.shape[0]
    nt = targets.shape[0]
    target_tile = tail_targets.shape[0]
    n_split = heap_v.shape[0]
    n_qtiles = (nq + query_tile - 1) // query_tile
    n_ttiles = (nt + target_tile - 1) // target_tile
    n_full = nt // target_tile
    tiles_per_split = (n_ttiles + n_split - 1) // n_split
    for item in prange(n_qtiles * n_split):
        qt = item // n_split
        split = item % n_split
        q0 = qt * query_tile
        q1 = min(nq, q0 + query_tile)
        rows = q1 - q0
        query_block = queries[q0:q1]
        scores = np.empty((rows, target_tile), dtype=np.float32)
        for tt in range(split * tiles_per_split, min(n_ttiles, (split + 1) * tiles_per_split)):
            t0 = tt * target_tile
            if tt < n_full:
                target_block = targets[t0:t0 + target_tile]
                tile_bias = bias[t0:t0 + target_tile]
            else:
                target_block = tail_targets
                tile_bias = tail_bias
            np.dot(query_block, target_block.T, scores)
            for r in range(rows):
                _fold_row(scores[r], tile_bias, t0, heap_v[split, q0 + r], heap_i[split, q0 + r])


@njit(parallel=True, cache=True)
def squared_norms(rows):
    """|row|^2 of each float32 row, accumulated in float64 in a fixed order, so equal rows
    get equal norms (numpy's reductions may peel differently by alignment)."""
    out = np.empty(rows.shape[0], dtype=np.float64)
    for i in prange(rows.shape[0]):
        total = 0.0
        for j in range(rows.shape[1]):
            total += np.float64(rows[i, j]) * np.float64(rows[i, j])
        out[i] = total
    return out


@njit(parallel=True, cache=True)
def unit_rows(rows):
    """Each float64 row divided by its norm in float64, then rounded once to float32."""
    out = np.empty(rows.shape, dtype=np.float32)
    for i in prange(rows.shape[0]):
        total = 0.0
        for j in range(rows.shape[1]):
            total += rows[i, j] * rows[i, j]
        norm = np.sqrt(total)
        for j in range(rows.shape[1]):
            out[i, j] = rows[i, j] / norm
    return out


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
