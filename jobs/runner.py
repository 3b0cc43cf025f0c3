"""Run a job spec: read -> plan -> search+write -> commit, with a summary.

The runner holds no join logic: it reads the inputs the spec names, asks
:func:`nearest_join.explain_nearest_join` for the plan and :func:`nearest_join.nearest_by_join`
for the result, and hands the result to :class:`jobs.output.StagedOutput`. Every phase is
logged with its row counts and time. Problems with the spec or the inputs become
:class:`~jobs.spec.SpecError` (exit status 2) before anything is written. A run takes the
output's lock before it reads any input, so a busy or unwritable output fails in seconds.

Search, merge and write run in one Spark job (the merge is the shuffle stage after the
partial top-k of each block, the write the last stage's output), so they are timed together
as ``search+write``. The rows written and the queries that found a match are counted as the
rows pass (an observation over the join's first-match marker), not by a second pass over a
persisted result.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fnmatch
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

from .inputs import check_parquet_input
from .output import StagedOutput, data_files
from .tables import OutputTable, TableWrite, ordered_result, read_table, require_catalog, resolve_output
from .spec import STATE_DIR, SUMMARY_FILE, JobSpec, SpecError, check_paths, is_local, local_path, option_key, redact_settings

logger = logging.getLogger(__name__)

# Internal bookkeeping column: 1 on each query row's best match (PlannedJoin.dataframe's
# first_match_column), so that queries left without a candidate are counted for inner joins
# too. Dropped before writing.
FIRST_MATCH = "_nearest_join_first_match"

# Spark's error conditions for an input file it cannot read: not Parquet, or a column whose
# type differs from the schema Spark took from another file. Local inputs are checked before
# Spark reads them (jobs.inputs); these catch the others (s3a://, hdfs://).
_UNREADABLE_INPUT = ("FAILED_READ_FILE", "CANNOT_READ_FILE_FOOTER")
# errno values of an output location that cannot be written, whatever a re-run does.
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR)


# -- Spark session ------------------------------------------------------------------------------


@contextlib.contextmanager
def spark_session(settings: dict[str, str], *, app_name: str, use_master: bool = True,
                  show_progress: bool = True) -> Iterator[Any]:
    """The active SparkSession with ``settings`` applied, or a new one built from them.

    With a session already running (tests, notebooks, an orchestrator), the settings Spark lets
    a running session change are applied for the duration of the block and then restored; the
    others are logged as ignored. Otherwise a session is built (``master`` only when
    ``use_master``: under ``spark-submit`` its ``--master`` wins) and stopped afterwards.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        restore: dict[str, str | None] = {}
        for name, value in settings.items():
            if name != "master" and active.conf.isModifiable(name):
                restore[name] = active.conf.get(name, None)
                active.conf.set(name, value)
            else:
                logger.info("Spark setting %s not applied: the session is already running", name)
        try:
            yield active
        finally:
            for name, value in restore.items():
                if value is None:
                    active.conf.unset(name)
                else:
                    active.conf.set(name, value)
        return

    builder = SparkSession.builder.appName(app_name)
    master = settings.get("master")
    if master and use_master:
        builder = builder.master(master)
        if master.startswith("local"):
            # Local-mode Python workers must use this interpreter (numpy, pyarrow, the
            # library), not whatever `python3` is first on PATH under cron.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            # The driver JVM is the whole cluster here: it starts from Spark's class archive
            # where one was recorded (jobs.jvm).
            from .jvm import with_archive

            options = with_archive(settings.get("spark.driver.extraJavaOptions"))
            if options:
                settings = {**settings, "spark.driver.extraJavaOptions": options}
    elif master:
        logger.info("spark.master from the spec not applied: spark-submit's --master wins")
    for name, value in settings.items():
        if name != "master":
            builder = builder.config(name, value)
    if show_progress and "spark.ui.showConsoleProgress" not in settings:
        builder = builder.config("spark.ui.showConsoleProgress", "true")
    applied = {k: v for k, v in settings.items() if k != "master" or use_master}
    logger.info("starting Spark with %s", redact_settings(applied))
    session = builder.getOrCreate()
    try:
        yield session
    finally:
        session.stop()


def start_kernel_warm_up(spec: JobSpec, submitted: bool) -> None:
    """Before Spark's session starts: under a local master (the spec's; ``spark-submit``'s is
    not known yet) the executors' workers share this machine, and the kernels they will run
    compile on a thread of this process while the session starts and the inputs are read
    (:func:`nearest_join.join.warm_up_kernels`). The vectors' element types come from each
    side's first local Parquet file; anything else (a URI, an unreadable file) skips it, and
    the read phase reports what is wrong."""
    master = spec.spark_settings.get("master", "")
    if submitted or not master.startswith("local"):
        return
    dtypes = tuple(_vector_dtype(side) for side in (spec.query, spec.target))
    if None in dtypes:
        return
    from nearest_join.join import warm_up_kernels

    warm_up_kernels(spec.join.metric, dtypes, spec.join.options)


def _vector_dtype(side) -> str | None:
    """"float32" or "float64": what the executors decode ``side``'s vectors to, from the
    schema of its first local Parquet file (None when there is none or it says nothing)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .inputs import parquet_files

    if side.table is not None or side.format != "parquet":
        return None   # known once Spark reads it
    path = side.paths[0]
    if not is_local(path):
        return None
    try:
        files = parquet_files(path)
        field = pq.read_schema(files[0]).field(side.vector) if files else None
    except (OSError, KeyError, ValueError, pa.ArrowException):
        return None
    if field is None:
        return None
    return "float32" if getattr(field.type, "value_type", None) == pa.float32() else "float64"


# -- phases ---------------------------------------------------------------------------------


class _Phases:
    """Times named phases and logs each one's outcome."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[dict[str, Any]]:
        logger.info("%s: started", name)
        facts: dict[str, Any] = {}
        start = time.perf_counter()
        yield facts
        self.seconds[name] = round(time.perf_counter() - start, 3)
        details = ", ".join(f"{k} {_fmt(v)}" for k, v in facts.items())
        logger.info("%s: done in %.2f s%s", name, self.seconds[name], f" ({details})" if details else "")


def _fmt(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


@dataclass
class Prepared:
    """The inputs as the library will see them, and the join it planned (one facts job)."""

    query: Any          # pyspark DataFrame, renamed
    target: Any
    query_vector: str   # output names of the vector columns
    target_vector: str
    planned: Any        # nearest_join.join.PlannedJoin: the plan and how to run it

    @property
    def plan(self) -> Any:
        """The library's JoinPlan."""
        return self.planned.plan

    @property
    def query_rows(self) -> int:
        return self.plan.query_rows

    @property
    def target_rows(self) -> int:
        return self.plan.target_rows


def _first_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _spark_condition(exc: BaseException) -> tuple[str | None, dict[str, str], list[str]]:
    """Spark's error condition, message parameters and messages (outermost first) of ``exc``."""
    from py4j.protocol import Py4JError, Py4JJavaError

    if isinstance(exc, Py4JJavaError):  # a Java exception pyspark did not convert
        # From the first SparkThrowable with a condition: a collect to Python wraps the job's
        # failure in an exception of its own (SocketAuthServer's "Exception thrown in awaitResult").
        chain, cause = [], exc.java_exception
        while cause is not None:
            chain.append(cause)
            cause = cause.getCause()
        for i, java in enumerate(chain):
            try:
                condition = java.getCondition()
            except Py4JError:  # not a SparkThrowable
                continue
            if condition:
                return condition, dict(java.getMessageParameters()), _messages(chain[i:])
        return None, {}, _messages(chain)
    if callable(getattr(exc, "getCondition", None)):  # pyspark.errors.PySparkException
        return exc.getCondition(), dict(exc.getMessageParameters() or {}), [str(exc)]
    return None, {}, []


def _messages(chain: list) -> list[str]:
    """The messages of the first two Java exceptions of ``chain`` (their class where none)."""
    return [str(java.getMessage() or java.getClass().getName()) for java in chain[:2]]


def _holds(side, path: str) -> bool:
    """Whether the input ``side`` names the file ``path`` (a path or URI from Spark)."""
    path = local_path(path) if is_local(path) else path
    return any(path == p or path.startswith(p.rstrip("/") + "/") or fnmatch.fnmatch(path, p)
               for p in side.paths)


def _unreadable_input(exc: BaseException, spec: JobSpec) -> SpecError | None:
    """The SpecError for a Spark failure to read an input file or an input the kernels refuse
    (a float64 element too small for them, found where an executor decodes it), or None for
    other failures."""
    refused = re.search(r"\[VECTOR_ELEMENT_OUT_OF_RANGE\][^\n]*", str(exc))
    if refused:
        return SpecError(option_key("vectors"), refused.group(0))
    condition, parameters, messages = _spark_condition(exc)
    if not condition or not condition.startswith(_UNREADABLE_INPUT):
        return None
    path = parameters.get("path", "")
    sides = [s for s in (spec.query, spec.target) if _holds(s, path)] or [spec.query, spec.target]
    reasons = "; ".join(_first_line(m) for m in messages)
    return SpecError("/".join(f"{s.side}.path" for s in sides),
                     f"Spark cannot read {path or 'an input file'}: {reasons}")


@contextlib.contextmanager
def _input_errors(spec: JobSpec) -> Iterator[None]:
    """Turn Spark's failures to read an input file into a SpecError naming the side and file."""
    try:
        yield
    except SpecError:
        raise
    except Exception as exc:
        error = _unreadable_input(exc, spec)
        if error is None:
            raise
        raise error from None


def _read_side(spark, side, schema=None) -> Any:
    """Read one input (a table by name, or its paths in their format: Parquet with ``schema``,
    its footers' when they settle it: no Spark job to read one), filter, select and prefix its
    columns; errors name the spec key."""
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    from nearest_join.ranking import quote

    if side.table is not None:
        df = read_table(spark, side)
    else:
        try:
            reader = spark.read if schema is None else spark.read.schema(schema)
            df = (reader.parquet(*side.paths) if side.format == "parquet"
                  else reader.format(side.format).load(list(side.paths)))
        except AnalysisException as exc:
            raise SpecError(f"{side.side}.path",
                            f"cannot read {side.format.upper()}: {_first_line(exc)}") from None
    if side.vector not in df.columns:
        raise SpecError(
            f"{side.side}.vector",
            f"column {side.vector!r} not found in {side.source}; columns: {df.columns}",
        )
    _check_vector_type(df, side)
    if side.where:
        try:
            df = df.where(side.where)
        except AnalysisException as exc:
            raise SpecError(f"{side.side}.where", _first_line(exc)) from None
    if side.columns is not None:
        missing = [c for c in side.columns if c not in df.columns]
        if missing:
            raise SpecError(
                f"{side.side}.columns",
                f"column(s) {missing} not found in {side.source}; columns: {df.columns}",
            )
        keep = list(side.columns) + ([side.vector] if side.vector not in side.columns else [])
        df = df.select(*[F.col(quote(c)) for c in keep])
    if side.prefix:
        df = df.select(*[F.col(quote(c)).alias(side.prefix + c) for c in df.columns])
    return df


def _check_vector_type(df, side) -> None:
    """The library's own check of the vector column's type, naming the spec key."""
    from nearest_join.errors import VectorTypeError
    from nearest_join.ranking import vector_itemsize

    try:
        vector_itemsize(df, side.vector, side.side)
    except VectorTypeError as exc:
        raise SpecError(f"{side.side}.vector", str(exc)) from None


def _check_output_columns(spec: JobSpec, query, target) -> None:
    seen: dict[str, str] = {}
    distance_col = spec.join.options.distance_col
    extra = [(distance_col, "join.distance_col")] if distance_col else []
    names = [(c, "query.columns") for c in query.columns] + [
        (c, "target.columns") for c in target.columns
    ] + extra + [(c, "output.partition_values") for c, _ in spec.output.partition_values]
    for name, key in names:
        if name in seen:
            raise SpecError(
                key,
                f"output column {name!r} is also produced by {seen[name]}; give one side a "
                "prefix (e.g. target.prefix: target_) or select fewer columns",
            )
        seen[name] = key
    for name in spec.output.partition_by:
        if name not in seen:
            raise SpecError(
                "output.partition_by",
                f"column {name!r} is not in the output; output columns: {list(seen)}",
            )


def _check_key_columns(spec: JobSpec, query, target) -> None:
    """``join.on`` names the inputs' columns (before prefix) kept by each side's ``columns``:
    checked with the other column checks, before the planner's first Spark job, and named
    among the user's own columns (the runner's internal ones are not the user's to pick)."""
    for q_name, t_name in spec.join.options.on or ():
        for side, name, df in ((spec.query, q_name, query), (spec.target, t_name, target)):
            if side.prefix + name in df.columns:
                continue
            kept = [c[len(side.prefix):] for c in df.columns]
            where = f"{side.side}.columns" if side.columns is not None else side.source
            raise SpecError("join.on", f"column {name!r} not found in the {side.side} input ({where}); "
                                       f"its columns: {kept}")


def _library_error(exc: BaseException) -> SpecError | None:
    """The SpecError for an error the library raised about its arguments or the inputs'
    vectors (the spec key comes from the error's ``argument``, never from its text)."""
    from nearest_join.errors import ArgumentError, ArgumentTypeError, NearestByJoinError, VectorTypeError

    if isinstance(exc, VectorTypeError):
        return SpecError(f"{exc.side}.vector", str(exc))
    if isinstance(exc, (ArgumentError, ArgumentTypeError)):
        return SpecError(option_key(exc.argument), exc.problem)
    if isinstance(exc, NearestByJoinError):
        return SpecError(option_key(exc.argument), str(exc))
    return None


def read_inputs(spec: JobSpec, spark, phases: _Phases) -> tuple[Any, Any]:
    """Validate paths, read both inputs and check their columns (the ``read`` phase)."""
    check_paths(spec)
    if spec.uses_tables:
        require_catalog(spark)
    with phases("read"), _input_errors(spec):
        # Every file's footer, before Spark takes a schema from one file of either side.
        query_schema = check_parquet_input(spec.query) if spec.query.format == "parquet" else None
        # a self-join reads one input twice
        target_schema = (None if spec.target.format != "parquet" else check_parquet_input(spec.target)
                         if spec.target.paths != spec.query.paths else query_schema)
        query = _read_side(spark, spec.query, query_schema)
        target = _read_side(spark, spec.target, target_schema)
        if FIRST_MATCH in query.columns or FIRST_MATCH in target.columns:
            raise SpecError("query.columns", f"column name {FIRST_MATCH!r} is reserved")
        _check_output_columns(spec, query, target)
        _check_key_columns(spec, query, target)
    return query, target


def _prefixed_keys(spec: JobSpec):
    """``join.on`` as the join sees it: the spec names the inputs' columns, the join their
    prefixed names."""
    on = spec.join.options.on
    if on is None:
        return None
    return tuple((spec.query.prefix + q_name, spec.target.prefix + t_name) for q_name, t_name in on)


def prepare(spec: JobSpec, spark, phases: _Phases | None = None) -> Prepared:
    """Validate paths, read both inputs, check columns, and plan (the inputs' one facts job,
    which the explanation, the summary and the run share). Writes nothing."""
    import dataclasses

    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    from nearest_join.join import plan_join

    phases = phases or _Phases()
    query, target = read_inputs(spec, spark, phases)
    query_vector = spec.query.prefix + spec.query.vector
    target_vector = spec.target.prefix + spec.target.vector
    options = dataclasses.replace(spec.join.options, vectors=(query_vector, target_vector), on=_prefixed_keys(spec))
    with phases("plan") as facts, _input_errors(spec):
        try:
            if spec.join.index is not None:   # join.index: a saved IVF index, or train and save one
                from nearest_join.ivf_index import load_or_build

                index = load_or_build(spec.join.index.path, rebuild=spec.join.index.rebuild, target=target,
                                      column=target_vector, metric=spec.join.metric, nlist=options.nlist,
                                      seed=options.seed)
                options = dataclasses.replace(options, index=index, nlist=None)
            planned = plan_join(query, target, spec.join.metric, options)
        except (TypeError, ValueError, AnalysisException) as exc:
            error = _library_error(exc)
            if error is None and isinstance(exc, AnalysisException):
                error = SpecError("join", _first_line(exc))
            if error is None:
                raise
            raise error from None
        plan = planned.plan
        facts["query rows"], facts["target rows"] = plan.query_rows, plan.target_rows
        facts["plan"], facts["backend"] = plan.plan, plan.backend
    return Prepared(query, target, query_vector, target_vector, planned)


def write_parquet(df, path: str, partition_by: tuple[str, ...], num_files: int | None) -> None:
    """Write ``df`` as Parquet into the (new) directory ``path``."""
    if num_files:
        df = df.repartition(num_files, *partition_by) if partition_by else df.repartition(num_files)
    writer = df.write.mode("errorifexists")
    if partition_by:
        writer = writer.partitionBy(*partition_by)
    writer.parquet(path)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def run_job(spec: JobSpec, spark) -> dict[str, Any]:
    """Run ``spec`` on ``spark`` and publish its output atomically; return the run summary.

    Raises
    ------
    SpecError
        Bad spec or input, or an output location that cannot be written (before anything
        is written), or a ragged vector or unreadable input file found while searching
        (nothing is published).
    jobs.output.OutputBusyError
        Another run is writing the same output path or table (found before any input is read).
    """
    started_at, start = _now(), time.perf_counter()
    phases = _Phases()
    with contextlib.ExitStack() as stack:
        # The lock before the inputs: a run whose output is busy or cannot be written fails
        # in seconds, not after the search. prepare() re-checks the output under the lock.
        if spec.output.table is not None:
            return _run_into_table(spec, spark, stack, phases, started_at, start)
        staged = _lock_output(spec, stack)
        if spec.incremental is not None:
            summary, run = _run_incremental(spec, spark, staged, phases, started_at, start)
            try:
                with phases("commit"):
                    staged.publish(summary)
                    if spec.incremental.state is not None:
                        # After the output: a run killed between the two leaves the last
                        # state, from which the next run refreshes today's inputs as exactly.
                        run.commit()
            finally:
                run.discard()   # nothing once committed
            return summary
        summary = _search_and_write(spec, spark, staged.staging, phases, started_at, start)
        with phases("commit"):
            if spec.output.mode == "overwrite_partitions":
                staged.publish_partitions(summary, spec.output.partition_by, dict(spec.output.partition_values))
            else:
                staged.publish(summary)
    return summary


def _run_into_table(spec: JobSpec, spark, stack: contextlib.ExitStack, phases: _Phases, started_at: str,
                    start: float) -> dict[str, Any]:
    """A run whose output is a catalog table (:mod:`jobs.tables`): the table checked and
    locked before the inputs are read, the result checked against its columns before the
    write, then the write into the staging directory and the switch of its partitions."""
    table = resolve_output(spark, spec)
    writer = TableWrite(spark, table, spec)
    try:
        stack.enter_context(writer)
    except OSError as exc:
        if exc.errno not in _UNWRITABLE:
            raise
        raise SpecError("output.table", f"cannot write beside {str(table.root)!r} ({spec.output.table}'s "
                                        f"location): {exc.strerror}") from None
    checked: dict[str, Any] = {}

    def check(result):
        result, checked["new_columns"] = ordered_result(result, table, spec)
        checked["schema"] = result.schema
        return result

    summary = _search_and_write(spec, spark, writer.staging, phases, started_at, start, check=check)
    summary["output"].update(location=str(writer.run_dir), table_created=not table.exists)
    with phases("commit"):
        writer.commit(summary, checked["new_columns"], checked["schema"])
    return summary


def _with_partition_values(result, spec: JobSpec):
    """``output.partition_values``: a constant string column each, on every output row."""
    from pyspark.sql import functions as F

    for name, value in spec.output.partition_values:
        result = result.withColumn(name, F.lit(value))
    return result


def _kept_columns(df, vector: str, keep_vectors: bool) -> list[int]:
    """The positions of the output's columns of one side: all, or all but its vector column."""
    return [i for i, name in enumerate(df.columns) if keep_vectors or name != vector]


def _search_and_write(spec: JobSpec, spark, staging, phases: _Phases, started_at: str, start: float,
                      check=None) -> dict[str, Any]:
    """Read, plan, then search and write the result into ``staging`` in one Spark job; returns
    the run's summary. ``check`` may check and reorder the result before it is written."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    from nearest_join.planner import describe_precision

    prepared = prepare(spec, spark, phases)
    counted = Observation("nearest_join_rows")
    planned = prepared.planned
    # Without output.include_vectors the executors emit no vector (not dropped after).
    keep = spec.output.include_vectors
    joined = planned.dataframe(
        first_match_column=FIRST_MATCH,
        query_columns=_kept_columns(planned.query, prepared.query_vector, keep),
        target_columns=_kept_columns(planned.target, prepared.target_vector, keep),
    ).observe(counted, F.count(F.lit(1)).alias("rows"), F.sum(FIRST_MATCH).alias("matched"))
    result = _with_partition_values(joined.drop(FIRST_MATCH), spec)
    if check is not None:
        result = check(result)
    with phases("search+write") as facts:
        try:
            write_parquet(result, str(staging), spec.output.partition_by, spec.output.num_files)
        except Exception as exc:  # a ragged row surfaces as a failed Spark job
            # An executor's error reaches the driver as the text of a failed job.
            if "VECTOR_DIMENSION_MISMATCH" in str(exc):
                raise SpecError(
                    option_key("vectors"),
                    "a row's vector has another dimension than the rest "
                    "(VECTOR_DIMENSION_MISMATCH); fix the input or filter it, e.g. "
                    "query.where: size(vec) = 64",
                ) from exc
            unreadable = _unreadable_input(exc, spec)
            if unreadable is not None:
                raise unreadable from None
            raise
        counts = counted.get
        facts["output rows"] = output_rows = int(counts["rows"])
        facts["queries without candidates"] = unmatched = \
            prepared.query_rows - int(counts["matched"] or 0)
        facts["files"] = files = len(data_files(staging))
    search_s = phases.seconds["search+write"]
    pairs = prepared.query_rows * prepared.target_rows
    plan = prepared.plan.to_dict()
    return _summary(
        spec, phases, started_at, start, input_rows=(prepared.query_rows, prepared.target_rows),
        output_rows=output_rows, files=files, queries_without_candidates=unmatched, plan=plan,
        backend=plan.get("backend"),
        # What the plan asked for; "auto" is resolved by each executor for its device
        # (the driver is not told which one ran: see describe_precision's words).
        precision=plan.get("precision"),
        precision_runs=describe_precision(plan.get("backend"), plan.get("precision")),
        pairs=pairs, pairs_per_s=round(pairs / search_s, 1) if search_s > 0 else None,
        # Inside search+write: the executors' seconds per phase, summed over tasks and threads.
        executor_s=planned.executor_seconds())


def _run_incremental(spec: JobSpec, spark, staged: StagedOutput, phases: _Phases, started_at: str,
                     start: float) -> tuple[dict[str, Any], Any]:
    """``incremental``: refresh the output from the state inside the last published output
    (:mod:`nearest_join.incremental`; a full run when there is none or it answers another
    join), then write the result, and the new state inside the staging directory, which
    ``staged`` publishes in one step. With ``incremental.state``, the state is read from there
    and staged beside it: the caller commits it (the returned run) after publishing the
    output. Returns the run summary and the run."""
    import shutil
    from pathlib import Path

    from nearest_join.incremental import incremental_nearest_join, remove_staged_states

    query, target = read_inputs(spec, spark, phases)
    options = spec.join.options
    q_vector, t_vector = spec.query.prefix + spec.query.vector, spec.target.prefix + spec.target.vector
    state = Path(spec.incremental.state_path(spec.output))
    own_state = spec.incremental.state is not None
    # Beside the staging directory, under its name: a killed run's is removed with it.
    new_state = None if own_state else staged.staging.parent / f"{staged.staging.name}-state"
    if own_state:   # what killed runs staged beside it (under the output's lock: no other run)
        remove_staged_states(state)
    run = None
    try:
        with phases("search") as facts, _input_errors(spec), _incremental_errors():
            run = incremental_nearest_join(query, target, spec.join.metric, options.num_results, state=state,
                                           new_state=new_state, **_incremental_arguments(spec))
            changes = run.changes
            facts["refresh"] = changes.refreshed
            facts["queries searched whole"] = changes.queries_searched_whole
        # Without output.include_vectors no vector is kept: a side left with its id alone is
        # not joined (IncrementalJoin.dataframe).
        keep = spec.output.include_vectors
        result = _with_partition_values(run.dataframe(query_columns=_kept_columns(query, q_vector, keep),
                                                      target_columns=_kept_columns(target, t_vector, keep)), spec)
        with phases("write") as facts:
            write_parquet(result, str(staged.staging), spec.output.partition_by, spec.output.num_files)
            files = len(data_files(staged.staging))
            # From the files' footers: an Observation is dropped from a plan Spark finds empty.
            output_rows = spark.read.parquet(str(staged.staging)).count() if files else 0
            facts["output rows"] = output_rows
        if not own_state:
            os.rename(new_state, staged.staging / STATE_DIR)
    except BaseException:
        if run is not None:
            run.discard()
        raise
    finally:
        if not own_state:
            shutil.rmtree(new_state, ignore_errors=True)
    plan = {"plan": "incremental refresh" if changes.refreshed else "incremental, full run",
            "metric": spec.join.metric, "k": options.num_results, "mode": "exact", "join_type": options.join_type}
    return _summary(spec, phases, started_at, start, input_rows=(changes.query_rows, changes.target_rows),
                    output_rows=output_rows, files=files, queries_without_candidates=None, plan=plan,
                    backend=options.backend, precision=options.precision,
                    incremental={"state": str(state), **changes.as_dict()}, pairs=None, pairs_per_s=None), run


def _summary(spec: JobSpec, phases: _Phases, started_at: str, start: float, *, input_rows: tuple[int, int],
             output_rows: int, files: int, **fields) -> dict[str, Any]:
    """A run's summary: the fields every run has, with ``fields`` (the run's own: plan,
    backend, precision, ...) after its counts."""
    import nearest_join
    from nearest_join.join import kernel_warm_up_seconds

    warm_up = kernel_warm_up_seconds()
    return {
        "job": spec.name,
        "spec_file": spec.source,
        "nearest_join_version": nearest_join.__version__,
        "status": "succeeded",
        "started_at": started_at,
        "finished_at": _now(),
        "input_rows": {"query": input_rows[0], "target": input_rows[1]},
        "output_rows": output_rows,
        **fields,
        "wall_time_s": round(time.perf_counter() - start, 3),
        "phases_s": dict(phases.seconds),
        # This process's kernel warm-up (a local master's executors share its machine):
        # compiling, or loading cached, kernels beside the other phases.
        "kernel_warm_up_s": round(warm_up[0], 3),
        "kernel_compile_s": round(warm_up[1], 3),   # the rest: loading numba's cache
        "output": {**({"table": spec.output.table} if spec.output.table else {"path": spec.output.path}),
                   "files": files, "partition_by": list(spec.output.partition_by), "mode": spec.output.mode},
        "inputs": {side.side: [f"table {side.table}"] if side.table else list(side.paths)
                   for side in (spec.query, spec.target)},
        "parameters": dict(spec.parameters or {}),
        "spark_settings": redact_settings(spec.spark_settings),
        "spec": spec.redacted_document(),
    }


def _lock_output(spec: JobSpec, stack: contextlib.ExitStack) -> StagedOutput:
    """Take the output's lock for the rest of ``stack``; an unwritable location is a SpecError."""
    staged = StagedOutput(spec.output.path, replace=spec.output.mode in ("overwrite", "overwrite_partitions"))
    try:
        stack.enter_context(staged)
    except OSError as exc:
        if exc.errno not in _UNWRITABLE:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        raise SpecError(
            "output.path",
            f"cannot write {spec.output.path!r}: {exc.strerror}{where}; choose another "
            "output.path or make it writable",
        ) from None
    return staged


def explain_job(spec: JobSpec, spark) -> tuple[Prepared, OutputTable | None]:
    """Everything a run does before searching: the plan, and the output table as the catalog
    has it (None for a path output), without running the join."""
    table = resolve_output(spark, spec) if spec.output.table is not None else None
    return prepare(spec, spark), table


def _incremental_arguments(spec: JobSpec) -> dict[str, Any]:
    """The incremental join's keyword arguments of an ``incremental`` spec, but its state."""
    options, incremental = spec.join.options, spec.incremental
    return dict(query_id=spec.query.prefix + incremental.query_id,
                target_id=spec.target.prefix + incremental.target_id, margin=incremental.margin,
                vectors=(spec.query.prefix + spec.query.vector, spec.target.prefix + spec.target.vector),
                join_type=options.join_type, distance_col=options.distance_col, backend=options.backend,
                precision=options.precision, max_distance=options.max_distance,
                min_similarity=options.min_similarity, on=_prefixed_keys(spec), mode=options.mode,
                recall=options.recall, nlist=options.nlist, nprobe=options.nprobe, seed=options.seed)


@contextlib.contextmanager
def _incremental_errors():
    """The incremental join's argument errors as the spec keys that gave the arguments."""
    from nearest_join.errors import ArgumentError, ArgumentTypeError

    keys = {"query_id": "incremental.query_id", "target_id": "incremental.target_id",
            "margin": "incremental.margin"}
    try:
        yield
    except (ArgumentError, ArgumentTypeError) as exc:
        raise SpecError(keys.get(exc.argument) or option_key(exc.argument), exc.problem) from None


def explain_refresh(spec: JobSpec, spark):
    """What a run of an ``incremental`` spec would do (``nearest_join.incremental.RefreshPlan``):
    a refresh or a full run, the rows changed on each side, the searches' pairs. Reads the
    inputs and the state; writes nothing."""
    from nearest_join.incremental import explain_incremental

    query, target = read_inputs(spec, spark, _Phases())
    with _input_errors(spec), _incremental_errors():
        return explain_incremental(query, target, spec.join.metric, spec.join.options.num_results,
                                   state=spec.incremental.state_path(spec.output), **_incremental_arguments(spec))


def _warm_up_text(seconds: float, compiling: float) -> str:
    if not seconds:
        return "compiled by the executors (no local warm-up)"
    return (f"{seconds:.2f} s on this process's warm-up thread, beside the phases: compiling "
            f"{compiling:.2f} s, loading numba's cache {seconds - compiling:.2f} s")


def _output_text(output: dict[str, Any]) -> str:
    if "table" not in output:
        return output["path"]
    changed = ", ".join(("replaced " if p["replaced"] else "added ") + "/".join(f"{k}={v}" for k, v in p["partition"].items())
                        for p in output.get("partitions", []))
    return f"table {output['table']}" + (f" ({changed})" if changed else "")


def format_summary(summary: dict[str, Any]) -> str:
    """The one-screen summary the CLI prints at the end of a run."""
    rows = summary["input_rows"]
    plan = summary["plan"]
    phases = " | ".join(f"{k} {v:.2f} s" for k, v in summary["phases_s"].items())
    rate = summary["pairs_per_s"]
    rate_text = f"{rate / 1e6:,.1f} M pairs/s" if rate is not None else "n/a"
    lines = [
        f"nearest-join: job {summary['job']!r} {summary['status']} in {summary['wall_time_s']:.1f} s",
        f"  query        {rows['query']:,} rows  <- {', '.join(summary['inputs']['query'])}",
        f"  target       {rows['target']:,} rows  <- {', '.join(summary['inputs']['target'])}",
        f"  plan         {plan.get('plan')} | backend {summary['backend']} | precision "
        f"{summary['precision']} | metric "
        f"{plan.get('metric')} | k {plan.get('k')} | mode {plan.get('mode')} | "
        f"join {plan.get('join_type')}",
        f"  output       {summary['output_rows']:,} rows in {summary['output']['files']} files"
        f"  -> {_output_text(summary['output'])}",
    ]
    if summary.get("parameters"):
        lines.append("  parameters   " + ", ".join(f"{k}={v}" for k, v in sorted(summary["parameters"].items())))
    incremental = summary.get("incremental")
    if incremental is not None:
        what = ("refreshed" if incremental["refreshed"] else f"full run ({incremental['reason']})")
        lines.append(
            f"  incremental  {what}: queries +{incremental['queries_inserted']:,} "
            f"-{incremental['queries_deleted']:,} ~{incremental['queries_changed']:,}, targets "
            f"+{incremental['targets_inserted']:,} -{incremental['targets_deleted']:,} "
            f"~{incremental['targets_changed']:,}; {incremental['queries_searched_whole']:,} queries "
            f"searched whole, {incremental['queries_merged']:,} lists merged"
            + (", searched in the driver" if incremental.get("searched_here") else ""))
        recall = incremental.get("recall")
        if recall is not None:
            measured = ("not estimated (nprobe given)" if recall["recall_estimate"] is None else
                        f"{recall['recall_estimate']:.4f} (lower bound {recall['recall_lower']:.4f}: "
                        f"{recall['recall_of']})")
            lines.append(f"  recall       {measured}, nprobe {recall['nprobe']} of nlist {recall['nlist']}")
    else:
        lines += [
            f"  no candidate {summary['queries_without_candidates']:,} query rows",
            f"  throughput   {summary['pairs']:,} pairs scored, {rate_text} (search+write)",
        ]
    lines.append(f"  phases       {phases}")
    if summary.get("executor_s"):
        local = summary.get("plan", {}).get("plan") == "local"   # the executors' functions, in the driver
        lines.append(("  driver       " if local else "  executors    ")
                     + " | ".join(f"{k} {v:.2f} s" for k, v in summary["executor_s"].items())
                     + (" (the local plan's search, summed over threads)" if local
                        else " (summed over tasks and threads)"))
    lines += [
        f"  kernels      {_warm_up_text(summary.get('kernel_warm_up_s', 0.0), summary.get('kernel_compile_s', 0.0))}",
        f"  summary      {os.path.join(summary['output'].get('location') or summary['output']['path'], SUMMARY_FILE)}",
    ]
    return "\n".join(lines)
