"""The float64 reference backend: simple, obviously right, the oracle for every test.

It computes the exact distance or similarity of every (query, target) pair in float64 and
ranks each row with a stable sort, so that ties go to the lower target index. Distances are
computed in the difference form, sum((q - t)^2), and cosine as the difference of the unit
vectors, sum((q/|q| - t/|t|)^2) = 2 - 2 cos: the expansion |q|^2 - 2 q.t + |t|^2 cancels
catastrophically when the data sit far from the origin (an offset much larger than the spread),
even in float64. Inner product has no difference form and is summed directly. It is slow by
design and never chosen by ``backend="auto"`` while a faster backend accepts the input.
"""
from __future__ import annotations

import numpy as np

from ._common import Metric, drop_beyond_cap, empty_result, rankable_rows

# Bound on the float64 values of one chunk's difference tensor (rows x targets x dimension).
CHUNK_ELEMENTS = 1 << 22


def _dots(q: np.ndarray, t: np.ndarray) -> np.ndarray:
    # einsum (no BLAS) sums every pair in the same order, so identical rows get identical
    # scores wherever they sit; a dgemm rounds its tail columns differently, which would
    # break the tie rule (lower index first) for exact duplicates.
    return np.einsum("ij,kj->ik", q, t)


def unit_rows(rows: np.ndarray) -> np.ndarray:
    """float64 rows divided by their norms; each row is first divided by its largest
    magnitude (so that no square over- or underflows, for elements from 1e-300 to 1e300)."""
    rows = np.asarray(rows, dtype=np.float64)
    peak = np.abs(rows).max(axis=1, keepdims=True) if rows.shape[1] else np.ones((rows.shape[0], 1))
    peak[~(peak > 0)] = 1.0
    scaled = rows / peak
    with np.errstate(divide="ignore", invalid="ignore"):
        return scaled / np.sqrt(np.einsum("ij,ij->i", scaled, scaled))[:, None]


def squared_differences(q: np.ndarray, t: np.ndarray) -> np.ndarray:
    """sum((q_i - t_j)^2) of every pair, float64, in chunks of queries."""
    out = np.empty((q.shape[0], t.shape[0]))
    chunk = max(1, CHUNK_ELEMENTS // max(1, t.size))
    for start in range(0, q.shape[0], chunk):
        diff = q[start:start + chunk, None, :] - t[None, :, :]
        out[start:start + chunk] = np.einsum("ijk,ijk->ij", diff, diff)
    return out


def keys_float64(queries: np.ndarray, targets: np.ndarray, metric: Metric) -> np.ndarray:
    """Ranking keys of every pair in float64, smaller is better: the squared difference for
    l2, sqeuclidean and (of unit vectors) cosine, the negated inner product. Ranking by the
    cosine key rather than by 1 - key / 2 keeps the order of nearly parallel vectors, whose
    cosines all round to 1."""
    q = np.asarray(queries, dtype=np.float64)
    t = np.asarray(targets, dtype=np.float64)
    if metric.name in ("l2", "sqeuclidean"):
        return squared_differences(q, t)
    if metric.name == "inner_product":
        return -_dots(q, t)
    return squared_differences(unit_rows(q), unit_rows(t))


def values_of_keys(keys: np.ndarray, metric: Metric) -> np.ndarray:
    """The distances or similarities that ``metric`` reports for keys of :func:`keys_float64`."""
    if metric.name == "l2":
        return np.sqrt(keys)
    if metric.name == "sqeuclidean":
        return keys
    if metric.name == "cosine":
        return 1.0 - keys / 2.0
    return -keys


def scores_float64(queries: np.ndarray, targets: np.ndarray, metric: Metric) -> np.ndarray:
    """Exact float64 scores of every pair: distances or similarities as ``metric`` defines."""
    return values_of_keys(keys_float64(queries, targets, metric), metric)


def knn_reference(queries: np.ndarray, targets: np.ndarray, k: int, metric: Metric,
                  cap: float | None = None):
    """Exact top-k in float64. See :func:`nearest_kernels.knn` for the contract;
    ``cap``: only targets whose float64 value is within it (inclusive) rank."""
    nq = queries.shape[0]
    values, indices = empty_result(nq, k, metric)
    q_ok = rankable_rows(queries, metric)
    t_ok = rankable_rows(targets, metric)
    t_idx = np.flatnonzero(t_ok)
    if nq == 0 or t_idx.size == 0:
        values[~q_ok] = metric.worst
        return values, indices
    t_sel = targets[t_idx]
    width = min(k, t_idx.size)
    chunk = max(1, CHUNK_ELEMENTS // max(1, t_idx.size * max(1, targets.shape[1])))
    for start in range(0, nq, chunk):
        stop = min(nq, start + chunk)
        key = keys_float64(queries[start:stop], t_sel, metric)
        # Stable sort: equal keys keep target order, so the lower index wins ties.
        order = np.argsort(key, axis=1, kind="stable")[:, :width]
        best = values_of_keys(np.take_along_axis(key, order, axis=1), metric)
        best, chosen = drop_beyond_cap(best, t_idx[order], cap, metric)
        with np.errstate(over="ignore"):   # beyond float32's range reads +-inf (documented)
            values[start:stop, :width] = best
        indices[start:stop, :width] = chosen
    indices[~q_ok] = -1
    values[~q_ok] = metric.worst
    return values, indices
