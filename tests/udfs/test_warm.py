"""The kernel warm-up (udfs.warm): it compiles what a join's search then runs, once per process
and configuration, off the calling thread, and a search waits for it instead of compiling the
same kernels beside it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from udfs import search, warm

ROOT = Path(__file__).resolve().parents[2]


def test_the_warm_up_covers_the_search_it_warms(tmp_path):
    """In a process with an empty numba cache: after the warm-up of a join, a real search of
    that join (other sizes and values) compiles nothing more. Three joins in one process (one
    numba start-up): l2 over float32 broadcast, at a k whose heaps are narrow and at one whose
    heaps the search seeds (a kernel of its own), and inner product over float64 blocked, capped;
    then the probed search of an IVF plan's large lists after the keyed warm-up's."""
    script = textwrap.dedent("""
        import json, sys, numpy as np, pyarrow as pa
        from numba.core import event
        from udfs.context import JoinContext, SearchSettings, SideLayout
        from udfs.local import local_join
        from udfs.warm import WarmUp, start_warm_up

        compiled = []
        class Seen(event.Listener):
            def on_start(self, ev): compiled.append(ev.data["dispatcher"].py_func.__qualname__)
            def on_end(self, ev): pass
        event.register("numba:compile", Seen())
        results = []
        for metric, dtype, plan, cap, k in (("l2", "float32", "broadcast", None, 7),
                                            ("l2", "float32", "broadcast", None, 70),
                                            ("inner_product", "float64", "blocked", -50.0, 70)):
            rng = np.random.default_rng(1)
            q = pa.table({"id": np.arange(300), "v": pa.array(list(rng.standard_normal((300, 17)).astype(dtype)))})
            t = pa.table({"id": np.arange(900), "w": pa.array(list(rng.standard_normal((900, 17)).astype(dtype)))})
            ctx = JoinContext(SearchSettings(k, metric, "auto"), SideLayout("v", 1, 17, 128),
                              SideLayout("w", 1, 17, 400), "leftouter", True, t.schema, cap=cap)
            thread = start_warm_up(WarmUp.of(ctx, (dtype, dtype)), (plan,))
            if thread is not None:   # None: this configuration was warmed by an earlier join
                thread.join()
            compiled.clear()   # what the search compiles, after its warm-up
            out = local_join(q, t, ctx, plan=plan, partitions=2)
            results.append({"join": metric, "rows": out.num_rows, "compiled": list(compiled)})
        # IVF lists: after a keyed warm-up's probed search (its tiny joins are the keyed
        # plan's, test_a_keyed_warm_up_runs_the_probed_search), a CPU task's probed search of
        # lists too large for a tiny join, on shifted operands
        from nearest_kernels.segments import knn_probed
        from udfs.warm import _probed_search
        for offset in (0.0, 100.0):
            _probed_search(WarmUp("l2", "auto", ("float32", "float32"), keyed=True), offset)
        compiled.clear()
        rng = np.random.default_rng(2)
        q = (rng.standard_normal((300, 17)) + 30).astype(np.float32)
        t = (rng.standard_normal((900, 17)) + 30).astype(np.float32)
        probes = np.stack([np.arange(300) % 3, (np.arange(300) + 1) % 3], axis=1).ravel()
        v, _ = knn_probed(q, t, np.array([0, 100, 500, 900]), np.arange(0, 601, 2), probes, 7, "l2", threads=2)
        results.append({"join": "ivf", "rows": int((v < np.inf).any(axis=1).sum()), "compiled": list(compiled)})
        from udfs.warm import warm_up_seconds
        print(json.dumps({"joins": results, "seconds": warm_up_seconds()}))
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for result in found["joins"]:
        assert result["rows"] >= 300, result
        assert result["compiled"] == [], result
    total, compiling = found["seconds"]
    assert 0 < compiling <= total, found["seconds"]   # the warm-ups compiled, with an empty cache
    # A new process with the cache the first one filled loads its kernels: no second compiling.
    again = textwrap.dedent("""
        from udfs.warm import WarmUp, start_warm_up, warm_up_seconds
        start_warm_up(WarmUp("l2", "auto", ("float32", "float32")), ("broadcast",)).join()
        print(*warm_up_seconds())
    """)
    proc = subprocess.run([sys.executable, "-c", again], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    total, compiling = map(float, proc.stdout.split()[-2:])
    assert total > 0 and compiling == 0, (total, compiling)


def test_once_per_process_and_configuration(monkeypatch):
    started = []
    monkeypatch.setattr(warm, "_warm", lambda w, plans: started.append((w, plans)))
    monkeypatch.setattr(search, "warm_up_threads", {})
    monkeypatch.setattr(warm, "warm_up_threads", search.warm_up_threads)
    monkeypatch.setattr(warm, "cuda_may_exist", lambda: False)
    l2 = warm.WarmUp("l2", "auto", ("float32", "float32"))
    first = warm.start_warm_up(l2, ("broadcast", "blocked"))
    first.join()
    assert started == [(l2, ("broadcast", "blocked"))]
    assert warm.start_warm_up(l2, ("broadcast",)) is None            # warmed already
    keyed = warm.WarmUp("l2", "auto", ("float32", "float64"), keyed=True)
    warm.start_warm_up(keyed, ("broadcast", "blocked")).join()
    assert started[-1] == (keyed, ("broadcast",))   # the keyed blocked plan runs its own cells
    assert warm.start_warm_up(warm.WarmUp("l2", "gpu", ("float32", "float32")), ("broadcast",)) is None
    monkeypatch.setattr(warm, "cuda_may_exist", lambda: True)      # a GPU task compiles its own
    assert warm.start_warm_up(warm.WarmUp("cosine", "auto", ("float32", "float32")), ("broadcast",)) is None
    assert warm.start_warm_up(warm.WarmUp("cosine", "cpu", ("float32", "float32")), ("broadcast",)) is not None


def test_a_keyed_warm_up_runs_the_probed_search(monkeypatch):
    """IVF lists are keyed: a keyed warm-up also runs the probed search of large lists, on the
    as-is and the shifted operands; an unkeyed one does not."""
    ran = []
    monkeypatch.setattr(warm, "local_join", lambda *args, **kwargs: None)
    monkeypatch.setattr(warm, "_probed_search", lambda w, offset: ran.append((w.keyed, offset)))
    warm._warm(warm.WarmUp("l2", "auto", ("float32", "float32")), ("broadcast",))
    assert ran == []
    warm._warm(warm.WarmUp("cosine", "auto", ("float32", "float64"), keyed=True), ("broadcast",))
    assert ran == [(True, 0.0), (True, 100.0)]


def test_a_search_waits_for_the_warm_ups_of_its_process(monkeypatch):
    import threading

    release, order = threading.Event(), []

    def slow(w, plans):
        release.wait(5)
        order.append("warmed")

    monkeypatch.setattr(warm, "_warm", slow)
    monkeypatch.setattr(search, "warm_up_threads", {})
    monkeypatch.setattr(warm, "warm_up_threads", search.warm_up_threads)
    monkeypatch.setattr(warm, "cuda_may_exist", lambda: False)
    warm.start_warm_up(warm.WarmUp("sqeuclidean", "cpu", ("float64", "float64")), ("broadcast",))
    threading.Timer(0.2, release.set).start()
    search.open_block_searcher(search.SearchSettings(3, "sqeuclidean", "cpu"))
    order.append("searched")
    assert order == ["warmed", "searched"]


@pytest.mark.parametrize("metric", ["cosine", "inner_product"])
def test_the_tiny_join_admits_every_target_under_its_cap(metric):
    """A capped warm-up must reach every kernel past the cap: its cap admits all targets."""
    query, target, ctx = warm._tiny_join(warm.WarmUp(metric, "auto", ("float32", "float64"), capped=True))
    from udfs.local import local_join

    out = local_join(query, target, ctx, plan="broadcast")
    assert out.num_rows == query.num_rows * ctx.k


def test_the_compile_timer_ignores_a_compilation_it_did_not_see_begin():
    """A compilation that began before the warm-up's listener was registered (another thread of
    the process) ends unmatched: ignored, never an error inside numba's compilation."""
    timer = warm._compile_time()
    timer.on_end(None)                      # no start seen on this thread
    timer.on_start(None), timer.on_start(None), timer.on_end(None), timer.on_end(None)
    assert timer.seconds >= 0 and timer.depth == {__import__("threading").get_ident(): 0}
