"""Fixed costs: what a small job, a new worker and a call in a warm session pay besides the search.

Three tables, each from fresh processes of this machine:

* ``demo``: the demo job through the CLI (``nearest-join demo``: 2,000 x 20,000, d=64, k=5),
  twice: first with an empty numba cache (``NUMBA_CACHE_DIR`` a new directory: what a fresh
  install pays), then again with that cache. Wall time of the command, the job's own time (its
  summary), each phase, Spark's session start (wall less the job), and the seconds the job's
  kernel warm-up spent compiling or loading kernels beside the phases.
* ``compile``: per metric, what one worker process pays for the kernels of its first search:
  the executor path (``udfs.warm``) in a new process with an empty numba cache, then in a new
  process with that cache.
* ``call``: in one warm ``local[2]`` session, ``nearest_by_join`` on the demo's tables (best of
  ``--repeat``) against Spark's own ``nearestByJoin`` on the same cached DataFrames (one run), and
  the CPU kernel alone on the same arrays: the call's fixed cost is its time less the kernel's.

Usage::

    python benchmarks/fixed_costs.py                  # all three tables
    python benchmarks/fixed_costs.py --tables demo compile

Records go to ``benchmarks/results/fixed_costs.jsonl``; ``make bench-report`` renders them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ["PYTHONDONTWRITEBYTECODE"] = ""   # as make's targets: processes keep their bytecode

from benchmarks._record import Recorder  # noqa: E402

METRICS = ("l2", "sqeuclidean", "cosine", "inner_product")
_WARM = """
import sys, time
from udfs.warm import WarmUp, _warm
t = time.perf_counter()
_warm(WarmUp(sys.argv[1], "auto", ("float32", "float32")), ("broadcast",))
print(time.perf_counter() - t)
"""


def demo(rec: Recorder, data_dir: Path) -> None:
    cache = tempfile.mkdtemp(prefix="nj-numba-")
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    nearest_join = str(Path(sys.executable).parent / "nearest-join")
    out = data_dir / "out"
    for run in ("cold numba cache", "its cache warm"):
        start = time.perf_counter()
        proc = subprocess.run([nearest_join, "demo", "--data-dir", str(data_dir / "demo"),
                               "--set", f"output.path={out}", "--set", "output.mode=overwrite",
                               "--set", "spark.spark.ui.showConsoleProgress=false"],
                              env=env, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        summary = json.loads((out / "_nearest_join_summary.json").read_text())
        phases = summary["phases_s"]
        print(f"demo, {run}: wall {wall:.1f} s, job {summary['wall_time_s']:.1f} s, {phases}, "
              f"warm-up {summary['kernel_warm_up_s']:.2f} s", flush=True)
        rec.add("demo", run=run, wall_s=round(wall, 2), job_s=summary["wall_time_s"],
                session_s=round(wall - summary["wall_time_s"], 2), kernel_warm_up_s=summary["kernel_warm_up_s"],
                **{f"{name}_s": seconds for name, seconds in phases.items()})


def compile_costs(rec: Recorder) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for metric in METRICS:
        cache = tempfile.mkdtemp(prefix="nj-numba-")
        seconds = []
        for _ in range(2):
            proc = subprocess.run([sys.executable, "-c", _WARM, metric], env={**env, "NUMBA_CACHE_DIR": cache},
                                  capture_output=True, text=True, check=True)
            seconds.append(float(proc.stdout.split()[-1]))
        print(f"compile {metric}: {seconds[0]:.2f} s cold, {seconds[1]:.2f} s from the cache", flush=True)
        rec.add("compile", metric=metric, cold_s=round(seconds[0], 2), cached_s=round(seconds[1], 2))


def call(rec: Recorder, data_dir: Path, repeat: int) -> None:
    import numpy as np
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from jobs.demo import DemoSize, ensure_demo_data
    from nearest_join import nearest_by_join
    from nearest_join.kernels import knn

    tables = ensure_demo_data(data_dir / "demo", DemoSize())
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config("spark.python.daemon.module", "udfs.daemon")
             .config("spark.sql.shuffle.partitions", "8").config("spark.driver.memory", "4g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    q = spark.read.parquet(str(tables / "query")).cache()
    t = spark.read.parquet(str(tables / "target")).toDF("tid", "tname", "w").cache()
    q.count(), t.count()
    ours = lambda: nearest_by_join(q, t, F.vector_l2_distance(q.vec, t.w), 5).write.format("noop").mode("overwrite").save()  # noqa: E731
    ours()   # the session's first call: its workers start and load the kernels
    best = min(_timed(ours) for _ in range(repeat))
    theirs = _timed(lambda: q.nearestByJoin(t, F.vector_l2_distance(q.vec, t.w), 5, "exact", "distance")
                    .write.format("noop").mode("overwrite").save())
    queries = np.array(q.select("vec").toPandas()["vec"].tolist(), np.float32)
    targets = np.array(t.select("w").toPandas()["w"].tolist(), np.float32)
    knn(queries, targets, 5, "l2", backend="cpu")
    kernel = min(_timed(lambda: knn(queries, targets, 5, "l2", backend="cpu")) for _ in range(repeat))
    print(f"call: ours {best:.3f} s (kernel {kernel:.3f} s, fixed {best - kernel:.3f} s), Spark's {theirs:.1f} s, "
          f"{theirs / best:.1f}x", flush=True)
    rec.add("call", nq=queries.shape[0], nt=targets.shape[0], d=queries.shape[1], k=5, ours_s=round(best, 3),
            kernel_s=round(kernel, 4), fixed_s=round(best - kernel, 3), spark_s=round(theirs, 2),
            speedup=round(theirs / best, 1), repeat=repeat)
    spark.stop()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", nargs="+", default=["demo", "compile", "call"], choices=["demo", "compile", "call"])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rec = Recorder("fixed_costs")
    with tempfile.TemporaryDirectory(prefix="nj-fixed-") as work:
        work = Path(work)
        if "demo" in args.tables:
            demo(rec, work)
        if "compile" in args.tables:
            compile_costs(rec)
        if "call" in args.tables:
            call(rec, work, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
