"""The search of a block pair: the task's searcher, and the keyed search by group.

**The task's searcher.** A Spark task opens one searcher (:func:`open_block_searcher`: the
backend and device chosen once, the thread share, the JIT warm-up) and streams its blocks
through it: :class:`BlockSearcher` on the CPU, or the GPU searcher (``udfs.gpu_search``),
which keeps the current target block resident on the device, keyed by ``target_key``, so that
many query blocks against the same target block copy it once.

**The keyed search** (:func:`grouped_search`): each query row meets only the target rows of
its group. A group is a dense int id per row (``-1``: none): the driver numbers the distinct
keys of ``on=`` (``nearest_join.inputs.positional_inputs``), and the IVF plan its lists. A
target block is sorted by group once per task (:class:`GroupSegments`), so each group's rows
are one contiguous segment; a query block is searched against those segments and gives the
same ``(values, rows)`` as one search of the whole block would, rows being the block's own
rows. The result therefore folds into the top-k state and emits exactly as an unkeyed search
does (``udfs.merge``, ``udfs.encode``), and the tie rule holds: the sort is stable, so within a
segment block order is kept.

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

**Probed rows** (:func:`probed_search`, which :func:`grouped_search` hands them to): in the
IVF plan (``nearest_join.ivf``) the group of a target row is its list (nearest centroid) and
a query row carries the ``nprobe`` lists it probes (:class:`udfs.decode.Probes`). The same
target block sorted by group, the same split of the work:

* probes of small segments in one :func:`~nearest_kernels.segments.knn_segments` call,
  a query's small segments ranked together (float64 keys, exact for every metric);
* the large segments (dense lists: queries x rows x d above :data:`SEGMENT_WORK`): on
  a CPU task all of them in one :func:`~nearest_kernels.segments.knn_probed` call (one
  operand set-up for the block, each list multiplied once for the queries that probe it,
  each query ranked once: a probed pair costs about what an exact one does); on a GPU task
  one call of its searcher per list, for all the queries that probe it, each list's
  results folded into its queries' top k by the shared
  :func:`nearest_kernels.merge_topk` (a running (queries, k) state, whatever nprobe is);

and the two parts merged by the same ``merge_topk``. Every pair searched is exact; only
which lists a query probes is approximate. Ties between targets of equal value go to the
lower block row, except within one segment call (``knn_segments``, ``knn_probed``), where
they go to the lower list first (the segments' order); both are deterministic for a given
input.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nearest_kernels import knn

from .context import SearchSettings, cuda_may_exist, task_cpus
from .decode import Probes

logger = logging.getLogger(__name__)


class BlockSearcher:
    """CPU (or reference) searcher: a thin wrapper over :func:`nearest_kernels.knn`."""

    def __init__(self, settings: SearchSettings, threads: int | None = None, backend: str | None = None):
        self.settings = settings
        self.threads = threads or task_cpus()
        # The backend every block runs: the one open_block_searcher chose for the task (an
        # explicit "cpu" or "reference" runs that backend; an error names why it cannot).
        # Without a choice, "auto" lets knn's dispatcher choose per call, and its first
        # candidate is the GPU backend: that call imports torch.
        if backend is None:
            backend = settings.backend if settings.backend in ("cpu", "reference") else "auto"
        self.backend = backend
        self.device = "cpu"

    def search(self, query_vectors: np.ndarray, target_vectors: np.ndarray,
               target_key: object = None, cap: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of each query row against the target block (:func:`nearest_kernels.knn`);
        ``cap``: knn's (only targets within it rank, inclusive; None: no cap)."""
        s = self.settings
        return knn(query_vectors, target_vectors, s.k, s.metric, backend=self.backend,
                   threads=self.threads, cap=cap)


# The kernel warm-ups this process started (udfs.warm), by what they warm.
warm_up_threads: dict[tuple, threading.Thread] = {}


def wait_for_warm_ups() -> None:
    """Wait for this process's kernel warm-ups: a search that compiled on its own would compile
    what the warm-up (or, under the machine's compile lock, another process) is compiling."""
    threads = set(warm_up_threads.values())
    if threading.current_thread() in threads:   # a warm-up's own search: it compiles
        return
    for thread in threads:
        thread.join()


def open_block_searcher(settings: SearchSettings) -> BlockSearcher:
    """The searcher for this task, chosen by the kernels' dispatcher
    (:func:`nearest_kernels.dispatch.choose_task_backend`): the GPU Spark assigned to the
    task when the gpu backend accepts it, else the CPU kernel.

    ``backend="cpu"`` / ``"reference"`` run that backend; ``"gpu"`` without a usable GPU is
    an error naming why; ``"auto"`` falls back to the CPU without configuration (and does not
    import torch where no NVIDIA device can exist: :func:`udfs.context.cuda_may_exist`). The choice and
    the reasons of the backends refused before it are logged.
    """
    from nearest_kernels.dispatch import choose_task_backend

    skip = {}
    if settings.backend == "auto" and not cuda_may_exist():
        skip["gpu"] = "no GPU assigned to this task and no NVIDIA driver on this host"
    name, reasons = choose_task_backend(settings.backend, skip=skip)
    if name == "gpu":
        from .gpu_search import gpu_searcher_or_none

        searcher = gpu_searcher_or_none(settings)
        if searcher is not None:
            logger.info("task backend gpu%s", "".join(f" ({r})" for r in reasons))
            return searcher
        if settings.backend == "gpu":
            raise RuntimeError("backend 'gpu' requested but this executor has no usable CUDA device")
        name, reasons = choose_task_backend(settings.backend, skip={"gpu": "no usable CUDA device"})
    logger.info("task backend %s%s", name, "".join(f" ({r})" for r in reasons))
    wait_for_warm_ups()
    # The blocks run the backend chosen here, not "auto" again per block (which would import
    # torch for the GPU backend's refusal on every CPU executor).
    return BlockSearcher(settings, backend=name)


# -- the keyed search -----------------------------------------------------------------------------
# A group whose query rows x target rows x d is at most this goes to the batched segment
# search; above it, to its own kernel call. The segment loop runs without BLAS, so its cost
# grows with the work, while a kernel call pays a fixed set-up first. On a CPU executor the
# segment loop stays the faster well above this line (benchmarks/keyed_join.py's --segment-work
# option timed both per group at fb7aa93; git keeps it); the line is drawn low for the GPU searcher, whose
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
    go to one ``knn_probed`` call instead, :func:`probed_search`);
    small groups go to one :func:`~nearest_kernels.segments.knn_segments` call with
    ``cap`` and ``threads``. ``sorted_targets`` are the target block's vectors in
    ``segments.order``. Query rows of no group, or of a group the block lacks, get empty
    slots (the metric's worst value, row -1).
    """
    from nearest_kernels import resolve_metric
    from nearest_kernels.segments import knn_segments  # numba: on executors only

    if not isinstance(query_groups, np.ndarray):   # several groups per row (IVF probes)
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


def probed_search(search: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
                  query_vectors: np.ndarray, probes: Probes, sorted_targets: np.ndarray, segments,
                  k: int, metric: str, *, segment_work: int, cap: float | None = None,
                  threads: int = 1, wide: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(values, rows) of a query block against a target block, each query row searched
    against the segments of all its groups (the contract of
    :func:`grouped_search`, with :class:`~udfs.decode.Probes` for the query groups).

    ``wide`` (the task searches on the CPU): the large segments go to one
    :func:`~nearest_kernels.segments.knn_probed` call instead of one ``search`` call
    per segment. ``segment_work``: the work (queries x rows x d) above which a segment is large
    (``grouped_search`` passes :data:`SEGMENT_WORK`).
    """
    from nearest_kernels import merge_topk, resolve_metric
    from nearest_kernels.segments import knn_probed, knn_segments  # numba: on executors only

    nq, d = query_vectors.shape
    if probes.rows != nq:
        raise RuntimeError(f"internal error: {probes.rows} probe rows for {nq} query rows")
    worst = resolve_metric(metric).worst
    values = np.full((nq, k), worst, np.float32)
    rows = np.full((nq, k), -1, np.int64)
    if nq == 0 or segments.groups.size == 0 or probes.groups.size == 0:
        return values, rows
    # Each probe's segment; probes of groups the block lacks are dropped.
    owner = np.repeat(np.arange(nq, dtype=np.int64), np.diff(probes.starts))
    at = np.minimum(np.searchsorted(segments.groups, probes.groups), segments.groups.size - 1)
    present = (probes.groups >= 0) & (segments.groups[at] == probes.groups)
    owner, segment = owner[present], at[present]
    if segment.size == 0:
        return values, rows
    sizes = np.diff(segments.starts)
    large = np.bincount(segment, minlength=sizes.size) * sizes * d > segment_work
    small = ~large[segment]
    if small.any():
        # The queries in the order of their first small segment: queries of one list run one
        # after another and find its rows in cache (a block's lists, taken in query order, are
        # read from memory once per query). owner is non-decreasing (CSR order), so the small
        # probes are CSR too, and stay so when whole rows are permuted.
        s_owner, s_segment = owner[small], segment[small]
        counts = np.bincount(s_owner, minlength=nq)
        starts = np.zeros(nq + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        first = np.full(nq, segments.groups.size, np.int64)   # rows without one: last
        first[counts > 0] = s_segment[starts[:-1][counts > 0]]
        by_segment = np.argsort(first, kind="stable")
        moved = np.repeat(starts[by_segment], counts[by_segment]) + (
            np.arange(s_owner.size) - np.repeat(np.cumsum(counts[by_segment]) - counts[by_segment],
                                                counts[by_segment]))
        probe_starts = np.zeros(nq + 1, np.int64)
        np.cumsum(counts[by_segment], out=probe_starts[1:])
        v, local = knn_segments(query_vectors[by_segment], sorted_targets, segments.starts, probe_starts,
                                s_segment[moved], k, metric, cap=cap, threads=threads)
        values[by_segment] = v
        rows[by_segment] = np.where(local >= 0, segments.order[np.maximum(local, 0)], -1)

    big = np.flatnonzero(~small)
    if big.size and wide:
        # Every query's large segments in one call: one operand set-up for the block, each
        # segment multiplied once for all its queries, each query ranked once.
        b_owner = owner[big]
        starts = np.zeros(nq + 1, np.int64)
        np.cumsum(np.bincount(b_owner, minlength=nq), out=starts[1:])
        v, local = knn_probed(query_vectors, sorted_targets, segments.starts, starts, segment[big], k,
                              metric, cap=cap, threads=threads)
        found = np.where(local >= 0, segments.order[np.maximum(local, 0)], -1)
        values, rows = merge_topk([values, v], [rows, found], k, metric)
    elif big.size:
        b_owner, b_segment = owner[big], segment[big]
        by_segment = np.argsort(b_segment, kind="stable")
        bounds = np.flatnonzero(np.diff(b_segment[by_segment])) + 1
        for chunk in np.split(by_segment, bounds):
            # One call for every query probing this list, folded into those queries' top k
            # (memory: the running (nq, k) state, whatever nprobe is).
            s = int(b_segment[chunk[0]])
            members = b_owner[chunk]
            lo, hi = segments.starts[s], segments.starts[s + 1]
            v, local = search(query_vectors[members], sorted_targets[lo:hi])
            block_rows = segments.order[lo:hi]
            found = np.where(local >= 0, block_rows[np.maximum(local, 0)], -1)
            values[members], rows[members] = merge_topk([values[members], v], [rows[members], found], k, metric)
    return values, rows
