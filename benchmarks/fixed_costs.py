"""Fixed costs: what a small job and a new worker pay besides the search, each from fresh processes (tables
``demo``, ``compile``, ``warm_call``, ``fresh_clone``; what each measures: its text in ``benchmarks/report.py``).

Usage: python benchmarks/fixed_costs.py [--tables demo compile warm_call fresh_clone]
"""
from __future__ import annotations

import argparse
import json
import os
import re
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
from udfs.warm import WarmUp, _warm, warm_up_seconds
t = time.perf_counter()
_warm(WarmUp(sys.argv[1], "auto", ("float32", "float32")), ("broadcast",))
print(time.perf_counter() - t, warm_up_seconds()[1])
"""

# One session of conf/local.yaml's settings, its Python workers' socket as argv[1] says, then
# each join of WARM_JOINS called CALLS times: a JSON line per join with the median call.
_CALLS = """
import json, statistics, sys, time
import numpy as np
from benchmarks._record import local_spark
from jobs.spec import load_profile
from nearest_join import nearest_by_join
conf = {k: v for k, v in load_profile("local")[1].items() if k not in ("master", "spark.driver.memory")}
conf["spark.python.unix.domain.socket.enabled"] = sys.argv[1]
spark = local_spark("warm calls", "2g", conf=conf)
rng = np.random.default_rng(0)
for nq, nt, plan in json.loads(sys.argv[2]):
    q = spark.createDataFrame([(i, v) for i, v in enumerate(rng.standard_normal((nq, 64)).tolist())],
                              "qid int, v array<float>").cache()
    t = spark.createDataFrame([(i, v) for i, v in enumerate(rng.standard_normal((nt, 64)).tolist())],
                              "tid int, w array<float>").cache()
    q.count(), t.count()
    if plan != "local":
        spark.conf.set("spark.nearestJoin.localLimitBytes", "0")
    seconds, jobs = [], []
    for call in range(int(sys.argv[3])):
        group = f"{nq}-{plan}-{call}"
        spark.sparkContext.setJobGroup(group, group)
        start = time.perf_counter()
        nearest_by_join(q, t, "l2", 5, vectors=("v", "w"), broadcast_limit_bytes=0 if plan == "blocked" else None
                        ).write.format("noop").mode("overwrite").save()
        seconds.append(time.perf_counter() - start)
        jobs.append(len(spark.sparkContext.statusTracker().getJobIdsForGroup(group)))
    spark.conf.unset("spark.nearestJoin.localLimitBytes")
    print(json.dumps({"nq": nq, "nt": nt, "plan": plan, "seconds": statistics.median(seconds[5:]),
                      "spark_jobs": jobs[-1]}), flush=True)
"""
WARM_JOINS = [(20, 30, "local"), (20, 30, "broadcast"), (20, 30, "blocked"), (2000, 20000, "local"),
              (2000, 20000, "broadcast"), (2000, 20000, "blocked")]


def warm_calls(rec: Recorder, calls: int = 25) -> None:
    """A join's cost in a warm session: the median of calls after the first five, each of the
    same inputs (cached), the result written to Spark's noop sink; the local profile's session
    with its Python workers over TCP on localhost (Spark's default) and over a Unix domain
    socket (the profile's), two sessions of each."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    found = {}
    # A session of each, then one of each in the other order: each socket's faster median
    # (the machine drifts between sessions).
    for socket, enabled in (("tcp", "false"), ("unix", "true"), ("unix", "true"), ("tcp", "false")):
        proc = subprocess.run([sys.executable, "-c", _CALLS, enabled, json.dumps(WARM_JOINS), str(calls)], env=env,
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                by = found.setdefault((r["nq"], r["nt"], r["plan"]), {})
                if socket not in by or r["seconds"] < by[socket]["seconds"]:
                    by[socket] = r
    for (nq, nt, plan), by in found.items():
        rec.add("warm_call", nq=nq, nt=nt, d=64, k=5, plan=plan, spark_jobs=by["unix"]["spark_jobs"],
                tcp_s=round(by["tcp"]["seconds"], 3), unix_s=round(by["unix"]["seconds"], 3),
                tcp_over_unix=round(by["tcp"]["seconds"] / by["unix"]["seconds"], 2), calls=calls)


def demo(rec: Recorder, data_dir: Path) -> None:
    """Three runs of the demo, each a new process: with nothing cached (no numba cache, no
    class archive: a ``pip install`` that never ran ``make``); after recording the class
    archive, with an empty numba cache (what ``make run`` gives a fresh install); then again."""
    classes = tempfile.mkdtemp(prefix="nj-jvm-")   # XDG_CACHE_HOME: where jobs.jvm keeps the archive
    base = {**os.environ, "XDG_CACHE_HOME": classes}
    nearest_join = str(Path(sys.executable).parent / "nearest-join")
    out = data_dir / "out"
    for numba_cache, archive in (("empty", "none"), ("empty", "recorded"), ("warm", "recorded")):
        if archive == "recorded" and numba_cache == "empty":
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "jobs.jvm"], env=base, cwd=ROOT, check=True, capture_output=True)
            print(f"class archive recorded in {time.perf_counter() - start:.1f} s", flush=True)
        if numba_cache == "empty":
            env = {**base, "NUMBA_CACHE_DIR": tempfile.mkdtemp(prefix="nj-numba-")}
        start = time.perf_counter()
        proc = subprocess.run([nearest_join, "demo", "--data-dir", str(data_dir / "demo"),
                               "--set", f"output.path={out}", "--set", "output.mode=overwrite",
                               "--set", "spark.spark.ui.showConsoleProgress=false"],
                              env=env, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        summary = json.loads((out / "_nearest_join_summary.json").read_text())
        rec.add("demo", numba_cache=numba_cache, class_archive=archive, wall_s=round(wall, 2),
                job_s=summary["wall_time_s"], session_s=round(wall - summary["wall_time_s"], 2),
                kernel_warm_up_s=summary["kernel_warm_up_s"], kernel_compile_s=summary["kernel_compile_s"],
                **{f"{name}_s": seconds for name, seconds in summary["phases_s"].items()},
                executor_search_s=summary["executor_s"]["search"], plan=summary["plan"]["plan"])


def compile_costs(rec: Recorder) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    seconds: dict[str, list[float]] = {}
    for metric in METRICS:
        cache = tempfile.mkdtemp(prefix="nj-numba-")
        for _ in range(2):   # an empty cache, then the one the first process filled
            proc = subprocess.run([sys.executable, "-c", _WARM, metric], env={**env, "NUMBA_CACHE_DIR": cache},
                                  capture_output=True, text=True, check=True)
            seconds.setdefault(metric, []).append([round(float(x), 2) for x in proc.stdout.split()[-2:]])
    for i, state in enumerate(("empty", "warm")):
        rec.add("compile", numba_cache=state, **{metric: s[i][0] for metric, s in seconds.items()},
                **{f"{metric}_compiling": s[i][1] for metric, s in seconds.items()})


def fresh_clone(rec: Recorder, work: Path) -> None:
    """``make run`` then ``make test`` in a new clone of HEAD (its own virtualenv), as a new
    user's first two commands and as .ci/run."""
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "PYSPARK_PYTHON", "VIRTUAL_ENV")}
    for target in ("run", "test"):
        start = time.perf_counter()
        # unbuffered: each line when a terminal would show it
        proc = subprocess.Popen(["make", target], cwd=clone, env={**env, "PYTHONUNBUFFERED": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines, shown = [], None
        for line in proc.stdout:   # the demo's summary ends with its first output rows
            lines.append(line)
            if shown is None and re.match(r"first \d+ output rows", line):
                shown = time.perf_counter() - start
        seconds = time.perf_counter() - start
        output = "".join(lines)
        if proc.wait():
            print(output[-6000:], flush=True)
        rec.add("fresh_clone", step=f"make {target}", seconds=round(seconds, 1), rc=proc.returncode)
        if target != "run":
            continue
        recorded = re.search(r"Spark's class archive recorded in (\d+) s", output)
        if shown is not None:
            rec.add("fresh_clone", step="of which: until the demo's result is on the screen", seconds=round(shown, 1),
                    rc=0)
        if recorded:
            rec.add("fresh_clone", step="of which: recording Spark's class archive (python -m jobs.jvm)",
                    seconds=float(recorded.group(1)), rc=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", nargs="+", default=["demo", "compile", "warm_call", "fresh_clone"],
                        choices=["demo", "compile", "warm_call", "fresh_clone"])
    args = parser.parse_args()
    rec = Recorder("fixed_costs")
    with tempfile.TemporaryDirectory(prefix="nj-fixed-") as work:
        work = Path(work)
        if "demo" in args.tables:
            demo(rec, work)
        if "compile" in args.tables:
            compile_costs(rec)
        if "warm_call" in args.tables:
            warm_calls(rec)
        if "fresh_clone" in args.tables:
            fresh_clone(rec, work)
    rec.print_tables()
    return 0


if __name__ == "__main__":
    sys.exit(main())
