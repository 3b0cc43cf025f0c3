"""Exact top-k of many small searches in one call: each query row against its own segments.

The keyed plan (``on=``) meets many tiny groups (100,000 keys of ~10 targets): one
:func:`~nearest_kernels.knn` call per group would pay its fixed cost (dispatch, operand
set-up, thread start, the exact stage's bookkeeping) per group, far more than the
arithmetic of a 10-target search. :func:`knn_segments` searches a whole query block in one
compiled, parallel loop instead: the targets are laid out in contiguous segments
(``segment_starts``), and query row ``i`` is searched against the union of its segments
``probe_segments[probe_starts[i]:probe_starts[i + 1]]``.

Why this design, rather than the alternatives:

* Exact for all four metrics by construction. Every (query, target) pair it meets gets its
  float64 key in the oracle's form (difference form ``sum((q - t)^2)`` for l2 / sqeuclidean,
  the same on unit vectors for cosine, ``-q.t`` for inner product, the per-pair sums of
  ``_cpu_kernels``), and rows are ranked by (key, target index): the cpu backend's exact
  stage, without its float32 candidate stage (there is nothing to prune in a segment of a
  few rows). A "group offset" coordinate (``group * H`` appended to every vector) would keep
  the l2 family apart only, and would cost float32 precision in the sgemm that the proof of
  the cpu kernel would have to absorb; inner product and cosine have no such offset.
* No group mask over a concatenated sgemm: the work stays proportional to the in-group
  pairs, not to (queries x all targets of the batch).
* Reusable by an IVF plan: a query probing several lists is a query with several segments
  (the lists' rows, sorted by list once per task); the union is ranked in one top-k, so no
  merge is needed either.

It does the arithmetic without BLAS, so a large segment (many queries times many targets)
belongs to :func:`knn`; ``udfs.search`` sends each group to one or the other by its work.
Ties go to the lower target index, as in every backend: with segments in block order (a
stable sort by group) that is the block's order.
"""
from __future__ import annotations

import numpy as np

from . import cpu  # first: it points numba's cache at a writable directory
from ._common import (
    check_cap,
    check_inputs,
    drop_beyond_cap,
    rankable_rows,
    resolve_metric,
)
from ._cpu_kernels import inverse_norms
from ._segment_kernels import segment_topk

__all__ = ["TOLERANCE", "knn_probed", "knn_segments"]

# Values are float64 keys rounded once to float32 (plus a square root for l2): within the
# cpu backend's tolerance, in the same units (``cpu.TOLERANCE``).
TOLERANCE = cpu.TOLERANCE


def knn_segments(queries: np.ndarray, targets: np.ndarray, segment_starts: np.ndarray,
                 probe_starts: np.ndarray, probe_segments: np.ndarray, k: int, metric: str = "l2",
                 *, cap: float | None = None, threads: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest targets of each query row among the rows of its segments.

    Parameters
    ----------
    queries : ndarray (nq, d), float32 or float64
    targets : ndarray (nt, d), float32 or float64, same d
    segment_starts : int64 ndarray (n_segments + 1,)
        Segment ``s`` is ``targets[segment_starts[s]:segment_starts[s + 1]]``; non-decreasing,
        from 0 to at most ``nt``.
    probe_starts : int64 ndarray (nq + 1,)
        Query ``i`` searches segments ``probe_segments[probe_starts[i]:probe_starts[i + 1]]``
        (none: an empty result row).
    probe_segments : int64 ndarray
        Segment numbers, each in ``0 .. n_segments - 1``; a query's segments should be
        distinct (a repeated one would rank its rows twice).
    k : int >= 1
    metric : {"l2", "sqeuclidean", "inner_product", "cosine"}
    cap : float, optional
        As :func:`~nearest_kernels.knn`'s ``cap``: only targets whose value is within it
        (inclusive) rank.
    threads : int, optional
        Threads of the parallel loop over queries (default: this process's share of cores).

    Returns
    -------
    values : float32 ndarray (nq, k)
        Best first; +inf (distances) or -inf (similarities) in missing slots.
    indices : int64 ndarray (nq, k)
        Row numbers of ``targets``; -1 in missing slots. Ties go to the lower index.

    Raises
    ------
    ValueError
        As :func:`~nearest_kernels.knn`, and segments or probes out of range.

    Notes
    -----
    Rows that cannot rank (a NaN or infinite element; a zero vector under cosine) never
    match, as in :func:`~nearest_kernels.knn`. The work is
    ``sum over queries of (their segments' rows) x d`` multiply-adds in float64.

    Examples
    --------
    >>> import numpy as np
    >>> t = np.array([[0.0], [5.0], [1.0], [2.0]], dtype=np.float32)
    >>> q = np.array([[0.9], [0.9]], dtype=np.float32)
    >>> starts = np.array([0, 2, 4])               # segments {0, 5} and {1, 2}
    >>> v, i = knn_segments(q, t, starts, np.array([0, 1, 2]), np.array([0, 1]), 2)
    >>> np.round(v.astype(np.float64), 2).tolist(), i.tolist()
    ([[0.9, 4.1], [0.1, 1.1]], [[0, 1], [2, 3]])
    """
    queries, targets, k, m, cap, segment_starts, probe_starts, probe_segments = _check_segments(
        queries, targets, segment_starts, probe_starts, probe_segments, k, metric, cap)
    nq, nt = queries.shape[0], targets.shape[0]
    keys = np.full((nq, k), np.inf)
    indices = np.full((nq, k), -1, np.int64)
    if nq and nt and probe_segments.size:
        q_ok = rankable_rows(queries, m)
        t_ok = rankable_rows(targets, m)
        if m.name == "cosine":   # unit rows in float64, as the oracle's difference form
            q_factors = inverse_norms(np.ascontiguousarray(queries))
            t_factors = inverse_norms(np.ascontiguousarray(targets))
        else:
            q_factors, t_factors = np.ones(nq), np.ones(nt)
        with cpu.thread_limits(cpu.check_threads(threads)):
            segment_topk(np.ascontiguousarray(queries), q_factors, q_ok, np.ascontiguousarray(targets),
                         t_factors, t_ok, segment_starts, probe_starts, probe_segments,
                         m.name != "inner_product", keys, indices)
    found = indices >= 0
    if m.name == "l2":
        values = np.sqrt(keys)
    elif m.name == "sqeuclidean":
        values = keys
    elif m.name == "cosine":
        values = 1.0 - keys / 2.0
    else:
        values = -keys
    values = np.where(found, values, m.worst)
    values, indices = drop_beyond_cap(values, indices, cap, m)
    with np.errstate(over="ignore"):   # beyond float32's range reads +-inf, as knn's
        return values.astype(np.float32), indices


def knn_probed(queries: np.ndarray, targets: np.ndarray, segment_starts: np.ndarray,
               probe_starts: np.ndarray, probe_segments: np.ndarray, k: int, metric: str = "l2",
               *, cap: float | None = None, threads: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`knn_segments`' contract (same arguments, same results up to ties' float32
    rounding) for large segments: each segment is searched by the cpu backend's fused sgemm
    for every query that probes it, and each query is ranked exactly once over all its
    segments (``cpu.knn_probed_rows``). Its fixed cost is one operand set-up per call, its
    work that of one wide search of the probed pairs, so a query block probing a few
    hundred-row lists each (an IVF plan) costs about what the same pairs cost in
    :func:`~nearest_kernels.knn`; tiny segments waste most of a target tile
    (``knn_segments`` suits them).

    Examples
    --------
    >>> import numpy as np
    >>> t = np.array([[0.0], [5.0], [1.0], [2.0]], dtype=np.float32)
    >>> q = np.array([[0.9], [0.9]], dtype=np.float32)
    >>> starts = np.array([0, 2, 4])               # segments {0, 5} and {1, 2}
    >>> v, i = knn_probed(q, t, starts, np.array([0, 1, 2]), np.array([0, 1]), 2)
    >>> np.round(v.astype(np.float64), 2).tolist(), i.tolist()
    ([[0.9, 4.1], [0.1, 1.1]], [[0, 1], [2, 3]])
    """
    queries, targets, k, m, cap, segment_starts, probe_starts, probe_segments = _check_segments(
        queries, targets, segment_starts, probe_starts, probe_segments, k, metric, cap)
    nq, nt = queries.shape[0], targets.shape[0]
    values = np.full((nq, k), m.worst, np.float32)
    indices = np.full((nq, k), -1, np.int64)
    if not (nq and nt and probe_segments.size):
        return values, indices
    # Rows that cannot rank leave: such queries probe nothing, such targets leave their
    # segments (the clean rows keep their order, so ties still go to the lower index). Blocks
    # whose rows all rank, the usual case, are searched as they are, without a copy.
    q_ok = rankable_rows(queries, m)
    t_ok = rankable_rows(targets, m)
    q_rows = slice(None) if q_ok.all() else np.flatnonzero(q_ok)
    clean_targets = None if t_ok.all() else np.flatnonzero(t_ok)
    if not q_ok.any() or not t_ok.any():
        return values, indices
    if clean_targets is not None:
        targets = targets[clean_targets]
        segment_starts = np.concatenate([[0], np.cumsum(t_ok)]).astype(np.int64)[segment_starts]
    if not isinstance(q_rows, slice):
        queries = queries[q_rows]
        counts = probe_starts[q_rows + 1] - probe_starts[q_rows]
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        probe_segments = probe_segments[np.repeat(probe_starts[q_rows] - starts[:-1], counts)
                                        + np.arange(starts[-1], dtype=np.int64)]
        probe_starts = starts
    v, i = cpu.knn_probed_rows(np.ascontiguousarray(queries), np.ascontiguousarray(targets), segment_starts,
                               probe_starts, probe_segments, k, m, cpu.check_threads(threads), check_cap(cap))
    values[q_rows] = v
    indices[q_rows] = i if clean_targets is None else np.where(i >= 0, clean_targets[np.maximum(i, 0)], -1)
    return values, indices


def _check_segments(queries, targets, segment_starts, probe_starts, probe_segments, k, metric, cap):
    """knn_segments' arguments checked and converted (the errors its docstring names)."""
    queries, targets, k = check_inputs(queries, targets, k)
    m = resolve_metric(metric)
    cap = check_cap(cap)
    nq, nt = queries.shape[0], targets.shape[0]
    segment_starts = np.ascontiguousarray(segment_starts, dtype=np.int64)
    probe_starts = np.ascontiguousarray(probe_starts, dtype=np.int64)
    probe_segments = np.ascontiguousarray(probe_segments, dtype=np.int64)
    n_segments = segment_starts.shape[0] - 1
    if segment_starts.ndim != 1 or n_segments < 0 or segment_starts[0] < 0 \
            or segment_starts[-1] > nt or np.any(np.diff(segment_starts) < 0):
        raise ValueError(f"segment_starts: expected non-decreasing offsets from 0 to at most {nt} "
                         f"(the targets' rows), got {segment_starts[:8].tolist()}...")
    if probe_starts.shape != (nq + 1,) or probe_starts[0] != 0 or np.any(np.diff(probe_starts) < 0) \
            or probe_starts[-1] != probe_segments.shape[0]:
        raise ValueError(f"probe_starts: expected {nq + 1} non-decreasing offsets from 0 to "
                         f"{probe_segments.shape[0]} (len(probe_segments)), got shape {probe_starts.shape}")
    if probe_segments.size and (probe_segments.min() < 0 or probe_segments.max() >= n_segments):
        raise ValueError(f"probe_segments: expected segment numbers in 0..{n_segments - 1}, got "
                         f"{int(probe_segments.min())}..{int(probe_segments.max())}")
    return queries, targets, k, m, cap, segment_starts, probe_starts, probe_segments
