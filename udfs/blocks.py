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

None of this imports pyspark at module level: :func:`local_join` runs the same functions on
plain ``pyarrow`` tables (tests, GPU benchmarks).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa

from nearest_join.kernels import merge_topk

from . import columns as C
from .searcher import SearchSettings, open_block_searcher
from .vectors import _as_array, decode_vectors

logger = logging.getLogger(__name__)

PACKED_SCHEMA = pa.schema([(C.BLOCK_ID, pa.int64()), (C.BLOB, pa.binary())])
PARTIAL_SCHEMA = pa.schema([
    (C.Q_BLOCK_ID, pa.int64()), (C.T_BLOCK_ID, pa.int64()),
    (C.Q_BLOB, pa.binary()), (C.PARTIAL, pa.binary()),
])
# Output batches are cut to about this many rows.
OUTPUT_BATCH_ROWS = 1 << 16


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
def table_to_blob(table: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def blob_to_table(blob) -> pa.Table:
    return pa.ipc.open_stream(blob).read_all()


def _binary_values(array: pa.Array) -> list[pa.Buffer]:
    """Zero-copy buffers of every value of a binary column."""
    array = array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int32)[array.offset: array.offset + len(array) + 1]
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


# ----------------------------------------------------------------------------- row gathers
def _take_fixed_lists(array: pa.Array, rows: np.ndarray, missing: np.ndarray) -> pa.Array | None:
    """Gather rows of a list<float|double> column whose lists all have one length, in numpy.

    Arrow's generic take walks lists row by row (about 5x slower for 128-float vectors);
    vector columns are by far the largest payload, so they take this path. None = not
    applicable (NULLs, ragged lengths, other types): use Arrow's take.
    """
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        return None
    if not pa.types.is_floating(array.type.value_type) or array.null_count or len(array) == 0:
        return None
    offsets = array.offsets.to_numpy()
    width = int(offsets[1] - offsets[0])
    if width == 0 or offsets[-1] - offsets[0] != width * len(array):
        return None
    values = array.values.slice(int(offsets[0]), width * len(array))
    if values.null_count:
        return None
    matrix = values.to_numpy().reshape(len(array), width)
    gathered = matrix[np.where(missing, 0, rows)]
    out_offsets = np.arange(len(rows) + 1, dtype=offsets.dtype) * width
    return type(array).from_arrays(pa.array(out_offsets), pa.array(gathered.reshape(-1)), type=array.type,
                                   mask=pa.array(missing) if missing.any() else None)


def take_rows(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """``table.take(rows)`` with -1 giving a NULL row; vector columns gathered in numpy."""
    rows = np.asarray(rows, dtype=np.int64)
    missing = rows < 0
    indices = pa.array(rows, mask=missing) if missing.any() else pa.array(rows)
    columns = []
    for column in table.columns:
        array = _as_array(column)
        fast = _take_fixed_lists(array, rows, missing)
        columns.append(fast if fast is not None else array.take(indices))
    return pa.Table.from_arrays(columns, schema=table.schema)


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
        return pa.RecordBatch.from_arrays(
            [pa.array([block_id], pa.int64()), _binary_array([table_to_blob(table)])],
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
@dataclass
class TopkState:
    """Running top-k of one query block: values, global target keys, payload per slot."""

    values: np.ndarray      # float32 (nq, k)
    keys: np.ndarray        # int64 (nq, k), -1 = empty slot
    payload: pa.Table       # nq * k rows, slot (i, j) at row i * k + j; NULL rows for empty slots

    @classmethod
    def from_search(cls, values: np.ndarray, local_rows: np.ndarray, block_id: int,
                    target_table: pa.Table) -> "TopkState":
        keys = np.where(local_rows >= 0, (np.int64(block_id) << C.ROW_BITS) | local_rows, -1)
        payload = take_rows(target_table, local_rows.reshape(-1))
        return cls(values, keys, payload)

    def absorb(self, other: "TopkState", metric: str) -> "TopkState":
        nq, k = self.keys.shape
        values, keys, sources = merge_topk(
            [self.values, other.values], [self.keys, other.keys], k, metric, return_sources=True
        )
        # Column c of the concatenation [self | other] of row i lives at payload row
        # i*k + c in self, or nq*k + i*k_o + (c - k) in other.
        k_other = other.keys.shape[1]
        rows = np.arange(nq, dtype=np.int64)[:, None]
        mine = sources < k
        flat = np.where(mine, rows * k + sources, nq * k + rows * k_other + (sources - k))
        flat = np.where(sources < 0, -1, flat).reshape(-1)
        # Blob round trips rename payload columns positionally; align names before concat.
        combined = pa.concat_tables([self.payload, other.payload.rename_columns(self.payload.column_names)])
        payload = take_rows(combined, flat)
        return TopkState(values, keys, payload)

    def to_blob(self) -> pa.Buffer:
        table = pa.table(
            [pa.array(self.values.reshape(-1)), pa.array(self.keys.reshape(-1))]
            + list(self.payload.columns),
            names=[C.SLOT_VALUE, C.SLOT_KEY] + [f"t{i}" for i in range(self.payload.num_columns)],
        )
        return table_to_blob(table)

    @classmethod
    def from_blob(cls, blob, k: int) -> "TopkState":
        table = blob_to_table(blob)
        values = table.column(0).to_numpy().astype(np.float32, copy=False).reshape(-1, k)
        keys = table.column(1).to_numpy().astype(np.int64, copy=False).reshape(-1, k)
        payload = table.drop_columns([C.SLOT_VALUE, C.SLOT_KEY])
        return cls(values, keys, payload)


def _fold(state: TopkState | None, part: TopkState | None, metric: str) -> TopkState | None:
    if part is None:
        return state
    return part if state is None else state.absorb(part, metric)


class _PairSearch:
    """Decodes blocks and runs the task's searcher on one (query block, target block) pair."""

    def __init__(self, ctx: JoinContext):
        self.ctx = ctx
        self.searcher = open_block_searcher(ctx.settings)

    def query_block(self, blob) -> tuple[pa.Table, np.ndarray]:
        table = blob_to_table(blob)
        q = self.ctx.query
        vectors = decode_vectors(table.column(q.vector_index), q.dimension, label=q.label,
                                 expected_from=q.expected_from)
        return table, vectors

    def search(self, q_vectors: np.ndarray, t_block_id: int, t_blob) -> TopkState | None:
        if t_block_id == C.EMPTY_BLOCK_ID:
            return None
        t = self.ctx.target
        table = blob_to_table(t_blob)
        t_vectors = decode_vectors(table.column(t.vector_index), t.dimension, label=t.label,
                                   expected_from=t.expected_from)
        if q_vectors.shape[0] == 0 or t_vectors.shape[0] == 0:
            return None
        values, rows = self.searcher.search(q_vectors, t_vectors, target_key=t_block_id)
        return TopkState.from_search(values, rows, t_block_id, table)


# ----------------------------------------------------------------------------- emit
def emit_rows(query_table: pa.Table, state: TopkState | None, ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """Joined rows of one query block: query columns, target columns, [distance].

    INNER keeps the filled slots; LEFT OUTER also keeps one row with NULL target columns
    for a query row without any candidate.
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
    for start in range(0, max(flat.size, 1), OUTPUT_BATCH_ROWS):
        part = flat[start: start + OUTPUT_BATCH_ROWS]
        if part.size == 0:
            return
        filled = keys.reshape(-1)[part] >= 0
        arrays = list(take_rows(query_table, part // k).columns)
        if state is None:
            arrays += [pa.nulls(part.size, f.type) for f in ctx.target_schema]
        else:
            arrays += list(take_rows(state.payload, np.where(filled, part, -1)).columns)
        if ctx.with_distance:
            arrays.append(pa.array(values.reshape(-1)[part], pa.float32(), mask=~filled))
        arrays = [a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for a in arrays]
        yield pa.RecordBatch.from_arrays(arrays, names=[C.output_name(i) for i in range(len(arrays))])


# ----------------------------------------------------------------------------- plans
def _pair_columns(batch: pa.RecordBatch):
    """(query block ids, query blobs, target block ids, target blobs) of a batch of pairs."""
    return (batch.column(C.Q_BLOCK_ID).to_numpy(), _binary_values(batch.column(C.Q_BLOB)),
            batch.column(C.T_BLOCK_ID).to_numpy(), _binary_values(batch.column(C.T_BLOB)))


def search_broadcast(batches: Iterable[pa.RecordBatch], ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """Broadcast plan, one pass: fold every target block into each query block, emit rows.

    Input rows ``(q_block_id, q_blob, t_block_id, t_blob)`` arrive grouped by query block (a
    broadcast nested-loop join streams each query row against all broadcast rows). That order
    is checked: every query block of a task must meet the same set of target blocks.
    """
    pair = _PairSearch(ctx)
    metric = ctx.settings.metric
    current = None
    q_table = q_vectors = state = None
    seen: set[int] = set()
    reference_set: frozenset[int] | None = None

    def finish():
        nonlocal reference_set
        blocks = frozenset(seen)
        if reference_set is None:
            reference_set = blocks
        elif blocks != reference_set:
            raise RuntimeError(
                "internal error: the broadcast pairs of a query block did not arrive together "
                f"({len(blocks)} target blocks against {len(reference_set)}); results would be wrong"
            )
        return emit_rows(q_table, state, ctx)

    for batch in batches:
        q_ids, q_blobs, t_ids, t_blobs = _pair_columns(batch)
        for r in range(batch.num_rows):
            if q_ids[r] != current:
                if current is not None:
                    yield from finish()
                current = q_ids[r]
                q_table, q_vectors = pair.query_block(q_blobs[r])
                state, seen = None, set()
            if int(t_ids[r]) in seen:
                raise RuntimeError(f"internal error: target block {int(t_ids[r])} met twice")
            seen.add(int(t_ids[r]))
            state = _fold(state, pair.search(q_vectors, int(t_ids[r]), t_blobs[r]), metric)
    if current is not None:
        yield from finish()


def search_pairs(batches: Iterable[pa.RecordBatch], ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """Blocked plan, stage 1: one partial top-k per (query block, target block) pair."""
    pair = _PairSearch(ctx)
    for batch in batches:
        q_ids, q_blobs, t_ids, t_blobs = _pair_columns(batch)
        for r in range(batch.num_rows):
            _, q_vectors = pair.query_block(q_blobs[r])
            part = pair.search(q_vectors, int(t_ids[r]), t_blobs[r])
            partial = pa.py_buffer(b"") if part is None else part.to_blob()
            yield pa.RecordBatch.from_arrays(
                [pa.array([q_ids[r]], pa.int64()), pa.array([t_ids[r]], pa.int64()),
                 _binary_array([q_blobs[r]]), _binary_array([partial])],
                schema=PARTIAL_SCHEMA,
            )


def merge_partials(key, batches: Iterable[pa.RecordBatch], ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """Blocked plan, stage 2 (grouped by query block): fold the partials, emit rows.

    Streams the group batch by batch: memory is one query block's state plus one batch.
    """
    metric = ctx.settings.metric
    q_table = None
    state = None
    seen: set[int] = set()
    for batch in batches:
        t_ids = batch.column(C.T_BLOCK_ID).to_numpy()
        partials = _binary_values(batch.column(C.PARTIAL))
        if q_table is None and batch.num_rows:
            q_table = blob_to_table(_binary_values(batch.column(C.Q_BLOB).slice(0, 1))[0])
        for r in range(batch.num_rows):
            if int(t_ids[r]) in seen:  # a retried task's duplicate: never count a block twice
                continue
            seen.add(int(t_ids[r]))
            if partials[r].size:
                state = _fold(state, TopkState.from_blob(partials[r], ctx.k), metric)
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
