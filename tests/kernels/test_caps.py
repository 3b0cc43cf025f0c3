"""knn(..., cap=...): only targets within the cap rank, inclusive, on every backend that takes
a cap, against the float64 oracle (tests.oracle.assert_capped_topk).

Caps at midpoints between consecutive distinct oracle values (no value lies near them, so the
float64 values decide every pair) at several quantiles, below and above every value, and exactly
at a value on integer data (the cap is inclusive: a target exactly at it matches).
"""
from __future__ import annotations

import logging
import zlib

import numpy as np
import pytest

from nearest_join.kernels import knn
from tests.oracle import assert_capped_topk, backend_rtol, key_values, oracle_keys

BACKENDS = ("cpu", "reference")
METRIC_NAMES = ("l2", "sqeuclidean", "cosine", "inner_product")
DESCENDING = {"cosine": True, "inner_product": True, "l2": False, "sqeuclidean": False}


def _rng(request) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def midpoint_cap(values: np.ndarray, quantile: float, descending: bool) -> float:
    """A cap between two consecutive distinct values, near the quantile (of "how many pass")."""
    distinct = np.unique(values)
    if descending:
        distinct = distinct[::-1]
    position = round(quantile * (distinct.size - 1))
    if position <= 0:    # below (distances) / above (similarities) every value
        return float(distinct[0] - (1.0 if not descending else -1.0) * (abs(distinct[0]) + 1.0))
    if position >= distinct.size - 1:
        return float(distinct[-1] + (1.0 if not descending else -1.0) * (abs(distinct[-1]) + 1.0))
    return float((distinct[position] + distinct[position + 1]) / 2.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("metric", METRIC_NAMES)
@pytest.mark.parametrize("quantile", [0.0, 0.002, 0.05, 0.5, 1.0], ids=lambda q: f"q{q}")
@pytest.mark.parametrize("shape", [(37, 31, 5), (70, 1100, 33)], ids=lambda s: "x".join(map(str, s)))
def test_cap_against_oracle(request, backend, metric, quantile, shape):
    nq, nt, d = shape
    rng = _rng(request)
    # Offset data (the l2 family's cancellation case), a few duplicate targets.
    queries = (rng.standard_normal((nq, d)) * 2 + 3).astype(np.float32)
    targets = (rng.standard_normal((nt, d)) * 2 + 3).astype(np.float32)
    targets[-3:] = targets[:3]
    values = key_values(oracle_keys(queries, targets, metric), metric)
    cap = midpoint_cap(values, quantile, DESCENDING[metric])
    for k in (1, 10, nt + 3):
        got_values, got_indices = knn(queries, targets, k, metric, backend=backend, cap=cap)
        assert_capped_topk(queries, targets, k, metric, cap, got_values, got_indices,
                           backend_rtol(backend), case=f"{backend} {shape}")
    counts = (got_indices >= 0).sum(axis=1)
    if quantile == 0.0:
        assert (counts == 0).all()
    if quantile == 1.0:
        assert (counts == nt).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("metric,cap,expected", [
    # q = (0, 0); targets (3, 4), (5, 0), (0, 6), (1, 1): distances 5, 5, 6, sqrt 2.
    ("l2", 5.0, [3, 0, 1]),
    ("sqeuclidean", 25.0, [3, 0, 1]),
    # q = (1, 1): inner products 7, 5, 6, 2.
    ("inner_product", 6.0, [0, 2]),
], ids=lambda v: str(v))
def test_cap_is_inclusive(backend, metric, cap, expected):
    q = np.array([[0.0, 0.0]] if metric != "inner_product" else [[1.0, 1.0]], np.float32)
    t = np.array([[3, 4], [5, 0], [0, 6], [1, 1]], np.float32)
    values, indices = knn(q, t, 4, metric, backend=backend, cap=cap)
    assert indices[0].tolist() == expected + [-1] * (4 - len(expected))
    assert values[0, len(expected) - 1] == np.float32(cap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cosine_cap_is_inclusive(backend):
    # Axis vectors: cosines exactly 1, 0 and -1; a cap of 0 keeps the orthogonal target.
    q = np.array([[1.0, 0.0, 0.0]], np.float32)
    t = np.array([[0, 0, -2], [0, 3, 0], [2, 0, 0], [-1, 0, 0]], np.float32)
    values, indices = knn(q, t, 4, "cosine", backend=backend, cap=0.0)
    assert indices[0].tolist() == [2, 0, 1, -1]
    assert values[0].tolist() == [1.0, 0.0, 0.0, -np.inf]


@pytest.mark.parametrize("metric", METRIC_NAMES)
def test_capped_rows_need_no_float64_scan(request, metric, caplog):
    """A row with fewer than k targets within the cap is proven by the cap's key: the cpu
    kernel's float64 fallback search runs for no row (its debug line counts them)."""
    rng = _rng(request)
    queries = rng.standard_normal((200, 64)).astype(np.float32)
    targets = rng.standard_normal((3000, 64)).astype(np.float32)
    values = key_values(oracle_keys(queries, targets, metric), metric)
    cap = midpoint_cap(values, 0.001, DESCENDING[metric])
    with caplog.at_level(logging.DEBUG, logger="nearest_join.kernels.cpu"):
        _, indices = knn(queries, targets, 10, metric, backend="cpu", cap=cap)
    counts = (indices >= 0).sum(axis=1)
    assert (counts < 10).any() and (counts > 0).any()
    lines = [r.getMessage() for r in caplog.records if "float64 rows=" in r.getMessage()]
    assert lines and all(line.endswith("float64 rows=0") for line in lines), lines


@pytest.mark.parametrize("cap", [float("nan"), float("inf"), "1", True])
def test_bad_cap(cap):
    q = np.zeros((1, 2), np.float32)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="cap: expected None or a finite number"):
            knn(q, q, 1, "l2", backend=backend, cap=cap)


def test_a_backend_without_caps_is_refused_a_capped_call(monkeypatch):
    """A backend that does not declare ``caps`` would ignore the cap and return rows beyond it:
    the dispatcher refuses it by name, and ``auto`` passes over it to one that takes caps."""
    from nearest_join.kernels import dispatch
    from nearest_join.kernels.reference_backend import BACKEND as reference

    class Uncapped:
        name, devices, dtypes, metrics, max_k, caps = "uncapped", ("cpu",), ("float32",), \
            ("l2",), None, False

        def refuse(self, *args, **options):
            return None

        def run(self, queries, targets, k, metric, **options):
            return reference.run(queries, targets, k, metric)

    monkeypatch.setitem(dispatch._REGISTRY, "uncapped",
                        dispatch._Entry("uncapped", "unused", loaded=Uncapped(), tried=True))
    monkeypatch.setattr(dispatch, "_REGISTRY", {"uncapped": dispatch._REGISTRY.pop("uncapped"),
                                                **dispatch._REGISTRY})
    q = np.zeros((1, 2), np.float32)
    t = np.array([[1.0, 0.0], [5.0, 0.0]], np.float32)
    with pytest.raises(ValueError, match="uncapped.*distance cap"):
        knn(q, t, 2, "l2", backend="uncapped", cap=2.0)
    values, indices = knn(q, t, 2, "l2", cap=2.0)          # auto: the next backend takes it
    assert indices.tolist() == [[0, -1]] and values[0, 0] == 1.0
    _, indices = knn(q, t, 2, "l2")                          # no cap: the uncapped one runs
    assert indices.tolist() == [[0, 1]]
