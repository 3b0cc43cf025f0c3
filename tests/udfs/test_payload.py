"""udfs.payload: row gathers from one or several payload tables, against Arrow's own take."""
import numpy as np
import pyarrow as pa
import pytest

from udfs.payload import copy_into, gather_rows, take_matrices, take_matrix, take_rows, vector_matrix


def _payload(rng, n, d, offset):
    m = rng.standard_normal((n, d)).astype(np.float32)
    return pa.table({
        "id": np.arange(offset, offset + n),
        "name": [f"row{offset + i}" if i % 5 else None for i in range(n)],
        "v": pa.array(list(m), type=pa.list_(pa.float32())),
        "fixed": pa.FixedSizeListArray.from_arrays(pa.array(m.reshape(-1).astype(np.float64)), d),
        "large": pa.array(list(m), type=pa.large_list(pa.float32())),
    })


def _expected(sources, source, rows):
    """Row by row through Arrow: the slow, obvious answer."""
    out = []
    for s, r in zip(source, rows):
        out.append(None if s < 0 else sources[s].slice(int(r), 1).to_pylist()[0])
    return out


@pytest.mark.parametrize("n_sources", [1, 3])
def test_gather_rows_matches_row_by_row_take(n_sources):
    rng = np.random.default_rng(n_sources)
    sources = [_payload(rng, 40 + 7 * s, 5, 1000 * s) for s in range(n_sources)]
    n = 300
    source = rng.integers(-1, n_sources, n)
    rows = np.array([rng.integers(0, sources[s].num_rows) if s >= 0 else 0 for s in source])
    columns = gather_rows(sources, source, rows, threads=3)
    got = pa.Table.from_arrays(columns, schema=sources[0].schema).to_pylist()
    want = _expected(sources, source, rows)
    for g, w in zip(got, want):
        if w is None:
            assert all(v is None for v in g.values())
        else:
            assert g == w


def test_ragged_float_lists_with_a_matching_total_take_the_generic_path():
    # lengths 2, 1, 3 total 6 = 3 x 2: a first-length-and-total check would read them as
    # three 2-vectors and gather garbage.
    column = pa.array([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0]], type=pa.list_(pa.float32()))
    assert vector_matrix(column) is None
    table = pa.table({"v": column})
    assert take_rows(table, np.array([2, -1, 0])).column(0).to_pylist() == [[4.0, 5.0, 6.0], None, [1.0, 2.0]]


def test_vector_matrix_is_a_zero_copy_view_of_a_sliced_column():
    m = np.arange(24, dtype=np.float32).reshape(6, 4)
    for column in (pa.array(list(m), type=pa.list_(pa.float32())),
                   pa.FixedSizeListArray.from_arrays(pa.array(m.reshape(-1)), 4)):
        view = vector_matrix(column.slice(2, 3))
        np.testing.assert_array_equal(view, m[2:5])
    assert vector_matrix(pa.array([[1.0], None], type=pa.list_(pa.float32()))) is None


def test_threaded_matrix_take_and_copy_equal_numpy():
    rng = np.random.default_rng(5)
    m = rng.standard_normal((5000, 600)).astype(np.float32)   # 12 MB: above PARALLEL_BYTES
    rows = rng.integers(0, 5000, 6000)
    out = np.empty((6000, 600), np.float32)
    take_matrix(m, rows, out, threads=4)
    np.testing.assert_array_equal(out, m[rows])
    out64 = np.empty((5000, 600), np.float32)
    copy_into(out64, m.astype(np.float64), threads=4)
    np.testing.assert_array_equal(out64, m)
    mats = [m, m[::-1].copy(), m[:100].copy()]
    source = rng.integers(-1, 3, 6000)
    rows2 = np.where(source == 2, rows % 100, rows)
    take_matrices(mats, source, rows2, out, threads=4)
    want = np.stack([mats[s][r] if s >= 0 else np.zeros(600, np.float32) for s, r in zip(source, rows2)])
    np.testing.assert_array_equal(out, want)


def test_compiled_row_copy_equals_numpy_and_checks_its_indices():
    from nearest_kernels.gather import take_rows as compiled_take

    rng = np.random.default_rng(6)
    for dtype in (np.float32, np.float64):
        m = rng.standard_normal((300, 7)).astype(dtype)
        strided = m[:, ::2]                       # a non-contiguous source
        rows = rng.integers(0, 300, 500)
        out = np.empty((500, strided.shape[1]), dtype)
        compiled_take(strided, rows, out)
        np.testing.assert_array_equal(out, strided[rows])
    out = np.empty((2, 7), np.float32)
    m = np.zeros((300, 7), np.float32)
    with pytest.raises(IndexError, match="row 300 outside 0..299"):
        compiled_take(m, np.array([0, 300]), out)
    with pytest.raises(IndexError, match="row -1"):
        compiled_take(m, np.array([-1, 3]), out)
    with pytest.raises(ValueError, match="do not match"):
        compiled_take(m, np.array([1, 2]), np.empty((2, 7), np.float64))
    # One source among several: take_matrices copies straight through, the same rows.
    one = np.empty((500, 7), np.float32)
    take_matrices([m + 1, m], np.zeros(500, np.int64), rng.integers(0, 300, 500), one, threads=1)
    np.testing.assert_array_equal(one, np.ones((500, 7), np.float32))
    # Rows of one source into their positions (several sources fill one output).
    from nearest_kernels.gather import take_rows_at

    src = rng.standard_normal((300, 7))[:, ::2]          # float64, non-contiguous
    out = np.full((50, 4), -1.0)
    positions, rows = rng.permutation(50)[:20], rng.integers(0, 300, 20)
    take_rows_at(src, rows, positions, out)
    want = np.full((50, 4), -1.0)
    want[positions] = src[rows]
    np.testing.assert_array_equal(out, want)
    with pytest.raises(IndexError, match="position 50 outside 0..49"):
        take_rows_at(src, np.array([0, 1]), np.array([3, 50]), out)
    with pytest.raises(IndexError, match="row 300 outside 0..299"):
        take_rows_at(src, np.array([300]), np.array([3]), out)
    with pytest.raises(ValueError, match="positions"):
        take_rows_at(src, np.array([1]), np.array([3]), out.astype(np.float32))


def test_distinct_rows_of_a_state_equal_numpy_and_check_their_range():
    """A shipped state's distinct (source, row) pairs in (source, row) order and each slot's
    position among them, against a numpy reference: several sources, repeats, empty slots;
    a slot outside its source raises."""
    from nearest_kernels.gather import distinct_rows

    rng = np.random.default_rng(3)
    sizes = [40, 0, 25, 60]
    source = rng.choice([0, 2, 3], 500).astype(np.int32)
    rows = np.array([rng.integers(0, sizes[s]) for s in source])
    source[rng.random(500) < 0.2] = -1
    out_source, out_row, payload_row = distinct_rows(source, rows, sizes)
    filled = source >= 0
    pairs = sorted(set(zip(source[filled].tolist(), rows[filled].tolist())))
    assert list(zip(out_source.tolist(), out_row.tolist())) == pairs
    where = {pair: i for i, pair in enumerate(pairs)}
    want = [where[(s, r)] if s >= 0 else -1 for s, r in zip(source.tolist(), rows.tolist())]
    assert payload_row.tolist() == want
    empty = distinct_rows(np.full(4, -1, np.int32), np.zeros(4, np.int64), sizes)
    assert empty[0].size == 0 and empty[2].tolist() == [-1] * 4
    with pytest.raises(IndexError, match="1 slots refer"):
        distinct_rows(np.array([0, 2], np.int32), np.array([3, 25]), sizes)
    with pytest.raises(IndexError, match="1 slots refer"):
        distinct_rows(np.array([4], np.int32), np.array([0]), sizes)


def test_large_gathers_split_their_rows_over_the_threads(monkeypatch):
    """A large gather runs the compiled copy over the task's threads, in contiguous ranges that
    cover every row once (each source's rows into their positions when several fill one
    output); numpy's rows either way."""
    from nearest_kernels import gather

    ranges = []
    real = gather._gather_kernels.take_rows_at
    monkeypatch.setattr(gather._gather_kernels, "take_rows_at",
                        lambda lo, hi, *a: (ranges.append((lo, hi)), real(lo, hi, *a)))
    rng = np.random.default_rng(7)
    m = rng.standard_normal((5000, 600)).astype(np.float32)    # 12 MB: above PARALLEL_BYTES
    rows = rng.integers(0, 5000, 6000)
    out = np.empty((6000, 600), np.float32)
    take_matrix(m, rows, out, threads=4)
    np.testing.assert_array_equal(out, m[rows])
    assert sorted(ranges) == [(0, 1500), (1500, 3000), (3000, 4500), (4500, 6000)]
    at_ranges = []
    monkeypatch.setattr(gather._gather_kernels, "take_rows_at",
                        lambda lo, hi, *a: (at_ranges.append((lo, hi)), real(lo, hi, *a)))
    mats = [m, m[::-1].copy(), m[:100].copy()]
    source = rng.integers(-1, 3, 6000)
    rows2 = np.where(source == 2, rows % 100, rows)
    out[:] = np.nan
    take_matrices(mats, source, rows2, out, threads=4)
    want = np.stack([mats[s][r] if s >= 0 else np.zeros(600, np.float32) for s, r in zip(source, rows2)])
    np.testing.assert_array_equal(out, want)
    assert len(at_ranges) == 3 * 4
