"""Top-k state of one query block, and its wire format (the blocked plan's partials).

``TopkState`` holds, for one query block, the running best ``k`` values, global target keys
(``block_id << ROW_BITS | row``: the tie rule's order) and references to the payload rows of
those targets. States of several target blocks merge through the shared
:func:`nearest_join.kernels.merge_topk`; ``to_blob`` / ``from_blob`` ship a state between the
blocked plan's stages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from nearest_join.kernels import merge_topk

from . import columns as C
from .packing import blob_to_table, table_to_blob, write_stream
from .rows import ColumnViews, gather_rows, gather_threads

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
        from nearest_join.kernels.gather import distinct_rows   # numba: on executors only

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
        return cls(values, keys, [payload], source, payload_row.astype(np.int64))


def fold_state(state: TopkState | None, part: TopkState | None, metric: str) -> TopkState | None:
    if part is None:
        return state
    return part if state is None else state.absorb(part, metric)
