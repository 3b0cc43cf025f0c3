"""The keyed search: each query row meets only the target rows of its group.

A group is a dense int id per row (``-1``: none): the driver numbers the distinct keys of
``on=`` (``nearest_join.join._with_groups``); an IVF plan would number its lists the same
way. A target block is sorted by group once per task (:class:`GroupSegments`), so each
group's rows are one contiguous segment; a query block is searched group by group against
those segments (:func:`grouped_search`) and gives the same ``(values, rows)`` as one search
of the whole block would, rows being the block's own rows. The result therefore folds into
the top-k state and emits exactly as an unkeyed search does (``udfs.topk``, ``udfs.emit``),
and the tie rule holds: the sort is stable, so within a segment block order is kept.

This first version calls the kernel once per group present in both the query block and the
target block; batching many tiny groups into one kernel call is still to come.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

NO_GROUP = -1


def group_ids(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """int64 group ids of an Arrow column; NULL (no group) reads ``NO_GROUP``."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return array.fill_null(NO_GROUP).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


@dataclass(frozen=True)
class GroupSegments:
    """One block's rows sorted by group: group ``groups[i]`` holds rows
    ``order[starts[i]:starts[i + 1]]`` (in block order). Rows without a group are left out."""

    groups: np.ndarray   # int64, ascending, distinct, >= 0
    starts: np.ndarray   # int64, len(groups) + 1
    order: np.ndarray    # int64 block rows, sorted by group

    @classmethod
    def of(cls, ids: np.ndarray) -> GroupSegments:
        rows = np.flatnonzero(ids >= 0)
        order = rows[np.argsort(ids[rows], kind="stable")]
        sorted_ids = ids[order]
        groups, first = np.unique(sorted_ids, return_index=True)
        starts = np.append(first, sorted_ids.size).astype(np.int64)
        return cls(groups.astype(np.int64), starts, order.astype(np.int64))


def grouped_search(search: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
                   query_vectors: np.ndarray, query_groups: np.ndarray, sorted_targets: np.ndarray,
                   segments: GroupSegments, k: int, worst: float) -> tuple[np.ndarray, np.ndarray]:
    """(values, rows) of a query block against a target block, each query row searched only
    against its group's segment.

    ``search(queries, targets)`` is the task's kernel call (the knn contract: (nq, k) float32
    values and int64 rows, -1 for an empty slot); ``sorted_targets`` are the target block's
    vectors in ``segments.order``. Query rows of no group, or of a group the block lacks,
    get empty slots (value ``worst``, row -1).
    """
    nq = query_vectors.shape[0]
    values = np.full((nq, k), worst, np.float32)
    rows = np.full((nq, k), -1, np.int64)
    if nq == 0 or segments.groups.size == 0:
        return values, rows
    q_order = np.argsort(query_groups, kind="stable")
    q_sorted = query_groups[q_order]
    q_present, q_first = np.unique(q_sorted, return_index=True)
    q_bounds = np.append(q_first, nq)
    at = np.searchsorted(segments.groups, q_present)
    hit = (at < segments.groups.size) & (segments.groups[np.minimum(at, segments.groups.size - 1)] == q_present)
    for i in np.flatnonzero(hit & (q_present >= 0)):
        members = q_order[q_bounds[i]:q_bounds[i + 1]]
        lo, hi = segments.starts[at[i]], segments.starts[at[i] + 1]
        v, local = search(query_vectors[members], sorted_targets[lo:hi])
        width = min(k, v.shape[1])
        values[members, :width] = v[:, :width]
        block_rows = segments.order[lo:hi]
        rows[members, :width] = np.where(local[:, :width] >= 0, block_rows[np.maximum(local[:, :width], 0)], -1)
    return values, rows
