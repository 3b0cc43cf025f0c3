"""Row gathers for the executors (``udfs.payload``, ``udfs.merge``): compiled copies of selected
rows of a matrix, with the GIL released, split over threads; and the distinct rows a shipped
top-k state refers to. Pure numeric code: no pyspark.
"""
from __future__ import annotations

import numpy as np

from ._numba import frozen, run_split

from . import _gather_kernels  # noqa: E402  (after _numba chose the cache directory)

__all__ = ["distinct_rows", "take_rows", "take_rows_at"]


def take_rows(matrix: np.ndarray, rows: np.ndarray, out: np.ndarray, threads: int = 1) -> None:
    """``out[:] = matrix[rows]`` (2-D, same dtype), GIL released, the rows split over
    ``threads`` threads. Indices are checked here: the compiled loops do not bounds-check.
    """
    if rows.shape[0] != out.shape[0] or matrix.shape[1:] != out.shape[1:] or matrix.dtype != out.dtype:
        raise ValueError(f"take_rows: shapes {matrix.shape} -> {out.shape} (dtypes {matrix.dtype}, "
                         f"{out.dtype}) do not match {rows.shape[0]} rows")
    if rows.shape[0] == 0:
        return
    lo, hi = int(rows.min()), int(rows.max())
    if lo < 0 or hi >= matrix.shape[0]:
        raise IndexError(f"take_rows: row {lo if lo < 0 else hi} outside 0..{matrix.shape[0] - 1}")
    rows = np.asarray(rows, dtype=np.int64)
    # take_rows_at into positions 0, 1, ...: one compiled copy for both gathers (a kernel of
    # its own cost each new worker its compilation, for the same loop).
    positions = np.arange(rows.shape[0], dtype=np.int64)
    run_split(_gather_kernels.take_rows_at, rows.shape[0], *frozen(matrix, rows, positions), out, threads=threads)


def take_rows_at(matrix: np.ndarray, rows: np.ndarray, positions: np.ndarray, out: np.ndarray,
                 threads: int = 1) -> None:
    """``out[positions] = matrix[rows]`` (2-D, same dtype), GIL released: one source's rows
    into their slots of an output that several sources fill. ``threads`` as in
    :func:`take_rows`; the indices are checked here."""
    if (rows.shape != positions.shape or rows.ndim != 1 or matrix.shape[1:] != out.shape[1:]
            or matrix.dtype != out.dtype or matrix.ndim != 2):
        raise ValueError(f"take_rows_at: {rows.shape[0]} rows of {matrix.shape} ({matrix.dtype}) to "
                         f"{positions.shape[0]} positions of {out.shape} ({out.dtype})")
    if rows.shape[0] == 0:
        return
    for name, idx, limit in (("row", rows, matrix.shape[0]), ("position", positions, out.shape[0])):
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= limit:
            raise IndexError(f"take_rows_at: {name} {lo if lo < 0 else hi} outside 0..{limit - 1}")
    rows, positions = np.asarray(rows, dtype=np.int64), np.asarray(positions, dtype=np.int64)
    run_split(_gather_kernels.take_rows_at, rows.shape[0], *frozen(matrix, rows, positions), out, threads=threads)


def distinct_rows(source: np.ndarray, rows: np.ndarray, sizes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (source, row) pairs of a state's slots, in (source, row) order, and each
    slot's position among them: (sources int64, rows int64, payload_row int32 per slot, -1
    for an empty slot ``source < 0``). ``sizes``: rows per source; a slot outside them
    raises IndexError."""
    source = np.ascontiguousarray(source, dtype=np.int32).reshape(-1)
    rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
    if source.shape != rows.shape:
        raise ValueError(f"distinct_rows: {source.shape[0]} sources for {rows.shape[0]} rows")
    base = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).astype(np.int64)
    payload_row = np.empty(source.shape[0], np.int32)
    out_source, out_row, bad = _gather_kernels.distinct_rows(source, rows, base, payload_row)
    if bad:
        raise IndexError(f"distinct_rows: {bad} slots refer to a source or row outside "
                         f"{base.shape[0] - 1} sources of {list(np.diff(base))} rows")
    return out_source, out_row, payload_row
