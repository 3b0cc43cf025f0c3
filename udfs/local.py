"""An in-process driver of the executor functions: Arrow tables in, joined rows out.

:func:`local_join` packs, pairs and searches exactly as Spark feeds the functions of
``udfs.packing`` and ``udfs.blocks``, without Spark (tests, GPU benchmarks).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from . import columns as C
from .blocks import merge_partials, search_broadcast, search_pairs
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
    def pack(table: pa.Table, layout: SideLayout) -> pa.Table:
        out = []
        bounds = np.linspace(0, table.num_rows, partitions + 1).astype(int)
        for p in range(partitions):
            part = table.slice(bounds[p], bounds[p + 1] - bounds[p])
            with timed(ctx.timings, "pack"):
                out.extend(pack_blocks(part.to_batches(max_chunksize=1000), layout, partition=p))
        return pa.Table.from_batches(out, schema=PACKED_SCHEMA)

    q_packed = pack(query, ctx.query)
    t_packed = pa.concat_tables([pa.Table.from_batches([empty_target_block()]),
                                 pack(target, ctx.target)])
    if plan == "broadcast":
        out = list(search_broadcast(pair_batches(q_packed, t_packed), ctx))
    elif plan == "blocked":
        partial = list(search_pairs(pair_batches(q_packed, t_packed, rows_once=False), ctx))
        groups: dict[int, list[pa.RecordBatch]] = {}
        for b in partial:
            groups.setdefault(b.column(0)[0].as_py(), []).append(b)
        out = [b for key, bs in groups.items() for b in merge_partials((key,), bs, ctx)]
    else:
        raise ValueError(f"plan: expected 'broadcast' or 'blocked', got {plan!r}")
    if not out:
        return None
    return pa.Table.from_batches(out)
