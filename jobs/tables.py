"""Catalog tables: inputs read by name, and a partitioned output table that each run replaces
partition by partition, with the same promises as a path output.

A table output's files live under the table's location, one directory per run::

    <table location>/nj-run-<run id>/<col>=<value>/part-*.parquet   (one per partition written)
    <table location>/nj-run-<run id>/_nearest_join_summary.json

A run writes its partitions into a hidden staging directory beside the table's location
(``.NAME.nj-staging-<run id>``, the path output's staging name, under the same lock), moves it
to ``nj-run-<run id>`` under the table's location when it is complete, and only then points the
catalog at it: one ``ALTER TABLE ... ADD PARTITION ... LOCATION`` for the partitions the table
does not have yet, and one ``ALTER TABLE ... PARTITION ... SET LOCATION`` per partition it
replaces. Each of those is one metastore call, so a reader of a partition sees its old files
or its new ones, never a mix. Files no partition points at any more (the replaced partitions',
a killed run's) are deleted afterwards, and at the start of the next run.

The table is created (``STORED AS PARQUET``, Hive's layout, readable by other engines) by the
first run, with the result's columns, partitioned by ``output.partition_by``, and marked with
the table property ``nearest_join.writer``: a run writes only into a table nearest-join
created, as a path output replaces only a directory nearest-join wrote.

The lock is the path output's (:class:`jobs.output.StagedOutput`): a ``flock`` on
``.NAME.nj-lock`` beside the table's location, so the location must be on a local or shared
POSIX filesystem (``file:``), as a path output must.
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from .output import SUCCESS_FILE, StagedOutput, partition_dirs
from .spec import SUMMARY_FILE, InputSpec, JobSpec, SpecError

logger = logging.getLogger(__name__)

__all__ = ["RUN_PREFIX", "WRITER_PROPERTY", "OutputTable", "TableWrite", "list_partitions", "ordered_result",
           "read_table", "resolve_output", "require_catalog"]

RUN_PREFIX = "nj-run-"
# Set on the tables nearest-join creates; a run writes only into such a table.
WRITER_PROPERTY = "nearest_join.writer"
# What Spark and Hive name the directory of a NULL partition value.
_NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"


def require_catalog(spark) -> None:
    """A spec that uses a table needs a session with a persistent (Hive) catalog."""
    catalog = spark.conf.get("spark.sql.catalogImplementation", "in-memory")
    if catalog != "hive":
        raise SpecError("spark_profile", f"the spec uses a table, but the running Spark session's catalog is "
                                         f"{catalog!r}, which forgets its tables when it stops; start the job "
                                         "in a session of its own (nearest-join builds one with Spark's Hive "
                                         "catalog) or enable Hive support in yours")


def _split(name: str) -> tuple[str | None, str]:
    database, _, table = name.rpartition(".")
    return (database or None), table


def _identifier(spark, name: str):
    database, table = _split(name)
    jvm = spark._jvm
    return jvm.org.apache.spark.sql.catalyst.TableIdentifier.apply(table, jvm.scala.Option.apply(database))


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _sql_name(name: str) -> str:
    return ".".join(_quote(part) for part in name.split("."))


def _literal(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _local(location: str) -> str | None:
    """The filesystem path of a ``file:`` location URI (None for any other scheme)."""
    parsed = urlparse(location)
    return unquote(parsed.path) if parsed.scheme in ("", "file") else None


def read_table(spark, side: InputSpec):
    """The input table of ``side``; a missing one is a SpecError naming ``query.table`` /
    ``target.table`` (before anything is read)."""
    from pyspark.errors import AnalysisException

    if not spark.catalog.tableExists(side.table):
        database, _ = _split(side.table)
        known = [t.name for t in spark.catalog.listTables(database)] if (
            database is None or spark.catalog.databaseExists(database)) else None
        where = f"database {database!r} does not exist" if known is None else (
            f"tables of {database or 'the current database'}: {sorted(known)}")
        raise SpecError(f"{side.side}.table", f"table {side.table!r} not found in the catalog ({where})")
    try:
        return spark.table(side.table)
    except AnalysisException as exc:
        raise SpecError(f"{side.side}.table", f"cannot read table {side.table!r}: "
                                              f"{str(exc).strip().splitlines()[0]}") from None


@dataclass
class OutputTable:
    """The output table as the catalog has it (or will have it), and one run's writing of it."""

    name: str                          # db.name as the spec writes it
    root: Path                         # the table's location (its default location if new)
    exists: bool
    partition_by: tuple[str, ...]
    columns: list[tuple[str, str]] = field(default_factory=list)   # (name, type) of an existing table
    partitions: dict[tuple[str, ...], str] = field(default_factory=dict)   # values -> location

    def describe(self) -> list[str]:
        """Lines for ``explain``: the table, where it lives, its partitions."""
        state = (f"exists, {len(self.partitions)} partition(s)" if self.exists
                 else "does not exist yet: the run creates it")
        lines = [f"table {self.name} at {self.root} ({state}), partitioned by {list(self.partition_by)}"]
        for values, location in sorted(self.partitions.items())[:20]:
            lines.append(f"    {_partition_name(self.partition_by, values)} -> {location}")
        if len(self.partitions) > 20:
            lines.append(f"    ... {len(self.partitions) - 20} more")
        return lines


def _partition_name(columns, values) -> str:
    return "/".join(f"{c}={v}" for c, v in zip(columns, values))


def list_partitions(spark, name: str, partition_by) -> dict[tuple[str, ...], str]:
    """{partition values in ``partition_by``'s order: location URI} of the table ``name``, in
    one call to the catalog (``SHOW PARTITIONS`` has no locations)."""
    jvm = spark._jvm
    catalog = spark._jsparkSession.sessionState().catalog()
    convert = jvm.scala.jdk.javaapi.CollectionConverters
    partitions = {}
    for partition in convert.asJava(catalog.listPartitions(_identifier(spark, name), jvm.scala.Option.empty())):
        spec = {str(k).lower(): v for k, v in dict(convert.asJava(partition.spec())).items()}
        partitions[tuple(spec[c.lower()] for c in partition_by)] = partition.location().toString()
    return partitions


def resolve_output(spark, spec: JobSpec) -> OutputTable:
    """The output table of ``spec`` as the catalog has it, checked before anything is read.

    Raises
    ------
    SpecError
        ``output.table``: the table exists but nearest-join did not create it, or its location is
        not a local filesystem path; ``output.partition_by``: it is partitioned otherwise.
    """
    require_catalog(spark)
    name, output = spec.output.table, spec.output
    database, table = _split(name)
    catalog = spark._jsparkSession.sessionState().catalog()
    if spark.catalog.tableExists(name):
        metadata = catalog.getTableMetadata(_identifier(spark, name))
        if not metadata.properties().contains(WRITER_PROPERTY):
            raise SpecError("output.table", f"table {name!r} exists and was not created by nearest-join (no table "
                                            f"property {WRITER_PROPERTY}); refusing to write into it. Choose "
                                            "another output.table")
        partitioned = tuple(str(c) for c in spark._jvm.scala.jdk.javaapi.CollectionConverters.asJava(
            metadata.partitionColumnNames()))
        if [c.lower() for c in partitioned] != [c.lower() for c in output.partition_by]:
            raise SpecError("output.partition_by", f"table {name!r} is partitioned by {list(partitioned)}, the "
                                                   f"spec says {list(output.partition_by)}")
        location = metadata.location().toString()
        columns = [(f.name, f.dataType.simpleString()) for f in spark.table(name).schema.fields]
        partitions = list_partitions(spark, name, partitioned)
        exists = True
    else:
        if database is not None and spark.catalog.databaseExists(database):
            location = catalog.defaultTablePath(_identifier(spark, name)).toString()
        else:  # CREATE DATABASE's default location: <warehouse>/<db>.db
            warehouse = spark.conf.get("spark.sql.warehouse.dir")
            location = f"{warehouse.rstrip('/')}/{(database or 'default').lower()}.db/{table.lower()}"
        columns, partitions, exists = [], {}, False
    root = _local(location)
    if root is None:
        raise SpecError("output.table", f"table {name!r} lives at {location}, not on a local filesystem path: "
                                        "the job's lock and staging need a local or shared POSIX filesystem "
                                        "(see docs/jobs.md, Atomicity)")
    return OutputTable(name=name, root=Path(root), exists=exists, partition_by=output.partition_by,
                       columns=columns, partitions=partitions)


def ordered_result(result, table: OutputTable, spec: JobSpec):
    """``result`` with its columns in the table's order, after checking them against the
    table's (an existing table; ``output.schema_change``). Returns (result, new columns)."""
    from pyspark.sql import functions as F

    partition_by = [c.lower() for c in table.partition_by]
    got = {f.name.lower(): (f.name, f.dataType.simpleString()) for f in result.schema.fields}
    if not table.exists:
        data = [f.name for f in result.schema.fields if f.name.lower() not in partition_by]
        ordered = data + [got[c][0] for c in partition_by]
        return result.select(*[F.col(_quote(c)) for c in ordered]), []
    have = {name.lower(): (name, kind) for name, kind in table.columns}
    added = [got[c] for c in got if c not in have]
    removed = [have[c][0] for c in have if c not in got]
    retyped = [f"{have[c][0]} {have[c][1]} -> {got[c][1]}" for c in got if c in have and got[c][1] != have[c][1]]
    if removed or retyped or (added and spec.output.schema_change != "add_columns"):
        parts = [f"{what} {items}" for what, items in (("new", [f"{n} {t}" for n, t in added]),
                                                         ("missing", removed), ("type changed", retyped)) if items]
        allow = " (output.schema_change: add_columns allows new columns only)" if removed or retyped else (
            "; set output.schema_change: add_columns to add them to the table")
        raise SpecError("output.table", f"the result's columns differ from table {table.name!r}'s: "
                                        f"{'; '.join(parts)}{allow}")
    data = [have[c][0] for c in have if c not in partition_by] + [name for name, _ in added]
    ordered = data + [have[c][0] for c in partition_by]
    return result.select(*[F.col(_quote(got[c.lower()][0])).alias(c) for c in ordered]), added


def _written_partitions(run_dir: Path, partition_by) -> list[tuple[str, ...]]:
    """The partition values of the ``col=value`` leaf directories Spark wrote under ``run_dir``."""
    found = []
    for directory, subdirectories, _ in os.walk(run_dir):
        depth = len(Path(directory).relative_to(run_dir).parts)
        subdirectories[:] = sorted(d for d in subdirectories if "=" in d and not d.startswith((".", "_")))
        if depth == len(partition_by):
            names = Path(directory).relative_to(run_dir).parts
            values = tuple(unquote(part.split("=", 1)[1]) for part in names)
            if _NULL_PARTITION in values:
                raise SpecError("output.partition_by",
                                f"the result has a NULL in a partition column "
                                f"({_partition_name(partition_by, values)}): a table partition needs a value; "
                                "filter the rows (query.where / target.where) or choose other "
                                "output.partition_by columns")
            found.append(values)
            subdirectories[:] = []
    return found


class TableWrite:
    """One run's writing of an output table: lock, staging, commit (see the module's text)."""

    def __init__(self, spark, table: OutputTable, spec: JobSpec):
        self.spark, self.table, self.spec = spark, table, spec
        # The path output's lock and staging directory, beside the table's location.
        self.staged = StagedOutput(table.root)
        self.run_dir = table.root / f"{RUN_PREFIX}{self.staged.run_id}"

    @property
    def staging(self) -> Path:
        return self.staged.staging

    def __enter__(self) -> "TableWrite":
        self.staged.__enter__()
        try:
            self._tidy()
        except BaseException:
            self.staged.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.staged.__exit__(exc_type, exc, tb)

    def _tidy(self) -> None:
        """Delete the run directories no partition points at: replaced partitions' files, and what a
        killed run left (a staging directory is StagedOutput's to delete). Called under the lock."""
        if not self.table.root.is_dir():
            return
        if self.table.exists:
            self.table.partitions = list_partitions(self.spark, self.table.name, self.table.partition_by)
        used = {os.path.normpath(p) for p in map(_local, self.table.partitions.values()) if p}
        for run_dir in sorted(self.table.root.glob(f"{RUN_PREFIX}*")):
            if not run_dir.is_dir():
                continue
            inside = [p for p in used if p == str(run_dir) or p.startswith(str(run_dir) + os.sep)]
            if not inside:
                logger.info("removing %s: no partition of %s points at it", run_dir, self.table.name)
                shutil.rmtree(run_dir, ignore_errors=True)
                continue
            for leaf in _leaves(run_dir, len(self.table.partition_by)):
                if os.path.normpath(leaf) not in used:
                    logger.info("removing %s: replaced", leaf)
                    shutil.rmtree(leaf, ignore_errors=True)

    def commit(self, summary: dict[str, Any], new_columns: list[tuple[str, str]], result_schema) -> list[dict]:
        """Create the table if needed, move the run's files under its location and point the
        catalog's partitions at them; returns what was added or replaced, for the summary."""
        from nearest_join.publish import fsync_path

        table, spark = self.table, self.spark
        staging = self.staging
        staging.mkdir(exist_ok=True)   # an empty result may not create it
        written = _written_partitions(staging, table.partition_by)
        values = dict(self.spec.output.partition_values)
        if not written and all(c in values for c in table.partition_by):
            # The run's partition is known beforehand: an empty result still replaces it.
            fixed = tuple(values[c] for c in table.partition_by)
            (staging.joinpath(*[f"{c}={v}" for c, v in zip(table.partition_by, fixed)])).mkdir(parents=True)
            written = [fixed]
        changes = [{"partition": dict(zip(table.partition_by, v)),
                    "location": str(self.run_dir.joinpath(*[f"{c}={v}" for c, v in zip(table.partition_by, v)])),
                    "replaced": table.partitions.get(v)} for v in written]
        summary["output"]["partitions"] = changes
        (staging / SUMMARY_FILE).write_text(_json(summary))
        (staging / SUCCESS_FILE).touch()
        for path in (staging / SUMMARY_FILE, staging):
            fsync_path(path)
        if not table.exists:
            self._create(result_schema)
        elif new_columns:
            spark.sql(f"ALTER TABLE {_sql_name(table.name)} ADD COLUMNS "
                      f"({', '.join(f'{_quote(n)} {t}' for n, t in new_columns)})")
        table.root.mkdir(parents=True, exist_ok=True)
        os.rename(staging, self.run_dir)
        fsync_path(table.root)
        # The switch: one metastore call per statement. New partitions are added together; each
        # replaced one gets its new location in one call of its own.
        added = [c for c in changes if c["replaced"] is None]
        if added:
            spark.sql(f"ALTER TABLE {_sql_name(table.name)} ADD " + " ".join(
                f"PARTITION ({_partition_clause(c['partition'])}) LOCATION {_literal(c['location'])}"
                for c in added))
        for change in changes:
            if change["replaced"] is not None:
                spark.sql(f"ALTER TABLE {_sql_name(table.name)} PARTITION ({_partition_clause(change['partition'])}) "
                          f"SET LOCATION {_literal(change['location'])}")
        table.exists = True
        spark.catalog.refreshTable(table.name)
        self._tidy()
        return changes

    def _create(self, schema) -> None:
        table, spark = self.table, self.spark
        partition_by = [c.lower() for c in table.partition_by]
        columns = [f for f in schema.fields if f.name.lower() not in partition_by]
        partitions = [next(f for f in schema.fields if f.name.lower() == c) for c in partition_by]
        database, _ = _split(table.name)
        if database is not None:
            spark.sql(f"CREATE DATABASE IF NOT EXISTS {_quote(database)}")
        spark.sql(
            f"CREATE TABLE {_sql_name(table.name)} "
            f"({', '.join(f'{_quote(f.name)} {f.dataType.simpleString()}' for f in columns)}) "
            f"PARTITIONED BY ({', '.join(f'{_quote(f.name)} {f.dataType.simpleString()}' for f in partitions)}) "
            f"STORED AS PARQUET TBLPROPERTIES ({_literal(WRITER_PROPERTY)} = 'nearest-join')")
        logger.info("created table %s", table.name)


def _partition_clause(values: dict[str, str]) -> str:
    """``col = 'value', ...`` of a PARTITION (...) clause (Spark casts the strings to the columns' types)."""
    return ", ".join(f"{_quote(column)} = {_literal(value)}" for column, value in values.items())


def _leaves(run_dir: Path, depth: int) -> list[str]:
    return [os.path.normpath(run_dir / leaf) for leaf in partition_dirs(run_dir, depth)]


def _json(summary: dict[str, Any]) -> str:
    import json

    return json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"
