"""The "cpu" backend: exact top-k with a fused, tiled sgemm + Numba top-k fold, then an exact
ranking of the candidates in float64 (see :meth:`CpuBackend.run` for the two stages and why
they are exact on every finite input).

Every metric becomes "smallest ``Q' T^T + bias``" on float32 operands (see
:mod:`nearest_kernels._cpu_kernels`): the l2 family searches squared distances between
both blocks shifted by the targets' sample mean (unless the mean is small against the spread)
and scaled by a power of two; inner product searches the queries, scaled by a power of two per
row, against the targets; cosine searches unit rows (normalised in float64). A float32 block
needing neither shift nor scale is multiplied as it is. The candidates are then ranked by keys
computed in float64 from the caller's own rows, in difference form for the l2 family.

Threads follow the caller's share of cores (``threads=``, in Spark ``spark.task.cpus``): the
kernels split their rows over that many threads (``_numba.run_split``) for the whole search,
each calling a single-threaded BLAS on its own tiles, so the process never runs more than
``threads`` busy threads per search; the BLAS setting is restored afterwards.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import numpy as np

from ._common import Metric, check_cap, drop_beyond_cap, heap_width
from ._numba import task_threads  # (chooses numba's cache directory before numba loads)

from threadpoolctl import ThreadpoolController  # noqa: E402

from . import _cpu_kernels  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "TOLERANCE", "CpuBackend"]


def merge_parts(values: np.ndarray, indices: np.ndarray, widths, offsets, k: int, descending: bool):
    """Merge of best-first parts laid side by side (``merge.merge_topk``): a compiled k-way
    merge, GIL released. ``values`` float32 and ``indices`` int64 (rows, sum(widths)), part p
    the next ``widths[p]`` columns, its valid indices shifted by ``offsets[p]``.

    Returns (values, global indices (-1 empty), columns, fallback) with ``min(k, columns)``
    columns each; rows flagged in ``fallback`` (a NaN value, a part out of order) are not
    filled: the caller sorts them.
    """
    values = np.ascontiguousarray(values, dtype=np.float32)
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
    if values.shape != indices.shape or values.ndim != 2 or bounds[-1] != values.shape[1]:
        raise ValueError(f"values, indices: expected (rows, {bounds[-1]}) arrays, got "
                         f"{values.shape} and {indices.shape}")
    rows, width = values.shape[0], min(k, values.shape[1])
    out_val = np.empty((rows, width), np.float32)
    out_idx = np.empty((rows, width), np.int64)
    order = np.empty((rows, width), np.int64)
    fallback = np.zeros(rows, bool)
    _cpu_kernels.merge_parts(values, indices, bounds, np.asarray(offsets, np.int64), bool(descending),
                             out_val, out_idx, order, fallback)
    return out_val, out_idx, order, fallback


# The kernel returns float64 difference-form values of its chosen pairs rounded once to float32
# (see CpuBackend.run). TOLERANCE is in the units of the kernel tests' scale (|q|^2 + |t|^2 for
# squared distances, |q| |t| for inner product, 1 for cosine): the float32 rounding of a value
# is at most 2^-24 of it, and a squared distance is at most twice its scale. RANK_TOLERANCE is
# relative to the size of the shifted problem (``tests/adversarial.key_scale``): candidates are
# ranked by float64 keys, whose rounding is ~d 2^-53 of that size.
TOLERANCE = {"float32": 3e-7, "float64": 3e-7}
RANK_TOLERANCE = 1e-12

# Tile shape. A (1024 x 512) float32 score tile is 2 MiB, one core's L2 on the benchmark
# machine; the per-thread sgemm on it runs near the single-core 4096^3 rate at d = 128 and
# d = 768 (a taller tile serves more queries per packed target tile; with the Haswell sgemm,
# shapes from 512 x 512 to 2048 x 1024 performed alike).
QUERY_TILE = 1024
TARGET_TILE = 512
# Below this many queries per thread, splitting the target range between threads keeps the
# sgemm's M dimension larger than splitting the queries would.
MIN_QUERIES_PER_THREAD = 64
# Target tiles are a multiple of this many rows: a multiple of every sgemm micro-kernel width.
TILE_MULTIPLE = 64
# Query tiles start at multiples of this many rows (of 2, 3, 4, 6, 8, 12, 16, 24), so a row's
# position within the sgemm's micro-kernel rows, and so its rounding, does not depend on the
# number of threads: the candidates, and the work of the exact stage, are then the same.
QUERY_TILE_MULTIPLE = 48
# Unit roundoff of float32 and float64, and float32's subnormal rounding (absolute).
_U32 = 2.0 ** -24
_U64 = 2.0 ** -53
_ETA32 = 2.0 ** -150
# Operand scaling: the shifted targets' largest element lands in [2^-1, 1) (or, for a float32
# block multiplied as it is, anywhere in AS_IS_PEAKS); queries may reach 2^QUERY_HEADROOM
# before the common scale shrinks to fit them (the l2 family), so that no square, product or
# sum of d of them over- or underflows float32 for d < 2^40 (products at most 2^60 each).
QUERY_HEADROOM = 40
AS_IS_PEAKS = (2.0 ** -20, 2.0 ** 20)
# The targets are shifted by their sample mean c unless |c| is below 1/SHIFT_RATIO of the
# sample's spread (root mean square distance from c): the norms would then shrink by less
# than a fraction SHIFT_RATIO^-2 / 2, and the unshifted float32 block can be used as it is.
SHIFT_RATIO = 16
# Rows of the float64 fallback search per chunk bound its (rows x targets) key matrix.
FALLBACK_KEYS = 1 << 23
# An unproven row is searched again keeping every target that can be within its k-th key, up
# to this many (or 4 k); rows per chunk of that search bound its (rows x kept) keys.
COLLECT_WIDTH = 1024
COLLECT_KEYS = 1 << 22


def _power_of_two_scale(peak: np.ndarray) -> np.ndarray:
    """2^-e with 2^(e-1) <= peak < 2^e (elementwise), 1 where peak is 0: an exact scaling."""
    peak = np.asarray(peak, dtype=np.float64)
    _, exponent = np.frexp(np.where(peak > 0, peak, 1.0))
    return np.where(peak > 0, np.ldexp(1.0, -exponent), 1.0)


def default_threads() -> int:
    """This process's share of cores: the CPUs it may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_threads(threads) -> int:
    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise ValueError(f"threads: expected an integer >= 1, got {threads!r}")
    return int(threads)


_blas: ThreadpoolController | None = None


def blas_controller() -> ThreadpoolController:
    """The BLAS libraries of this process, found once.

    Scanning the loaded libraries costs ~1 ms, as much as a small search; a BLAS loaded later
    is not controlled, and needs not be: the kernel calls scipy's BLAS (numba's ``np.dot``
    binds to ``scipy.linalg.cython_blas``), which is loaded here first.
    """
    global _blas
    if _blas is None:
        import scipy.linalg.cython_blas  # noqa: F401

        _blas = ThreadpoolController().select(user_api="blas")
    return _blas


@contextmanager
def thread_limits(threads: int):
    """Split the kernels' rows over ``threads`` threads and run BLAS on one, restoring the
    BLAS setting on exit.

    BLAS gets one thread because each kernel thread calls it on its own tile; a multithreaded
    BLAS inside would oversubscribe the caller's share of cores.
    """
    with task_threads(threads), blas_controller().limit(limits=1):
        yield threads


def plan_tiles(nq: int, nt: int, threads: int) -> tuple[int, int, int]:
    """(query_tile, target_tile, n_split): the work split of one search.

    Items are (query tile, target split) pairs run one per thread. With enough queries, the
    query tiles are resized so that their number is about a multiple of ``threads`` (equal
    work per thread under numba's static schedule), rounded up to ``QUERY_TILE_MULTIPLE``
    rows (results then do not depend on ``threads``); with few queries, one query tile and
    the target tiles are split between threads instead. The target tile is a multiple of
    ``TILE_MULTIPLE`` (see ``_cpu_kernels.search_tiles`` for why every call has one shape).
    """
    target_tile = min(TARGET_TILE, -(-nt // TILE_MULTIPLE) * TILE_MULTIPLE)
    n_ttiles = -(-nt // target_tile)
    if nq >= MIN_QUERIES_PER_THREAD * threads:
        rounds = -(-nq // (QUERY_TILE * threads))
        query_tile = -(-nq // (rounds * threads))
        query_tile = -(-query_tile // QUERY_TILE_MULTIPLE) * QUERY_TILE_MULTIPLE
        return query_tile, target_tile, 1
    return nq, target_tile, max(1, min(threads, n_ttiles))


class _Operands:
    """The sgemm's operands and what relates its scores to the exact keys (see CpuBackend.run).

    ``scaled`` (nq, d) float32 = alpha a, ``targets32`` (nt, d) float32 = b, ``bias`` (nt,)
    float32: a score is ``scaled . b + bias``. ``offset`` (nq,) float64: score + offset
    approximates the exact key, within ``margin`` (nq,) float64 (a proven bound). The exact
    key of (i, j) is computed from the caller's rows ``queries[i] * q_factors[i]`` and
    ``targets[j] * t_factors[j]`` (``difference`` form or negated product); ``unscale``
    turns keys back into the metric's units.
    """

    def __init__(self, queries: np.ndarray, targets: np.ndarray, metric: Metric,
                 defer_target_stats: bool = False):
        d = queries.shape[1]
        self.queries = np.ascontiguousarray(queries)
        self.targets = np.ascontiguousarray(targets)
        nq, nt = self.queries.shape[0], self.targets.shape[0]
        self.difference = metric.name != "inner_product"
        if metric.name == "cosine":
            q_unit = _cpu_kernels.inverse_norms(self.queries)
            t_unit = _cpu_kernels.inverse_norms(self.targets)
        else:
            q_unit, t_unit = np.ones(nq), np.ones(nt)
        center, spread = _cpu_kernels.sample_center(self.targets, t_unit)
        if float(center @ center) * SHIFT_RATIO ** 2 <= spread:
            center = np.zeros(d)    # a shift this small would not shrink the operands
        # A float32 block that needs neither a shift nor a scale is multiplied as it is: one
        # read for its norms instead of a shifted, scaled copy. For inner product the bound
        # needs only the block's largest norm and element, and only after the search: with
        # ``defer_target_stats`` the search takes them from each tile it has just multiplied,
        # the block is not read for them, and :meth:`finish` completes the bound.
        as_is = metric.name != "cosine" and self.targets.dtype == np.float32 and not center.any()
        self.deferred = as_is and defer_target_stats and not self.difference
        b_sq = np.zeros(nt)
        t_peak = 0.0
        if self.deferred:
            pass
        elif as_is:
            t_peaks = _cpu_kernels.row_peaks(self.targets, np.ones(nt), np.zeros(d), out_sq=b_sq)
            t_peak = float(t_peaks.max(initial=0.0))
            as_is = AS_IS_PEAKS[0] <= t_peak < AS_IS_PEAKS[1]
        else:
            t_peak = float(_cpu_kernels.row_peaks(self.targets, t_unit, center).max(initial=0.0))
        t_scale = 1.0 if as_is else float(_power_of_two_scale(t_peak))
        if self.difference:
            # a = s (q - c), b = s (t - c): |a - b|^2 = s^2 |q - t|^2 exactly, whatever c;
            # c near the targets makes the expansion see the spread, not the offset.
            q_peaks = _cpu_kernels.row_peaks(self.queries, q_unit, center)
            scale = min(t_scale, float(_power_of_two_scale(q_peaks.max(initial=0.0))) * 2.0 ** QUERY_HEADROOM)
            as_is = as_is and scale == t_scale
            q_scales = np.full(nq, scale)
            q_shift, t_scales = center, np.full(nt, scale)
        else:
            # a = s_i q (a power of two per row), b = s (t - c): a . b = s_i s (q . t - q . c),
            # and q . c is constant along the row: the ranking is that of q . t.
            q_peaks = _cpu_kernels.row_peaks(self.queries, q_unit, np.zeros(d))
            q_scales = _power_of_two_scale(q_peaks)
            q_shift, t_scales = np.zeros(d), np.full(nt, t_scale)
        a = np.empty(self.queries.shape, np.float32)
        a_sq = np.empty(nq)
        _cpu_kernels.shift_scale(self.queries, q_unit, q_shift, q_scales, a, a_sq)
        if as_is:
            self.targets32 = self.targets
        else:
            targets32 = np.empty(self.targets.shape, np.float32)
            _cpu_kernels.shift_scale(self.targets, t_unit, center, t_scales, targets32, b_sq)
            self.targets32 = targets32
        self.q_factors = q_unit * q_scales
        self.t_factors = t_unit * t_scales
        # Powers of two (no unit factors) on float32 rows: applied once to each key's sum.
        self.factor_after = metric.name != "cosine" and \
            self.queries.dtype == np.float32 and self.targets.dtype == np.float32
        shift = float(np.sqrt((center * center).sum()))
        if self.difference:
            self.scaled = a * np.float32(-2.0)        # a power of two: exact
            self.bias = b_sq.astype(np.float32)
            self.offset = a_sq
        else:
            self.scaled = -a
            self.bias = np.zeros(nt, np.float32)
            # offset = -(q s_i) . (c s): exact key = -(a . b) + offset
            if center.any():
                self.offset = -(np.asarray(self.queries, np.float64) @ center) * self.q_factors * t_scale
            else:
                self.offset = np.zeros(nq)
        self._bound_inputs = (d, q_peaks, q_scales, t_scale, shift, a_sq)
        if not self.deferred:
            self._bound(float(b_sq.max(initial=0.0)), t_peak)
        # The cap's key: the largest key (this row's units) whose value is within the cap,
        # and the rounding of that translation (absolute, in keys): a relative 2^-40 of the
        # key, and for cosine of the key of 1 - cap (which cancels when the cap is near 1).
        if metric.name == "l2":
            self._cap_key = lambda cap: np.full(nq, (cap * scale) ** 2 if cap >= 0 else -1.0)  # keys >= 0
        elif metric.name == "sqeuclidean":
            self._cap_key = lambda cap: np.full(nq, cap * scale * scale)
        elif metric.name == "cosine":
            self._cap_key = lambda cap: np.full(nq, 2.0 * scale * scale * (1.0 - cap))
        else:
            self._cap_key = lambda cap: -cap * q_scales * t_scale
        self._cap_unit = 2.0 * scale * scale if metric.name == "cosine" else 0.0
        if metric.name == "l2":
            self.values = lambda keys: np.sqrt(keys) / scale
        elif metric.name == "sqeuclidean":
            self.values = lambda keys: keys / (scale * scale)
        elif metric.name == "cosine":
            self.values = lambda keys: 1.0 - keys / (2.0 * scale * scale)
        else:
            self.values = lambda keys: -keys / (q_scales[:, None] * t_scale)

    def finish(self, stats: np.ndarray) -> bool:
        """Complete a deferred bound from the search's per-item (largest squared norm,
        largest element) of the targets, ``stats`` (items, 2). False when the block was not
        fit to be multiplied as it is (an element outside ``AS_IS_PEAKS``): the scores are
        then void, and the search must run again on operands built without deferring."""
        t_peak = float(stats[:, 1].max(initial=0.0))
        if not AS_IS_PEAKS[0] <= t_peak < AS_IS_PEAKS[1]:
            return False
        self._bound(float(stats[:, 0].max(initial=0.0)), t_peak)
        self.deferred = False
        return True

    def _bound(self, b_sq_max: float, t_peak: float) -> None:
        """``margin``: each row's proven bound on |score + offset - exact key|."""
        d, q_peaks, q_scales, t_scale, shift, a_sq = self._bound_inputs
        # Norm bounds of the exact shifted rows: the float32 ones, their rounding (relative
        # u32, float32 subnormals absolute) and the float64 shift's rounding (relative to the
        # unshifted magnitude, at most the shifted one plus |c|).
        q_raw = (q_peaks * np.sqrt(d) + shift) * q_scales
        t_raw = (t_peak * np.sqrt(d) + shift) * t_scale
        q_err = _U32 * np.sqrt(a_sq) + 4 * _U64 * (q_raw + shift * q_scales) + np.sqrt(d) * _ETA32
        t_err = _U32 * np.sqrt(b_sq_max) + 4 * _U64 * (t_raw + shift * t_scale) + np.sqrt(d) * _ETA32
        A = np.sqrt(a_sq) + q_err
        B = float(np.sqrt(b_sq_max)) + t_err
        n_u = (d + 2) * 2 * _U32
        gamma = n_u / (1 - n_u)     # the sgemm's d-term sums, at twice the unit roundoff
        tiny = d * 2.0 ** -147       # underflowing products
        keys64 = (d + 4) * 2 * _U64  # the exact keys' and offsets' float64 sums
        if self.difference:
            e = q_err + t_err
            margin = (2 * (A + B) * e + e * e                 # rounding the operands
                      + 2 * gamma * A * B + tiny               # the sgemm
                      + 2 * _U32 * B * B                       # the bias, and adding it
                      + _U32 * (B * B + 2 * A * B)
                      + keys64 * (A + B) ** 2)                 # |a|^2 and the exact key
        else:
            c_scaled = shift * t_scale
            margin = (q_err * B + A * t_err + q_err * t_err    # rounding the operands
                      + gamma * A * B + tiny                   # the sgemm
                      + keys64 * A * (B + c_scaled + t_err))   # the offset and the exact key
        self.margin = 1.25 * margin

    def cap_keys(self, cap: float) -> np.ndarray:
        """(nq,) float64: a key above which no target is within ``cap`` (its value's units):
        the cap's key, rounded outwards."""
        keys = self._cap_key(cap)
        return keys + 2.0 ** -40 * (np.abs(keys) + self._cap_unit)

    def exact_keys(self, candidates: np.ndarray, needed: np.ndarray, rows=None) -> np.ndarray:
        """float64 keys of each row's ``needed`` candidates (+inf elsewhere and for -1); with
        ``rows``, candidates' row r is query ``rows[r]``."""
        out = np.full(candidates.shape, np.inf)
        queries, q_factors = self.queries, self.q_factors
        if rows is not None:
            queries, q_factors = np.ascontiguousarray(queries[rows]), q_factors[rows]
        pairs = _cpu_kernels.pairs_by_target(candidates, needed, self.targets.shape[0])
        _cpu_kernels.pair_keys(queries, q_factors, self.targets, self.t_factors,
                               candidates, pairs, self.difference, self.factor_after, out)
        return out

    def collect_rows(self, rows: np.ndarray, bounds: np.ndarray, width: int, threads: int):
        """(keys, indices, overflow) for unproven ``rows``: each row's best ``width`` by (key,
        index) among every target whose score can be within its key bound ``bounds`` (the
        k-th key found, or a cap's), from one more float32 search that keeps all of them;
        ``overflow`` lists the rows (positions in ``rows``) with more such targets than it
        keeps, whose answer is not set.

        A target left out scored above ``bound - offset + margin``, so its exact key is above
        the bound: the rows' top ``width`` are among those kept. Exact ties at the k-th place
        (integer data) and near ties the float32 scores cannot separate are settled here; only
        a row with thousands of such targets needs the float64 search of every target.
        """
        nt = self.targets.shape[0]
        collect = min(nt, max(COLLECT_WIDTH, 4 * width))
        keys = np.full((rows.shape[0], width), np.inf)
        best = np.full((rows.shape[0], width), -1, dtype=np.int64)
        overflow = []
        limit = _cpu_kernels.cap_key(bounds - self.offset[rows] + self.margin[rows])
        chunk = max(1, COLLECT_KEYS // collect)
        for start in range(0, rows.shape[0], chunk):
            part = rows[start:start + chunk]
            heaps, _ = _search(self, collect, *plan_tiles(part.shape[0], nt, threads),
                               start=limit[start:start + chunk],
                               scaled=np.ascontiguousarray(self.scaled[part]))
            _, kept = _cpu_kernels.decode(heaps)
            full = (kept != _cpu_kernels.EMPTY_INDEX).all(axis=2).any(axis=0)
            _, cand = _cpu_kernels.decode(np.concatenate(list(heaps), axis=1))
            cand = np.where(cand != _cpu_kernels.EMPTY_INDEX, cand, -1).astype(np.int64)
            exact = self.exact_keys(cand, np.ones(cand.shape, dtype=bool), rows=part)
            part_key = np.empty((part.shape[0], width))
            part_best = np.empty((part.shape[0], width), dtype=np.int64)
            _cpu_kernels.best_by_key(exact, cand, part_key, part_best)
            keys[start:start + chunk], best[start:start + chunk] = part_key, part_best
            overflow.extend(start + np.flatnonzero(full))
        return keys, best, np.asarray(overflow, dtype=np.int64)

    def search_rows(self, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, indices) of these rows' ``width`` best of every target by (key, index):
        the float64 search, in chunks of rows."""
        nt = self.targets.shape[0]
        keys = np.empty((rows.shape[0], width))
        best = np.empty((rows.shape[0], width), dtype=np.int64)
        chunk = max(1, FALLBACK_KEYS // max(1, nt))
        for start in range(0, rows.shape[0], chunk):
            part = np.ascontiguousarray(rows[start:start + chunk], dtype=np.int64)
            row_keys = np.empty((part.shape[0], nt))
            _cpu_kernels.all_keys(self.queries, part, self.q_factors, self.targets, self.t_factors,
                                  self.difference, self.factor_after, row_keys)
            for r in range(part.shape[0]):
                row = row_keys[r]
                kth = np.partition(row, width - 1)[width - 1]
                near = np.flatnonzero(row <= kth)
                near = near[np.lexsort((near, row[near]))][:width]
                keys[start + r], best[start + r] = row[near], near
        return keys, best


def _scipy_blas_missing() -> str | None:
    try:
        import scipy.linalg.cython_blas  # noqa: F401  (numba's np.dot binds to these)
    except ImportError as exc:
        return f"needs scipy for numba's BLAS binding (np.dot in nopython mode): {exc}"
    return None


class CpuBackend:
    """Fused tiled-sgemm + Numba top-k, exact float64 ranking, any k (see the module docstring)."""

    name = "cpu"
    devices = ("cpu",)
    dtypes = ("float32", "float64")
    metrics = ("l2", "sqeuclidean", "inner_product", "cosine")
    # Any k: heaps are min(k, nt) wide; memory is that of the (nq, k) result plus
    # 8 B x nq x min(k, nt) per target split.
    max_k = None

    def refuse_task(self) -> str | None:
        """Why no search of this process can run here (scipy's BLAS missing), or None."""
        return _scipy_blas_missing()

    def refuse(self, queries, targets, k, metric: Metric, **options) -> str | None:
        """None when the backend accepts the call, else why it does not."""
        if metric.name not in self.metrics:
            return f"metric {metric.name!r} not supported"
        if targets.shape[0] >= _cpu_kernels.EMPTY_INDEX:
            return f"at most {_cpu_kernels.EMPTY_INDEX - 1} targets per call (32-bit heap index)"
        return _scipy_blas_missing()

    caps = True     # takes knn's ``cap`` option

    def run(self, queries, targets, k, metric: Metric, threads=None, cap=None, **options):
        """Top-k of clean rows (the dispatcher removed rows that cannot rank).

        ``threads`` (int >= 1): threads to use; default: the CPUs this process may run on.
        ``cap``: only targets whose value is within it (inclusive: a distance ``<= cap``, a
        similarity ``>= cap``) rank; a row may then have fewer than k. Other options
        (``precision``, ``device``) are for other backends and are ignored.

        Two stages, exact by construction for every finite input:

        1. Candidates. Both blocks are shifted by the targets' mean (l2, sqeuclidean; cosine
           on unit vectors) or the targets alone (inner product: the shift adds a constant per
           query), scaled by powers of two so that nothing over- or underflows, and rounded
           to float32; the fused sgemm + heap search keeps each row's ``heap_width`` best by
           float32 score. The shift makes the expansion's error scale with the spread of the
           data, not with its offset from the origin.
        2. Exact ranking. The candidates' keys are computed in float64 from the caller's rows,
           in difference form (:func:`_cpu_kernels.pair_keys`), and ranked by (key, index).
           A row is proven when its last kept score, less the bound on the sgemm's error for
           that row (``_Operands.margin``: from the shifted norms, d and float32's rounding),
           is above its k-th key: no target outside the heap can rank or tie in the top k.
           The rows it cannot prove (exact ties at the k-th place, nearly parallel vectors
           the float32 sgemm cannot separate) are searched again, keeping every target whose
           score can be within their k-th key (``_Operands.collect_rows``), and ranked by
           exact keys; a row with more such targets than that search keeps is searched in
           float64 against every target. No decision depends on which sgemm kernel the BLAS
           library picked.

        Under a cap, the heaps start full of the cap's key (``_cpu_kernels.cap_key``): the
        largest score that can belong to a target within the cap, i.e. the cap's key less the
        row's offset plus its proven bound, so nothing within the cap is pruned and nothing
        beyond it far enough to be proven enters. After the exact ranking the candidates
        beyond the cap are dropped; a row is proven when its floor is above its k-th key or
        above the cap's key (no target outside the heap is then within the cap).
        """
        threads = check_threads(threads)
        cap = check_cap(cap)
        nq, nt = queries.shape[0], targets.shape[0]
        width = min(k, nt)
        with thread_limits(threads) as used:
            query_tile, target_tile, n_split = plan_tiles(nq, nt, used)
            kept = heap_width(k, nt)
            # Uncapped, an inner product's bound can wait for the search (see _Operands).
            ops = _Operands(queries, targets, metric, defer_target_stats=cap is None)
            start = None
            if cap is not None:
                cap_keys = ops.cap_keys(cap)
                start = _cpu_kernels.cap_key(cap_keys - ops.offset + ops.margin)
            heaps, stats = _search(ops, kept, query_tile, target_tile, n_split, start=start)
            if ops.deferred and not ops.finish(stats):    # (deferred only when uncapped)
                ops = _Operands(queries, targets, metric)
                heaps, _ = _search(ops, kept, query_tile, target_tile, n_split)
            # Sorting the keys orders each row by (score, index). With several target
            # splits, the best of their union is the first ``kept``.
            keys = heaps[0] if n_split == 1 else np.concatenate(list(heaps), axis=1)
            scores, best_key, best_i = _rank_exactly(ops, np.sort(keys, axis=1)[:, :kept], width)
            if kept < nt:
                floor = scores[:, -1].astype(np.float64) + ops.offset - ops.margin
                bound = best_key[:, -1] if cap is None else np.minimum(best_key[:, -1], cap_keys)
                unproven = np.flatnonzero(~(floor > bound))
                scanned = unproven[:0]
                if len(unproven):
                    keys_u, best_u, overflow = ops.collect_rows(unproven, bound[unproven], width, used)
                    settled = np.setdiff1d(np.arange(len(unproven)), overflow)
                    best_key[unproven[settled]], best_i[unproven[settled]] = keys_u[settled], best_u[settled]
                    scanned = unproven[overflow]
                    if len(scanned):
                        best_key[scanned], best_i[scanned] = ops.search_rows(scanned, width)
            else:
                unproven = scanned = ()
        logger.debug("cpu knn nq=%d nt=%d k=%d threads=%d tiles=(%d, %d) splits=%d collected rows=%d "
                     "float64 rows=%d", nq, nt, k, used, query_tile, target_tile, n_split, len(unproven),
                     len(scanned))
        return _result(ops, best_key, best_i, k, cap, metric)


def _rank_exactly(ops: _Operands, sorted_keys: np.ndarray, width: int):
    """(scores, keys, indices): each row's candidates (heap keys sorted, best first) decoded,
    and its best ``width`` by (exact float64 key, index); the exact stage of
    :meth:`CpuBackend.run` and of :func:`knn_probed_rows`."""
    scores, cand = _cpu_kernels.decode(sorted_keys)
    cand = np.where(cand != _cpu_kernels.EMPTY_INDEX, cand, -1).astype(np.int64)
    # Only candidates whose score is within twice the bound of the k-th score can rank
    # (key >= score + offset - margin > k-th score + offset + margin >= the k-th key); the
    # others keep +inf, and so never rank.
    needed = ~(scores > scores[:, width - 1:width] + 2 * ops.margin[:, None])
    best_key = np.empty((cand.shape[0], width))
    best_i = np.empty((cand.shape[0], width), dtype=np.int64)
    _cpu_kernels.best_by_key(ops.exact_keys(cand, needed), cand, best_key, best_i)
    return scores, best_key, best_i


def _result(ops: _Operands, best_key: np.ndarray, best_i: np.ndarray, k: int, cap, metric: Metric):
    """knn's (values, indices) of each row's best keys: the metric's values, the cap applied,
    padded to k with the metric's worst value and -1."""
    nq, width = best_key.shape
    values = np.full((nq, k), metric.worst, dtype=np.float32)
    indices = np.full((nq, k), -1, dtype=np.int64)
    best_values, best_i = drop_beyond_cap(ops.values(best_key), best_i, cap, metric)
    with np.errstate(over="ignore"):   # beyond float32's range reads +-inf (documented)
        values[:, :width] = best_values
    indices[:, :width] = best_i
    return values, indices


def _search(ops: _Operands, kept: int, query_tile: int, target_tile: int, n_split: int,
            start: np.ndarray | None = None, scaled: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The fused search of ``scaled`` (default: all of ``ops.scaled``; else some of its rows)
    against ``ops``' targets: (n_split, rows, kept) heaps of each split's best keys per row,
    starting from each row's key in ``start`` (a limit: nothing at or above it enters) or
    empty, and the targets' stats it took for inner product (else empty; deferred operands' ``finish``)."""
    scaled = ops.scaled if scaled is None else scaled
    nq = scaled.shape[0]
    tail, tail_bias = _tail_tile(ops.targets32, ops.bias, target_tile)
    heaps = np.full((n_split, nq, kept), _cpu_kernels.EMPTY_KEY, dtype=np.uint64)
    if start is not None:
        heaps[:] = start[None, :, None]
    # Stats for every inner product search, deferred or not (one more read of each target, in
    # cache): one compiled search for the metric instead of two, whichever way it is prepared.
    items = -(-nq // query_tile) * n_split if not ops.difference else 0
    stats = np.zeros((items, 2))
    _cpu_kernels.search_tiles(scaled, ops.targets32, ops.bias, tail, tail_bias, heaps, query_tile, stats)
    return heaps, stats


def _tail_tile(targets: np.ndarray, bias: np.ndarray, target_tile: int):
    """The last, partial target tile padded to ``target_tile`` rows (zeros, bias +inf)."""
    start = targets.shape[0] // target_tile * target_tile
    tail = np.zeros((target_tile, targets.shape[1]), dtype=np.float32)
    tail_bias = np.full(target_tile, np.inf, dtype=np.float32)
    tail[: targets.shape[0] - start] = targets[start:]
    tail_bias[: targets.shape[0] - start] = bias[start:]
    return tail, tail_bias


BACKEND = CpuBackend()


# ------------------------------------------------------------------------ probed segments
def segment_members(probe_starts: np.ndarray, probe_segments: np.ndarray, rows: np.ndarray,
                    n_segments: int) -> tuple[np.ndarray, np.ndarray]:
    """The probes of query ``rows`` by segment, CSR: segment ``s`` is probed by
    ``rows[members[member_starts[s]:member_starts[s + 1]]]`` (positions in ``rows``, ascending)."""
    counts = probe_starts[rows + 1] - probe_starts[rows]
    firsts = np.cumsum(counts) - counts
    at = np.repeat(probe_starts[rows] - firsts, counts) + np.arange(counts.sum(), dtype=np.int64)
    segments = probe_segments[at]
    owners = np.repeat(np.arange(rows.shape[0], dtype=np.int64), counts)
    order = np.argsort(segments, kind="stable")
    member_starts = np.searchsorted(segments[order], np.arange(n_segments + 1)).astype(np.int64)
    return owners[order], member_starts


def segment_tile(rows):
    """The target tile of a probed search's segment of ``rows`` rows (an int, or an array of
    segments' row counts and their tiles): its rows in the fewest
    tiles of at most ``TARGET_TILE``, each the least multiple of ``TILE_MULTIPLE`` that holds
    an equal share (a 320-row list is one 320-row tile, a 600-row one two of 320), so that
    a segment pads fewer than ``TILE_MULTIPLE`` rows per tile. Each segment takes its own:
    exactness does not rest on the scores' rounding (the exact stage ranks what they leave
    in doubt, ties included: ``knn_probed_rows``), and at a given column a tile's width, a
    multiple of ``TILE_MULTIPLE``, does not change a pair's float32 score under either
    OpenBLAS kernel selection (measured; a query tile below four rows does, which segments
    probed by few queries already get, and Haswell's kernels round by column)."""
    parts = -(-np.maximum(rows, 1) // TARGET_TILE)
    return -(-(-(-rows // parts)) // TILE_MULTIPLE) * TILE_MULTIPLE


def probed_heaps(ops: _Operands, rows: np.ndarray, members: np.ndarray, member_starts: np.ndarray,
                 segment_starts: np.ndarray, kept: int, start: np.ndarray | None, threads: int) -> np.ndarray:
    """(len(rows), kept) max-heaps of each query row's best keys over the rows of the
    segments it probes (:func:`segment_members` of ``rows``): the fused sgemm search of each
    segment (in its own tiles, :func:`segment_tile`) against the queries that probe it, all
    segments in one call (``_cpu_kernels.probed_tiles``), each thread folding into the heaps
    of its own queries (keys hold the block's target indices). ``start``: each row's limit
    key, as :func:`_search`'s."""
    heaps = np.full((rows.shape[0], kept), _cpu_kernels.EMPTY_KEY, dtype=np.uint64)
    if start is not None:
        heaps[:] = start[:, None]
    sizes = np.diff(segment_starts)
    tiles = segment_tile(sizes).astype(np.int64)
    # Each thread's positions: contiguous, of about equal work (probed rows).
    probes = np.diff(member_starts)
    owner_work = np.bincount(members, weights=np.repeat(sizes, probes), minlength=rows.shape[0])
    cumulative = np.cumsum(owner_work)
    parts = max(1, min(threads, rows.shape[0]))
    bounds = np.searchsorted(cumulative, cumulative[-1] * np.arange(1, parts) / parts, side="right") \
        if rows.shape[0] else np.zeros(0, np.int64)
    bounds = np.concatenate([[0], bounds, [rows.shape[0]]]).astype(np.int64)
    _cpu_kernels.probed_tiles(ops.scaled, rows.astype(np.int64, copy=False), members, member_starts,
                              segment_starts.astype(np.int64, copy=False), tiles, ops.targets32, ops.bias,
                              heaps, bounds, QUERY_TILE, threads=parts)
    return heaps


def knn_probed_rows(queries: np.ndarray, targets: np.ndarray, segment_starts: np.ndarray,
                    probe_starts: np.ndarray, probe_segments: np.ndarray, k: int, metric: Metric,
                    threads: int, cap: float | None) -> tuple[np.ndarray, np.ndarray]:
    """``segments.knn_probed`` on clean rows (it removes the rows that cannot rank): each
    query row's top k among the rows of its probed segments.

    :meth:`CpuBackend.run`'s two stages, with the candidate stage run segment by segment:
    the operands are set up once for the whole block (a shift and scale any subset of the
    block keeps exact), each segment is searched by the fused sgemm for the queries that
    probe it (:func:`probed_heaps`), and each query's one heap collects its candidates over
    all its segments. The exact ranking, the proof and its fallbacks then run once per query,
    as in ``run``, over the probed rows only: a row is proven when its heap holds every row
    it probes or its floor is above its k-th key; the others collect every probed target
    within their bound, and a row with more of them than that search keeps is ranked in
    float64 against every row it probes. The work is that of one wide search over the
    probed pairs, not one search per segment.
    """
    nq, nt = queries.shape[0], targets.shape[0]
    n_segments = segment_starts.shape[0] - 1
    width = min(k, nt)
    with thread_limits(threads) as used:
        ops = _Operands(queries, targets, metric)
        everyone = np.arange(nq, dtype=np.int64)
        members, member_starts = segment_members(probe_starts, probe_segments, everyone, n_segments)
        sizes = np.diff(segment_starts)
        owners = np.repeat(everyone, np.diff(probe_starts))
        probed = np.bincount(owners, weights=sizes[probe_segments], minlength=nq).astype(np.int64)
        kept = heap_width(k, nt)
        start = cap_keys = None
        if cap is not None:
            cap_keys = ops.cap_keys(cap)
            start = _cpu_kernels.cap_key(cap_keys - ops.offset + ops.margin)
        heaps = probed_heaps(ops, everyone, members, member_starts, segment_starts, kept, start, used)
        scores, best_key, best_i = _rank_exactly(ops, np.sort(heaps, axis=1), width)
        floor = scores[:, -1].astype(np.float64) + ops.offset - ops.margin
        bound = best_key[:, -1] if cap is None else np.minimum(best_key[:, -1], cap_keys)
        unproven = np.flatnonzero(~(floor > bound) & (probed > kept))
        if unproven.size:
            collect = int(min(probed[unproven].max(), max(COLLECT_WIDTH, 4 * width)))
            limit = _cpu_kernels.cap_key(bound[unproven] - ops.offset[unproven] + ops.margin[unproven])
            chunk = max(1, COLLECT_KEYS // collect)
            for first in range(0, unproven.shape[0], chunk):
                part = unproven[first:first + chunk]
                m, m_starts = segment_members(probe_starts, probe_segments, part, n_segments)
                heaps = probed_heaps(ops, part, m, m_starts, segment_starts, collect,
                                     limit[first:first + chunk], used)
                _, found = _cpu_kernels.decode(heaps)
                overflow = (found != _cpu_kernels.EMPTY_INDEX).all(axis=1) & (probed[part] > collect)
                found = np.where(found != _cpu_kernels.EMPTY_INDEX, found, -1).astype(np.int64)
                part_key = np.empty((part.shape[0], width))
                part_best = np.empty((part.shape[0], width), dtype=np.int64)
                _cpu_kernels.best_by_key(ops.exact_keys(found, found >= 0, rows=part), found, part_key,
                                         part_best)
                best_key[part], best_i[part] = part_key, part_best
                for row in part[overflow]:
                    best_key[row], best_i[row] = _probed_float64(ops, row, probe_starts, probe_segments,
                                                                 segment_starts, width)
    return _result(ops, best_key, best_i, k, cap, metric)


def _probed_float64(ops: _Operands, row: int, probe_starts: np.ndarray, probe_segments: np.ndarray,
                    segment_starts: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, indices) of query ``row``'s best ``width`` by (key, index) among every row of
    its segments, from float64 keys: the probed search's last resort (thousands of targets
    tied within the bound)."""
    segments = probe_segments[probe_starts[row]:probe_starts[row + 1]]
    candidates = np.concatenate([np.arange(segment_starts[s], segment_starts[s + 1]) for s in segments])
    candidates = np.sort(candidates).astype(np.int64)[None]
    keys = np.empty((1, width))
    best = np.empty((1, width), dtype=np.int64)
    rows = np.array([row], dtype=np.int64)
    _cpu_kernels.best_by_key(ops.exact_keys(candidates, np.ones(candidates.shape, bool), rows=rows),
                             candidates, keys, best)
    return keys[0], best[0]
