"""Memory of the blocked plan, for a target several times the driver's memory, local[2] (table ``blocked``;
what it measures: its text in ``benchmarks/report.py``). A thread samples the processes' RSS; each one's peak
is reset before (``/proc/PID/clear_refs``) and its ``VmHWM`` read after, so a spike between samples counts.

Usage: python benchmarks/memory.py [--budgets 64m] [--target-rows 2500000]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from benchmarks._record import Recorder, local_spark, noop, process_tree, sampling, vector_table  # noqa: E402

MiB = 1 << 20
QUERY_ROWS, D, K, DRIVER_MEMORY = 4_000, 256, 10, "1g"
CHUNK_ROWS = 1 << 16          # rows generated and written at a time (64 MiB at d = 256)
ROWS_PER_FILE = 1 << 18       # several files: several input partitions
SAMPLE_S = 0.2                # seconds between RSS samples


def write_side(path: str, rows: int, d: int, seed: int, id_name: str, vec_name: str) -> int:
    """Write ``rows`` Gaussian float32 vectors as Parquet files under ``path``; bytes written."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    schema = pa.schema([(id_name, pa.int64()), (vec_name, pa.list_(pa.float32()))])
    written = 0
    for file_start in range(0, rows, ROWS_PER_FILE):
        file_rows = min(ROWS_PER_FILE, rows - file_start)
        name = os.path.join(path, f"part-{file_start // ROWS_PER_FILE:05d}.parquet")
        with pq.ParquetWriter(name, schema, compression="none") as writer:
            for start in range(file_start, file_start + file_rows, CHUNK_ROWS):
                n = min(CHUNK_ROWS, file_start + file_rows - start)
                vectors = rng.standard_normal(n * d, dtype=np.float32).reshape(n, d)
                writer.write_table(vector_table(np.arange(start, start + n, dtype=np.int64), vectors, id_name,
                                                vec_name), row_group_size=1 << 15)
        written += os.path.getsize(name)
    return written


def _status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of a process in bytes (empty when it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value, _ = line.split()
                    out[key[:-1]] = int(value) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> dict[int, str]:
    """{pid: kind} of this process tree's JVM ("JVM") and Python workers ("worker"; pyspark's
    daemon, which only forks them, is "daemon")."""
    found = {}
    for pid, fields in process_tree(root).items():
        if pid == root:
            continue
        cmd = _cmdline(pid)
        if "java" in cmd.split(" ")[0]:
            found[pid] = "JVM"
        elif "pyspark.daemon" in cmd or "pyspark.worker" in cmd:
            # The daemon (a JVM's child) forks the workers: a worker's parent is a daemon.
            forked = "pyspark.daemon" in _cmdline(int(fields[1]))
            found[pid] = "worker" if forked or "pyspark.daemon" not in cmd else "daemon"
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="32m,128m", help="spark.nearestJoin.taskMemoryBytes values")
    ap.add_argument("--target-rows", type=int, default=2_500_000)
    args = ap.parse_args(argv)

    data = tempfile.mkdtemp(prefix="nj-memory-")
    # A SIGTERM (a timeout, a kill) still removes the data: turn it into SystemExit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args, data)
    finally:
        shutil.rmtree(data, ignore_errors=True)


def run(args, data: str) -> int:
    from pyspark.sql import functions as F

    from nearest_join import explain_nearest_join, nearest_by_join
    from nearest_join.planner import parse_bytes

    t0 = time.perf_counter()
    t_path, q_path = os.path.join(data, "target"), os.path.join(data, "query")
    t_bytes = write_side(t_path, args.target_rows, D, 2, "tid", "tv")
    write_side(q_path, QUERY_ROWS, D, 1, "qid", "qv")
    print(f"data: target {args.target_rows} x {D} float32 = {t_bytes / MiB:.0f} MiB Parquet "
          f"({t_bytes / parse_bytes(DRIVER_MEMORY):.1f}x driver memory {DRIVER_MEMORY}), "
          f"query {QUERY_ROWS} rows; written in {time.perf_counter() - t0:.0f} s", flush=True)

    spark = local_spark("nearest_join-memory", DRIVER_MEMORY, conf={"spark.executorEnv.PYTHONPATH": ROOT})
    try:
        q = spark.read.parquet(q_path)
        t = spark.read.parquet(t_path)
        ranking = F.vector_l2_distance(q.qv, t.tv)

        # Warm-up: every worker imports the stack and loads the compiled kernels; its RSS
        # afterwards is the fixed cost of a worker (nothing of the budget is held any more).
        warm_q, warm_t = q.limit(200), t.limit(4000)
        noop(nearest_by_join(warm_q, warm_t, F.vector_l2_distance(warm_q.qv, warm_t.tv), K,
                             broadcast_limit_bytes=0, query_block_rows=50, target_block_rows=500))
        time.sleep(1.0)
        fixed_by_pid = {pid: _status(pid).get("VmRSS", 0) for pid, kind in descendants(os.getpid()).items()
                        if kind == "worker"}
        fixed_cost = max(fixed_by_pid.values(), default=0)

        kinds: dict[int, str] = {}
        table = []
        for budget_text in args.budgets.split(","):
            budget = parse_bytes(budget_text)
            spark.conf.set("spark.nearestJoin.taskMemoryBytes", str(budget))
            plan = explain_nearest_join(q, t, ranking, K)
            if plan.plan != "blocked":
                raise SystemExit(f"expected the blocked plan, got {plan.plan}: {plan.reason}")
            peaks: dict[int, int] = {}

            def sample():
                kinds.update(descendants(os.getpid()))
                for pid in list(kinds):
                    status = _status(pid)
                    value = max(status.get("VmRSS", 0), status.get("VmHWM", 0))
                    if value:
                        peaks[pid] = max(peaks.get(pid, 0), value)
            for pid in descendants(os.getpid()):     # the kernel's peak, from now on
                try:
                    with open(f"/proc/{pid}/clear_refs", "w") as f:
                        f.write("5")
                except OSError:
                    pass
            with sampling(sample, SAMPLE_S):
                start = time.perf_counter()
                noop(nearest_by_join(q, t, ranking, K))
                seconds = time.perf_counter() - start
            workers = sorted((v for pid, v in peaks.items() if kinds[pid] == "worker"), reverse=True)
            # Above its own fixed cost (a worker started after the warm-up: the largest one).
            above = max((v - fixed_by_pid.get(pid, fixed_cost) for pid, v in peaks.items()
                         if kinds[pid] == "worker"), default=0)
            jvms = sorted((v for pid, v in peaks.items() if kinds[pid] == "JVM"), reverse=True)
            table.append(dict(budget=budget_text, query_block_rows=plan.query_block_rows,
                              target_block_rows=plan.target_block_rows, target_blocks=plan.target_blocks,
                              worker_peak_mib=[round(v / MiB) for v in workers],
                              worker_fixed_mib=round(fixed_cost / MiB), jvm_peak_mib=[round(v / MiB) for v in jvms],
                              join_s=round(seconds, 1), over_budget=round(above / budget, 2)))
    finally:
        spark.stop()

    rec = Recorder("memory", gpu=False)
    for row in table:
        rec.add("blocked", master="local[2]", driver_memory=DRIVER_MEMORY, d=D, k=K, metric="l2",
                query_rows=QUERY_ROWS, target_rows=args.target_rows,
                target_parquet_mib=round(t_bytes / MiB), **row)
    rec.print_tables()
    return 0


if __name__ == "__main__":
    sys.exit(main())
