"""Per-task search set-up: choose the backend and device once, then search block after block.

A Spark task builds one :class:`BlockSearcher` (device choice, thread share, JIT warm-up) and
streams its blocks through it. The GPU searcher (``udfs.gpu``) keeps the current target block
resident on the device, keyed by ``target_key``, so that many query blocks against the same
target block copy it once.
"""
from __future__ import annotations

import logging
import threading

import numpy as np

from nearest_kernels import knn

from .context import SearchSettings, cuda_may_exist, task_cpus

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
    import torch where no NVIDIA device can exist: :func:`cuda_may_exist`). The choice and
    the reasons of the backends refused before it are logged.
    """
    from nearest_kernels.dispatch import choose_task_backend

    skip = {}
    if settings.backend == "auto" and not cuda_may_exist():
        skip["gpu"] = "no GPU assigned to this task and no NVIDIA driver on this host"
    name, reasons = choose_task_backend(settings.backend, skip=skip)
    if name == "gpu":
        from .gpu import gpu_searcher_or_none

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
