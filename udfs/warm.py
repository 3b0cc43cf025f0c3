"""Compile a join's CPU kernels off the critical path, once per process.

numba compiles a kernel the first time a process calls it with new argument types (or loads
it from its on-disk cache, when a process of the same machine compiled it before). A new
executor would otherwise pay that inside its first search task. :func:`start_warm_up` runs
the executor path of one join (decode, search, fold, merge, emit: ``udfs.local.local_join``)
on a few rows of the join's own element types, metric, k, cap and keys, on a daemon thread:

* on executors, from the first task that packs a side's rows (:func:`warming`), so that the
  search stage that follows finds the kernels compiled in the same process, or in the cache;
* on a driver whose executors share its machine (a ``local`` master), from the start of the
  planning, so that the cache is filled before the first search task asks for it.

A search that reaches a kernel still compiling waits for that compilation (numba compiles
under one lock per process) instead of compiling it again. GPU tasks compile their own
kernels (``udfs.gpu_search``): the warm-up covers the CPU backend only.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from nearest_kernels import seeds_heaps

from .context import JoinContext, SearchSettings, SideLayout, cuda_may_exist
from .local import local_join
from .search import warm_up_threads

logger = logging.getLogger(__name__)

_seconds: dict[tuple, float] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class WarmUp:
    """What decides which kernels, and which compiled types of them, a join's tasks run."""

    metric: str
    backend: str                 # the join's: "auto" or "cpu" warm up; a GPU task compiles its own
    dtypes: tuple[str, str]      # query and target elements as decoded: "float32" / "float64"
    keyed: bool = False          # on= keys or IVF lists: the grouped (segment) searches
    capped: bool = False
    wide: bool = False           # k large enough that the search seeds its heaps (seeds_heaps)

    @classmethod
    def of(cls, ctx: JoinContext, dtypes: tuple[str, str]) -> WarmUp:
        return cls(ctx.settings.metric, ctx.settings.backend, dtypes, ctx.keyed, ctx.cap is not None,
                   seeds_heaps(ctx.settings.k))


def start_warm_up(warm: WarmUp, plans: tuple[str, ...]) -> threading.Thread | None:
    """Compile the CPU kernels of ``warm``'s joins in each plan of ``plans`` ("broadcast",
    "blocked") on a daemon thread, once per process and configuration. None when nothing is
    to be done (a GPU task, or warmed already)."""
    if warm.backend not in ("auto", "cpu") or (warm.backend == "auto" and cuda_may_exist()):
        return None
    if warm.keyed:   # the keyed blocked plan runs its own cells (nearest_join.keyed), not these
        plans = tuple(plan for plan in plans if plan == "broadcast")
    with _lock:
        todo = tuple(plan for plan in plans if (warm, plan) not in warm_up_threads)
        if not todo:
            return None
        thread = threading.Thread(target=_warm, args=(warm, todo), daemon=True, name="nj-warm-up")
        for plan in todo:
            warm_up_threads[(warm, plan)] = thread
    thread.start()
    return thread


def _warm(warm: WarmUp, plans: tuple[str, ...]) -> None:
    from nearest_kernels import compile_lock, import_numba

    import_numba()   # not beside another thread's first import of it (import_numba says why)
    from numba.core import event

    start = time.perf_counter()
    compiling = _compile_time()
    try:
        with compile_lock():   # one process of the machine compiles, the others then load
            locked = time.perf_counter()
            # Inside the lock: another warm-up of this process compiles only outside it.
            event.register("numba:compile", compiling)
            try:
                for offset in (0.0, 100.0):   # both the as-is and the shifted operands
                    for plan in plans:
                        local_join(*_tiny_join(warm, offset), plan=plan, partitions=2)
                    if warm.keyed:
                        _probed_search(warm, offset)
            finally:
                event.unregister("numba:compile", compiling)
    except Exception:   # noqa: BLE001 (a warm-up is an optimisation: the search reports errors)
        logger.warning("kernel warm-up failed", exc_info=True)
        return
    done = time.perf_counter()
    _seconds[(warm, plans)] = (done - locked, compiling.seconds)
    logger.info("kernels for %s %s warmed in %.2f s, %.2f s of it compiling (%.2f s waiting for "
                "another process's)", warm, plans, done - locked, compiling.seconds, locked - start)


def _compile_time():
    """A numba event listener whose ``seconds`` are those spent in numba's outermost
    compilations (a kernel's callees compile inside it) on any thread: the warm-up's kernels
    run on the task's threads (``run_split``). numba compiles under one lock per process, so
    they never overlap. A kernel numba loads from its cache raises no compile event."""
    from nearest_kernels import import_numba

    import_numba()
    from numba.core import event

    class CompileTime(event.Listener):
        def __init__(self) -> None:
            self.depth: dict[int, int] = {}
            self.started: dict[int, float] = {}
            self.seconds = 0.0

        def on_start(self, ev) -> None:
            thread = threading.get_ident()
            self.depth[thread] = self.depth.get(thread, 0) + 1
            if self.depth[thread] == 1:
                self.started[thread] = time.perf_counter()

        def on_end(self, ev) -> None:
            # A compilation that began before the listener was registered ends unmatched:
            # ignored (an exception here would fail that compilation).
            thread = threading.get_ident()
            if not self.depth.get(thread):
                return
            self.depth[thread] -= 1
            if self.depth[thread] == 0:
                self.seconds += time.perf_counter() - self.started.pop(thread)

    return CompileTime()


def warm_up_seconds() -> tuple[float, float]:
    """(seconds, of which compiling) this process's finished warm-ups spent on kernels: the
    rest is loading what numba's cache holds."""
    return sum(total for total, _ in _seconds.values()), sum(compiled for _, compiled in _seconds.values())


def _tiny_join(warm: WarmUp, offset: float = 0.0) -> tuple[pa.Table, pa.Table, JoinContext]:
    """A few rows of ``warm``'s element types (and group ids), and a join context over them:
    every block pair, fold, merge and emit of a real join (LEFT OUTER, with the distance), at
    a size that costs nothing but compiling. A query row equals a target row, so that the
    exact stage meets a tie. The targets are symmetric about ``offset``: at 0 their mean is 0,
    and the kernel multiplies them as they are; far from 0 it shifts them first (the two
    ways ``nearest_kernels.cpu`` prepares its operands)."""
    rng = np.random.default_rng(0)
    d, k, rows, target_block = 3, 3, 12, 7
    if warm.wide:   # each target partition makes a block that holds a whole heap (its search seeds
        # it) and one that does not; blocks of even rows, so that they stay symmetric
        k = next(k for k in range(1, 1 << 20) if seeds_heaps(k))
        target_block = k + k % 2 + 8
        rows = 2 * (target_block + 16)

    def side(name: str, dtype: str, vectors: np.ndarray) -> pa.Table:
        element = pa.from_numpy_dtype(np.dtype(dtype))
        columns = {"id": pa.array(np.arange(rows)), name: pa.array(list(vectors.astype(dtype)), type=pa.list_(element))}
        if warm.keyed:
            columns["group"] = pa.array(np.arange(rows, dtype=np.int32) % 2)
        return pa.table(columns)

    half = rng.standard_normal((rows // 2, d))
    targets = np.stack([half, -half], axis=1).reshape(rows, d) + offset   # pairs: every block symmetric
    queries = rng.standard_normal((rows, d)) + offset
    queries[0] = targets[3]
    query, target = side("qv", warm.dtypes[0], queries), side("tv", warm.dtypes[1], targets)
    group = 2 if warm.keyed else None
    ctx = JoinContext(SearchSettings(k, warm.metric, "cpu"), SideLayout("qv", 1, d, 5, group_index=group),
                      SideLayout("tv", 1, d, target_block, group_index=group), "leftouter", True, target.schema,
                      cap=_admitting_cap(warm.metric) if warm.capped else None)
    return query, target, ctx


def _probed_search(warm: WarmUp, offset: float) -> None:
    """The IVF plan's search of a CPU task's large lists (``udfs.search.probed_search``'s
    ``knn_probed``), which a tiny join's lists are too small to reach."""
    from nearest_kernels.segments import knn_probed  # numba: on executors only

    rng = np.random.default_rng(0)
    queries = (rng.standard_normal((4, 3)) + offset).astype(warm.dtypes[0])
    targets = (rng.standard_normal((6, 3)) + offset).astype(warm.dtypes[1])
    knn_probed(queries, targets, np.array([0, 2, 6]), np.arange(0, 9, 2), np.array([0, 1] * 4), 3, warm.metric,
               cap=_admitting_cap(warm.metric) if warm.capped else None, threads=2)


def _admitting_cap(metric: str) -> float:
    """A cap every target is within: the capped paths run, and every later kernel is reached."""
    return -1e15 if metric in ("cosine", "inner_product") else 1e15


def warming(pack, warm: WarmUp, plan: str):
    """``pack`` (a mapInArrow function) that first starts the join's warm-up in its process."""
    return functools.partial(_warm_then_pack, pack, warm, plan)


def _warm_then_pack(pack, warm: WarmUp, plan: str, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    start_warm_up(warm, (plan,))
    yield from pack(batches)


def started_worker(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow function of no output: the task that starts a Python worker (and its daemon)."""
    for _ in batches:
        pass
    return iter(())
