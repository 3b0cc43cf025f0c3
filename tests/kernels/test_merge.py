"""merge_topk: partial top-k of target blocks merged with offsets equals one search."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from nearest_kernels import METRICS, knn, merge_topk
from tests.kernels.test_knn import check_knn


def seeded_rng(request) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def split_search(queries, targets, k, metric, backend, bounds, **merge_options):
    """knn on each target block [bounds[i], bounds[i+1]), then one merge with offsets."""
    parts = [knn(queries, targets[a:b], k, metric, backend=backend)
             for a, b in zip(bounds[:-1], bounds[1:])]
    return merge_topk([v for v, _ in parts], [i for _, i in parts], k, metric,
                      offsets=list(bounds[:-1]), **merge_options)


@pytest.mark.parametrize("k", [1, 7, 500])
@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_merged_blocks_equal_one_search(request, backend, metric, k):
    """Small integers keep every float32 sum exact, so the split cannot change a value and ties
    abound: the merge must resolve them by the lower global index exactly like one search.
    Blocks have awkward sizes; one is smaller than k and k=500 exceeds the 450 targets."""
    rng = seeded_rng(request)
    queries = rng.integers(-3, 4, size=(25, 5)).astype(np.float32)
    targets = rng.integers(-3, 4, size=(450, 5)).astype(np.float32)
    queries[0] = 0.0  # a zero query: no match for cosine, all targets tie for inner product
    targets[[3, 200]] = 0.0  # zero targets: excluded for cosine only
    whole_v, whole_i = knn(queries, targets, k, metric, backend=backend)
    merged_v, merged_i = split_search(queries, targets, k, metric, backend, [0, 5, 163, 450])
    if metric == "cosine":
        # Cosine values are rounded (normalised vectors), but one block's rounding is another's:
        # each target is normalised alone, so values match to float32 rounding of the scores.
        # Slots whose value is within 1e-5 of a neighbour may swap; all others must agree.
        np.testing.assert_allclose(merged_v, whole_v, rtol=0, atol=1e-6)
        finite = np.where(np.isfinite(whole_v), whole_v, 10.0)
        apart = np.abs(np.diff(finite, axis=1)) > 1e-5
        edge = np.ones((finite.shape[0], 1), dtype=bool)
        settled = np.hstack([apart, edge]) & np.hstack([edge, apart])
        np.testing.assert_array_equal(merged_i[settled], whole_i[settled])
        np.testing.assert_array_equal(merged_i == -1, whole_i == -1)
    else:
        np.testing.assert_array_equal(merged_i, whole_i)
        np.testing.assert_array_equal(merged_v, whole_v)


@pytest.mark.parametrize("metric", list(METRICS))
def test_merged_random_blocks_match_reference(request, metric):
    """Random data through the cpu backend: merged blocks pass the same checks against the
    float64 reference as one search (tolerances and near ties as in test_knn)."""
    rng = seeded_rng(request)
    queries = rng.standard_normal((40, 16)).astype(np.float32)
    targets = rng.standard_normal((3001, 16)).astype(np.float32)
    v, i = split_search(queries, targets, 10, metric, "cpu", [0, 1100, 1101, 3001])
    check_knn(queries, targets, 10, metric, v, i, "cpu")


def test_return_sources_points_into_the_concatenated_parts():
    values = [np.array([[1.0, 5.0], [2.0, np.inf]], np.float32),
              np.array([[1.0, 3.0, 9.0], [np.inf, np.inf, np.inf]], np.float32)]
    indices = [np.array([[4, 0], [1, -1]]), np.array([[2, 0, 1], [-1, -1, -1]])]
    v, i, sources = merge_topk(values, indices, 4, "l2", offsets=[0, 100], return_sources=True)
    # The two 1.0 tie: global 4 beats 102. Row 1 has a single candidate, then empty slots.
    assert i.tolist() == [[4, 102, 100, 0], [1, -1, -1, -1]]
    assert v.tolist() == [[1.0, 1.0, 3.0, 5.0], [2.0, np.inf, np.inf, np.inf]]
    assert sources.tolist() == [[0, 2, 3, 1], [0, -1, -1, -1]]
    concatenated = np.concatenate(values, axis=1)
    found = sources >= 0
    gathered = np.take_along_axis(concatenated, np.maximum(sources, 0), axis=1)
    np.testing.assert_array_equal(gathered[found], v[found])


def test_similarities_merge_largest_first():
    v, i = merge_topk([np.array([[0.9, 0.1]]), np.array([[0.5, -np.inf]])],
                      [np.array([[3, 1]]), np.array([[0, -1]])], 3, "cosine", offsets=[10, 0])
    assert i.tolist() == [[13, 0, 11]]
    assert v.tolist() == [[pytest.approx(0.9), 0.5, pytest.approx(0.1)]]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: merge_topk([], [], 1), r"values, indices: expected the same non-zero number"),
        (lambda: merge_topk([np.zeros((1, 1))], [], 1), r"got 1 and 0"),
        (lambda: merge_topk([np.zeros((1, 1))], [np.zeros((1, 1), np.int64)], 1, offsets=[0, 1]),
         r"offsets: expected 1 offsets, got 2"),
        (lambda: merge_topk([np.zeros((1, 2))], [np.zeros((1, 1), np.int64)], 1),
         r"values, indices: expected matching"),
        (lambda: merge_topk([np.zeros((1, 1))], [np.zeros((1, 1), np.int64)], 1, "hamming"),
         r"metric: expected one of"),
    ],
    ids=["no_parts", "count_mismatch", "offsets", "shape_mismatch", "metric"],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("metric", ["l2", "inner_product"])
@pytest.mark.parametrize("levels", [3, 1000, None])
def test_fast_ordering_equals_lexsort_with_ties_and_empty_slots(metric, levels):
    """The argsort-first ordering must give lexsort's answer, ties (few value levels) included."""
    rng = np.random.default_rng(0 if levels is None else levels)
    nq, k = 400, 6
    parts_v, parts_i = [], []
    for p in range(3):
        raw = rng.random((nq, k)) if levels is None else rng.integers(0, levels, (nq, k)) / levels
        idx = rng.permutation(10_000)[: nq * k].reshape(nq, k) + 10_000 * p
        empty = rng.random((nq, k)) < 0.1
        descending = metric == "inner_product"
        vals = np.where(empty, -np.inf if descending else np.inf, raw).astype(np.float32)
        idx = np.where(empty, -1, idx)
        order = np.lexsort((np.where(empty, np.iinfo(np.int64).max, idx), -vals if descending else vals), axis=1)
        parts_v.append(np.take_along_axis(vals, order, 1))
        parts_i.append(np.take_along_axis(idx, order, 1))
    v, i = merge_topk(parts_v, parts_i, k, metric)
    all_v, all_i = np.concatenate(parts_v, 1), np.concatenate(parts_i, 1)
    valid = all_i >= 0
    primary = np.where(valid, -all_v if metric == "inner_product" else all_v, np.inf)
    ref = np.lexsort((np.where(valid, all_i, np.iinfo(np.int64).max), primary), axis=1)[:, :k]
    np.testing.assert_array_equal(i, np.take_along_axis(all_i, ref, 1))


@pytest.mark.parametrize("metric", ["l2", "inner_product"])
def test_rows_out_of_order_or_with_nan_values_are_sorted_not_merged(metric):
    """The compiled merge takes parts as best first; rows where a part is out of order or
    holds a NaN value must still get the full sort's answer (lexsort, NaN last), sources
    included, while sorted rows beside them are merged."""
    rng = np.random.default_rng(5)
    nq, k = 300, 5
    descending = metric == "inner_product"
    parts_v, parts_i = [], []
    for p in range(3):
        vals = rng.integers(0, 4, (nq, k)).astype(np.float32)        # ties
        idx = rng.permutation(5_000)[: nq * k].reshape(nq, k) + 5_000 * p
        order = np.lexsort((idx, -vals if descending else vals), axis=1)
        vals, idx = np.take_along_axis(vals, order, 1), np.take_along_axis(idx, order, 1)
        parts_v.append(vals)
        parts_i.append(idx)
    parts_v[1][:40] = parts_v[1][:40, ::-1]          # out of order (reversed)
    parts_i[1][:40] = parts_i[1][:40, ::-1]
    parts_v[2][40:60, 2] = np.nan                    # NaN values in valid slots
    parts_i[0][60:80, 3:] = -1                       # empty slots at the end: still in order
    v, i, sources = merge_topk(parts_v, parts_i, k, metric, return_sources=True)
    all_v, all_i = np.concatenate(parts_v, 1), np.concatenate(parts_i, 1)
    valid = all_i >= 0
    primary = np.where(valid, -all_v if descending else all_v, np.inf)
    ref = np.lexsort((np.where(valid, all_i, np.iinfo(np.int64).max), primary), axis=1)[:, :k]
    ref_i = np.take_along_axis(all_i, ref, 1)
    np.testing.assert_array_equal(i, ref_i)
    np.testing.assert_array_equal(sources, np.where(ref_i >= 0, ref, -1))
    np.testing.assert_array_equal(v[ref_i >= 0], np.take_along_axis(all_v, ref, 1)[ref_i >= 0])
