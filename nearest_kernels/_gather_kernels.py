"""Numba kernels of :mod:`nearest_kernels.gather`: row copies and the payload bookkeeping
of a shipped top-k state. Import this module only through ``gather``, which points numba's cache
at a writable directory before numba is imported.
"""
from __future__ import annotations

import numpy as np
from ._numba import import_numba

import_numba()
from numba import njit  # noqa: E402


@njit(nogil=True, cache=True)
def take_rows_at(lo, hi, matrix, rows, positions, out):
    """``out[positions[i]] = matrix[rows[i]]`` for ``i`` in ``lo..hi``: one source's rows into
    their slots of an output that several sources fill (no gathered temporary, GIL released);
    ``gather.take_rows`` with positions 0, 1, ... A plain copy loop: about twice ``np.take``'s
    rate for 128-float rows, whose per-row item copies do not vectorise."""
    width = matrix.shape[1]
    for i in range(lo, hi):
        r = rows[i]
        p = positions[i]
        for j in range(width):
            out[p, j] = matrix[r, j]


# Payload bookkeeping of a shipped state (``udfs.merge.TopkState.to_blob``).
@njit(nogil=True, cache=True)
def distinct_rows(source, rows, base, payload_row):
    """The distinct (source, row) pairs the slots refer to, in (source, row) order:
    returns (their sources, their rows, the number of slots whose source or row is out of
    range: nothing else is valid then); ``payload_row[i]`` gets slot i's position among
    them (-1 for an empty slot, ``source < 0``). Sources' rows are laid end to end at
    ``base`` (``base[-1]`` rows in all): one marking pass, one prefix pass, one lookup."""
    n_sources = base.shape[0] - 1
    total = base[n_sources]
    position = np.zeros(total, np.int32)          # 1 + position of a used code, 0 unused
    bad = 0
    for i in range(source.shape[0]):
        s = source[i]
        if s >= 0:
            if s >= n_sources or rows[i] < 0 or rows[i] >= base[s + 1] - base[s]:
                bad += 1
            else:
                position[base[s] + rows[i]] = 1
    if bad:
        return np.empty(0, np.int64), np.empty(0, np.int64), bad
    count = 0
    for c in range(total):
        if position[c]:
            count += 1
            position[c] = count
    out_source = np.empty(count, np.int64)
    out_row = np.empty(count, np.int64)
    s = 0
    for c in range(total):
        p = position[c]
        if p:
            while c >= base[s + 1]:
                s += 1
            out_source[p - 1] = s
            out_row[p - 1] = c - base[s]
    for i in range(source.shape[0]):
        s = source[i]
        payload_row[i] = position[base[s] + rows[i]] - 1 if s >= 0 else -1
    return out_source, out_row, 0
