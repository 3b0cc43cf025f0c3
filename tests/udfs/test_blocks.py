"""The executor functions, fed Arrow batches outside Spark, against the float64 reference."""
import numpy as np
import pyarrow as pa
import pytest

from nearest_kernels import knn
from udfs import columns as C
from udfs.context import JoinContext, SearchSettings, SideLayout
from udfs.local import local_join
from udfs.merge import TopkState
from udfs.packing import pack_blocks


def _tables(rng, nq, nt, d):
    Q = rng.standard_normal((nq, d)).astype(np.float32)
    T = rng.standard_normal((nt, d)).astype(np.float32)
    qt = pa.table({"qid": np.arange(nq), "qv": pa.array(list(Q), type=pa.list_(pa.float32()))})
    tt = pa.table({"tid": np.arange(nt), "tag": [f"t{i}" for i in range(nt)],
                   "tv": pa.array(list(T), type=pa.list_(pa.float32()))})
    return Q, T, qt, tt


def _ctx(k, metric, d, q_rows, t_rows, join_type="inner", schema=None):
    return JoinContext(SearchSettings(k, metric, "auto"), SideLayout("qv", 1, d, q_rows),
                       SideLayout("tv", 2, d, t_rows), join_type, True, schema)


@pytest.mark.parametrize("plan", ["broadcast", "blocked"])
@pytest.mark.parametrize("metric", ["l2", "inner_product"])
def test_local_join_matches_reference(plan, metric):
    rng = np.random.default_rng(hash((plan, metric)) % 2**32)
    Q, T, qt, tt = _tables(rng, 61, 403, 7)
    k = 6
    out = local_join(qt, tt, _ctx(k, metric, 7, 13, 50, schema=tt.schema), plan=plan, partitions=2)
    values, indices = knn(Q, T, k, metric, backend="reference")
    got = sorted(zip(out.column(0).to_pylist(), out.column(2).to_pylist()))
    assert got == sorted((q, int(t)) for q in range(61) for t in indices[q])
    np.testing.assert_allclose(np.sort(out.column(5).to_numpy()), np.sort(values.ravel()), rtol=1e-4, atol=1e-4)
    # every output row carries the payload of the vector that was ranked
    tv = np.array(out.column(4).to_pylist(), np.float32)
    np.testing.assert_array_equal(tv, T[np.array(out.column(2).to_pylist())])


def test_held_blocks_break_ties_as_the_packed_plans():
    """The broadcast plan of ``local_join`` cuts each side, whatever its record batches (here
    7, 0, 30 and 13 rows), into blocks of the block size with packing's ids, held as views,
    not packed: the rows equal the packed blocked plan's and the oracle's, with every target
    duplicated in a later block, so that each query's k-th value is tied (the earlier row
    wins)."""
    from udfs.local import held_blocks

    rng = np.random.default_rng(21)
    Q, T, qt, tt = _tables(rng, 23, 25, 4)
    T = np.concatenate([T, T])      # rows 25-49 repeat rows 0-24
    tt = pa.concat_tables([tt, tt.set_column(0, "tid", pa.array(np.arange(25, 50)))])
    batch = tt.combine_chunks().to_batches()[0]
    tt = pa.Table.from_batches([batch.slice(0, 7), batch.slice(7, 0), batch.slice(7, 30), batch.slice(37)])
    ctx = _ctx(5, "l2", 4, 6, 20, schema=tt.schema)
    blocks = held_blocks(tt, ctx.target, 1)
    assert [(i >> C.SEQUENCE_BITS, i & ((1 << C.SEQUENCE_BITS) - 1), b.num_rows) for i, b in blocks] == \
        [(1, 0, 20), (1, 1, 20), (1, 2, 10)]
    assert pa.concat_tables([b for _, b in blocks]).equals(tt)
    held = local_join(qt, tt, ctx, plan="broadcast")
    packed = local_join(qt, tt, ctx, plan="blocked")

    def rows(out):
        return sorted(zip(out.column(0).to_pylist(), out.column(2).to_pylist(), out.column(5).to_pylist()))
    assert rows(held) == rows(packed)
    values, indices = knn(Q, T, 5, "l2", backend="reference")
    # the oracle keeps the earlier of two equal rows: the first copy (0-24) before the second
    assert sorted((q, t) for q, t, _ in rows(held)) == sorted((q, int(t)) for q in range(23) for t in indices[q])


def test_left_outer_keeps_unmatched_query_rows_once():
    rng = np.random.default_rng(1)
    Q, T, qt, tt = _tables(rng, 5, 3, 2)
    qt = qt.set_column(1, "qv", pa.array([None] + list(Q[1:]), type=pa.list_(pa.float32())))
    out = local_join(qt, tt, _ctx(4, "l2", 2, 2, 2, "leftouter", tt.schema), plan="blocked")
    rows = out.to_pylist()
    unmatched = [r for r in rows if r[C.output_name(0)] == 0]
    assert len(unmatched) == 1 and unmatched[0][C.output_name(2)] is None
    assert unmatched[0][C.output_name(5)] is None  # distance NULL
    assert len(rows) == 1 + 4 * 3  # the other 4 queries see all 3 targets


@pytest.mark.parametrize("plan", ["broadcast", "blocked"])
@pytest.mark.parametrize("join_type", ["inner", "leftouter"])
def test_query_blocks_without_any_candidate_against_several_target_blocks(plan, join_type):
    """NULL and NULL-element query rows, some filling whole query blocks, against a target
    of four blocks over two packing tasks; k larger than the target."""
    rng = np.random.default_rng(12)
    Q, T, qt, tt = _tables(rng, 7, 7, 3)
    vectors = [None, None, [1.0, None, 0.0]] + [list(v) for v in Q[3:]]   # block 0: no candidate
    qt = qt.set_column(1, "qv", pa.array(vectors, type=pa.list_(pa.float32())))
    k = 9
    out = local_join(qt, tt, _ctx(k, "l2", 3, 2, 2, join_type, tt.schema), plan=plan, partitions=2)
    rows = out.to_pylist()
    unmatched = sorted(r[C.output_name(0)] for r in rows if r[C.output_name(2)] is None)
    assert all(r[C.output_name(5)] is None for r in rows if r[C.output_name(2)] is None)
    assert unmatched == ([0, 1, 2] if join_type == "leftouter" else [])
    values, indices = knn(Q[3:], T, k, "l2", backend="reference")
    got = sorted((r[C.output_name(0)], r[C.output_name(2)]) for r in rows if r[C.output_name(2)] is not None)
    assert got == sorted((3 + q, int(t)) for q in range(4) for t in indices[q] if t >= 0)
    assert len(rows) == len(unmatched) + 4 * 7


@pytest.mark.parametrize("join_type", ["inner", "leftouter"])
def test_emission_built_ahead_on_helper_threads_equals_the_serial_one(monkeypatch, join_type):
    """Many small output batches, built ahead on helper threads, arrive in order and equal
    the one-thread emission; a consumer that stops early leaves nothing running."""
    import threading

    from udfs import encode as E

    rng = np.random.default_rng(5)
    Q, T, qt, tt = _tables(rng, 40, 9, 3)
    qt = qt.set_column(1, "qv", pa.array([None] + list(Q[1:]), type=pa.list_(pa.float32())))
    ctx = _ctx(4, "l2", 3, 40, 9, join_type, tt.schema)
    monkeypatch.setattr(E, "OUTPUT_BATCH_ROWS", 7)
    monkeypatch.setattr(E, "gather_threads", lambda: 1)
    serial = local_join(qt, tt, ctx, plan="broadcast")
    monkeypatch.setattr(E, "gather_threads", lambda: 3)
    built = []
    real_gather = E.gather_rows

    def record_thread(*args, **kwargs):
        built.append(threading.current_thread().name)
        return real_gather(*args, **kwargs)
    monkeypatch.setattr(E, "gather_rows", record_thread)
    ahead = local_join(qt, tt, ctx, plan="broadcast")
    assert ahead.equals(serial) and ahead.num_rows == serial.num_rows >= 4 * 39
    assert any(name.startswith("nj-emit") for name in built), built
    # Stop after two batches: the generator closes without waiting for the queued ones.
    state = TopkState.from_search(np.zeros((40, 4), np.float32), np.tile(np.arange(4), (40, 1)), 0, tt)
    gen = E.emit_rows(qt, state, ctx)
    first = [next(gen), next(gen)]
    gen.close()
    assert [b.num_rows for b in first] == [7, 7]


def test_broadcast_checks_each_target_blocks_vectors_once_per_task(monkeypatch):
    """Query blocks of a broadcast task share the target tables' vector views: the check
    that reads every offset runs once per target block, not once per (query, target) block."""
    from udfs import payload as R

    rng = np.random.default_rng(9)
    Q, T, qt, tt = _tables(rng, 35, 100, 3)
    seen = []
    real = R.vector_matrix

    def counted(array):
        if pa.types.is_list(array.type):
            seen.append(len(array))
        return real(array)
    monkeypatch.setattr(R, "vector_matrix", counted)
    out = local_join(qt, tt, _ctx(3, "l2", 3, 7, 50, schema=tt.schema), plan="broadcast")
    assert out.num_rows == 35 * 3
    assert seen.count(50) == 2, seen          # two target blocks of 50 rows, five query blocks


def test_broadcast_decodes_each_target_block_once_ahead_and_a_failed_decode_fails_the_task(monkeypatch):
    """Target blocks are decoded on the worker as their first pair arrives (while the main
    thread decodes the query block), once per task; a decode that fails there still fails
    the task, from the fold that needs the block."""
    from udfs import decode as D

    rng = np.random.default_rng(6)
    _, _, qt, tt = _tables(rng, 35, 100, 3)
    decoded = []
    real = D.decode_vectors

    def counted(column, dimension, **kw):
        decoded.append(len(column))
        return real(column, dimension, **kw)
    monkeypatch.setattr(D, "decode_vectors", counted)
    out = local_join(qt, tt, _ctx(3, "l2", 3, 7, 50, schema=tt.schema), plan="broadcast")
    assert out.num_rows == 35 * 3
    assert decoded.count(50) == 2 and decoded.count(7) == 5, decoded
    # (Packing checks the dimensions first: a decode that fails here is a damaged block.)
    def failing(column, dimension, **kw):
        if len(column) == 50:
            raise D.VectorDimensionError("damaged target block")
        return real(column, dimension, **kw)
    monkeypatch.setattr(D, "decode_vectors", failing)
    with pytest.raises(D.VectorDimensionError, match="damaged target block"):
        local_join(qt, tt, _ctx(3, "l2", 3, 7, 50, schema=tt.schema), plan="broadcast")


def test_a_failing_search_fails_the_task_instead_of_hanging(monkeypatch):
    from udfs import blocks as B

    class Failing:
        calls = 0

        def search(self, q, t, target_key=None, cap=None):
            Failing.calls += 1
            if Failing.calls == 2:
                raise RuntimeError("device lost")
            return np.zeros((len(q), 2), np.float32), np.zeros((len(q), 2), np.int64)

    monkeypatch.setattr(B, "open_block_searcher", lambda settings: Failing())
    rng = np.random.default_rng(4)
    _, _, qt, tt = _tables(rng, 6, 30, 3)
    for plan in ("broadcast", "blocked"):
        Failing.calls = 0
        with pytest.raises(RuntimeError, match="device lost"):
            local_join(qt, tt, _ctx(2, "l2", 3, 3, 10, schema=tt.schema), plan=plan)


def test_broadcast_refuses_pairs_that_do_not_arrive_grouped():
    """The broadcast plan's order check: a query block meeting a different set of target
    blocks, one target block twice, or arriving without its rows (a pair other than its first
    carries none) is an internal error, never a silent wrong answer."""
    from udfs.blocks import search_broadcast
    from udfs.local import pair_batches
    from udfs.packing import PACKED_SCHEMA

    rng = np.random.default_rng(5)
    _, _, qt, tt = _tables(rng, 8, 40, 3)
    ctx = _ctx(2, "l2", 3, 4, 20, schema=tt.schema)
    q_packed = pa.Table.from_batches(list(pack_blocks(qt.to_batches(), ctx.query, 0)), schema=PACKED_SCHEMA)
    t_packed = pa.Table.from_batches(list(pack_blocks(tt.to_batches(), ctx.target, 1)), schema=PACKED_SCHEMA)
    pairs = list(pair_batches(q_packed, t_packed))          # 2 query blocks x 2 target blocks
    assert len(pairs) == 4
    assert sum(b.num_rows for b in search_broadcast(iter(pairs), ctx)) == 8 * 2
    with pytest.raises(RuntimeError, match="did not arrive together"):
        list(search_broadcast(iter(pairs[:3]), ctx))        # the second block misses one
    with pytest.raises(RuntimeError, match="met twice"):
        list(search_broadcast(iter([pairs[0], pairs[0]] + pairs[1:]), ctx))
    # Only a query block's first pair carries its rows: a block starting without them fails.
    assert pairs[1].column(C.Q_BLOB)[0].as_py() is None
    with pytest.raises(RuntimeError, match="arrived without its rows"):
        list(search_broadcast(iter(pairs[1:]), ctx))
    with pytest.raises(RuntimeError, match="arrived without its rows"):
        list(search_broadcast(iter([pairs[0], pairs[1], pairs[3], pairs[2]]), ctx))


def test_blocked_plan_ships_each_query_blocks_rows_once():
    """Stage 1 sends a query block's rows with its empty-target-block partial only; stage 2
    finds them wherever that partial comes in its group, and refuses a group without them
    (its rows would silently be missing from the output)."""
    from udfs.blocks import merge_partials, search_pairs
    from udfs.local import pair_batches
    from udfs.packing import PACKED_SCHEMA, empty_target_block

    rng = np.random.default_rng(8)
    Q, T, qt, tt = _tables(rng, 30, 90, 4)
    ctx = _ctx(3, "l2", 4, 12, 40, schema=tt.schema)
    q_packed = pa.Table.from_batches(list(pack_blocks(qt.to_batches(), ctx.query, 0)), schema=PACKED_SCHEMA)
    t_packed = pa.Table.from_batches(list(pack_blocks(tt.to_batches(), ctx.target, 1)) + [empty_target_block()],
                                     schema=PACKED_SCHEMA)
    partials = list(search_pairs(pair_batches(q_packed, t_packed, rows_once=False), ctx))
    assert len(partials) == 3 * 4                    # 3 query blocks x (3 target blocks + empty)
    groups: dict[int, list] = {}
    for b in partials:
        groups.setdefault(b.column(C.Q_BLOCK_ID)[0].as_py(), []).append(b)
    for q_id, batches in groups.items():
        carriers = [b.column(C.T_BLOCK_ID)[0].as_py() for b in batches if b.column(C.Q_BLOB)[0].as_py()]
        assert carriers == [C.EMPTY_BLOCK_ID], q_id
    _, want = knn(Q, T, 3, "l2", backend="reference")

    def neighbours(groups_in_order):
        out = pa.Table.from_batches([o for key, bs in groups_in_order for o in merge_partials((key,), bs, ctx)])
        got = {}
        for qid, tid in zip(out.column(0).to_pylist(), out.column(2).to_pylist()):
            got.setdefault(qid, set()).add(tid)
        return got

    for order in (lambda bs: bs, lambda bs: bs[::-1]):   # the rows' partial last, then first
        got = neighbours([(key, order(bs)) for key, bs in groups.items()])
        assert got == {q: set(want[q].tolist()) for q in range(30)}
    key, batches = next(iter(groups.items()))
    without = [b for b in batches if b.column(C.T_BLOCK_ID)[0].as_py() != C.EMPTY_BLOCK_ID]
    with pytest.raises(RuntimeError, match=f"query block {key} has partials but not its rows"):
        list(merge_partials((key,), without, ctx))


def test_a_keyed_broadcast_task_searches_the_union_of_its_target_blocks(monkeypatch):
    # IVF lists over five target blocks, the last 200 rows exact copies of the first 200 (other
    # blocks, same lists), 20 queries equal to targets (ties at distance 0). Each query block
    # is searched once against the union of the blocks, and every list probed returns the
    # exact search's rows, ties to the lower target (the first copy), as exact search ranks them.
    import functools

    from udfs import blocks as B
    from udfs.ivf import pack_listed
    from udfs.local import pair_batches
    from udfs.packing import PACKED_SCHEMA, empty_target_block

    rng = np.random.default_rng(5)
    d, nlist, k, nt, nq = 8, 4, 5, 1000, 90
    centres = rng.standard_normal((nlist, d)).astype(np.float32) * 10
    targets = (centres[rng.integers(0, nlist, nt)] + rng.standard_normal((nt, d))).astype(np.float32)
    targets[800:] = targets[:200]
    queries = (centres[rng.integers(0, nlist, nq)] + rng.standard_normal((nq, d))).astype(np.float32)
    queries[:20] = targets[:20]
    qt = pa.table({"qid": np.arange(nq), "qv": pa.array(list(queries), type=pa.list_(pa.float32()))})
    tt = pa.table({"tid": np.arange(nt), "tv": pa.array(list(targets), type=pa.list_(pa.float32()))})
    q_layout, t_layout = SideLayout("qv", 1, d, 32, group_index=2), SideLayout("tv", 1, d, 210, group_index=2)
    q_pack, t_pack = (functools.partial(pack_listed, centroids=centres, metric="l2", nprobe=p) for p in (nlist, None))
    q_packed = pa.Table.from_batches(list(q_pack(qt.to_batches(max_chunksize=40), layout=q_layout)),
                                     schema=PACKED_SCHEMA)
    t_packed = pa.Table.from_batches(list(t_pack(tt.to_batches(max_chunksize=300), layout=t_layout))
                                     + [empty_target_block()], schema=PACKED_SCHEMA)
    assert t_packed.num_rows - 1 == 5 and q_packed.num_rows == 3
    searches = []
    real = B.grouped_search

    def counted(search, q, *args, **kwargs):
        searches.append((q.shape[0], args[1].shape[0]))
        return real(search, q, *args, **kwargs)

    monkeypatch.setattr(B, "grouped_search", counted)
    ctx = JoinContext(SearchSettings(k, "l2", "cpu"), q_layout, t_layout, "inner", False, tt.schema)
    out = pa.Table.from_batches(list(B.search_broadcast(pair_batches(q_packed, t_packed), ctx)))
    assert searches == [(32, nt), (32, nt), (26, nt)]       # one per query block, every target
    _, expected = knn(queries, targets, k, "l2", backend="reference")
    qid, tid = out.column(0).to_numpy(), out.column(2).to_numpy()
    got = [tid[qid == i].tolist() for i in range(nq)]
    assert got == expected.tolist()
    assert all(row[0] == i for i, row in enumerate(got[:20]))   # the tie at 0: the first copy


@pytest.mark.parametrize("plan", ["broadcast-streamed", "blocked-streamed"])
@pytest.mark.parametrize("join_type", ["inner", "leftouter"])
@pytest.mark.parametrize("partitions", [1, 3])
def test_streamed_plans_match_the_paired_ones(plan, join_type, partitions):
    """The plans whose streamed side reaches the search as rows (each task's first row met by
    every broadcast block) return the paired plan's rows: several blocks on both sides, NULL
    query vectors, one task or several (tasks of no rows: tests/join/test_plans.py)."""
    rng = np.random.default_rng(7)
    Q, T, qt, tt = _tables(rng, 61, 403, 5)
    qt = qt.set_column(1, "qv", pa.array([None if i % 17 == 3 else list(Q[i]) for i in range(61)],
                                         type=pa.list_(pa.float32())))
    ctx = _ctx(4, "l2", 5, 13, 50, join_type, tt.schema)
    paired = local_join(qt, tt, ctx, plan="blocked", partitions=2)
    streamed = local_join(qt, tt, ctx, plan=plan, partitions=partitions)
    key = [(C.output_name(0), "ascending"), (C.output_name(2), "ascending")]
    # 4 of the 61 queries have no vector: no row (inner), one NULL row each (left outer)
    assert streamed.num_rows == paired.num_rows == 57 * 4 + (4 if join_type == "leftouter" else 0)
    assert streamed.sort_by(key).equals(paired.sort_by(key))


def test_streamed_blocks_keep_the_first_row_once_whatever_the_batches():
    """The first row's copies (one per broadcast block) spanning several input batches, and a
    task whose first row met no block (an empty broadcast side): every row once, in order, and
    the blocks complete before the first packed block; no block where one is required fails."""
    from udfs.blocks import streamed_blocks
    from udfs.local import streamed_batches

    rows = pa.table({"a": np.arange(10), "v": pa.array([[float(i)] for i in range(10)], pa.list_(pa.float32()))})
    met = pa.table({"id": np.arange(7, dtype=np.int64) + 100, "blob": [bytes([i]) * 3 for i in range(7)]})
    seen = []

    def pack(batches):
        for batch in batches:
            seen.extend(batch.column(0).to_pylist())
            yield pa.RecordBatch.from_arrays([pa.array([len(seen)], pa.int64()), pa.array([b"x"])],
                                             names=["id", "blob"])

    for chunk in (1, 2, 3, 1000):
        seen.clear()
        blocks, packed = streamed_blocks(streamed_batches(rows, met, max_rows=chunk), pack, 2)
        assert [b for b, _ in blocks] == list(range(100, 107))
        assert [bytes(blob) for _, blob in blocks] == [bytes([i]) * 3 for i in range(7)]
        assert len(list(packed)) >= 1 and seen == list(range(10))
        seen.clear()
        blocks, packed = streamed_blocks(streamed_batches(rows, met.slice(0, 0), max_rows=chunk), pack, 2,
                                         required=False)
        assert blocks == [] and len(list(packed)) >= 1 and seen == list(range(10))
        with pytest.raises(RuntimeError, match="met no broadcast block"):
            streamed_blocks(streamed_batches(rows, met.slice(0, 0), max_rows=chunk), pack, 2)
