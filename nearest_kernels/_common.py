"""Shared pieces of the numeric core: metric table, input validation, exclusion masks.

Pure numpy: this package never imports pyspark or pandas (executors without Spark on the
import path, and the GPU machine, import it directly).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "Metric",
    "METRICS",
    "resolve_metric",
    "as_matrix",
    "check_inputs",
    "rankable_rows",
    "empty_result",
    "check_cap",
    "within_cap",
    "drop_beyond_cap",
    "heap_width",
    "seeds_heaps",
]


@dataclass(frozen=True)
class Metric:
    """How a metric ranks: ``descending`` is True for similarities (largest first)."""

    name: str
    descending: bool

    @property
    def worst(self) -> float:
        """The value a missing slot holds: +inf for distances, -inf for similarities."""
        return -np.inf if self.descending else np.inf

    @property
    def needs_norm(self) -> bool:
        """Cosine excludes zero-magnitude vectors (Spark returns NULL similarity there)."""
        return self.name == "cosine"


METRICS: dict[str, Metric] = {
    "l2": Metric("l2", descending=False),
    "sqeuclidean": Metric("sqeuclidean", descending=False),
    "inner_product": Metric("inner_product", descending=True),
    "cosine": Metric("cosine", descending=True),
}


def resolve_metric(metric: str) -> Metric:
    """Return the :class:`Metric` named ``metric`` or raise a ValueError listing the choices."""
    if isinstance(metric, Metric):
        return metric
    if not isinstance(metric, str) or metric not in METRICS:
        raise ValueError(
            f"metric: expected one of {sorted(METRICS)}, got {metric!r}"
        )
    return METRICS[metric]


def as_matrix(name: str, array) -> np.ndarray:
    """Check that ``array`` is a 2-D float32/float64 numpy array; return it unchanged.

    Non-contiguous arrays are accepted; backends copy only when they must.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(array).__name__}")
    if array.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array (rows, dimension), got shape {array.shape}")
    if array.dtype not in (np.float32, np.float64):
        raise ValueError(f"{name}: expected dtype float32 or float64, got {array.dtype}")
    return array


def check_inputs(queries, targets, k) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate the common arguments of every backend (shapes, dtypes, k)."""
    queries = as_matrix("queries", queries)
    targets = as_matrix("targets", targets)
    if queries.shape[1] != targets.shape[1]:
        raise ValueError(
            f"targets: expected dimension {queries.shape[1]} (the dimension of queries), "
            f"got {targets.shape[1]}"
        )
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k: expected an integer >= 1, got {k!r}")
    return queries, targets, int(k)


def rankable_rows(vectors: np.ndarray, metric: Metric) -> np.ndarray:
    """Boolean mask of the rows that can rank, as Spark's vector functions define it.

    A row with any NaN (a NULL element arrives as NaN) or infinity never matches: Spark would
    return NULL (NaN) or a non-finite value there, and the GEMM decomposition
    |q|^2 - 2 q.t + |t|^2 cannot rank infinities faithfully. For cosine, a zero-magnitude row
    never matches (Spark returns a NULL similarity).
    """
    ok = np.isfinite(vectors).all(axis=1)
    if metric.needs_norm:
        ok &= np.any(vectors != 0, axis=1)
    return ok


def empty_result(nq: int, k: int, metric: Metric) -> tuple[np.ndarray, np.ndarray]:
    """An all-missing result: index -1 and the metric's worst value in every slot."""
    return (
        np.full((nq, k), metric.worst, dtype=np.float32),
        np.full((nq, k), -1, dtype=np.int64),
    )


def check_cap(cap) -> float | None:
    """A ``cap`` option of :func:`nearest_kernels.knn`: None or a finite number."""
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.integer, np.floating)) \
            or not np.isfinite(cap):
        raise ValueError(f"cap: expected None or a finite number, got {cap!r}")
    return float(cap)


def within_cap(values: np.ndarray, cap: float, metric: Metric) -> np.ndarray:
    """Where ``values`` (the metric's units, float64) are within the cap, which is inclusive:
    a distance ``<= cap`` or a similarity ``>= cap`` (Sedona's ``max_distance`` is inclusive
    too). NaN is never within."""
    return values >= cap if metric.descending else values <= cap


def drop_beyond_cap(values: np.ndarray, indices: np.ndarray, cap: float | None,
                    metric: Metric) -> tuple[np.ndarray, np.ndarray]:
    """Empty (index -1, the worst value) every slot whose value is beyond ``cap``. Rows are
    best first, so the slots dropped are each row's last: rows stay best first."""
    if cap is None:
        return values, indices
    beyond = ~within_cap(values, cap, metric)
    values = np.where(beyond, np.asarray(metric.worst, values.dtype), values)
    indices = np.where(beyond, -1, indices)
    return values, indices


# The CPU kernel's heaps (``cpu``, ``_cpu_kernels``), here for the driver's warm-up
# (``udfs.warm``), which must not import numba. Slots kept beyond k for the exact stage (see
# cpu.CpuBackend.run): fewer would leave more rows unproven (each searched again); more cost
# every row heap inserts.
RERANK_EXTRA = 4
# Heaps at least this wide start from a selection over the first target tile instead of one
# insert per candidate: a wide heap takes most of its inserts there (all of the first k, and
# k ln(tile / k) more), each a sift of log2(k) levels; a narrow one takes few.
SEED_WIDTH = 64


def heap_width(k: int, nt: int) -> int:
    """Candidates kept per query row: k and a margin for the exact stage, at most every target."""
    return min(k + RERANK_EXTRA + k // 32, nt)


def seeds_heaps(k: int) -> bool:
    """Whether a search for k keeps heaps wide enough to seed (given targets enough): a
    kernel of its own that narrower joins never compile."""
    return k + RERANK_EXTRA + k // 32 >= SEED_WIDTH
