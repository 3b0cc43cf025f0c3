"""Subprocess suites that run beside the main pytest run.

Some checks need a process of their own: the Triton interpreter (``TRITON_INTERPRET`` is read
when triton loads), each OpenBLAS kernel selection (chosen when the library loads), Spark's
local-cluster master and a Spark Connect server (neither can share a process with the suite's
local[2] session). Each used to run in the test that checks it, so the main run waited for it.

A test module registers such a suite at import (:func:`register`) and marks the test that
checks it ``@pytest.mark.background("name")``. After collection, ``tests/conftest.py`` starts
the suites of the selected tests, one at a time in registration order, on a worker thread, and
moves their tests to the end of the run; each of those tests then waits for its suite's result
(the ``background_result`` fixture) and asserts on it. So the suites overlap the main run: on
2 cores the main run leaves one mostly idle (Spark's job start-ups, py4j round trips, Python
loops), and the suites fill it. A suite whose test is deselected never starts; one still
running when the session ends is killed.

A *lane* (:data:`LANES`) is a set of ordinary test files or folders that runs as such a suite:
one pytest subprocess with a Spark session of its own. When a run selects the lane's test
(``tests/test_lanes.py``) together with tests of its paths, the main run hands those tests to
the lane (:func:`take_lanes`) and the lane's test asserts that every one of them passed or
skipped, showing the failures' output otherwise; the terminal summary gives the lane's counts
and slowest tests. Run without tests/test_lanes.py (``pytest tests/jobs``), they run in the main
run.
Two workers run the suites, so a lane overlaps the short suites as well as the main run.
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from jobs.jvm import with_archive

REPO = Path(__file__).resolve().parents[1]
# The JVM options of every Spark JVM the tests start (the sessions' drivers, local-cluster's
# executors, the Connect server). The tests' JVMs plan and run thousands of tiny queries:
# - C2's compilations cost more CPU than they save (the kernels run in Python workers);
# - G1 started a concurrent marking cycle for nearly every humongous allocation (Arrow and
#   task-result buffers larger than half its 1 MB regions), each on a core the suite needs;
#   the parallel collector has no concurrent cycles.
# - Spark's class archive, where `make run` or `make test`'s set-up (jobs.jvm) has recorded one:
#   the JVMs start faster.
JVM_OPTIONS = with_archive("-XX:TieredStopAtLevel=1 -XX:+UseParallelGC")


def python_workers() -> dict[str, str]:
    """The Python workers of every session the tests start, as the jobs' local profile has them
    (conf/local.yaml: the daemon udfs/daemon.py, the Unix domain socket). Read when a session
    starts: jobs.spec imports pyspark, which the GPU machine's test run (kernels only) lacks."""
    from jobs.spec import load_profile

    return {name: value for name, value in load_profile("local")[1].items() if name.startswith("spark.python.")}


# The order the suites start in: the longest first, so the last to finish overlaps the main
# run. A suite not named here starts after these.
ORDER = ("join-oracles", "approx-and-jobs", "triton-interpreter", "local-cluster", "spark-connect", "blas-default",
         "blas-haswell")
# Suites running at once (beside the main run): on 2 cores the main run and one suite leave a
# core partly idle (job start-ups, py4j round trips), a second suite fills it.
WORKERS = 2
# lane name -> the files and folders (relative to the repository) whose tests it runs. The main
# run is the longest lane: its Spark tests wait on job start-ups and py4j round trips and keep
# about one core busy, so a second session takes some of them. Every lane pays a pytest start,
# a JVM and its warm-up: on 2 cores, fewer and longer lanes cost less CPU than more and shorter.
LANES = {
    "join-oracles": ("tests/join/test_exactness.py", "tests/join/test_caps.py", "tests/join/test_keys.py",
                     "tests/join/test_keyed_blocked.py", "tests/join/test_incremental.py"),
    "approx-and-jobs": ("tests/join/test_approx.py", "tests/join/test_approx_keys.py",
                        "tests/join/test_approx_blocked.py", "tests/jobs"),
}


@dataclass
class Suite:
    name: str
    argv: list[str]
    env: dict[str, str]
    timeout: float
    junit_path: str | None = None
    # filled in when it has run
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    process: subprocess.Popen | None = None

    def tail(self, chars: int = 4000) -> str:
        """The end of the suite's output, for assertion messages."""
        return f"[{self.name}: rc {self.returncode}, {self.seconds:.0f} s]\n" + \
            self.stdout[-chars:] + "\n--- stderr ---\n" + self.stderr[-chars:]

    def _junit_suite(self):
        assert self.junit_path and os.path.exists(self.junit_path), self.tail()
        suite = ET.parse(self.junit_path).getroot()
        return suite if suite.tag == "testsuite" else suite.find("testsuite")

    def junit(self) -> dict:
        """tests / failures / errors / skipped of a pytest suite's JUnit report."""
        suite = self._junit_suite()
        return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}

    def junit_failures(self) -> list[str]:
        """Each failed or erroring test case of the JUnit report: its name and its output."""
        found = []
        for case in self._junit_suite().iter("testcase"):
            for bad in list(case.findall("failure")) + list(case.findall("error")):
                name = f"{case.get('classname')}::{case.get('name')}"
                found.append(f"{bad.tag.upper()} {name}: {bad.get('message', '')}\n{bad.text or ''}")
        return found


_SUITES: dict[str, Suite] = {}
_QUEUE: queue.Queue = queue.Queue()
_WORKERS: list[threading.Thread] = []
# lane name -> the node ids handed to it by take_lanes
_LANE_TESTS: dict[str, list[str]] = {}
_LOCK = threading.Lock()
_STOPPED = threading.Event()


def register(name: str, argv: list[str], env: dict[str, str] | None = None,
             unset: tuple[str, ...] = (), timeout: float = 900, junit: bool = False) -> None:
    """Declare a suite: ``argv`` run from the repository root with this process's environment
    less the variables in ``unset``, plus ``env`` (and PYTHONPATH pointing at the repository).
    With ``junit``, the argv gets ``--junitxml=<file>`` appended (a pytest run) and
    :meth:`Suite.junit` reads it."""
    full_env = {k: v for k, v in os.environ.items() if k not in unset}
    full_env.update(PYTHONPATH=str(REPO), PYSPARK_PYTHON=sys.executable)
    full_env.update(env or {})
    argv = list(argv)
    junit_path = None
    if junit:
        junit_path = os.path.join(tempfile.mkdtemp(prefix=f"nj-{name}-"), "junit.xml")
        argv.append(f"--junitxml={junit_path}")
    _SUITES.setdefault(name, Suite(name, argv, full_env, timeout, junit_path))


def _run(suite: Suite) -> None:
    start = time.perf_counter()
    try:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            with _LOCK:
                if _STOPPED.is_set():
                    raise RuntimeError("the session ended before the suite started")
                suite.process = subprocess.Popen(suite.argv, cwd=REPO, env=suite.env,
                                                 stdout=out, stderr=err, text=True)
            try:
                suite.returncode = suite.process.wait(timeout=suite.timeout)
            except subprocess.TimeoutExpired:
                suite.process.kill()
                suite.process.wait()
                suite.returncode = -9
                err.write(f"\n[killed after the suite's timeout of {suite.timeout:.0f} s]\n")
            out.seek(0)
            err.seek(0)
            suite.stdout, suite.stderr = out.read(), err.read()
    except Exception as exc:  # noqa: BLE001 (reported through the suite's test)
        suite.returncode = -1
        suite.stderr += f"\n[could not run: {exc!r}]"
    finally:
        suite.seconds = time.perf_counter() - start
        suite.done.set()


def _work() -> None:
    while True:
        suite = _QUEUE.get()
        if suite is None:
            return
        _run(suite)


def start(names) -> None:
    """Queue the named suites (in :data:`ORDER`) on the worker threads."""
    with _LOCK:
        for name in sorted(set(names), key=rank):
            suite = _SUITES[name]
            if not suite.started:
                suite.started = True
                _QUEUE.put(suite)
        while len(_WORKERS) < WORKERS:
            _WORKERS.append(threading.Thread(target=_work, name=f"background-suites-{len(_WORKERS)}",
                                             daemon=True))
            _WORKERS[-1].start()


def registered(name: str) -> bool:
    return name in _SUITES


def take_lanes(items) -> list:
    """Hand the selected tests of each lane whose own test is selected to that lane's suite
    (registered here, with their node ids); return the items the main run keeps."""
    waiting = {name_of(item) for item in items if is_background(item)}
    kept = list(items)
    for name, paths in LANES.items():
        if name not in waiting:
            continue
        roots = [REPO / path for path in paths]
        mine = [item for item in kept
                if any(Path(str(item.path)).resolve().is_relative_to(root) for root in roots)]
        if not mine:
            continue
        taken = {id(item) for item in mine}
        kept = [item for item in kept if id(item) not in taken]
        _LANE_TESTS[name] = [item.nodeid for item in mine]
        register(name, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--durations=15", *_LANE_TESTS[name]], timeout=1200, junit=True)
    return kept


def lane_result(name: str) -> Suite:
    """The finished lane, after checking that it ran every test handed to it, and none failed.
    Skips (with the reason) when the run handed it no test."""
    import pytest

    if name not in _LANE_TESTS:
        pytest.skip(f"no test of {', '.join(LANES[name])} is selected in this run (they run in the "
                    f"lane only when they are)")
    suite = result(name)
    failures = suite.junit_failures() if suite.junit_path and os.path.exists(suite.junit_path) else []
    assert not failures and suite.returncode == 0, (
        f"{', '.join(LANES[name])} (run as the background lane {name!r}): {len(failures)} failed\n\n"
        + "\n\n".join(failures) + "\n\n" + suite.tail())
    report = suite.junit()
    # every test handed over ran (a test not collected there would be missing from the count)
    assert report["tests"] == len(_LANE_TESTS[name]), (report, len(_LANE_TESTS[name]), suite.tail())
    return suite


def rank(name: str) -> tuple[int, str]:
    return (ORDER.index(name) if name in ORDER else len(ORDER), name)


def result(name: str) -> Suite:
    """The suite's result, waiting for it (and starting it first if nothing did)."""
    if name not in _SUITES:
        raise KeyError(f"no background suite {name!r} registered (known: {sorted(_SUITES)})")
    start([name])
    suite = _SUITES[name]
    suite.done.wait()
    return suite


def stop() -> None:
    """Kill a suite still running (its test was not reached), start no other, end the workers."""
    with _LOCK:
        _STOPPED.set()
        for suite in _SUITES.values():
            if suite.process is not None and suite.process.poll() is None:
                suite.process.kill()
    for _ in _WORKERS:
        _QUEUE.put(None)


def summary() -> list[str]:
    """One line per suite that ran: name, exit status, seconds (its test's "setup" time in
    --durations is only the wait for it); for a lane also its counts and slowest tests."""
    lines = []
    for s in sorted(_SUITES.values(), key=lambda s: rank(s.name)):
        if not s.done.is_set():
            continue
        lines.append(f"{s.name}: rc {s.returncode}, {s.seconds:.1f} s")
        if s.name in _LANE_TESTS and s.junit_path and os.path.exists(s.junit_path):
            report = s.junit()
            passed = report["tests"] - report["failures"] - report["errors"] - report["skipped"]
            lines.append(f"  {', '.join(LANES[s.name])}: {passed} passed, {report['skipped']} skipped, "
                         f"{report['failures']} failed, {report['errors']} errors "
                         f"(of {len(_LANE_TESTS[s.name])} handed to the lane)")
            durations = s.stdout.split("slowest 15 durations", 1)
            for line in durations[1].splitlines()[1:] if len(durations) == 2 else []:
                if line.startswith("="):
                    break
                lines.append("  " + line)
            # its skips and failures with their reasons (-ra)
            lines += ["  " + ln for ln in s.stdout.splitlines()
                      if ln.split(" ", 1)[0] in ("SKIPPED", "XFAIL", "XPASS", "FAILED", "ERROR")]
    return lines


def is_background(item) -> bool:
    return item.get_closest_marker("background") is not None


def will_skip(item) -> bool:
    """Whether a ``skipif`` mark with a plain condition skips the item (its suite need not run)."""
    return any(bool(m.args[0]) for m in item.iter_markers("skipif")
               if m.args and not isinstance(m.args[0], str))


def name_of(item) -> str:
    return item.get_closest_marker("background").args[0]
