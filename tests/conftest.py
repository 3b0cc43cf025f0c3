"""One SparkSession for the whole test run (local[2], UI off, few shuffle partitions).

Kernel tests never touch it: the fixture is created only when a test asks for ``spark``.
"""
from __future__ import annotations

import os
import sys

import pytest

# Spark's Python workers must run this interpreter (the one with numpy/numba/pyarrow).
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("nearest_join-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "4")
        .config("spark.task.maxFailures", "1")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
