"""k-means for the IVF plan's lists: centroids of a sample, assigned with our own exact kernel.

:func:`kmeans` clusters a sample of the target into ``n_clusters`` lists; the IVF plan
(:mod:`nearest_join.ivf`) then assigns every target row to its nearest centroid and routes
every query to its ``nprobe`` nearest ones. Three properties matter more than speed here:

* **Exact assignment.** The assignment step is :func:`nearest_kernels.knn` with k=1 on
  the cpu backend: the true nearest centroid of the float64 difference form, ties to the lower
  centroid. Training, target assignment and query routing all use that one kernel
  (:func:`route`), so a row's list is the same on the driver and on every executor.
* **Deterministic for a seed.** Seeded k-means++ initialisation (``numpy.random.default_rng``;
  drawn from a seeded subsample of ``INIT_ROWS_PER_CLUSTER`` rows per cluster),
  a fixed iteration cap, float64 centroid sums in row order, and an empty cluster re-seeded
  with the row farthest from its centroid (ties to the lower row): the same sample and seed
  give the same centroids, bit for bit, on any machine.
* **Spherical k-means for the similarities.** ``cosine`` and ``inner_product`` cluster the
  *normalised* copies of the rows, keep unit centroids, and route by cosine. For cosine that
  is the metric itself. Inner product on unnormalised data has no such geometry (a long
  vector can beat a close one), so its lists are built and probed by direction only, while
  the ranking inside the probed lists is the exact inner product: only the candidate set is
  approximate, and the recall estimate of the plan measures how much that costs. A zero
  vector has no direction; it cannot rank under cosine, and under inner product it goes to
  list 0 (its score is 0 against every query, so any list is as good).

Pure numpy + numba (the cpu backend's kernels); no pyspark.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from . import cpu  # noqa: F401  (first: it points numba's cache at a writable directory)
from ._common import as_matrix, resolve_metric
from ._numba import frozen, run_split
from .cpu import default_threads

from ._numba import import_numba

import_numba()
from numba import njit  # noqa: E402
from .dispatch import knn

__all__ = ["MAX_ITERATIONS", "KMeansResult", "Lloyd", "kmeans", "route", "routing_metric", "training_rows"]

# Lloyd iterations at most: the lists only need to be good enough for routing, and the recall
# estimate picks nprobe for whatever lists came out (faiss's IVF training runs 10 to 25).
MAX_ITERATIONS = 20
# k-means++ draws its centres from at most this many rows per cluster (a seeded subsample):
# each centre costs one pass over the rows it draws from, and the Lloyd iterations that
# follow move the centres anyway.
INIT_ROWS_PER_CLUSTER = 8


def routing_metric(metric: str) -> str:
    """The metric lists are trained and probed with: ``l2`` for the l2 family (sqeuclidean
    has the same order), ``cosine`` for cosine and inner product (spherical k-means)."""
    return "l2" if resolve_metric(metric).name in ("l2", "sqeuclidean") else "cosine"


def _unit_rows(rows: np.ndarray) -> np.ndarray:
    """Rows divided by their norms in float64 (scaled first, so no square overflows), as float32."""
    rows = rows.astype(np.float64)
    peak = np.abs(rows).max(axis=1, keepdims=True)
    peak[peak == 0] = 1.0
    scaled = rows / peak
    norms = np.sqrt((scaled * scaled).sum(axis=1, keepdims=True))
    norms[norms == 0] = 1.0
    return (scaled / norms).astype(np.float32)


def training_rows(vectors: np.ndarray, metric: str) -> np.ndarray:
    """The rows k-means clusters, float32: the finite rows (a NaN or infinite element never
    ranks); for cosine and inner product their non-zero rows, normalised."""
    vectors = as_matrix("vectors", vectors)
    ok = np.isfinite(vectors).all(axis=1)
    if routing_metric(metric) == "cosine":
        ok &= np.any(vectors != 0, axis=1)
        return _unit_rows(vectors[ok])
    return np.ascontiguousarray(vectors[ok], dtype=np.float32)


@njit(nogil=True, cache=True)
def _plus_plus(points, first, draws, chosen):
    """k-means++ (D^2 sampling) in one compiled loop: ``chosen[0] = first``, then centre
    ``c`` is the row where ``draws[c - 1]`` falls in the running sum of each row's squared
    distance (float64 difference form, summed in element order) to its nearest chosen
    centre. One serial pass over the points per centre: a parallel loop would wake its
    threads once per centre, which costs more than the pass over a few thousand rows.

    The pass runs over the points transposed, element by element across a block of rows:
    each row's sum still adds its elements in order (the same bits as a row-by-row loop),
    but the rows' sums are independent, so the loop over them vectorises instead of waiting
    on one sum's additions."""
    n, d = points.shape
    columns = np.empty((d, n))
    for i in range(n):
        for j in range(d):
            columns[j, i] = np.float64(points[i, j])
    nearest = np.full(n, np.inf)
    distance = np.empty(n)
    cumulative = np.empty(n)
    chosen[0] = first
    for c in range(1, chosen.shape[0]):
        centre = columns[:, chosen[c - 1]].copy()
        distance[:] = 0.0
        for j in range(d):
            x = centre[j]
            row = columns[j]
            for i in range(n):
                diff = row[i] - x
                distance[i] += diff * diff
        total = 0.0
        for i in range(n):
            nearest[i] = min(nearest[i], distance[i])
            total += nearest[i]
            cumulative[i] = total
        if total > 0 and np.isfinite(total):
            chosen[c] = min(np.searchsorted(cumulative, draws[c - 1] * total, side="right"), n - 1)
        else:   # every row sits on a chosen centre (duplicates): any row; its list stays empty
            chosen[c] = min(int(draws[c - 1] * n), n - 1)


def _kmeans_plus_plus(points: np.ndarray, n_clusters: int, rng: np.random.Generator) -> np.ndarray:
    """Seeded k-means++ (D^2 sampling) over ``points``: the rows chosen as first centroids."""
    chosen = np.empty(n_clusters, np.int64)
    first = rng.integers(points.shape[0])
    draws = rng.random(n_clusters - 1)   # the same stream as one draw per centre
    _plus_plus(points, first, draws, chosen)
    return chosen


@njit(nogil=True, cache=True)
def _cluster_sums(points, assignment, n_clusters):
    """float64 sums of each cluster's points, in row order (serial: deterministic)."""
    sums = np.zeros((n_clusters, points.shape[1]))
    for i in range(points.shape[0]):
        a = assignment[i]
        for j in range(points.shape[1]):
            sums[a, j] += np.float64(points[i, j])
    return sums


def _squared_distances(points, centroids, nearest, threads=None):
    """Each point's squared distance to its centroid, float64 difference form."""
    out = np.empty(points.shape[0])
    run_split(_squared_distance_rows, points.shape[0], *frozen(points, centroids, nearest), out,
              threads=threads or default_threads())
    return out


@njit(nogil=True, cache=True)
def _squared_distance_rows(lo, hi, points, centroids, nearest, out):
    for i in range(lo, hi):
        total = 0.0
        for j in range(points.shape[1]):
            diff = np.float64(points[i, j]) - np.float64(centroids[nearest[i], j])
            total += diff * diff
        out[i] = total


def route(vectors: np.ndarray, centroids: np.ndarray, metric: str, nprobe: int = 1,
          threads: int | None = None) -> np.ndarray:
    """The ``nprobe`` nearest centroids of every row, nearest first (int64 (n, nprobe)).

    The one assignment of the IVF plan (training, targets, queries): the cpu kernel's exact
    top-k under :func:`routing_metric`, ties to the lower centroid. A row that cannot rank
    (a NaN or infinite element; a zero vector under cosine) gets -1 in every slot, except a
    finite zero vector under inner product, which probes lists 0, 1, ... (any list is as good:
    its score is 0 against every target).
    """
    vectors = as_matrix("vectors", vectors)
    centroids = np.ascontiguousarray(as_matrix("centroids", centroids), dtype=vectors.dtype)
    nprobe = min(int(nprobe), centroids.shape[0])
    if vectors.shape[0] == 0:
        return np.empty((0, nprobe), np.int64)
    _, lists = knn(vectors, centroids, nprobe, routing_metric(metric), backend="cpu", threads=threads)
    if resolve_metric(metric).name == "inner_product":
        zero = np.isfinite(vectors).all(axis=1) & ~np.any(vectors != 0, axis=1)
        lists[zero] = np.arange(nprobe, dtype=np.int64)
    return lists


@dataclass(frozen=True)
class KMeansResult:
    """Centroids (float32, unit rows for the similarities), the final assignment of the
    training rows to them (exact, as :func:`route` gives it), the Lloyd iterations run."""

    centroids: np.ndarray
    assignment: np.ndarray
    iterations: int


def kmeans(vectors: np.ndarray, n_clusters: int, metric: str = "l2", *, seed: int = 0,
           max_iterations: int = MAX_ITERATIONS, threads: int | None = None) -> KMeansResult:
    """Lloyd's k-means of ``vectors`` (spherical for cosine and inner product), deterministic.

    Parameters
    ----------
    vectors : ndarray (n, d), float32 or float64
        The sample to cluster; rows that cannot rank are left out (:func:`training_rows`).
    n_clusters : int
        Between 1 and the number of rows left.
    metric : {"l2", "sqeuclidean", "cosine", "inner_product"}
        The join's metric; training follows :func:`routing_metric`.
    seed : int
        Seeds k-means++; the same rows and seed give the same centroids.
    max_iterations : int
        Lloyd iterations at most (it stops earlier when no row changes its cluster).
    threads : int, optional
        Threads of the assignment kernel.

    Returns
    -------
    KMeansResult
        ``assignment[i]`` is the nearest centroid of training row ``i``
        (``training_rows(vectors, metric)[i]``) under the final centroids.

    Raises
    ------
    ValueError
        ``n_clusters`` out of range (it names the rows available), ``max_iterations < 0``,
        or input that is no 2-D float array.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.0], [0.1], [10.0], [10.2]], np.float32)
    >>> result = kmeans(x, 2, seed=0)
    >>> sorted(np.round(result.centroids[:, 0].astype(float), 2).tolist())
    [0.05, 10.1]
    """
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, (int, np.integer)) or max_iterations < 0:
        raise ValueError(f"max_iterations: expected an int >= 0, got {max_iterations!r}")
    return Lloyd(vectors, n_clusters, metric, seed=seed, threads=threads).run(max_iterations).result()


class Lloyd:
    """:func:`kmeans` as a run that can pause: :meth:`run` iterates up to a total number of
    Lloyd iterations, :meth:`result` gives the centroids reached and the exact assignment under
    them. Running on after a pause gives the same centroids, bit for bit, as running straight
    through (``kmeans`` is ``Lloyd(...).run(max_iterations).result()``): the IVF plan screens
    its data with the centroids of the first few iterations and trains on only where the
    lists can select (``nearest_join.ivf``). Arguments and errors are :func:`kmeans`'."""

    def __init__(self, vectors: np.ndarray, n_clusters: int, metric: str = "l2", *, seed: int = 0,
                 threads: int | None = None):
        points = training_rows(vectors, metric)
        n = points.shape[0]
        if isinstance(n_clusters, bool) or not isinstance(n_clusters, (int, np.integer)) \
                or not 1 <= n_clusters <= max(n, 1) or n == 0:
            raise ValueError(f"n_clusters: expected an int between 1 and {n} (the rankable training rows), "
                             f"got {n_clusters!r}")
        rng = np.random.default_rng(seed)
        pool = np.arange(n)
        if n > INIT_ROWS_PER_CLUSTER * n_clusters:
            pool = np.sort(rng.choice(n, INIT_ROWS_PER_CLUSTER * int(n_clusters), replace=False))
        self._points, self._metric, self._threads = points, metric, threads
        self.rows = n           # the rankable training rows
        self._spherical = routing_metric(metric) == "cosine"
        self._centroids = points[pool[_kmeans_plus_plus(points[pool], int(n_clusters), rng)]].copy()
        self._previous = None   # the assignment the last iteration moved the centroids by
        self._current = None    # (assignment, distance) under the centroids, once computed
        self.iterations = 0     # Lloyd iterations run (centroid updates)
        self.converged = False  # an iteration changed no row's cluster: the centroids are final

    def _assigned(self) -> tuple[np.ndarray, np.ndarray]:
        if self._current is None:
            self._current = _assign(self._points, self._centroids, self._metric, self._threads)
        return self._current

    def run(self, iterations: int) -> Lloyd:
        """Iterate until ``iterations`` in all (those run before count), or until an
        iteration would change no row's cluster."""
        while not self.converged and self.iterations < iterations:
            assignment, distance = self._assigned()
            if self._previous is not None and np.array_equal(self._previous, assignment):
                self.converged = True
                break
            self.iterations += 1
            self._centroids = _update(self._points, assignment, distance, self._centroids.shape[0],
                                      self._spherical)
            self._previous, self._current = assignment, None
        return self

    def result(self) -> KMeansResult:
        """The centroids so far and each training row's nearest one under them."""
        return KMeansResult(self._centroids, self._assigned()[0], self.iterations)


def _assign(points: np.ndarray, centroids: np.ndarray, metric: str, threads) -> tuple[np.ndarray, np.ndarray]:
    """Each point's nearest centroid and its squared distance to it (for re-seeding)."""
    nearest = route(points, centroids, metric, 1, threads)[:, 0]
    return nearest, _squared_distances(points, centroids, nearest, threads)


def _update(points: np.ndarray, assignment: np.ndarray, distance: np.ndarray, n_clusters: int,
            spherical: bool) -> np.ndarray:
    """New centroids: float64 means in row order (unit means when spherical); an empty
    cluster (or a spherical one whose mean is 0) takes the point farthest from its own
    centroid, farthest first, ties to the lower row, each point at most once."""
    sums = _cluster_sums(points, assignment, n_clusters)
    counts = np.bincount(assignment, minlength=n_clusters)
    centroids = sums / np.maximum(counts, 1)[:, None]
    if spherical:
        norms = np.sqrt((centroids * centroids).sum(axis=1))
        empty = (counts == 0) | (norms == 0)
        centroids = centroids / np.where(norms == 0, 1.0, norms)[:, None]
    else:
        empty = counts == 0
    lost = np.flatnonzero(empty)
    if lost.size:
        # lexsort: by distance descending, then row ascending
        farthest = np.lexsort((np.arange(points.shape[0]), -distance))[:lost.size]
        centroids[lost[:farthest.size]] = points[farthest]
    return centroids.astype(np.float32)
