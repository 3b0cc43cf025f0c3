"""Spark's driver JVM starts from an archive of the classes a join loads (class data sharing).

A fresh JVM spends its first seconds loading, verifying and linking Spark's classes, for the
session and again for the first query of each kind. Java's class data sharing maps classes a
previous JVM dumped (``-XX:ArchiveClassesAtExit``) instead: the session and the first join
start in about half the time. The archive belongs to one Java build and one classpath (one
pyspark install), so it is kept per pair, under the user's cache directory.

* :func:`build_archive` (``python -m jobs.jvm``; ``make run`` runs it, and ``make test``'s set-up
  while pip installs torch) records one: a subprocess runs a small join of each plan through
  Parquet under a local master, its JVM dumps the classes as it exits, and only an archive
  that a JVM then maps is moved into place (a truncated one crashes the JVM that maps it, so
  none is ever half there).
* :func:`java_options` gives the driver's options that use it, where it exists; without it,
  a JVM starts as it always did. A JVM that cannot use it (another classpath) starts without it,
  silently.

Only a driver JVM that runs the tasks too (a local master) uses it: a cluster's executors
start on other machines.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["archive_path", "java_options", "build_archive"]

# The JVM's messages about an archive it cannot use: it then runs without one.
_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def _java() -> str | None:
    """The java that pyspark's launcher runs (``$JAVA_HOME/bin/java``, else the PATH's)."""
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(found) if found and os.path.exists(found) else None


def _jars() -> tuple[str, Path] | None:
    """(version, jars directory) of the pyspark this process imports."""
    try:
        import pyspark
    except ImportError:
        return None
    return pyspark.__version__, Path(pyspark.__file__).resolve().parent / "jars"


def archive_path() -> Path | None:
    """Where the archive of this Java build and this pyspark install lives (None without
    java or pyspark). The name hashes what the archive depends on: a new JDK or pyspark
    gets a new archive, never a stale one."""
    java, found = _java(), _jars()
    if java is None or found is None:
        return None
    version, jars = found
    stat = os.stat(java)
    key = "\n".join([java, str(stat.st_size), str(stat.st_mtime_ns), str(jars), version,
                     *(sorted(os.listdir(jars)) if jars.is_dir() else [])])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "nearest_join" / "jvm" / f"spark-{version}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa"


def _forget_orphans(directory: Path) -> None:
    """Delete the archives of pyspark installs or JDKs that are gone (each archive's ``.json``
    names both): an archive is some 200 MB, and every virtualenv records its own."""
    for owner in directory.glob("*.json"):
        try:
            facts = json.loads(owner.read_text())
            gone = not (os.path.isdir(facts["jars"]) and os.path.exists(facts["java"]))
        except (OSError, ValueError, KeyError, TypeError):
            gone = True
        if gone:
            owner.with_suffix(".jsa").unlink(missing_ok=True)
            owner.unlink(missing_ok=True)


def java_options() -> str:
    """The driver JVM's options that map the class archive, or "" when there is none yet."""
    path = archive_path()
    if path is None or not path.is_file():
        return ""
    return f"-XX:SharedArchiveFile={path} {_QUIET}"


def with_archive(options: str | None) -> str:
    """``options`` (a ``spark.driver.extraJavaOptions`` value) with :func:`java_options` added,
    unless they already name a class archive."""
    options = (options or "").strip()
    if "SharedArchiveFile" in options or "ArchiveClassesAtExit" in options:
        return options
    return f"{options} {java_options()}".strip()


def _maps(java: str, archive: Path) -> bool:
    """Whether a JVM starts with ``archive`` (a truncated archive kills it with SIGBUS)."""
    # A JVM that crashes writes hs_err_pid*.log into its working directory: into none here.
    result = subprocess.run([java, f"-XX:SharedArchiveFile={archive}", *_QUIET.split(),
                             f"-XX:ErrorFile={os.devnull}", "-XX:-CreateCoredumpOnCrash", "-version"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120,
                            cwd=tempfile.gettempdir())
    return result.returncode == 0


def _wait_for_group(pgid: int, deadline: float) -> None:
    """Until no process of the group ``pgid`` is left: the JVM writes the archive as it exits,
    after its Python parent may have."""
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
    raise TimeoutError("the JVM recording the class archive did not exit")


def _recorder(recording: Path) -> list[str]:
    """The command whose JVM writes the archive to ``recording`` as it exits (:func:`_record`)."""
    return [sys.executable, "-m", "jobs.jvm", "--record", str(recording)]


def build_archive(timeout_s: float = 600) -> Path | None:
    """Record the class archive unless it exists; its path, or None where there is no java or
    pyspark. Safe to run concurrently: each run records its own file and the moves are atomic."""
    path = archive_path()
    java = _java()
    if path is None or java is None:
        return None
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    recording = path.with_name(f"{path.stem}.{os.getpid()}.recording")
    deadline = time.monotonic() + timeout_s
    try:
        child = subprocess.Popen(_recorder(recording), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 start_new_session=True, cwd=Path(__file__).resolve().parents[1])
        try:
            _, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            raise RuntimeError(f"recording the class archive took over {timeout_s:.0f} s") from None
        _wait_for_group(child.pid, deadline)
        if child.returncode != 0:
            raise RuntimeError(f"recording the class archive failed:\n{err.decode(errors='replace')[-2000:]}")
        if not recording.is_file() or not _maps(java, recording):
            raise RuntimeError("the JVM wrote no class archive it can map")
        _forget_orphans(path.parent)
        path.with_suffix(".json").write_text(json.dumps({"java": java, "jars": str(_jars()[1])}))
        os.replace(recording, path)
    finally:
        recording.unlink(missing_ok=True)
    return path


def _record(archive: str) -> None:
    """In the recording subprocess: a local session whose JVM dumps its classes to ``archive``
    as it exits, after a small join of each plan, read from and written to Parquet."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import SparkSession

    from nearest_join import nearest_by_join

    from .spec import load_profile

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)   # as the runner's local sessions
    _, settings = load_profile("local")   # the local profile's session, recording
    settings["spark.driver.extraJavaOptions"] = (
        f"{settings.get('spark.driver.extraJavaOptions', '')} -XX:ArchiveClassesAtExit={archive} {_QUIET}")
    settings["spark.ui.showConsoleProgress"] = "false"
    builder = SparkSession.builder.master(settings.pop("master", "local[2]")).appName("nearest_join-class-archive")
    for name, value in settings.items():
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as work:
        for side, rows in (("query", 20), ("target", 50)):
            vectors = rng.normal(size=(rows, 4)).astype(np.float32)
            pq.write_table(pa.table({"id": np.arange(rows), "vec": list(vectors)}), f"{work}/{side}.parquet")
        q = spark.read.parquet(f"{work}/query.parquet")
        t = spark.read.parquet(f"{work}/target.parquet").withColumnRenamed("id", "tid")
        for options in ({}, dict(broadcast_limit_bytes=0, query_block_rows=8, target_block_rows=16)):
            out = nearest_by_join(q, t, "l2", 3, vectors="vec", distance_col="d", **options)
            out.drop("vec").write.mode("overwrite").parquet(f"{work}/out")
        spark.read.parquet(f"{work}/out").toPandas()
    spark.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--record"]:
        _record(argv[1])
        return 0
    started = time.perf_counter()
    existed = (archive_path() or Path()).is_file()
    try:
        path = build_archive()
    except (RuntimeError, OSError, TimeoutError) as exc:
        # An archive only makes Spark start sooner: without one it starts as it always did.
        print(f"no class archive for Spark's JVM ({exc}); local jobs start without one", file=sys.stderr)
        return 0
    if path is None:
        print("no java or pyspark: no class archive", file=sys.stderr)
    elif not existed:
        print(f"Spark's class archive recorded in {time.perf_counter() - started:.0f} s: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
