"""The float64 reference backend: simple, obviously right, the oracle for every test.

It computes the exact distance or similarity of every (query, target) pair in float64,
one chunk of queries at a time, and ranks each row with a stable sort so that ties go to
the lower target index. It is slow by design and never chosen by ``backend="auto"`` while a
faster backend accepts the input.
"""
from __future__ import annotations

import numpy as np

from ._common import Metric, empty_result, rankable_rows

# Rows of the query chunk; bounds the float64 score matrix at CHUNK_ELEMENTS values.
CHUNK_ELEMENTS = 1 << 24


def _dots(q: np.ndarray, t: np.ndarray) -> np.ndarray:
    # einsum (no BLAS) sums every pair in the same order, so identical rows get identical
    # scores wherever they sit; a dgemm rounds its tail columns differently, which would
    # break the tie rule (lower index first) for exact duplicates. About 3x slower.
    return np.einsum("ij,kj->ik", q, t)


def scores_float64(queries: np.ndarray, targets: np.ndarray, metric: Metric) -> np.ndarray:
    """Exact float64 scores of every pair: distances or similarities as ``metric`` defines."""
    q = queries.astype(np.float64)
    t = targets.astype(np.float64)
    if metric.name in ("l2", "sqeuclidean"):
        # Direct differences would cost nq*nt*d memory; the expansion is exact enough in
        # float64 for float32 inputs (relative error ~1e-16 of the norms).
        sq = (q * q).sum(1)[:, None] - 2.0 * _dots(q, t) + (t * t).sum(1)[None, :]
        np.maximum(sq, 0.0, out=sq)
        return np.sqrt(sq) if metric.name == "l2" else sq
    dots = _dots(q, t)
    if metric.name == "inner_product":
        return dots
    qn = np.sqrt((q * q).sum(1))
    tn = np.sqrt((t * t).sum(1))
    with np.errstate(divide="ignore", invalid="ignore"):
        return dots / qn[:, None] / tn[None, :]


def knn_reference(queries: np.ndarray, targets: np.ndarray, k: int, metric: Metric):
    """Exact top-k in float64. See :func:`nearest_join.kernels.knn` for the contract."""
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
    chunk = max(1, CHUNK_ELEMENTS // max(1, t_idx.size))
    for start in range(0, nq, chunk):
        stop = min(nq, start + chunk)
        s = scores_float64(queries[start:stop], t_sel, metric)
        key = -s if metric.descending else s
        # Stable sort: equal scores keep target order, so the lower index wins ties.
        order = np.argsort(key, axis=1, kind="stable")[:, :width]
        values[start:stop, :width] = np.take_along_axis(s, order, axis=1)
        indices[start:stop, :width] = t_idx[order]
    indices[~q_ok] = -1
    values[~q_ok] = metric.worst
    return values, indices
