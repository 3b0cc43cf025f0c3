"""Multi-GPU scaling of the blocked plan (issue 6). Spark cannot run on the GPU machines (no Java), so
each executor is one process per GPU running ``udfs.blocks.search_pairs`` on its share of the (query
block, target block) pairs (whole target blocks, round robin), its GPU chosen from the task address as
under Spark; timed from a barrier after each warmed up to the last one done. Then all partials go
through ``merge_partials`` and the merged rows are compared with the one-GPU run.

    python benchmarks/multi_gpu.py --gpus 1,2 --out results/     # issue 6 sizes
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _context(params):
    from udfs.context import JoinContext, SearchSettings, SideLayout

    return JoinContext(SearchSettings(params["k"], "l2", params["backend"], params["precision"]),
                       SideLayout("qv", 1, params["d"], params["q_rows"]),
                       SideLayout("tv", 1, params["d"], params["t_rows"]), "inner", True, params["schema"])


def _read(path):
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def _write(path, table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _pair_batches(q_packed, t_packed, t_indices):
    """Pair rows in the plan's order: each target block meets every query block."""
    from udfs import columns as C

    schema = pa.schema([(C.Q_BLOCK_ID, pa.int64()), (C.Q_BLOB, pa.binary()),
                        (C.T_BLOCK_ID, pa.int64()), (C.T_BLOB, pa.binary())])
    for ti in t_indices:
        for qi in range(q_packed.num_rows):
            yield pa.RecordBatch.from_arrays(
                [pa.array([q_packed.column(0)[qi].as_py()], pa.int64()),
                 pa.array([q_packed.column(1)[qi].as_py()], pa.binary()),
                 pa.array([t_packed.column(0)[ti].as_py()], pa.int64()),
                 pa.array([t_packed.column(1)[ti].as_py()], pa.binary())], schema=schema)


def worker(rank, n_procs, gpu_address, work_dir, params, barrier, results):
    """One simulated executor: its GPU from the task address, its share of the pairs."""
    import torch

    from udfs.blocks import search_pairs
    from udfs.context import local_task

    with local_task(gpu=gpu_address):
        work = Path(work_dir)
        q_packed, t_packed = _read(work / "q.arrow"), _read(work / "t.arrow")
        ctx = _context(params)
        mine = [ti for ti in range(t_packed.num_rows) if ti % n_procs == rank]
        # Warm-up: compile, first upload (an executor has done this before its next task).
        list(search_pairs(_pair_batches(q_packed, t_packed, mine[:1]), ctx))
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        barrier.wait()
        t0 = time.perf_counter()
        partial = list(search_pairs(_pair_batches(q_packed, t_packed, mine), ctx))
        sync()
        t1 = time.perf_counter()
        _write(work / f"partial_{n_procs}_{rank}.arrow", pa.Table.from_batches(partial))
        results.put({"rank": rank, "start": t0, "stop": t1, "pairs": len(partial)})


def merge(n_procs, work_dir, params):
    from udfs.blocks import merge_partials

    table = pa.concat_tables([_read(Path(work_dir) / f"partial_{n_procs}_{r}.arrow") for r in range(n_procs)])
    ctx = _context(params)
    groups: dict[int, list] = {}
    for batch in table.to_batches(max_chunksize=1):
        groups.setdefault(batch.column(0)[0].as_py(), []).append(batch)
    t0 = time.perf_counter()
    out = [b for key in sorted(groups) for b in merge_partials((key,), groups[key], ctx)]
    merged = pa.Table.from_batches(out)
    return merged, time.perf_counter() - t0


def main(argv=None):
    from benchmarks._record import run_spawned
    from udfs.packing import PACKED_SCHEMA, empty_target_block, pack_blocks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nq", type=int, default=262_144)
    ap.add_argument("--nt", type=int, default=4_000_000)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--q-rows", type=int, default=65_536)
    ap.add_argument("--t-rows", type=int, default=500_000)
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--backend", default="gpu", help="'auto' runs the CPU path (smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(42)
    Q = rng.standard_normal((args.nq, args.d), dtype=np.float32)
    T = rng.standard_normal((args.nt, args.d), dtype=np.float32)

    def table(x, name):
        vec = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), args.d)
        return pa.table({name + "id": np.arange(len(x), dtype=np.int64), name + "v": vec})

    qt, tt = table(Q, "q"), table(T, "t")
    del Q, T
    params = {"k": args.k, "d": args.d, "precision": args.precision, "q_rows": args.q_rows, "t_rows": args.t_rows,
              "backend": args.backend, "schema": tt.schema}
    ctx = _context(params)
    rows = []
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        for name, src, layout, part in (("q", qt, ctx.query, 0), ("t", tt, ctx.target, 1)):
            # Targets with the empty block, as the plan unions it (it carries each query
            # block's rows to the merge).
            extra = [empty_target_block()] if name == "t" else []
            _write(work / f"{name}.arrow", pa.Table.from_batches(
                list(pack_blocks(src.to_batches(max_chunksize=1 << 16), layout, part)) + extra, schema=PACKED_SCHEMA))
        del qt, tt
        baseline = None
        for n in [int(g) for g in args.gpus.split(",")]:
            addresses = [str(r) for r in range(n)]
            got = run_spawned(worker, [(r, n, addresses[r], work_dir, params) for r in range(n)], timeout=1800)
            wall = max(g["stop"] for g in got) - min(g["start"] for g in got)
            merged, merge_s = merge(n, work_dir, params)
            key = merged.sort_by([("__nj_out_0", "ascending"), ("__nj_out_4", "ascending"),
                                  ("__nj_out_2", "ascending")])
            same = None
            if baseline is None:
                baseline = (key, wall)
            else:
                same = key.equals(baseline[0])
            row = {"gpus": n, "addresses": addresses, "wall_s": wall, "merge_s": merge_s,
                   "pairs_per_process": [g["pairs"] for g in got],
                   "pairs_per_s": sum(g["pairs"] for g in got) / wall,
                   "queries_x_targets_per_s": args.nq * args.nt / wall,
                   "efficiency": None if n == 1 else (baseline[1] / wall) / n, "equals_1gpu": same,
                   "rows": merged.num_rows}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "multi_gpu.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
