"""Arrow out: the joined output rows of one query block, as the record batches Spark receives.

A row is the query row's columns, its target's columns (NULL for LEFT OUTER's unmatched
rows), [the distance], [a mark on each query row's best match]; the payload rows are gathered
from the query block and from the top-k state's payload tables (``udfs.payload``).
Batches are built ahead on helper threads, so building the next batch overlaps whatever the
consumer does with the current one (Spark: writing it to the JVM).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from . import columns as C
from .payload import ColumnViews, gather_rows, gather_threads
from .timing import timed

if TYPE_CHECKING:
    from .context import JoinContext
    from .merge import TopkState

# Output batches are cut to about this many rows.
OUTPUT_BATCH_ROWS = 1 << 16
# Output batches built ahead of the one the consumer holds (each ~70 MB with two 128-float
# vector columns): bounds the memory this overlap costs.
EMIT_AHEAD = 2


def emit_rows(query_table: pa.Table, state: TopkState | None, ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """Joined rows of one query block: query columns, target columns, [distance].

    INNER keeps the filled slots; LEFT OUTER also keeps one row with NULL target columns
    for a query row without any candidate. Batches are built up to ``EMIT_AHEAD`` ahead on
    helper threads (gathers and Arrow kernels release the GIL), so building batch j+1
    overlaps whatever the consumer does with batch j (Spark: writing it to the JVM) and the
    serial index work of one batch overlaps the gathers of the next.
    """
    nq, k = query_table.num_rows, ctx.k
    if state is None:
        keys = np.full((nq, k), -1, np.int64)
        values = np.zeros((nq, k), np.float32)
    else:
        keys, values = state.keys, state.values
    keep = keys >= 0
    if ctx.join_type == "leftouter":
        keep[:, 0] |= ~keep.any(axis=1)
    flat = np.flatnonzero(keep.reshape(-1))
    query_views = ColumnViews()
    if state is not None:
        state.views()                  # made once here, not raced for by the helper threads
    parts = [flat[start: start + OUTPUT_BATCH_ROWS] for start in range(0, flat.size, OUTPUT_BATCH_ROWS)]

    def build(part: np.ndarray) -> pa.RecordBatch:
        with timed(ctx.timings, "encode"):
            return _build(part)

    def _build(part: np.ndarray) -> pa.RecordBatch:
        filled = keys.reshape(-1)[part] >= 0
        q_rows = part // k
        arrays = gather_rows([query_table], np.zeros_like(q_rows), q_rows, views=query_views,
                             columns=ctx.query_columns)
        if state is None:
            targets = range(len(ctx.target_schema)) if ctx.target_columns is None else ctx.target_columns
            arrays += [pa.nulls(part.size, ctx.target_schema.field(c).type) for c in targets]
        else:
            arrays += state.gather(part, ctx.target_columns)
        if ctx.with_distance:
            arrays.append(pa.array(values.reshape(-1)[part], pa.float32(),
                                   mask=None if filled.all() else ~filled))
        if ctx.mark_first:   # slots are best first: a query's best match is its slot 0
            arrays.append(pa.array((filled & (part % k == 0)).astype(np.int8), pa.int8()))
        return pa.RecordBatch.from_arrays(arrays, names=[C.output_name(i) for i in range(len(arrays))])

    if len(parts) <= 1 or gather_threads() <= 1:
        for part in parts:
            yield build(part)
        return
    pending: deque[Future] = deque()
    try:
        for part in parts:
            pending.append(_emit_pool().submit(build, part))
            if len(pending) > EMIT_AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:         # the consumer stopped early: drop what is queued
            future.cancel()


_EMIT_POOL: ThreadPoolExecutor | None = None


def _emit_pool() -> ThreadPoolExecutor:
    """Helper threads that build output batches (not the gather pool: a build waits on it)."""
    global _EMIT_POOL
    if _EMIT_POOL is None:
        _EMIT_POOL = ThreadPoolExecutor(EMIT_AHEAD + 1, thread_name_prefix="nj-emit")
    return _EMIT_POOL
