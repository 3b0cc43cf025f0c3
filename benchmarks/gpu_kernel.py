"""GPU Arrow path (issue 4): per shape of ``ARROW_SHAPES`` the plan's executor functions fed Arrow
batches, against one exact kernel call on the same rows (bf16, tf32); ``--arrow-concurrent N``: N
broadcast tasks sharing one GPU. Prints the rows as JSON lines, writes them to ``--out``.

    python benchmarks/gpu_kernel.py --arrow-only --out results/     # table ``arrow``
    python benchmarks/gpu_kernel.py --arrow-concurrent 2            # table ``arrow_concurrent``
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._record import cuda_ms, git_commit, run_spawned, vector_table  # noqa: E402
from nearest_kernels.gpu import prepare_targets, search_prepared  # noqa: E402

ARROW_SHAPES = [("blocked", 1, 4), ("broadcast", 1, 4), ("broadcast", 2, 1), ("broadcast", 4, 1), ("broadcast", 8, 2)]


def exact_kernel_ms(Qn, Tn, precision: str, k: int, reps: int) -> float:
    """One exact kernel call on the whole target, on the device: the median of ``reps`` (CUDA
    events, after a warm-up that compiles); NaN without a GPU."""
    if not torch.cuda.is_available():
        return float("nan")
    dev = torch.device("cuda")
    q = torch.from_numpy(Qn).to(dev)
    prepared = prepare_targets(torch.from_numpy(Tn).to(dev), "l2", precision)
    ms = cuda_ms(lambda: search_prepared(q, prepared, k), reps)
    del prepared, q
    torch.cuda.empty_cache()
    return ms


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
    qt, tt = (vector_table(np.arange(len(x), dtype=np.int64), x, side + "id", side + "v")
              for x, side in ((Qn, "q"), (Tn, "t")))
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

    The blocked plan runs ``search_pairs`` then ``merge_partials`` per query block, the broadcast
    plan ``search_broadcast``; rows are emitted with their payload, host-device copies included."""
    from udfs.blocks import merge_partials, search_broadcast, search_pairs

    ctx, pairs = _packed_pairs(Qn, Tn, k, precision, t_block_rows, q_block_rows, plan=plan)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if plan == "blocked":
        partial = list(search_pairs(iter(pairs), ctx))
        groups: dict[int, list] = {}
        for b in partial:
            groups.setdefault(b.column(0)[0].as_py(), []).append(b)
        rows = sum(out.num_rows for key, bs in groups.items() for out in merge_partials((key,), bs, ctx))
    else:
        rows = sum(out.num_rows for out in search_broadcast(iter(pairs), ctx))
    return {"seconds": time.perf_counter() - t0, "rows": rows, "pairs": len(pairs)}


def _concurrent_worker(rank, spec, barrier, results) -> None:
    """One simulated Python worker of ``--arrow-concurrent`` (a spawned process): the same
    data and packed pairs as the others, two untimed tasks (compiles, the kept target block),
    then ``spec["tasks"]`` timed tasks back to back from a common start."""
    from udfs.blocks import search_broadcast
    from udfs.context import local_task

    rng = np.random.default_rng(7)
    Qn = rng.standard_normal((spec["nq"], spec["d"]), dtype=np.float32)
    Tn = rng.standard_normal((spec["nt"], spec["d"]), dtype=np.float32)

    def task() -> int:
        return sum(b.num_rows for b in search_broadcast(iter(pairs), ctx))

    with local_task(scope="concurrent tasks"):       # one stage: the target block is kept
        ctx, pairs = _packed_pairs(Qn, Tn, spec["k"], spec["precision"], spec["t_rows"], spec["q_rows"],
                                   spec["backend"], plan="broadcast")
        task()
        task()
        barrier.wait()
        start = time.monotonic()
        rows = sum(task() for _ in range(spec["tasks"]))
        results.put((rank, start, time.monotonic(), rows))


def arrow_concurrent(args, precision: str, k: int, kernel_ms: float, record) -> None:
    """Several broadcast tasks sharing one GPU, as ``spark.task.resource.gpu.amount`` < 1 runs
    them: each in its own process (Spark's Python workers), the GPU time-sliced between them.
    Throughput share = tasks x one kernel call's time / wall time from the common start."""
    for plan, q_blocks, t_blocks in [s for s in ARROW_SHAPES if s[0] == "broadcast"]:
        spec = {"nq": args.nq, "nt": args.nt, "d": args.d, "k": k, "precision": precision,
                "q_rows": -(-args.nq // q_blocks), "t_rows": -(-args.nt // t_blocks),
                "tasks": args.arrow_tasks, "backend": "gpu" if torch.cuda.is_available() else "cpu"}
        for n_proc in sorted({1, args.arrow_concurrent}):
            done = run_spawned(_concurrent_worker, [(r, spec) for r in range(n_proc)], timeout=600)
            wall, tasks = max(d[2] for d in done) - min(d[1] for d in done), spec["tasks"] * n_proc
            record(what="arrow_concurrent", plan=plan, query_blocks=q_blocks, target_blocks=t_blocks,
                   precision=precision, k=k, processes=n_proc, tasks=tasks, wall_ms=round(1e3 * wall, 1),
                   rows=sum(d[3] for d in done), kernel_exact_ms=kernel_ms,
                   share_of_kernel=kernel_ms * tasks / (1e3 * wall))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nq", type=int, default=65_536)
    ap.add_argument("--nt", type=int, default=1_000_000)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--ks", default="10,100", help="the first is the k of every row")
    ap.add_argument("--precisions", default="fp32,tf32,bf16", help="those of bf16 and tf32 run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for results.jsonl")
    ap.add_argument("--arrow-only", action="store_true", help="no effect (kept for recorded commands)")
    ap.add_argument("--arrow-shapes", default=None,
                    help="Arrow path: comma-separated plan:QxT shapes, e.g. broadcast:2x1,blocked:1x4 "
                         "(default: all of ARROW_SHAPES)")
    ap.add_argument("--arrow-concurrent", type=int, default=0,
                    help="only: N broadcast tasks at once on the GPU, each in its own process (and 1, "
                         "for comparison), for each broadcast shape of --arrow-shapes, first k")
    ap.add_argument("--arrow-tasks", type=int, default=6, help="--arrow-concurrent: timed tasks per process")
    ap.add_argument("--arrow-reps", type=int, default=3,
                    help="Arrow path: next-task runs per shape (the median is reported)")
    args = ap.parse_args(argv)
    if args.arrow_shapes:
        global ARROW_SHAPES
        ARROW_SHAPES = [(p.split(":")[0], *map(int, p.split(":")[1].split("x")))
                        for p in args.arrow_shapes.split(",")]
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    print(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()} torch {torch.__version__} "
          f"commit {git_commit()} nq={args.nq} nt={args.nt}", flush=True)

    def record(**row):
        print(json.dumps(row), flush=True)
        if out:
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    rng = np.random.default_rng(7)
    Qn = rng.standard_normal((args.nq, args.d), dtype=np.float32)
    Tn = rng.standard_normal((args.nt, args.d), dtype=np.float32)
    precisions = [p for p in ("bf16", "tf32") if p in args.precisions.split(",")]
    k = int(args.ks.split(",")[0])
    if args.arrow_concurrent:
        for precision in precisions:
            arrow_concurrent(args, precision, k, exact_kernel_ms(Qn, Tn, precision, k, args.reps), record)
        return

    from udfs.context import local_task

    for precision in precisions:
        t_exact = exact_kernel_ms(Qn, Tn, precision, k, args.reps)
        # (plan, query blocks, target blocks): the blocked plan's pairs of one query block;
        # the broadcast plan streaming query blocks past target blocks that stay resident.
        # The first task of its stage in this process keeps the broadcast blocks
        # (udfs.context.task_scope); the next tasks of the same stage, timed, find them on the device.
        for plan, q_blocks, t_blocks in ARROW_SHAPES:
            q_rows, t_rows = -(-args.nq // q_blocks), -(-args.nt // t_blocks)
            with local_task(scope=f"benchmark {plan} {q_blocks}x{t_blocks} {precision} k={k}"):
                arrow_path(Qn, Tn, k, precision, t_rows, q_rows, plan)
                # the median of --arrow-reps (the host side's time moves between runs)
                runs = sorted((arrow_path(Qn, Tn, k, precision, t_rows, q_rows, plan)
                               for _ in range(max(1, args.arrow_reps))), key=lambda r: r["seconds"])
            median = runs[len(runs) // 2]
            record(d=args.d, precision=precision, k=k, what="arrow", plan=plan, query_blocks=q_blocks,
                   target_blocks=t_blocks, kernel_exact_ms=t_exact, arrow_ms=median["seconds"] * 1e3,
                   arrow_share_of_kernel=(t_exact / 1e3) / median["seconds"],
                   arrow_runs_ms=[round(r["seconds"] * 1e3, 1) for r in runs], pairs=median["pairs"],
                   rows=median["rows"])


if __name__ == "__main__":
    main()
