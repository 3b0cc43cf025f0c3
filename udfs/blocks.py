"""The plan loops Spark runs on executors: block pairs through decode -> search -> merge -> encode.

* **Pairs.** A search meets (query block, target block) pairs, each ``(q_block_id, q_blob,
  t_block_id, t_blob)`` with the blocks packed by ``udfs.packing``. The side a plan broadcasts
  is packed by a Spark stage of its own; the side it streams reaches the search as rows, each
  task's first row carrying the broadcast blocks (:func:`streamed_blocks`), and is packed in
  the search's task (the rows cross from Spark once). The one-task plan and the blocked plan's
  cartesian product pair packed blocks of both sides (:func:`search_broadcast`,
  :func:`search_pairs` on pair rows).
* broadcast: :func:`search_streamed_queries` folds every target block into the state
  (``udfs.merge.TopkState``) of a query block in one pass and emits the joined rows
  (``udfs.encode``).
* blocked: one partial state per pair (:func:`search_pairs`; with the query blocks broadcast,
  :func:`search_streamed_targets`), and :func:`merge_partials` (grouped by query block) folds
  the partials and emits the rows. A query block's own rows travel once, with its partial of
  the empty target block (every query block has exactly one), not with each of its target
  blocks' partials.
* keyed blocked (``nearest_join.keyed``: ``on=`` keys or IVF lists, a target too large to
  broadcast): :func:`search_cell` searches one cell (a cogroup of one query part and one
  target part) and emits a partial per stage-2 block among its query rows, named by their
  row ids; :func:`merge_cells` merges each query row's partials from all its cells
  (``udfs.merge.RowsTopk``) and emits the rows.

A task's searches run one step ahead on a worker thread (:class:`_PairSearch`). None of this
imports pyspark at module level: ``udfs.local.local_join`` runs the same functions on plain
``pyarrow`` tables (tests, GPU benchmarks).
"""
from __future__ import annotations

import typing
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from . import columns as C
from . import files
from .context import JoinContext, SearchSettings, task_cpus
from .decode import Probes, binary_values, blob_to_table, decode_block, decode_vectors, group_ids
from .encode import emit_rows
from .merge import MAX_SOURCES, RowsTopk, TopkState, fold_state
from .packing import binary_array, table_to_blob
from .payload import ColumnViews, pooled_empty, take_rows
from .search import GroupSegments, grouped_search, open_block_searcher
from .timing import timed

PARTIAL_SCHEMA = pa.schema([
    (C.Q_BLOCK_ID, pa.int64()), (C.T_BLOCK_ID, pa.int64()),
    (C.Q_BLOB, pa.binary()), (C.PARTIAL, pa.binary()),
])


def block_search(ctx: JoinContext, searcher, q_vectors: np.ndarray, t_vectors: np.ndarray, t_block_id):
    """(values, rows) of one block pair (``t_block_id``: the searcher's key for the target
    vectors, None when they are no whole block) by the task's searcher, with the join's cap
    (the kernels prune with it; a row may come back with fewer than k)."""
    return searcher.search(q_vectors, t_vectors, target_key=t_block_id, cap=ctx.cap)


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
        self._decoded: dict[int, tuple] = {}
        self._union: tuple | None = None   # (its block ids, _KeyedUnion)

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def query_block(self, blob) -> tuple[pa.Table, np.ndarray, np.ndarray | None]:
        with timed(self.ctx.timings, "decode"):
            return decode_block(blob, self.ctx.query)

    def broadcast_target(self, block_id: int, blob) -> tuple[pa.Table, np.ndarray, np.ndarray | None]:
        """A broadcast target block, decoded once per task: every query block meets it.

        The decoded blocks stay referenced for the task (the broadcast target is bounded by
        ``spark.nearestJoin.broadcastLimitBytes``; float32 vectors decode as zero-copy views).
        (rows, vectors, group ids or None); a keyed task searches the union of its blocks
        (:meth:`keyed_union`).
        """
        hit = self._decoded.get(block_id)
        if hit is None:
            hit = self._decoded[block_id] = self.target_block(blob)
        return hit

    def keyed_union(self, block_ids) -> "_KeyedUnion":
        """The decoded target blocks ``block_ids`` as one keyed target, built once per task."""
        key = frozenset(block_ids)
        if self._union is None or self._union[0] != key:
            self._union = (key, _KeyedUnion([(b, *self._decoded[b]) for b in sorted(key)]))
        return self._union[1]

    def target_block(self, blob) -> tuple[pa.Table, np.ndarray, np.ndarray | None]:
        with timed(self.ctx.timings, "decode"):
            return decode_block(blob, self.ctx.target)

    def search_keyed(self, q_vectors: np.ndarray, groups, block_ids) -> TopkState | None:
        """Keyed (``on=`` keys or IVF lists): a query block against the union of the decoded
        target blocks ``block_ids`` (:meth:`keyed_union`) at once; None without query rows."""
        if q_vectors.shape[0] == 0:
            return None
        with timed(self.ctx.timings, "decode"):
            union = self.keyed_union(block_ids)
        # target_key None: a segment is no block a GPU searcher may keep resident.
        # On the CPU an IVF block's probed lists are one wide search (knn_probed); a GPU
        # searcher takes one call per list.
        with timed(self.ctx.timings, "search"):
            values, rows = grouped_search(lambda q, t: self.search_block(q, t, None), q_vectors, groups,
                                          union.vectors, union.segments, self.ctx.k, self.ctx.settings.metric,
                                          cap=self.ctx.cap, threads=task_cpus(),
                                          wide=getattr(self.searcher, "backend", None) == "cpu")
        with timed(self.ctx.timings, "merge"):
            return union.state(values, rows)

    def search_block(self, q_vectors: np.ndarray, t_vectors: np.ndarray, t_block_id):
        """(values, rows) of one block pair: :func:`block_search` with the task's searcher."""
        return block_search(self.ctx, self.searcher, q_vectors, t_vectors, t_block_id)

    def search(self, q_vectors: np.ndarray, t_block_id: int, t_blob) -> TopkState | None:
        if t_block_id == C.EMPTY_BLOCK_ID:
            return None
        table, t_vectors, _ = self.target_block(t_blob)
        if q_vectors.shape[0] == 0 or t_vectors.shape[0] == 0:
            return None
        with timed(self.ctx.timings, "search"):
            values, rows = self.search_block(q_vectors, t_vectors, t_block_id)
        return TopkState.from_search(values, rows, t_block_id, table)

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the worker thread, after everything submitted before it."""
        return self._worker.submit(fn, *args)



def _pairs(batches: Iterable[pa.RecordBatch]) -> Iterator[tuple]:
    """The (query block id, query blob, target block id, target blob) of each pair row."""
    for batch in batches:
        q_ids, q_blobs, t_ids, t_blobs = _pair_columns(batch)
        for r in range(batch.num_rows):
            yield int(q_ids[r]), q_blobs[r], int(t_ids[r]), t_blobs[r]


def streamed_blocks(batches: Iterable[pa.RecordBatch], pack, width: int,
                    required: bool = True, source=None) -> tuple[list, Iterator[tuple]]:
    """A streamed side's rows as they are, and the broadcast blocks its task's first row met.

    Input rows: the side's ``width`` columns, then a broadcast block's id and blob; the task's
    first row comes once per broadcast block (the plan joins it alone to them), every other
    row once with NULLs. ``required``: the broadcast side has a block at least (the empty
    target block; query blocks, unless the query has no rows), and a task whose first row met
    none fails. Returns the broadcast blocks as (id, blob) in their order (complete:
    the rows are read up to the first without a block before the blocks are returned), and
    the side's own blocks as (id, blob), which ``pack`` (a packing mapInArrow function) makes
    of the rows here, in the search's own task: the rows cross from Spark once. ``source``
    (a :class:`udfs.files.FileRows`): the task's one row is its id, and its rows are read from
    the side's files here instead."""
    batches = iter(batches)
    met: list[tuple[int, pa.Buffer]] = []
    held: list[pa.RecordBatch] = []
    for batch in batches:
        valid = batch.column(width).is_valid().to_numpy(zero_copy_only=False)
        if valid.any():
            mask = pa.array(valid)
            ids, blobs = batch.column(width).filter(mask).to_numpy(), binary_values(batch.column(width + 1).filter(mask))
            # The first row once: its other copies are its pairs with the other blocks.
            keep = ~valid
            if not met:
                keep[np.flatnonzero(valid)[0]] = True
            met.extend((int(i), blob) for i, blob in zip(ids, blobs))
            batch = batch.filter(pa.array(keep))
        held.append(batch.select(range(width)))
        if not valid.all():
            break
    if required and not met and any(batch.num_rows for batch in held):
        raise RuntimeError("internal error: a task's first streamed row met no broadcast block (the plan "
                           "joins it to every block); its rows would be searched against none")

    def rows() -> Iterator[pa.RecordBatch]:
        if source is not None:
            yield from source.batches(files.task_ids([*held, *batches]))
            return
        yield from held
        for batch in batches:
            yield batch.select(range(width))

    def blocks() -> Iterator[tuple]:
        for packed in pack(rows()):
            ids, blobs = packed.column(0).to_numpy(), binary_values(packed.column(1))
            for r in range(packed.num_rows):
                yield int(ids[r]), blobs[r]

    return met, blocks()


def _pair_columns(batch: pa.RecordBatch):
    """(query block ids, query blobs, target block ids, target blobs) of a batch of pairs."""
    return (batch.column(C.Q_BLOCK_ID).to_numpy(), binary_values(batch.column(C.Q_BLOB)),
            batch.column(C.T_BLOCK_ID).to_numpy(), binary_values(batch.column(C.T_BLOB)))


class _KeyedUnion:
    """A keyed task's broadcast target blocks as one target sorted by group: each group's
    rows of every block form one contiguous segment, so that a query row meets its group
    (or its probed lists) in one search, not once per block with a merge after each.

    Blocks are laid end to end in ascending block id, and the sort by group is stable: within
    a group, union order is (block, row) order, the order of the targets' global keys, so
    ties go to the same target as when each block was searched and the results merged.
    """

    def __init__(self, blocks: list[tuple[int, pa.Table, np.ndarray, np.ndarray]]):
        self.block_ids = np.array([b[0] for b in blocks], dtype=np.int64)
        self.tables = [b[1] for b in blocks]
        sizes = [b[2].shape[0] for b in blocks]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.segments = GroupSegments.of(np.concatenate([b[3] for b in blocks]))
        from nearest_kernels.gather import take_rows_at   # numba: on executors only

        order = self.segments.order
        # One copy, block by block, into pool memory (reused: no fresh page faults): union
        # row u goes to position position[u] of the sorted rows.
        position = np.full(int(self.offsets[-1]), -1, np.int64)
        position[order] = np.arange(order.shape[0], dtype=np.int64)
        first = max((b[2] for b in blocks), key=lambda v: v.shape[0])
        self.vectors, _ = pooled_empty((order.shape[0],) + first.shape[1:], first.dtype)
        for (_, _, vectors, _), lo, hi in zip(blocks, self.offsets[:-1], self.offsets[1:]):
            local = np.flatnonzero(position[lo:hi] >= 0)
            take_rows_at(vectors, local, position[lo + local], self.vectors)

    def state(self, values: np.ndarray, rows: np.ndarray) -> TopkState:
        """The top-k state of a search's (values, union rows): each slot's block and row."""
        valid = rows >= 0
        block = np.searchsorted(self.offsets, np.maximum(rows, 0), side="right") - 1
        local = np.where(valid, rows - self.offsets[block], -1)
        keys = np.where(valid, (self.block_ids[block] << C.ROW_BITS) | local, -1)
        source = np.where(valid, block, -1).astype(np.int32)
        return TopkState(values, keys, list(self.tables), source, local.astype(np.int64)).pruned()


class _QueryBlock:
    """One query block of the broadcast plan while its target blocks are folded in."""

    def __init__(self, block_id, table: pa.Table, vectors: np.ndarray, groups: np.ndarray | None = None):
        self.id, self.table, self.vectors = block_id, table, vectors
        self.groups = groups                   # on= keys: each row's group id (-1: none)
        self.state: TopkState | None = None    # host fold (CPU searchers)
        self.device_state = None               # device fold (udfs.gpu_search.DeviceFold)
        self.tables: list[pa.Table] = []       # payload tables, by source ordinal
        self.seen: set[int] = set()
        self.folds: list[Future] = []          # the worker's folds for this block, in order

    def fold(self, pair: "_PairSearch", t_block_id: int, t_blob, metric: str) -> None:
        """Worker thread: search one target block and fold it into this block's top-k."""
        if t_block_id == C.EMPTY_BLOCK_ID or self.vectors.shape[0] == 0:
            return
        table, t_vectors, _ = pair.broadcast_target(t_block_id, t_blob)
        if t_vectors.shape[0] == 0:
            return
        searcher, timings = pair.searcher, pair.ctx.timings
        if hasattr(searcher, "search_fold"):
            self.tables.append(table)
            # Broadcast blocks are the same for every task of the stage: kept for the next.
            with timed(timings, "search"):
                self.device_state = searcher.search_fold(self.vectors, t_vectors, t_block_id, t_block_id,
                                                         len(self.tables) - 1, self.device_state, keep=True,
                                                         cap=pair.ctx.cap)
        else:
            with timed(timings, "search"):
                values, rows = pair.search_block(self.vectors, t_vectors, t_block_id)
            with timed(timings, "merge"):
                self.state = fold_state(self.state, TopkState.from_search(values, rows, t_block_id, table),
                                        metric)

    def search_union(self, pair: "_PairSearch") -> None:
        """Worker thread, keyed (``on=`` keys or IVF lists): search the union of every target
        block this query block met (:class:`_KeyedUnion`) at once."""
        blocks = sorted(self.seen - {C.EMPTY_BLOCK_ID})
        if blocks:
            self.state = pair.search_keyed(self.vectors, self.groups, blocks)

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
        if state is not None and views is not None and state.views_cache is None:
            state.views_cache = views
        return state


def search_broadcast(batches: Iterable[pa.RecordBatch], ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """The broadcast plan's search, one pass: fold every target block into each query block,
    emit rows. Pairs of packed blocks (the one-task plan's; :func:`search_streamed_queries`
    makes the pairs of the streamed plan in its task).

    Input rows ``(q_block_id, q_blob, t_block_id, t_blob)`` arrive grouped by query block, and
    a query block's first pair carries its rows (``q_blob`` NULL in the others; in a one-task
    join every pair carries them, and those of the later pairs are not read). That order is
    checked: a query block must arrive with its rows, and every query block of a task must
    meet the same set of target blocks.
    A worker thread searches and folds (on the device for a GPU searcher) while this thread
    emits the rows of the previous query block.
    """
    return _search_broadcast(_pairs(batches), ctx)


def search_held_blocks(query_blocks: list[tuple[int, pa.Table]], target_blocks: list[tuple[int, pa.Table]],
                       ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """The broadcast plan's search of blocks this process holds (``udfs.local``: the driver's
    local plan and the incremental join's searches): (block id, rows) of each side, searched
    as :func:`search_broadcast` searches packed pairs, without the blobs' wire format."""
    return _search_broadcast(((q_id, q_rows, t_id, t_rows) for q_id, q_rows in query_blocks
                              for t_id, t_rows in target_blocks), ctx)


def search_streamed_queries(batches: Iterable[pa.RecordBatch], ctx: JoinContext, pack, width: int,
                            source=None) -> Iterator[pa.RecordBatch]:
    """Broadcast plan, the query's rows as they are (:func:`streamed_blocks`, ``source``
    there): packed into blocks here, each searched against every broadcast target block as
    :func:`search_broadcast` searches its pairs."""
    met, blocks = streamed_blocks(batches, pack, width, source=source)
    return _search_broadcast(((q_id, q_blob, t_id, t_blob) for q_id, q_blob in blocks for t_id, t_blob in met),
                             ctx)


def _search_broadcast(pairs: Iterable[tuple], ctx: JoinContext) -> Iterator[pa.RecordBatch]:
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
        if done.groups is not None:
            done.folds.append(pair.submit(done.search_union, pair))
        return emit_rows(done.table, done.result(target_views), ctx)

    try:
        for q_id, q_blob, t_id, t_blob in pairs:
            previous = None
            if t_id not in targets_seen and t_id != C.EMPTY_BLOCK_ID:
                # Decoded on the worker (it caches the block for the folds) while this
                # thread decodes the query block: the first search waits on one decode.
                targets_seen.add(t_id)
                pair.submit(pair.broadcast_target, t_id, t_blob)
            if block is None or q_id != block.id:
                if (q_blob.num_rows if isinstance(q_blob, pa.Table) else q_blob.size) == 0:
                    raise RuntimeError(
                        f"internal error: query block {q_id} arrived without its rows (its first "
                        f"pair was with target block {t_id}); its output would be lost")
                previous, block = block, _QueryBlock(q_id, *pair.query_block(q_blob))
                if prefetch is not None:   # to the device while the worker searches
                    prefetch(block.vectors)
            if t_id in block.seen:
                raise RuntimeError(f"internal error: target block {t_id} met twice")
            block.seen.add(t_id)
            if block.groups is None:   # keyed: one search of the union, at the block's end
                block.folds.append(pair.submit(block.fold, pair, t_id, t_blob, metric))
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
    return _search_pairs(_pairs(batches), ctx)


def search_streamed_targets(batches: Iterable[pa.RecordBatch], ctx: JoinContext, pack, width: int,
                            queries: bool = True, source=None) -> Iterator[pa.RecordBatch]:
    """Blocked plan with the query blocks broadcast, the target's rows as they are
    (:func:`streamed_blocks`, ``source`` there): packed into blocks here, one partial per (query block, target
    block) as :func:`search_pairs`. The empty target block's partials (a query block's rows)
    are another task's (:func:`search_pairs` of the empty block's pairs). ``queries``: the
    query side has rows (query blocks to meet). Keyed (``on=``): :func:`_search_keyed_targets`."""
    met, blocks = streamed_blocks(batches, pack, width, required=queries, source=source)
    if ctx.keyed:
        return _search_keyed_targets(met, blocks, ctx)
    return _search_pairs(((q_id, q_blob, t_id, t_blob) for t_id, t_blob in blocks for q_id, q_blob in met), ctx)


def _search_keyed_targets(met: list, blocks: Iterator[tuple], ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """The keyed search of a task's streamed target rows: every query block (``met``) against
    the union of the task's target blocks grouped by key (:class:`_KeyedUnion`, as a keyed
    broadcast task searches its broadcast blocks), one partial per query block, named by the
    task's first target block (a retried task's partial is counted once). The task holds its
    partition's target rows at once."""
    pair = _PairSearch(ctx)
    try:
        ids = []
        for t_id, t_blob in blocks:
            pair.broadcast_target(t_id, t_blob)   # decoded once, kept for the union
            ids.append(t_id)
        if not ids:
            return
        for q_id, q_blob in met:
            _, vectors, groups = pair.query_block(q_blob)
            state = pair.search_keyed(vectors, groups, ids)
            partial = pa.py_buffer(b"") if state is None else state.to_blob()
            yield pa.RecordBatch.from_arrays(
                [pa.array([q_id], pa.int64()), pa.array([ids[0]], pa.int64()),
                 binary_array([pa.py_buffer(b"")]), binary_array([partial])], schema=PARTIAL_SCHEMA)
    finally:
        pair.close()


def _search_pairs(pairs: Iterable[tuple], ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    pair = _PairSearch(ctx)

    def partial_batch(q_id, q_blob, t_id, future) -> pa.RecordBatch:
        part = future.result()
        partial = pa.py_buffer(b"") if part is None else part.to_blob()
        # The query block's rows once per query block (stage 2 reads them once): with the
        # empty target block's partial, which every query block has.
        q_rows = q_blob if t_id == C.EMPTY_BLOCK_ID else pa.py_buffer(b"")
        return pa.RecordBatch.from_arrays(
            [pa.array([q_id], pa.int64()), pa.array([t_id], pa.int64()),
             binary_array([q_rows]), binary_array([partial])],
            schema=PARTIAL_SCHEMA,
        )

    pending = None
    try:
        for q_id, q_blob, t_id, t_blob in pairs:
            if ctx.keyed and t_id != C.EMPTY_BLOCK_ID:
                raise RuntimeError("internal error: on= keys paired block by block, which searches no keys")
            _, q_vectors, _ = pair.query_block(q_blob)
            submitted = (q_id, q_blob, t_id, pair.submit(pair.search, q_vectors, t_id, t_blob))
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
        partials = binary_values(batch.column(C.PARTIAL))
        if q_table is None:
            q_blob = next((b for b in binary_values(batch.column(C.Q_BLOB)) if b.size), None)
            if q_blob is not None:
                q_table = blob_to_table(q_blob)
                if ctx.query.group_index is not None:   # keyed: the rows without their group id
                    q_table = q_table.remove_column(ctx.query.group_index)
        for r in range(batch.num_rows):
            if int(t_ids[r]) in seen:  # a retried task's duplicate: never count a block twice
                continue
            seen.add(int(t_ids[r]))
            if partials[r].size:
                with timed(ctx.timings, "decode"):
                    pending.append(TopkState.from_blob(partials[r], ctx.k))
            if len(pending) >= MAX_SOURCES:
                with timed(ctx.timings, "merge"):
                    state = TopkState.combine(([state] if state is not None else []) + pending, metric)
                pending = []
    if pending:
        with timed(ctx.timings, "merge"):
            state = TopkState.combine(([state] if state is not None else []) + pending, metric)
    if q_table is None and seen:
        raise RuntimeError(
            f"internal error: query block {key[0] if key else '?'} has partials but not its rows "
            "(its empty target block's pair is missing); its output would be lost"
        )
    if q_table is not None:
        yield from emit_rows(q_table, state, ctx)


# One searcher per worker process and settings: a cogroup calls search_cell once per cell,
# and a searcher's set-up (device choice, JIT warm-up) is paid once, not per cell.
_CELL_SEARCHERS: dict = {}


def _cell_searcher(settings: SearchSettings):
    searcher = _CELL_SEARCHERS.get(settings)
    if searcher is None:
        searcher = _CELL_SEARCHERS[settings] = open_block_searcher(settings)
    return searcher


def _ordered(table: pa.Table, row_id: str) -> pa.Table:
    """The table in ``row_id`` order (a shuffle delivers a cell's rows in any order)."""
    ids = table.column(row_id).to_numpy()
    if ids.size > 1 and not np.all(ids[1:] > ids[:-1]):
        return take_rows(table, np.argsort(ids, kind="stable"))
    return table


def search_cell(queries: pa.Table, targets: pa.Table, ctx: JoinContext) -> pa.Table:
    """Keyed blocked plan, stage 1 (``nearest_join.keyed``; a cogroup by cell): the partial
    top-k of one cell, one query part against one target part, as rows of ``PARTIAL_SCHEMA``:
    one per stage-2 block among the cell's query rows.

    ``queries``: the side's columns, ``C.GROUP`` (the row's one group: a key's, or one probed
    list of an IVF query), ``C.Q_ROW``, ``C.PROBE``, ``C.Q_BLOCK_ID`` (the stage-2 block),
    ``C.T_BLOCK_ID`` (this cell's target part) and ``C.CELL``; ``targets``: the side's columns,
    ``C.GROUP``, ``C.T_ROW`` and ``C.CELL``. A query row in several of the cell's groups (an
    IVF query whose probed lists share the cell's bin) arrives once per group and is searched
    against all of them at once (``udfs.search``). Each query row is searched against its
    groups' rows only (:func:`udfs.search.grouped_search`: small groups in one segment
    search, large ones by the task's searcher); a target's key is its row id ``C.T_ROW``, so
    ties go to the target met first in input order, in whichever cell and part it lies.

    Each output row holds, for one stage-2 block: the partial of its query rows here (their
    ids ride in the partial, ``TopkState.query_ids``) and the payload of its rows whose copy
    of probe rank 0 is in target part 0 here (with their ``C.Q_ROW`` last: each query row's
    payload travels to stage 2 once; the other copies carry only the vector). ``C.T_BLOCK_ID``
    holds the cell: stage 2 counts each cell's row once.
    """
    if queries.num_rows == 0:      # a target part no query drew: nothing to search
        return PARTIAL_SCHEMA.empty_table()
    cell = int(queries.column(C.CELL)[0].as_py())
    queries = _ordered(queries, C.Q_ROW)
    g = ctx.query.group_index
    q_ids = queries.column(C.Q_ROW).to_numpy()
    # One search row per query row: the first of its copies (one per group in this cell).
    first = np.flatnonzero(np.concatenate([[True], q_ids[1:] != q_ids[:-1]]))
    blocks_of = queries.column(C.Q_BLOCK_ID).to_numpy()
    carrier = ((queries.column(C.PROBE).to_numpy() == 0)
               & (queries.column(C.T_BLOCK_ID).to_numpy() == 0))
    state = None
    if targets.num_rows:
        if targets.num_rows > C.MAX_BLOCK_ROWS:
            raise RuntimeError(f"internal error: a cell of {targets.num_rows} target rows exceeds "
                               f"{C.MAX_BLOCK_ROWS}; the layout's target parts are too large")
        targets = _ordered(targets, C.T_ROW)
        t_table = targets.select(list(range(ctx.target.group_index)))
        q_vectors = decode_vectors(queries.column(ctx.query.vector_index), ctx.query.dimension,
                                   label=ctx.query.label, expected_from=ctx.query.expected_from)
        t_vectors = decode_vectors(t_table.column(ctx.target.vector_index), ctx.target.dimension,
                                   label=ctx.target.label, expected_from=ctx.target.expected_from)
        segments = GroupSegments.of(group_ids(targets.column(C.GROUP)))
        groups = group_ids(queries.column(C.GROUP))
        if first.size < q_ids.size:      # some query row in several groups: its probes, CSR
            groups = Probes(np.append(first, q_ids.size).astype(np.int64), groups)
            q_vectors = q_vectors[first]
        searcher = _cell_searcher(ctx.settings)
        with timed(ctx.timings, "search"):
            values, rows = grouped_search(
                lambda q, t: block_search(ctx, searcher, q, t, None), q_vectors, groups,
                np.ascontiguousarray(t_vectors[segments.order]), segments,
                ctx.k, ctx.settings.metric, cap=ctx.cap, threads=task_cpus())
        t_keys = targets.column(C.T_ROW).to_numpy()
        filled = rows >= 0
        state = TopkState(values, np.where(filled, t_keys[np.maximum(rows, 0)], -1), [t_table],
                          np.where(filled, 0, -1).astype(np.int32), rows.astype(np.int64, copy=False))
    q_table = queries.select(list(range(g)))
    out = []
    for block in np.unique(blocks_of):
        mine = blocks_of[first] == block
        partial = pa.py_buffer(b"")
        if state is not None and mine.any():
            sel = np.flatnonzero(mine)
            part = state if sel.size == first.size else TopkState(
                state.values[sel], state.keys[sel], state.sources, state.source[sel], state.rows[sel])
            part.query_ids = q_ids[first[sel]]
            partial = part.to_blob()
        payload = np.flatnonzero(carrier & (blocks_of == block))
        q_rows = pa.py_buffer(b"")
        if payload.size:
            rows_table = take_rows(q_table, payload) if payload.size < q_table.num_rows else q_table
            q_rows = table_to_blob(rows_table.append_column(C.Q_ROW, pa.array(q_ids[payload], pa.int64())))
        if partial.size or q_rows.size:
            out.append((int(block), q_rows, partial))
    if not out:
        return PARTIAL_SCHEMA.empty_table()
    return pa.Table.from_batches([pa.RecordBatch.from_arrays(
        [pa.array([b for b, _, _ in out], pa.int64()), pa.array([cell] * len(out), pa.int64()),
         binary_array([q for _, q, _ in out]), binary_array([p for _, _, p in out])], schema=PARTIAL_SCHEMA)])


def merge_cells(key, batches: Iterable[pa.RecordBatch], ctx: JoinContext) -> Iterator[pa.RecordBatch]:
    """Keyed blocked plan, stage 2 (grouped by stage-2 block): merge each query row's
    partials, from every cell it was searched in, into its top k (:class:`udfs.merge.RowsTopk`)
    and emit the block's rows, whose payload came in pieces from the cells that carried it.

    Streams the group batch by batch: memory is the block's state (its payload held at most
    twice) plus one partial.
    """
    state = RowsTopk(ctx.k, ctx.settings.metric)
    pieces: list[pa.Table] = []
    seen: set[int] = set()
    for batch in batches:
        cells = batch.column(C.T_BLOCK_ID).to_numpy()
        q_blobs = binary_values(batch.column(C.Q_BLOB))
        partials = binary_values(batch.column(C.PARTIAL))
        for r in range(batch.num_rows):
            if int(cells[r]) in seen:  # a retried task's duplicate: never count a cell twice
                continue
            seen.add(int(cells[r]))
            if q_blobs[r].size:
                pieces.append(blob_to_table(q_blobs[r]))
            if partials[r].size:
                with timed(ctx.timings, "merge"):
                    state.absorb(TopkState.from_blob(partials[r], ctx.k))
    if not pieces:
        if state.rows_held:
            raise RuntimeError(f"internal error: stage-2 block {key[0] if key else '?'} has partials "
                               "but not its rows; its output would be lost")
        return
    q_table = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
    ids = q_table.column(q_table.num_columns - 1).to_numpy()
    q_table = q_table.remove_column(q_table.num_columns - 1)
    yield from emit_rows(q_table, state.state_of(ids), ctx)


def cell_function(ctx: JoinContext):
    """The cogroup function of the keyed blocked plan's stage 1 (:func:`search_cell`)."""
    def search(key: tuple, queries: pa.Table, targets: pa.Table) -> pa.Table:
        return search_cell(queries, targets, ctx)

    return search


def cells_merge_function(ctx: JoinContext):
    """The grouped-map function of the keyed blocked plan's stage 2 (:func:`merge_cells`)."""
    def merge(key: typing.Tuple[pa.Scalar, ...],
              batches: typing.Iterator[pa.RecordBatch]) -> typing.Iterator[pa.RecordBatch]:
        return merge_cells(key, batches, ctx)

    return merge


def merge_function(ctx: JoinContext):
    """The grouped-map function of the blocked plans' stage 2 (:func:`merge_partials`)."""
    # Type hints select Spark's streaming (iterator of batches) grouped-map form.
    def merge(key: typing.Tuple[pa.Scalar, ...],
              batches: typing.Iterator[pa.RecordBatch]) -> typing.Iterator[pa.RecordBatch]:
        return merge_partials(key, batches, ctx)

    return merge
