"""Comparison helpers for join outputs: same neighbours, allowing ties and float noise."""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

# Spark computes the vector functions in float; we compute in float32 GEMM form. Values of
# the same pair agree to a few ulps of the norms; 1e-4 relative is far above that and far
# below the gaps in random test data.
VALUE_TOL = 1e-4


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= VALUE_TOL * max(1.0, abs(a), abs(b))


def group_rows(rows, qkey, tkey, value):
    """{query key: [(value, target key), ...]} from output rows (target key None = NULL)."""
    out = defaultdict(list)
    for r in rows:
        out[qkey(r)].append((value(r), tkey(r)))
    return out


def assert_same_neighbours(ours, theirs, descending: bool):
    """Both outputs pick the same neighbours for every query key.

    Per query key: the multisets of values agree (within VALUE_TOL) and so do the target
    keys, except targets whose value ties with the worst kept value (either side may pick any
    of those: Spark leaves tie order unspecified).
    """
    assert set(ours) == set(theirs), f"query keys differ: {set(ours) ^ set(theirs)}"
    for key in ours:
        a = sorted(ours[key], key=lambda vt: (vt[0] is None, -(vt[0] or 0) if descending else (vt[0] or 0)))
        b = sorted(theirs[key], key=lambda vt: (vt[0] is None, -(vt[0] or 0) if descending else (vt[0] or 0)))
        assert len(a) == len(b), f"query {key}: {len(a)} rows vs {len(b)}: {a} vs {b}"
        for (va, _), (vb, _) in zip(a, b):
            assert (va is None) == (vb is None), f"query {key}: {a} vs {b}"
            if va is not None:
                assert _close(va, vb), f"query {key}: values {a} vs {b}"
        values = [v for v, _ in a if v is not None]
        if not values:
            assert Counter(t for _, t in a) == Counter(t for _, t in b)
            continue
        boundary = values[-1]
        strict_a = Counter(t for v, t in a if v is not None and not _close(v, boundary))
        strict_b = Counter(t for v, t in b if v is not None and not _close(v, boundary))
        assert strict_a == strict_b, f"query {key}: {a} vs {b}"


def reference_pairs(Q, T, k, metric, q_ids, t_ids):
    """{query id: [(value, target id)]} from the float64 reference kernel."""
    from nearest_join.kernels import knn

    values, indices = knn(np.asarray(Q), np.asarray(T), k, metric, backend="reference")
    out = defaultdict(list)
    for qi, qid in enumerate(q_ids):
        for v, ti in zip(values[qi], indices[qi]):
            if ti >= 0:
                out[qid].append((float(v), t_ids[ti]))
    return out
