"""Prepared target blocks a GPU searcher keeps on its device, within and across tasks.

:class:`TargetStore` holds prepared blocks by key, least recently used first, with their
device bytes (:func:`prepared_bytes`); a searcher keeps one for its own task. Broadcast blocks,
the same for every task of a stage, are kept per device for the next task of that stage that
this Python worker runs (:func:`kept_targets`; Spark reuses workers): the first searcher opened
for any other stage frees them, and a cheap fingerprint (:func:`fingerprint`) guards every
reuse.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

logger = logging.getLogger(__name__)


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
