"""A subset of the parity cases through Spark Connect (SparkSession.builder.remote), in a
process of its own (connect_parity.py) started beside the main run (tests/background.py)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from tests import background

pytestmark = pytest.mark.connect

background.register("spark-connect", [sys.executable, os.path.join(os.path.dirname(__file__), "connect_parity.py")],
                    timeout=900)


@pytest.mark.background("spark-connect")
@pytest.mark.skipif(importlib.util.find_spec("grpc") is None,
                    reason="Spark Connect needs pyspark[connect] (grpcio)")
def test_parity_through_spark_connect(background_result):
    proc = background_result
    lines = [ln for ln in proc.stdout.splitlines() if ln.split(" ")[-1] == "OK" or " FAILED" in ln]
    assert proc.returncode == 0, proc.tail()
    # 12 parity cases, the query-broadcast case, the num_results error, the approx case, 9 column
    # cases (connect_parity.column_cases)
    assert len([ln for ln in lines if ln.endswith(" OK")]) == 24, proc.stdout
