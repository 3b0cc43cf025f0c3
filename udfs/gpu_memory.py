"""What a GPU searcher holds: host buffers on the way to its device, and target blocks on it.

**Host staging** (:class:`HostStaging`): reusable host buffers (pinned on CUDA; the copy into
them split over the task's threads by ``udfs.payload.copy_into``), uploads through them, on a
side stream when asked, and the query blocks another thread staged ahead of their search
(:meth:`HostStaging.prefetch`). Works on a CPU ``torch.device`` too (no streams, no pinning).

**Prepared target blocks** (:class:`TargetStore`): held by key, least recently used first,
with their device bytes (:func:`prepared_bytes`); a searcher keeps one for its own task.
Broadcast blocks, the same for every task of a stage, are kept per device for the next task
of that stage that this Python worker runs (:func:`kept_targets`; Spark reuses workers): the
first searcher opened for any other stage frees them, and a cheap fingerprint
(:func:`fingerprint`) guards every reuse.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np

from .payload import copy_into

logger = logging.getLogger(__name__)

# Query blocks prefetch() may hold staged on the device, each in its own pinned host slot.
PREFETCH_SLOTS = 2


def same_memory(held: np.ndarray, array: np.ndarray) -> bool:
    """``array`` views the same memory as ``held`` (which we keep alive, so it cannot be reused)."""
    if held is array:
        return True
    a, b = held.__array_interface__, array.__array_interface__
    return (a["data"] == b["data"] and a["shape"] == b["shape"] and a["strides"] == b["strides"]
            and held.dtype == array.dtype)


class HostStaging:
    """One searcher's host buffers, copy stream and prefetched query blocks on ``device``."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._pinned: dict[str, torch.Tensor] = {}
        self.ahead: list = []           # [(host array, device tensor, event, slot)] from prefetch()
        self._ahead_lock = threading.Lock()

    def host_buffer(self, name: str, shape: tuple[int, ...], dtype) -> "torch.Tensor":
        """A reusable (pinned on CUDA) host tensor of at least ``shape``."""
        import torch

        numel = int(np.prod(shape))
        buf = self._pinned.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=self._cuda)
            self._pinned[name] = buf
        return buf[:numel].view(shape)

    def upload(self, array: np.ndarray, name: str, stream=None) -> "torch.Tensor":
        """``array`` on the device: float64 rows stay float64 (the search re-ranks from the
        rows as given: a float32 staging copy would lose what float64 inputs resolve), any
        other dtype arrives as float32."""
        import torch

        dtype = torch.float64 if array.dtype == np.float64 else torch.float32
        host = self.host_buffer(name, array.shape, dtype)
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
        """Start copying a one-batch query block to the device before its search is called
        (:meth:`udfs.gpu_search.GpuBlockSearcher.prefetch` says when).

        The copy runs on the copy stream from its own pinned slot. ``PREFETCH_SLOTS`` blocks
        may wait staged (the main thread can decode the next block before the worker has
        taken the previous one: at a task's start the first search waits for the target
        block); a further one replaces the oldest, whose copy is waited for first. One caller
        at a time (the main thread); the lock is not held during the copy, so the worker's
        search never waits for it (when it was, a task's first search waited for the copy).
        """
        import torch

        with self._ahead_lock:
            if any(same_memory(entry[0], query_vectors) for entry in self.ahead):
                return
            oldest = self.ahead.pop(0) if len(self.ahead) >= PREFETCH_SLOTS else None
            used = {entry[3] for entry in self.ahead}
        slot = next(f"ahead{n}" for n in range(PREFETCH_SLOTS) if f"ahead{n}" not in used)
        if oldest is not None and oldest[2] is not None:
            oldest[2].synchronize()              # its copy read the pinned slot
        if self._cuda:
            with torch.cuda.device(self.device):
                q_dev = self.upload(query_vectors, slot, stream=self.copy_stream)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
        else:
            q_dev, ready = self.upload(query_vectors, slot), None
        with self._ahead_lock:
            self.ahead.append((query_vectors, q_dev, ready, slot))

    def take_prefetched(self, query_vectors: np.ndarray):
        """(device tensor, event) staged by :meth:`prefetch` for this array, or None. Blocks
        staged before it are dropped (blocks are searched in the order they were staged)."""
        with self._ahead_lock:
            for n, entry in enumerate(self.ahead):
                if same_memory(entry[0], query_vectors):
                    break
            else:
                return None
            del self.ahead[:n + 1]
            if entry[2] is not None:
                entry[2].synchronize()   # done (long ago, as a rule): the slot is free again
            return entry[1], entry[2]


# -- prepared target blocks ---------------------------------------------------------------------

def prepared_bytes(nt: int, d: int, precision: str, source_bytes: int) -> int:
    """Device bytes of a prepared target block of ``nt`` x ``d``: its rows as uploaded
    (``source_bytes`` an element, the re-rank's input), the float32 working rows and the
    product's operand (bf16: 2 bytes; tf32: 4; fp32 reads the working rows), so about 10
    bytes an element in bf16 and 12 in tf32 for float32 input."""
    operand = {"bf16": 2, "tf32": 4, "fp32": 0}[precision]
    return nt * d * (source_bytes + 4 + operand)


def fingerprint(vectors: np.ndarray) -> tuple:
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
