"""Arrow vector columns decode as Spark's vector functions see them."""
import re

import numpy as np
import pyarrow as pa
import pytest

from udfs.decode import SMALLEST_FLOAT64, VectorDimensionError, VectorRangeError, decode_vectors

ML_VECTOR = pa.struct([("type", pa.int8()), ("size", pa.int32()),
                       ("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float64()))])


@pytest.mark.parametrize("list_type", [pa.list_(pa.float32()), pa.large_list(pa.float32()),
                                       pa.list_(pa.float64())], ids=str)
def test_lists_with_nulls(list_type):
    arr = pa.array([[1.0, 2.0], None, [None, 3.0], [4.0, 5.0]], type=list_type)
    out = decode_vectors(arr, 2)
    assert out.dtype == (np.float32 if list_type.value_type == pa.float32() else np.float64)
    np.testing.assert_array_equal(out, [[1, 2], [np.nan, np.nan], [np.nan, 3], [4, 5]])
    np.testing.assert_array_equal(decode_vectors(arr.slice(2), None), [[np.nan, 3], [4, 5]])


def test_fixed_size_list():
    arr = pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3, 4, 5, 6], pa.float32()), 3)
    np.testing.assert_array_equal(decode_vectors(arr, 3), [[1, 2, 3], [4, 5, 6]])


def test_ragged_row_names_column_and_dimensions():
    arr = pa.array([[1.0, 2.0], [1.0, 2.0, 3.0]], type=pa.list_(pa.float32()))
    with pytest.raises(VectorDimensionError, match=r"column `qv` has a vector of dimension 3 and "
                                                    r"target column `tv` has dimension 2"):
        decode_vectors(arr, 2, label="qv", expected_from="target column `tv`")
    with pytest.raises(VectorDimensionError, match="dimension 3 and the first vector of `qv` has dimension 2"):
        decode_vectors(arr, None, label="qv")


def test_ml_vectors_dense_sparse_null():
    arr = pa.array([
        {"type": 1, "size": None, "indices": None, "values": [1.0, 2.0, 3.0]},
        None,
        {"type": 0, "size": 3, "indices": [0, 2], "values": [7.0, 9.0]},
    ], type=ML_VECTOR)
    np.testing.assert_array_equal(decode_vectors(arr, 3), [[1, 2, 3], [np.nan] * 3, [7, 0, 9]])
    np.testing.assert_array_equal(decode_vectors(arr.slice(1), None), [[np.nan] * 3, [7, 0, 9]])
    with pytest.raises(VectorDimensionError):
        decode_vectors(arr, 4, label="v")


def test_empty_and_all_null():
    assert decode_vectors(pa.array([], type=pa.list_(pa.float32())), 5).shape == (0, 5)
    out = decode_vectors(pa.array([None, None], type=pa.list_(pa.float32())), 2)
    assert out.shape == (2, 2) and np.isnan(out).all()


@pytest.mark.parametrize("list_type", [pa.list_(pa.float32()), pa.large_list(pa.float64())], ids=str)
def test_lists_without_null_lists_slices_and_ragged_rows(list_type):
    # No NULL list: lengths come from the slice's own offsets (a ragged row outside the slice
    # does not count), NULL elements still become NaN.
    arr = pa.array([[1.0, 2.0], [3.0, 4.0, 5.0], [6.0, None], [7.0, 8.0], [9.0, 10.0]], type=list_type)
    assert arr.null_count == 0
    np.testing.assert_array_equal(decode_vectors(arr.slice(2), 2), [[6, np.nan], [7, 8], [9, 10]])
    np.testing.assert_array_equal(decode_vectors(arr.slice(3, 2), None), [[7, 8], [9, 10]])
    with pytest.raises(VectorDimensionError,
                       match="column `v` has a vector of dimension 3 and the other side has dimension 2"):
        decode_vectors(arr.slice(0, 3), 2, label="v")
    with pytest.raises(VectorDimensionError, match="dimension 2 and the first vector of `v` has dimension 3"):
        decode_vectors(arr.slice(1), None, label="v")


def test_float32_lists_decode_without_a_copy():
    values = np.arange(12, dtype=np.float32)
    arr = pa.ListArray.from_arrays(pa.array([0, 3, 6, 9, 12], pa.int32()), pa.array(values))
    out = decode_vectors(arr, 3)
    np.testing.assert_array_equal(out, values.reshape(4, 3))
    assert np.shares_memory(out, arr.values.to_numpy())


@pytest.mark.parametrize("column", [
    pa.array([None, None, None], type=pa.list_(pa.float32())),
    pa.array([None, None, None], type=pa.large_list(pa.float32())),
    pa.array([None, None, None], type=ML_VECTOR),
], ids=["list", "large_list", "ml_vector"])
def test_all_null_column_without_a_dimension(column):
    # No vector, so no dimension (the join's is unknown when both sides are all NULL): one
    # NaN column still marks every row as never a candidate (a width-0 matrix could not).
    out = decode_vectors(column, None)
    assert out.shape == (3, 1) and np.isnan(out).all()
    assert decode_vectors(column.slice(1, 0), None).shape == (0, 1)


@pytest.mark.parametrize("list_type", [pa.list_(pa.float32()), pa.large_list(pa.float64())], ids=str)
def test_empty_vectors_decode_as_one_zero_column(list_type):
    # Dimension 0: the zero coordinate keeps l2 and the inner product at 0 (Spark's value for
    # two empty vectors) and NULL rows NaN.
    np.testing.assert_array_equal(decode_vectors(pa.array([[], []], type=list_type), 0),
                                  [[0.0], [0.0]])
    np.testing.assert_array_equal(decode_vectors(pa.array([[], None, []], type=list_type), None),
                                  [[0.0], [np.nan], [0.0]])
    with pytest.raises(VectorDimensionError, match="dimension 1 and the first vector of `v` has dimension 0"):
        decode_vectors(pa.array([[], [1.0]], type=list_type), None, label="v")


@pytest.mark.parametrize("tiny", [np.nextafter(SMALLEST_FLOAT64, 0), -1e-300, 5e-324], ids=repr)
def test_a_float64_element_too_small_for_the_kernels_is_refused(tiny):
    # Rows that differ only in such elements would need a scale beyond float64's range: the
    # kernels lost them (no neighbour, a silent gap) or failed with an overflow. 0, NaN (a NULL
    # element), a NULL row, float32 subnormals and the smallest magnitude allowed decode.
    fine = [[1.0, 0.0], [SMALLEST_FLOAT64, -SMALLEST_FLOAT64], None, [None, 2.0]]
    np.testing.assert_array_equal(decode_vectors(pa.array(fine, type=pa.list_(pa.float64())), 2)[:2],
                                  [[1.0, 0.0], [SMALLEST_FLOAT64, -SMALLEST_FLOAT64]])
    assert decode_vectors(pa.array([[1e-45, 0.0]], type=pa.list_(pa.float32())), 2)[0, 0] > 0
    for arr in (pa.array(fine + [[1.0, tiny]], type=pa.list_(pa.float64())),
                pa.array([[1.0, 2.0], [tiny, 0.0]], type=pa.large_list(pa.float64())),
                pa.array([{"type": 1, "size": None, "indices": None, "values": [tiny, 1.0]}], type=ML_VECTOR)):
        with pytest.raises(VectorRangeError, match=r"\[VECTOR_ELEMENT_OUT_OF_RANGE\] column `tv` holds the float64 "
                                                   rf"element {re.escape(repr(float(tiny)))}: expected 0 or a magnitude of at least 2\^-960"):
            decode_vectors(arr, None, label="tv")
