"""Where numba caches compiled kernels, and whether its threading layer takes parallel calls
from several threads at once: the set-up every numba module of the package shares.

Import this module before numba (``cpu`` and ``gather`` do, first): the cache directory is
read when numba loads.
"""
from __future__ import annotations

import os
import sys
import tempfile

__all__ = ["ensure_numba_cache_dir", "parallel_calls_threadsafe"]


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

_THREADSAFE: bool | None = None


def parallel_calls_threadsafe() -> bool:
    """Whether numba's threading layer takes parallel calls from several threads at once.

    tbb and omp do; workqueue aborts the process on a concurrent call. The layer is the one
    already running, else the one numba will load: the first importable of its priority
    list (or the configured one).
    """
    global _THREADSAFE
    if _THREADSAFE is None:
        import numba

        try:
            layer = numba.threading_layer()
        except ValueError:                      # no parallel call yet: predict numba's choice
            layer = numba.config.THREADING_LAYER
            if layer == "default":
                layer = "workqueue"
                for name in numba.config.THREADING_LAYER_PRIORITY:
                    if name == "workqueue" or _layer_loadable(name):
                        layer = name
                        break
        _THREADSAFE = layer in ("tbb", "omp", "safe", "threadsafe")
    return _THREADSAFE


def _layer_loadable(name: str) -> bool:
    try:
        __import__(f"numba.np.ufunc.{name}pool")
    except Exception:   # noqa: BLE001 (missing libtbb / libgomp: numba cannot load it either)
        return False
    return True
