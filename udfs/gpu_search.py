"""GPU block searcher for executors: the task's GPU, a resident target block, pipelined copies.

:func:`gpu_searcher_or_none` is what :func:`udfs.search.open_block_searcher` calls for
``backend="auto"`` / ``"gpu"``. It returns None when torch or a CUDA device is missing, so a
CPU executor needs no configuration. Otherwise the searcher

* uses the GPU Spark assigned to the task (``TaskContext.resources()["gpu"].addresses[0]``);
  outside Spark, the address :func:`udfs.context.local_task` names (tests and benchmarks
  that simulate executors, ``udfs.local.local_join``), else device 0;
* keeps target blocks resident on the device, keyed by ``target_key`` (least recently used
  out first, within half the memory budget), so the many query blocks of a task that meet
  the same target blocks copy each once;
* keeps broadcast target blocks for the next task of the same stage that this Python
  worker runs (Spark reuses workers): every task of a broadcast stage searches the same
  target, which a GPU would otherwise copy and prepare again per task (a cost that
  grows with the block; benchmarks/RESULTS.md). Kept blocks belong to one stage; the first
  searcher opened for any other stage (or with ``SearchSettings.keep_targets`` off) frees
  them, and a cheap fingerprint guards every reuse;
* stages query batches in pinned host memory (the copy into it split over the task's
  threads) and copies batch i+1 on a side stream while batch i is searched; a query block
  that fits one batch stays on the device while the next call passes the same memory;
* sizes its batches and candidate buffers from the device memory free when it opened.

The task's GPU and scope come from ``udfs.context``; the host staging, the prefetched query
blocks and the resident and kept target blocks are ``udfs.gpu_memory``'s. A query block's
running top-k stays on the device (:class:`DeviceFold`), read back once per query block.
"""
from __future__ import annotations

import contextlib
import logging

import numpy as np

from .context import SearchSettings, address_to_ordinal, task_gpu_address, task_scope
from .gpu_memory import HostStaging, TargetStore, fingerprint, kept_targets, prepared_bytes, same_memory

logger = logging.getLogger(__name__)

# Share of the free device memory (at open) a searcher may use for targets and batches.
MEMORY_FRACTION = 0.7
# Per query row, beyond its vectors: candidate lists (<= 2048 int64 slots), keys, indices,
# re-rank temporaries. Generous on purpose; the kernel chunks inside this budget.
ROW_OVERHEAD_BYTES = 64 << 10
MIN_BATCH_ROWS = 1024
# Configurations this worker process has compiled (GpuBlockSearcher.warm_up).
_WARMED: set = set()
# Share of the memory budget resident target blocks may hold (the rest: query batches).
TARGET_SHARE = 0.5


def memory_budget(available: int, total: int, share: float = 1.0) -> int:
    """A searcher's device memory budget: ``MEMORY_FRACTION`` of what is available to it, and
    of no more than its task's ``share`` of the device (``spark.task.resource.gpu.amount``
    0.5: two tasks' workers open on one GPU at once, each would otherwise see it all free)."""
    return int(min(available, total * min(1.0, share)) * MEMORY_FRACTION)


class DeviceFold:
    """A query block's running top-k on the device, plus its host copy in flight.

    ``values`` float32, ``keys`` int64 global keys (-1 empty), ``source`` int32 payload
    table ordinals (-1 empty), ``rows`` int64 rows in those tables; all (nq, k).
    """

    def __init__(self, values, keys, source, rows, host, ready):
        self.values, self.keys, self.source, self.rows = values, keys, source, rows
        self._host, self._ready = host, ready

    @classmethod
    def start(cls, values, keys, source, rows, cuda: bool) -> "DeviceFold":
        import torch

        tensors = (values, keys, source, rows)
        if not cuda:
            return cls(*tensors, tuple(t.clone() for t in tensors), None)
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(*tensors, host, ready)

    def to_numpy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(values, keys, source, rows) as numpy, once the copy started by the fold is done."""
        if self._ready is not None:
            self._ready.synchronize()
        return tuple(h.numpy() for h in self._host)


def gpu_searcher_or_none(settings: SearchSettings):
    """A :class:`GpuBlockSearcher` on this task's GPU, or None without torch / CUDA."""
    if settings.backend not in ("auto", "gpu"):
        return None
    try:
        import torch
    except ImportError:
        logger.debug("torch is not installed: CPU search")
        return None
    if not torch.cuda.is_available():
        logger.debug("no CUDA device: CPU search")
        return None
    address = task_gpu_address()
    ordinal = 0 if address is None else address_to_ordinal(address)
    if not 0 <= ordinal < torch.cuda.device_count():
        raise RuntimeError(f"GPU address {address!r} maps to CUDA ordinal {ordinal}, but this "
                           f"executor sees {torch.cuda.device_count()} device(s)")
    return GpuBlockSearcher(settings, torch.device("cuda", ordinal))


class GpuBlockSearcher:
    """Searches query blocks against a resident target block on one device.

    Works on a CPU ``torch.device`` too (no streams, no pinning): the tests here use that.
    """

    def __init__(self, settings: SearchSettings, device, *, memory_bytes: int | None = None,
                 batch_rows: int | None = None):
        import torch

        from nearest_kernels.gpu import choose, resolve_precision

        self.settings = settings
        self.device = torch.device(device)
        # "auto" resolved once for this task's device; the executor logs and reports it.
        self.precision = resolve_precision(settings.precision, self.device)
        self.backend = "gpu"
        self._cuda = self.device.type == "cuda"
        # Blocks kept by an earlier task of this stage (or freed, for another stage) before
        # the free memory is read.
        self._kept = kept_targets(self.device, task_scope() if settings.keep_targets else None)
        if memory_bytes is None:
            if self._cuda:
                free, total = torch.cuda.mem_get_info(self.device)
                # Memory torch's allocator holds but no tensor uses (an earlier task's) is
                # free for this one, and so are the blocks kept for it.
                idle = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
                kept = self._kept.bytes if self._kept is not None else 0
                memory_bytes = memory_budget(free + idle + kept, total, settings.gpu_share)
            else:
                memory_bytes = 4 << 30
        self.memory_bytes = memory_bytes
        self.batch_rows = batch_rows
        self._resident = TargetStore()   # this searcher's blocks (target_key -> prepared)
        self._targets = None             # the block of the current search
        self._query_cache = None         # (host array, device tensor) of a one-batch query block
        self.staging = HostStaging(self.device)   # host buffers, copy stream, prefetched blocks
        self.implementation, reasons = choose(settings.k, self.precision, self.device)
        logger.info("GPU searcher on %s: precision %s (asked %s), %s candidates%s, memory budget %.1f GiB",
                    self.device, self.precision, settings.precision, self.implementation.name,
                    "".join(f" ({r})" for r in reasons), memory_bytes / 2**30)
        self.warm_up()

    def warm_up(self) -> bool:
        """Compile the plan's configuration in this worker before its first block: one search
        of random rows of the plan's block shapes (``SearchSettings.warm_shape``), made on the
        device, with this searcher's k, metric, precision and implementation. Once per worker
        process and configuration (Spark reuses Python workers: a later task's searcher finds
        it done); True when it ran.

        The fused kernel's specialisations follow the shapes, not only d, k and the precision:
        the kernel form (a register list, its segments or the torch path) and the survivor
        test follow the number of targets and of query rows (``_triton_plan.plan_candidates``,
        ``segment_count``, ``skip_share`` in ``nearest_kernels``), and Triton specialises
        integer arguments (rows, targets, dimension) by their divisibility by 16; the re-rank
        kernel the rows' dtypes.
        So the warm-up searches the first query batch's rows against a full target block, in
        the plans' dtypes: the first real pair then finds its first pass compiled (a shorter
        last block, and widening rounds over few rows, may still compile their own forms).
        It costs one search of a block pair, without the host copies."""
        shape = self.settings.warm_shape
        if shape is None:
            return False
        import time

        import torch

        from nearest_kernels.gpu import compile_first_pass, prepare_targets, search_prepared

        q_rows, t_rows, d, q_dtype, t_dtype = shape
        rows = min(q_rows, self._rows_per_batch(q_rows, d))
        key = (str(self.device), self.settings.k, self.settings.metric, self.precision,
               rows, t_rows, d, q_dtype, t_dtype)
        if key in _WARMED or min(rows, t_rows, d) < 1:
            return False
        start = time.perf_counter()
        ctx = torch.cuda.device(self.device) if self._cuda else contextlib.nullcontext()
        with ctx:
            generator = torch.Generator(self.device).manual_seed(0)

            def random(n: int, dtype: str):
                return torch.randn((n, d), generator=generator, device=self.device,
                                   dtype=getattr(torch, dtype))

            compile_first_pass(rows, t_rows, d, self.settings.k, self.settings.metric, self.precision,
                               self.device, (q_dtype, t_dtype))
            targets = prepare_targets(random(t_rows, t_dtype), self.settings.metric, self.precision)
            search_prepared(random(rows, q_dtype), targets, self.settings.k,
                            buffer_bytes=max(64 << 20, rows * ROW_OVERHEAD_BYTES // 2))
            if self._cuda:
                torch.cuda.synchronize(self.device)
        _WARMED.add(key)
        logger.info("warmed up %s: %d x %d rows, d=%d, k=%d, %s %s in %.1f s", self.device, rows, t_rows, d,
                    self.settings.k, self.settings.metric, self.precision, time.perf_counter() - start)
        return True

    def prefetch(self, query_vectors: np.ndarray) -> None:
        """Start copying a one-batch query block to the device before its search is called.

        The one method another thread may call while a search runs: the broadcast plan's
        main thread stages the query block it has just decoded while the worker thread
        searches the previous one, and that block's search then finds it on the device
        (same host memory) instead of copying it first. How the copy runs, how many blocks
        may wait staged and why the worker never waits for it:
        :meth:`udfs.gpu_memory.HostStaging.prefetch`.
        """
        query_vectors = np.asarray(query_vectors)
        if query_vectors.ndim != 2 or query_vectors.shape[0] == 0:
            return
        if self._rows_per_batch(*query_vectors.shape) < query_vectors.shape[0]:
            return
        self.staging.prefetch(query_vectors)

    @property
    def _target_bytes(self) -> int:
        return self._resident.bytes + (self._kept.bytes if self._kept is not None else 0)

    def _resident_targets(self, target_vectors: np.ndarray, target_key, keep: bool = False):
        """The prepared block for ``target_key``, uploading it when it is not resident.

        Blocks stay resident, least recently used first out, while they fit in
        ``TARGET_SHARE`` of the memory budget: a broadcast task meets the same target
        blocks for every query block, so each is copied once per task, not once per pair.
        ``keep``: the block is the same for every task of this stage (a broadcast block):
        it is stored for the stage's next task in this worker, when there is a task scope.
        """
        from nearest_kernels.gpu import (
            kept_sample_rows,
            lower_table_bytes,
            prepare_targets,
            uses_lower_keys,
        )

        target_vectors = np.asarray(target_vectors)
        shared = keep and target_key is not None and self._kept is not None
        store, other = (self._kept, self._resident) if shared else (self._resident, self._kept)
        key = (target_key, self.settings.metric, self.precision) if shared else target_key
        stamp = fingerprint(target_vectors)
        if target_key is not None:
            hit = store.get(key, stamp)
            if hit is not None:
                self._targets = hit
                return hit
        nt, d = target_vectors.shape
        # the prepared block (prepared_bytes) with the sample its searches keep + EXACT mode's
        # lower keys where they are used: the block's two weight rows (kept) and a search's
        # bias table with its temporaries
        rows = nt + kept_sample_rows(nt, d, self.settings.k, self.precision)
        needed = prepared_bytes(rows, d, self.precision, 8 if target_vectors.dtype == np.float64 else 4)
        if uses_lower_keys(self.settings.k, self.precision, d):
            needed += nt * 4 * 2 + lower_table_bytes(nt)
        budget = int(self.memory_bytes * TARGET_SHARE)
        self._targets = None
        # Free before the next block arrives: this kind's oldest first, then the other's.
        for s in (store, other):
            while s is not None and len(s) and self._target_bytes + needed > budget:
                s.pop_oldest()
        if target_key is None:
            self._resident.clear()
        t = self.staging.upload(target_vectors, "targets")
        prepared = prepare_targets(t, self.settings.metric, self.precision)
        size = prepared_bytes(rows, d, self.precision, t.element_size())
        if target_key is not None:
            store.put(key, prepared, size, stamp)
        self._targets = prepared
        return prepared

    def _rows_per_batch(self, nq: int, d: int) -> int:
        if self.batch_rows:
            return max(1, self.batch_rows)
        left = max(self.memory_bytes - self._target_bytes, 256 << 20)
        per_row = 3 * d * 4 + ROW_OVERHEAD_BYTES
        return max(MIN_BATCH_ROWS, min(nq, left // per_row))

    # ------------------------------------------------------------------ search
    def search(self, query_vectors: np.ndarray, target_vectors: np.ndarray,
               target_key: object = None, cap: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of each query row against the target block: numpy in, numpy out.

        Same contract as :func:`nearest_kernels.knn`, ``cap`` included (the kernels'
        limit from their first pass; a row may have fewer than k). ``target_key`` names the
        target block: equal keys reuse the block already on the device.
        """
        v, i = self._search_device(query_vectors, target_vectors, target_key, cap=cap)
        return v.cpu().numpy(), i.cpu().numpy()

    def search_fold(self, query_vectors: np.ndarray, target_vectors: np.ndarray, target_key: object,
                    block_id: int, source: int, state: "DeviceFold | None",
                    keep: bool = False, cap: float | None = None) -> "DeviceFold":
        """Search one target block and fold it into ``state`` on the device.

        The running top-k of a query block stays on the device across its target blocks:
        a fold is a sort of (nq, 2k) there, not a host merge of numpy arrays. Slots are
        ordered by (value, global key ``block_id << ROW_BITS | row``), the tie rule of
        :func:`nearest_kernels.merge_topk`. ``source`` tags the block's slots (the
        caller's payload table). The fold's host copy starts at once; read it with
        :meth:`DeviceFold.to_numpy` from any thread. ``keep``: a broadcast block, kept for
        the stage's next task (see :meth:`_resident_targets`). ``cap``: as in :meth:`search`
        (a capped block's empty slots fold like a short block's).
        """
        import torch

        from nearest_kernels import resolve_metric
        from nearest_kernels.gpu import best_order

        from .columns import ROW_BITS

        metric = resolve_metric(self.settings.metric)
        v, i = self._search_device(query_vectors, target_vectors, target_key, keep, cap=cap)
        ctx = torch.cuda.device(self.device) if self._cuda else contextlib.nullcontext()
        with ctx:
            filled = i >= 0
            keys = torch.where(filled, (int(block_id) << ROW_BITS) | i, -1)
            src = torch.where(filled, int(source), -1).to(torch.int32)
            if state is not None:
                v = torch.cat([state.values, v], dim=1)
                keys = torch.cat([state.keys, keys], dim=1)
                src = torch.cat([state.source, src], dim=1)
                i = torch.cat([state.rows, i], dim=1)
                order = best_order(v, keys, self.settings.k, metric.descending)
                v, keys, src, i = (torch.gather(x, 1, order) for x in (v, keys, src, i))
            return DeviceFold.start(v, keys, src, i, self._cuda)

    def _search_device(self, query_vectors: np.ndarray, target_vectors: np.ndarray, target_key,
                       keep: bool = False, cap: float | None = None):
        """(values, indices) on the device for the whole query block."""
        import torch

        from nearest_kernels import resolve_metric
        from nearest_kernels.gpu import search_prepared

        k, metric = self.settings.k, resolve_metric(self.settings.metric)
        query_vectors = np.asarray(query_vectors)
        nq, d = query_vectors.shape
        values = torch.full((nq, k), metric.worst, dtype=torch.float32, device=self.device)
        indices = torch.full((nq, k), -1, dtype=torch.int64, device=self.device)
        if nq == 0 or target_vectors.shape[0] == 0:
            return values, indices
        ctx = torch.cuda.device(self.device) if self._cuda else contextlib.nullcontext()
        with ctx:
            targets = self._resident_targets(target_vectors, target_key, keep)
            rows = self._rows_per_batch(nq, d)
            buffer_bytes = max(64 << 20, rows * ROW_OVERHEAD_BYTES // 2)
            starts = list(range(0, nq, rows))
            compute = torch.cuda.current_stream(self.device) if self._cuda else None
            # Two staging slots: batch i+1 is copied (side stream) while batch i is searched.
            # A query block that fits one batch stays on the device for the next call with
            # the same array (the broadcast plan searches it against every target block).
            cached = self._query_cache
            one = len(starts) == 1
            if one and cached is not None and same_memory(cached[0], query_vectors):
                pending = (cached[1], None)
            else:
                pending = (self.staging.take_prefetched(query_vectors) if one else None) or \
                    self._stage(query_vectors, starts, 0)
                self._query_cache = (query_vectors, pending[0]) if one else None
            for n, start in enumerate(starts):
                stop = min(nq, start + rows)
                q_dev, ready = pending
                if n + 1 < len(starts):
                    pending = self._stage(query_vectors, starts, n + 1)
                if ready is not None:
                    compute.wait_event(ready)
                v, i = search_prepared(q_dev, targets, k, buffer_bytes=buffer_bytes, cap=cap)
                if self._cuda:
                    q_dev.record_stream(compute)
                values[start:stop] = v
                indices[start:stop] = i
        return values, indices

    def _stage(self, query_vectors: np.ndarray, starts: list[int], n: int):
        """Copy batch ``n`` host -> device; returns (device tensor, event or None)."""
        import torch

        start = starts[n]
        stop = starts[n + 1] if n + 1 < len(starts) else query_vectors.shape[0]
        slot = f"queries{n % 2}"
        if not self._cuda:
            return self.staging.upload(query_vectors[start:stop], slot), None
        copy_stream = self.staging.copy_stream
        # The slot's previous copy must have finished before it is overwritten.
        copy_stream.synchronize()
        q_dev = self.staging.upload(query_vectors[start:stop], slot, stream=copy_stream)
        ready = torch.cuda.Event()
        ready.record(copy_stream)
        return q_dev, ready
