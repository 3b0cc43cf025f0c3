"""Local Parquet inputs are checked file by file before Spark reads them.

Spark infers an input's schema from the footer of one of its files and meets the others only
while the job runs: a file that is not Parquet, or one whose column types differ, fails the
search minutes later as a ``Py4JJavaError``. Reading every footer here (a few KB per file,
no data) finds both at once and names the file, so the run exits 2 before anything is
written. Non-local inputs (``s3a://``, ``hdfs://``) are left to Spark; the runner turns its
read failures into the same error.

The same footers give Spark the input's schema where they settle it (:func:`footer_schema`):
without one, ``spark.read.parquet`` runs a Spark job to read a footer Spark could have been told.
"""
from __future__ import annotations

import glob
import json
import os
from concurrent.futures import ThreadPoolExecutor

from .spec import InputSpec, SpecError, is_local, local_path

__all__ = ["parquet_files", "check_parquet_input", "footer_schema"]

# Footers are small reads; on NFS or Lustre each costs a round trip, so overlap them.
_FOOTER_THREADS = 16


def _hidden(name: str) -> bool:
    # What Spark skips when it lists a directory (HadoopFSUtils.shouldFilterOutPathName):
    # _SUCCESS, _temporary, .crc files, files still being copied. `_x=1` is a partition.
    return (name.startswith("_") and "=" not in name) or name.startswith(".") or name.endswith(
        "._COPYING_")


def parquet_files(pattern: str) -> list[str]:
    """The files Spark reads for one local input path, directory or glob, sorted."""
    roots = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    files = []
    for root in roots:
        if glob.has_magic(pattern) and _hidden(os.path.basename(root)):
            continue
        if os.path.isfile(root):
            files.append(root)
            continue
        for directory, subdirectories, names in os.walk(root, followlinks=True):
            subdirectories[:] = sorted(d for d in subdirectories if not _hidden(d))
            files.extend(os.path.join(directory, n) for n in sorted(names) if not _hidden(n))
    return files


def _spark_type(arrow_type) -> str:
    """The Spark SQL type a Parquet column of ``arrow_type`` reads as, for comparison.

    Differences Spark does not see are dropped: list item names and nullability, string vs
    large_string, dictionary encoding, timestamp units.
    """
    import pyarrow as pa
    from pyarrow import types

    if types.is_dictionary(arrow_type):
        return _spark_type(arrow_type.value_type)
    if types.is_list(arrow_type) or types.is_large_list(arrow_type) or types.is_fixed_size_list(
            arrow_type):
        return f"array<{_spark_type(arrow_type.value_type)}>"
    if types.is_map(arrow_type):
        return f"map<{_spark_type(arrow_type.key_type)},{_spark_type(arrow_type.item_type)}>"
    if types.is_struct(arrow_type):
        fields = ",".join(f"{f.name}:{_spark_type(f.type)}" for f in arrow_type)
        return f"struct<{fields}>"
    if types.is_string(arrow_type) or types.is_large_string(arrow_type):
        return "string"
    if types.is_binary(arrow_type) or types.is_large_binary(arrow_type):
        return "binary"
    if types.is_timestamp(arrow_type):
        return "timestamp" if arrow_type.tz is not None else "timestamp_ntz"
    names = {pa.int8(): "tinyint", pa.int16(): "smallint", pa.int32(): "int",
             pa.int64(): "bigint", pa.float32(): "float", pa.float64(): "double",
             pa.bool_(): "boolean", pa.date32(): "date"}
    return names.get(arrow_type, str(arrow_type))


def _footer(path: str):
    """The Arrow schema of one Parquet file, or the reason it cannot be read."""
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path), None
    except OSError as exc:  # includes pyarrow's ArrowIOError; ArrowInvalid is a ValueError
        return None, exc.strerror or str(exc)
    except ValueError as exc:
        return None, str(exc)


# The key under which Spark writes a file's Spark schema into its Parquet footer
# (ParquetReadSupport.SPARK_METADATA_KEY); Spark reads its schema from there when present.
_SPARK_SCHEMA_KEY = b"org.apache.spark.sql.parquet.row.metadata"


def _plain_type(arrow_type):
    """The Spark type a Parquet column of ``arrow_type`` reads as, for the types whose reading
    does not depend on Spark settings or on the Parquet physical type; None for any other
    (timestamps: INT96 or not, unsigned integers, binary: ``binaryAsString``, decimals, maps)."""
    import pyarrow as pa
    from pyarrow import types
    from pyspark.sql import types as T

    if types.is_list(arrow_type) or types.is_large_list(arrow_type) or types.is_fixed_size_list(
            arrow_type):
        element = _plain_type(arrow_type.value_type)
        return None if element is None else T.ArrayType(element, True)
    if types.is_struct(arrow_type):
        fields = [(f.name, _plain_type(f.type)) for f in arrow_type]
        if any(t is None for _, t in fields):
            return None
        return T.StructType([T.StructField(name, t, True) for name, t in fields])
    if types.is_string(arrow_type) or types.is_large_string(arrow_type):
        return T.StringType()
    plain = {pa.int8(): T.ByteType(), pa.int16(): T.ShortType(), pa.int32(): T.IntegerType(),
             pa.int64(): T.LongType(), pa.float32(): T.FloatType(), pa.float64(): T.DoubleType(),
             pa.bool_(): T.BooleanType(), pa.date32(): T.DateType()}
    return plain.get(arrow_type)


def footer_schema(schemas: list) -> object | None:
    """The schema Spark infers for an input whose files have these Arrow schemas (footers
    read with pyarrow), or None where it is not certain; Spark then infers it itself.

    Spark takes an input's schema from one of its files: the Spark schema a file written by
    Spark carries, else its Parquet schema converted. It is certain here when every file has
    the same columns, in the same order, of the same types (which file Spark reads does not
    matter), and the file carries Spark's schema or its columns are all of plain types.
    Fields are nullable, as Spark reads any file.
    """
    from pyspark.sql import types as T

    if not schemas:
        return None
    first = schemas[0]
    names = [name.lower() for name in first.names]
    if len(set(names)) != len(names):   # Spark's columns are case-insensitive by default
        return None
    spark_schema = (first.metadata or {}).get(_SPARK_SCHEMA_KEY)
    for schema in schemas[1:]:
        if schema.names != first.names or not all(a.type.equals(b.type) for a, b in zip(schema, first)):
            return None
        if (schema.metadata or {}).get(_SPARK_SCHEMA_KEY) != spark_schema:
            return None
    if spark_schema is not None:
        try:
            struct = T.StructType.fromJson(json.loads(spark_schema))
        except (ValueError, KeyError, TypeError, ImportError):
            return None
        return struct if struct.fieldNames() == first.names else None
    fields = [(field.name, _plain_type(field.type)) for field in first]
    if any(t is None for _, t in fields):
        return None
    return T.StructType([T.StructField(name, t, True) for name, t in fields])


def _partitioned(files: list[str], roots: list[str]) -> bool:
    """Whether any file lies below a ``column=value`` directory of its input (a partition
    column Spark adds from the path)."""
    for path in files:
        root = next((r for r in roots if path.startswith(r.rstrip(os.sep) + os.sep)), None)
        relative = os.path.dirname(path[len(root) + 1:]) if root else ""
        if any("=" in part for part in relative.split(os.sep)):
            return True
    return False


def check_parquet_input(side: InputSpec):
    """Every local file of ``side`` is Parquet, and a column has one type in all of them.

    Empty files are skipped (Spark skips them too). Columns missing from some files are
    allowed: Spark reads them as null there.

    Returns
    -------
    pyspark.sql.types.StructType or None
        The schema for Spark to read ``side`` with (:func:`footer_schema`), when every path is
        local, holds data files, and none is partitioned by directory; else None.

    Raises
    ------
    SpecError
        ``query.path`` / ``target.path``, naming the file and why it cannot be read, or the
        column, its two types and a file of each.
    """
    key = f"{side.side}.path"
    files = [f for p in side.paths if is_local(p) for f in parquet_files(local_path(p))]
    files = [f for f in files if os.path.getsize(f) > 0]
    if not files:
        return None  # nothing to compare; Spark reports an input without data files itself
    with ThreadPoolExecutor(max_workers=min(_FOOTER_THREADS, len(files))) as pool:
        footers = list(pool.map(_footer, files))
    first_seen: dict[str, tuple[str, str]] = {}  # column -> (type, file it was first seen in)
    for path, (schema, problem) in zip(files, footers):
        if schema is None:
            raise SpecError(
                key,
                f"{path!r} is not a readable Parquet file ({problem}); remove it from the "
                "input, or list only the Parquet files",
            )
        for name, spark_type in ((f.name, _spark_type(f.type)) for f in schema):
            seen_type, seen_in = first_seen.setdefault(name, (spark_type, path))
            if seen_type != spark_type:
                raise SpecError(
                    key,
                    f"column {name!r} is {spark_type} in {path!r} but {seen_type} in "
                    f"{seen_in!r}; all files of one input need the same column types (rewrite "
                    "the odd files, or list only files with one schema)",
                )
    if not all(is_local(p) for p in side.paths) or _partitioned(files, [local_path(p) for p in side.paths]):
        return None
    return footer_schema([schema for schema, _ in footers])
