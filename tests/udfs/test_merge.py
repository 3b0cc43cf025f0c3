"""udfs.merge without Spark: the top-k state of a query block (its fold, its combine of many
parts at once, its wire format) and RowsTopk, the keyed blocked plan's stage 2: partials that
each hold some query rows of a block (named by their row ids), merged into those rows, against
a brute-force merge of every partial's candidates; the payload follows its slot through the
compactions; the filled-slot count that triggers them stays the state's."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import udfs.merge
from udfs import columns as C
from udfs.merge import MAX_SOURCES, RowsTopk, TopkState


# -- the state of one query block ---------------------------------------------------------------

def test_states_without_any_candidate_combine_keep_a_payload_table_and_ship():
    # Query rows with no candidate in two target blocks: the combined state refers to no
    # payload row, yet its NULL payload columns still need the target's column types.
    t1 = pa.table({"x": ["a", "b"], "n": [1, 2]})
    t2 = pa.table({"x": ["c"], "n": [3]})
    empty = np.full((2, 2), -1)
    parts = [TopkState.from_search(np.full((2, 2), np.inf, np.float32), empty, b, t)
             for b, t in enumerate((t1, t2))]
    merged = TopkState.combine(parts, "l2")
    assert merged.keys.tolist() == [[-1, -1], [-1, -1]] and len(merged.sources) == 1
    assert merged.payload.schema == t1.schema
    assert merged.payload.to_pylist() == [{"x": None, "n": None}] * 4
    shipped = TopkState.from_blob(merged.to_blob(), 2)
    assert shipped.keys.tolist() == merged.keys.tolist()
    assert shipped.payload.column(0).type == pa.string() and shipped.payload.num_rows == 4


def test_state_blob_round_trip_and_absorb():
    t1 = pa.table({"x": ["a", "b"]})
    t2 = pa.table({"x": ["c", "d"]})
    s1 = TopkState.from_search(np.array([[1.0, 5.0]], np.float32), np.array([[0, 1]]), 0, t1)
    s2 = TopkState.from_search(np.array([[2.0, np.inf]], np.float32), np.array([[1, -1]]), 1, t2)
    s2 = TopkState.from_blob(s2.to_blob(), 2)
    merged = s1.absorb(s2, "l2")
    assert merged.values.tolist() == [[1.0, 2.0]]
    assert merged.keys.tolist() == [[0, (1 << C.ROW_BITS) | 1]]
    assert merged.payload.column(0).to_pylist() == ["a", "d"]


def test_state_ships_each_payload_row_once_and_folds_many_blocks():
    rng = np.random.default_rng(9)
    nq, k, d = 7, 4, 3
    tables = [pa.table({"tid": np.arange(10) + 100 * b,
                        "tv": pa.array(list(rng.standard_normal((10, d)).astype(np.float32)),
                                       type=pa.list_(pa.float32()))}) for b in range(MAX_SOURCES + 3)]
    state, expected = None, []
    for b, table in enumerate(tables):
        rows = rng.integers(-1, 3, (nq, k))          # few distinct rows: shared by query rows
        values = np.where(rows >= 0, rng.random((nq, k)), np.inf).astype(np.float32)
        values.sort(axis=1)
        part = TopkState.from_search(values, rows, b, table)
        shipped = TopkState.from_blob(part.to_blob(), k)
        assert shipped.sources[0].num_rows == len(np.unique(rows[rows >= 0]))
        assert shipped.payload.equals(part.payload.rename_columns(shipped.payload.column_names))
        state = shipped if state is None else state.absorb(shipped, "l2")
        assert len(state.sources) <= MAX_SOURCES
        expected += [(float(values[i, j]), i, int(table.column(0)[rows[i, j]].as_py()))
                     for i in range(nq) for j in range(k) if rows[i, j] >= 0]
    payload_ids = state.payload.column(0).to_pylist()
    for i in range(nq):
        mine = sorted((v, tid) for v, q, tid in expected if q == i)[:k]
        got = [(float(state.values[i, j]), payload_ids[i * k + j]) for j in range(k) if state.keys[i, j] >= 0]
        assert [v for v, _ in got] == pytest.approx([v for v, _ in mine])
        # every slot's payload belongs to the key it ranks
        for j in range(k):
            if state.keys[i, j] >= 0:
                block, row = state.keys[i, j] >> C.ROW_BITS, state.keys[i, j] & ((1 << C.ROW_BITS) - 1)
                assert payload_ids[i * k + j] == 100 * block + row


@pytest.mark.parametrize("metric", ["l2", "inner_product"])
def test_combining_many_states_at_once_equals_folding_them_one_by_one(metric):
    rng = np.random.default_rng(31)
    nq, k = 9, 5
    states = []
    for b in range(6):
        table = pa.table({"tid": np.arange(20) + 100 * b, "tag": [f"b{b}r{i}" for i in range(20)]})
        rows = rng.integers(-1, 20, (nq, k))
        values = np.where(rows >= 0, rng.integers(0, 6, (nq, k)) / 5, np.nan).astype(np.float32)  # ties
        worst = -np.inf if metric == "inner_product" else np.inf
        values = np.where(rows >= 0, values, worst)
        order = np.argsort(-values if metric == "inner_product" else values, axis=1, kind="stable")
        part = TopkState.from_search(np.take_along_axis(values, order, 1), np.take_along_axis(rows, order, 1),
                                     b, table)
        states.append(TopkState.from_blob(part.to_blob(), k) if b % 2 else part)
    at_once = TopkState.combine(states, metric)
    one_by_one = states[0]
    for s in states[1:]:
        one_by_one = one_by_one.absorb(s, metric)
    np.testing.assert_array_equal(at_once.keys, one_by_one.keys)
    np.testing.assert_array_equal(at_once.values, one_by_one.values)
    assert at_once.payload.to_pylist() == one_by_one.payload.rename_columns(
        at_once.payload.column_names).to_pylist()


# -- the keyed blocked plan's stage 2 ----------------------------------------------------------

K = 4


def _partial(rng, ids: np.ndarray, next_key: list[int]) -> TopkState:
    """A partial of rows ``ids``: up to K candidates each (some slots empty), distinct target
    keys, values with ties; its payload row holds the candidate's key."""
    n = ids.size
    filled = rng.integers(0, K + 1, n)
    values = np.full((n, K), np.inf, np.float32)
    keys = np.full((n, K), -1, np.int64)
    rows = np.zeros((n, K), np.int64)
    source = np.full((n, K), -1, np.int32)
    payload = []
    for i in range(n):
        got = np.sort(rng.integers(0, 6, filled[i]).astype(np.float32))   # ties among values
        for j, value in enumerate(got):
            values[i, j], keys[i, j] = value, next_key[0]
            rows[i, j], source[i, j] = len(payload), 0
            payload.append(next_key[0])
            next_key[0] += 1
    table = pa.table({"key": pa.array(payload, pa.int64())})
    return TopkState(values, keys, [table], source, rows, ids.astype(np.int64))


@pytest.mark.parametrize("max_sources", [udfs.merge.MAX_SOURCES, 1])
def test_partials_merge_into_the_rows_they_name(monkeypatch, max_sources):
    monkeypatch.setattr(udfs.merge, "MAX_SOURCES", max_sources)   # 1: compact after most partials
    rng = np.random.default_rng(7)
    state = RowsTopk(K, "l2")
    seen: dict[int, list[tuple[float, int]]] = {}
    next_key = [0]
    for _ in range(30):
        ids = rng.choice(200, rng.integers(1, 40), replace=False) + 1000
        part = _partial(rng, ids, next_key)
        for i, row in enumerate(ids):
            seen.setdefault(int(row), []).extend(
                (float(v), int(t)) for v, t in zip(part.values[i], part.keys[i]) if t >= 0)
        state.absorb(part)
        held = state.keys[: state.rows_held]
        assert state._filled == int((held >= 0).sum())
    assert sorted(state.ids.tolist()) == sorted(seen)
    n = state.rows_held
    flat = TopkState(state.values[:n], state.keys[:n], state.sources, state.source[:n], state.rows[:n])
    payload = flat.payload.column("key").to_pylist()
    for row, slot in zip(state.ids.tolist(), state._slot_of.tolist()):
        want = sorted(seen[row])[:K]     # smallest values, ties to the lower key
        got = [(float(v), int(t)) for v, t in zip(state.values[slot], state.keys[slot]) if t >= 0]
        assert got == want, row
        assert payload[slot * K: slot * K + len(got)] == [t for _, t in got], row
    if max_sources == 1:
        assert len(state.sources) <= 2   # compacted along the way
