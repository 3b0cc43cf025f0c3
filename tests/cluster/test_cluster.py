"""Distributed and fault tests on Spark's local-cluster master (two executor JVMs)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster


def test_join_on_two_executors_and_after_losing_one():
    script = os.path.join(os.path.dirname(__file__), "cluster_join.py")
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    for check in ("two-executors", "broadcast-plan", "blocked-plan", "executor-killed-mid-join"):
        assert f"{check} OK" in proc.stdout, proc.stdout
