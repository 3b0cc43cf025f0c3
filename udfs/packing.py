"""Packed blocks: a side's rows cut into blocks, each one Arrow IPC blob.

``pack_blocks`` (a ``mapInArrow`` function) turns a partition's user rows into blocks of at
most ``block_rows`` rows; each block becomes one row ``(block_id, blob)`` where ``blob`` is an
Arrow IPC stream holding the block's rows with *all* their columns. Payload columns
therefore travel with the vectors: the output never re-reads the source, so a
non-deterministic source (a union, a repartition) cannot change row identities between the
search and the output. Also here: the writing half of the Arrow codec of blobs and binary
columns (its reading half is ``udfs.decode``), shared by the plans (``udfs.blocks``) and the
top-k wire format (``udfs.merge``).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

from . import columns as C
from .context import SideLayout, task_partition
from .decode import decode_vectors

PACKED_SCHEMA = pa.schema([(C.BLOCK_ID, pa.int64()), (C.BLOB, pa.binary())])


def write_stream(sink, table: pa.Table) -> None:
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def table_to_blob(table: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    write_stream(sink, table)
    return sink.getvalue()


def binary_array(buffers: list[pa.Buffer]) -> pa.Array:
    """A binary column over existing buffers: one concatenation, no Python bytes copies."""
    sizes = np.array([b.size for b in buffers], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    if offsets[-1] >= 1 << 31:
        raise ValueError("a packed block exceeds 2 GiB: lower the block size")
    data = buffers[0] if len(buffers) == 1 else pa.py_buffer(b"".join(memoryview(b) for b in buffers))
    return pa.Array.from_buffers(pa.binary(), len(buffers),
                                 [None, pa.py_buffer(offsets.astype(np.int32)), data])


def check_dimensions(batch: pa.RecordBatch, layout: SideLayout) -> None:
    """Fail on a ragged row before anything is written (decode validates lengths)."""
    decode_vectors(batch.column(layout.vector_index), layout.dimension, label=layout.label,
                   expected_from=layout.expected_from)


def pack_blocks(batches: Iterable[pa.RecordBatch], layout: SideLayout,
                partition: int | None = None) -> Iterator[pa.RecordBatch]:
    """mapInArrow function: user rows -> one ``(block_id, blob)`` row per block.

    Every incoming batch is checked for ragged vectors first, so a bad row fails the job
    before any output exists.
    """
    partition = task_partition() if partition is None else partition
    if partition >= 1 << C.PARTITION_BITS:
        raise ValueError(f"partition {partition} exceeds the {1 << C.PARTITION_BITS} partitions a join supports")
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    sequence = 0

    def emit(table: pa.Table) -> pa.RecordBatch:
        nonlocal sequence
        if sequence >= 1 << C.SEQUENCE_BITS:
            raise ValueError("too many blocks in one partition: raise the block size")
        block_id = (partition << C.SEQUENCE_BITS) | sequence
        sequence += 1
        # One record batch per block: readers then get single-chunk columns, which decode
        # and gather as zero-copy views instead of being concatenated on every use.
        return pa.RecordBatch.from_arrays(
            [pa.array([block_id], pa.int64()), binary_array([table_to_blob(table.combine_chunks())])],
            schema=PACKED_SCHEMA,
        )

    for batch in batches:
        if batch.num_rows == 0:
            continue
        check_dimensions(batch, layout)
        pending.append(batch)
        pending_rows += batch.num_rows
        while pending_rows >= layout.block_rows:
            table = pa.Table.from_batches(pending)
            yield emit(table.slice(0, layout.block_rows))
            rest = table.slice(layout.block_rows)
            pending = rest.to_batches()
            pending_rows = rest.num_rows
    if pending_rows:
        yield emit(pa.Table.from_batches(pending))


def empty_target_block() -> pa.RecordBatch:
    """The always-present empty target block: every query block meets at least one block."""
    return pa.RecordBatch.from_arrays(
        [pa.array([C.EMPTY_BLOCK_ID], pa.int64()), pa.array([b""], pa.binary())],
        schema=PACKED_SCHEMA,
    )
