"""One SparkSession for the whole test run (local[2], UI off, few shuffle partitions; Python
workers from udfs/daemon.py, as the jobs run them; rows given with a schema as JVM-local
relations: :func:`_rows_as_local_relation`), the subprocess suites that run beside the main run
(tests/background.py), and what the run's processes share: OpenMP threads that sleep when
idle, and numba's compiled kernels (tests/warm_kernels.py).

Kernel tests never touch the session: the fixture is created only when a test asks for ``spark``.
"""
from __future__ import annotations

import os
import sys
import warnings

import pytest

from tests import background, warm_kernels

# Spark's Python workers must run this interpreter (the one with numpy/numba/pyarrow).
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
# OpenMP runtimes (torch's and faiss's, which some tests load) spin their threads after every
# parallel region before they sleep; with several test processes on 2 cores the spinning
# threads take the cores from the ones with work. Read when the OpenMP runtime loads;
# inherited by Spark's workers and by the background suites (set before tests/background.py
# copies the environment).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _rows_as_local_relation() -> None:
    """``createDataFrame(rows, schema)`` in the tests' classic sessions: the rows, through Arrow,
    as a JVM-local relation (``LocalRelation``) rather than a Python RDD (``ExistingRDD``), whose
    every scan deserialises the rows in a Python worker (a daemon of its own): about 0.2 s per
    Spark job over tiny inputs, in each of the thousands of joins and oracle calls the tests run.
    The same rows, types, NULLs and partitions (one per core up to the rows). Anything else (no
    schema or a list of names, dict rows, ML vectors, rows Arrow refuses, a schema Spark cannot
    parse) takes Spark's own path, with Spark's own answer or error; so do tests that build
    their inputs otherwise (Parquet, ``spark.range``)."""
    import functools

    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.session import SparkSession
    from pyspark.sql.types import StructType, UserDefinedType, _parse_datatype_string

    create = SparkSession.createDataFrame

    def has_udt(struct) -> bool:
        return any(isinstance(f.dataType, UserDefinedType) or "udt" in f.dataType.simpleString() for f in struct.fields)

    @functools.wraps(create)
    def local(self, data, schema=None, *args, **kwargs):
        if isinstance(data, list) and isinstance(schema, (str, StructType)) and not args and not kwargs \
                and all(isinstance(row, tuple) for row in data):
            try:
                struct = schema if isinstance(schema, StructType) else _parse_datatype_string(schema)
                if isinstance(struct, StructType) and not has_udt(struct) \
                        and all(len(row) == len(struct.fields) for row in data):
                    arrow = to_arrow_schema(struct, timezone=self.conf.get("spark.sql.session.timeZone"))
                    columns = list(zip(*data)) if data else [()] * len(struct.fields)
                    table = pa.Table.from_arrays([pa.array(list(c), type=f.type) for c, f in zip(columns, arrow)],
                                                 schema=arrow)
                    return create(self, table)
            except Exception:   # noqa: BLE001 (Spark's own path below gives Spark's own answer or error)
                pass
        return create(self, data, schema, *args, **kwargs)

    SparkSession.createDataFrame = local


def _jvm_names_remembered() -> None:
    """py4j asks the JVM for every name a Python call looks up there (``jvm.PythonUtils`` in
    each ``select``, ``jvm.org.apache...``), and the JVM answers a name under one of its
    wildcard imports only after failed class lookups through every jar on Spark's class path:
    a large share of the JVM's time spent answering the suite's Python calls. A name that
    resolved to a class resolves the same for the JVM's life, and so does a full name below a
    package: remembered (a view's short name that found no class is asked again: an import
    added later may give it one). The client's objects are kept with the names, so a new
    gateway's never match."""
    from py4j import java_gateway

    for cls, place, kinds in (
            (java_gateway.JVMView, lambda view: view._id, (java_gateway.JavaClass,)),
            (java_gateway.JavaPackage, lambda package: (package._jvm_id, package._fqn),
             (java_gateway.JavaClass, java_gateway.JavaPackage))):
        lookup = cls.__getattr__
        known: dict = {}

        def remembered(self, name, lookup=lookup, known=known, place=place, kinds=kinds):
            entry = (id(self._gateway_client), place(self), name)
            found = known.get(entry)
            if found is None:
                found = lookup(self, name)
                if isinstance(found, kinds):
                    known[entry] = found
            return found

        cls.__getattr__ = remembered


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    _rows_as_local_relation()
    _jvm_names_remembered()
    session = (
        SparkSession.builder.master("local[2]")
        .appName("nearest_join-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        # A DataFrame made from Python rows gets this many partitions: one per core. Each
        # task of the thousands of tiny jobs costs more than its rows; tests that need empty
        # or skewed partitions make them.
        .config("spark.default.parallelism", "2")
        .config("spark.task.maxFailures", "1")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.session.timeZone", "UTC")
        # Spark's expressions interpreted, not compiled: the tests run thousands of queries of
        # a few rows, each of a new shape, and Janino's compilation of each cost more CPU than
        # the rows. The same results (Spark checks both modes against each other); the sessions
        # of local-cluster, Spark Connect (tests/cluster) and the CLI's own processes compile.
        .config("spark.sql.codegen.wholeStage", "false")
        .config("spark.sql.codegen.factoryMode", "NO_CODEGEN")
        # The tests' joins are small: under the default limit most would take the local plan
        # (searched in the driver) and leave the executors' plans, which every larger join
        # runs, untested. tests/join/test_local_plan.py runs it against them.
        .config("spark.nearestJoin.localLimitBytes", "0")
        # Every query's start event carries its plan's description for the SQL UI (off here, but
        # its listener still runs), by default in the "formatted" mode, which numbers and walks
        # every operator: a share of the JVM's CPU when the queries are thousands of tiny ones.
        # The one-line mode; no test reads it.
        .config("spark.sql.ui.explainMode", "simple")
        .config("spark.driver.extraJavaOptions", background.JVM_OPTIONS)
        .config(map=background.python_workers())
        .config("spark.executorEnv.PYTHONPATH", str(background.REPO))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def local_plan(spark):
    """The session with the local plan at its default limit, as a new user's (the suite's
    session turns it off, above), restored after the test."""
    key = "spark.nearestJoin.localLimitBytes"
    before = spark.conf.get(key, None)
    spark.conf.unset(key)
    yield spark
    if before is None:
        spark.conf.unset(key)
    else:
        spark.conf.set(key, before)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Compile the executor's kernels (tests/warm_kernels.py) when Spark will run, hand the
    tests of each selected lane to it, start the background suites of the selected tests
    (after -k / -m deselection: trylast) and run those tests last, in the order their suites
    run."""
    if config.option.collectonly:
        return
    waiting = [item for item in items if background.is_background(item)]
    if waiting or any("spark" in getattr(item, "fixturenames", ()) for item in items):
        # before any Spark worker or suite starts: they load the kernels numba compiled here
        try:
            warm_kernels.warm()
        except Exception as exc:  # noqa: BLE001 (the tests of what broke say more)
            warnings.warn(f"tests/warm_kernels.py failed: {exc!r}", stacklevel=1)
    if not waiting:
        return
    items[:] = background.take_lanes(items)
    background.start([background.name_of(item) for item in waiting
                      if background.registered(background.name_of(item)) and not background.will_skip(item)])
    waiting.sort(key=lambda item: background.rank(background.name_of(item)))
    items[:] = [item for item in items if not background.is_background(item)] + waiting


def pytest_sessionfinish(session, exitstatus):
    background.stop()


def pytest_terminal_summary(terminalreporter):
    lines = background.summary()
    if lines:
        terminalreporter.write_sep("-", "background suites (ran beside the main run)")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def background_result(request) -> background.Suite:
    """The finished suite named by the test's ``background`` marker."""
    return background.result(background.name_of(request.node))
