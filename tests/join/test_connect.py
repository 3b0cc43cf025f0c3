"""A subset of the parity cases through Spark Connect (SparkSession.builder.remote)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.connect


def test_parity_through_spark_connect():
    pytest.importorskip("grpc", reason="Spark Connect needs pyspark[connect] (grpcio)")
    script = os.path.join(os.path.dirname(__file__), "connect_parity.py")
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.split(" ")[-1] == "OK" or " FAILED" in ln]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len([ln for ln in lines if ln.endswith(" OK")]) == 13, proc.stdout
