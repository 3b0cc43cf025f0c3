"""Adversarial inputs and the float64 difference-form oracle shared by the kernel, operator
and GPU exactness tests.

The cases are what real data looks like and what centred Gaussians hide: offsets much larger
than the spread (map coordinates, non-centred embeddings, sensor features), d from 1 up, exact
duplicates and duplicates one ulp apart, magnitudes from 1e-30 to 1e30 (float32 and float64
inputs), nearly parallel vectors (cosine, inner product) and small integers with many exact
ties. Pure numpy: the GPU machine imports it without Spark.

The oracle ranks by the difference form, in float64: sum((q - t)^2) for l2 / sqeuclidean,
sum((q/|q| - t/|t|)^2) = 2 - 2 cos for cosine, and -q.t for inner product (which has no
difference form). The expansion |q|^2 - 2 q.t + |t|^2 cancels catastrophically on offset
data even in float64; the difference form does not.

:func:`assert_true_topk` is the check: every returned row must be a true top-k row of the
oracle, with ties decided within a tolerance the backend declares, relative to
:func:`key_scale` (the size of the shifted problem: how far a query and the targets lie from
the targets' mean). Squared distances are compared, not their roots: the root divides an error
by twice the distance, so a tolerance on roots would either pass wrong rankings of far pairs or
fail correct ones of near pairs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DIMS = (1, 2, 3, 4, 16, 64, 128, 384)
ALL_METRICS = ("l2", "sqeuclidean", "cosine", "inner_product")
F32_MAX = float(np.finfo(np.float32).max)
# Rows of the oracle's float64 difference tensor per chunk (chunk x nt x d values).
_CHUNK_VALUES = 1 << 22


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


# ----------------------------------------------------------------------------- the oracle
def _unit(rows: np.ndarray) -> np.ndarray:
    """Rows divided by their norms in float64, scaled first so no square overflows."""
    rows = rows.astype(np.float64)
    peak = np.abs(rows).max(axis=1, keepdims=True)
    peak[peak == 0] = 1.0
    scaled = rows / peak
    return scaled / np.sqrt((scaled * scaled).sum(axis=1, keepdims=True))


def oracle_keys(queries: np.ndarray, targets: np.ndarray, metric: str) -> np.ndarray:
    """Ranking keys of every pair in float64, smaller is better (see the module docstring)."""
    q = queries.astype(np.float64)
    t = targets.astype(np.float64)
    if metric == "inner_product":
        return -np.einsum("ij,kj->ik", q, t)
    if metric == "cosine":
        q, t = _unit(q), _unit(t)
    keys = np.empty((q.shape[0], t.shape[0]))
    chunk = max(1, _CHUNK_VALUES // max(1, t.size))
    for start in range(0, q.shape[0], chunk):
        diff = q[start:start + chunk, None, :] - t[None, :, :]
        keys[start:start + chunk] = np.einsum("ijk,ijk->ij", diff, diff)
    return keys


def key_values(keys: np.ndarray, metric: str) -> np.ndarray:
    """The values the metric reports for oracle keys (float64)."""
    if metric == "l2":
        return np.sqrt(keys)
    if metric == "sqeuclidean":
        return keys
    if metric == "cosine":
        return 1.0 - keys / 2.0
    return -keys


def key_scale(queries: np.ndarray, targets: np.ndarray, metric: str) -> np.ndarray:
    """Per query, the size of the shifted problem that a correct kernel's rounding error is
    relative to: (|q - c| + max |t - c|)^2 for the l2 family (c = the targets' mean; unit
    vectors for cosine), |q| max |t - c| for inner product. Shifting by c is exact in real
    arithmetic and leaves the ranking unchanged (for inner product: a per-query constant)."""
    q = queries.astype(np.float64)
    t = targets.astype(np.float64)
    if metric == "cosine":
        q, t = _unit(q), _unit(t)
    c = t.mean(axis=0)
    t_far = np.sqrt(((t - c) ** 2).sum(axis=1)).max(initial=0.0)
    if metric == "inner_product":
        return np.sqrt((q * q).sum(axis=1)) * t_far
    return (np.sqrt(((q - c) ** 2).sum(axis=1)) + t_far) ** 2


def _float32_of(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return values.astype(np.float32)


def assert_true_topk(queries, targets, k: int, metric: str, values, indices, rtol: float,
                     case: str = "") -> None:
    """Every returned row is a true top-k row of the oracle and every value is right.

    Per query row: exactly min(k, nt) distinct valid indices (every adversarial row ranks);
    each one's oracle key within ``tol`` of the true k-th key, with tol = ``rtol`` x
    :func:`key_scale` plus the float64 oracle's own rounding; keys best first within tol;
    values equal to the oracle's for the same pair within float32 rounding and tol (l2 is
    compared squared), and +-inf exactly where the true value exceeds float32's range.
    """
    nq, nt = queries.shape[0], targets.shape[0]
    width = min(k, nt)
    assert values.shape == (nq, k) and indices.shape == (nq, k), (values.shape, indices.shape)
    keys = oracle_keys(queries, targets, metric)
    scale = key_scale(queries, targets, metric)
    d = queries.shape[1]
    q64 = queries.astype(np.float64)
    tnorm = np.sqrt((targets.astype(np.float64) ** 2).sum(axis=1)).max(initial=0.0)
    f64 = 2.0 ** -50 * (d + 2)
    problems = []
    for i in range(nq):
        got = indices[i]
        if (got[:width] < 0).any() or (got[width:] >= 0).any() or len(set(got[:width])) != width:
            problems.append(f"row {i}: indices {got.tolist()} (expected {width} distinct valid)")
            continue
        kth = np.partition(keys[i], width - 1)[width - 1]
        extra = np.abs(kth) + (np.sqrt((q64[i] ** 2).sum()) * tnorm if metric == "inner_product" else 0.0)
        tol = rtol * scale[i] + f64 * extra
        mine = keys[i, got[:width]]
        if (mine > kth + tol).any():
            worst = int(np.argmax(mine))
            problems.append(f"row {i}: target {got[worst]} has key {mine[worst]!r} beyond the true "
                            f"k-th {kth!r} (+ tol {tol:.3g})")
        if (np.diff(mine) < -tol).any():
            problems.append(f"row {i}: keys not best first: {mine.tolist()}")
        want = key_values(mine, metric)
        have = values[i, :width].astype(np.float64)
        if metric == "l2":
            want_cmp, have_cmp, vtol = mine, have * have, tol + 2.0 ** -21 * mine + 2.0 ** -200
        else:
            want_cmp, have_cmp = want, have
            # float32 rounding of the value, down to its subnormals (1e-60 reads 0)
            vtol = tol / (2.0 if metric == "cosine" else 1.0) + 2.0 ** -22 * np.abs(want) + 2.0 ** -148
        overflow = np.isinf(_float32_of(want))
        if (have[overflow] != _float32_of(want)[overflow]).any():
            problems.append(f"row {i}: values {have.tolist()} should be inf where {want.tolist()} "
                            "exceeds float32")
        ok = overflow | (np.abs(have_cmp - want_cmp) <= vtol)
        if not ok.all():
            problems.append(f"row {i}: values {have.tolist()} vs oracle {want.tolist()} (tol {vtol})")
        if np.isfinite(values[i, width:]).any():
            problems.append(f"row {i}: missing slots hold {values[i, width:].tolist()}")
    assert not problems, f"{case} {metric} k={k}: {len(problems)} of {nq} rows wrong:\n  " + \
        "\n  ".join(problems[:8])
