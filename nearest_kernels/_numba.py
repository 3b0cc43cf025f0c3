"""Where numba caches compiled kernels, and how a kernel runs on several threads: the set-up
every numba module of the package shares.

Import this module before numba (``cpu`` and ``gather`` do, first): the cache directory is
read when numba loads.

**Threads.** No kernel uses numba's ``parallel=True``: its parallel lowering (a gufunc and a
threading layer per function) cost seconds of compilation per kernel in every process whose
cache is cold, the first thing a new executor pays, and concurrent parallel calls from two
threads abort the process under numba's default threading layer. Each kernel is instead a
serial ``nogil`` loop over a range of rows, ``kernel(lo, hi, *args)``, and :func:`run_split`
runs it over ``threads`` contiguous ranges on a shared thread pool (the GIL released inside):
the same static split numba's ``prange`` made, any number of callers at once.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["compile_lock", "ensure_numba_cache_dir", "frozen", "import_numba", "run_split", "task_threads",
           "threads_of_task"]


def frozen(*arrays):
    """Read-only views of ``arrays`` (one array: its view). numba compiles a kernel once per
    argument type, and a read-only array is another type than a writable one: every array a
    kernel only reads is passed read-only by its wrapper, whatever the caller holds (Arrow's
    buffers are read-only, numpy's results writable), so that each kernel compiles one variant
    per dtype, not one per mix of flags (seconds each, in every process with a cold cache).
    Anything not an array (None for an absent argument) passes as it is."""
    views = []
    for array in arrays:
        if hasattr(array, "flags"):
            array = array.view()
            array.flags.writeable = False
        views.append(array)
    return views[0] if len(views) == 1 else tuple(views)


def ensure_numba_cache_dir() -> None:
    """Point numba's cache at a writable directory when the package directory is not one.

    numba caches next to the source file by default. On executors the package often lives in a
    read-only site-packages; without a writable cache every Spark task would recompile (seconds).
    Must run before numba compiles the kernels; an explicit NUMBA_CACHE_DIR always wins.
    """
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    if os.access(here, os.W_OK):
        return
    for candidate in (
        os.path.join(os.path.expanduser("~"), ".cache", "nearest_join", "numba"),
        os.path.join(tempfile.gettempdir(), f"nearest_join-numba-{os.getuid()}"),
    ):
        try:
            os.makedirs(candidate, exist_ok=True)
        except OSError:
            continue
        if os.access(candidate, os.W_OK):
            os.environ["NUMBA_CACHE_DIR"] = candidate
            if "numba" in sys.modules:  # already imported: config was read, set it directly
                sys.modules["numba"].config.CACHE_DIR = candidate
            return


ensure_numba_cache_dir()

_numba_import = threading.Lock()


def import_numba() -> None:
    """Import numba, one thread of the process at a time: every module of ours that uses
    numba calls this before its first ``from numba import ...``, and so does the kernel
    warm-up thread. Two threads importing numba for the first time at once can each hold an
    import lock of numba's own modules that the other waits for; Python breaks that deadlock
    by handing one of them a partially initialised module (seen on a local master's driver:
    the warm-up thread's ``numba.core.event`` without ``start_event`` while the approx
    planner imported k-means)."""
    with _numba_import:
        import numba  # noqa: F401


@contextlib.contextmanager
def compile_lock():
    """Held by one process of the machine at a time, per numba cache directory: processes that
    would compile the same kernels at once (a local master's driver and workers, an executor's
    workers) take turns, the first compiling into the cache and the others loading from it,
    instead of each compiling on the same cores. Without a writable directory, no lock."""
    import fcntl

    directory = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                  "__pycache__")
    try:
        os.makedirs(directory, exist_ok=True)
        handle = open(os.path.join(directory, "nearest_join-compile.lock"), "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

# The threads a kernel call splits its rows over when not told: the caller's share of cores,
# set by :func:`task_threads` around a search (per thread: each task of a process has its own).
_TASK_THREADS: contextvars.ContextVar[int] = contextvars.ContextVar("nearest_join_threads", default=1)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


@contextlib.contextmanager
def task_threads(threads: int):
    """Within the block, kernels split their rows over ``threads`` threads by default."""
    token = _TASK_THREADS.set(max(1, int(threads)))
    try:
        yield
    finally:
        _TASK_THREADS.reset(token)


def threads_of_task() -> int:
    """The threads :func:`task_threads` set for this thread (1 outside it)."""
    return _TASK_THREADS.get()


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            # Tasks never wait on the pool, so callers sharing it cannot deadlock; the width
            # only bounds how many ranges of all callers run at once.
            _pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1),
                                       thread_name_prefix="nearest_join-kernel")
        return _pool


def run_split(kernel, n: int, *args, threads: int | None = None) -> None:
    """``kernel(lo, hi, *args)`` over ``threads`` (default :func:`threads_of_task`) contiguous
    ranges of ``range(n)``: the first on the calling thread, the others on the shared pool.
    ``kernel`` must release the GIL (numba ``nogil=True``) for the ranges to run at once."""
    parts = max(1, min(threads or threads_of_task(), n))
    if parts == 1:
        kernel(0, n, *args)
        return
    bounds = [n * p // parts for p in range(parts + 1)]
    futures = [_shared_pool().submit(kernel, bounds[p], bounds[p + 1], *args) for p in range(1, parts)]
    try:
        kernel(bounds[0], bounds[1], *args)
    finally:
        for future in futures:
            future.result()
