"""GPU kernel benchmark (issue 4): fused Triton top-k vs torch addmm + topk vs the GEMM alone.

Run on a CUDA machine from the repository root:

    python benchmarks/gpu_kernel.py --out results/        # full table (about 3 minutes)
    python benchmarks/gpu_kernel.py --quick               # small shapes, smoke run
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

from nearest_kernels import _gpu_bound as gb  # noqa: E402
from nearest_kernels import _gpu_prepare as gp  # noqa: E402
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
    from nearest_kernels import _triton_candidates as tcands

    qs = gp.prepare_queries(Q, prepared.side)
    keys, idx, _ = tcands.triton_candidates(qs, prepared.side, max(gb.MIN_CANDIDATES, gb.next_pow2(k)))
    return keys[:, :k], idx[:, :k]


def _packed_pairs(Qn, Tn, k, precision, t_block_rows, q_block_rows, backend: str = "gpu",
                  plan: str = "blocked"):
    """(JoinContext, pair batches) as ``plan`` feeds them: ``list<float>`` vector columns
    (what Spark sends for ``array<float>``), blocks packed by ``pack_blocks`` and the empty
    target block first, every pair row carrying its target blob and, in the blocked plan,
    its query blob (the broadcast plan: a query block's first pair only)."""
    import pyarrow as pa

    from udfs.context import JoinContext, SearchSettings, SideLayout
    from udfs.local import pair_batches
    from udfs.packing import PACKED_SCHEMA, empty_target_block, pack_blocks

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


def arrow_path(Qn, Tn, k, precision, t_block_rows, q_block_rows, plan="blocked"):
    """Time one plan's executor functions on Arrow batches as Spark feeds them (packing untimed).

    The pairs come from :func:`_packed_pairs`; the blocked plan runs ``search_pairs`` then
    ``merge_partials`` per query block, the broadcast plan ``search_broadcast``; rows are
    emitted with their payload (ids and both vectors), host-device copies included.
    """
    from udfs.blocks import merge_partials, search_broadcast, search_pairs

    ctx, pairs = _packed_pairs(Qn, Tn, k, precision, t_block_rows, q_block_rows, plan=plan)
    torch.cuda.synchronize()
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
    return {"search_s": t1 - t0, "merge_s": t2 - t1, "rows": rows, "pairs": len(pairs), "minor_faults": faults}


def _concurrent_worker(rank, spec, barrier, results) -> None:
    """One simulated Python worker of ``--arrow-concurrent`` (a spawned process): the same
    data and packed pairs as the others, two untimed tasks (compiles, the kept target block),
    then ``spec["tasks"]`` timed tasks back to back from a common start."""
    from udfs.context import local_task

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
    from benchmarks._record import run_spawned

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

    from benchmarks._record import import_base_kernels

    import_base_kernels(folder)
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
    ap.add_argument("--only", default="",
                    help="--compare-base: comma-separated name parts; run only the shapes whose name has one")
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
    ap.add_argument("--compare-base", default=None,
                    help="only: the EXACT search against another commit's nearest_kernels copied to "
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
            from udfs.context import SearchSettings
            from udfs.gpu_search import GpuBlockSearcher

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
            # broadcast blocks: udfs.context.task_scope), the next of the same stage (finds them
            # on the device), and one of a stage that keeps nothing (uploads them again).
            from udfs.context import local_task

            for plan, q_blocks, t_blocks in ARROW_SHAPES:
                q_rows, t_rows = -(-nq_a // q_blocks), -(-nt_a // t_blocks)
                with local_task(scope=f"benchmark {plan} {q_blocks}x{t_blocks} {precision} k={k}"):
                    res = arrow_path(Qn, Tn, k, precision, t_rows, q_rows, plan)
                    # The next tasks of the stage: the median of --arrow-reps (the host side's
                    # time moves between runs).
                    warm_runs = [arrow_path(Qn, Tn, k, precision, t_rows, q_rows, plan)
                                 for _ in range(max(1, args.arrow_reps))]
                warm_runs.sort(key=lambda r: r["search_s"] + r["merge_s"])
                res_warm = warm_runs[len(warm_runs) // 2]
                res_fresh = arrow_path(Qn, Tn, k, precision, t_rows, q_rows, plan)
                total = res_warm["search_s"] + res_warm["merge_s"]
                fresh = res_fresh["search_s"] + res_fresh["merge_s"]
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
