"""Benchmark records, and the helpers the benchmarks share.

A benchmark writes one JSON line per measured case to ``benchmarks/results/<benchmark>.jsonl`` (committed:
the current figures; git keeps their history) through :class:`Recorder`; ``benchmarks/report.py`` renders
them. A record is a flat JSON object: its provenance (:data:`benchmarks.report.RESERVED`: benchmark,
table, run, date, commit, command, machine), then its own fields. ``table`` names one table of the
benchmark, which holds one run: the current one.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from benchmarks.report import RESERVED, RESULTS_DIR, read_records, render_table

ROOT = Path(__file__).resolve().parents[1]
SMOKE_DIR = ROOT / "benchmarks" / "out" / "results"    # --quick runs: not in git, replace nothing
LIBRARY_DIRS = ("nearest_join", "udfs", "nearest_kernels", "jobs")


def git_commit() -> str:
    """``BENCH_COMMIT`` if set, else the short HEAD (``+dirty`` when library code differs
    from it), else ``unknown``."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *LIBRARY_DIRS], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def command_line() -> str:
    """The command that ran this process, shell-quoted, the interpreter relative to the working
    directory where it lies under it."""
    exe = Path(sys.executable)
    exe_text = str(exe.relative_to(Path.cwd())) if exe.is_relative_to(Path.cwd()) else exe.name
    return shlex.join([exe_text, *sys.argv])


def _cpu_model() -> str:
    """lscpu's model name, family/model, caches and hypervisor."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    facts = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}
    extras = [f"family {facts['CPU family']} model {facts['Model']}" if "CPU family" in facts else "",
              f"L2 {facts['L2 cache']}" if "L2 cache" in facts else "",
              f"L3 {facts['L3 cache']}" if "L3 cache" in facts else "",
              facts.get("Hypervisor vendor", "")]
    return f"{facts.get('Model name', platform.machine())} ({', '.join(e for e in extras if e)})"


def blas_info() -> dict:
    """The BLAS kernel selection of this process: ``OPENBLAS_CORETYPE`` (or ``unset``), any
    other ``OPENBLAS_*`` setting, and each loaded BLAS library with the kernel it reports
    (threadpoolctl's ``architecture``).
    Loads scipy's BLAS first: numba's ``np.dot``, the cpu kernel's sgemm, binds to it."""
    with contextlib.suppress(ImportError):
        import scipy.linalg.cython_blas  # noqa: F401
    libraries = []
    with contextlib.suppress(ImportError):
        from threadpoolctl import threadpool_info

        libraries = sorted({f"{lib.get('prefix')} {lib.get('version')} {lib.get('architecture')}"
                            for lib in threadpool_info() if lib.get("user_api") == "blas"})
    info = {"OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "unset")}
    info.update({k: v for k, v in sorted(os.environ.items()) if k.startswith("OPENBLAS_") and k not in info})
    info["libraries"] = libraries
    return info


def _gpus() -> list[str]:
    """GPU models, through nvidia-smi (no torch import needed); [] without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def machine_info(blas: bool = True, gpu: bool | None = None) -> dict:
    """CPU model, cores this process may use, memory; the GPUs (``gpu=None``: when
    nvidia-smi finds any); for CPU benchmarks (``blas=True``) the BLAS kernel selection."""
    info: dict = {"cpu": _cpu_model(), "cores": len(os.sched_getaffinity(0)),
                  "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    gpus = _gpus() if gpu is not False else []
    if gpus:
        info["gpu"] = f"{len(gpus)} x {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus)
    if blas:
        info["blas"] = blas_info()
    return info


class Recorder:
    """Appends one run's records of ``benchmark`` (the script's name) to ``<results_dir>/<benchmark>.jsonl``;
    ``blas``, ``gpu``: what :func:`machine_info` records; ``command``, ``commit``, ``machine``,
    ``date`` override what is found (transcribing older figures)."""

    def __init__(self, benchmark: str, *, blas: bool = True, gpu: bool | None = None,
                 command: str | None = None, commit: str | None = None, machine: dict | None = None,
                 date: str | None = None, results_dir: Path | str | None = None) -> None:
        self.benchmark = benchmark
        self.path = Path(results_dir or RESULTS_DIR) / f"{benchmark}.jsonl"
        self.run = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + uuid.uuid4().hex[:6]
        self.command = command if command is not None else command_line()
        self.commit = commit if commit is not None else git_commit()
        self.machine = machine if machine is not None else machine_info(blas=blas, gpu=gpu)
        self.date = date
        self._tables: set[str] = set()

    def add(self, table: str, **fields) -> dict:
        """Write one record to ``table``; the run's first record of a table replaces the
        records of earlier runs of it. Returns the record."""
        clash = sorted(set(fields) & set(RESERVED))
        if clash:
            raise ValueError(f"record fields {clash} are reserved ({', '.join(RESERVED)})")
        date = self.date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        record = {"benchmark": self.benchmark, "table": table, "run": self.run, "date": date,
                  "commit": self.commit, "command": self.command, "machine": self.machine, **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = Path(tempfile.gettempdir()) / f"nj-bench-{self.benchmark}.lock"   # not in git
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)       # two runs of one benchmark at once stay whole
            kept = read_records(self.path)
            if table not in self._tables:
                kept = [r for r in kept if r.get("table") != table or r.get("run") == self.run]
                self._tables.add(table)
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r, default=_plain) + "\n" for r in [*kept, record]))
            os.replace(tmp, self.path)
        return record

    def print_tables(self) -> None:
        """Print the tables this run wrote, as ``benchmarks/report.py`` renders them in RESULTS.md."""
        records = [r for r in read_records(self.path) if r.get("run") == self.run]
        for table in dict.fromkeys(r["table"] for r in records):
            print("\n" + render_table(self.benchmark, table, [r for r in records if r["table"] == table]))


def _plain(value):
    """numpy scalars and paths as JSON values."""
    return value.item() if hasattr(value, "item") else str(value)


# --- timing --------------------------------------------------------------------------------


def _busy_cpu_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (Linux /proc/stat)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed(fn, repeat: int) -> tuple[float, float]:
    """The shortest wall time, in seconds, of ``repeat`` calls of ``fn``, and the share of the
    machine's cores that other processes kept busy during that call (0 on a quiet machine)."""
    best, others = float("inf"), 0.0
    cores = os.cpu_count() or 1
    for _ in range(repeat):
        busy, mine, start = _busy_cpu_seconds(), time.process_time(), time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        foreign = (_busy_cpu_seconds() - busy) - (time.process_time() - mine)
        if seconds < best:
            best, others = seconds, max(0.0, foreign) / (seconds * cores)
    return best, others


def best_of(fn, repeat: int) -> float:
    """The shortest wall time, in seconds, of ``repeat`` calls of ``fn``."""
    return timed(fn, repeat)[0]


def cuda_ms(fn, reps: int, warmup: int = 1) -> float:
    """The median device time (CUDA events, ms) of ``reps`` calls of ``fn`` after ``warmup`` calls."""
    import torch

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
    return statistics.median(times)


# --- data and processes --------------------------------------------------------------------


def local_spark(app: str, driver_memory: str, master: str = "local[2]", conf: dict | None = None):
    """The Spark session of a benchmark: ``master``, no UI and no progress bar, 4 shuffle
    partitions, ``driver_memory``, any other ``conf``; Spark's log at ERROR. Its Python
    workers run this interpreter unless ``PYSPARK_PYTHON`` says otherwise."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (SparkSession.builder.master(master).appName(app)
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.memory", driver_memory).config("spark.sql.shuffle.partitions", "4"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def cached_parquet(spark, path: str, table, row_group_size: int):
    """The Arrow ``table`` written to ``path`` as Parquet, read back by Spark and cached
    (counted: in memory before anything is timed)."""
    import pyarrow.parquet as pq

    pq.write_table(table, path, row_group_size=row_group_size)
    frame = spark.read.parquet(path).cache()
    frame.count()
    return frame


def noop(df) -> None:
    """Compute every row of ``df`` into Spark's ``noop`` sink (nothing is kept)."""
    df.write.format("noop").mode("overwrite").save()


def vector_table(ids, vectors, id_name: str, vector_name: str, null_rows=None):
    """An Arrow table of ``ids`` and the rows of the matrix ``vectors`` as a list column (what
    Spark reads as ``array<float>`` or ``array<double>``). ``null_rows``: NULL vectors where
    true, and NaN elements as NULL elements."""
    import numpy as np
    import pyarrow as pa

    flat = vectors.reshape(-1)
    values = pa.array(flat) if null_rows is None else pa.array(flat, mask=np.isnan(flat))
    offsets = pa.array(np.arange(vectors.shape[0] + 1, dtype=np.int32) * vectors.shape[1], pa.int32())
    lists = pa.ListArray.from_arrays(offsets, values, mask=None if null_rows is None else pa.array(null_rows))
    return pa.table({id_name: pa.array(ids), vector_name: lists})


def run_spawned(target, rank_args: list[tuple], timeout: float) -> list:
    """Benchmark processes started together, one per rank (as Spark's Python workers, or one
    per GPU): ``target(*args, barrier, results)`` in a spawned process per ``args`` of
    ``rank_args``; each passes ``barrier`` (all ranks) before its timed part and puts one
    result on ``results``. Returns the results (in arrival order); raises when a process
    exits with an error."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(rank_args)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, results)) for args in rank_args]
    for proc in procs:
        proc.start()
    got = [results.get(timeout=timeout) for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"benchmark process exited with {proc.exitcode}")
    return got


def process_tree(root: int) -> dict[int, list[str]]:
    """``root`` and its descendants now (the Spark JVM, its Python daemon and workers), each
    with the fields of its ``/proc/PID/stat`` after the command name (``[1]`` the parent,
    ``[11]``, ``[12]`` user and system ticks, ``[19]`` the start time)."""
    stats: dict[int, list[str]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            stats[int(name)] = stat[stat.rindex(")") + 2:].split()
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    found, stack = {}, [root]
    while stack:
        pid = stack.pop()
        if pid in stats:
            found[pid] = stats[pid]
        stack.extend(children.get(pid, ()))
    return found


@contextlib.contextmanager
def sampling(sample, every: float = 0.2):
    """Call ``sample()`` every ``every`` seconds on a thread while the block runs, and once after
    it (what a process used or held between two samples still counts)."""
    stop = threading.Event()

    def loop():
        while not stop.wait(every):
            sample()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sample()
