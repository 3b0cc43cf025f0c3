"""A side's rows read from its Parquet files in the task, instead of handed over by Spark.

Spark hands ``array<float>`` columns to Python element by element (its Parquet reader, then
its Arrow writer); pyarrow decodes the same files many times faster. Where a side is a plain
scan of local Parquet files (``nearest_join.parquet_scan.file_rows`` decides, on the driver),
its tasks are a range of ids, one row each, and each task reads its share of the files' rows
here: the rows the packers and the streamed searches would have received from Spark, under
the same positional names, in the files' order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq


# Rows a task decodes at once (Spark's Arrow batches: spark.sql.execution.arrow.maxRecordsPerBatch).
BATCH_ROWS = 10_000


@dataclass(frozen=True)
class FileRows:
    """A side's rows in its Parquet files, cut into ``tasks`` contiguous shares of equal rows
    (+-1). ``files``: each file's path and the rows of each of its row groups, as the driver
    read them from the footers; ``columns``: the side's columns in the files, in the side's
    order; ``names``: the positional names the tasks hand them on under; ``types``: the Arrow
    type of each, as the driver found it in every file."""
    files: tuple[tuple[str, tuple[int, ...]], ...]
    columns: tuple[str, ...]
    names: tuple[str, ...]
    types: tuple[pa.DataType, ...]
    tasks: int

    def only(self, index: int) -> FileRows:
        """The side's column ``index`` alone, in the same shares."""
        return dataclasses.replace(self, columns=(self.columns[index],), names=(self.names[index],),
                                   types=(self.types[index],))

    @property
    def rows(self) -> int:
        return sum(sum(groups) for _, groups in self.files)

    def share(self, task: int) -> tuple[int, int]:
        """Task ``task``'s rows: [start, stop) in the files' order."""
        base, extra = divmod(self.rows, self.tasks)
        start = task * base + min(task, extra)
        return start, start + base + (task < extra)

    @property
    def schema(self) -> pa.Schema:
        return pa.schema(list(zip(self.names, self.types)))

    def table(self) -> pa.Table:
        """Every row, in the files' order, one table."""
        return pa.Table.from_batches(list(self.rows_between(0, self.rows)), schema=self.schema)

    def batches(self, tasks: Iterable[int]) -> Iterator[pa.RecordBatch]:
        """The rows of the shares ``tasks`` (a task's id rows), in batches of at most
        :data:`BATCH_ROWS`."""
        for task in tasks:
            yield from self.rows_between(*self.share(int(task)))

    def rows_between(self, start: int, stop: int) -> Iterator[pa.RecordBatch]:
        """Rows [start, stop) in the files' order, in batches of at most :data:`BATCH_ROWS`."""
        schema = self.schema
        at = 0
        for path, groups in self.files:
            if at >= stop:
                return
            if at + sum(groups) <= start:
                at += sum(groups)
                continue
            parquet = pq.ParquetFile(path)
            if tuple(parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)) != groups:
                raise RuntimeError(f"the Parquet file {path} changed while the join read it: its row groups "
                                   f"are not those the plan counted ({len(groups)} groups of {sum(groups)} rows)")
            for g, rows in enumerate(groups):
                first, last = max(start - at, 0), min(stop - at, rows)
                at += rows
                if first >= last:
                    continue
                # A row group's rows a batch at a time, as Spark's reader decodes them: a task
                # holds one batch decoded, whatever its files' row groups.
                done = 0
                for batch in parquet.iter_batches(BATCH_ROWS, row_groups=[g], columns=list(self.columns),
                                                  use_threads=False):
                    lo, hi = max(first - done, 0), min(last - done, batch.num_rows)
                    done += batch.num_rows
                    if lo < hi:
                        yield self._checked(batch.slice(lo, hi - lo), schema, path)
                    if done >= last:
                        break

    def _checked(self, batch: pa.RecordBatch, schema: pa.Schema, path: str) -> pa.RecordBatch:
        """``batch`` under the positional names and the plan's types (another file's list field
        name or nullability cast away); an error if a column has another type."""
        for i, wanted in enumerate(self.types):
            if not same_type(batch.column(i).type, wanted):
                raise RuntimeError(f"the Parquet file {path} changed while the join read it: column "
                                   f"{self.columns[i]!r} is {batch.column(i).type}, not {wanted}")
        table = pa.Table.from_batches([batch]).rename_columns(list(self.names))
        if table.schema != schema:
            table = table.cast(schema)
        return table.combine_chunks().to_batches()[0]


def same_type(arrow_type: pa.DataType, wanted: pa.DataType) -> bool:
    """Whether a column pyarrow reads as ``arrow_type`` holds the values of ``wanted``
    unconverted: the same atomic type, or lists of the same element type (their field's name
    and nullability aside)."""
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return pa.types.is_list(wanted) and arrow_type.value_type == wanted.value_type
    return arrow_type == wanted


def task_ids(batches: Iterable[pa.RecordBatch]) -> list[int]:
    """The share ids of a task's input rows (column 0): one row, its share's id, in each task
    of a side read from its files (the task's partition id is not it: a union before the
    search numbers the partitions after its other inputs')."""
    return [int(i) for batch in batches for i in batch.column(0).to_numpy(zero_copy_only=False)]


def read_then(batches: Iterable[pa.RecordBatch], function, source: FileRows) -> Iterator[pa.RecordBatch]:
    """mapInArrow function over a task's id row: ``function`` (a mapInArrow function: packing,
    a scan) of the rows of its share, read from the files."""
    yield from function(source.batches(task_ids(batches)))
