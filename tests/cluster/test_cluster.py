"""Distributed and fault tests on Spark's local-cluster master (two executor JVMs), in a
process of their own (cluster_join.py) started beside the main run (tests/background.py)."""
from __future__ import annotations

import os
import sys

import pytest

from tests import background

pytestmark = pytest.mark.cluster

background.register("local-cluster", [sys.executable, os.path.join(os.path.dirname(__file__), "cluster_join.py")],
                    timeout=1200)


@pytest.mark.background("local-cluster")
def test_join_on_two_executors_and_after_losing_one(background_result):
    proc = background_result
    assert proc.returncode == 0, proc.tail()
    for check in ("two-executors", "broadcast-plan", "local-plan", "blocked-plan", "blocked-plan-queries-broadcast",
                  "executor-killed-mid-join"):
        assert f"{check} OK" in proc.stdout, proc.stdout
