"""The "cpu" backend: exact top-k with a fused, tiled sgemm + Numba top-k fold.

Computation happens in float32 whatever the input dtype (float64 input is cast once), on
C-contiguous copies made only when the input is not already float32 C-contiguous. Every metric
becomes "smallest ``Q' T^T + bias``" (see :mod:`nearest_join.kernels._cpu_kernels`):

- ``sqeuclidean``: Q' = -2 q, bias = |t|^2, so the score is |q - t|^2 - |q|^2. |q|^2 is the same
  for a whole row and is added back only to the k survivors, then clamped at 0 (rounding can
  make a tiny distance negative); ``l2`` also takes the square root of the survivors only.
- ``inner_product``: Q' = -q, bias = 0; the value is the negated score.
- ``cosine``: both sides are normalised in float64, then rounded to float32, and searched as
  inner product. Normalising first (rather than dividing by norms at the end) is required for
  the ranking, which the target norm changes; it also keeps values within a few float32 ulps of
  the exact cosine, and costs one pass over the data.

Threads follow the caller's share of cores (``threads=``, in Spark ``spark.task.cpus``): numba
runs that many threads for the whole search, each calling a single-threaded BLAS on its own
tiles, so the process never runs more than ``threads`` busy threads; both settings are restored
afterwards.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
from contextlib import contextmanager

import numpy as np

from ._common import Metric


def _ensure_numba_cache_dir() -> None:
    """Point numba's cache at a writable directory when the package directory is not one.

    numba caches next to the source file by default. On executors the package often lives in a
    read-only site-packages; without a writable cache every Spark task would recompile (seconds).
    Must run before numba compiles the kernels; an explicit NUMBA_CACHE_DIR always wins.
    """
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    if os.access(here, os.W_OK):
        return
    for candidate in (
        os.path.join(os.path.expanduser("~"), ".cache", "nearest_join", "numba"),
        os.path.join(tempfile.gettempdir(), f"nearest_join-numba-{os.getuid()}"),
    ):
        try:
            os.makedirs(candidate, exist_ok=True)
        except OSError:
            continue
        if os.access(candidate, os.W_OK):
            os.environ["NUMBA_CACHE_DIR"] = candidate
            if "numba" in sys.modules:  # already imported: config was read, set it directly
                sys.modules["numba"].config.CACHE_DIR = candidate
            return


_ensure_numba_cache_dir()

import numba  # noqa: E402  (after the cache directory is chosen)
from threadpoolctl import ThreadpoolController  # noqa: E402

from . import _cpu_kernels  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "TOLERANCE", "CpuBackend", "take_rows", "take_rows_at"]


def take_rows(matrix: np.ndarray, rows: np.ndarray, out: np.ndarray, threads: int = 1) -> bool:
    """``out[:] = matrix[rows]`` (2-D, same dtype), GIL released.

    ``threads`` > 1 runs the copy on numba's threads when concurrent parallel calls are safe
    (see :func:`parallel_calls_threadsafe`: the CPU search may run parallel kernels on
    another thread at the same time) and returns True; otherwise copies on this thread and
    returns False only if ``threads`` > 1 was asked for, so that the caller can split the
    rows over its own threads instead (``udfs.rows``). Indices are checked here: the
    compiled loops do not bounds-check.
    """
    if rows.shape[0] != out.shape[0] or matrix.shape[1:] != out.shape[1:] or matrix.dtype != out.dtype:
        raise ValueError(f"take_rows: shapes {matrix.shape} -> {out.shape} (dtypes {matrix.dtype}, "
                         f"{out.dtype}) do not match {rows.shape[0]} rows")
    if rows.shape[0] == 0:
        return True
    lo, hi = int(rows.min()), int(rows.max())
    if lo < 0 or hi >= matrix.shape[0]:
        raise IndexError(f"take_rows: row {lo if lo < 0 else hi} outside 0..{matrix.shape[0] - 1}")
    rows = np.asarray(rows, dtype=np.int64)
    return _run_copy(_cpu_kernels.take_rows, _cpu_kernels.take_rows_parallel, (matrix, rows, out), threads)


def _run_copy(serial, parallel, args: tuple, threads: int) -> bool:
    """Run a compiled copy on this thread, or on ``threads`` of numba's threads where
    concurrent parallel calls are safe (else return False: the caller splits the work)."""
    if threads > 1:
        if not parallel_calls_threadsafe():
            return False
        previous = numba.get_num_threads()   # per calling thread in numba
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            parallel(*args)
        finally:
            numba.set_num_threads(previous)
        return True
    serial(*args)
    return True


def take_rows_at(matrix: np.ndarray, rows: np.ndarray, positions: np.ndarray, out: np.ndarray,
                 threads: int = 1) -> bool:
    """``out[positions] = matrix[rows]`` (2-D, same dtype), GIL released: one source's rows
    into their slots of an output that several sources fill. ``threads`` and the return
    value as in :func:`take_rows`; the indices are checked here."""
    if (rows.shape != positions.shape or rows.ndim != 1 or matrix.shape[1:] != out.shape[1:]
            or matrix.dtype != out.dtype or matrix.ndim != 2):
        raise ValueError(f"take_rows_at: {rows.shape[0]} rows of {matrix.shape} ({matrix.dtype}) to "
                         f"{positions.shape[0]} positions of {out.shape} ({out.dtype})")
    if rows.shape[0] == 0:
        return True
    for name, idx, limit in (("row", rows, matrix.shape[0]), ("position", positions, out.shape[0])):
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= limit:
            raise IndexError(f"take_rows_at: {name} {lo if lo < 0 else hi} outside 0..{limit - 1}")
    rows, positions = np.asarray(rows, dtype=np.int64), np.asarray(positions, dtype=np.int64)
    return _run_copy(_cpu_kernels.take_rows_at, _cpu_kernels.take_rows_at_parallel,
                     (matrix, rows, positions, out), threads)


def distinct_rows(source: np.ndarray, rows: np.ndarray, sizes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (source, row) pairs of a state's slots, in (source, row) order, and each
    slot's position among them: (sources int64, rows int64, payload_row int32 per slot, -1
    for an empty slot ``source < 0``). ``sizes``: rows per source; a slot outside them
    raises IndexError."""
    source = np.ascontiguousarray(source, dtype=np.int32).reshape(-1)
    rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
    if source.shape != rows.shape:
        raise ValueError(f"distinct_rows: {source.shape[0]} sources for {rows.shape[0]} rows")
    base = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).astype(np.int64)
    payload_row = np.empty(source.shape[0], np.int32)
    out_source, out_row, bad = _cpu_kernels.distinct_rows(source, rows, base, payload_row)
    if bad:
        raise IndexError(f"distinct_rows: {bad} slots refer to a source or row outside "
                         f"{base.shape[0] - 1} sources of {list(np.diff(base))} rows")
    return out_source, out_row, payload_row


_THREADSAFE: bool | None = None


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


def parallel_calls_threadsafe() -> bool:
    """Whether numba's threading layer takes parallel calls from several threads at once.

    tbb and omp do; workqueue aborts the process on a concurrent call. The layer is the one
    already running, else the one numba will load: the first importable of its priority
    list (or the configured one).
    """
    global _THREADSAFE
    if _THREADSAFE is None:
        try:
            layer = numba.threading_layer()
        except ValueError:                      # no parallel call yet: predict numba's choice
            layer = numba.config.THREADING_LAYER
            if layer == "default":
                layer = "workqueue"
                for name in numba.config.THREADING_LAYER_PRIORITY:
                    if name == "workqueue" or _layer_loadable(name):
                        layer = name
                        break
        _THREADSAFE = layer in ("tbb", "omp", "safe", "threadsafe")
    return _THREADSAFE


def _layer_loadable(name: str) -> bool:
    try:
        __import__(f"numba.np.ufunc.{name}pool")
    except Exception:   # noqa: BLE001 (missing libtbb / libgomp: numba cannot load it either)
        return False
    return True

# Values agree with the float64 reference within TOLERANCE[input dtype] * scale, where scale is
# |q|^2 + |t|^2 for squared distances (l2 is compared squared: the bound holds there, while the
# square root divides an absolute error by 2 x distance, without bound near 0), |q| |t| for
# inner product and 1 for cosine. The kernel computes in float32 for both input dtypes, so both
# entries are the float32 bound: ~100 ulps (eps32 = 1.2e-7) covers the sgemm's d-term
# accumulation for d up to ~1000 and the cancellation in |q|^2 - 2 q.t + |t|^2.
TOLERANCE = {"float32": 1e-5, "float64": 1e-5}

# Tile shape. A (1024 x 512) float32 score tile is 2 MiB, one core's L2 on the benchmark
# machine; the per-thread sgemm on it runs at ~85% of the single-core 4096^3 rate at d = 128 and
# d = 768. Measured per CPU-second, single thread, nq = 4000, nt = 100000, d = 128, k = 10,
# AVX-512 sgemm: 1024 x 512: 116 GFLOP, 512 x 1024: 112, 256 x 1024: 106, 128 x 1024: 89,
# 64 x 4096: 71 (a taller tile serves more queries per packed target tile). With the Haswell
# sgemm, shapes from 512 x 512 to 2048 x 1024 were within 3% of each other.
QUERY_TILE = 1024
TARGET_TILE = 512
# Below this many queries per thread, splitting the target range between threads keeps the
# sgemm's M dimension larger than splitting the queries would.
MIN_QUERIES_PER_THREAD = 64
# Target tiles are a multiple of this many rows: a multiple of every sgemm micro-kernel width.
TILE_MULTIPLE = 64
# Query tiles start at multiples of this many rows. Some sgemm kernels round a row's dot
# products differently by its position within the micro-kernel's rows: OpenBLAS's Haswell
# sgemm (OPENBLAS_CORETYPE=Haswell) by the position mod 12, measured 2026-11-30 (the
# AVX-512 kernel not at all). With tile starts at a multiple of 48 (of 2, 3, 4, 6, 8, 12,
# 16, 24) a row's position is the same whatever the number of threads, so are its bits;
# the rounding up costs at most 47 rows of balance per tile (nq=4000 on 2 threads: tiles of
# 1008 rows instead of 1000).
QUERY_TILE_MULTIPLE = 48
# Heap slots kept beyond k for the re-rank (see CpuBackend.run): k + RERANK_EXTRA + k // 16.
RERANK_EXTRA = 4
_POSITION_FREE: dict = {}


def sgemm_position_free(rows: int, target_tile: int, d: int) -> bool:
    """Whether this process's sgemm gives every column of a (rows x target_tile x d) call
    the same bits for the same target row (a probe, once per shape; BLAS on one thread).

    OpenBLAS's AVX-512 kernel does; its Haswell kernel (OPENBLAS_CORETYPE=Haswell, and what
    it picks on AVX2-only CPUs) rounds columns 8-15 of each 16 differently (measured
    2026-11-30), so copies of a row in different places would score apart.
    """
    key = (rows, target_tile, d)
    if key not in _POSITION_FREE:
        rng = np.random.default_rng(20261130)
        q = rng.standard_normal((rows, d)).astype(np.float32)
        t = np.repeat(rng.standard_normal((1, d)).astype(np.float32), target_tile, axis=0)
        out = np.empty((rows, target_tile), dtype=np.float32)
        _cpu_kernels.score_tile(q, t, out)
        _POSITION_FREE[key] = bool((out == out[:, :1]).all())
        if not _POSITION_FREE[key]:
            logger.info("sgemm rounds columns by position (%d x %d x %d): results are re-ranked",
                        rows, target_tile, d)
    return _POSITION_FREE[key]


def heap_width(k: int, nt: int) -> int:
    """Candidates kept per query row: k and a margin for the re-rank, at most every target."""
    return min(k + RERANK_EXTRA + k // 16, nt)


def score_margin(d: int, query_scale: np.ndarray, target_norm: float, bias_max: float) -> np.ndarray:
    """Per row, a bound on |sgemm score + |q|^2 (l2 family) - exact key| (float64 array).

    The sgemm sums d products (``gamma_d`` of their absolute sum, at most |q'| |t| by
    Cauchy-Schwarz; twice the unit roundoff, as for kernels that may truncate), the bias is
    one rounding of |t|^2 and the score one rounding of their sum; doubled for slack. The
    exact keys are float64 sums of float32 products, far inside the slack.
    """
    n_u = (d + 2) * 2.0 ** -23
    g = n_u / (1 - n_u)
    return 2 * (g * query_scale * target_norm + 2 * g * bias_max + 2.0 ** -22 * (bias_max + query_scale * target_norm))


def default_threads() -> int:
    """This process's share of cores: the CPUs it may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _check_threads(threads) -> int:
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
    """Run numba on ``threads`` threads and BLAS on one, restoring both on exit.

    BLAS gets one thread because each numba thread calls it on its own tile; a multithreaded
    BLAS inside would oversubscribe the caller's share of cores.
    """
    numba_threads = min(threads, numba.config.NUMBA_NUM_THREADS)
    if numba_threads < threads:
        logger.debug("threads=%d capped at numba's pool size %d", threads, numba_threads)
    previous = numba.get_num_threads()
    numba.set_num_threads(numba_threads)
    try:
        with blas_controller().limit(limits=1):
            yield numba_threads
    finally:
        numba.set_num_threads(previous)


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


def _prepare(queries: np.ndarray, targets: np.ndarray, metric: Metric):
    """Scaled float32 queries, float32 targets, float32 bias and float64 |q|^2 (or None).

    Norms are those of the float32 values the sgemm sees, so that |q|^2 - 2 q.t + |t|^2 is the
    squared distance of the same vectors whatever the input dtype.
    """
    if metric.name == "cosine":
        queries = _cpu_kernels.unit_rows(np.ascontiguousarray(queries, dtype=np.float64))
        targets = _cpu_kernels.unit_rows(np.ascontiguousarray(targets, dtype=np.float64))
    else:
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        targets = np.ascontiguousarray(targets, dtype=np.float32)
    if metric.name in ("l2", "sqeuclidean"):
        # -2 is a power of two: the scaling is exact, so the sgemm sees the input values.
        bias = _cpu_kernels.squared_norms(targets).astype(np.float32)
        return queries * np.float32(-2.0), targets, bias, _cpu_kernels.squared_norms(queries)
    return -queries, targets, np.zeros(targets.shape[0], dtype=np.float32), None


def _tail_tile(targets: np.ndarray, bias: np.ndarray, target_tile: int):
    """The last, partial target tile padded to ``target_tile`` rows (zeros, bias +inf)."""
    start = targets.shape[0] // target_tile * target_tile
    tail = np.zeros((target_tile, targets.shape[1]), dtype=np.float32)
    tail_bias = np.full(target_tile, np.inf, dtype=np.float32)
    tail[: targets.shape[0] - start] = targets[start:]
    tail_bias[: targets.shape[0] - start] = bias[start:]
    return tail, tail_bias


def _scan_row(query: np.ndarray, targets: np.ndarray, width: int, squared: bool):
    """(keys, indices) of one row's ``width`` best of every target by (key, index)."""
    keys = np.empty(targets.shape[0], dtype=np.float64)
    _cpu_kernels.row_keys(query, targets, squared, keys)
    kth = np.partition(keys, width - 1)[width - 1]
    near = np.flatnonzero(keys <= kth)
    near = near[np.lexsort((near, keys[near]))][:width]
    return keys[near], near


def _scipy_blas_missing() -> str | None:
    try:
        import scipy.linalg.cython_blas  # noqa: F401  (numba's np.dot binds to these)
    except ImportError as exc:
        return f"needs scipy for numba's BLAS binding (np.dot in nopython mode): {exc}"
    return None


class CpuBackend:
    """Fused tiled-sgemm + Numba top-k, float32, any k (see the module docstring)."""

    name = "cpu"
    devices = ("cpu",)
    dtypes = ("float32", "float64")
    metrics = ("l2", "sqeuclidean", "inner_product", "cosine")
    # Any k: heaps are min(k, nt) wide; memory is that of the (nq, k) result plus
    # 8 B x nq x min(k, nt) per target split.
    max_k = None

    def refuse(self, queries, targets, k, metric: Metric, **options) -> str | None:
        """None when the backend accepts the call, else why it does not."""
        if metric.name not in self.metrics:
            return f"metric {metric.name!r} not supported"
        if targets.shape[0] >= _cpu_kernels.EMPTY_INDEX:
            return f"at most {_cpu_kernels.EMPTY_INDEX - 1} targets per call (32-bit heap index)"
        return _scipy_blas_missing()

    def run(self, queries, targets, k, metric: Metric, threads=None, **options):
        """Top-k of clean rows (the dispatcher removed rows that cannot rank).

        ``threads`` (int >= 1): threads to use; default: the CPUs this process may run on.
        Other options (``precision``, ``device``) are for other backends and are ignored.

        The fused sgemm + heap search keeps each row's best by float32 score, ties to the
        lower index. That rule needs copies of one row to score the same bits wherever they
        sit, which some sgemm kernels do not give (:func:`sgemm_position_free`, probed once
        per tile shape). Where they do not, the heaps keep ``heap_width`` candidates, their
        keys are recomputed in float64 from the float32 rows in one fixed order
        (``_cpu_kernels.rerank_keys``) and ranked by (key, index); a row is proven when its
        last kept score, less the sgemm's error bound (:func:`score_margin`), is above its
        k-th key, and the few others are recomputed against every target
        (``_cpu_kernels.row_keys``).
        """
        threads = _check_threads(threads)
        nq, nt = queries.shape[0], targets.shape[0]
        width = min(k, nt)
        squared = metric.name in ("l2", "sqeuclidean")
        with thread_limits(threads) as used:
            scaled, targets32, bias, query_norms = _prepare(queries, targets, metric)
            query_tile, target_tile, n_split = plan_tiles(nq, nt, used)
            tile_rows = {min(query_tile, nq), nq % query_tile or query_tile}
            rerank = not all(sgemm_position_free(r, target_tile, queries.shape[1]) for r in tile_rows)
            kept = heap_width(k, nt) if rerank else width
            tail, tail_bias = _tail_tile(targets32, bias, target_tile)
            heaps = np.full((n_split, nq, kept), _cpu_kernels.EMPTY_KEY, dtype=np.uint64)
            _cpu_kernels.search_tiles(scaled, targets32, bias, tail, tail_bias, heaps, query_tile)
            # Sorting the keys orders each row by (score, index): best first, ties to the
            # lower index. With several target splits, the best of their union is the first
            # ``kept``.
            keys = heaps[0] if n_split == 1 else np.concatenate(list(heaps), axis=1)
            scores, cand = _cpu_kernels.decode(np.sort(keys, axis=1)[:, :kept])
            cand = np.where(cand != _cpu_kernels.EMPTY_INDEX, cand, -1).astype(np.int64)
            if rerank:
                best_key, best_i = self._rerank(scores, cand, scaled, targets32, bias, query_norms,
                                                width, squared)
        logger.debug("cpu knn nq=%d nt=%d k=%d threads=%d tiles=(%d, %d) splits=%d rerank=%s",
                     nq, nt, k, used, query_tile, target_tile, n_split, rerank)
        if not rerank:
            best_i = cand
            if query_norms is not None:
                best_key = np.maximum(scores.astype(np.float64) + query_norms[:, None], 0.0)
            else:
                best_key = scores
        values = np.full((nq, k), metric.worst, dtype=np.float32)
        indices = np.full((nq, k), -1, dtype=np.int64)
        found = best_i >= 0
        if metric.name == "l2":
            result = np.sqrt(best_key)
        elif squared:
            result = best_key
        else:
            result = -best_key
        values[:, :width] = np.where(found, result, metric.worst)
        indices[:, :width] = np.where(found, best_i, -1)
        return values, indices

    def _rerank(self, scores, cand, scaled, targets32, bias, query_norms, width, squared):
        """(keys float64, indices) of each row's ``width`` best candidates by exact key."""
        nt = targets32.shape[0]
        # The float32 rows the sgemm saw (the scalings by -2 and -1 are exact).
        q32 = scaled * np.float32(-0.5 if squared else -1.0)
        exact = np.empty(cand.shape, dtype=np.float64)
        _cpu_kernels.rerank_keys(q32, targets32, cand, squared, exact)
        order = np.lexsort((np.where(cand >= 0, cand, nt), exact), axis=1)[:, :width]
        best_key = np.take_along_axis(exact, order, axis=1)
        best_i = np.take_along_axis(cand, order, axis=1)
        unproven = self._unproven(scores, cand, best_key, q32, targets32, bias, query_norms,
                                  cand.shape[1], nt)
        if len(unproven):
            logger.debug("cpu knn: %d rows rescanned (ties within the sgemm's error)", len(unproven))
        for row in unproven:
            best_key[row], best_i[row] = _scan_row(q32[row], targets32, width, squared)
        return best_key, best_i

    @staticmethod
    def _unproven(scores, cand, best_key, q32, targets32, bias, query_norms, kept, nt) -> np.ndarray:
        """Rows whose kept candidates may miss a target that ranks (or ties) in the top k."""
        if kept >= nt or nt == 0:
            return np.empty(0, dtype=np.int64)
        full = cand[:, -1] >= 0                 # a row with empty slots holds every target
        offset = query_norms if query_norms is not None else 0.0
        scale = np.sqrt(_cpu_kernels.squared_norms(q32)) * (2.0 if query_norms is not None else 1.0)
        tnorm = float(np.sqrt(_cpu_kernels.squared_norms(targets32).max()))
        margin = score_margin(q32.shape[1], scale, tnorm, float(bias.max())) * 1.01
        floor = scores[:, -1].astype(np.float64) + offset - margin
        return np.flatnonzero(full & ~(floor > best_key[:, -1]))


BACKEND = CpuBackend()
