"""64-bit Arrow offsets (issue 19): ``spark.sql.execution.arrow.useLargeVarTypes=true``.

With that setting Spark sends strings and binaries as ``large_string`` / ``large_binary``,
the packed blocks' blobs included; the codec must read their offsets as int64 (and
``large_list`` vectors' too).
"""
import numpy as np
import pyarrow as pa
import pytest

from nearest_join import nearest_by_join
from tests.oracle import assert_join_true_topk, group_rows
from udfs.decode import binary_values as _binary_values
from udfs.decode import decode_vectors, value_offsets
from udfs.payload import take_rows, vector_matrix

VARIABLE_TYPES = [pa.binary(), pa.large_binary(), pa.string(), pa.large_string(),
                  pa.list_(pa.float32()), pa.large_list(pa.float32())]


def _values(type_):
    if pa.types.is_binary(type_) or pa.types.is_large_binary(type_):
        return [b"ab", b"", None, b"cde", b"f", b"ghij"]
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return ["ab", "", None, "cde", "f", "ghij"]
    return [[1.0, 2.0], [], None, [3.0, 4.0, 5.0], [6.0], [7.0, 8.0, 9.0, 10.0]]


@pytest.mark.parametrize("type_", VARIABLE_TYPES, ids=str)
def test_value_offsets_of_a_sliced_column(type_):
    array = pa.array(_values(type_), type_).slice(2, 3)
    offsets = value_offsets(array)
    wide = "large" in str(type_)
    assert offsets.dtype == (np.int64 if wide else np.int32)
    # The slice's own offsets: lengths 0 (NULL), 3, 1 from absolute position 2 + 0.
    np.testing.assert_array_equal(np.diff(offsets), [0, 3, 1])
    np.testing.assert_array_equal(offsets - offsets[0], [0, 0, 3, 4])
    assert value_offsets(array.slice(3)).tolist() == [int(offsets[-1])]


@pytest.mark.parametrize("type_", [pa.binary(), pa.large_binary()], ids=str)
def test_binary_values_read_64_bit_offsets(type_):
    blobs = [b"first", b"", b"third one", b"4"]
    array = pa.array(blobs, type_)
    assert [v.to_pybytes() for v in _binary_values(array)] == blobs
    assert [v.to_pybytes() for v in _binary_values(array.slice(1, 2))] == blobs[1:3]
    chunked = pa.chunked_array([array.slice(0, 2), array.slice(2)])
    assert [v.to_pybytes() for v in _binary_values(chunked)] == blobs


def test_large_list_vectors_decode_and_gather():
    m = np.arange(18, dtype=np.float32).reshape(6, 3)
    column = pa.array(list(m), pa.large_list(pa.float32())).slice(1, 4)
    np.testing.assert_array_equal(vector_matrix(column), m[1:5])
    np.testing.assert_array_equal(decode_vectors(column, 3), m[1:5])
    table = pa.table({"s": pa.array(["a", "b", "c", "d"], pa.large_string()), "v": column})
    out = take_rows(table, np.array([3, -1, 0]))
    assert out.schema == table.schema
    assert out.column("s").to_pylist() == ["d", None, "a"]
    assert out.column("v").to_pylist() == [m[4].tolist(), None, m[1].tolist()]


@pytest.fixture
def large_var_types(spark):
    key = "spark.sql.execution.arrow.useLargeVarTypes"
    previous = spark.conf.get(key, None)
    spark.conf.set(key, "true")
    yield
    if previous is None:
        spark.conf.unset(key)
    else:
        spark.conf.set(key, previous)


NQ, NT, D, K = 12, 30, 5, 3
PLANS = {
    "broadcast": dict(target_block_rows=8),
    "blocked": dict(broadcast_limit_bytes=0, query_block_rows=5, target_block_rows=8),
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_join_under_large_var_types(spark, large_var_types, plan):
    rng = np.random.default_rng(19)
    Q = rng.standard_normal((NQ, D)).astype(np.float32)
    T = rng.standard_normal((NT, D)).astype(np.float32)
    # A NULL query vector too: its LEFT OUTER row carries the NULL padding of large types.
    q = spark.createDataFrame([(i, f"query {i}", None if i == 0 else Q[i].tolist()) for i in range(NQ)],
                              "qid int, qname string, qv array<float>").repartition(2)
    t = spark.createDataFrame([(i, f"target {i}" * (i % 4), bytes([i]), T[i].tolist()) for i in range(NT)],
                              "tid int, tname string, tbytes binary, tv array<float>").repartition(3)
    rows = nearest_by_join(q, t, "l2", K, vectors=("qv", "tv"), join_type="leftouter",
                           distance_col="d", **PLANS[plan]).collect()
    assert len(rows) == 1 + (NQ - 1) * K
    for r in rows:
        assert r["qname"] == f"query {r['qid']}"
        if r["qid"] == 0:
            assert (r["tid"], r["tname"], r["tbytes"], r["tv"], r["d"]) == (None,) * 5
        else:
            assert (r["tname"], r["tbytes"]) == (f"target {r['tid']}" * (r["tid"] % 4), bytes([r["tid"]]))
            np.testing.assert_array_equal(np.asarray(r["tv"], np.float32), T[r["tid"]])
    ours = group_rows([r for r in rows if r["qid"] != 0], lambda r: r["qid"], lambda r: r["tid"],
                      lambda r: float(r["d"]))
    assert_join_true_topk(ours, Q[1:], T, K, "l2", list(range(1, NQ)), list(range(NT)))
