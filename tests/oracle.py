"""The tests' one oracle: float64 difference-form keys, the true-top-k check every kernel and
join result goes through, and the comparison with Spark's own ``nearestByJoin``.

The oracle ranks by the difference form, in float64: sum((q - t)^2) for l2 / sqeuclidean,
sum((q/|q| - t/|t|)^2) = 2 - 2 cos for cosine, and -q.t for inner product (which has no
difference form). The expansion |q|^2 - 2 q.t + |t|^2 cancels catastrophically on offset
data even in float64; the difference form does not. It is written here, apart from
``nearest_kernels.reference`` (the reference *backend*), so that the reference is checked
against it rather than against itself.

:func:`assert_true_topk` is the check: every returned row must be a true top-k row of the
oracle, with ties decided within a tolerance the backend declares next to its code
(:func:`backend_rtol`: ``cpu.RANK_TOLERANCE``, ``gpu.RTOL``, ``reference_backend.RTOL``),
relative to :func:`key_scale` (the size of the shifted problem: how far a query and the
targets lie from the targets' mean). Squared distances are compared, not their roots: the
root divides an error by twice the distance, so a tolerance on roots would either pass wrong
rankings of far pairs or fail correct ones of near pairs.

Join outputs (rows) are checked by the same function through :func:`assert_join_true_topk`,
at the kernel's tolerance plus float32's rounding of the k-th value (:func:`operator_rtol`:
the operator returns float32 values and merges blocks on them).
Only the comparison with Spark's ``nearestByJoin`` (:func:`assert_same_neighbours`) has its
own, looser tolerance, :data:`SPARK_VALUE_TOL`, for the reason given there.

Pure numpy (the GPU machine imports it without Spark).
"""
from __future__ import annotations

import importlib
from collections import Counter, defaultdict

import numpy as np

# Rows of the oracle's float64 difference tensor per chunk (chunk x nt x d values).
_CHUNK_VALUES = 1 << 22

# Where each backend declares its tolerance for assert_true_topk (module, constant).
_RTOL_OF = {
    "cpu": ("nearest_kernels.cpu", "RANK_TOLERANCE"),
    "gpu": ("nearest_kernels.gpu", "RTOL"),
    "reference": ("nearest_kernels.reference_backend", "RTOL"),
}

# A join's values are float32, and the blocked plans merge the partial top k of target blocks on
# those values: two targets whose values round to one float32 value are a tie there, broken by
# block order. So a join's rows are the true top k to within float32's rounding of the k-th
# value (2^-24 relative; a squared l2 key twice that), on top of the kernel's own tolerance.
OPERATOR_VALUE_RTOL = 2.0 ** -21

# Spark computes its vector functions (vector_l2_distance & co.) of array<float> columns in
# float, in the expanded form, so a value of Spark's carries an error of a few float32 ulps of
# the norms, not of the distance: 1e-4 relative is far above that and far below the gaps in
# the random test data.
# Used only where Spark's own nearestByJoin is the other side; a result of ours is checked
# against the float64 oracle at the kernel's tolerance (assert_join_true_topk).
SPARK_VALUE_TOL = 1e-4


def backend_rtol(name: str) -> float:
    """The tolerance the backend ``name`` declares next to its code (see the module docstring)."""
    module, constant = _RTOL_OF[name]
    return float(getattr(importlib.import_module(module), constant))


# ----------------------------------------------------------------------------- keys
def _unit(rows: np.ndarray) -> np.ndarray:
    """Rows divided by their norms in float64, scaled first so no square overflows; a zero
    row becomes NaN (it has no direction: cosine never matches it)."""
    rows = rows.astype(np.float64)
    peak = np.abs(rows).max(axis=1, keepdims=True)
    peak[peak == 0] = 1.0
    scaled = rows / peak
    with np.errstate(invalid="ignore"):
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


# ----------------------------------------------------------------------------- the check
def assert_true_topk(queries, targets, k: int, metric: str, values, indices, rtol: float,
                     case: str = "") -> None:
    """Every returned row is a true top-k row of the oracle and every value is right.

    Per query row: exactly min(k, nt) distinct valid indices (every row passed must rank);
    each one's oracle key within ``tol`` of the true k-th key, with tol = ``rtol`` x
    :func:`key_scale` plus the float64 oracle's own rounding; keys best first within tol;
    values equal to the oracle's for the same pair within float32 rounding and tol (l2 is
    compared squared), and +-inf exactly where the true value exceeds float32's range;
    missing slots (k > nt) hold index -1 and a non-finite value.
    """
    values = np.asarray(values)
    indices = np.asarray(indices)
    nq, nt = queries.shape[0], targets.shape[0]
    width = min(k, nt)
    assert values.shape == (nq, k) and indices.shape == (nq, k), (values.shape, indices.shape)
    problems = {}   # row -> its first problem (rows are checked all at once, reported in order)

    def report(rows, message):
        for i in np.flatnonzero(rows):
            problems.setdefault(int(i), []).append(message(int(i)))

    report(np.isfinite(values[:, width:]).any(axis=1),
           lambda i: f"row {i}: missing slots hold {values[i, width:].tolist()}")
    if width == 0:
        report((indices >= 0).any(axis=1), lambda i: f"row {i}: indices {indices[i].tolist()} (no targets)")
    else:
        keys = oracle_keys(queries, targets, metric)
        scale = key_scale(queries, targets, metric)
        d = queries.shape[1]
        got = indices[:, :width]
        distinct = (np.diff(np.sort(got, axis=1), axis=1) != 0).all(axis=1)
        bad = (got < 0).any(axis=1) | (indices[:, width:] >= 0).any(axis=1) | ~distinct
        report(bad, lambda i: f"row {i}: indices {indices[i].tolist()} (expected {width} distinct valid)")
        kth = np.partition(keys, width - 1, axis=1)[:, width - 1]
        extra = np.abs(kth)
        if metric == "inner_product":
            tnorm = np.sqrt((targets.astype(np.float64) ** 2).sum(axis=1)).max(initial=0.0)
            extra = extra + np.sqrt((queries.astype(np.float64) ** 2).sum(axis=1)) * tnorm
        tol = (rtol * scale + 2.0 ** -50 * (d + 2) * extra)[:, None]
        mine = np.take_along_axis(keys, np.where(got >= 0, got, 0), axis=1)
        good = ~bad
        beyond = mine > kth[:, None] + tol
        report(good & beyond.any(axis=1), lambda i: (
            f"row {i}: target {got[i, np.argmax(mine[i])]} has key {mine[i].max()!r} beyond the true "
            f"k-th {kth[i]!r} (+ tol {tol[i, 0]:.3g})"))
        report(good & (np.diff(mine, axis=1) < -tol).any(axis=1),
               lambda i: f"row {i}: keys not best first: {mine[i].tolist()}")
        want = key_values(mine, metric)
        have = values[:, :width].astype(np.float64)
        if metric == "l2":
            want_cmp, have_cmp, vtol = mine, have * have, tol + 2.0 ** -21 * mine + 2.0 ** -200
        else:
            want_cmp, have_cmp = want, have
            # float32 rounding of the value, down to its subnormals (1e-60 reads 0)
            vtol = tol / (2.0 if metric == "cosine" else 1.0) + 2.0 ** -22 * np.abs(want) + 2.0 ** -148
        want32 = _float32_of(want)
        overflow = np.isinf(want32)
        report(good & (overflow & (have != want32)).any(axis=1), lambda i: (
            f"row {i}: values {have[i].tolist()} should be inf where {want[i].tolist()} exceeds float32"))
        with np.errstate(invalid="ignore", over="ignore"):
            ok = overflow | (np.abs(have_cmp - want_cmp) <= vtol)
        report(good & ~ok.all(axis=1), lambda i: (
            f"row {i}: values {have[i].tolist()} vs oracle {want[i].tolist()} (tol {vtol[i].tolist()})"))
    lines = [line for row in sorted(problems) for line in problems[row]]
    assert not problems, f"{case} {metric} k={k}: {len(problems)} of {nq} rows wrong:\n  " + \
        "\n  ".join(lines[:8])


def assert_knn_result(queries, targets, k: int, metric: str, values, indices, rtol: float,
                      case: str = "") -> None:
    """A ``knn``-style result: float32 values, int64 indices, missing slots exactly -1 and the
    metric's worst value (+inf for distances, -inf for similarities), then
    :func:`assert_true_topk`."""
    values = np.asarray(values)
    indices = np.asarray(indices)
    assert values.dtype == np.float32 and indices.dtype == np.int64, (values.dtype, indices.dtype)
    worst = -np.inf if metric in ("cosine", "inner_product") else np.inf
    missing = indices < 0
    assert (values[missing] == worst).all(), f"{case}: missing slots must hold {worst}"
    assert_true_topk(queries, targets, k, metric, values, indices, rtol, case=case)


def oracle_within_cap(queries, targets, metric: str, cap: float) -> np.ndarray:
    """(nq, nt) bool: the pairs whose oracle value is within ``cap`` (inclusive: a distance
    ``<= cap``, a similarity ``>= cap``). Tests pick caps that no value lies near unless it
    equals the cap exactly (integer data), so the float64 values decide every pair."""
    values = key_values(oracle_keys(queries, targets, metric), metric)
    return values >= cap if metric in ("cosine", "inner_product") else values <= cap


def assert_capped_topk(queries, targets, k: int, metric: str, cap: float, values, indices,
                       rtol, case: str = "") -> None:
    """Under a cap: each row holds its true top ``min(k, n_i)`` of the ``n_i`` targets within
    the cap (:func:`assert_true_topk` on those targets), then empty slots (-1, non-finite).
    ``rtol``: a number, or a function of (query row, its targets, width) such as
    :func:`operator_rtol` for a join's rows."""
    queries, targets = np.asarray(queries), np.asarray(targets)
    values, indices = np.asarray(values), np.asarray(indices)
    within = oracle_within_cap(queries, targets, metric, cap)
    for i in range(queries.shape[0]):
        allowed = np.flatnonzero(within[i])
        width = min(k, allowed.size)
        got = indices[i]
        assert (got[width:] < 0).all() and not np.isfinite(values[i, width:]).any(), (
            f"{case} {metric} cap={cap!r} row {i}: {allowed.size} targets within the cap, k={k}, "
            f"got indices {got.tolist()} values {values[i].tolist()}")
        if width == 0:
            continue
        local = np.searchsorted(allowed, got[:width])
        ok = (got[:width] >= 0) & (local < allowed.size)
        assert ok.all() and (allowed[np.minimum(local, allowed.size - 1)] == got[:width]).all(), (
            f"{case} {metric} cap={cap!r} row {i}: indices {got[:width].tolist()} not all within "
            f"the cap (within: {allowed[:20].tolist()}...)")
        row_rtol = rtol(queries[i:i + 1], targets[allowed], width, metric) if callable(rtol) else rtol
        assert_true_topk(queries[i:i + 1], targets[allowed], width, metric, values[i:i + 1, :width],
                         local[None, :], row_rtol, case=f"{case} cap={cap!r} row {i}")


# ----------------------------------------------------------------------------- join outputs
def group_rows(rows, qkey, tkey, value):
    """{query key: [(value, target key), ...]} from output rows (target key None = NULL)."""
    out = defaultdict(list)
    for r in rows:
        out[qkey(r)].append((value(r), tkey(r)))
    return out


def operator_rtol(queries, targets, k: int, metric: str, backend: str = "cpu") -> float:
    """The tolerance of a join's rows for :func:`assert_true_topk`: float32's rounding of each
    query's k-th value (:data:`OPERATOR_VALUE_RTOL`; for cosine, whose key is 2 - 2 cos, the
    similarity's rounding is absolute), relative to the row's key scale, plus the tolerance of
    the ``backend`` the executors ran."""
    queries, targets = np.asarray(queries), np.asarray(targets)
    width = min(k, targets.shape[0])
    if width == 0 or queries.shape[0] == 0:
        return backend_rtol(backend)
    keys = oracle_keys(queries, targets, metric)
    kth = np.partition(keys, width - 1, axis=1)[:, width - 1]
    rounding = OPERATOR_VALUE_RTOL * (np.maximum(np.abs(kth), 2.0) if metric == "cosine" else np.abs(kth))
    scale = key_scale(queries, targets, metric)
    return float(np.max(rounding / np.maximum(scale, 1e-300))) + backend_rtol(backend)


def assert_join_true_topk(grouped, queries, targets, k: int, metric: str, query_keys,
                          target_keys, rtol: float | None = None, case: str = "") -> None:
    """A join's rows (``grouped`` by :func:`group_rows`) are each query's true top k of the
    oracle (:func:`assert_true_topk`) at ``rtol``, by default :func:`operator_rtol`.

    ``query_keys[i]`` / ``target_keys[j]`` name row i of ``queries`` / row j of ``targets``.
    A query's rows arrive in no particular order (Spark promises none), so they are put best
    first (ties: block order, i.e. the lower target row) before the check; a query key the
    output lacks fails as a row with no indices.
    """
    values, indices = join_arrays(grouped, k, metric, query_keys, target_keys, case)
    if rtol is None:
        rtol = operator_rtol(queries, targets, k, metric)
    assert_true_topk(np.asarray(queries), np.asarray(targets), k, metric, values, indices, rtol,
                     case=case)


def join_arrays(grouped, k: int, metric: str, query_keys, target_keys, case: str = ""):
    """(values, indices) arrays (nq, k) of a join's rows (``grouped`` by :func:`group_rows`),
    each query's rows best first (ties: the lower target row), -1 / worst where it has fewer."""
    position = {key: j for j, key in enumerate(target_keys)}
    assert len(position) == len(target_keys), "target keys must be unique"
    descending = metric in ("cosine", "inner_product")
    values = np.full((len(query_keys), k), -np.inf if descending else np.inf, dtype=np.float64)
    indices = np.full((len(query_keys), k), -1, dtype=np.int64)
    unknown = set(grouped) - set(query_keys)
    assert not unknown, f"{case}: rows for query keys not asked for: {sorted(unknown)[:10]}"
    for i, key in enumerate(query_keys):
        pairs = [(float(v), position[t]) for v, t in grouped.get(key, []) if t is not None]
        assert len(pairs) <= k, f"{case}: query {key} has {len(pairs)} rows > k = {k}"
        pairs.sort(key=lambda vt: (-vt[0] if descending else vt[0], vt[1]))
        for slot, (v, j) in enumerate(pairs):
            values[i, slot], indices[i, slot] = v, j
    return values, indices


def assert_same_neighbours(ours, theirs, descending: bool, value_tol: float = SPARK_VALUE_TOL):
    """Both outputs (grouped by :func:`group_rows`) pick the same neighbours for every query
    key: Spark's ``nearestByJoin`` against ours (see :data:`SPARK_VALUE_TOL`).

    Per query key: the multisets of values agree (within ``value_tol`` relative) and so do the
    target keys, except targets whose value ties with the worst kept value (either side may
    pick any of those: Spark leaves tie order unspecified).
    """
    def close(a: float, b: float) -> bool:
        return abs(a - b) <= value_tol * max(1.0, abs(a), abs(b))

    def best_first(pairs):
        return sorted(pairs, key=lambda vt: (vt[0] is None, -(vt[0] or 0) if descending else (vt[0] or 0)))

    assert set(ours) == set(theirs), f"query keys differ: {set(ours) ^ set(theirs)}"
    for key in ours:
        a, b = best_first(ours[key]), best_first(theirs[key])
        assert len(a) == len(b), f"query {key}: {len(a)} rows vs {len(b)}: {a} vs {b}"
        for (va, _), (vb, _) in zip(a, b):
            assert (va is None) == (vb is None), f"query {key}: {a} vs {b}"
            if va is not None:
                assert close(va, vb), f"query {key}: values {a} vs {b}"
        values = [v for v, _ in a if v is not None]
        if not values:
            assert Counter(t for _, t in a) == Counter(t for _, t in b)
            continue
        boundary = values[-1]
        strict_a = Counter(t for v, t in a if v is not None and not close(v, boundary))
        strict_b = Counter(t for v, t in b if v is not None and not close(v, boundary))
        assert strict_a == strict_b, f"query {key}: {a} vs {b}"
