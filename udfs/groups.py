"""The keyed search: each query row meets only the target rows of its group.

A group is a dense int id per row (``-1``: none): the driver numbers the distinct keys of
``on=`` (``nearest_join.inputs.positional_inputs``); an IVF plan would number its lists the same
way. A target block is sorted by group once per task (:class:`GroupSegments`), so each
group's rows are one contiguous segment; a query block is searched against those segments
(:func:`grouped_search`) and gives the same ``(values, rows)`` as one search of the whole
block would, rows being the block's own rows. The result therefore folds into the top-k
state and emits exactly as an unkeyed search does (``udfs.topk``, ``udfs.emit``), and the
tie rule holds: the sort is stable, so within a segment block order is kept.

Groups are searched two ways, by their work (queries x targets x d of the pair):

* small groups, all of them at once, in one call of
  :func:`nearest_kernels.segments.knn_segments`: every query row of the block against
  its group's segment in one compiled loop, float64 keys ranked by (key, row), exact for
  every metric. 100,000 keys of ~10 targets then cost one call, not 100,000; an IVF plan
  passes several segments (its probed lists) per query to the same call;
* large groups one :func:`~nearest_kernels.knn` call each (the task's searcher: sgemm
  or GPU), where the call's fixed cost is small against the arithmetic it speeds up.

Both are exact with the same tie rule, so where the line falls changes the time, not the
answer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# A group whose query rows x target rows x d is at most this goes to the batched segment
# search; above it, to its own kernel call. The segment loop runs without BLAS, so its cost
# grows with the work, while a kernel call pays a fixed set-up first. On a CPU executor the
# segment loop stays the faster well above this line (benchmarks/keyed_join.py
# --segment-work times both per group); the line is drawn low for the GPU searcher, whose
# call is cheap against the arithmetic it takes off the CPU (not measured on a GPU yet).
SEGMENT_WORK = 1 << 20


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
                   segments: GroupSegments, k: int, metric: str, *, cap: float | None = None,
                   threads: int = 1, wide: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(values, rows) of a query block against a target block, each query row searched only
    against its group's segment.

    ``search(queries, targets)`` is the task's kernel call for a large group (the knn
    contract: (nq, k) float32 values and int64 rows, -1 for an empty slot, ``cap`` applied;
    ``wide``: the task searches on the CPU, and a query's several large groups, IVF probes,
    go to one ``knn_probed`` call instead, :func:`udfs.probes.probed_search`);
    small groups go to one :func:`~nearest_kernels.segments.knn_segments` call with
    ``cap`` and ``threads``. ``sorted_targets`` are the target block's vectors in
    ``segments.order``. Query rows of no group, or of a group the block lacks, get empty
    slots (the metric's worst value, row -1).
    """
    from nearest_kernels import resolve_metric
    from nearest_kernels.segments import knn_segments  # numba: on executors only

    if not isinstance(query_groups, np.ndarray):   # several groups per row (IVF probes)
        from .probes import probed_search

        return probed_search(search, query_vectors, query_groups, sorted_targets, segments, k,
                             metric, segment_work=SEGMENT_WORK, cap=cap, threads=threads, wide=wide)
    nq = query_vectors.shape[0]
    worst = resolve_metric(metric).worst
    values = np.full((nq, k), worst, np.float32)
    rows = np.full((nq, k), -1, np.int64)
    if nq == 0 or segments.groups.size == 0:
        return values, rows
    # Each query row's segment (-1: its group is absent from the block, or it has none).
    at = np.minimum(np.searchsorted(segments.groups, query_groups), segments.groups.size - 1)
    segment = np.where((query_groups >= 0) & (segments.groups[at] == query_groups), at, -1)
    present = segment >= 0
    sizes = np.diff(segments.starts)
    queries_per_segment = np.bincount(segment[present], minlength=sizes.size)
    large = queries_per_segment * sizes * query_vectors.shape[1] > SEGMENT_WORK

    small_rows = np.flatnonzero(present & ~large[np.maximum(segment, 0)])
    if small_rows.size:
        # One probe per query row: probe_starts 0, 1, ..., n.
        v, local = knn_segments(query_vectors[small_rows], sorted_targets, segments.starts,
                                np.arange(small_rows.size + 1, dtype=np.int64), segment[small_rows],
                                k, metric, cap=cap, threads=threads)
        values[small_rows] = v
        rows[small_rows] = np.where(local >= 0, segments.order[np.maximum(local, 0)], -1)

    for s in np.flatnonzero(large):
        members = np.flatnonzero(segment == s)
        lo, hi = segments.starts[s], segments.starts[s + 1]
        v, local = search(query_vectors[members], sorted_targets[lo:hi])
        width = min(k, v.shape[1])
        values[members, :width] = v[:, :width]
        block_rows = segments.order[lo:hi]
        rows[members, :width] = np.where(local[:, :width] >= 0, block_rows[np.maximum(local[:, :width], 0)], -1)
    return values, rows
