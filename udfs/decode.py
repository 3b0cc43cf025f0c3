"""Arrow in: the blobs and columns a task receives, decoded into tables and numpy arrays.

The first step of every plan's search: a packed block's blob becomes its rows
(:func:`blob_to_table`), its vector column a dense matrix (:func:`decode_vectors`) and, for
a keyed side, its group column int64 group ids or the IVF probes of each row
(:func:`group_ids`); :func:`decode_block` does all three. Binary columns of blobs (the pairs,
the partials) are read as zero-copy buffers (:func:`binary_values`).

Vector columns are read as Spark's vector functions see them. Accepted Arrow layouts (what
Spark sends for the supported column types): ``list<float>`` / ``list<double>``
(``array<float>`` / ``array<double>``, also large and fixed-size lists) and the struct behind
pyspark.ml's ``VectorUDT`` (``type`` 1 = dense ``values``; 0 = sparse
``size``/``indices``/``values``). A NULL vector or a NULL element becomes NaN, which the
kernels treat as "never matches".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .context import SideLayout


class VectorDimensionError(ValueError):
    """A vector whose length differs from the join's dimension (Spark: VECTOR_DIMENSION_MISMATCH)."""


class VectorRangeError(ValueError):
    """A float64 element other than 0 smaller than :data:`SMALLEST_FLOAT64` in magnitude."""


# The smallest magnitude a float64 element other than 0 may have. The kernels shift each
# block of rows and scale it by one power of two, and (cosine) scale each row by its inverse
# norm, both float64: rows that differ only in smaller elements would need a scale beyond
# float64's range, and the searches would lose such rows or fail. float32 elements never
# come near it.
SMALLEST_FLOAT64 = 2.0 ** -960
_CHECKED_ELEMENTS = 1 << 15   # elements per step of that check


def as_array(column) -> pa.Array:
    """``column`` as one Arrow array: a ChunkedArray's chunks combined (its only chunk as is)."""
    if isinstance(column, pa.ChunkedArray):
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column


def value_offsets(array: pa.Array) -> np.ndarray:
    """The ``len(array) + 1`` value offsets of a binary, string or list column (the slice's
    own, zero-copy), 32- or 64-bit as the type says.

    ``spark.sql.execution.arrow.useLargeVarTypes`` makes Spark send ``large_binary`` /
    ``large_string`` (the packed blobs too), and ``large_list`` has 64-bit offsets as well:
    read as 32-bit, each offset becomes two wrong ones.
    """
    t = array.type
    if pa.types.is_large_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_list(t):
        dtype = np.int64
    elif pa.types.is_binary(t) or pa.types.is_string(t) or pa.types.is_list(t):
        dtype = np.int32
    else:
        raise TypeError(f"expected a binary, string or list column, got {t}")
    n = len(array)
    buffer = array.buffers()[1]
    if n == 0 and (buffer is None or buffer.size == 0):
        return np.zeros(1, dtype)      # IPC may ship an empty column without its one offset
    return np.frombuffer(buffer, dtype=dtype)[array.offset: array.offset + n + 1]


def blob_to_table(blob) -> pa.Table:
    """The table of an Arrow IPC stream blob (a packed block, a partial's part)."""
    return pa.ipc.open_stream(blob).read_all()


def binary_values(array: pa.Array) -> list[pa.Buffer]:
    """Zero-copy buffers of every value of a binary column."""
    array = array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array
    offsets = value_offsets(array)     # large_binary under useLargeVarTypes
    data = array.buffers()[2]
    if data is None:
        return [pa.py_buffer(b"")] * len(array)
    return [data.slice(int(offsets[i]), int(offsets[i + 1] - offsets[i])) for i in range(len(array))]


def vector_dtype(arrow_type: pa.DataType) -> np.dtype:
    """numpy dtype of the decoded matrix: float32 for float elements, float64 otherwise."""
    if pa.types.is_struct(arrow_type):
        return np.dtype(np.float64)
    value_type = arrow_type.value_type
    return np.dtype(np.float32) if pa.types.is_float32(value_type) else np.dtype(np.float64)


def _mismatch(column: str, found: int, expected: int, expected_from: str) -> VectorDimensionError:
    return VectorDimensionError(
        f"[VECTOR_DIMENSION_MISMATCH] Vectors must have the same dimension, but column "
        f"`{column}` has a vector of dimension {found} and {expected_from} has dimension {expected}."
    )


def _check_lengths(present: np.ndarray, dimension: int | None, label: str, expected_from: str) -> int:
    """The dimension every non-NULL vector must have (the first one's when None, 0 when there
    is none); raise on a ragged row."""
    if dimension is None:
        dimension = int(present[0]) if present.size else 0
        expected_from = f"the first vector of `{label}`"
    bad = np.flatnonzero(present != dimension)
    if bad.size:
        raise _mismatch(label, int(present[bad[0]]), dimension, expected_from)
    return dimension


def decode_vectors(column, dimension: int | None, *, label: str = "vector",
                   expected_from: str = "the other side") -> np.ndarray:
    """Decode one Arrow vector column into an (n, dimension) float matrix, NaN on NULL rows.

    A column with no element at all (every vector NULL, or every one of length 0) decodes to
    one column: see :func:`_without_elements`.

    Parameters
    ----------
    column : pyarrow Array or ChunkedArray
    dimension : int or None
        Expected length of every non-NULL vector; None takes the first non-NULL vector's.
    label : str
        The user's column name, for errors.
    expected_from : str
        Where ``dimension`` came from, for errors (e.g. "target column `w`").

    Raises
    ------
    VectorDimensionError
        A non-NULL vector of another length (a ragged row).
    VectorRangeError
        A float64 element other than 0 below :data:`SMALLEST_FLOAT64` in magnitude.
    """
    vectors = _decoded(as_array(column), dimension, label, expected_from)
    if vectors.dtype == np.float64:
        _refuse_tiny(vectors, label)
    return vectors


def _refuse_tiny(vectors: np.ndarray, label: str) -> None:
    """Raise :class:`VectorRangeError` on a float64 element other than 0 whose magnitude is
    below :data:`SMALLEST_FLOAT64` (NaN, a NULL's mark, is not one)."""
    flat = vectors.reshape(-1)
    magnitudes = np.empty(min(flat.size, _CHECKED_ELEMENTS))
    for start in range(0, flat.size, _CHECKED_ELEMENTS):   # a chunk's temporaries stay in cache
        part = flat[start:start + _CHECKED_ELEMENTS]
        small = np.abs(part, out=magnitudes[:part.size]) < SMALLEST_FLOAT64
        found = part[small & (part != 0)] if small.any() else ()
        if len(found):
            raise VectorRangeError(
                f"[VECTOR_ELEMENT_OUT_OF_RANGE] column `{label}` holds the float64 element {float(found[0])!r}: "
                f"expected 0 or a magnitude of at least 2^-960 (about {SMALLEST_FLOAT64:.1e}); round such "
                f"elements to 0 or cast the column to array<float>")


def _decoded(arr: pa.Array, dimension: int | None, label: str, expected_from: str) -> np.ndarray:
    """:func:`decode_vectors` without its range check."""
    n = len(arr)
    if pa.types.is_struct(arr.type):
        return _decode_ml_vectors(arr, dimension, label, expected_from)
    dtype = vector_dtype(arr.type)
    if arr.null_count == 0 and (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        return _decode_dense_lists(arr, dimension, label, expected_from, dtype)
    if pa.types.is_fixed_size_list(arr.type):
        lengths = np.full(n, arr.type.list_size, dtype=np.int64)
    else:
        lengths = pc.list_value_length(arr).fill_null(-1).to_numpy(zero_copy_only=False)
    valid = lengths >= 0
    if not pa.types.is_fixed_size_list(arr.type) and arr.null_count:
        valid &= arr.is_valid().to_numpy(zero_copy_only=False)
    dimension = _check_lengths(lengths[valid], dimension, label, expected_from)
    if dimension == 0:
        return _without_elements(valid, dtype)
    flat = arr.flatten()  # honours slicing and skips NULL lists
    if flat.null_count:
        flat = flat.fill_null(np.nan)
    values = flat.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    if valid.all():
        return values.reshape(n, dimension)
    out = np.full((n, dimension), np.nan, dtype=dtype)
    out[valid] = values.reshape(-1, dimension)
    return out


def _without_elements(valid: np.ndarray, dtype) -> np.ndarray:
    """Vectors of dimension 0, or a column whose vectors are all NULL (no dimension to know:
    0 then), as one zero column with NaN on the NULL rows.

    A width-0 matrix cannot mark a NULL row (NaN: never a candidate), and would make every
    NULL row a match at distance 0. The zero coordinate changes no value: l2 and the inner
    product of empty vectors stay 0, and cosine sees a zero vector, NULL similarity: what
    Spark's vector functions give for ``[]``. Both sides decode this way when the join's
    dimension is 0 or unknown, so their widths agree.
    """
    out = np.zeros((valid.shape[0], 1), dtype=dtype)
    out[~valid] = np.nan
    return out


def _decode_dense_lists(arr, dimension, label: str, expected_from: str, dtype) -> np.ndarray:
    """A list column without NULL lists (the common case): lengths from the offsets in one
    pass, values as a zero-copy view. The general path's length array, NULL fill and boolean
    selections cost 3-10 ms per 10^6 rows, paid before a broadcast task's first search."""
    n = len(arr)
    lengths = np.diff(value_offsets(arr))
    dimension = _check_lengths(lengths, dimension, label, expected_from)
    if dimension == 0:
        return _without_elements(np.ones(n, bool), dtype)
    flat = arr.flatten()
    if flat.null_count:
        flat = flat.fill_null(np.nan)
    return flat.to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(n, dimension)


def _decode_ml_vectors(arr: pa.StructArray, dimension, label, expected_from) -> np.ndarray:
    n = len(arr)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    kinds = arr.field("type").fill_null(-1).to_numpy(zero_copy_only=False)
    sizes = arr.field("size").fill_null(-1).to_numpy(zero_copy_only=False)
    values = arr.field("values")
    value_lengths = pc.list_value_length(values).fill_null(0).to_numpy(zero_copy_only=False)
    lengths = np.where(kinds == 1, value_lengths, sizes)
    dimension = _check_lengths(lengths[valid], dimension, label, expected_from)
    if dimension == 0:
        return _without_elements(valid, np.float64)
    out = np.full((n, dimension), np.nan, dtype=np.float64)
    rows = np.flatnonzero(valid)
    if rows.size == 0:
        return out
    flat_values = values.flatten().to_numpy(zero_copy_only=False)
    offsets = value_offsets(values)[: n + 1]
    offsets = offsets - offsets[0]  # flatten() is relative to the slice
    dense = rows[kinds[rows] == 1]
    for row in dense:  # row-wise: dense ml vectors are rare at scale; keeps the logic obvious
        out[row] = flat_values[offsets[row]: offsets[row + 1]]
    sparse = rows[kinds[rows] == 0]
    if sparse.size:
        indices = arr.field("indices")
        flat_idx = indices.flatten().to_numpy(zero_copy_only=False)
        idx_off = value_offsets(indices)[: n + 1]
        idx_off = idx_off - idx_off[0]
        for row in sparse:
            out[row] = 0.0
            out[row, flat_idx[idx_off[row]: idx_off[row + 1]]] = flat_values[offsets[row]: offsets[row + 1]]
    return out


# -- group columns -------------------------------------------------------------------------------

NO_GROUP = -1


@dataclass(frozen=True)
class Probes:
    """Each row's groups, CSR: row ``i`` is in ``groups[starts[i]:starts[i + 1]]`` (distinct).

    The IVF plan's query rows (``nearest_join.ivf``): a row carries the ``nprobe`` lists it
    probes as an Arrow ``list<int>`` column, and is searched against all of them at once
    (``udfs.search.probed_search``).
    """

    starts: np.ndarray   # int64 (rows + 1,)
    groups: np.ndarray   # int64

    @property
    def rows(self) -> int:
        return self.starts.shape[0] - 1

    @classmethod
    def of_arrow(cls, array: pa.Array) -> Probes:
        """A ``list<int>`` column; a NULL list (or a NULL item) probes nothing."""
        lengths = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False)
        starts = np.zeros(len(array) + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        groups = pc.list_flatten(array).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        return cls(starts, groups)


def group_ids(column: pa.ChunkedArray | pa.Array):
    """int64 group ids of an Arrow column; NULL (no group) reads ``NO_GROUP``. A ``list<int>``
    column (the IVF plan's probed lists: several groups per row) reads as :class:`Probes`,
    which :func:`udfs.search.grouped_search` takes in place of the ids."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        return Probes.of_arrow(array)
    return array.fill_null(NO_GROUP).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


# -- packed blocks -------------------------------------------------------------------------------

def decode_block(blob, side: SideLayout) -> tuple[pa.Table, np.ndarray, np.ndarray | Probes | None]:
    """(rows, vectors, group ids or None) of a packed block of ``side`` (or of its rows as a
    table, a block this process holds: ``udfs.blocks.search_held_blocks``): a keyed side's
    group id column is dropped from the rows (the output has the user's columns only)."""
    table = blob if isinstance(blob, pa.Table) else blob_to_table(blob)
    groups = None
    if side.group_index is not None:
        groups = group_ids(table.column(side.group_index))
        table = table.remove_column(side.group_index)
    vectors = decode_vectors(table.column(side.vector_index), side.dimension, label=side.label,
                             expected_from=side.expected_from)
    return table, vectors, groups
