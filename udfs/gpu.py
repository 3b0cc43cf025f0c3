"""GPU block searcher for executors: the task's GPU, a resident target block, pipelined copies.

:func:`gpu_searcher_or_none` is what :func:`udfs.searcher.open_block_searcher` calls for
``backend="auto"`` / ``"gpu"``. It returns None when torch or a CUDA device is missing, so a
CPU executor needs no configuration. Otherwise the searcher

* uses the GPU Spark assigned to the task (``TaskContext.resources()["gpu"].addresses[0]``);
  outside Spark, the address :func:`local_task` names (tests and benchmarks that simulate
  executors, ``udfs.local.local_join``), else device 0;
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

pyspark is imported lazily (the GPU benchmark machines have none).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .rows import copy_into
from .searcher import SearchSettings

logger = logging.getLogger(__name__)

# Share of the free device memory (at open) a searcher may use for targets and batches.
MEMORY_FRACTION = 0.7
# Per query row, beyond its vectors: candidate buffer (<= 2048 int64 slots), keys, indices,
# re-rank temporaries. Generous on purpose; the kernel chunks inside this budget.
ROW_OVERHEAD_BYTES = 64 << 10
MIN_BATCH_ROWS = 1024
# Share of the memory budget resident target blocks may hold (the rest: query batches).
TARGET_SHARE = 0.5
# Query blocks prefetch() may hold staged on the device, each in its own pinned host slot.
PREFETCH_SLOTS = 2


def memory_budget(available: int, total: int, share: float = 1.0) -> int:
    """A searcher's device memory budget: ``MEMORY_FRACTION`` of what is available to it, and
    of no more than its task's ``share`` of the device (``spark.task.resource.gpu.amount``
    0.5: two tasks' workers open on one GPU at once, each would otherwise see it all free)."""
    return int(min(available, total * min(1.0, share)) * MEMORY_FRACTION)


def _task_context():
    """This task's ``pyspark.TaskContext``, or None outside Spark (or without pyspark)."""
    try:
        from pyspark import TaskContext  # only present inside Spark
    except ImportError:
        return None
    return TaskContext.get()


@dataclass(frozen=True)
class LocalTask:
    """What a Spark task context tells the searcher, for searches run outside Spark
    (:func:`local_task`): the task's GPU address and the scope of kept target blocks."""

    gpu: str | None = None
    scope: str | None = None


# Outside Spark: the task this process (all its threads) simulates; see local_task.
_LOCAL_TASK = LocalTask()


@contextlib.contextmanager
def local_task(gpu: str | None = None, scope: str | None = None):
    """Searchers opened inside run as a Spark task with GPU address ``gpu`` in a stage named
    ``scope`` would (tests, benchmarks that simulate executors, ``udfs.local.local_join``).
    Process-wide, not per thread: a simulated task's searches may run on a worker thread.
    Inside Spark the task context decides and this is ignored."""
    global _LOCAL_TASK
    before = _LOCAL_TASK
    _LOCAL_TASK = LocalTask(gpu, scope)
    try:
        yield
    finally:
        _LOCAL_TASK = before


def task_gpu_address() -> str | None:
    """The GPU address Spark assigned to this task, else the :func:`local_task`'s, else None."""
    ctx = _task_context()
    if ctx is not None:
        gpu = ctx.resources().get("gpu")
        if gpu is not None and gpu.addresses:
            return str(gpu.addresses[0])
        return None
    return _LOCAL_TASK.gpu


def task_scope() -> str | None:
    """What the tasks that may share kept target blocks have in common.

    Inside Spark the SQL execution and the stage: all tasks of a broadcast stage read the
    same broadcast target (a retried stage keeps its id and its broadcast), and stage ids do
    not repeat within an application (a re-run of the same DataFrame is a new execution and
    new stages). Outside Spark the :func:`local_task`'s scope, else None (nothing is kept
    past the searcher).
    """
    ctx = _task_context()
    if ctx is not None:
        return f"execution {ctx.getLocalProperty('spark.sql.execution.id')} stage {ctx.stageId()}"
    return _LOCAL_TASK.scope


def address_to_ordinal(address: str) -> int:
    """CUDA ordinal of a Spark GPU address.

    ``conf/gpu_discovery.sh`` reports CUDA ordinals as the executor sees them (already
    renumbered when the cluster manager set ``CUDA_VISIBLE_DEVICES``), so the address is the
    ordinal.
    """
    try:
        return int(address)
    except ValueError:
        raise ValueError(f"GPU address: expected a CUDA ordinal, got {address!r}") from None


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


def prepared_bytes(nt: int, d: int, precision: str, source_bytes: int) -> int:
    """Device bytes of a prepared target block of ``nt`` x ``d``: its rows as uploaded
    (``source_bytes`` an element, the re-rank's input), the float32 working rows and the
    product's operand (bf16: 2 bytes; tf32: 4; fp32 reads the working rows), so about 10
    bytes an element in bf16 and 12 in tf32 for float32 input."""
    operand = {"bf16": 2, "tf32": 4, "fp32": 0}[precision]
    return nt * d * (source_bytes + 4 + operand)


def _same_memory(held: np.ndarray, array: np.ndarray) -> bool:
    """``array`` views the same memory as ``held`` (which we keep alive, so it cannot be reused)."""
    if held is array:
        return True
    a, b = held.__array_interface__, array.__array_interface__
    return (a["data"] == b["data"] and a["shape"] == b["shape"] and a["strides"] == b["strides"]
            and held.dtype == array.dtype)


def _fingerprint(vectors: np.ndarray) -> tuple:
    """Shape, dtype and three rows of a target block: a reused block must match them."""
    n = vectors.shape[0]
    rows = vectors[[0, n // 2, n - 1]] if n else vectors[:0]
    return vectors.shape, vectors.dtype.str, np.ascontiguousarray(rows).tobytes()


class TargetStore:
    """Prepared target blocks by key, least recently used first, with their device bytes."""

    def __init__(self):
        self._entries: OrderedDict = OrderedDict()   # key -> (PreparedTargets, bytes, fingerprint)
        self.bytes = 0

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def prepared(self, key):
        """The block stored under ``key`` (tests)."""
        return self._entries[key][0]

    def get(self, key, fingerprint):
        """The block for ``key`` if it is stored and matches ``fingerprint``, else None."""
        hit = self._entries.get(key)
        if hit is None:
            return None
        if hit[2] != fingerprint:
            logger.warning("target block %r changed under the same key: uploaded again", key)
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return hit[0]

    def put(self, key, prepared, size: int, fingerprint) -> None:
        self._entries[key] = (prepared, size, fingerprint)
        self.bytes += size

    def pop_oldest(self) -> None:
        self._drop(next(iter(self._entries)))

    def _drop(self, key) -> None:
        _, size, _ = self._entries.pop(key)
        self.bytes -= size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


# Per device: (task scope, target blocks kept for the next task of that scope).
_KEPT: dict[str, tuple[str, TargetStore]] = {}


def kept_targets(device, scope: str | None) -> TargetStore | None:
    """The store of blocks kept on ``device`` for ``scope``; a new scope frees the old one's.

    None for no scope: then whatever is kept for another scope is freed as well (a worker
    serves one stage at a time, and the memory is the new task's).
    """
    name = str(device)
    held = _KEPT.get(name)
    if held is not None and held[0] == scope:
        return held[1]
    if held is not None:
        held[1].clear()
        del _KEPT[name]
        logger.info("freed the target blocks kept on %s for %s", name, held[0])
        if scope is None:
            _release_cached_memory(device)
    if scope is None:
        return None
    store = TargetStore()
    _KEPT[name] = (scope, store)
    return store


def _release_cached_memory(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class GpuBlockSearcher:
    """Searches query blocks against a resident target block on one device.

    Works on a CPU ``torch.device`` too (no streams, no pinning): the tests here use that.
    """

    def __init__(self, settings: SearchSettings, device, *, memory_bytes: int | None = None,
                 batch_rows: int | None = None):
        import torch

        from nearest_join.kernels.gpu import choose, resolve_precision

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
        self._ahead: list = []           # [(host array, device tensor, event, slot)] from prefetch()
        self._ahead_lock = threading.Lock()
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._pinned: dict[str, torch.Tensor] = {}
        self.implementation, reasons = choose(settings.k, self.precision, self.device)
        logger.info("GPU searcher on %s: precision %s (asked %s), %s candidates%s, memory budget %.1f GiB",
                    self.device, self.precision, settings.precision, self.implementation.name,
                    "".join(f" ({r})" for r in reasons), memory_bytes / 2**30)

    # ------------------------------------------------------------------ host staging
    def _host_buffer(self, name: str, shape: tuple[int, ...], dtype) -> "torch.Tensor":
        """A reusable (pinned on CUDA) host tensor of at least ``shape``."""
        import torch

        numel = int(np.prod(shape))
        buf = self._pinned.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=self._cuda)
            self._pinned[name] = buf
        return buf[:numel].view(shape)

    def _upload(self, array: np.ndarray, name: str, stream=None) -> "torch.Tensor":
        """``array`` on the device: float64 rows stay float64 (the search re-ranks from the
        rows as given: a float32 staging copy would lose what float64 inputs resolve), any
        other dtype arrives as float32."""
        import torch

        dtype = torch.float64 if array.dtype == np.float64 else torch.float32
        host = self._host_buffer(name, array.shape, dtype)
        # One pass, in the task's threads: converts and packs into pinned memory (a single
        # thread's memcpy is slower than the PCIe copy that follows).
        copy_into(host.numpy(), array)
        if stream is None:
            # On a CPU device ``to`` would return the staging buffer itself, which the next
            # upload overwrites: copy, as a device would.
            return host.to(self.device, non_blocking=self._cuda, copy=not self._cuda)
        with torch.cuda.stream(stream):
            return host.to(self.device, non_blocking=True)

    def prefetch(self, query_vectors: np.ndarray) -> None:
        """Start copying a one-batch query block to the device before its search is called.

        The one method another thread may call while a search runs: the broadcast plan's
        main thread stages the query block it has just decoded while the worker thread
        searches the previous one, and that block's search then finds it on the device
        (same host memory) instead of copying it first. The copy runs on the copy stream
        from its own pinned slot. ``PREFETCH_SLOTS`` blocks may wait staged (the main thread
        can decode the next block before the worker has taken the previous one: at a task's
        start the first search waits for the target block); a further one replaces the
        oldest, whose copy is waited for first. One caller at a time (the main thread); the
        lock is not held during the copy, so the worker's search never waits for it (when
        it was, a task's first search waited for the copy).
        """
        import torch

        query_vectors = np.asarray(query_vectors)
        if query_vectors.ndim != 2 or query_vectors.shape[0] == 0:
            return
        if self._rows_per_batch(*query_vectors.shape) < query_vectors.shape[0]:
            return
        with self._ahead_lock:
            if any(_same_memory(entry[0], query_vectors) for entry in self._ahead):
                return
            oldest = self._ahead.pop(0) if len(self._ahead) >= PREFETCH_SLOTS else None
            used = {entry[3] for entry in self._ahead}
        slot = next(f"ahead{n}" for n in range(PREFETCH_SLOTS) if f"ahead{n}" not in used)
        if oldest is not None and oldest[2] is not None:
            oldest[2].synchronize()              # its copy read the pinned slot
        if self._cuda:
            with torch.cuda.device(self.device):
                q_dev = self._upload(query_vectors, slot, stream=self._copy_stream)
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
        else:
            q_dev, ready = self._upload(query_vectors, slot), None
        with self._ahead_lock:
            self._ahead.append((query_vectors, q_dev, ready, slot))

    def _take_prefetched(self, query_vectors: np.ndarray):
        """(device tensor, event) staged by :meth:`prefetch` for this array, or None. Blocks
        staged before it are dropped (blocks are searched in the order they were staged)."""
        with self._ahead_lock:
            for n, entry in enumerate(self._ahead):
                if _same_memory(entry[0], query_vectors):
                    break
            else:
                return None
            del self._ahead[:n + 1]
            if entry[2] is not None:
                entry[2].synchronize()   # done (long ago, as a rule): the slot is free again
            return entry[1], entry[2]

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
        from nearest_join.kernels._gpu_torch import lower_table_bytes
        from nearest_join.kernels.gpu import prepare_targets, uses_lower_keys

        target_vectors = np.asarray(target_vectors)
        shared = keep and target_key is not None and self._kept is not None
        store, other = (self._kept, self._resident) if shared else (self._resident, self._kept)
        key = (target_key, self.settings.metric, self.precision) if shared else target_key
        fingerprint = _fingerprint(target_vectors)
        if target_key is not None:
            hit = store.get(key, fingerprint)
            if hit is not None:
                self._targets = hit
                return hit
        nt, d = target_vectors.shape
        # the prepared block (prepared_bytes) + EXACT mode's lower keys where they are used:
        # the block's two weight rows (kept) and a search's bias table with its temporaries
        needed = prepared_bytes(nt, d, self.precision, 8 if target_vectors.dtype == np.float64 else 4)
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
        t = self._upload(target_vectors, "targets")
        prepared = prepare_targets(t, self.settings.metric, self.precision)
        size = prepared_bytes(nt, d, self.precision, t.element_size())
        if target_key is not None:
            store.put(key, prepared, size, fingerprint)
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
               target_key: object = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of each query row against the target block: numpy in, numpy out.

        Same contract as :func:`nearest_join.kernels.knn`. ``target_key`` names the target
        block: equal keys reuse the block already on the device.
        """
        v, i = self._search_device(query_vectors, target_vectors, target_key)
        return v.cpu().numpy(), i.cpu().numpy()

    def search_fold(self, query_vectors: np.ndarray, target_vectors: np.ndarray, target_key: object,
                    block_id: int, source: int, state: "DeviceFold | None",
                    keep: bool = False) -> "DeviceFold":
        """Search one target block and fold it into ``state`` on the device.

        The running top-k of a query block stays on the device across its target blocks:
        a fold is a sort of (nq, 2k) there, not a host merge of numpy arrays. Slots are
        ordered by (value, global key ``block_id << ROW_BITS | row``), the tie rule of
        :func:`nearest_join.kernels.merge_topk`. ``source`` tags the block's slots (the
        caller's payload table). The fold's host copy starts at once; read it with
        :meth:`DeviceFold.to_numpy` from any thread. ``keep``: a broadcast block, kept for
        the stage's next task (see :meth:`_resident_targets`).
        """
        import torch

        from nearest_join.kernels import resolve_metric
        from nearest_join.kernels._gpu_torch import best_order

        from .columns import ROW_BITS

        metric = resolve_metric(self.settings.metric)
        v, i = self._search_device(query_vectors, target_vectors, target_key, keep)
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
                       keep: bool = False):
        """(values, indices) on the device for the whole query block."""
        import torch

        from nearest_join.kernels import resolve_metric
        from nearest_join.kernels.gpu import search_prepared

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
            if one and cached is not None and _same_memory(cached[0], query_vectors):
                pending = (cached[1], None)
            else:
                pending = (self._take_prefetched(query_vectors) if one else None) or \
                    self._stage(query_vectors, starts, 0)
                self._query_cache = (query_vectors, pending[0]) if one else None
            for n, start in enumerate(starts):
                stop = min(nq, start + rows)
                q_dev, ready = pending
                if n + 1 < len(starts):
                    pending = self._stage(query_vectors, starts, n + 1)
                if ready is not None:
                    compute.wait_event(ready)
                v, i = search_prepared(q_dev, targets, k, buffer_bytes=buffer_bytes)
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
            return self._upload(query_vectors[start:stop], slot), None
        # The slot's previous copy must have finished before it is overwritten.
        self._copy_stream.synchronize()
        q_dev = self._upload(query_vectors[start:stop], slot, stream=self._copy_stream)
        ready = torch.cuda.Event()
        ready.record(self._copy_stream)
        return q_dev, ready



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
