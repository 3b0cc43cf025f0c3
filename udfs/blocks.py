"""The Arrow batch loops Spark runs on executors: pack, search block pairs, merge, emit.

Data layout
-----------
* **Packed blocks.** ``pack_blocks`` turns a partition's user rows into blocks of at most
  ``block_rows`` rows; each block becomes one row ``(block_id, blob)`` where ``blob`` is an
  Arrow IPC stream holding the block's rows with *all* their columns. Payload columns
  therefore travel with the vectors: the output never re-reads the source, so a
  non-deterministic source (a union, a repartition) cannot change row identities between
  the search and the output.
* **Pairs.** The driver cross-joins query blocks with target blocks. Each pair row holds
  ``(q_block_id, q_blob, t_block_id, t_blob)``.
* **Top-k state.** ``TopkState`` holds, for one query block, the running best ``k`` values,
  global target keys (``block_id << ROW_BITS | row``: the tie rule's order) and the payload
  rows of those targets. States of several target blocks merge through the shared
  :func:`nearest_join.kernels.merge_topk`.

Plans
-----
* broadcast: :func:`search_broadcast` folds every target block into the state of a query
  block in one pass (the pairs of one query block arrive together, as a broadcast nested loop
  join streams them) and emits the joined rows.
* blocked: :func:`search_pairs` emits one partial state per pair (its own task), and
  :func:`merge_partials` (grouped by query block) folds the partials and emits the rows.
  A query block's own rows travel once, with its partial of the empty target block (every
  query block has exactly one), not with each of its target blocks' partials.

None of this imports pyspark at module level: :func:`local_join` runs the same functions on
plain ``pyarrow`` tables (tests, GPU benchmarks).
"""
from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa

from nearest_join.kernels import merge_topk

from . import columns as C
from .searcher import SearchSettings, open_block_searcher
from .rows import ColumnViews, gather_rows, gather_threads
from .vectors import decode_vectors, value_offsets

logger = logging.getLogger(__name__)

PACKED_SCHEMA = pa.schema([(C.BLOCK_ID, pa.int64()), (C.BLOB, pa.binary())])
PARTIAL_SCHEMA = pa.schema([
    (C.Q_BLOCK_ID, pa.int64()), (C.T_BLOCK_ID, pa.int64()),
    (C.Q_BLOB, pa.binary()), (C.PARTIAL, pa.binary()),
])
# Output batches are cut to about this many rows.
OUTPUT_BATCH_ROWS = 1 << 16
# Output batches built ahead of the one the consumer holds (each ~70 MB with two 128-float
# vector columns): bounds the memory this overlap costs.
EMIT_AHEAD = 2


@dataclass(frozen=True)
class SideLayout:
    """Where one side's vectors are and what they must look like (plain picklable values)."""

    label: str              # the user's column name, for errors
    vector_index: int       # position of the vector column among the side's columns
    dimension: int | None   # expected vector length; None = take the first vector's
    block_rows: int         # rows per packed block
    expected_from: str = "the other side"


@dataclass(frozen=True)
class JoinContext:
    """Everything an executor needs, captured by value in the UDF closures."""

    settings: SearchSettings
    query: SideLayout
    target: SideLayout
    join_type: str                      # "inner" | "leftouter"
    with_distance: bool
    target_schema: pa.Schema            # Arrow schema of the target's columns (NULL padding)
    output_names: tuple[str, ...] = field(default=())

    @property
    def k(self) -> int:
        return self.settings.k


# ----------------------------------------------------------------------------- blobs
def _write_stream(sink, table: pa.Table) -> None:
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def table_to_blob(table: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    _write_stream(sink, table)
    return sink.getvalue()


def blob_to_table(blob) -> pa.Table:
    return pa.ipc.open_stream(blob).read_all()


def _binary_values(array: pa.Array) -> list[pa.Buffer]:
    """Zero-copy buffers of every value of a binary column."""
    array = array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array
    offsets = value_offsets(array)     # large_binary under useLargeVarTypes
    data = array.buffers()[2]
    if data is None:
        return [pa.py_buffer(b"")] * len(array)
    return [data.slice(int(offsets[i]), int(offsets[i + 1] - offsets[i])) for i in range(len(array))]


def _binary_array(buffers: list[pa.Buffer]) -> pa.Array:
    """A binary column over existing buffers: one concatenation, no Python bytes copies."""
    sizes = np.array([b.size for b in buffers], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    if offsets[-1] >= 1 << 31:
        raise ValueError("a packed block exceeds 2 GiB: lower the block size")
    data = buffers[0] if len(buffers) == 1 else pa.py_buffer(b"".join(memoryview(b) for b in buffers))
    return pa.Array.from_buffers(pa.binary(), len(buffers),
                                 [None, pa.py_buffer(offsets.astype(np.int32)), data])


def _task_partition() -> int:
    try:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is not None:
            return int(ctx.partitionId())
    except ImportError:
        pass
    return 0


# ----------------------------------------------------------------------------- packing
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
    partition = _task_partition() if partition is None else partition
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
            [pa.array([block_id], pa.int64()), _binary_array([table_to_blob(table.combine_chunks())])],
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


# ----------------------------------------------------------------------------- top-k state
# A partial blob: an 8-byte little-endian length, the slot table's IPC stream, then the
# payload table's IPC stream (the distinct target rows the slots refer to).
_LENGTH = np.dtype("<u8")
# A state keeps at most this many payload sources before it gathers them into one table.
MAX_SOURCES = 8


@dataclass
class TopkState:
    """Running top-k of one query block: values, global target keys, payload references.

    Slot ``(i, j)`` holds value ``values[i, j]``, the target's global key ``keys[i, j]`` (-1 =
    empty slot) and its payload: row ``rows[i, j]`` of table ``sources[source[i, j]]``.
    Payload rows are referenced, not copied: a fold moves two small integers per slot, and
    the rows are gathered once, when the state is emitted or shipped.
    """

    values: np.ndarray      # float32 (nq, k)
    keys: np.ndarray        # int64 (nq, k), -1 = empty slot
    sources: list           # payload tables (same column types, names may differ)
    source: np.ndarray      # int32 (nq, k), -1 = empty slot
    rows: np.ndarray        # int64 (nq, k)
    _views: ColumnViews | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_search(cls, values: np.ndarray, local_rows: np.ndarray, block_id: int,
                    target_table: pa.Table) -> "TopkState":
        keys = np.where(local_rows >= 0, (np.int64(block_id) << C.ROW_BITS) | local_rows, -1)
        source = np.where(local_rows >= 0, 0, -1).astype(np.int32)
        return cls(values, keys, [target_table], source, local_rows.astype(np.int64, copy=False))

    def views(self) -> ColumnViews:
        """The payload tables' cached vector views (made on first use)."""
        if self._views is None:
            self._views = ColumnViews()
        return self._views

    def gather(self, slots: np.ndarray | None = None) -> list[pa.Array]:
        """Payload columns of the flat slots ``slots`` (all when None); NULL for empty slots."""
        source, rows = self.source.reshape(-1), self.rows.reshape(-1)
        if slots is not None:
            source, rows = source[slots], rows[slots]
        return gather_rows(self.sources, source, rows, views=self.views())

    @property
    def payload(self) -> pa.Table:
        """Every slot's payload row, slot (i, j) at row i * k + j (tests, debugging)."""
        return pa.Table.from_arrays(self.gather(), schema=self.sources[0].schema)

    def absorb(self, other: "TopkState", metric: str) -> "TopkState":
        return TopkState.combine([self, other], metric)

    @classmethod
    def combine(cls, states: list["TopkState"], metric: str) -> "TopkState":
        """One state from several of the same query block: one merge, however many parts."""
        if len(states) == 1:
            return states[0]
        k = states[0].keys.shape[1]
        values, keys, picked = merge_topk([s.values for s in states], [s.keys for s in states], k,
                                          metric, return_sources=True)
        # ``picked`` indexes the concatenation of the parts' columns; so do these.
        offsets = np.cumsum([0] + [len(s.sources) for s in states[:-1]])
        stacked_source = np.concatenate(
            [np.where(s.source >= 0, s.source + off, -1) for s, off in zip(states, offsets)], axis=1)
        stacked_rows = np.concatenate([s.rows for s in states], axis=1)
        safe = np.maximum(picked, 0)
        source = np.where(picked < 0, -1, np.take_along_axis(stacked_source, safe, axis=1)).astype(np.int32)
        rows = np.take_along_axis(stacked_rows, safe, axis=1)
        sources = [table for s in states for table in s.sources]
        return TopkState(values, keys, sources, source, rows)._pruned()

    def _pruned(self) -> "TopkState":
        """Drop sources no slot refers to; gather into one table past MAX_SOURCES."""
        used = np.flatnonzero(np.bincount(self.source.reshape(-1) + 1, minlength=len(self.sources) + 1)[1:])
        if len(used) > MAX_SOURCES:
            table = self.payload
            nq, k = self.keys.shape
            flat = np.arange(nq * k, dtype=np.int64).reshape(nq, k)
            return TopkState(self.values, self.keys, [table],
                             np.where(self.source >= 0, 0, -1).astype(np.int32), flat)
        if not len(used):
            # No slot is filled (a NULL query vector, a zero one under cosine, only NULL
            # targets): keep one table all the same. Its columns give the empty slots' NULL
            # payload their types; a state without any could be neither emitted nor shipped.
            used = np.zeros(1, np.int64)
        if len(used) == len(self.sources):
            return self
        remap = np.full(len(self.sources), -1, np.int32)
        remap[used] = np.arange(len(used), dtype=np.int32)
        source = np.where(self.source >= 0, remap[np.maximum(self.source, 0)], -1).astype(np.int32)
        return TopkState(self.values, self.keys, [self.sources[s] for s in used], source, self.rows)

    def to_blob(self) -> pa.Buffer:
        """Ship the state: slots plus each referenced payload row once."""
        # Distinct (source, row) pairs, compiled (a bitmap over the sources' rows laid end to
        # end: linear; a sort of nq * k codes was a fifth of the shipping cost, the numpy
        # bitmap passes ~12 ms of ~50 per 65,536 x 10 state).
        from nearest_join.kernels.cpu import distinct_rows   # numba: on executors only

        distinct_source, distinct_row, payload_row = distinct_rows(
            self.source, self.rows, [t.num_rows for t in self.sources])
        payload = pa.Table.from_arrays(
            gather_rows(self.sources, distinct_source, distinct_row),
            names=[f"t{i}" for i in range(self.sources[0].num_columns)])
        slots = pa.table([pa.array(self.values.reshape(-1)), pa.array(self.keys.reshape(-1)),
                          pa.array(payload_row)], names=[C.SLOT_VALUE, C.SLOT_KEY, C.SLOT_ROW])
        head = table_to_blob(slots)
        # Size the blob first (a mock write copies nothing), then write it once into one
        # pool buffer: a growing stream would copy a few-hundred-MB payload several times.
        mock = pa.MockOutputStream()
        _write_stream(mock, payload)
        blob = pa.allocate_buffer(_LENGTH.itemsize + head.size + mock.size())
        sink = pa.FixedSizeBufferWriter(blob)
        threads = gather_threads()
        if threads > 1:   # the payload's bytes are one memcpy: split it over the task's cores
            sink.set_memcopy_threads(threads)
        sink.write(np.array([head.size], _LENGTH).tobytes())
        sink.write(head)
        _write_stream(sink, payload)
        return blob

    @classmethod
    def from_blob(cls, blob, k: int) -> "TopkState":
        blob = pa.py_buffer(blob) if not isinstance(blob, pa.Buffer) else blob
        size = int(np.frombuffer(blob, _LENGTH, count=1)[0])
        slots = blob_to_table(blob.slice(_LENGTH.itemsize, size))
        payload = blob_to_table(blob.slice(_LENGTH.itemsize + size))
        values = slots.column(0).to_numpy().astype(np.float32, copy=False).reshape(-1, k)
        keys = slots.column(1).to_numpy().astype(np.int64, copy=False).reshape(-1, k)
        payload_row = slots.column(2).to_numpy().reshape(-1, k)
        source = np.where(payload_row >= 0, 0, -1).astype(np.int32)
        return cls(values, keys, [payload], source, payload_row.astype(np.int64))


def _fold(state: TopkState | None, part: TopkState | None, metric: str) -> TopkState | None:
    if part is None:
        return state
    return part if state is None else state.absorb(part, metric)


class _PairSearch:
    """Decodes blocks and runs the task's searcher on (query block, target block) pairs.

    Searches run one step ahead on a worker thread (:meth:`submit` returns a future), so the
    device searches pair i+1 while this thread folds, ships or emits pair i. Only the worker
    touches the searcher, except a GPU searcher's ``prefetch`` (thread-safe), which the broadcast
    plan calls here. The GIL is free while the worker waits for the GPU or the kernel.
    """

    def __init__(self, ctx: JoinContext):
        self.ctx = ctx
        self.searcher = open_block_searcher(ctx.settings)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="nj-search")
        self._decoded: dict[int, tuple[pa.Table, np.ndarray]] = {}

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    @staticmethod
    def _decode(blob, side: SideLayout) -> tuple[pa.Table, np.ndarray]:
        table = blob_to_table(blob)
        vectors = decode_vectors(table.column(side.vector_index), side.dimension, label=side.label,
                                 expected_from=side.expected_from)
        return table, vectors

    def query_block(self, blob) -> tuple[pa.Table, np.ndarray]:
        return self._decode(blob, self.ctx.query)

    def broadcast_target(self, block_id: int, blob) -> tuple[pa.Table, np.ndarray]:
        """A broadcast target block, decoded once per task: every query block meets it.

        The decoded blocks stay referenced for the task (the broadcast target is bounded by
        ``spark.nearestJoin.broadcastLimitBytes``; float32 vectors decode as zero-copy views).
        """
        hit = self._decoded.get(block_id)
        if hit is None:
            hit = self._decoded[block_id] = self.target_block(blob)
        return hit

    def target_block(self, blob) -> tuple[pa.Table, np.ndarray]:
        return self._decode(blob, self.ctx.target)

    def search(self, q_vectors: np.ndarray, t_block_id: int, t_blob) -> TopkState | None:
        if t_block_id == C.EMPTY_BLOCK_ID:
            return None
        table, t_vectors = self.target_block(t_blob)
        if q_vectors.shape[0] == 0 or t_vectors.shape[0] == 0:
            return None
        values, rows = self.searcher.search(q_vectors, t_vectors, target_key=t_block_id)
        return TopkState.from_search(values, rows, t_block_id, table)

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the worker thread, after everything submitted before it."""
        return self._worker.submit(fn, *args)


# ----------------------------------------------------------------------------- emit
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
        filled = keys.reshape(-1)[part] >= 0
        q_rows = part // k
        arrays = gather_rows([query_table], np.zeros_like(q_rows), q_rows, views=query_views)
        if state is None:
            arrays += [pa.nulls(part.size, f.type) for f in ctx.target_schema]
        else:
            arrays += state.gather(part)
        if ctx.with_distance:
            arrays.append(pa.array(values.reshape(-1)[part], pa.float32(),
                                   mask=None if filled.all() else ~filled))
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


# ----------------------------------------------------------------------------- plans
def _pair_columns(batch: pa.RecordBatch):
    """(query block ids, query blobs, target block ids, target blobs) of a batch of pairs."""
    return (batch.column(C.Q_BLOCK_ID).to_numpy(), _binary_values(batch.column(C.Q_BLOB)),
            batch.column(C.T_BLOCK_ID).to_numpy(), _binary_values(batch.column(C.T_BLOB)))


class _QueryBlock:
    """One query block of the broadcast plan while its target blocks are folded in."""

    def __init__(self, block_id, table: pa.Table, vectors: np.ndarray):
        self.id, self.table, self.vectors = block_id, table, vectors
        self.state: TopkState | None = None    # host fold (CPU searchers)
        self.device_state = None               # device fold (udfs.gpu.DeviceFold)
        self.tables: list[pa.Table] = []       # payload tables, by source ordinal
        self.seen: set[int] = set()
        self.folds: list[Future] = []          # the worker's folds for this block, in order

    def fold(self, pair: "_PairSearch", t_block_id: int, t_blob, metric: str) -> None:
        """Worker thread: search one target block and fold it into this block's top-k."""
        if t_block_id == C.EMPTY_BLOCK_ID or self.vectors.shape[0] == 0:
            return
        table, t_vectors = pair.broadcast_target(t_block_id, t_blob)
        if t_vectors.shape[0] == 0:
            return
        searcher = pair.searcher
        if hasattr(searcher, "search_fold"):
            self.tables.append(table)
            # Broadcast blocks are the same for every task of the stage: kept for the next.
            self.device_state = searcher.search_fold(self.vectors, t_vectors, t_block_id, t_block_id,
                                                     len(self.tables) - 1, self.device_state, keep=True)
        else:
            values, rows = searcher.search(self.vectors, t_vectors, target_key=t_block_id)
            self.state = _fold(self.state, TopkState.from_search(values, rows, t_block_id, table), metric)

    def result(self, views: ColumnViews | None = None) -> TopkState | None:
        """Main thread, after the last fold finished: the block's state on the host.

        ``views``: vector views of the payload tables shared by the task's query blocks (the
        broadcast target tables are the same objects for all of them; checking a view reads
        every offset of its column, milliseconds for a million rows).
        """
        for fold in self.folds:        # every one: a failed fold must fail the task
            fold.result()
        if self.device_state is None:
            state = self.state
        else:
            values, keys, source, rows = self.device_state.to_numpy()
            state = TopkState(values, keys, self.tables, source, rows)
        if state is not None and views is not None and state._views is None:
            state._views = views
        return state


def search_broadcast(batches: Iterable[pa.RecordBatch], ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """Broadcast plan, one pass: fold every target block into each query block, emit rows.

    Input rows ``(q_block_id, q_blob, t_block_id, t_blob)`` arrive grouped by query block (a
    broadcast nested-loop join streams each query row against all broadcast rows). That order
    is checked: every query block of a task must meet the same set of target blocks.
    A worker thread searches and folds (on the device for a GPU searcher) while this thread
    emits the rows of the previous query block.
    """
    pair = _PairSearch(ctx)
    metric = ctx.settings.metric
    prefetch = getattr(pair.searcher, "prefetch", None)   # GPU searchers stage query blocks ahead
    targets_seen: set[int] = set()     # target blocks whose decode is queued on the worker
    target_views = ColumnViews()
    reference_set: frozenset[int] | None = None
    block: _QueryBlock | None = None

    def finish(done: _QueryBlock):
        nonlocal reference_set
        blocks = frozenset(done.seen)
        if reference_set is None:
            reference_set = blocks
        elif blocks != reference_set:
            raise RuntimeError(
                "internal error: the broadcast pairs of a query block did not arrive together "
                f"({len(blocks)} target blocks against {len(reference_set)}); results would be wrong"
            )
        return emit_rows(done.table, done.result(target_views), ctx)

    try:
        for batch in batches:
            q_ids, q_blobs, t_ids, t_blobs = _pair_columns(batch)
            for r in range(batch.num_rows):
                previous = None
                t_id = int(t_ids[r])
                if t_id not in targets_seen and t_id != C.EMPTY_BLOCK_ID:
                    # Decoded on the worker (it caches the block for the folds) while this
                    # thread decodes the query block: the first search waits on one decode.
                    targets_seen.add(t_id)
                    pair.submit(pair.broadcast_target, t_id, t_blobs[r])
                if block is None or q_ids[r] != block.id:
                    previous, block = block, _QueryBlock(q_ids[r], *pair.query_block(q_blobs[r]))
                    if prefetch is not None:   # to the device while the worker searches
                        prefetch(block.vectors)
                if t_id in block.seen:
                    raise RuntimeError(f"internal error: target block {t_id} met twice")
                block.seen.add(t_id)
                block.folds.append(pair.submit(block.fold, pair, t_id, t_blobs[r], metric))
                if previous is not None:
                    # The worker has moved on to the new block while the old one is emitted.
                    yield from finish(previous)
        if block is not None:
            yield from finish(block)
    finally:
        pair.close()


def search_pairs(batches: Iterable[pa.RecordBatch], ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """Blocked plan, stage 1: one partial top-k per (query block, target block) pair.

    The search of the next pair runs while the current partial is serialised.
    """
    pair = _PairSearch(ctx)

    def partial_batch(q_id, q_blob, t_id, future) -> pa.RecordBatch:
        part = future.result()
        partial = pa.py_buffer(b"") if part is None else part.to_blob()
        # The query block's rows once per query block (stage 2 reads them once): with the
        # empty target block's partial, which every query block has.
        q_rows = q_blob if t_id == C.EMPTY_BLOCK_ID else pa.py_buffer(b"")
        return pa.RecordBatch.from_arrays(
            [pa.array([q_id], pa.int64()), pa.array([t_id], pa.int64()),
             _binary_array([q_rows]), _binary_array([partial])],
            schema=PARTIAL_SCHEMA,
        )

    pending = None
    try:
        for batch in batches:
            q_ids, q_blobs, t_ids, t_blobs = _pair_columns(batch)
            for r in range(batch.num_rows):
                _, q_vectors = pair.query_block(q_blobs[r])
                submitted = (q_ids[r], q_blobs[r], int(t_ids[r]),
                             pair.submit(pair.search, q_vectors, int(t_ids[r]), t_blobs[r]))
                if pending is not None:
                    yield partial_batch(*pending)
                pending = submitted
        if pending is not None:
            yield partial_batch(*pending)
    finally:
        pair.close()


def merge_partials(key, batches: Iterable[pa.RecordBatch], ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """Blocked plan, stage 2 (grouped by query block): fold the partials, emit rows.

    Streams the group batch by batch: memory is one query block's state plus at most
    MAX_SOURCES partials. The query block's rows come with its empty target block's partial.
    """
    metric = ctx.settings.metric
    q_table = None
    state = None
    pending: list[TopkState] = []      # merged MAX_SOURCES at a time: one sort, not one per part
    seen: set[int] = set()
    for batch in batches:
        t_ids = batch.column(C.T_BLOCK_ID).to_numpy()
        partials = _binary_values(batch.column(C.PARTIAL))
        if q_table is None:
            q_blob = next((b for b in _binary_values(batch.column(C.Q_BLOB)) if b.size), None)
            if q_blob is not None:
                q_table = blob_to_table(q_blob)
        for r in range(batch.num_rows):
            if int(t_ids[r]) in seen:  # a retried task's duplicate: never count a block twice
                continue
            seen.add(int(t_ids[r]))
            if partials[r].size:
                pending.append(TopkState.from_blob(partials[r], ctx.k))
            if len(pending) >= MAX_SOURCES:
                state = TopkState.combine(([state] if state is not None else []) + pending, metric)
                pending = []
    if pending:
        state = TopkState.combine(([state] if state is not None else []) + pending, metric)
    if q_table is None and seen:
        raise RuntimeError(
            f"internal error: query block {key[0] if key else '?'} has partials but not its rows "
            "(its empty target block's pair is missing); its output would be lost"
        )
    if q_table is not None:
        yield from emit_rows(q_table, state, ctx)


# ----------------------------------------------------------------------------- local driver
def _pairs_batch(q_packed: pa.Table, t_packed: pa.Table) -> Iterator[pa.RecordBatch]:
    for qi in range(q_packed.num_rows):
        for ti in range(t_packed.num_rows):
            yield pa.RecordBatch.from_pydict({
                C.Q_BLOCK_ID: [q_packed.column(0)[qi].as_py()],
                C.Q_BLOB: [q_packed.column(1)[qi].as_py()],
                C.T_BLOCK_ID: [t_packed.column(0)[ti].as_py()],
                C.T_BLOB: [t_packed.column(1)[ti].as_py()],
            }, schema=pa.schema([(C.Q_BLOCK_ID, pa.int64()), (C.Q_BLOB, pa.binary()),
                                 (C.T_BLOCK_ID, pa.int64()), (C.T_BLOB, pa.binary())]))


def empty_target_block() -> pa.RecordBatch:
    """The always-present empty target block: every query block meets at least one block."""
    return pa.RecordBatch.from_arrays(
        [pa.array([C.EMPTY_BLOCK_ID], pa.int64()), pa.array([b""], pa.binary())],
        schema=PACKED_SCHEMA,
    )


def local_join(query: pa.Table, target: pa.Table, ctx: JoinContext, plan: str = "broadcast",
               partitions: int = 1) -> pa.Table:
    """Run the executor functions in-process on Arrow tables, as Spark would feed them.

    ``partitions`` splits each side into that many packing tasks. Returns the joined rows
    with the positional output names.
    """
    def pack(table: pa.Table, layout: SideLayout) -> pa.Table:
        out = []
        bounds = np.linspace(0, table.num_rows, partitions + 1).astype(int)
        for p in range(partitions):
            part = table.slice(bounds[p], bounds[p + 1] - bounds[p])
            out.extend(pack_blocks(part.to_batches(max_chunksize=1000), layout, partition=p))
        return pa.Table.from_batches(out, schema=PACKED_SCHEMA)

    q_packed = pack(query, ctx.query)
    t_packed = pa.concat_tables([pack(target, ctx.target),
                                 pa.Table.from_batches([empty_target_block()])])
    if plan == "broadcast":
        out = list(search_broadcast(_pairs_batch(q_packed, t_packed), ctx))
    elif plan == "blocked":
        partial = list(search_pairs(_pairs_batch(q_packed, t_packed), ctx))
        groups: dict[int, list[pa.RecordBatch]] = {}
        for b in partial:
            groups.setdefault(b.column(0)[0].as_py(), []).append(b)
        out = [b for key, bs in groups.items() for b in merge_partials((key,), bs, ctx)]
    else:
        raise ValueError(f"plan: expected 'broadcast' or 'blocked', got {plan!r}")
    if not out:
        return None
    return pa.Table.from_batches(out)
