"""udfs.topk.RowsTopk, the keyed blocked plan's stage 2, without Spark: partials that each hold
some query rows of a block (named by their row ids), merged into those rows, against a
brute-force merge of every partial's candidates; the payload follows its slot through the
compactions; the filled-slot count that triggers them stays the state's."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import udfs.topk
from udfs.topk import RowsTopk, TopkState

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


@pytest.mark.parametrize("max_sources", [udfs.topk.MAX_SOURCES, 1])
def test_partials_merge_into_the_rows_they_name(monkeypatch, max_sources):
    monkeypatch.setattr(udfs.topk, "MAX_SOURCES", max_sources)   # 1: compact after most partials
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
