"""Numba kernels of the "cpu" backend: tiled GEMM fused with a per-query running top-k.

Import this module only through :mod:`nearest_kernels.cpu`, which points numba's cache at a
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

The fold: each query keeps a max-heap of its best ``k`` candidates, worst on top. A candidate
is one uint64 key, ``order(score) << 32 | target index``, where ``order`` maps a float32 to a
uint32 with the same order; comparing keys compares (score, index) lexicographically in one
instruction, which is the tie rule, and the sift has no unpredictable two-array comparisons
(faster than separate value/index heaps). A candidate enters only if its
score is strictly below the score of the heap top. Because targets arrive in increasing index
order, a candidate equal to the top has a higher index than everything kept, so the strict test
is exactly the "lower index wins" rule. The test runs on blocks of ``_BLOCK`` candidates at a
time as a branch-free count that LLVM vectorises; only a block with at least one candidate under
the threshold is scanned one by one (after the first tiles, almost none are). A heap of at least
``SEED_WIDTH`` slots is instead filled from its first target tile by a selection, then heapified.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir

from ._numba import import_numba

import_numba()
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from ._common import SEED_WIDTH
from ._numba import frozen, run_split

# Candidates tested per vectorised threshold check. A compile-time constant trip count lets LLVM
# unroll and vectorise the count loop (a run-time bound measured 5x slower); 64 float32 are eight
# 256-bit vectors (numba's default vector width, AVX-512 machines included).
_BLOCK = 64

_SIGN = np.uint32(0x80000000)
_SHIFT = np.uint64(32)
# The index that sorts after every target's: an empty slot's while candidates are ordered.
_NO_INDEX = np.int64(np.iinfo(np.int64).max)


@intrinsic
def _bits_of(typingctx, value):
    """The bits of a float32 as a uint32 (a bitcast: numba has no scalar one)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _float_of(typingctx, bits):
    """The float32 whose bits are the low 32 of the unsigned integer ``bits`` (the inverse of
    :func:`_bits_of`; numba widens uint32 arithmetic to 64 bits)."""
    if not isinstance(bits, types.Integer) or bits.signed or bits.bitwidth < 32:
        return None

    def codegen(context, builder, signature, args):
        low = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())
    return types.float32(bits), codegen


@njit(inline="always", cache=True)
def _order_bits(bits):
    """float32 bits (as uint32) -> uint32 with the order of the floats (finite and inf).

    Negative floats grow in magnitude as their bits grow: flip all their bits. Non-negative
    floats already sort by their bits: set the sign bit so they rank above all negatives.
    -0.0 would rank below +0.0, but no score is -0.0: every score is a product sum plus a bias
    that is +0.0 or positive, and -0.0 + +0.0 is +0.0.
    """
    return bits ^ np.uint32(0xFFFFFFFF) if bits & _SIGN else bits | _SIGN


@njit(inline="always", cache=True)
def _float_bits(order):
    """The inverse of :func:`_order_bits`."""
    return order ^ _SIGN if order & _SIGN else order ^ np.uint32(0xFFFFFFFF)


# An empty heap slot: score +inf and an index no target has, so it ranks after every real
# candidate. Targets must number fewer than 2^32 - 1 (the index lives in the low 32 bits).
EMPTY_INDEX = 0xFFFFFFFF
EMPTY_KEY = np.uint64((0x7F800000 | 0x80000000) << 32 | EMPTY_INDEX)


@njit(inline="always", cache=True)
def _sift_down(heaps, q, pos, key, size):
    """Place ``key`` at ``pos`` of query q's max-heap heaps[q, :size] and sift it down (the
    subtrees below ``pos`` are heaps): with pos 0, replace the top; from the last parent up to
    0, build a heap."""
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        child_key = heaps[q, child]
        right = child + 1
        if right < size:
            right_key = heaps[q, right]
            if right_key > child_key:
                child = right
                child_key = right_key
        if child_key > key:
            heaps[q, pos] = child_key
            pos = child
        else:
            break
    heaps[q, pos] = key


@njit(inline="always", cache=True)
def _select_smallest(keys, n, count):
    """Reorder keys[:n] so that its ``count`` smallest come first (quickselect, median of
    three, Hoare's partition: equal keys, the EMPTY_KEY padding, are fine)."""
    lo, hi, target = 0, n - 1, count - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        a, b, c = keys[lo], keys[mid], keys[hi]
        if a > b:
            a, b = b, a
        if b > c:
            b = c
        if a > b:
            b = a
        i, j = lo, hi
        while i <= j:
            while keys[i] < b:
                i += 1
            while keys[j] > b:
                j -= 1
            if i <= j:
                keys[i], keys[j] = keys[j], keys[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break


@njit(cache=True)
def _seed_row(scores, r, bias, t0, heaps, q, row_scores, keys):
    """Fill query q's heap from row ``r`` of the first score tile of its target range: the
    heap's width smallest keys, heapified. The heap arrives filled with one key, EMPTY_KEY or
    a distance cap's (see :func:`search_tiles`); a candidate not below it, padding (score +inf)
    included, becomes that key, as the strict test of :func:`_fold_row` keeps it out."""
    width = scores.shape[1]
    kept = heaps.shape[1]
    limit = heaps[q, 0]
    for j in range(width):
        row_scores[j] = scores[r, j] + bias[j]
    for j in range(width):
        keys[j] = (np.uint64(_order_bits(_bits_of(row_scores[j]))) << _SHIFT) | np.uint64(t0 + j)
    for j in range(width):
        if not row_scores[j] < np.inf or keys[j] >= limit:
            keys[j] = limit
    n = width
    if n > kept:
        _select_smallest(keys, n, kept)
        n = kept
    for c in range(n):
        heaps[q, c] = keys[c]
    for pos in range(kept // 2 - 1, -1, -1):
        _sift_down(heaps, q, pos, heaps[q, pos], kept)


@njit(cache=True)
def _fold_row(scores, r, bias, t0, heaps, q):
    """Fold row ``r`` of a score tile (targets t0, t0+1, ...) into query q's heap.

    Arrays and row numbers are passed rather than row views: a view costs reference counting,
    which per row measured 0.3 -> 0.2 ns per candidate for the whole fold at k=10. (Seeding
    the first tile with a k-th-smallest selection instead of inserts was tried: np.partition
    made it 4-10% slower.)
    """
    width = scores.shape[1]
    k = heaps.shape[1]
    threshold = _float_of(_float_bits(np.uint32(heaps[q, 0] >> _SHIFT)))
    for block in range(width // _BLOCK):
        start = block * _BLOCK
        hits = 0
        for j in range(start, start + _BLOCK):
            hits += (scores[r, j] + bias[j]) < threshold
        if hits == 0:
            continue
        for j in range(start, start + _BLOCK):
            score = scores[r, j] + bias[j]
            if score < threshold:
                order = np.uint64(_order_bits(_bits_of(score)))
                _sift_down(heaps, q, 0, (order << _SHIFT) | np.uint64(t0 + j), k)
                threshold = _float_of(_float_bits(np.uint32(heaps[q, 0] >> _SHIFT)))


@njit(fastmath={"reassoc"}, nogil=True, cache=True)
def _square_sum_and_peak(row):
    """(|row|^2 in float64, max |row[j]|) of a float32 row (any summation order: a bound)."""
    total = 0.0
    peak = 0.0
    for j in range(row.shape[0]):
        v = np.float64(row[j])
        total += v * v
        peak = max(peak, abs(v))
    return total, peak


def search_tiles(queries, targets, bias, tail_targets, tail_bias, heaps, query_tile, stats, threads=None):
    """Fill ``heaps`` (n_split, nq, k) uint64 with per-split max-heaps of the best keys.

    ``queries`` (nq, d) and ``targets`` (nt, d) are C-contiguous float32, ``bias`` (nt,)
    float32. Every sgemm call has the same shape (query tile x target tile x d), so that copies
    of a target row score alike where the kernel allows it: a tail narrower than OpenBLAS's
    micro-kernel takes another code path with another rounding (measured: a 1031-wide call
    scores copies of one row differently), and under its Haswell kernels copies in different
    columns of one call may differ too (measured). Exactness does not rest on it: the exact
    stage ranks whatever the scores leave in doubt, ties included (``cpu.CpuBackend.run``).
    So the target tile width is a multiple of 64 and the last, partial tile is
    ``tail_targets`` (target_tile, d): the remaining targets padded with zero rows whose
    ``tail_bias`` is +inf, so they never enter.
    The heaps arrive filled with EMPTY_KEY, or, under a distance cap, each row's with the key
    of the largest score that can be within the cap (:func:`cap_key`): a target enters only
    below it, so the cap prunes from the first tile on. Split ``s`` covers an equal share of the target
    tiles, in order. Call with BLAS limited to one thread: each of the items' threads runs its own sgemm
    (:func:`run_split` over the items, ``threads`` of them at once).

    ``stats`` (n_items, 2) float64, or (0, 2) for none: item ``i`` writes the largest squared
    norm and the largest element magnitude of the targets of every ``n_qtiles``-th tile of its
    split, from the tile it has just multiplied (still in cache); between them the items cover
    every target once (the bound of an inner product search, see ``cpu._Operands.finish``).
    """
    queries, targets, bias, tail_targets, tail_bias = frozen(queries, targets, bias, tail_targets, tail_bias)
    n_qtiles = (queries.shape[0] + query_tile - 1) // query_tile
    # None, not an empty array or False: numba prunes a branch on an argument that is None
    # before it types the branch, so a join that neither seeds nor takes stats (heaps narrower
    # than SEED_WIDTH, any metric but inner product) never compiles _seed_row or the stats pass.
    run_split(_search_items, n_qtiles * heaps.shape[0], queries, targets, bias, tail_targets, tail_bias,
              heaps, query_tile, stats if stats.shape[0] > 0 else None,
              True if heaps.shape[2] >= SEED_WIDTH else None, threads=threads)


@njit(nogil=True, cache=True)
def _search_items(lo, hi, queries, targets, bias, tail_targets, tail_bias, heaps, query_tile, stats, seed):
    """Items ``lo`` to ``hi`` of :func:`search_tiles`, on the calling thread."""
    nq = queries.shape[0]
    nt = targets.shape[0]
    target_tile = tail_targets.shape[0]
    n_split = heaps.shape[0]
    n_qtiles = (nq + query_tile - 1) // query_tile
    n_ttiles = (nt + target_tile - 1) // target_tile
    n_full = nt // target_tile
    tiles_per_split = (n_ttiles + n_split - 1) // n_split
    for item in range(lo, hi):
        qt = item // n_split
        split = item % n_split
        q0 = qt * query_tile
        q1 = min(nq, q0 + query_tile)
        rows = q1 - q0
        query_block = queries[q0:q1]
        scores = np.empty((rows, target_tile), dtype=np.float32)
        split_heaps = heaps[split]
        first = split * tiles_per_split
        largest_sq = 0.0
        largest = 0.0
        for tt in range(first, min(n_ttiles, (split + 1) * tiles_per_split)):
            t0 = tt * target_tile
            if tt < n_full:
                target_block = targets[t0:t0 + target_tile]
                tile_bias = bias[t0:t0 + target_tile]
            else:
                target_block = tail_targets
                tile_bias = tail_bias
            np.dot(query_block, target_block.T, scores)
            if stats is not None and (tt - first) % n_qtiles == qt:
                for j in range(t0, min(nt, t0 + target_tile)):
                    sq, peak = _square_sum_and_peak(targets[j])
                    largest_sq = max(largest_sq, sq)
                    largest = max(largest, peak)
            if seed is not None and tt == first:
                row_scores = np.empty(target_tile, dtype=np.float32)
                row_keys = np.empty(target_tile, dtype=np.uint64)
                for r in range(rows):
                    _seed_row(scores, r, tile_bias, t0, split_heaps, q0 + r, row_scores, row_keys)
                continue
            for r in range(rows):
                _fold_row(scores, r, tile_bias, t0, split_heaps, q0 + r)
        if stats is not None:
            stats[item, 0] = largest_sq
            stats[item, 1] = largest



def probed_tiles(scaled, rows, members, member_starts, segment_starts, tiles, targets, bias, heaps, bounds,
                 query_tile, threads=None):
    """The probed search's candidate stage in one call (``cpu.probed_heaps``): fold into
    ``heaps`` (n, kept) uint64, row ``p`` the heap of query ``rows[p]`` (a row of ``scaled``),
    the scores of every segment ``s`` against the queries that probe it,
    ``members[member_starts[s]:member_starts[s + 1]]`` (positions ``p``, ascending). Segment
    ``s`` is ``targets[segment_starts[s]:segment_starts[s + 1]]`` (``bias`` alike), searched in
    tiles of ``tiles[s]`` rows (a multiple of 64), its last, partial tile padded with zero rows
    whose bias is +inf (they never enter), as :func:`search_tiles` pads its tail; the keys hold
    the targets' indices in ``targets``.

    Thread ``i`` takes the positions ``bounds[i]`` to ``bounds[i + 1]`` (of about equal work)
    through every segment: no two threads fold into one heap, each gathers its queries' rows
    into one tile buffer of ``query_tile`` rows and multiplies them by each tile of the
    segment, with the buffers allocated once per thread (a segment of a few hundred rows is a
    single tile: fresh buffers per segment cost about what its multiplication does)."""
    scaled, rows, members, member_starts, segment_starts, tiles, targets, bias, bounds = frozen(
        scaled, rows, members, member_starts, segment_starts, tiles, targets, bias, bounds)
    run_split(_probed_items, bounds.shape[0] - 1, scaled, rows, members, member_starts, segment_starts, tiles,
              targets, bias, heaps, bounds, query_tile, threads=threads)


@njit(inline="always", cache=True)
def _lower_bound(values, lo, hi, value):
    """The first position in ``values[lo:hi]`` (ascending) holding ``value`` or more."""
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(nogil=True, cache=True)
def _probed_items(lo, hi, scaled, rows, members, member_starts, segment_starts, tiles, targets, bias, heaps,
                  bounds, query_tile):
    """Parts ``lo`` to ``hi`` of :func:`probed_tiles`, on the calling thread. Rows are copied
    element by element (a row assignment costs numba seconds to compile), and each target
    tile into the thread's buffer before its multiplication (one sgemm variant to compile, a
    partial tile padded in place; a copy costs 1 / query_tile of the multiplication)."""
    d = scaled.shape[1]
    widest = 0
    for s in range(tiles.shape[0]):
        widest = max(widest, tiles[s])
    query_flat = np.empty(query_tile * d, dtype=np.float32)
    score_flat = np.empty(query_tile * widest, dtype=np.float32)
    target_flat = np.empty(widest * d, dtype=np.float32)
    tile_bias = np.empty(widest, dtype=np.float32)
    for part in range(lo, hi):
        first, last = bounds[part], bounds[part + 1]
        for s in range(tiles.shape[0]):
            m0, m1 = member_starts[s], member_starts[s + 1]
            t0, t1 = segment_starts[s], segment_starts[s + 1]
            if m1 == m0 or t1 == t0:
                continue
            a = _lower_bound(members, m0, m1, first)
            b = _lower_bound(members, a, m1, last)
            if a == b:
                continue
            tile = tiles[s]
            target_block = target_flat[:tile * d].reshape((tile, d))
            block_bias = tile_bias[:tile]
            for c0 in range(a, b, query_tile):
                n = min(b, c0 + query_tile) - c0
                block = query_flat[:n * d].reshape((n, d))
                for i in range(n):
                    row = rows[members[c0 + i]]
                    for c in range(d):
                        block[i, c] = scaled[row, c]
                scores = score_flat[:n * tile].reshape((n, tile))
                for at in range(t0, t1, tile):
                    for j in range(tile):
                        inside = at + j < t1
                        for c in range(d):
                            target_block[j, c] = targets[at + j, c] if inside else 0.0
                        block_bias[j] = bias[at + j] if inside else np.inf
                    np.dot(block, target_block.T, scores)
                    for i in range(n):
                        _fold_row(scores, i, block_bias, at, heaps, members[c0 + i])


def cap_key(scores: np.ndarray) -> np.ndarray:
    """Heap keys (uint64) that admit exactly the float32 scores ``<= scores`` (float64,
    rounded up to float32; +inf or NaN: EMPTY_KEY, which admits every finite score): the
    score's order bits and EMPTY_INDEX, so a target of equal score ranks before it."""
    up = scores.astype(np.float32)
    up = np.where(up.astype(np.float64) < scores, np.nextafter(up, np.float32(np.inf)), up)
    up = np.nextafter(up, np.float32(np.inf))   # the fold admits scores strictly below
    # -0.0 would rank below a score of +0.0 (see _order_bits): the least positive admits it.
    up = np.where(up == 0, np.float32(2.0 ** -149), up)
    bits = up.view(np.uint32)
    order = np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))
    keys = (order.astype(np.uint64) << np.uint64(32)) | np.uint64(EMPTY_INDEX)
    return np.where(np.isfinite(up), keys, EMPTY_KEY)


def decode(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scores (float32) and target indices (int64, EMPTY_INDEX where empty) of uint64 keys."""
    order = (keys >> np.uint64(32)).astype(np.uint32)
    negative = (order & np.uint32(0x80000000)) == 0
    bits = np.where(negative, ~order, order ^ np.uint32(0x80000000))
    return bits.view(np.float32), (keys & np.uint64(0xFFFFFFFF)).astype(np.int64)


def inverse_norms(rows, threads=None):
    """1 / |row| of each row in float64, each row first divided by its largest magnitude so
    that no square over- or underflows (elements from 1e-300 to 1e300); 0 for a zero row."""
    out = np.empty(rows.shape[0], dtype=np.float64)
    run_split(_inverse_norms, rows.shape[0], frozen(rows), out, threads=threads)
    return out


@njit(nogil=True, cache=True)
def _inverse_norms(lo, hi, rows, out):
    for i in range(lo, hi):
        peak = 0.0
        for j in range(rows.shape[1]):
            peak = max(peak, abs(np.float64(rows[i, j])))
        if peak == 0.0:
            out[i] = 0.0
            continue
        total = 0.0
        for j in range(rows.shape[1]):
            v = np.float64(rows[i, j]) / peak
            total += v * v
        out[i] = 1.0 / peak / np.sqrt(total)


# Rows of a block whose mean is the shift's reference point (evenly spaced over the block).
MEAN_SAMPLE = 4096


def sample_center(rows, factors):
    """The mean of ``rows[i] * factors[i]`` over at most MEAN_SAMPLE evenly spaced rows, in
    float64 (the shift's reference point), and the mean squared distance of those rows from
    it (the sample's spread). Any point keeps the search exact (the bound uses the shifted rows
    as they are); one near the block's centre keeps the shifted values small. numpy, not
    numba: at most MEAN_SAMPLE rows, and a compiled loop cost every new process its compile."""
    step = max(1, (rows.shape[0] + MEAN_SAMPLE - 1) // MEAN_SAMPLE)
    picked = np.arange(0, rows.shape[0], step)
    factors = np.asarray(factors, np.float64)
    if picked.size == 0:
        return np.zeros(rows.shape[1]), 0.0

    def chunks():   # float64 copies of _CENTER_CHUNK rows at a time (d = 4096: 16 MiB)
        for start in range(0, picked.size, _CENTER_CHUNK):
            at = picked[start:start + _CENTER_CHUNK]
            yield rows[at].astype(np.float64) * factors[at, None]

    center = sum(chunk.sum(axis=0) for chunk in chunks()) / picked.size
    spread = sum(float(np.einsum("ij,ij->", chunk - center, chunk - center)) for chunk in chunks())
    return center, spread / picked.size


_CENTER_CHUNK = 512


def row_peaks(rows, factors, center, out_sq=None, threads=None):
    """max_j |rows[i, j] * factors[i] - center[j]| of each row, in float64; and in ``out_sq``
    (when given) the sum of those values' squares in float64, in one fixed order (equal rows,
    equal sums): with unit factors and a zero center, the norms of a float32 block used as it
    is, from the same single read."""
    out = np.empty(rows.shape[0], dtype=np.float64)
    out_sq = np.empty(rows.shape[0], dtype=np.float64) if out_sq is None else out_sq
    run_split(_row_peaks, rows.shape[0], *frozen(rows, factors, center), out, out_sq, threads=threads)
    return out


@njit(nogil=True, cache=True)
def _row_peaks(lo, hi, rows, factors, center, out, out_sq):
    for i in range(lo, hi):
        peak = 0.0
        total = 0.0
        f = factors[i]
        for j in range(rows.shape[1]):
            v = np.float64(rows[i, j]) * f - center[j]
            total += v * v
            peak = max(peak, abs(v))
        out[i] = peak
        out_sq[i] = total


@njit(fastmath={"reassoc"}, nogil=True, cache=True)
def _square_sum(row):
    """|row|^2 of a float32 row in float64: one compiled summation order (``reassoc`` lets
    LLVM vectorise it) for every row, so equal rows get equal norms."""
    total = 0.0
    for j in range(row.shape[0]):
        v = np.float64(row[j])
        total += v * v
    return total


def shift_scale(rows, factors, center, scales, out, out_sq, threads=None):
    """``out[i, j] = float32((rows[i, j] * factors[i] - center[j]) * scales[i])``: the
    shifted, scaled float32 operand of the sgemm, computed in float64 and rounded once; and
    ``out_sq[i]`` = |out[i]|^2 in float64 (:func:`_square_sum`: equal rows, equal norms)."""
    run_split(_shift_scale, rows.shape[0], *frozen(rows, factors, center, scales), out, out_sq, threads=threads)


@njit(nogil=True, cache=True)
def _shift_scale(lo, hi, rows, factors, center, scales, out, out_sq):
    for i in range(lo, hi):
        f = factors[i]
        s = scales[i]
        for j in range(rows.shape[1]):
            out[i, j] = np.float32((np.float64(rows[i, j]) * f - center[j]) * s)
        out_sq[i] = _square_sum(out[i])


# Exact keys (see ``cpu.CpuBackend.run``): the ranking key of a pair in float64 from the
# caller's original rows, each scaled by a per-row factor. ``difference``: sum((q f_q - t f_t)^2),
# the squared distance in difference form (l2 family; with f = s / |row| for cosine); otherwise
# -sum((q f_q) (t f_t)), the negated inner product. With ``factor_after`` the factors are
# powers of two applied to the sum instead of to each element: the same bits wherever no
# float64 term over- or underflows unscaled, which the caller guarantees (float32 rows: a
# term is at most (2 x 3.4e38)^2 and at least 2^-298), and two multiplications less per element.
#
# The sums are compiled with ``reassoc`` alone, so that LLVM vectorises them (several vector
# accumulators, combined in an order it fixes at compile time): one compiled loop for every
# pair, so equal rows get equal keys wherever they sit. Any summation order keeps the error
# within (d - 1) u64 of the sum of the terms' magnitudes, which is what the proof assumes
# (``keys64`` in ``cpu._Operands``). They are not inlined at numba's level: numba would
# compile an inlined body with the caller's (strict) flags and the loops would stay scalar.
@njit(fastmath={"reassoc"}, nogil=True, cache=True)
def difference_sum(q, gq, t, gt):
    total = 0.0
    for c in range(q.shape[0]):
        x = np.float64(q[c]) * gq - np.float64(t[c]) * gt
        total += x * x
    return total


@njit(fastmath={"reassoc"}, nogil=True, cache=True)
def product_sum(q, gq, t, gt):
    total = 0.0
    for c in range(q.shape[0]):
        total += (np.float64(q[c]) * gq) * (np.float64(t[c]) * gt)
    return total


@njit(inline="always", cache=True)
def _pair_key(queries, i, fq, targets, j, ft, factor_after, key_sum):
    """The sum ``key_sum`` (difference_sum or product_sum) of the pair, its factors applied."""
    gq, gt = (1.0, 1.0) if factor_after else (fq, ft)
    total = key_sum(queries[i], gq, targets[j], gt)
    return total * (fq * ft) if factor_after else total


def _key_forms(difference: bool) -> tuple[bool | None, bool | None]:
    """The kernels' two switches of the key form, (difference, product): one True, the other
    None. numba prunes a branch on an argument that is None before it types the branch (a
    False would be typed, and its branch compiled), so a process compiles only the form its
    joins take: the difference form for every metric but inner product."""
    return (True, None) if difference else (None, True)


@njit(nogil=True, cache=True)
def pairs_by_target(candidates, needed, n_targets):
    """The flat positions ``i * width + c`` of the needed, valid candidates, ordered by target
    (a counting sort: one pass to count, one to place; stable, so by position within a target)."""
    width = candidates.shape[1]
    counts = np.empty(n_targets + 1, np.int64)
    counts[:] = 0   # (np.zeros would be one more compiled function in every new process)
    for i in range(candidates.shape[0]):
        for c in range(width):
            j = candidates[i, c]
            if j >= 0 and needed[i, c]:
                counts[j + 1] += 1
    for j in range(n_targets):
        counts[j + 1] += counts[j]
    pairs = np.empty(counts[n_targets], np.int64)
    for i in range(candidates.shape[0]):
        for c in range(width):
            j = candidates[i, c]
            if j >= 0 and needed[i, c]:
                pairs[counts[j]] = i * width + c
                counts[j] += 1
    return pairs


@intrinsic
def _prefetch_row(typingctx, rows, row):
    """Ask the CPU to start loading row ``row`` of the C-contiguous 2-D array ``rows`` into
    cache (one prefetch hint per 64-byte line; a hint, so it never faults or changes a value)."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        row_bytes = builder.mul(builder.extract_value(array.shape, 1), builder.extract_value(array.strides, 1))
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        i8p = ir.IntType(8).as_pointer()
        start = builder.gep(builder.bitcast(array.data, i8p), [builder.mul(index, row_bytes)])
        i32 = ir.IntType(32)
        hint = builder.module.declare_intrinsic("llvm.prefetch", [i8p],
                                                ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
        lines = builder.udiv(builder.add(row_bytes, row_bytes.type(63)), row_bytes.type(64))
        with cgutils.for_range(builder, lines) as loop:
            line = builder.gep(start, [builder.mul(loop.index, row_bytes.type(64))])
            builder.call(hint, [line, i32(0), i32(3), i32(1)])   # read, keep in all levels, data
        return context.get_dummy_value()
    return types.void(rows, row), codegen


# Pairs ahead of the current one whose rows :func:`pair_keys` asks the cache for: the query
# row of a pair is a random one, and its load would otherwise stall the sum.
PREFETCH_AHEAD = 4


def pair_keys(queries, q_factors, targets, t_factors, candidates, pairs, difference, factor_after, out,
              threads=None):
    """``out[i, c]``: the exact key of (queries[i], targets[candidates[i, c]]) for the flat
    positions ``i * width + c`` listed in ``pairs``, which the caller sorts by target: each
    target row is then read once per run of its pairs while the query rows stay in cache
    (reading one random target row per pair made this stage memory-bound). The rows of the
    pair ``PREFETCH_AHEAD`` further on are prefetched while a pair's key is summed."""
    run_split(_pair_keys, pairs.shape[0], *frozen(queries, q_factors, targets, t_factors, candidates, pairs),
              *_key_forms(difference), factor_after, out, threads=threads)


@njit(nogil=True, cache=True)
def _pair_keys(lo, hi, queries, q_factors, targets, t_factors, candidates, pairs, difference, product, factor_after,
               out):
    width = candidates.shape[1]
    for p in range(lo, hi):
        if p + PREFETCH_AHEAD < hi:
            ahead = pairs[p + PREFETCH_AHEAD] // width
            _prefetch_row(queries, ahead)
            _prefetch_row(targets, candidates[ahead, pairs[p + PREFETCH_AHEAD] - ahead * width])
        i = pairs[p] // width
        c = pairs[p] - i * width
        j = candidates[i, c]
        if difference is not None:
            out[i, c] = _pair_key(queries, i, q_factors[i], targets, j, t_factors[j], factor_after, difference_sum)
        if product is not None:
            out[i, c] = -_pair_key(queries, i, q_factors[i], targets, j, t_factors[j], factor_after, product_sum)


def best_by_key(keys, candidates, best_key, best_index):
    """Each row's first ``best_key.shape[1]`` candidates by (key, target index), -1 (an empty
    slot) after every target. The rows arrive ordered by float32 score, which the exact keys
    only permute among near-ties: an insertion sort (:func:`_insertion_best`) is then linear;
    the rows with many inversions (exact ties, the float64 search) are sorted by numpy's
    lexsort instead. (A sort compiled by numba cost seconds of compilation in every new
    process, for rows that are rare.)"""
    unsorted = np.zeros(keys.shape[0], np.bool_)
    run_split(_insertion_best, keys.shape[0], *frozen(keys, candidates), best_key, best_index, unsorted)
    rows = np.flatnonzero(unsorted)
    if rows.size:
        index = np.where(candidates[rows] >= 0, candidates[rows], _NO_INDEX)
        order = np.lexsort((index, keys[rows]), axis=1)[:, :best_key.shape[1]]
        best_key[rows] = np.take_along_axis(keys[rows], order, 1)
        chosen = np.take_along_axis(index, order, 1)
        best_index[rows] = np.where(chosen != _NO_INDEX, chosen, -1)


@njit(nogil=True, cache=True)
def _insertion_best(lo, hi, keys, candidates, best_key, best_index, unsorted):
    """:func:`best_by_key` of rows ``lo`` to ``hi`` by insertion sort, given up (``unsorted[i]``
    set, the row's output left for the caller) after 8 x width moves."""
    width = keys.shape[1]
    out_width = best_key.shape[1]
    limit = 8 * width
    big = _NO_INDEX
    row_keys = np.empty(width, keys.dtype)
    row_index = np.empty(width, np.int64)
    for i in range(lo, hi):
        for a in range(width):
            row_keys[a] = keys[i, a]
            row_index[a] = candidates[i, a] if candidates[i, a] >= 0 else big
        moves = 0
        for a in range(1, width):
            key, index = row_keys[a], row_index[a]
            b = a
            while b > 0 and (row_keys[b - 1] > key or (row_keys[b - 1] == key and row_index[b - 1] > index)):
                row_keys[b] = row_keys[b - 1]
                row_index[b] = row_index[b - 1]
                b -= 1
            row_keys[b] = key
            row_index[b] = index
            moves += a - b
            if moves > limit:
                break
        if moves > limit:
            unsorted[i] = True
            continue
        for a in range(out_width):
            best_key[i, a] = row_keys[a]
            best_index[i, a] = row_index[a] if row_index[a] != big else -1


def all_keys(queries, rows, q_factors, targets, t_factors, difference, factor_after, out, threads=None):
    """``out[r, j]``: the exact key of (queries[rows[r]], targets[j]) for every target: the
    float64 search of the rows the sgemm's bound cannot decide."""
    run_split(_all_keys, rows.shape[0], *frozen(queries, rows, q_factors, targets, t_factors), *_key_forms(difference),
              factor_after, out, threads=threads)


@njit(nogil=True, cache=True)
def _all_keys(lo, hi, queries, rows, q_factors, targets, t_factors, difference, product, factor_after, out):
    for r in range(lo, hi):
        i = rows[r]
        for j in range(targets.shape[0]):
            if difference is not None:
                out[r, j] = _pair_key(queries, i, q_factors[i], targets, j, t_factors[j], factor_after,
                                      difference_sum)
            if product is not None:
                out[r, j] = -_pair_key(queries, i, q_factors[i], targets, j, t_factors[j], factor_after, product_sum)


# Merge of partial top-k lists (``merge.merge_topk``): each part's row is already best first.
@njit(nogil=True, cache=True)
def merge_parts(values, indices, bounds, offsets, descending, out_val, out_idx, order, fallback):
    """k-way merge of each row's parts, the column ranges ``bounds[p]:bounds[p + 1]`` of
    ``values`` (float32) and ``indices`` (int64, -1 = empty slot), each best first: by value
    (descending for similarities), ties to the lower index ``indices + offsets[p]``, empty
    slots last; equal pairs keep column order (as a stable sort would).

    Writes the best ``out_val.shape[1]`` of each row: values, global indices (-1 for an
    empty slot) and their columns in ``order``. A row with a NaN value among its valid slots
    or a part out of that order is not merged: ``fallback[i]`` is set, for the caller's sort.
    """
    n_parts = bounds.shape[0] - 1
    width = order.shape[1]
    big = _NO_INDEX
    heads = np.empty(n_parts, np.int64)
    for i in range(values.shape[0]):
        bad = False
        for p in range(n_parts):
            prev_key = -np.inf
            prev_idx = -1
            for j in range(bounds[p], bounds[p + 1]):
                raw = indices[i, j]
                if raw < 0:
                    key = np.inf
                    idx = big
                else:
                    v = values[i, j]
                    key = -v if descending else v
                    idx = raw + offsets[p]
                    bad |= v != v
                bad |= (prev_key > key) | ((prev_key == key) & (prev_idx > idx))
                prev_key = key
                prev_idx = idx
            heads[p] = bounds[p]
        if bad:
            fallback[i] = True
            continue
        for out in range(width):
            best = -1
            best_key = np.inf
            best_idx = big
            for p in range(n_parts):
                j = heads[p]
                if j < bounds[p + 1]:
                    raw = indices[i, j]
                    if raw < 0:
                        key = np.inf
                        idx = big
                    else:
                        key = -values[i, j] if descending else values[i, j]
                        idx = raw + offsets[p]
                    if best < 0 or key < best_key or (key == best_key and idx < best_idx):
                        best, best_key, best_idx = p, key, idx
            j = heads[best]
            heads[best] += 1
            order[i, out] = j
            if best_idx == big:
                out_idx[i, out] = -1
            else:
                out_idx[i, out] = best_idx
            out_val[i, out] = values[i, j]
