"""The float64 oracle itself, on cases small enough to compute by hand."""
from __future__ import annotations

import numpy as np
import pytest

from nearest_kernels import METRICS
from nearest_kernels.reference import knn_reference, scores_float64

# Queries q0 = (0, 0), q1 = (1, 2); targets t0 = (3, 4), t1 = (1, 0), t2 = (-2, 2), t3 = (1, 0).
QUERIES = np.array([[0.0, 0.0], [1.0, 2.0]])
TARGETS = np.array([[3.0, 4.0], [1.0, 0.0], [-2.0, 2.0], [1.0, 0.0]])


def test_scores_by_hand():
    # Squared distances: q0 -> 25, 1, 8, 1; q1 -> (2^2 + 2^2), (0 + 2^2), (3^2 + 0), 4.
    sq = [[25.0, 1.0, 8.0, 1.0], [8.0, 4.0, 9.0, 4.0]]
    np.testing.assert_array_equal(scores_float64(QUERIES, TARGETS, METRICS["sqeuclidean"]), sq)
    np.testing.assert_allclose(scores_float64(QUERIES, TARGETS, METRICS["l2"]), np.sqrt(sq))
    # Inner products: q0 -> all 0; q1 -> 3 + 8, 1, -2 + 4, 1.
    np.testing.assert_array_equal(scores_float64(QUERIES, TARGETS, METRICS["inner_product"]),
                                  [[0.0, 0.0, 0.0, 0.0], [11.0, 1.0, 2.0, 1.0]])
    # Cosine of q1 = (1, 2), |q1| = sqrt(5): t0: 11 / (5 sqrt 5); t1: 1 / sqrt 5;
    # t2: 2 / (sqrt 5 * 2 sqrt 2) = 1 / sqrt 10.
    cos = scores_float64(QUERIES[1:], TARGETS, METRICS["cosine"])
    np.testing.assert_allclose(cos, [[11 / (5 * np.sqrt(5)), 1 / np.sqrt(5), 1 / np.sqrt(10),
                                      1 / np.sqrt(5)]], rtol=1e-15)


@pytest.mark.parametrize(
    "metric, values, indices",
    [
        # q0: t1 and t3 tie at 1 (lower index first), then t2 at sqrt 8.
        ("l2", [[1.0, 1.0, np.sqrt(8.0)], [2.0, 2.0, np.sqrt(8.0)]], [[1, 3, 2], [1, 3, 0]]),
        ("sqeuclidean", [[1.0, 1.0, 8.0], [4.0, 4.0, 8.0]], [[1, 3, 2], [1, 3, 0]]),
        # Similarities, largest first; q0 ties everywhere at 0: index order.
        ("inner_product", [[0.0, 0.0, 0.0], [11.0, 2.0, 1.0]], [[0, 1, 2], [0, 2, 1]]),
        # q0 is a zero vector: no cosine match. q1: t0 (0.984), t1 = t3 (0.447), t2 (0.316).
        ("cosine", [[-np.inf] * 3, [11 / (5 * np.sqrt(5)), 1 / np.sqrt(5), 1 / np.sqrt(5)]],
         [[-1, -1, -1], [0, 1, 3]]),
    ],
)
def test_top3_by_hand(metric, values, indices):
    v, i = knn_reference(QUERIES, TARGETS, 3, METRICS[metric])
    assert i.tolist() == indices
    assert v.dtype == np.float32 and i.dtype == np.int64
    np.testing.assert_allclose(v, np.array(values, dtype=np.float32), rtol=1e-7)


@pytest.mark.parametrize("metric", list(METRICS))
def test_padding_and_exclusions_by_hand(metric):
    """A NaN target never matches, k above the remaining targets pads with -1 and the worst
    value, a NaN query gets an all-missing row."""
    queries = np.array([[1.0, 2.0], [np.nan, 0.0]])
    targets = np.array([[3.0, 4.0], [np.nan, 1.0], [1.0, 0.0]])
    v, i = knn_reference(queries, targets, 4, METRICS[metric])
    worst = METRICS[metric].worst
    # q = (1, 2): t0 = (3, 4) is at squared distance 8, inner product 11, cosine 11/(5 sqrt 5);
    # t2 = (1, 0) at squared distance 4, inner product 1, cosine 1/sqrt 5.
    expected = {
        "l2": ([2, 0], [2.0, np.sqrt(8.0)]),
        "sqeuclidean": ([2, 0], [4.0, 8.0]),
        "inner_product": ([0, 2], [11.0, 1.0]),
        "cosine": ([0, 2], [11 / (5 * np.sqrt(5)), 1 / np.sqrt(5)]),
    }[metric]
    assert i.tolist() == [expected[0] + [-1, -1], [-1, -1, -1, -1]]
    np.testing.assert_allclose(v[0, :2], np.array(expected[1], dtype=np.float32), rtol=1e-7)
    assert v[0, 2:].tolist() == [worst, worst] and v[1].tolist() == [worst] * 4
