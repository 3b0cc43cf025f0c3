"""The device test run (``pytest -m gpu``) inside one call's time limit, and its report.

Run on the GPU machine from the repository root::

    python3 tests/kernels/gpu_test_run.py --out $OUT --deadline-s 520 [--workers 8]
        [--only FILE] [--timeout-s 180] [FILES...]

The tests run in ``--workers`` pytest-xdist processes on the one GPU (the cost is mostly Triton
compilation, CPU-bound, one configuration at a time per process; the processes share one
Triton cache, so a configuration compiled by one is warm for the rest). Each test is bounded
by pytest-timeout (``--timeout-s``) and the whole run by ``--deadline-s`` (SIGINT, then kill).
Every outcome is logged as it arrives (``tests/kernels/_gpu_run_log.py``), so a stopped run
still reports: per file passed / failed / skipped / not reached, the wall time, the slowest
cases, and the node ids not reached or failed (``--only`` reruns such a list).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_FILES = ["tests/kernels/test_gpu_exactness.py", "tests/kernels/test_gpu.py",
                 "tests/udfs/test_gpu_search.py", "tests/kernels/test_gpu_shapes.py"]


def collect(files, only) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "-p", "tests.kernels._gpu_run_log", *files]
    if only:
        cmd += ["--gpu-run-only", only]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", default=DEFAULT_FILES)
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline-s", type=float, default=520)
    # (each worker holds its own CUDA context and caching allocator: with more, the largest
    # shape tests, d of 3072 and 4096 at k=1000, ran out of memory on an 80 GB card)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--timeout-s", type=int, default=180)
    ap.add_argument("--only", default=None, help="a file of node ids to run (one a line)")
    ap.add_argument("--tag", default="run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    ids = collect(args.files, args.only)
    print(f"{len(ids)} tests collected in {time.time() - start:.1f} s", flush=True)
    log = out / f"{args.tag}.jsonl"
    log.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "-p", "tests.kernels._gpu_run_log", "--gpu-run-log", str(log),
           f"--junitxml={out / (args.tag + '.xml')}", "-o", "junit_family=xunit2", *args.files]
    if args.only:
        cmd += ["--gpu-run-only", args.only]
    if args.workers > 0:   # pytest-xdist (on the device image)
        cmd += ["-n", str(args.workers), "--dist", "load"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += [f"--timeout={args.timeout_s}"]
    else:
        print("pytest-timeout is not installed: no per-test bound but the deadline", flush=True)
    with open(out / f"{args.tag}.out", "w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=False)
        remaining = args.deadline_s - (time.time() - start)
        try:
            proc.wait(timeout=max(1.0, remaining))
        except subprocess.TimeoutExpired:
            print("deadline: stopping the run (SIGINT)", flush=True)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall = time.time() - start
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    outcome = {}
    for r in rows:   # the call's outcome, or the setup's where setup failed / skipped
        outcome[r["nodeid"]] = r
    per_file = collections.defaultdict(collections.Counter)
    for nodeid in ids:
        f = nodeid.split("::")[0]
        r = outcome.get(nodeid)
        per_file[f]["collected"] += 1
        per_file[f][r["outcome"] if r else "not reached"] += 1
    failed = sorted(n for n, r in outcome.items() if r["outcome"] == "failed")
    unreached = [n for n in ids if n not in outcome]
    slowest = sorted(outcome.values(), key=lambda r: -r["seconds"])[:15]
    summary = dict(tag=args.tag, wall_s=round(wall, 1), workers=args.workers, timeout_s=args.timeout_s,
                   returncode=proc.returncode, per_file={f: dict(c) for f, c in per_file.items()},
                   failed=failed, slowest=[(r["nodeid"], r["seconds"]) for r in slowest])
    (out / f"{args.tag}_summary.json").write_text(json.dumps(summary, indent=1))
    (out / f"{args.tag}_rerun.txt").write_text("".join(n + "\n" for n in failed + unreached))
    for r in rows:
        if r["outcome"] == "failed":
            print("FAILED", r["nodeid"], (r["message"] or "")[-600:], sep="\n  ", flush=True)
    print(f"\nwall {wall:.0f} s, pytest rc {proc.returncode}, {args.workers} workers, "
          f"timeout {args.timeout_s} s per test")
    for f, c in per_file.items():
        print(f"{f}: " + ", ".join(f"{key} {c[key]}" for key in
                                   ("collected", "passed", "failed", "skipped", "not reached") if c[key]))
    print("slowest:", *(f"{s:8.1f} s  {n}" for n, s in summary["slowest"][:8]), sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
