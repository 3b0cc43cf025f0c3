"""A pytest plugin for the device run (``pytest -m gpu -p tests.kernels._gpu_run_log``): one
JSON line per test outcome, written and flushed as it arrives, to the file named by the
option ``--gpu-run-log``. A run stopped at its time limit keeps every line written before
the stop (a junit report is written only at the end); the node ids collected but absent
from the log are the tests not reached.
"""
from __future__ import annotations

import json
import time


def pytest_addoption(parser):
    parser.addoption("--gpu-run-log", default=None, help="append one JSON line per test outcome here")
    parser.addoption("--gpu-run-only", default=None, help="run only the node ids listed in this file")


def pytest_configure(config):
    path = config.getoption("--gpu-run-log")
    if hasattr(config, "workerinput"):   # an xdist worker: the controller writes the log
        path = None
    config._gpu_run_log = open(path, "a", buffering=1) if path else None   # noqa: SIM115


def pytest_runtest_logreport(report):
    log = getattr(_config, "_gpu_run_log", None) if _config else None
    if log is None:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        log.write(json.dumps({"nodeid": report.nodeid, "outcome": report.outcome,
                              "when": report.when, "seconds": round(report.duration, 3),
                              "worker": getattr(getattr(report, "node", None), "gateway", None) and report.node.gateway.id,
                              "at": round(time.time(), 1),
                              "message": (str(report.longrepr)[-1500:] if report.failed else None)}) + "\n")


_config = None


def pytest_sessionstart(session):
    global _config
    _config = session.config


def pytest_unconfigure(config):
    log = getattr(config, "_gpu_run_log", None)
    if log is not None:
        log.close()


def pytest_collection_modifyitems(config, items):
    """``--gpu-run-only FILE``: keep only the node ids listed there (one a line): a rerun of the
    tests a stopped run did not reach, or of those that failed."""
    path = config.getoption("--gpu-run-only")
    if not path:
        return
    wanted = {line.strip() for line in open(path) if line.strip()}
    keep = [item for item in items if item.nodeid in wanted]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
    items[:] = keep
