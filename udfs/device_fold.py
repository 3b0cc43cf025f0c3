"""A query block's running top-k on a GPU searcher's device, and its host copy in flight.

:meth:`udfs.gpu.GpuBlockSearcher.search_fold` folds each target block's results into a
:class:`DeviceFold` on the device; the broadcast plan reads it back once per query block.
"""
from __future__ import annotations

import numpy as np


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
