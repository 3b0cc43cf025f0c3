"""An in-process driver of the executor functions: Arrow tables in, joined rows out.

:func:`local_join` cuts, pairs and searches as Spark feeds the functions of ``udfs.packing``
and ``udfs.blocks``, without Spark (tests, the driver's local plan, the incremental join's
searches): the one-task plan's pairs (``broadcast``: blocks held as tables, the same blocks
and ids as packing gives, without the blobs' wire format, which a process searching its own
tables does not need), the blocked plan's (``blocked``: packed), and the plans whose streamed
side reaches the search as rows (``broadcast-streamed``: the query's; ``blocked-streamed``:
the target's, against the broadcast query blocks).
"""
from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from . import columns as C
from .blocks import (merge_partials, search_held_blocks, search_pairs, search_streamed_queries,
                     search_streamed_targets)
from .context import JoinContext, SideLayout, local_task
from .packing import PACKED_SCHEMA, empty_target_block, pack_blocks
from .timing import timed


PAIR_SCHEMA = pa.schema([(C.Q_BLOCK_ID, pa.int64()), (C.Q_BLOB, pa.binary()),
                         (C.T_BLOCK_ID, pa.int64()), (C.T_BLOB, pa.binary())])


def _blocks(packed: pa.Table) -> list[tuple[pa.Array, pa.Array]]:
    """(block id, blob) of each packed block, one-row slices of the table's own arrays (no
    copy of the blob)."""
    return [(batch.column(0).slice(i, 1), batch.column(1).slice(i, 1))
            for batch in packed.to_batches() for i in range(batch.num_rows)]


def held_blocks(rows: pa.Table, layout: SideLayout, partition: int) -> list[tuple[int, pa.Table]]:
    """(block id, rows) of one partition's ``rows``, cut as :func:`udfs.packing.pack_blocks`
    cuts them and with its ids, each block a view of one contiguous copy of the rows."""
    rows = rows.combine_chunks()
    starts = range(0, rows.num_rows, layout.block_rows)
    if len(starts) > 1 << C.SEQUENCE_BITS:
        raise ValueError("too many blocks in one partition: raise the block size")
    return [((partition << C.SEQUENCE_BITS) | sequence, rows.slice(start, layout.block_rows))
            for sequence, start in enumerate(starts)]


def pair_batches(q_packed: pa.Table, t_packed: pa.Table, rows_once: bool = True) -> Iterator[pa.RecordBatch]:
    """Every (query block, target block) pair, one batch each, grouped by query block.
    ``rows_once`` (the broadcast plan): only a query block's first pair carries its rows, the
    others a NULL ``q_blob``; else (the blocked plan's cartesian product) every pair does."""
    no_rows = pa.nulls(1, pa.binary())
    targets = _blocks(t_packed)
    for q_id, q_blob in _blocks(q_packed):
        for ti, (t_id, t_blob) in enumerate(targets):
            rows = q_blob if ti == 0 or not rows_once else no_rows
            yield pa.RecordBatch.from_arrays([q_id, rows, t_id, t_blob], schema=PAIR_SCHEMA)


def streamed_batches(rows: pa.Table, broadcast: pa.Table, max_rows: int = 1000) -> Iterator[pa.RecordBatch]:
    """One task's input of a streamed plan (``nearest_join.join._first_row_meets``): the side's
    ``rows`` with two more columns, the first row once per ``broadcast`` block (id, blob), the
    others once with NULLs, in batches of at most ``max_rows`` rows."""
    n = rows.num_rows
    if n == 0:
        return
    first = np.zeros(max(1, broadcast.num_rows), np.int64)
    taken = rows.take(np.concatenate([first, np.arange(1, n)]))
    nulls = n - 1
    ids = pa.concat_arrays([broadcast.column(0).combine_chunks() if broadcast.num_rows else pa.nulls(1, pa.int64()),
                            pa.nulls(nulls, pa.int64())])
    blobs = pa.concat_arrays([broadcast.column(1).combine_chunks() if broadcast.num_rows else pa.nulls(1, pa.binary()),
                              pa.nulls(nulls, pa.binary())])
    table = taken.append_column("__id", ids).append_column("__blob", blobs)
    yield from table.to_batches(max_chunksize=max_rows)


def local_join(query: pa.Table, target: pa.Table, ctx: JoinContext, plan: str = "broadcast",
               partitions: int = 1, *, gpu: str | None = None, task_scope: str | None = None) -> pa.Table:
    """Run the executor functions in-process on Arrow tables, as Spark would feed them.

    ``partitions`` splits each side into that many packing tasks. ``gpu`` / ``task_scope``:
    what a task context would tell the GPU searcher (its GPU address, the stage whose
    broadcast blocks it may keep; :func:`udfs.context.local_task`). Returns the joined rows with
    the positional output names.
    """
    with local_task(gpu, task_scope):
        return _local_join(query, target, ctx, plan, partitions)


def _local_join(query: pa.Table, target: pa.Table, ctx: JoinContext, plan: str, partitions: int) -> pa.Table:
    def parts(table: pa.Table) -> list[pa.Table]:
        bounds = np.linspace(0, table.num_rows, partitions + 1).astype(int)
        return [table.slice(bounds[p], bounds[p + 1] - bounds[p]) for p in range(partitions)]

    def pack(table: pa.Table, layout: SideLayout) -> pa.Table:
        out = []
        for p, part in enumerate(parts(table)):
            with timed(ctx.timings, "pack"):
                out.extend(pack_blocks(part.to_batches(max_chunksize=1000), layout, partition=p))
        return pa.Table.from_batches(out, schema=PACKED_SCHEMA)

    def merged(partial: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
        groups: dict[int, list[pa.RecordBatch]] = {}
        for b in partial:
            groups.setdefault(b.column(0)[0].as_py(), []).append(b)
        return [b for key, bs in groups.items() for b in merge_partials((key,), bs, ctx)]

    empty = pa.Table.from_batches([empty_target_block()])

    def t_packed() -> pa.Table:   # the empty block first, as the plans broadcast it
        return pa.concat_tables([empty, pack(target, ctx.target)])

    if plan == "broadcast-streamed":
        out, targets = [], t_packed()
        for p, part in enumerate(parts(query)):
            out.extend(search_streamed_queries(streamed_batches(part, targets), ctx, width=query.num_columns,
                                               pack=functools.partial(pack_blocks, layout=ctx.query, partition=p)))
    elif plan == "blocked-streamed":
        q_packed = pack(query, ctx.query)
        partial = list(search_pairs(pair_batches(q_packed, empty), ctx))
        for p, part in enumerate(parts(target)):
            partial.extend(search_streamed_targets(
                streamed_batches(part, q_packed), ctx, width=target.num_columns,
                pack=functools.partial(pack_blocks, layout=ctx.target, partition=p)))
        out = merged(partial)
    elif plan == "broadcast":
        with timed(ctx.timings, "pack"):
            q_blocks, t_blocks = ([block for p, part in enumerate(parts(table)) for block in held_blocks(part, layout, p)]
                                  for table, layout in ((query, ctx.query), (target, ctx.target)))
        # the empty target block first, as the plans broadcast it (its rows are never read)
        out = list(search_held_blocks(q_blocks, [(C.EMPTY_BLOCK_ID, pa.table({}))] + t_blocks, ctx))
    elif plan == "blocked":
        out = merged(list(search_pairs(pair_batches(pack(query, ctx.query), t_packed(), rows_once=False), ctx)))
    else:
        raise ValueError(f"plan: expected 'broadcast', 'blocked', 'broadcast-streamed' or 'blocked-streamed', "
                         f"got {plan!r}")
    if not out:
        return None
    return pa.Table.from_batches(out)
