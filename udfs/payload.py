"""Payload rows: gathers over Arrow tables, the payload half of every plan.

A top-k state refers to its payload rows as ``(source table, row)`` pairs and gathers them
once, when its rows are emitted or shipped (see ``udfs.merge.TopkState``). This module does
those gathers, below both the merge that ships them and the encoding that emits them:

* vector columns (``list`` / ``large_list`` / ``fixed_size_list`` of float or double, no
  NULLs, one length) are gathered as numpy matrices, in threads when large: Arrow's generic
  ``take`` walks lists row by row (about 5x slower for 128-float vectors), and vectors are by
  far the largest payload;
* every other column goes through Arrow's ``take`` on the rows each source contributes.

Fresh large allocations are the other cost: on some machines first-touch page faults make a
new 300 MB array cost ten times its copy. Output matrices are therefore taken from Arrow's
memory pool, which keeps freed memory for the next block. The same threaded copies into pool
memory serve the GPU searcher's host staging (:func:`copy_into`) and the keyed broadcast
task's sorted union of target blocks (:func:`pooled_empty`).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from .decode import as_array, value_offsets

# Gathers above this many bytes are split over the task's threads.
PARALLEL_BYTES = 8 << 20
_POOLS: dict[int, ThreadPoolExecutor] = {}


def gather_threads() -> int:
    """Threads for large gathers: this task's cores (``udfs.context.task_cpus``)."""
    from .context import task_cpus

    return task_cpus()


def _pool(threads: int) -> ThreadPoolExecutor:
    pool = _POOLS.get(threads)
    if pool is None:
        pool = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="nj-gather")
    return pool


def pooled_empty(shape: tuple[int, ...], dtype) -> tuple[np.ndarray, pa.Buffer]:
    """An uninitialised array backed by an Arrow pool buffer (reused memory, no page faults)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = pa.allocate_buffer(max(nbytes, 1))
    return np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape))).reshape(shape), buf


def _compiled(matrix: np.ndarray, out: np.ndarray) -> bool:
    return matrix.ndim == 2 and out.ndim == 2 and matrix.dtype == out.dtype and matrix.dtype.kind == "f"


def _take(matrix: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = matrix[rows]`` on this thread: the compiled row copy (GIL released, about
    twice ``np.take`` for 128-float rows) for 2-D arrays of one dtype, else ``np.take``."""
    if _compiled(matrix, out):
        from nearest_kernels.gather import take_rows

        take_rows(matrix, rows, out)
    else:
        np.take(matrix, rows, axis=0, out=out)


def take_matrix(matrix: np.ndarray, rows: np.ndarray, out: np.ndarray, threads: int | None = None) -> None:
    """``out[:] = matrix[rows]``, split over threads when large (the copy releases the GIL)."""
    n = rows.shape[0]
    threads = threads or gather_threads()
    if threads <= 1 or out.nbytes < PARALLEL_BYTES or n < 2 * threads:
        _take(matrix, rows, out)
        return
    if _compiled(matrix, out):
        from nearest_kernels.gather import take_rows

        take_rows(matrix, rows, out, threads=threads)
        return
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)
    futures = [_pool(threads).submit(_take, matrix, rows[a:b], out[a:b])
               for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    for f in futures:
        f.result()


def copy_into(out: np.ndarray, array: np.ndarray, threads: int | None = None) -> None:
    """``out[...] = array`` (converting the dtype), split by rows over threads when large."""
    threads = threads or gather_threads()
    n = out.shape[0]
    if threads <= 1 or out.nbytes < PARALLEL_BYTES or n < 2 * threads:
        out[...] = array
        return
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)
    futures = [_pool(threads).submit(np.copyto, out[a:b], array[a:b], "unsafe")
               for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    for f in futures:
        f.result()


def _take_sources(matrices: list[np.ndarray], source: np.ndarray, rows: np.ndarray, out: np.ndarray,
                  threads: int = 1) -> None:
    """:func:`take_matrices` source by source, each source's rows split over ``threads``."""
    from nearest_kernels.gather import take_rows_at

    for s, matrix in enumerate(matrices):
        sel = np.flatnonzero(source == s)
        if sel.size == source.shape[0]:    # one source: straight into the output
            if threads > 1:
                take_matrix(matrix, rows, out, threads)
            else:
                _take(matrix, rows, out)
        elif sel.size and _compiled(matrix, out):
            take_rows_at(matrix, rows[sel], sel, out, threads=threads)   # no temporary, no GIL
        elif sel.size:
            out[sel] = matrix[rows[sel]]
    empty = np.flatnonzero(source < 0)
    if empty.size:
        out[empty] = 0


def take_matrices(matrices: list[np.ndarray], source: np.ndarray, rows: np.ndarray, out: np.ndarray,
                  threads: int | None = None) -> None:
    """``out[j] = matrices[source[j]][rows[j]]`` (zeros where ``source[j] < 0``), each
    source's rows split over the task's threads when large."""
    n = source.shape[0]
    threads = threads or gather_threads()
    if threads <= 1 or out.nbytes < PARALLEL_BYTES or n < 2 * threads:
        threads = 1
    _take_sources(matrices, source, rows, out, threads)


def vector_matrix(array: pa.Array) -> np.ndarray | None:
    """Zero-copy (n, width) view of a float list column whose lists all have one length.

    None when not applicable (NULLs, ragged or empty lists, other types).
    """
    t = array.type
    if len(array) == 0 or array.null_count:
        return None
    if pa.types.is_fixed_size_list(t):
        if not pa.types.is_floating(t.value_type):
            return None
        width = t.list_size
        values = array.values.slice(array.offset * width, width * len(array))
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        if not pa.types.is_floating(t.value_type):
            return None
        offsets = value_offsets(array)
        width = int(offsets[1] - offsets[0])
        if width == 0 or offsets[-1] - offsets[0] != width * len(array):
            return None
        if width * len(array) > 1 and not np.all(np.diff(offsets) == width):
            return None
        values = array.values.slice(int(offsets[0]), width * len(array))
    else:
        return None
    if width == 0 or values.null_count:
        return None
    return values.to_numpy(zero_copy_only=False).reshape(len(array), width)


def _vector_array(type_: pa.DataType, matrix: np.ndarray, missing: np.ndarray) -> pa.Array:
    """A vector column of ``type_`` over ``matrix`` rows (zero-copy), NULL where ``missing``."""
    n, width = matrix.shape
    values = pa.array(matrix.reshape(-1), type=type_.value_type)
    mask = pa.array(missing) if missing.any() else None
    if pa.types.is_fixed_size_list(type_):
        return pa.FixedSizeListArray.from_arrays(values, width, mask=mask)
    offset_type = np.int64 if pa.types.is_large_list(type_) else np.int32
    offsets = pa.array(np.arange(n + 1, dtype=offset_type) * width)
    return type(pa.array([], type_)).from_arrays(offsets, values, type=type_, mask=mask)


def _column(table: pa.Table, position: int) -> pa.Array:
    return as_array(table.column(position))


class ColumnViews:
    """Per-table cache of :func:`vector_matrix` views: checking that every list of a column
    has one length reads all its offsets (a million-row target block: milliseconds), and a
    block's rows are gathered batch after batch. Holds the tables it has seen."""

    def __init__(self):
        self._views: dict[tuple[int, int], tuple[pa.Table, np.ndarray | None]] = {}

    def matrix(self, table: pa.Table, position: int) -> np.ndarray | None:
        key = (id(table), position)
        hit = self._views.get(key)
        if hit is None or hit[0] is not table:
            hit = (table, vector_matrix(_column(table, position)))
            self._views[key] = hit
        return hit[1]


def gather_rows(sources: list[pa.Table], source: np.ndarray, rows: np.ndarray,
                schema: pa.Schema | None = None, threads: int | None = None,
                views: ColumnViews | None = None, columns=None) -> list[pa.Array]:
    """Columns whose row ``j`` is row ``rows[j]`` of ``sources[source[j]]``; NULL where ``source[j] < 0``.

    All sources have the same column types (names may differ: they are matched by position).
    ``views`` caches the sources' vector views across calls. ``columns``: the positions to
    gather, in that order (default: all).
    """
    views = views or ColumnViews()
    source = np.asarray(source, dtype=np.int64).reshape(-1)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    n = source.shape[0]
    missing = source < 0
    schema = schema or sources[0].schema
    present = [s for s in range(len(sources)) if np.any(source == s)] if len(sources) > 1 else [0]
    picks = {s: np.flatnonzero(source == s) for s in present} if len(sources) > 1 else None
    safe_rows = np.where(missing, 0, rows)
    out = []
    for c in range(len(schema)) if columns is None else columns:
        columns_c = [_column(t, c) for t in sources]
        matrices = [views.matrix(t, c) for t in sources] if n else [None]
        if all(m is not None for m in matrices) and len({(m.shape[1], m.dtype) for m in matrices}) == 1:
            width, dtype = matrices[0].shape[1], matrices[0].dtype
            matrix, buf = pooled_empty((n, width), dtype)
            if len(sources) == 1:
                take_matrix(matrices[0], safe_rows, matrix, threads)
            else:
                take_matrices(matrices, source, safe_rows, matrix, threads)
            array = _vector_array(columns_c[0].type, matrix, missing)
            out.append(array)
            continue
        if len(sources) == 1:
            indices = pa.array(rows, mask=missing) if missing.any() else pa.array(rows)
            out.append(columns_c[0].take(indices))
            continue
        # Several sources: take each source's rows, then put them in slot order.
        parts, order = [], []
        for s in present:
            sel = picks[s]
            parts.append(columns_c[s].take(pa.array(rows[sel])))
            order.append(sel)
        stacked = pa.concat_arrays(parts) if parts else pa.nulls(0, columns_c[0].type)
        position = np.full(n, -1, np.int64)
        if order:
            where = np.concatenate(order)
            position[where] = np.arange(where.size)
        indices = pa.array(position, mask=position < 0)
        out.append(stacked.take(indices))
    return out


def take_rows(table: pa.Table, rows: np.ndarray, threads: int | None = None) -> pa.Table:
    """``table.take(rows)`` with -1 giving a NULL row; vector columns gathered in numpy."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    source = np.where(rows < 0, -1, 0)
    columns = gather_rows([table], source, rows, table.schema, threads)
    return pa.Table.from_arrays(columns, schema=table.schema)
