"""Compiled Triton kernels outside their launches: whether one loads, and compilations ahead.

:func:`load_refusal` compiles a kernel for a launch's arguments without launching it and says
why the device cannot load it (shared memory or registers over its limits), so that a
launcher can try its next configuration (``_triton_candidates``, ``_triton_filter``).
:data:`AHEAD` runs compilations on threads: ``_triton_warmup.compile_ahead`` starts them
before a search prepares its blocks, and every launcher waits for them before its first
launch instead of compiling the same kernel again.
"""
from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)

# Verdicts of load_refusal: (kernel name, compiled kernel's hash, device) -> None or the refusal.
_LOAD_VERDICTS: dict[tuple, str | None] = {}


def load_refusal(kernel, grid, args, kwargs, device: torch.device) -> str | None:
    """Why the compiled ``kernel`` for these arguments cannot run on ``device`` (shared
    memory or registers over its limits, read from the compiled kernel's metadata as the
    launch would), or None. Compiles without launching (``warmup``); the launch that follows
    reuses the compiled kernel. Under the interpreter nothing is compiled: None."""
    if device.type != "cuda":
        return None
    from triton.runtime.errors import OutOfResources

    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), compiled.hash, str(device))
    if key not in _LOAD_VERDICTS:
        try:
            compiled._init_handles()
            verdict = None
        except OutOfResources as exc:
            verdict = str(exc)
        _LOAD_VERDICTS[key] = verdict
    return _LOAD_VERDICTS[key]


class _CompileAhead:
    """The compilation of a search's first candidate pass started on a thread before the
    search prepares its blocks (:func:`compile_ahead`): the target preparation's own kernel
    compiles meanwhile (Triton's compiler releases the GIL), and the first launch waits for
    it (:meth:`wait`) instead of compiling the same kernel again."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._started: set = set()
        self._running = 0

    def start(self, key, work) -> bool:
        with self._lock:
            if key in self._started:
                return False
            self._started.add(key)
            self._running += 1
            self._idle.clear()

        def run():
            try:
                work()
            except Exception:   # the launch compiles it then, and reports what fails
                logger.debug("compiling ahead %s failed", key, exc_info=True)
            finally:
                with self._lock:
                    self._running -= 1
                    if not self._running:
                        self._idle.set()

        threading.Thread(target=run, name="nj-compile-ahead", daemon=True).start()
        return True

    def wait(self) -> None:
        self._idle.wait()


AHEAD = _CompileAhead()
