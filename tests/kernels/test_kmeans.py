"""k-means of the IVF plan (nearest_kernels.kmeans): the assignment against the float64
oracle on the adversarial inputs, determinism for a seed, spherical centroids, degenerate
samples (duplicates, fewer distinct rows than clusters), routing and errors. No Spark."""
from __future__ import annotations

import numpy as np
import pytest

from nearest_kernels.kmeans import Lloyd, kmeans, route, routing_metric, training_rows
from tests.adversarial import ALL_METRICS, cases, key_scale, oracle_keys

CASES = [c for c in cases(dims=(1, 3, 16, 128)) if c.targets.shape[0] >= 8]
RANK_RTOL = 1e-9   # the cpu kernel ranks by float64 keys; the oracle's own rounding on top


def _assert_nearest(points: np.ndarray, centroids: np.ndarray, metric: str, lists: np.ndarray,
                    probes: int = 1) -> None:
    """``lists`` are each row's ``probes`` nearest centroids of the float64 oracle, nearest first,
    within the kernel's rank tolerance (exactly the oracle's where it has no near-tie)."""
    rmetric = routing_metric(metric)
    keys = oracle_keys(points, centroids, rmetric)
    tol = RANK_RTOL * key_scale(points, centroids, rmetric)[:, None] + 1e-300
    order = np.argsort(keys, axis=1, kind="stable")[:, :probes]
    best = np.take_along_axis(keys, order, axis=1)
    got = np.take_along_axis(keys, lists, axis=1)
    assert np.all(np.abs(got - best) <= tol), "a row's list is not its nearest centroid"
    clear = np.ones(points.shape[0], bool)
    if centroids.shape[0] > probes:
        sorted_keys = np.sort(keys, axis=1)
        clear = np.all(np.diff(sorted_keys[:, :probes + 1], axis=1) > tol, axis=1)
    np.testing.assert_array_equal(lists[clear], order[clear])


@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_assignment_is_the_oracle_nearest_centroid(case, metric):
    n_clusters = min(8, case.targets.shape[0] // 4)
    result = kmeans(case.targets, n_clusters, metric, seed=3)
    points = training_rows(case.targets, metric)
    assert result.centroids.shape == (n_clusters, case.targets.shape[1])
    assert result.centroids.dtype == np.float32 and np.isfinite(result.centroids).all()
    assert result.assignment.shape == (points.shape[0],)
    _assert_nearest(points, result.centroids, metric, result.assignment[:, None])
    # The queries routed to their 3 nearest lists, nearest first.
    probes = min(3, n_clusters)
    lists = route(case.queries, result.centroids, metric, probes)
    # (raw rows: the oracle normalises them itself, in float64, as the kernel does)
    rankable = (lists >= 0).all(axis=1)
    assert rankable.sum() == training_rows(case.queries, metric).shape[0]
    _assert_nearest(case.queries[rankable], result.centroids, metric, lists[rankable], probes)


def test_same_seed_same_centroids_other_seed_other_centroids():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 16)).astype(np.float32)
    a = kmeans(x, 20, seed=7)
    b = kmeans(x, 20, seed=7)
    c = kmeans(x, 20, seed=8)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    np.testing.assert_array_equal(a.assignment, b.assignment)
    assert a.iterations == b.iterations
    assert not np.array_equal(a.centroids, c.centroids)


@pytest.mark.parametrize("metric", ["l2", "cosine", "inner_product"])
def test_a_paused_run_goes_on_as_one_straight_run(metric):
    """Lloyd paused after a few iterations and run on gives kmeans' centroids, assignment and
    iteration count bit for bit, whether the run stops at the cap or converges before it
    (the planner screens with the first iterations' centroids, then trains on)."""
    rng = np.random.default_rng(3)
    isotropic = rng.standard_normal((3000, 16)).astype(np.float32)
    separated = (np.repeat(rng.standard_normal((20, 16)), 150, axis=0)
                 + 0.01 * rng.standard_normal((3000, 16))).astype(np.float32)
    for x in (isotropic, separated):
        for pause, total in ((0, 3), (2, 3), (5, 20), (3, 3)):
            straight = kmeans(x, 30, metric, seed=1, max_iterations=total)
            run = Lloyd(x, 30, metric, seed=1).run(pause)
            early = run.result()
            assert early.iterations == min(pause, straight.iterations)
            resumed = run.run(total).result()
            np.testing.assert_array_equal(resumed.centroids, straight.centroids)
            np.testing.assert_array_equal(resumed.assignment, straight.assignment)
            assert resumed.iterations == straight.iterations
    converged = kmeans(separated, 20, metric, seed=1)
    assert converged.iterations < 20   # the separated set converges: the loop's other exit is covered
    run = Lloyd(separated, 20, metric, seed=1).run(50)
    assert run.converged and run.iterations == converged.iterations and run.rows == separated.shape[0]


@pytest.mark.parametrize("metric", ["l2", "inner_product"])
def test_separated_clusters_are_recovered(metric):
    # 6 blobs far apart (directions far apart for the spherical case): every blob one list.
    rng = np.random.default_rng(5)
    centres = 20.0 * np.eye(6, 12)
    labels = rng.integers(0, 6, 1200)
    x = (centres[labels] + 0.5 * rng.standard_normal((1200, 12))).astype(np.float32)
    result = kmeans(x, 6, metric, seed=0)
    pairs = set(zip(labels.tolist(), result.assignment.tolist()))
    assert len(pairs) == 6 and len({p[1] for p in pairs}) == 6
    if metric == "inner_product":
        np.testing.assert_allclose(np.linalg.norm(result.centroids, axis=1), 1.0, rtol=1e-6)


def test_spherical_training_uses_directions_only():
    # Scaling rows does not change spherical k-means (nor the routing).
    rng = np.random.default_rng(1)
    x = rng.standard_normal((500, 8)).astype(np.float32)
    scales = rng.uniform(0.01, 100.0, (500, 1)).astype(np.float32)
    a = kmeans(x, 5, "cosine", seed=2)
    b = kmeans(x * scales, 5, "inner_product", seed=2)
    np.testing.assert_allclose(a.centroids, b.centroids, atol=1e-5)
    np.testing.assert_array_equal(a.assignment, b.assignment)


def test_duplicates_and_empty_clusters():
    # 3 distinct rows, 5 clusters: the extra centroids duplicate rows and their lists stay
    # empty, which is harmless (ties go to the lower centroid).
    x = np.repeat(np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 5.0]], np.float32), [50, 30, 20], axis=0)
    result = kmeans(x, 5, seed=0)
    assert np.isfinite(result.centroids).all()
    _assert_nearest(x, result.centroids, "l2", result.assignment[:, None])
    counts = np.bincount(result.assignment, minlength=5)
    assert sorted(counts[counts > 0].tolist()) == [20, 30, 50]
    # Every distinct row is a centroid: each row's list holds only its copies.
    for row in np.unique(x, axis=0):
        members = np.flatnonzero((x == row).all(axis=1))
        assert len(set(result.assignment[members].tolist())) == 1


def test_empty_cluster_is_reseeded_with_the_farthest_row():
    from nearest_kernels.kmeans import _update

    points = np.array([[0.0], [1.0], [10.0], [11.0]], np.float32)
    assignment = np.array([0, 0, 0, 0])
    distance = np.array([25.0, 16.0, 25.0, 36.0])
    centroids = _update(points, assignment, distance, 3, spherical=False)
    np.testing.assert_array_equal(centroids[:, 0], [5.5, 11.0, 0.0])   # row 3, then row 0 (tie: lower)


def test_rows_that_cannot_rank_are_left_out_and_routed_nowhere():
    x = np.array([[1.0, 0.0], [np.nan, 1.0], [0.0, 0.0], [0.0, 2.0], [np.inf, 0.0], [3.0, 3.0]], np.float32)
    assert training_rows(x, "l2").shape[0] == 4          # NaN and inf rows out
    assert training_rows(x, "cosine").shape[0] == 3      # and the zero row
    centroids = kmeans(x, 2, "inner_product", seed=0).centroids
    lists = route(x, centroids, "inner_product", 2)
    assert (lists[[1, 4]] == -1).all()
    np.testing.assert_array_equal(lists[2], [0, 1])      # a zero vector under inner product
    assert (route(x, centroids, "cosine", 2)[[1, 2, 4]] == -1).all()
    assert (route(x, centroids, "cosine", 2)[[0, 3, 5]] >= 0).all()


@pytest.mark.parametrize("metric", ALL_METRICS)
def test_float64_input_routes_like_float32(metric):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((300, 5))
    centroids = kmeans(x.astype(np.float32), 4, metric, seed=1).centroids
    lists = route(x, centroids, metric, 2)
    _assert_nearest(x, centroids, metric, lists, 2)
    np.testing.assert_array_equal(lists, route(x.astype(np.float32), centroids, metric, 2))


@pytest.mark.parametrize("bad", [0, 11, True, 2.0])
def test_bad_cluster_count(bad):
    x = np.zeros((10, 2), np.float32) + np.arange(10, dtype=np.float32)[:, None]
    with pytest.raises(ValueError, match="n_clusters: expected an int between 1 and 10"):
        kmeans(x, bad)


def test_bad_iterations_and_input():
    x = np.ones((4, 2), np.float32)
    with pytest.raises(ValueError, match="max_iterations"):
        kmeans(x, 1, max_iterations=-1)
    with pytest.raises(ValueError, match="metric"):
        kmeans(x, 1, "hamming")
    with pytest.raises(TypeError, match="vectors: expected a numpy.ndarray"):
        kmeans([[1.0]], 1)
    with pytest.raises(ValueError, match="n_clusters.*between 1 and 0"):
        kmeans(np.full((3, 2), np.nan, np.float32), 1)


def test_docstring_examples_run():
    import doctest

    from nearest_kernels import kmeans as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
