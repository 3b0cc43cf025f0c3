"""Adversarial inputs shared by the kernel, operator and GPU exactness tests (the oracle they
are checked by is :mod:`tests.oracle`; its check is re-exported here for those callers).

The cases are what real data looks like and what centred Gaussians hide: offsets much larger
than the spread (map coordinates, non-centred embeddings, sensor features), d from 1 up, exact
duplicates and duplicates one ulp apart, magnitudes from 1e-30 to 1e30 (float32 and float64
inputs), nearly parallel vectors (cosine, inner product) and small integers with many exact
ties. Pure numpy: the GPU machine imports it without Spark.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tests.oracle import assert_true_topk, key_scale, key_values, oracle_keys  # noqa: F401

DIMS = (1, 2, 3, 4, 16, 64, 128, 384)
ALL_METRICS = ("l2", "sqeuclidean", "cosine", "inner_product")
F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Case:
    """One adversarial input: ``queries`` and ``targets`` of one dtype, and the metrics it is
    meant for (every metric is correct to run; these are the ones that stress it)."""

    name: str
    queries: np.ndarray
    targets: np.ndarray
    metrics: tuple[str, ...] = ALL_METRICS

    def __repr__(self) -> str:   # pytest ids
        return self.name


def _queries_from(targets: np.ndarray, fresh: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Queries that are half exact copies of targets, a quarter copies one ulp off in one
    coordinate, and a quarter fresh rows from the same distribution."""
    n = fresh.shape[0]
    copies = targets[rng.integers(0, targets.shape[0], n)].copy()
    ulp = copies[n // 2: 3 * n // 4]
    col = rng.integers(0, targets.shape[1], ulp.shape[0])
    rows = np.arange(ulp.shape[0])
    ulp[rows, col] = np.nextafter(ulp[rows, col], np.inf, dtype=ulp.dtype)
    copies[n // 2: 3 * n // 4] = ulp
    copies[3 * n // 4:] = fresh[3 * n // 4:]
    return copies


def offset_case(d: int, offset: float, spread: float, nq: int = 40, nt: int = 500,
                seed: int = 0, dtype=np.float32, duplicates: bool = True) -> Case:
    """Every coordinate ``offset + spread * N(0, 1)``: the norms are ~offset sqrt(d), the
    distances ~spread sqrt(d). With ``duplicates`` every tenth target row appears twice more."""
    rng = np.random.default_rng(seed)
    t = offset + spread * rng.standard_normal((nt, d))
    if duplicates:
        t[nt // 2: nt // 2 + nt // 10] = t[: nt // 10]
        t[nt - nt // 10:] = t[: nt // 10]
    t = t.astype(dtype)
    fresh = (offset + spread * rng.standard_normal((nq, d))).astype(dtype)
    return Case(f"offset{offset:g}-spread{spread:g}-d{d}-{np.dtype(dtype).name}", _queries_from(t, fresh, rng), t)


def magnitude_case(scale: float, d: int = 8, nq: int = 30, nt: int = 300, seed: int = 1,
                   dtype=np.float32) -> Case:
    """Gaussian rows times ``scale``: squared norms of 1e20-sized float32 elements overflow
    float32, those of 1e-24 underflow it."""
    rng = np.random.default_rng(seed)
    t = (scale * rng.standard_normal((nt, d))).astype(dtype)
    fresh = (scale * rng.standard_normal((nq, d))).astype(dtype)
    return Case(f"magnitude{scale:g}-d{d}-{np.dtype(dtype).name}", _queries_from(t, fresh, rng), t)


def parallel_case(d: int, nq: int = 30, nt: int = 400, seed: int = 2) -> Case:
    """Vectors within ~1e-4 rad of one direction, norms within 1%: cosines all ~1, inner
    products all ~|v|^2; only the tiny remainder ranks."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(d)
    base *= 10.0 / np.linalg.norm(base)
    t = base * (1 + 0.01 * rng.random((nt, 1))) + 1e-3 * rng.standard_normal((nt, d))
    t = t.astype(np.float32)
    fresh = (base * (1 + 0.01 * rng.random((nq, 1))) + 1e-3 * rng.standard_normal((nq, d))).astype(np.float32)
    return Case(f"parallel-d{d}", _queries_from(t, fresh, rng), t, ("cosine", "inner_product", "l2"))


def integer_case(d: int, high: int = 3, nq: int = 40, nt: int = 400, seed: int = 3,
                 dtype=np.float32) -> Case:
    """Small integers: hundreds of targets share each distance, so the k-th place ties."""
    rng = np.random.default_rng(seed)
    t = rng.integers(0, high + 1, (nt, d)).astype(dtype)
    q = rng.integers(0, high + 1, (nq, d)).astype(dtype)
    return Case(f"integer{high}-d{d}-{np.dtype(dtype).name}", q, t)


def tie_groups(nq: int, nt: int, d: int, sizes, seed: int = 0):
    """Groups of identical target rows (deduplication's data: real embeddings repeat texts),
    ``sizes`` rows each at random positions in Gaussian targets, the first group's row three
    times longer than the rest (it leads every metric's ranking, inner product too). The first
    half of the queries is that row, the next ones lie 1e-3 off the other groups' rows, the
    rest are fresh. Returns (queries, targets, each group's indices ascending), float32."""
    rng = np.random.default_rng(seed)
    t = rng.standard_normal((nt, d))
    spots = rng.permutation(nt)
    groups, at = [], 0
    for size in sizes:
        rows = np.sort(spots[at:at + size])
        t[rows] = t[rows[0]] * (3.0 if not groups else 1.0)
        groups.append(rows)
        at += size
    q = rng.standard_normal((nq, d))
    q[: nq // 2] = t[groups[0][0]]
    for j, rows in enumerate(groups[1:]):
        q[nq // 2 + j] = t[rows[0]] + 1e-3 * rng.standard_normal(d)
    return q.astype(np.float32), t.astype(np.float32), groups


def one_row_case() -> Case:
    q = np.array([[1e4 + 0.5, -3.0]], dtype=np.float32)
    return Case("one-row", q, np.array([[1e4, -3.0]], dtype=np.float32))


def cases(dims=DIMS) -> list[Case]:
    """The shared adversarial set (small shapes: each runs in milliseconds on the CPU)."""
    out = []
    for i, d in enumerate(dims):
        out.append(offset_case(d, 10.0, 0.1, seed=10 + i))            # the 10 + 0.1 x noise
        out.append(offset_case(d, 1e4, 1.0, seed=20 + i))             # spread 1e-4 of the offset
    out.append(offset_case(3, 1e3, 1e-1, seed=30, dtype=np.float64))  # map coordinates, doubles
    out.append(offset_case(64, 10.0, 1e-3, seed=31, dtype=np.float64))
    out.append(offset_case(128, 0.02, 1.0, seed=32))   # nearly centred: searched unshifted
    for scale in (1e-30, 1e-24, 1e20, 1e30):
        out.append(magnitude_case(scale, seed=40))
    for scale in (1e-30, 1e30):
        out.append(magnitude_case(scale, seed=41, dtype=np.float64))
    for d in (16, 128):
        out.append(parallel_case(d, seed=50 + d))
    out.append(integer_case(4))
    out.append(integer_case(16, high=1, dtype=np.float64))
    out.append(one_row_case())
    return out
