"""The IVF plan's list columns, computed on the executors (``mapInArrow``).

Each side gets its routing appended as the group column (``C.GROUP``) that the keyed search
reads (``udfs.groups``): a target row its list (nearest centroid, int; NULL when its vector
cannot rank), a query row the ``nprobe`` lists it probes, nearest first (``list<int>``;
empty when its vector cannot rank). Both come from
:func:`nearest_join.kernels.kmeans.route`, the one exact assignment the driver trained and
estimated recall with, so a row's lists are the same wherever they are computed.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

from . import columns as C
from .vectors import decode_vectors


def list_type(nprobe: int | None) -> pa.DataType:
    """The group column's Arrow type: int32 for targets (``nprobe`` None), list<int32> for queries."""
    return pa.int32() if nprobe is None else pa.list_(pa.int32())


def list_column(lists: np.ndarray, probes: bool) -> pa.Array:
    """Arrow column of :func:`route`'s output: the first list (NULL when -1) or, with
    ``probes``, each row's valid lists (all -1 when it cannot rank: an empty list)."""
    if not probes:
        first = lists[:, 0] if lists.shape[1] else np.full(lists.shape[0], -1, np.int64)
        return pa.array(first.astype(np.int32), mask=first < 0, type=pa.int32())
    valid = lists >= 0
    offsets = np.zeros(lists.shape[0] + 1, np.int32)
    np.cumsum(valid.sum(axis=1), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(lists[valid].astype(np.int32)))


def append_lists(batches: Iterable[pa.RecordBatch], *, vector_index: int, dimension: int,
                 centroids: np.ndarray, metric: str, nprobe: int | None, label: str,
                 expected_from: str) -> Iterator[pa.RecordBatch]:
    """Every batch with its rows' lists appended as ``C.GROUP`` (``nprobe`` None: a target
    row's one list; else a query row's ``nprobe`` probed lists)."""
    from nearest_join.kernels.kmeans import route  # numba: on executors only

    from .searcher import task_cpus

    threads = task_cpus()
    for batch in batches:
        vectors = decode_vectors(batch.column(vector_index), dimension, label=label,
                                 expected_from=expected_from)
        if vectors.shape[1] != centroids.shape[1]:   # no element in the batch (all NULL)
            vectors = np.full((vectors.shape[0], centroids.shape[1]), np.nan, vectors.dtype)
        lists = route(vectors, centroids, metric, nprobe or 1, threads=threads)
        column = list_column(lists, probes=nprobe is not None)
        yield pa.RecordBatch.from_arrays(list(batch.columns) + [column],
                                         names=list(batch.schema.names) + [C.GROUP])
