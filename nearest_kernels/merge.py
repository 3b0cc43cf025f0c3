"""The one top-k merge shared by every plan and backend.

Partial top-k results of several target blocks (each row best first, indices local to its
block, -1 for a missing slot) are merged into one top-k per query. Indices are made global
by adding each block's offset; ties go to the lower global index, the same rule as every
backend, so splitting the target into blocks never changes the answer.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ._common import resolve_metric

_NO_INDEX = np.iinfo(np.int64).max


def _order_rows(primary: np.ndarray, secondary: np.ndarray, k: int) -> np.ndarray:
    """Per row, the columns of the ``k`` smallest (primary, secondary) pairs, in order.

    ``np.lexsort`` does this directly but costs five times a plain ``argsort`` of the
    primary key. Rows whose first ``k + 1`` sorted primaries are strictly increasing are
    ordered by the primary alone (the secondary cannot matter there), so only rows with a
    tie (or a NaN, or empty slots, which tie at +inf) near their top go through lexsort.
    """
    order = np.argsort(primary, axis=1)
    head = np.take_along_axis(primary, order[:, : k + 1], axis=1)
    if head.shape[1] > 1:
        tied = ~(head[:, :-1] < head[:, 1:]).all(axis=1)
    else:
        tied = np.isnan(head[:, 0])
    if tied.any():
        order[tied] = np.lexsort((secondary[tied], primary[tied]), axis=1)
    return order[:, :k]


def merge_topk(
    values: Sequence[np.ndarray],
    indices: Sequence[np.ndarray],
    k: int,
    metric: str = "l2",
    *,
    offsets: Sequence[int] | None = None,
    return_sources: bool = False,
):
    """Merge partial top-k results of several target blocks into one top-k per query.

    Parameters
    ----------
    values, indices : sequences of arrays, each (nq, k_i)
        Partial results as returned by :func:`nearest_kernels.knn`: float values and int64
        indices, -1 where a slot is empty. All parts have the same number of rows.
    k : int
        Number of results to keep per query.
    metric : str
        Decides the order: distances ascending, similarities descending.
    offsets : sequence of int, optional
        Added to the valid indices of each part (the start of its target block).
    return_sources : bool
        Also return, for each kept slot, its column in the concatenation of all parts
        (``-1`` for an empty slot); callers use it to gather per-slot payloads.

    Returns
    -------
    values : float32 array (nq, k)
    indices : int64 array (nq, k)
    sources : int64 array (nq, k), only when ``return_sources``

    Examples
    --------
    >>> import numpy as np
    >>> v, i = merge_topk([np.array([[1.0, 4.0]]), np.array([[2.0, 4.0]])],
    ...                   [np.array([[0, 1]]), np.array([[0, 1]])], 3, "l2", offsets=[0, 10])
    >>> v.tolist(), i.tolist()
    ([[1.0, 2.0, 4.0]], [[0, 10, 1]])
    """
    m = resolve_metric(metric)
    if len(values) != len(indices) or not values:
        raise ValueError(
            f"values, indices: expected the same non-zero number of parts, "
            f"got {len(values)} and {len(indices)}"
        )
    if offsets is None:
        offsets = [0] * len(values)
    if len(offsets) != len(values):
        raise ValueError(f"offsets: expected {len(values)} offsets, got {len(offsets)}")
    nq = values[0].shape[0]
    for v, i in zip(values, indices):
        if v.shape != i.shape or v.ndim != 2 or v.shape[0] != nq:
            raise ValueError(
                f"values, indices: expected matching (nq={nq}, k_i) parts, got {v.shape} and {i.shape}"
            )
    from .cpu import merge_parts   # numba: imported on first use, not with the package

    raw_idx = np.concatenate([np.asarray(i, dtype=np.int64) for i in indices], axis=1)
    all_val = np.concatenate([np.asarray(v, dtype=np.float32) for v in values], axis=1)
    # Parts are best first: a compiled k-way merge (cpu.merge_parts; merge_topk of 65,536
    # rows of four parts of 10 on 2 cores: 33-44 ms against 108-170 with the sorts below).
    # Rows it does not take (a NaN value, a part out of order) are sorted, as all were before.
    out_val, out_idx, order, fallback = merge_parts(all_val, raw_idx, [v.shape[1] for v in values],
                                                    offsets, k, m.descending)
    if fallback.any():
        rows = np.flatnonzero(fallback)
        sub_idx = np.concatenate([np.where(i[rows] >= 0, np.asarray(i[rows], np.int64) + np.int64(o), -1)
                                  for i, o in zip(indices, offsets)], axis=1)
        sub_val = all_val[rows]
        valid = sub_idx >= 0
        # Sort key: value (negated for similarities), then index; empty slots go last.
        primary = np.where(valid, -sub_val if m.descending else sub_val, np.inf)
        secondary = np.where(valid, sub_idx, _NO_INDEX)
        sub_order = _order_rows(primary, secondary, k)
        order[rows] = sub_order
        out_idx[rows] = np.take_along_axis(sub_idx, sub_order, axis=1)
        out_val[rows] = np.take_along_axis(sub_val, sub_order, axis=1)
    width = out_idx.shape[1]
    if width < k:  # fewer candidate slots than k in total: pad
        pad = k - width
        out_idx = np.concatenate([out_idx, np.full((nq, pad), -1, np.int64)], axis=1)
        out_val = np.concatenate([out_val, np.full((nq, pad), m.worst, np.float32)], axis=1)
        order = np.concatenate([order, np.full((nq, pad), -1, np.int64)], axis=1)
    empty = out_idx < 0
    out_val[empty] = m.worst
    if return_sources:
        sources = np.where(empty, -1, order).astype(np.int64)
        return out_val, out_idx, sources
    return out_val, out_idx
