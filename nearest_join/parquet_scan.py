"""Columns of a DataFrame that is a plain scan of local Parquet files, read by pyarrow.

Spark hands ``array<float>`` columns to Python element by element: its Arrow conversion
writes every one, and for the vectors of a whole side that costs seconds where pyarrow decodes
the same files in a fraction of the time. :func:`plain_parquet_scan` finds the files and
columns when the DataFrame's optimized plan is nothing but a projection of columns of a
Parquet relation on the local file system; for anything else (a filter, a cast, a cached
DataFrame, another source, a partition column, Spark Connect) it returns None, and the caller
collects through Spark.

The rows come in the files' order, not Spark's: a caller aligns them with rows Spark collected
by a unique id (and checks that each side has every row once).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from pyspark.sql import DataFrame
from pyspark.sql.pandas.types import to_arrow_type
from pyspark.sql.types import (ArrayType, BinaryType, BooleanType, ByteType, DoubleType, FloatType, IntegerType,
                               LongType, ShortType, StringType)

from udfs.files import FileRows, same_type

from .ranking import column

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParquetScan:
    """Columns of a plain Parquet scan: its local files, the columns' names in them and the
    Arrow types Spark reads them as (:func:`plain_parquet_scan`)."""
    paths: tuple[str, ...]
    columns: tuple[str, ...]
    types: tuple[pa.DataType, ...]

    def read(self, as_names: list[str]) -> pa.Table | None:
        """The columns, renamed ``as_names``, each one contiguous array: the rows Spark would
        read, in the files' order; None when pyarrow cannot read the files (a missing or
        corrupt file) or reads another type than Spark's."""
        try:
            table = ds.dataset(list(self.paths), format="parquet").to_table(columns=list(self.columns))
        except (pa.ArrowException, OSError) as error:
            logger.info("reading %s through Spark: pyarrow cannot read its files (%s)", self.columns, error)
            return None
        if not all(same_type(table.column(i).type, t) for i, t in enumerate(self.types)):
            return None
        return table.rename_columns(as_names).combine_chunks()


def plain_parquet_scan(df: DataFrame, names: list[str]) -> ParquetScan | None:
    """The :class:`ParquetScan` of columns ``names`` of ``df`` (as
    :func:`nearest_join.ranking.column` resolves them) when ``df``'s optimized plan is a
    projection of columns of a Parquet relation on the local file system, none of them a
    partition column; else None. Nothing is read (the plan is Spark's, no job)."""
    if getattr(df, "_jdf", None) is None:   # Spark Connect: no plan to look into (nor py4j)
        return None
    from py4j.protocol import Py4JError

    try:
        return _scan_of(df, names)
    except Py4JError as error:   # a plan of a shape this reading does not know
        logger.info("reading %s through Spark: %s", names, error)
        return None


def _scan_of(df: DataFrame, names: list[str]) -> ParquetScan | None:
    probe = df.select(*[column(df, name).alias(f"c{i}") for i, name in enumerate(names)])
    plan = probe._jdf.queryExecution().optimizedPlan()
    if plan.getClass().getSimpleName() != "Project":
        return None
    scan = plan.child()
    if scan.getClass().getSimpleName() != "LogicalRelation" or scan.isStreaming():
        return None
    relation = scan.relation()
    if (relation.getClass().getSimpleName() != "HadoopFsRelation"
            or relation.fileFormat().getClass().getSimpleName() != "ParquetFileFormat"):
        return None
    output = scan.output()
    by_id = {output.apply(i).exprId().id(): output.apply(i).name() for i in range(output.size())}
    partitions = set(relation.partitionSchema().fieldNames())
    projected = plan.projectList()
    columns = []
    for i in range(projected.size()):
        alias = projected.apply(i)
        source = alias.child() if alias.getClass().getSimpleName() == "Alias" else None
        if source is None or source.getClass().getSimpleName() != "AttributeReference":
            return None
        name = by_id.get(source.exprId().id())
        if name is None or name in partitions:
            return None
        columns.append(name)
    paths = local_paths(relation)
    if paths is None:
        return None
    types = []
    for field in probe.schema.fields:
        try:
            types.append(to_arrow_type(field.dataType))
        except (TypeError, NotImplementedError):
            return None
    return ParquetScan(paths, tuple(columns), tuple(types))


# The Spark types a join's side may have for its rows to be read from the files in the tasks
# (udfs.files): those whose values pyarrow reads as Spark does (no calendar rebase, no time
# zone), alone or as array elements.
_FILE_TYPES = (ByteType, ShortType, IntegerType, LongType, FloatType, DoubleType, BooleanType, StringType, BinaryType)


def file_rows(df: DataFrame, names: list[str], tasks: int) -> FileRows | None:
    """The :class:`udfs.files.FileRows` of all of ``df``'s columns, handed on under ``names``
    and cut into ``tasks`` shares, when ``df`` is a plain Parquet scan (:func:`plain_parquet_scan`)
    of columns of the types pyarrow reads as Spark does, each file holding each of them with
    that type under that name; else None, and Spark reads the side. The footers are read here
    (the files' row groups), no data."""
    if not all(isinstance(f.dataType, _FILE_TYPES)
               or (isinstance(f.dataType, ArrayType) and isinstance(f.dataType.elementType, _FILE_TYPES))
               for f in df.schema.fields):
        return None
    spark = df.sparkSession
    if any(spark.conf.get(f"spark.sql.files.{key}", "false").lower() == "true"
           for key in ("ignoreCorruptFiles", "ignoreMissingFiles")):
        return None   # Spark would skip a file pyarrow cannot read: a task would fail
    if len(set(df.columns)) != len(df.columns):
        return None   # columns of one name (a self-join's): not one scan's
    from pyspark.errors import PySparkException

    try:
        scan = plain_parquet_scan(df, list(df.columns))
    except PySparkException as error:   # a name the probe cannot select
        logger.info("reading %s through Spark: %s", df.columns, error)
        return None
    if scan is None or not scan.paths:
        return None
    files, types = [], None
    for path in sorted(scan.paths):
        try:
            metadata = pq.read_metadata(path)
            schema = metadata.schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as error:
            logger.info("reading %s through Spark: pyarrow cannot read %s (%s)", df.columns, path, error)
            return None
        found = [schema.field(c).type if schema.get_field_index(c) >= 0 else None for c in scan.columns]
        if not all(t is not None and same_type(t, wanted) for t, wanted in zip(found, scan.types)):
            return None   # a file without a column, or of another type (Spark would convert it)
        types = types or tuple(found)
        files.append((path, tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))))
    return FileRows(tuple(files), scan.columns, tuple(names), types, max(1, tasks))


def local_paths(relation) -> tuple[str, ...] | None:
    """The files of a ``HadoopFsRelation`` (a py4j handle) as local paths, None unless all of
    them are on the local file system."""
    paths = []
    for uri in relation.location().inputFiles():
        parsed = urlparse(uri)
        if parsed.scheme != "file":
            return None
        paths.append(unquote(parsed.path))
    return tuple(paths)


def footer_rows(relation) -> int | None:
    """The rows of a Parquet ``HadoopFsRelation`` (a py4j handle) on the local file system,
    summed from its files' footers (no data read); None for another format, files elsewhere or
    a footer pyarrow cannot read."""
    if relation.fileFormat().getClass().getSimpleName() != "ParquetFileFormat":
        return None
    paths = local_paths(relation)
    if paths is None:
        return None
    try:
        return sum(pq.read_metadata(path).num_rows for path in paths)
    except (pa.ArrowException, OSError):
        return None
