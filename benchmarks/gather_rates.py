"""Where the Arrow path's row emission goes: gather rates of 128-float payload rows.

The broadcast plan emits ~1 KB per output row (both vectors), so the gather rate bounds the
Arrow path's row emission. This script times, for one output batch (65,536 rows, d=128)
gathered from a 10^6-row target table:

* ``np.take`` and the compiled ``take_rows`` on one thread; ``udfs.rows.take_matrix``
  (compiled chunks) over 1..N threads, into a reused
  buffer and into a fresh Arrow pool buffer per batch (first-touch page faults, or zeroing of
  fresh huge pages, show up as the difference);
* a numba ``prange`` gather (no per-chunk Python dispatch), reused and fresh;
* ``udfs.emit.emit_rows`` for a whole query block (query + target payload + distance).

Prints GB/s of output written and records each row in ``benchmarks/results/gather_rates.jsonl``
(table ``gather``, or ``emit`` for ``emit_rows``) for ``make bench-report``.
Run: ``python benchmarks/gather_rates.py [--threads 1,4,16]``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._record import Recorder  # noqa: E402

from udfs.rows import pooled_empty, take_matrix  # noqa: E402


def _numba_gather():
    import numba

    @numba.njit(parallel=True, cache=False)
    def gather(matrix, rows, out):
        for i in numba.prange(rows.shape[0]):
            out[i, :] = matrix[rows[i], :]
    return gather


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nt", type=int, default=1_000_000)
    ap.add_argument("--rows", type=int, default=65_536)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--threads", default="")
    ap.add_argument("--emit", action="store_true", help="also time udfs.emit.emit_rows")
    ap.add_argument("--profile", action="store_true", help="cProfile the last emit_rows run (with --emit)")
    ap.add_argument("--emit-sources", default="1",
                    help="with --emit: also emit states whose payload rows come from this many "
                         "tables (comma-separated counts), e.g. 1,4")
    ap.add_argument("--emit-configs", default="",
                    help="with --emit: comma-separated ROWS:AHEAD:THREADS settings of emit_rows "
                         "(output batch rows, batches built ahead, gather threads per batch) to time "
                         "besides the defaults, e.g. 16384:8:2,32768:4:4")
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, 4, cores})
    rng = np.random.default_rng(0)
    table = rng.standard_normal((args.nt, args.d), dtype=np.float32)
    rows = rng.integers(0, args.nt, args.rows)
    nbytes = args.rows * args.d * 4 * args.batches
    results = []

    def timed(name, fn):
        fn()   # warm-up (numba compiles here)
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        for _ in range(args.batches):
            fn()
        dt = time.perf_counter() - t0
        row = {"what": name, "GB/s": round(nbytes / dt / 1e9, 2), "ms_per_batch": round(dt / args.batches * 1e3, 2),
               "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0}
        results.append(row)
        print(json.dumps(row), flush=True)

    out = np.empty((args.rows, args.d), np.float32)
    timed("np.take 1 thread, reused", lambda: np.take(table, rows, axis=0, out=out))
    from nearest_kernels.gather import take_rows
    timed("take_rows (compiled) 1 thread, reused", lambda: take_rows(table, rows, out))
    for t in threads:
        timed(f"take_matrix {t} threads, reused", lambda t=t: take_matrix(table, rows, out, threads=t))
        timed(f"take_matrix {t} threads, fresh pool buffer",
              lambda t=t: take_matrix(table, rows, pooled_empty(out.shape, np.float32)[0], threads=t))
    timed("fresh np.empty + touch (page faults only)", lambda: np.empty(out.shape, np.float32).fill(0))
    try:
        gather = _numba_gather()
    except Exception as exc:   # numba missing or unusable: report and go on
        print(json.dumps({"what": "numba", "error": repr(exc)[:200]}))
    else:
        timed(f"numba prange ({cores} threads), reused", lambda: gather(table, rows, out))
        timed("numba prange, fresh pool buffer",
              lambda: gather(table, rows, pooled_empty(out.shape, np.float32)[0]))
    if args.emit:
        from udfs.context import JoinContext, SearchSettings
        from udfs.emit import emit_rows
        from udfs.packing import SideLayout
        from udfs.topk import TopkState

        k, nq = 10, args.rows * args.batches // 10
        d = args.d

        def arrow_table(x, name):
            offsets = pa.array(np.arange(len(x) + 1, dtype=np.int32) * d)
            return pa.table({name + "id": np.arange(len(x), dtype=np.int64),
                             name + "v": pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1)))})
        qt = arrow_table(rng.standard_normal((nq, d), dtype=np.float32), "q")
        tt = arrow_table(table, "t")
        ctx = JoinContext(SearchSettings(k, "l2", "cpu", "fp32"), SideLayout("qv", 1, d, nq),
                          SideLayout("tv", 1, d, args.nt), "inner", True, tt.schema)
        state = TopkState.from_search(rng.random((nq, k), dtype=np.float32), rng.integers(0, args.nt, (nq, k)), 0, tt)
        from udfs import emit

        all_cpus = os.sched_getaffinity(0)
        configs = [None] + [tuple(int(x) for x in c.split(":")) for c in args.emit_configs.split(",") if c]
        for config in configs:
            if config is not None:   # module settings; the helper pool is rebuilt for its size
                emit.OUTPUT_BATCH_ROWS, emit.EMIT_AHEAD = config[0], config[1]
                os.sched_setaffinity(0, sorted(all_cpus)[:config[2]])   # the task's share
                if emit._EMIT_POOL is not None:
                    emit._EMIT_POOL.shutdown()
                    emit._EMIT_POOL = None
            for rep in range(3 if config is None else 2):
                _emit_once(args, qt, state, ctx, emit_rows, results, config, profile=args.profile and rep == 2)
            if config is not None:
                continue
            for n_sources in sorted({int(x) for x in args.emit_sources.split(",") if x} - {1}):
                # A state folded from several target blocks: its payload rows come from n
                # tables (broadcast 1 x n, the blocked plan's merge), gathered source by source.
                bounds = np.linspace(0, args.nt, n_sources + 1).astype(np.int64)
                parts = [tt.slice(a, b - a) for a, b in zip(bounds[:-1], bounds[1:])]
                which = np.searchsorted(bounds, state.rows, side="right") - 1
                multi = TopkState(state.values, state.keys, parts, which.astype(np.int32),
                                  state.rows - bounds[which])
                for rep in range(2):
                    _emit_once(args, qt, multi, ctx, emit_rows, results, None, label=f"{n_sources} sources")
    rec = Recorder("gather_rates")
    for r in results:
        fields = {k.replace("GB/s", "gb_per_s"): v for k, v in r.items() if k != "what"}
        rec.add("gather" if "ms_per_batch" in r else "emit", case=r["what"], nt=args.nt, batch_rows=args.rows,
                d=args.d, batches=args.batches, **fields)
    print("\n| gather | GB/s | ms per batch |\n|---|---|---|")
    for r in results:
        if "ms_per_batch" in r:
            print(f"| {r['what']} | {r['GB/s']} | {r['ms_per_batch']} |")


def _emit_once(args, qt, state, ctx, emit_rows, results, config, profile=False, label="") -> None:
    """One timed ``emit_rows`` of a whole query block (config: ROWS, AHEAD, THREADS or None)."""
    d = args.d
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    n = sum(b.num_rows for b in emit_rows(qt, state, ctx))
    dt = time.perf_counter() - t0
    if prof is not None:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        print(buf.getvalue(), flush=True)
    row = {"what": "emit_rows (query + target vectors, ids, distance)", "rows": n,
           "config": ("default" if config is None else "rows %d, ahead %d, threads %d" % config)
           + (f", {label}" if label else ""),
           "GB/s": round(n * (2 * d * 4 + 20) / dt / 1e9, 2), "ms": round(dt * 1e3, 1)}
    results.append(row)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
