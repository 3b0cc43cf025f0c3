"""The merge: a query block's running top-k, folded target block by target block, merged from
partials, and shipped between stages.

:class:`TopkState` holds, for one query block, the running best ``k`` values, global target
keys (``block_id << ROW_BITS | row``: the tie rule's order) and references to the payload rows
of those targets (gathered once, by ``udfs.payload``, when the state is emitted or shipped).
States of several target blocks merge through the shared :func:`nearest_kernels.merge_topk`
(:meth:`TopkState.combine`, :func:`fold_state`); ``to_blob`` / ``from_blob`` ship a state
between the blocked plan's stages.

:class:`RowsTopk` is the keyed blocked plan's stage 2 (``nearest_join.keyed``): there a partial
holds *some* rows of a stage-2 block, named by their query row ids (``TopkState.query_ids``;
an IVF query's probed lists lie in different cells), and each is merged into the rows it
names by the same shared merge.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from nearest_kernels import merge_topk

from . import columns as C
from .decode import blob_to_table
from .packing import table_to_blob, write_stream
from .payload import ColumnViews, gather_rows, gather_threads

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
    # int64 (nq,): the query row id (``C.Q_ROW``) of each row, for a partial of the keyed
    # blocked plan (shipped with it); None: the rows are the query block's, in order.
    query_ids: np.ndarray | None = None
    # The payload tables' vector views (udfs.payload.ColumnViews), made on first use or shared
    # by the query blocks of a task whose payload tables are the same (the broadcast plan).
    views_cache: ColumnViews | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_search(cls, values: np.ndarray, local_rows: np.ndarray, block_id: int,
                    target_table: pa.Table) -> "TopkState":
        keys = np.where(local_rows >= 0, (np.int64(block_id) << C.ROW_BITS) | local_rows, -1)
        source = np.where(local_rows >= 0, 0, -1).astype(np.int32)
        return cls(values, keys, [target_table], source, local_rows.astype(np.int64, copy=False))

    def views(self) -> ColumnViews:
        """The payload tables' cached vector views (made on first use)."""
        if self.views_cache is None:
            self.views_cache = ColumnViews()
        return self.views_cache

    def gather(self, slots: np.ndarray | None = None, columns=None) -> list[pa.Array]:
        """Payload columns (the positions ``columns``, default all) of the flat slots ``slots``
        (all when None); NULL for empty slots."""
        source, rows = self.source.reshape(-1), self.rows.reshape(-1)
        if slots is not None:
            source, rows = source[slots], rows[slots]
        return gather_rows(self.sources, source, rows, views=self.views(), columns=columns)

    @property
    def payload(self) -> pa.Table:
        """Every slot's payload row, slot (i, j) at row i * k + j (tests, debugging)."""
        return pa.Table.from_arrays(self.gather(), schema=self.sources[0].schema)

    def absorb(self, other: TopkState, metric: str) -> TopkState:
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
        return TopkState(values, keys, sources, source, rows).pruned()

    def pruned(self) -> "TopkState":
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
        from nearest_kernels.gather import distinct_rows   # numba: on executors only

        distinct_source, distinct_row, payload_row = distinct_rows(
            self.source, self.rows, [t.num_rows for t in self.sources])
        payload = pa.Table.from_arrays(
            gather_rows(self.sources, distinct_source, distinct_row),
            names=[f"t{i}" for i in range(self.sources[0].num_columns)])
        columns = {C.SLOT_VALUE: pa.array(self.values.reshape(-1)), C.SLOT_KEY: pa.array(self.keys.reshape(-1)),
                   C.SLOT_ROW: pa.array(payload_row)}
        if self.query_ids is not None:   # per slot (k copies): a few bytes against its payload row
            columns[C.SLOT_QUERY] = pa.array(np.repeat(self.query_ids.astype(np.int64), self.keys.shape[1]))
        slots = pa.table(columns)
        head = table_to_blob(slots)
        # Size the blob first (a mock write copies nothing), then write it once into one
        # pool buffer: a growing stream would copy a few-hundred-MB payload several times.
        mock = pa.MockOutputStream()
        write_stream(mock, payload)
        blob = pa.allocate_buffer(_LENGTH.itemsize + head.size + mock.size())
        sink = pa.FixedSizeBufferWriter(blob)
        threads = gather_threads()
        if threads > 1:   # the payload's bytes are one memcpy: split it over the task's cores
            sink.set_memcopy_threads(threads)
        sink.write(np.array([head.size], _LENGTH).tobytes())
        sink.write(head)
        write_stream(sink, payload)
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
        query_ids = None
        if slots.num_columns > 3:
            query_ids = slots.column(3).to_numpy()[::k].astype(np.int64, copy=False)
        return cls(values, keys, [payload], source, payload_row.astype(np.int64), query_ids)


def fold_state(state: TopkState | None, part: TopkState | None, metric: str) -> TopkState | None:
    if part is None:
        return state
    return part if state is None else state.absorb(part, metric)


class RowsTopk:
    """Running top-k of the query rows of one stage-2 block of the keyed blocked plan, met in
    partials that each hold some of its rows (``TopkState.query_ids`` name them).

    A row's slot is appended when one of its partials first arrives (capacity doubles), so a
    partial costs its own rows, not the block's: :meth:`absorb` merges it into those rows with
    the shared :func:`nearest_kernels.merge_topk` (ties to the lower target key).
    Payload rows stay referenced in the partials' tables until those hold more than twice
    the filled slots (the rest displaced), then the filled slots are gathered into one table:
    memory is about twice the state's payload plus one partial, and each payload row is
    copied a bounded number of times on average.
    """

    def __init__(self, k: int, metric: str):
        from nearest_kernels import resolve_metric

        self.k, self.metric = k, metric
        self._worst = resolve_metric(metric).worst
        self.ids = np.zeros(0, np.int64)        # sorted row ids met so far
        self._slot_of = np.zeros(0, np.int64)   # their slots
        self.rows_held = 0
        self.values = np.zeros((0, k), np.float32)
        self.keys = np.zeros((0, k), np.int64)
        self.source = np.zeros((0, k), np.int32)
        self.rows = np.zeros((0, k), np.int64)
        self.sources: list[pa.Table] = []
        self._source_rows = 0
        self._filled = 0                        # filled slots of the rows held

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        """The slots of ``ids`` (distinct), new ones appended (empty)."""
        at = np.searchsorted(self.ids, ids)
        known = at < self.ids.size
        known[known] = self.ids[at[known]] == ids[known]
        slots = np.empty(ids.size, np.int64)
        slots[known] = self._slot_of[at[known]]
        new = np.flatnonzero(~known)
        if new.size:
            n = self.rows_held
            if n + new.size > self.values.shape[0]:
                self._grow(max(2 * self.values.shape[0], n + new.size))
            slots[new] = np.arange(n, n + new.size)
            self.values[n:n + new.size] = self._worst
            self.keys[n:n + new.size] = -1
            self.source[n:n + new.size] = -1
            self.rows[n:n + new.size] = 0
            self.rows_held = n + new.size
            ids_all = np.concatenate([self.ids, ids[new]])
            slot_all = np.concatenate([self._slot_of, slots[new]])
            order = np.argsort(ids_all, kind="stable")
            self.ids, self._slot_of = ids_all[order], slot_all[order]
        return slots

    def _grow(self, capacity: int) -> None:
        def grown(a: np.ndarray) -> np.ndarray:
            out = np.empty((capacity, self.k), a.dtype)
            out[: a.shape[0]] = a
            return out

        self.values, self.keys = grown(self.values), grown(self.keys)
        self.source, self.rows = grown(self.source), grown(self.rows)

    def absorb(self, part: TopkState) -> None:
        """Merge ``part`` (whose ``query_ids`` are distinct) into the rows it names."""
        if part.query_ids is None:
            raise RuntimeError("internal error: a keyed partial without its query row ids")
        slots = self._slots(part.query_ids)
        k = self.k
        values, keys, picked = merge_topk([self.values[slots], part.values], [self.keys[slots], part.keys],
                                          k, self.metric, return_sources=True)
        offset = len(self.sources)
        stacked_source = np.concatenate(
            [self.source[slots], np.where(part.source >= 0, part.source + offset, -1)], axis=1)
        stacked_rows = np.concatenate([self.rows[slots], part.rows], axis=1)
        safe = np.maximum(picked, 0)
        self._filled += int((keys >= 0).sum()) - int((self.keys[slots] >= 0).sum())
        self.values[slots], self.keys[slots] = values, keys
        self.source[slots] = np.where(picked < 0, -1, np.take_along_axis(stacked_source, safe, axis=1))
        self.rows[slots] = np.take_along_axis(stacked_rows, safe, axis=1)
        self.sources += part.sources
        self._source_rows += sum(t.num_rows for t in part.sources)
        if len(self.sources) > MAX_SOURCES and self._source_rows > 2 * max(self._filled, 1):
            self._compact()

    def _compact(self) -> None:
        n = self.rows_held
        state = TopkState(self.values[:n], self.keys[:n], self.sources, self.source[:n], self.rows[:n])
        filled = np.flatnonzero(state.keys.reshape(-1) >= 0)
        table = pa.Table.from_arrays(state.gather(filled), schema=self.sources[0].schema)
        source = np.full(n * self.k, -1, np.int32)
        rows = np.zeros(n * self.k, np.int64)
        source[filled], rows[filled] = 0, np.arange(filled.size, dtype=np.int64)
        self.source[:n], self.rows[:n] = source.reshape(n, self.k), rows.reshape(n, self.k)
        self.sources, self._source_rows = [table], table.num_rows

    def state_of(self, ids: np.ndarray) -> TopkState | None:
        """The state of rows ``ids`` (in that order; a row no partial named has empty slots),
        or None when no partial came. Raises RuntimeError when a partial named a row that
        ``ids`` lacks (its output would be lost)."""
        if not self.sources:
            return None
        at = np.minimum(np.searchsorted(self.ids, ids), max(self.ids.size - 1, 0))
        found = self.ids[at] == ids if self.ids.size else np.zeros(ids.size, bool)
        if int(found.sum()) != self.ids.size:
            raise RuntimeError(f"internal error: partials for {self.ids.size - int(found.sum())} query rows "
                               "whose rows did not arrive; their output would be lost")
        slots = self._slot_of[at] if self.ids.size else np.zeros(ids.size, np.int64)

        def pick(a: np.ndarray, empty) -> np.ndarray:
            return np.where(found[:, None], a[slots], empty).astype(a.dtype, copy=False)

        state = TopkState(pick(self.values, self._worst), pick(self.keys, -1), self.sources,
                          pick(self.source, -1), pick(self.rows, 0))
        return state.pruned()
