"""Spark's ``xxhash64`` of a vector column, computed from the column's Arrow buffers.

The incremental join fingerprints each row by two of Spark's 64-bit hashes,
``xxhash64(vector)`` and ``xxhash64("nearest_join", vector)``. Where its refresh collects the
vectors anyway (to search them in the driver) it computes the same two values here, from the
collected rows, instead of in the JVM, where the hash costs a pass over every element: the
fingerprints of a state are the same whichever side computed them.

Spark's ``XxHash64`` (``org.apache.spark.sql.catalyst.expressions.XXH64`` and
``HashExpression``): a running 64-bit hash, starting from the seed 42, folded over the
expression's values in order; a NULL value leaves it as it is. A string folds in as the
XXH64 of its UTF-8 bytes; an array as each of its elements in order (a NULL element leaves
it as it is); a float as ``hashInt`` of its bits (``Float.floatToIntBits``: every NaN one bit
pattern; -0.0 as 0.0), a double as ``hashLong`` of its bits (likewise). The arithmetic is
unsigned 64-bit and wraps; Spark's long is the same bits read as signed.
"""
from __future__ import annotations

import numpy as np

from ._numba import frozen, import_numba

import_numba()
from numba import njit  # noqa: E402

SEED = 42   # Spark's xxhash64 seed

_P1, _P2, _P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P4, _P5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
_MASK = (1 << 64) - 1
P1, P2, P3, P4, P5 = (np.uint64(p) for p in (_P1, _P2, _P3, _P4, _P5))


def _rotl_int(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK


def _fmix_int(h: int) -> int:
    h ^= h >> 33
    h = (h * _P2) & _MASK
    h ^= h >> 29
    h = (h * _P3) & _MASK
    return h ^ (h >> 32)


def xxhash64_bytes(data: bytes, seed: int) -> int:
    """XXH64 of ``data`` (Spark's ``hashUnsafeBytes``: a string's hash), as an unsigned int."""
    n, i = len(data), 0
    if n >= 32:
        v = [(seed + _P1 + _P2) & _MASK, (seed + _P2) & _MASK, seed & _MASK, (seed - _P1) & _MASK]
        while i + 32 <= n:
            for j in range(4):
                word = int.from_bytes(data[i + 8 * j: i + 8 * j + 8], "little")
                v[j] = (_rotl_int((v[j] + word * _P2) & _MASK, 31) * _P1) & _MASK
            i += 32
        h = (_rotl_int(v[0], 1) + _rotl_int(v[1], 7) + _rotl_int(v[2], 12) + _rotl_int(v[3], 18)) & _MASK
        for lane in v:
            h ^= (_rotl_int((lane * _P2) & _MASK, 31) * _P1) & _MASK
            h = (h * _P1 + _P4) & _MASK
    else:
        h = (seed + _P5) & _MASK
    h = (h + n) & _MASK
    while i + 8 <= n:
        k = (_rotl_int((int.from_bytes(data[i:i + 8], "little") * _P2) & _MASK, 31) * _P1) & _MASK
        h = (_rotl_int(h ^ k, 27) * _P1 + _P4) & _MASK
        i += 8
    if i + 4 <= n:
        h = (_rotl_int(h ^ ((int.from_bytes(data[i:i + 4], "little") * _P1) & _MASK), 23) * _P2 + _P3) & _MASK
        i += 4
    while i < n:
        h = (_rotl_int(h ^ ((data[i] * _P5) & _MASK), 11) * _P1) & _MASK
        i += 1
    return _fmix_int(h)


@njit(inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(inline="always")
def _fmix(h):
    h ^= h >> np.uint64(33)
    h *= P2
    h ^= h >> np.uint64(29)
    h *= P3
    h ^= h >> np.uint64(32)
    return h


@njit(nogil=True, cache=True)
def _fold_float32(offsets, bits, element_valid, row_valid, seed, out):
    """``out[r]``: the hash of row ``r`` (elements ``bits[offsets[r]:offsets[r+1]]``, float32
    bits) folded into ``seed``; a row that is not valid keeps the seed."""
    canonical_nan = np.uint32(0x7FC00000)
    for r in range(out.shape[0]):
        h = seed
        if row_valid[r]:
            for i in range(offsets[r], offsets[r + 1]):
                if element_valid.shape[0] and not element_valid[i]:
                    continue
                word = bits[i]
                if word == np.uint32(0x80000000):      # -0.0 hashes as 0.0
                    word = np.uint32(0)
                elif (word & np.uint32(0x7F800000)) == np.uint32(0x7F800000) and (word & np.uint32(0x007FFFFF)):
                    word = canonical_nan
                h = h + P5 + np.uint64(4)
                h ^= np.uint64(word) * P1
                h = _rotl(h, 23) * P2 + P3
                h = _fmix(h)
        out[r] = h


@njit(nogil=True, cache=True)
def _fold_float64(offsets, bits, element_valid, row_valid, seed, out):
    """:func:`_fold_float32` of float64 bits (``hashLong``)."""
    exponent, fraction = np.uint64(0x7FF0000000000000), np.uint64(0x000FFFFFFFFFFFFF)
    for r in range(out.shape[0]):
        h = seed
        if row_valid[r]:
            for i in range(offsets[r], offsets[r + 1]):
                if element_valid.shape[0] and not element_valid[i]:
                    continue
                word = bits[i]
                if word == np.uint64(0x8000000000000000):
                    word = np.uint64(0)
                elif (word & exponent) == exponent and (word & fraction):
                    word = np.uint64(0x7FF8000000000000)
                h = h + P5 + np.uint64(8)
                h ^= _rotl(word * P2, 31) * P1
                h = _rotl(h, 27) * P1 + P4
                h = _fmix(h)
        out[r] = h


def spark_xxhash64(offsets: np.ndarray, values: np.ndarray, element_valid: np.ndarray | None,
                   row_valid: np.ndarray, seed: int) -> np.ndarray:
    """Spark's running ``xxhash64`` of each row of a float32 or float64 list column, folded
    into ``seed`` (the hash of the expression's values before the vector: :data:`SEED` when the
    vector is the first), as int64 (Spark's long).

    ``offsets``: the rows' ``len + 1`` offsets into ``values`` (the elements, float32 or
    float64); ``element_valid``: per element, False for a NULL element (None: none is NULL);
    ``row_valid``: per row, False for a NULL vector.
    """
    width = np.dtype(values.dtype).itemsize
    if width not in (4, 8) or values.dtype.kind != "f":
        raise TypeError(f"expected float32 or float64 elements, got {values.dtype}")
    fold = _fold_float32 if width == 4 else _fold_float64
    out = np.empty(len(row_valid), np.uint64)
    valid = np.zeros(0, bool) if element_valid is None else np.asarray(element_valid, bool)
    fold(*frozen(np.asarray(offsets, np.int64), values.view(np.uint32 if width == 4 else np.uint64), valid,
                 np.asarray(row_valid, bool)), np.uint64(seed & _MASK), out)
    return out.view(np.int64)
