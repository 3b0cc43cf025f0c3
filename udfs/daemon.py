"""Spark's Python worker daemon (``pyspark.daemon``) for executors that run nearest_join:
``spark.python.daemon.module: udfs.daemon`` (set in ``conf/*.yaml``). Three changes, all to
what a new executor pays before its first search:

* **pyspark from its installed package.** Spark puts ``pyspark.zip`` first on the workers'
  ``PYTHONPATH``, and Python compiles every module it imports from a zip again in every
  process (a zip holds no bytecode it may write). Where the executor's interpreter has the
  same pyspark version installed, its package (compiled once, at install or first import) is
  put first instead. Another version leaves the path as Spark set it.
* **Imports before the first fork.** The daemon imports what every worker's first task
  imports (numpy, pyarrow, pandas, numba, scipy's BLAS, the executor functions) and sets up
  numba's CPU target, once: the forked workers share them instead of each paying them.
* **No full garbage collection after every task.** ``pyspark.daemon`` runs ``gc.collect()``
  after each task of a reused worker; once numpy, pyarrow, numba and the kernels are loaded,
  that walk costs more than a small task. A reused worker freezes what survives its first
  tasks out of the cyclic collector (``gc.freeze``); frozen objects are still freed by
  reference counting, only cycles among them are never collected.

numba compiles and loads no kernel here: kernels compile (or load from numba's cache) on their
first call in a worker, or earlier on a worker's warm-up thread (:mod:`udfs.warm`).
"""
from __future__ import annotations

import gc
import os
import sys
import zipfile


def _zip_version(path: str) -> str | None:
    """The pyspark version inside ``pyspark.zip`` at ``path`` (its ``pyspark/version.py``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            text = archive.read("pyspark/version.py").decode()
    except (OSError, KeyError, zipfile.BadZipFile):
        return None
    scope: dict = {}
    try:
        exec(compile(text, "pyspark/version.py", "exec"), scope)   # one assignment: __version__
    except Exception:  # noqa: BLE001 (an unreadable file: keep Spark's path)
        return None
    return scope.get("__version__")


def _installed_version() -> tuple[str, str] | None:
    """(version, the directory holding the package) of a pyspark installed beside this
    interpreter, found without importing it."""
    import importlib.machinery

    for entry in sys.path:
        if not entry or entry.endswith(".zip"):
            continue
        spec = importlib.machinery.PathFinder.find_spec("pyspark", [entry])
        if spec is None or not spec.submodule_search_locations:
            continue
        version_file = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
        scope: dict = {}
        try:
            with open(version_file) as f:
                exec(compile(f.read(), version_file, "exec"), scope)
        except (OSError, SyntaxError):
            return None
        return scope.get("__version__"), entry
    return None


def prefer_installed_pyspark() -> bool:
    """Put an installed pyspark of the zip's version before ``pyspark.zip`` on ``sys.path``.
    Must run before pyspark is imported; True when it did."""
    zips = [p for p in sys.path if os.path.basename(p) == "pyspark.zip"]
    if not zips or "pyspark" in sys.modules:
        return False
    installed = _installed_version()
    if installed is None or installed[0] is None or installed[0] != _zip_version(zips[0]):
        return False
    sys.path.remove(installed[1])
    sys.path.insert(sys.path.index(zips[0]), installed[1])
    return True


def _preload() -> None:
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow  # noqa: F401

    import nearest_kernels.cpu  # noqa: F401
    import udfs.blocks  # noqa: F401
    import udfs.ivf  # noqa: F401
    import udfs.warm  # noqa: F401

    try:
        import scipy.linalg.cython_blas  # noqa: F401  (numba's np.dot binds to it)
    except ImportError:   # the CPU backend refuses the task and says why
        return
    # numba sets up its CPU target (the typing and lowering registries, its runtime's own
    # functions) in the first process that compiles or loads a kernel: once here, not in each
    # worker's first search.
    from nearest_kernels import import_numba

    import_numba()
    from numba.core.registry import cpu_target

    cpu_target.typing_context.refresh()
    cpu_target.target_context.refresh()


def main() -> None:
    prefer_installed_pyspark()
    import pyspark.daemon as daemon

    run_task = daemon.worker
    tasks = 0

    def worker(sock, authenticated):
        nonlocal tasks
        try:
            return run_task(sock, authenticated)
        finally:
            tasks += 1
            if tasks & (tasks - 1) == 0:   # after tasks 1, 2, 4, 8, ...: what later tasks import
                gc.collect()
                gc.freeze()

    daemon.worker = worker
    _preload()
    daemon.manager()


if __name__ == "__main__":
    main()
