"""GPU kernel benchmark (issue 4): fused Triton top-k vs torch addmm + topk vs the GEMM alone.

Run on a CUDA machine from the repository root:

    python benchmarks/gpu_kernel.py --out results/        # full table (about 3 minutes)
    python benchmarks/gpu_kernel.py --quick               # small shapes, smoke run
    python benchmarks/gpu_kernel.py --variants --out results/   # kernel variants: check + time
    python benchmarks/gpu_kernel.py --compare-base .bench_base/kernels   # EXACT: this tree vs another

For nq x nt x d (default 65,536 x 1,000,000 x 128, plus d=768 in tf32/bf16 at k=10) and
k in {10, 100}, in fp32, tf32 and bf16, it times with CUDA events (median of repeats, after
a warm-up that includes compilation):

* ``gemm``: chunked ``addmm`` writing the distance matrix (the issue's ceiling);
* ``addmm+topk``: the same chunks followed by ``torch.topk`` (the issue's baseline);
* ``fused``: the fused kernel's candidate pass alone at k's plain list width (no re-rank and
  no proof: what the exact search costs on top of it; :func:`fused_pass`);
* ``exact``: the backend's answer (fused candidates + exact float32 re-rank);
* ``arrow``: the executor path of the blocked plan (``udfs.blocks.search_pairs`` then
  ``merge_partials``) fed Arrow batches, host-device copies and Arrow work included.

Effective TFLOP/s count 2 * nq * nt * d. Prints a table and writes it as JSON lines.
"""
from __future__ import annotations

import argparse
import collections
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nearest_kernels import _gpu_torch as gt  # noqa: E402
from nearest_kernels.gpu import prepare_targets, search_prepared  # noqa: E402

ARROW_SHAPES = [("blocked", 1, 4), ("broadcast", 1, 4), ("broadcast", 2, 1), ("broadcast", 4, 1), ("broadcast", 8, 2)]
CHUNK_ROWS = 4096   # query rows per addmm chunk in the torch baselines (4096 x 1e6 floats = 16 GB)


def cuda_ms(fn, reps: int, warmup: int = 1) -> list[float]:
    """Device times (CUDA events, ms) of ``reps`` calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def torch_operands(Q, T, precision):
    if precision == "bf16":
        return Q.bfloat16(), T.bfloat16()
    return Q, T


def gemm_alone(Q, T, bias, precision):
    """The GEMM alone: chunked ``addmm`` writing the (chunk, nt) matrix, in ``precision``."""
    q, t = torch_operands(Q, T, precision)
    b = bias.to(q.dtype)
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    for r0 in range(0, q.shape[0], CHUNK_ROWS):
        torch.addmm(b, q[r0:r0 + CHUNK_ROWS], t.T, alpha=-2.0)


def addmm_topk(Q, T, bias, precision, k):
    """Plain squared-l2 top-k indices: ``bias - 2 q.t`` by chunked ``addmm`` in ``precision``
    (``bias`` = |t|^2), then ``topk``: the naive search, no re-rank."""
    q, t = torch_operands(Q, T, precision)
    b = bias.to(q.dtype)
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    out = []
    for r0 in range(0, q.shape[0], CHUNK_ROWS):
        d = torch.addmm(b, q[r0:r0 + CHUNK_ROWS], t.T, alpha=-2.0)
        out.append(torch.topk(d, k, dim=1, largest=False).indices)
    return torch.cat(out)


def fused_pass(Q, prepared, k):
    """(keys, indices) of the fused kernel's candidate pass alone at k's plain list width, the
    first k of each row: the plain low-precision search, no re-rank and no proof. The library
    always re-ranks; this is the peer that says what exactness costs on top of the pass."""
    from nearest_kernels import _gpu_triton as tr

    qs = gt.prepare_queries(Q, prepared.side)
    keys, idx, _ = tr.triton_candidates(qs, prepared.side, max(gt.MIN_CANDIDATES, gt.next_pow2(k)))
    return keys[:, :k], idx[:, :k]


def _packed_pairs(Qn, Tn, k, precision, t_block_rows, q_block_rows, backend: str = "gpu",
                  plan: str = "blocked"):
    """(JoinContext, pair batches) as ``plan`` feeds them: ``list<float>`` vector columns
    (what Spark sends for ``array<float>``), blocks packed by ``pack_blocks`` and the empty
    target block first, every pair row carrying its target blob and, in the blocked plan,
    its query blob (the broadcast plan: a query block's first pair only)."""
    import pyarrow as pa

    from udfs.context import JoinContext, SearchSettings
    from udfs.local import pair_batches
    from udfs.packing import PACKED_SCHEMA, SideLayout, empty_target_block, pack_blocks

    d = Qn.shape[1]

    def table(x, name):
        offsets = pa.array(np.arange(len(x) + 1, dtype=np.int32) * d)
        vec = pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1)))
        return pa.table({name + "id": np.arange(len(x), dtype=np.int64), name + "v": vec})

    qt, tt = table(Qn, "q"), table(Tn, "t")
    ctx = JoinContext(SearchSettings(k, "l2", backend, precision), SideLayout("qv", 1, d, q_block_rows),
                      SideLayout("tv", 1, d, t_block_rows), "inner", True, tt.schema)
    q_packed = pa.Table.from_batches(list(pack_blocks(qt.to_batches(max_chunksize=1 << 16), ctx.query, 0)),
                                     schema=PACKED_SCHEMA)
    # With the empty target block, as the plans union it: every query block meets it.
    t_packed = pa.Table.from_batches([empty_target_block()]
                                     + list(pack_blocks(tt.to_batches(max_chunksize=1 << 16), ctx.target, 1)),
                                     schema=PACKED_SCHEMA)
    return ctx, list(pair_batches(q_packed, t_packed, rows_once=plan == "broadcast"))


def arrow_path(Qn, Tn, k, precision, t_block_rows, q_block_rows, plan="blocked", profile=False,
               on_start=None):
    """Time one plan's executor functions on Arrow batches as Spark feeds them (packing untimed).

    The pairs come from :func:`_packed_pairs`; the blocked plan runs ``search_pairs`` then
    ``merge_partials`` per query block, the broadcast plan ``search_broadcast``; rows are
    emitted with their payload (ids and both vectors), host-device copies included.
    """
    import cProfile
    import io
    import pstats

    from udfs.blocks import merge_partials, search_broadcast, search_pairs

    ctx, pairs = _packed_pairs(Qn, Tn, k, precision, t_block_rows, q_block_rows, plan=plan)
    torch.cuda.synchronize()
    if on_start:
        on_start()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    if plan == "blocked":
        partial = list(search_pairs(iter(pairs), ctx))
        t1 = time.perf_counter()
        groups: dict[int, list] = {}
        for b in partial:
            groups.setdefault(b.column(0)[0].as_py(), []).append(b)
        rows = sum(out.num_rows for key, bs in groups.items() for out in merge_partials((key,), bs, ctx))
    else:
        t1 = t0
        rows = sum(out.num_rows for out in search_broadcast(iter(pairs), ctx))
    t2 = time.perf_counter()
    # First-touch page faults (fresh output or staging memory) were the cost of some stages
    # on some hosts: count them (each is ~0.1-1 us; millions of them show up in the times).
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    top = ""
    if prof:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(10)
        top = buf.getvalue()
    return {"search_s": t1 - t0, "merge_s": t2 - t1, "rows": rows, "pairs": len(pairs), "profile": top,
            "minor_faults": faults}


def _concurrent_worker(rank, spec, barrier, results) -> None:
    """One simulated Python worker of ``--arrow-concurrent`` (a spawned process): the same
    data and packed pairs as the others, two untimed tasks (compiles, the kept target block),
    then ``spec["tasks"]`` timed tasks back to back from a common start."""
    from udfs.gpu_task import local_task

    with local_task(scope="concurrent tasks"):       # one stage: the target block is kept
        _concurrent_tasks(rank, spec, barrier, results)


def _concurrent_tasks(rank, spec, barrier, results) -> None:
    from udfs.blocks import search_broadcast

    rng = np.random.default_rng(7)
    Qn = rng.standard_normal((spec["nq"], spec["d"]), dtype=np.float32)
    Tn = rng.standard_normal((spec["nt"], spec["d"]), dtype=np.float32)
    ctx, pairs = _packed_pairs(Qn, Tn, spec["k"], spec["precision"], spec["t_rows"], spec["q_rows"],
                               spec["backend"], plan="broadcast")

    def task() -> int:
        return sum(b.num_rows for b in search_broadcast(iter(pairs), ctx))

    task()
    task()
    barrier.wait()
    start, times, rows = time.monotonic(), [], 0
    for _ in range(spec["tasks"]):
        t0 = time.monotonic()
        rows += task()
        times.append(time.monotonic() - t0)
    results.put((rank, start, time.monotonic(), times, rows))


def arrow_concurrent(args, precision: str, k: int, kernel_ms: float, record) -> None:
    """Several broadcast tasks sharing one GPU, as ``spark.task.resource.gpu.amount`` < 1 runs
    them: each in its own process (Spark's Python workers), the GPU time-sliced between them.
    Throughput share = tasks x one kernel call's time / wall time from the common start."""
    from benchmarks.spawned import run_spawned

    for plan, q_blocks, t_blocks in [s for s in ARROW_SHAPES if s[0] == "broadcast"]:
        spec = {"nq": args.nq, "nt": args.nt, "d": args.d, "k": k, "precision": precision,
                "q_rows": -(-args.nq // q_blocks), "t_rows": -(-args.nt // t_blocks),
                "tasks": args.arrow_tasks, "backend": "gpu" if torch.cuda.is_available() else "cpu"}
        for n_proc in sorted({1, args.arrow_concurrent}):
            done = run_spawned(_concurrent_worker, [(r, spec) for r in range(n_proc)], timeout=600)
            wall = max(d[2] for d in done) - min(d[1] for d in done)
            tasks = sum(len(d[3]) for d in done)
            task_ms = sorted(1e3 * t for d in done for t in d[3])
            record(what="arrow_concurrent", plan=plan, query_blocks=q_blocks, target_blocks=t_blocks,
                   precision=precision, k=k, processes=n_proc, tasks=tasks, wall_ms=round(1e3 * wall, 1),
                   task_ms_median=round(task_ms[len(task_ms) // 2], 1), rows=sum(d[4] for d in done),
                   kernel_exact_ms=kernel_ms, share_of_kernel=kernel_ms * tasks / (1e3 * wall))


def install_stage_timers() -> dict:
    """Wrap the Arrow path's stages with wall-clock timers (inclusive, summed over threads)."""
    import collections

    from nearest_kernels import gpu as kg
    from udfs import blocks, emit, rows, topk
    from udfs import gpu as ug

    acc = collections.defaultdict(float)

    def wrap(owner, name, label):
        def add(t0, t1):
            acc[label] += t1 - t0
        _timed(owner, name, add)

    # Wrapped where they are looked up: the modules import these names.
    wrap(blocks, "blob_to_table", "blob_to_table")
    wrap(blocks, "decode_vectors", "decode_vectors")
    wrap(topk, "merge_topk", "merge_topk")
    wrap(topk, "gather_rows", "gather_rows (states, emit)")
    wrap(emit, "gather_rows", "gather_rows (states, emit)")
    wrap(topk.TopkState, "absorb", "TopkState.absorb")
    wrap(topk.TopkState, "to_blob", "TopkState.to_blob")
    wrap(topk.TopkState, "from_blob", "TopkState.from_blob")
    wrap(blocks._PairSearch, "search", "worker: pair search")
    wrap(ug.GpuBlockSearcher, "search", "worker: GpuBlockSearcher.search")
    wrap(ug.GpuBlockSearcher, "_resident_targets", "worker: target upload+prepare")
    wrap(ug.GpuBlockSearcher, "_stage", "worker: query upload")
    wrap(kg, "search_prepared", "worker: search_prepared")
    wrap(rows, "copy_into", "copy_into (pinned staging)")
    return acc


def _timed(owner, name: str, done) -> None:
    """Replace ``owner.name`` by a wrapper that calls ``done(start, end)`` after each call."""
    fn = getattr(owner, name)

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            done(t0, time.perf_counter())
    setattr(owner, name, timed)


def install_timeline() -> list:
    """Record (thread, label, start, end) of the broadcast plan's stages, for one task's
    timeline: which stage is on the critical path, and where the device waits for the host."""
    import threading

    from nearest_kernels import gpu as kg
    from udfs import blocks
    from udfs import device_fold
    from udfs import gpu as ug

    events: list = []

    def wrap(owner, name, label):
        _timed(owner, name, lambda t0, t1: events.append((threading.current_thread().name, label, t0, t1)))

    wrap(blocks._PairSearch, "query_block", "decode query block")
    wrap(blocks._PairSearch, "broadcast_target", "decode target block")
    wrap(blocks._QueryBlock, "fold", "fold (worker)")
    wrap(blocks, "gather_rows", "gather_rows")
    wrap(ug.GpuBlockSearcher, "prefetch", "prefetch query block")
    wrap(ug.GpuBlockSearcher, "_resident_targets", "resident targets")
    wrap(device_fold.DeviceFold, "to_numpy", "fold result to host")
    wrap(kg, "search_prepared", "search_prepared")
    return events


def arrow_timeline(args, Qn, Tn, precision: str, k: int) -> None:
    """Print one warm broadcast task's stage timeline per broadcast shape (--arrow-timeline)."""
    from udfs.gpu_task import local_task

    events = install_timeline()
    for plan, q_blocks, t_blocks in ARROW_SHAPES:
        if plan != "broadcast":
            continue
        totals = []
        with local_task(scope=f"timeline {plan} {q_blocks}x{t_blocks} {precision}"):
            for _ in range(3):             # the first task uploads the targets; the others find them
                events.clear()
                marks: list = []
                res = arrow_path(Qn, Tn, k, precision, -(-args.nt // t_blocks), -(-args.nq // q_blocks), plan,
                                 on_start=lambda: marks.append(time.perf_counter()))
                totals.append((res["search_s"] + res["merge_s"]) * 1e3)
        t0 = marks[0]
        print(f"# timeline {plan} {q_blocks}x{t_blocks} {precision} k={k}: tasks "
              + ", ".join(f"{t:.1f}" for t in totals) + " ms; the last one (ms from its start):")
        for thread, label, start, end in sorted(events, key=lambda e: e[2]):
            print(f"#   {thread[:14]:<14} {label:<22} {1e3 * (start - t0):7.1f} .. {1e3 * (end - t0):7.1f}"
                  f" ({1e3 * (end - start):5.1f})")


def exact_breakdown(args, ks, precisions, record) -> None:
    """Where the exact search's time goes: each stage of ``exact_topk`` between two syncs.

    Stages run one after another (synchronised), so the sum is a little above the plain
    timed call; the split is what matters: candidate passes (and how many: widening rounds)
    against the re-rank's torch work (bound, margin test, gathers, sorts).
    """
    import collections

    from nearest_kernels import _gpu_triton as tr

    acc = collections.defaultdict(float)
    calls = collections.Counter()

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def timed(*a, **kw):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                torch.cuda.synchronize()
                acc[label] += time.perf_counter() - t0
                calls[label] += 1
        setattr(owner, name, timed)
        return fn

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.d)
    Q = torch.randn(args.nq, args.d, device=dev, generator=gen)
    T = torch.randn(args.nt, args.d, device=dev, generator=gen)
    for precision in precisions:
        prepared = prepare_targets(T, "l2", precision)
        for k in ks:
            search_prepared(Q, prepared, k)        # compile
            plain = statistics.median(cuda_ms(lambda: fused_pass(Q, prepared, k), args.reps))
            whole = statistics.median(cuda_ms(lambda: search_prepared(Q, prepared, k), args.reps))
            originals = [(tr, "triton_candidates", wrap(tr, "triton_candidates", "candidates (kernel)"))]
            originals += [(gt, n, wrap(gt, n, n)) for n in
                          ("prepare_side", "key_error_bound", "margin_holds", "skip_beyond", "exact_values",
                           "rank_exact", "torch_candidates", "value_limit")]
            originals.append((tr, "triton_exact_values", wrap(tr, "triton_exact_values", "triton_exact_values")))
            rows_in = []     # (query rows, n_cand) of each candidate pass: the widening rounds
            timed_candidates = tr.triton_candidates

            def counted(q, t, n_cand, **kw):
                rows_in.append((q.rows, n_cand))
                return timed_candidates(q, t, n_cand, **kw)
            tr.triton_candidates = counted
            acc.clear()
            calls.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            search_prepared(Q, prepared, k)
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
            for owner, name, fn in originals:
                setattr(owner, name, fn)
            record(what="exact_breakdown", precision=precision, k=k, plain_ms=plain, exact_ms=whole,
                   exact_over_plain=whole / plain, synced_total_ms=round(total * 1e3, 2),
                   candidate_calls=[f"{r} rows x {n}" for r, n in rows_in],
                   **{f"{n} ms": round(v * 1e3, 2) for n, v in acc.items()},
                   **{f"{n} calls": c for n, c in calls.items()})
        del prepared
        torch.cuda.empty_cache()


def upload_rates(nbytes=128 << 20):
    """GB/s of the ways a host array can reach the device (the target block's upload)."""
    from udfs.rows import copy_into

    dev = torch.device("cuda")
    host = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32).reshape(-1, 128)
    pinned = torch.empty(host.shape, dtype=torch.float32, pin_memory=True)
    out = {}
    for threads in (1, 4, 8):
        copy_into(pinned.numpy(), host, threads=threads)
        t0 = time.perf_counter()
        copy_into(pinned.numpy(), host, threads=threads)
        out[f"pinned_memcpy_{threads}t"] = nbytes / (time.perf_counter() - t0) / 1e9
    for name, fn in (("h2d_pinned", lambda: pinned.to(dev, non_blocking=True)),
                     ("h2d_pageable", lambda: torch.from_numpy(host).to(dev))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out[name] = nbytes / (time.perf_counter() - t0) / 1e9
    return out


def kernel_variants(only: str = ""):
    """(name, precision, n_cand, TileConfig or None, min_only) timed by ``--variants``."""
    from nearest_kernels import _gpu_triton as tr

    out = []
    for precision, n10 in (("tf32", 16), ("bf16", 32)):
        wide = precision != "bf16"
        stages = 2 if wide else 3
        out += [
            ("rowlist", precision, n10, tr.tile_config(n10, 128, precision), False),
            ("rowlist-64x128-w4", precision, n10, tr.TileConfig(64, 128, 4, num_stages=3, kernel="rowlist"), False),
            ("rowlist-x1", precision, n10, tr.TileConfig(128, 128, 8, num_stages=stages,
                                                         kernel="rowlist", extra_passes=1), False),
            # Segmented register lists (the default above ROWLIST_MAX is seg_cand 16, 128 x 128).
            *[("segmented-32", precision, n_cand, tr.TileConfig(128, 128, 8, num_stages=stages,
                                                                kernel="segmented", seg_cand=32), False)
              for n_cand in (128, 256)],   # 128: k = 100 from the plain width; how many rows proven?
            ("segmented-64", precision, 256, tr.TileConfig(128, 128, 8, num_stages=stages,
                                                           kernel="segmented", seg_cand=64), False),
            # 64 rows, 8 warps: no spills at seg_cand 64 (128 rows: 40-48 B stack; 4 warps: 192 B).
            ("segmented-64-64x128-w8", precision, 256, tr.TileConfig(64, 128, 8, num_stages=stages,
                                                                     kernel="segmented", seg_cand=64), False),
        ]
    out.append(("rowlist-s4", "bf16", 32, tr.TileConfig(128, 128, 8, num_stages=4, kernel="rowlist"), False))
    # tf32 operands fill shared memory at 128 x 128 (64 KiB query tile + 64 KiB per stage):
    # narrower target tiles or fewer query rows leave room for deeper prefetch.
    out += [
        ("rowlist-128x64-s4", "tf32", 16, tr.TileConfig(128, 64, 8, num_stages=4, kernel="rowlist"), False),
        ("rowlist-128x64-s3", "tf32", 16, tr.TileConfig(128, 64, 8, num_stages=3, kernel="rowlist"), False),
        ("rowlist-64x128-w8-s3", "tf32", 16, tr.TileConfig(64, 128, 8, num_stages=3, kernel="rowlist"), False),
        ("rowlist-128x64-s4", "bf16", 32, tr.TileConfig(128, 64, 8, num_stages=4, kernel="rowlist"), False),
        # The plain k=10 bf16 list (16), and 64-row programs of 4 warps (two per SM).
        ("rowlist16", "bf16", 16, tr.TileConfig(128, 128, 8, num_stages=3, kernel="rowlist"), False),
        ("rowlist16-64x128-w4", "bf16", 16, tr.TileConfig(64, 128, 4, num_stages=3, kernel="rowlist"), False),
        ("rowlist16-64x128-w4-noskip", "bf16", 16, tr.TileConfig(64, 128, 4, num_stages=3, kernel="rowlist",
                                                                  skip_test=False), False),
        ("rowlist16-skip", "tf32", 16, tr.TileConfig(128, 128, 8, num_stages=2, kernel="rowlist",
                                                     skip_test=True), False),
        ("rowlist16-noskip", "tf32", 16, tr.TileConfig(128, 128, 8, num_stages=2, kernel="rowlist",
                                                       skip_test=False), False),
        ("rowlist-64x128-w4-noskip", "bf16", 32, tr.TileConfig(64, 128, 4, num_stages=3, kernel="rowlist",
                                                                skip_test=False), False),
    ]
    for n_cand in (128, 256):   # segments of 64-row, 4-warp programs, two per SM
        out.append(("segmented-32-64x128-w4", "bf16", n_cand,
                    tr.TileConfig(64, 128, 4, num_stages=3, kernel="segmented", seg_cand=32), False))
    # Not yet timed: tf32 with three stages where d is consumed in 64-wide chunks (d > 128:
    # 32 + 32 KiB per stage fit three; at d=128 the whole 64 KiB query tile does not):
    # `--variants --no-check --d 768 --precisions tf32 --only rowlist-s3-tf32`.
    out.append(("rowlist-s3-tf32", "tf32", 16, tr.TileConfig(128, 128, 8, num_stages=3, kernel="rowlist"), False))
    # Not yet timed (next device session): the exact bf16 k=10 pass (n_cand 32) as four
    # 16-entry segments, and 8-entry segments for k=100 (S = n_cand / 4).
    out.append(("segmented-16-64x128-w4", "bf16", 32,
                tr.TileConfig(64, 128, 4, num_stages=3, kernel="segmented", seg_cand=16), False))
    # Two 16-entry segments: as many insertions as one list of 32, each over 16 entries; the
    # floor (the lesser segment's 16th key) proves fewer rows than a list of 32.
    out.append(("segmented-16-s2-64x128-w4", "bf16", 32,
                tr.TileConfig(64, 128, 4, num_stages=3, kernel="segmented", seg_cand=16, segments=2), False))
    out.append(("segmented-16", "bf16", 32,
                tr.TileConfig(128, 128, 8, num_stages=3, kernel="segmented", seg_cand=16), False))
    for precision, stages in (("tf32", 2), ("bf16", 3)):
        for seg, n_cand in [(seg, n) for seg in (8, 16) for n in (128, 256)]:
            out.append((f"segmented-{seg}", precision, n_cand, tr.TileConfig(128, 128, 8, num_stages=stages,
                                                                             kernel="segmented", seg_cand=seg), False))
        out.append(("segmented-32-skip", precision, 256, tr.TileConfig(128, 128, 8, num_stages=stages,
                                                                       kernel="segmented", seg_cand=32,
                                                                       skip_test=True), False))
    parts = [p for p in only.split(",") if p]
    return [v for v in out if not parts or any(p in v[0] for p in parts)]


def run_variants(args, record) -> None:
    """Check every variant against the float64 reference, then time its candidate pass.

    Candidate generators return (keys, idx, floor): below its floor a row's list holds every
    target, so the keys are compared with the torch path's there (the segmented lists may
    leave out targets above it). The timing rows also give the share of rows whose first
    list is proven at k = 10 / 100 (the rest widen: a second pass in exact mode).
    """
    from nearest_kernels import _gpu_triton as tr
    from nearest_kernels.reference import knn_reference  # noqa: F401 (oracle via check_result)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.kernels.test_gpu import check_result, make_data

    def served_k(n_cand, precision):
        """The largest k whose first candidate list is n_cand wide (so the check uses cfg)."""
        return max(k for k in range(1, n_cand + 1) if gt.candidate_width(k, precision) <= n_cand)

    dev = torch.device("cuda")
    # The checks run with the kernels' buffers filled with garbage first: every slot a
    # kernel reads back must have been written (tests/kernels/test_gpu.py does the same).
    allocate = tr._kernel_buffer
    tr._kernel_buffer = lambda shape, dtype, device: allocate(shape, dtype, device).fill_(
        0x5A5A5A5A5A5A5A5A if dtype == torch.int64 else -7)
    checked = {}
    for name, precision, n_cand, cfg, min_only in kernel_variants(args.only):
        if args.no_check:
            checked[(name, precision, n_cand)] = True
        if min_only or args.no_check:
            continue
        ok = True
        for n, (nq, nt, d, kind, metric) in enumerate([(517, 20_011, 128, "clustered", "sqeuclidean"),
                                                        (300, 7_001, 33, "gaussian", "inner_product"),
                                                        (1000, 30_000, 128, "gaussian", "l2")]):
            q, t = make_data(kind, nq, nt, d, 1000 * n + n_cand + len(name))
            qs, ts = gt.prepare_pair(torch.from_numpy(q).to(dev), torch.from_numpy(t).to(dev), metric, precision)
            k = served_k(n_cand, precision)
            try:
                fn = lambda a, b, c: tr.triton_candidates(a, b, c, config=cfg if c == n_cand else None)
                keys, idx, floor = fn(qs, ts, n_cand)
                # Candidate keys against the torch path's (same operands, float32 keys).
                ref_keys, _ = gt.torch_candidates(qs, ts, n_cand)
                sure = keys < floor[:, None]
                assert torch.allclose(torch.where(sure, keys, 0), torch.where(sure, ref_keys, 0), rtol=1e-5,
                                      atol=1e-3 * float(ref_keys.abs().max())), "keys"
                v, i = gt.exact_topk(qs, ts, k, fn, max_candidates=tr.MAX_CANDIDATES)
                check_result(q, t, k, metric, v.cpu().numpy(), i.cpu().numpy())
            except Exception as exc:  # report and keep going: one failed variant must not hide the rest
                ok = False
                record(what="variant_check", name=name, precision=precision, n_cand=n_cand, ok=False,
                       error=f"{type(exc).__name__}: {str(exc)[:400]}")
                break
        checked[(name, precision, n_cand)] = ok
        if ok:
            record(what="variant_check", name=name, precision=precision, n_cand=n_cand, ok=True)
    tr._kernel_buffer = allocate
    gen = torch.Generator(device=dev).manual_seed(args.d)
    Q = torch.randn(args.nq, args.d, device=dev, generator=gen)
    T = torch.randn(args.nt, args.d, device=dev, generator=gen)
    flops = 2.0 * args.nq * args.nt * args.d
    for precision in args.precisions.split(","):
        qs, ts = gt.prepare_pair(Q, T, "l2", precision)
        bound = gt.key_error_bound(qs, gt.TargetStats.of(ts), "l2")
        for name, p, n_cand, cfg, min_only in kernel_variants(args.only):
            if p != precision or not checked.get((name.replace("-min-only", ""), p, n_cand), min_only):
                continue
            try:
                ms = cuda_ms(lambda: tr.triton_candidates(qs, ts, n_cand, config=cfg), args.reps)
                extra = {}
                k_head = 100 if n_cand > 64 else 10
                if not min_only and k_head <= n_cand:   # also lists narrower than the exact width
                    keys, _, floor = tr.triton_candidates(qs, ts, n_cand, config=cfg)
                    extra[f"proven_k{k_head}"] = float(gt.margin_holds(keys, bound, k_head, floor).float().mean())
                    del keys, floor
                    # The list's first k_head against the torch path's k_head best of the same
                    # keys (2,048 rows): what the segments' short lists lose in plain mode.
                    sub = qs.take(torch.arange(2048, device=dev))
                    _, got, _ = tr.triton_candidates(sub, ts, n_cand, config=cfg)
                    _, want = gt.torch_candidates(sub, ts, k_head)
                    extra["list_recall"] = float((got[:, :k_head, None] == want[:, None, :]).any(2).float().mean())
            except Exception as exc:
                record(what="variant_time", name=name, precision=precision, n_cand=n_cand,
                       error=f"{type(exc).__name__}: {str(exc)[:300]}")
                continue
            t = statistics.median(ms)
            record(what="variant_time", name=name, precision=precision, n_cand=n_cand, ms=t,
                   spread_ms=max(ms) - min(ms), tflops=flops / t / 1e9, config=repr(cfg), **extra)
        del qs, ts
        torch.cuda.empty_cache()


















# (data, metric, d, precisions, ks) of --compare-base: the main table's shape at d=128, d=384,
# embedding-like unit rows (cosine), and the offset data (new code only: the old one
# widened towards brute force there).
COMPARE_SHAPES = [
    ("gaussian", "l2", 128, ("fp32", "tf32", "bf16"), (10, 100)),
    ("gaussian", "l2", 384, ("tf32", "bf16"), (10,)),
    ("embedding", "cosine", 384, ("tf32", "bf16"), (10, 100)),
    ("offset", "l2", 128, ("tf32", "bf16"), (10,)),
]


def _load_base_kernels(folder: Path):
    """The kernels package of another commit (a copy of its ``nearest_kernels`` folder) as the
    top-level package ``base_kernels``: its modules import each other relatively."""
    import importlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("base_kernels", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_kernels"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("base_kernels.gpu")


def compare_data(kind: str, n: int, d: int, gen) -> torch.Tensor:
    """Benchmark rows on the device: ``gaussian`` N(0, 1); ``embedding`` unit rows around a
    shared direction with power-law variances (sentence embeddings have a large common
    component: random pairs at cosine ~0.4); ``offset`` 10 + 0.1 N(0, 1) (issue 18)."""
    dev = torch.device("cuda")
    x = torch.randn(n, d, device=dev, generator=gen)
    if kind == "embedding":
        g = torch.Generator(device=dev).manual_seed(1234)     # the same direction for both sides
        mean = torch.randn(d, device=dev, generator=g)
        mean = mean / mean.norm()
        decay = (torch.arange(1, d + 1, device=dev, dtype=torch.float32) ** -0.5)
        x = x * (decay / decay.norm())
        x = 0.8 * mean + x
        x = x / x.norm(dim=1, keepdim=True)
    elif kind == "offset":
        x = 10.0 + 0.1 * x
    return x


def compare_base(args, record) -> None:
    """The EXACT search of this tree against ``--compare-base`` (another commit's kernels
    package), interleaved in one process: per shape, both prepare the same target block, run
    once (compiling), then alternate ``--reps`` timed runs each; the median of each and how
    many rows' indices agree."""
    base = _load_base_kernels(Path(args.compare_base))
    nq, nt = args.nq, args.nt
    for kind, metric, d, precisions, ks in COMPARE_SHAPES:
        name = f"{kind}-{metric}-d{d}"
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        gen = torch.Generator(device=torch.device("cuda")).manual_seed(d)
        Q = compare_data(kind, nq, d, gen)
        T = compare_data(kind, nt, d, gen)
        for precision in [p for p in precisions if p in args.precisions.split(",")]:
            new_t = prepare_targets(T, metric, precision)
            base_t = base.prepare_targets(T, metric, precision) if kind != "offset" else None
            for k in ks:
                new_fn = lambda: search_prepared(Q, new_t, k)
                base_fn = (lambda: base.search_prepared(Q, base_t, k)) if base_t is not None else None
                t0 = time.perf_counter()
                v_new, i_new = new_fn()
                torch.cuda.synchronize()
                first_new = time.perf_counter() - t0
                same = None
                if base_fn is not None:
                    v_base, i_base = base_fn()
                    same = float((i_new == i_base).all(dim=1).double().mean())
                    del v_base, i_base
                del v_new, i_new
                times = collections.defaultdict(list)
                for _ in range(args.reps):
                    if base_fn is not None:
                        times["base"] += cuda_ms(base_fn, 1, warmup=0)
                    times["new"] += cuda_ms(new_fn, 1, warmup=0)
                new_ms = statistics.median(times["new"])
                base_ms = statistics.median(times["base"]) if base_fn is not None else float("nan")
                record(what="compare_base", data=kind, metric=metric, d=d, precision=precision, k=k,
                       nq=nq, nt=nt, base_ms=round(base_ms, 2), new_ms=round(new_ms, 2),
                       new_over_base=round(new_ms / base_ms, 3) if base_fn is not None else None,
                       rows_same_indices=same, first_new_s=round(first_new, 2),
                       runs={key: [round(x, 1) for x in v] for key, v in times.items()})
            del new_t, base_t
            torch.cuda.empty_cache()
        del Q, T
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nq", type=int, default=65_536)
    ap.add_argument("--nt", type=int, default=1_000_000)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--d-large", type=int, default=768)
    ap.add_argument("--ks", default="10,100")
    ap.add_argument("--precisions", default="fp32,tf32,bf16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-arrow", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    ap.add_argument("--out", default=None, help="folder for results.jsonl")
    ap.add_argument("--variants", action="store_true", help="check and time the kernel variants only")
    ap.add_argument("--no-check", action="store_true", help="--variants: time without the checks")
    ap.add_argument("--only", default="",
                    help="--variants / --compare-base: comma-separated name parts; run only the variants "
                         "whose name has one (--variants' checks take ~30-60 s per variant: plan device "
                         "calls with this)")
    ap.add_argument("--arrow-only", action="store_true", help="only the Arrow-batch path")
    ap.add_argument("--arrow-shapes", default=None,
                    help="Arrow path: comma-separated plan:QxT shapes, e.g. broadcast:2x1,blocked:1x4 "
                         "(default: all of ARROW_SHAPES)")
    ap.add_argument("--arrow-concurrent", type=int, default=0,
                    help="only: N broadcast tasks at once on the GPU, each in its own process (and 1, "
                         "for comparison), for each broadcast shape of --arrow-shapes, first k")
    ap.add_argument("--arrow-tasks", type=int, default=6, help="--arrow-concurrent: timed tasks per process")
    ap.add_argument("--arrow-reps", type=int, default=3,
                    help="Arrow path: next-task runs per shape (the median is reported)")
    ap.add_argument("--profile", action="store_true", help="cProfile the Arrow path's main thread")
    ap.add_argument("--exact-breakdown", action="store_true",
                    help="only: time each stage of the exact search (candidates, bound, re-rank) at d")
    ap.add_argument("--arrow-timeline", action="store_true",
                    help="only: one warm broadcast task's stage timeline per broadcast shape (bf16, first k)")
    ap.add_argument("--arrow-breakdown", action="store_true",
                    help="also time the Arrow path's stages (bf16; a separate, instrumented run)")
    ap.add_argument("--compare-base", default=None,
                    help="only: the EXACT search against another commit's kernels copied to "
                         "this folder (git show), interleaved, on COMPARE_SHAPES (--only picks by name part)")
    args = ap.parse_args(argv)
    if args.arrow_shapes:
        global ARROW_SHAPES
        ARROW_SHAPES = [(p.split(":")[0], *map(int, p.split(":")[1].split("x")))
                        for p in args.arrow_shapes.split(",")]
    if args.quick:
        args.nq, args.nt, args.d_large, args.reps = 4096, 100_000, 256, 2
    ks = [int(k) for k in args.ks.split(",")]
    precisions = args.precisions.split(",")
    dev = torch.device("cuda")
    rows = []
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()} torch {torch.__version__} "
          f"commit {commit or '?'} nq={args.nq} nt={args.nt}",
          flush=True)

    def record(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    if args.variants:
        run_variants(args, record)
        print("\n| variant | precision | n_cand | ms | TFLOP/s |")
        print("|---|---|---|---|---|")
        for r in rows:
            if r["what"] == "variant_time" and "ms" in r:
                print(f"| {r['name']} | {r['precision']} | {r['n_cand']} | {r['ms']:.1f} | {r['tflops']:.0f} |")
            elif r.get("error") or r.get("ok") is False:
                print(f"| {r['name']} | {r['precision']} | {r['n_cand']} | FAILED {r.get('error', '')[:150]} | |")
        return

    if args.compare_base:
        compare_base(args, record)
        print("\n| data | metric | d | precision | k | base ms | new ms | new / base | rows same |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r["what"] == "compare_base":
                ratio = "" if r["new_over_base"] is None else f"{r['new_over_base']:.3f}"
                same = "" if r["rows_same_indices"] is None else f"{r['rows_same_indices']:.4f}"
                print(f"| {r['data']} | {r['metric']} | {r['d']} | {r['precision']} | {r['k']} | "
                      f"{r['base_ms']:.1f} | {r['new_ms']:.1f} | {ratio} | {same} |")
        return
    if args.exact_breakdown:
        exact_breakdown(args, ks, precisions, record)
        return
    if args.arrow_concurrent:
        rng = np.random.default_rng(7)
        Qn = rng.standard_normal((args.nq, args.d), dtype=np.float32)
        Tn = rng.standard_normal((args.nt, args.d), dtype=np.float32)
        for precision in [p for p in ("bf16", "tf32") if p in precisions]:
            kernel_ms = float("nan")
            if torch.cuda.is_available():
                q = torch.from_numpy(Qn).to(dev)
                prepared = prepare_targets(torch.from_numpy(Tn).to(dev), "l2", precision)
                kernel_ms = statistics.median(cuda_ms(lambda: search_prepared(q, prepared, ks[0]), args.reps))
                del prepared, q
                torch.cuda.empty_cache()
            arrow_concurrent(args, precision, ks[0], kernel_ms, record)
        for r in rows:
            print(f"arrow concurrent {r['processes']} x broadcast {r['query_blocks']}x{r['target_blocks']} "
                  f"{r['precision']} k={r['k']}: {r['tasks']} tasks in {r['wall_ms']:.0f} ms (task median "
                  f"{r['task_ms_median']:.0f} ms) vs kernel {r['kernel_exact_ms']:.0f} ms -> "
                  f"{100 * r['share_of_kernel']:.0f}% of kernel throughput")
        return
    if args.arrow_timeline:
        rng = np.random.default_rng(7)
        arrow_timeline(args, rng.standard_normal((args.nq, args.d), dtype=np.float32),
                       rng.standard_normal((args.nt, args.d), dtype=np.float32), "bf16", ks[0])
        return

    shapes = [] if args.arrow_only else [(args.d, ks, precisions)]
    if args.d_large and not args.arrow_only:
        shapes.append((args.d_large, [ks[0]], [p for p in precisions if p != "fp32"]))
    for d, shape_ks, shape_precisions in shapes:
        gen = torch.Generator(device=dev).manual_seed(d)
        Q = torch.randn(args.nq, d, device=dev, generator=gen)
        T = torch.randn(args.nt, d, device=dev, generator=gen)
        bias = (T * T).sum(1)
        flops = 2.0 * args.nq * args.nt * d
        for precision in shape_precisions:
            prepared = prepare_targets(T, "l2", precision)
            t_gemm = statistics.median(cuda_ms(lambda: gemm_alone(Q, T, bias, precision), args.reps))
            record(d=d, precision=precision, what="gemm", ms=t_gemm, tflops=flops / t_gemm / 1e9)
            for k in shape_ks:
                reps_base = 1 if d > 256 or precision == "fp32" else args.reps
                t_base = statistics.median(cuda_ms(lambda: addmm_topk(Q, T, bias, precision, k), reps_base))
                t_fused = statistics.median(cuda_ms(lambda: fused_pass(Q, prepared, k), args.reps))
                t_exact = statistics.median(cuda_ms(lambda: search_prepared(Q, prepared, k), args.reps))
                # The plain search's own accuracy, for the record (recall of the exact answer).
                _, i_plain = fused_pass(Q[:2048], prepared, k)
                _, i_exact = search_prepared(Q[:2048], prepared, k)
                recall = float((i_plain[:, :, None] == i_exact[:, None, :]).any(2).float().mean())
                record(d=d, precision=precision, k=k, what="compare", gemm_ms=t_gemm,
                       addmm_topk_ms=t_base, fused_ms=t_fused, exact_ms=t_exact,
                       fused_tflops=flops / t_fused / 1e9, speedup_vs_addmm_topk=t_base / t_fused,
                       fused_over_gemm=t_fused / t_gemm, exact_over_fused=t_exact / t_fused,
                       plain_recall=recall)
            del prepared
            torch.cuda.empty_cache()
        del Q, T, bias
        torch.cuda.empty_cache()

    if not args.no_arrow:
        record(what="upload_rates", **upload_rates())
        rng = np.random.default_rng(7)
        nq_a, nt_a, d = args.nq, args.nt, args.d
        Qn = rng.standard_normal((nq_a, d), dtype=np.float32)
        Tn = rng.standard_normal((nt_a, d), dtype=np.float32)
        for precision in [p for p in ("bf16", "tf32") if p in precisions]:
            k = ks[0]
            q = torch.from_numpy(Qn).to(dev)
            prepared = prepare_targets(torch.from_numpy(Tn).to(dev), "l2", precision)
            t_exact = statistics.median(cuda_ms(lambda: search_prepared(q, prepared, k), args.reps))
            del prepared, q
            torch.cuda.empty_cache()
            # The GPU searcher alone (numpy in/out, host-device copies included, no Arrow).
            from udfs.gpu import GpuBlockSearcher
            from udfs.context import SearchSettings

            searcher = GpuBlockSearcher(SearchSettings(k, "l2", "gpu", precision), dev)
            bounds = np.linspace(0, nt_a, 5).astype(int)
            searcher.search(Qn, Tn[bounds[0]:bounds[1]], target_key=-1)   # warm-up
            t0 = time.perf_counter()
            for b in range(4):
                searcher.search(Qn, Tn[bounds[b]:bounds[b + 1]], target_key=b)
            searcher_ms = (time.perf_counter() - t0) * 1e3
            del searcher
            torch.cuda.empty_cache()
            # (plan, query blocks, target blocks): the blocked plan's pairs of one query block;
            # the broadcast plan streaming query blocks past target blocks that stay resident.
            # Three tasks per shape: the first of its stage in this process (it keeps the
            # broadcast blocks: udfs.gpu_task.task_scope), the next of the same stage (finds them
            # on the device), and one of a stage that keeps nothing (uploads them again).
            from udfs.gpu_task import local_task

            for plan, q_blocks, t_blocks in ARROW_SHAPES:
                q_rows, t_rows = -(-nq_a // q_blocks), -(-nt_a // t_blocks)
                with local_task(scope=f"benchmark {plan} {q_blocks}x{t_blocks} {precision} k={k}"):
                    res = arrow_path(Qn, Tn, k, precision, t_rows, q_rows, plan)
                    # The next tasks of the stage: the median of --arrow-reps (the host side's
                    # time moves between runs).
                    warm_runs = [arrow_path(Qn, Tn, k, precision, t_rows, q_rows, plan,
                                            profile=precision == "bf16" and args.profile and r == 0)
                                 for r in range(max(1, args.arrow_reps))]
                warm_runs.sort(key=lambda r: r["search_s"] + r["merge_s"])
                res_warm = warm_runs[len(warm_runs) // 2]
                res_fresh = arrow_path(Qn, Tn, k, precision, t_rows, q_rows, plan)
                total = res_warm["search_s"] + res_warm["merge_s"]
                fresh = res_fresh["search_s"] + res_fresh["merge_s"]
                for r in warm_runs:
                    if r["profile"]:
                        print(f"# profile, {plan} {precision}\n" + r["profile"], flush=True)
                record(d=d, precision=precision, k=k, what="arrow", plan=plan, query_blocks=q_blocks,
                       target_blocks=t_blocks, kernel_exact_ms=t_exact,
                       searcher_ms=searcher_ms, searcher_share_of_kernel=t_exact / searcher_ms,
                       arrow_search_ms=res_warm["search_s"] * 1e3, arrow_merge_ms=res_warm["merge_s"] * 1e3,
                       arrow_first_ms=(res["search_s"] + res["merge_s"]) * 1e3,
                       arrow_share_of_kernel=(t_exact / 1e3) / total,
                       arrow_runs_ms=[round((r["search_s"] + r["merge_s"]) * 1e3, 1) for r in warm_runs],
                       arrow_unkept_ms=fresh * 1e3, arrow_unkept_share=(t_exact / 1e3) / fresh,
                       pairs=res_warm["pairs"],
                       rows=res_warm["rows"], minor_faults=res_warm["minor_faults"])

    if args.arrow_breakdown:   # last: the timers stay installed
        acc = install_stage_timers()
        from udfs.gpu_task import local_task

        for plan, q_blocks, t_blocks in ARROW_SHAPES:
            # The second task of a stage (kept broadcast blocks): the timers keep its stages.
            with local_task(scope=f"breakdown {plan} {q_blocks}x{t_blocks}"):
                for _ in range(2):
                    res = arrow_path(Qn, Tn, ks[0], "bf16", -(-args.nt // t_blocks), -(-args.nq // q_blocks),
                                     plan, on_start=acc.clear)
            record(what="arrow_breakdown", plan=plan, query_blocks=q_blocks, target_blocks=t_blocks,
                   total_ms=round((res["search_s"] + res["merge_s"]) * 1e3, 1), minor_faults=res["minor_faults"],
                   **{name: round(v * 1e3, 1) for name, v in sorted(acc.items())})

    print("\n| d | precision | k | GEMM ms | addmm+topk ms | fused ms | exact ms | fused TFLOP/s | "
          "fused vs addmm+topk | fused / GEMM | exact / fused |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["what"] == "compare":
            print(f"| {r['d']} | {r['precision']} | {r['k']} | {r['gemm_ms']:.1f} | {r['addmm_topk_ms']:.1f} | "
                  f"{r['fused_ms']:.1f} | {r['exact_ms']:.1f} | {r['fused_tflops']:.0f} | "
                  f"{r['speedup_vs_addmm_topk']:.1f}x | {r['fused_over_gemm']:.2f} | {r['exact_over_fused']:.2f} |")
    for r in rows:
        if r["what"] == "arrow":
            print(f"arrow {r['plan']} {r['query_blocks']}x{r['target_blocks']} blocks {r['precision']} k={r['k']}: search {r['arrow_search_ms']:.0f} ms + merge "
                  f"{r['arrow_merge_ms']:.0f} ms vs kernel {r['kernel_exact_ms']:.0f} ms -> "
                  f"{100 * r['arrow_share_of_kernel']:.0f}% of kernel throughput (next task of the stage, median of "
                  f"{'/'.join(f'{t:.0f}' for t in r['arrow_runs_ms'])} ms; "
                  f"first {r['arrow_first_ms']:.0f} ms, nothing kept {r['arrow_unkept_ms']:.0f} ms = "
                  f"{100 * r['arrow_unkept_share']:.0f}%); searcher alone "
                  f"{r['searcher_ms']:.0f} ms ({100 * r['searcher_share_of_kernel']:.0f}%)")


if __name__ == "__main__":
    main()
