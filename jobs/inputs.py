"""Local Parquet inputs are checked file by file before Spark reads them.

Spark infers an input's schema from the footer of one of its files and meets the others only
while the job runs: a file that is not Parquet, or one whose column types differ, fails the
search minutes later as a ``Py4JJavaError``. Reading every footer here (a few KB per file,
no data) finds both at once and names the file, so the run exits 2 before anything is
written. Non-local inputs (``s3a://``, ``hdfs://``) are left to Spark; the runner turns its
read failures into the same error.
"""
from __future__ import annotations

import glob
import os
from concurrent.futures import ThreadPoolExecutor

from .spec import InputSpec, SpecError, is_local, local_path

__all__ = ["parquet_files", "check_parquet_input"]

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
    """The column types of one Parquet file, or the reason it cannot be read."""
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except OSError as exc:  # includes pyarrow's ArrowIOError; ArrowInvalid is a ValueError
        return None, exc.strerror or str(exc)
    except ValueError as exc:
        return None, str(exc)
    return {field.name: _spark_type(field.type) for field in schema}, None


def check_parquet_input(side: InputSpec) -> None:
    """Every local file of ``side`` is Parquet, and a column has one type in all of them.

    Empty files are skipped (Spark skips them too). Columns missing from some files are
    allowed: Spark reads them as null there.

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
        return  # nothing to compare; Spark reports an input without data files itself
    with ThreadPoolExecutor(max_workers=min(_FOOTER_THREADS, len(files))) as pool:
        footers = list(pool.map(_footer, files))
    first_seen: dict[str, tuple[str, str]] = {}  # column -> (type, file it was first seen in)
    for path, (columns, problem) in zip(files, footers):
        if columns is None:
            raise SpecError(
                key,
                f"{path!r} is not a readable Parquet file ({problem}); remove it from the "
                "input, or list only the Parquet files",
            )
        for name, spark_type in columns.items():
            seen_type, seen_in = first_seen.setdefault(name, (spark_type, path))
            if seen_type != spark_type:
                raise SpecError(
                    key,
                    f"column {name!r} is {spark_type} in {path!r} but {seen_type} in "
                    f"{seen_in!r}; all files of one input need the same column types (rewrite "
                    "the odd files, or list only files with one schema)",
                )
