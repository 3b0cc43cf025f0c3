"""knn(..., cap=...): only targets within the cap rank, inclusive, on every backend that takes
a cap, against the float64 oracle (tests.oracle.assert_capped_topk).

Caps at midpoints between consecutive distinct oracle values (no value lies near them, so the
float64 values decide every pair) at several quantiles, below and above every value, and exactly
at a value on integer data (the cap is inclusive: a target exactly at it matches).

The gpu backend runs here as ``gpu-torch``: its torch path on CPU tensors (``knn_torch``: the
dispatcher's choice for CPU tensors), one precision per metric; on a CUDA machine (``-m gpu``) as ``gpu``
through ``knn`` in every precision (the fused kernel for tf32 / bf16). The fused kernel's
seeded lists under a cap run under the Triton interpreter in
``tests/kernels/interp/test_cap_kernels.py``.
"""
from __future__ import annotations

import logging
import zlib

import numpy as np
import pytest

from nearest_kernels import knn
from tests import adversarial as adv
from tests.oracle import assert_capped_topk, backend_rtol, key_values, oracle_keys

try:
    import torch
except ImportError:  # the gpu backend's tests skip with a reason
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
needs_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                                reason="needs a CUDA device (run on the GPU machine: pytest -m gpu)")
BACKENDS = ("cpu", "reference", pytest.param("gpu-torch", marks=needs_torch),
            pytest.param("gpu", marks=[pytest.mark.gpu, needs_cuda]))
METRIC_NAMES = ("l2", "sqeuclidean", "cosine", "inner_product")
DESCENDING = {"cosine": True, "inner_product": True, "l2": False, "sqeuclidean": False}
# gpu-torch (CPU tensors): one precision per metric, the low ones whose bound the cap's limit uses.
TORCH_PRECISION = {"l2": "bf16", "sqeuclidean": "tf32", "cosine": "bf16", "inner_product": "bf16"}
GPU_PRECISIONS = ("fp32", "tf32", "bf16")


def capped_searches(backend: str, queries, targets, k: int, metric: str, cap: float):
    """[(label, values, indices)] of a capped search on ``backend``: gpu in each precision."""
    if backend == "gpu-torch":
        from nearest_kernels.gpu import knn_torch

        precision = TORCH_PRECISION[metric]
        v, i = knn_torch(torch.from_numpy(queries), torch.from_numpy(targets), k, metric, precision,
                         cap=cap)
        return [(f"gpu-torch {precision}", v.numpy(), i.numpy())]
    if backend == "gpu":
        return [(f"gpu {p}", *knn(queries, targets, k, metric, backend="gpu", precision=p, cap=cap))
                for p in GPU_PRECISIONS]
    return [(backend, *knn(queries, targets, k, metric, backend=backend, cap=cap))]


def _rtol(backend: str) -> float:
    return backend_rtol("gpu" if backend.startswith("gpu") else backend)


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
    if backend == "gpu-torch" and nt > 100:
        pytest.skip("gpu-torch: the small shape here, the larger on the GPU (-m gpu)")
    rng = _rng(request)
    # Offset data (the l2 family's cancellation case), a few duplicate targets.
    queries = (rng.standard_normal((nq, d)) * 2 + 3).astype(np.float32)
    targets = (rng.standard_normal((nt, d)) * 2 + 3).astype(np.float32)
    targets[-3:] = targets[:3]
    values = key_values(oracle_keys(queries, targets, metric), metric)
    cap = midpoint_cap(values, quantile, DESCENDING[metric])
    for k in (1, 10, nt + 3):
        for label, got_values, got_indices in capped_searches(backend, queries, targets, k, metric, cap):
            assert_capped_topk(queries, targets, k, metric, cap, got_values, got_indices,
                               _rtol(backend), case=f"{label} {shape}")
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
    for label, values, indices in capped_searches(backend, q, t, 4, metric, cap):
        assert indices[0].tolist() == expected + [-1] * (4 - len(expected)), label
        assert values[0, len(expected) - 1] == np.float32(cap), label


@pytest.mark.parametrize("backend", BACKENDS)
def test_cosine_cap_is_inclusive(backend):
    # Axis vectors: cosines exactly 1, 0 and -1; a cap of 0 keeps the orthogonal target.
    q = np.array([[1.0, 0.0, 0.0]], np.float32)
    t = np.array([[0, 0, -2], [0, 3, 0], [2, 0, 0], [-1, 0, 0]], np.float32)
    for label, values, indices in capped_searches(backend, q, t, 4, "cosine", 0.0):
        assert indices[0].tolist() == [2, 0, 1, -1], label
        assert values[0].tolist() == [1.0, 0.0, 0.0, -np.inf], label


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "cosine", "inner_product"])
def test_a_pair_beyond_the_cap_never_takes_the_slot_of_one_within_it(backend, metric):
    # float64 rows whose two values round to the same float32 either side of the cap: the
    # lower index (row 0) is beyond it, row 1 within it, row 2 far; k=1 must return row 1.
    eps = 1e-12
    if metric in ("l2", "sqeuclidean"):
        q = np.zeros((1, 2))
        t = np.array([[1 + 3 * eps, 0.0], [1 + eps, 0.0], [9.0, 0.0]])
        cap = 1 + 2 * eps if metric == "l2" else (1 + 2 * eps) ** 2
    elif metric == "inner_product":
        q = np.array([[1.0, 0.0]])
        t = np.array([[1 - 3 * eps, 0.0], [1 - eps, 0.0], [-9.0, 0.0]])
        cap = 1 - 2 * eps
    else:   # cosine: angles 3 and 1 (times a small one), cap between their cosines
        a = 1e-5
        q = np.array([[1.0, 0.0]])
        t = np.array([[np.cos(3 * a), np.sin(3 * a)], [np.cos(a), np.sin(a)], [-1.0, 0.0]])
        cap = float(np.cos(2 * a))
    for label, values, indices in capped_searches(backend, q, t, 1, metric, cap):
        assert indices[0].tolist() == [1], label


ADVERSARIAL = [lambda: adv.offset_case(16, 10.0, 0.1, nq=20, nt=300, seed=41),
               lambda: adv.offset_case(3, 1e3, 0.1, nq=20, nt=300, seed=42, dtype=np.float64),
               lambda: adv.offset_case(1, 1e4, 1.0, nq=20, nt=300, seed=43),
               lambda: adv.integer_case(4, high=3, nq=20, nt=300, seed=44)]
ADVERSARIAL_IDS = ["offset10-d16", "offset1000-d3-float64", "offset1e4-d1", "integer3-d4"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", range(len(ADVERSARIAL)), ids=ADVERSARIAL_IDS)
def test_cap_on_adversarial_data(backend, n):
    """Offsets far larger than the spread (float32 and float64 rows), d = 1, duplicate targets
    and copies of targets as queries (exact ties), integer rows with hundreds of targets at
    each value: caps that leave some rows none, some fewer than k, some k. On integer data
    the caps are values themselves (inclusive: every target at the cap matches; l2,
    sqeuclidean, inner product: their float64 values are exact there), elsewhere midpoints."""
    case = ADVERSARIAL[n]()
    k = 10
    counts = []
    for metric in case.metrics:
        values = key_values(oracle_keys(case.queries, case.targets, metric), metric)
        exact = case.name.startswith("integer") and metric != "cosine"
        for quantile in (0.001, 0.01, 0.1):
            if exact:
                distinct = np.unique(values)[::-1 if DESCENDING[metric] else 1]
                cap = float(distinct[round(quantile * distinct.size)])
            else:
                cap = midpoint_cap(values, quantile, DESCENDING[metric])
            for label, got_v, got_i in capped_searches(backend, case.queries, case.targets, k, metric, cap):
                assert_capped_topk(case.queries, case.targets, k, metric, cap, got_v, got_i,
                                   _rtol(backend), case=f"{label} {case.name}")
                counts.append((got_i >= 0).sum(axis=1))
    counts = np.concatenate(counts)
    assert (counts == 0).any() and ((counts > 0) & (counts < k)).any() and (counts == k).any(), \
        (case.name, np.bincount(counts))


def _shells(nq: int = 20, d: int = 16, shell: int = 40, radius: float = 0.3, seed: int = 7):
    """Queries spread over a ball, each with 3 targets within 1e-3 and ``shell`` targets at
    ``radius`` (to 1e-6): a row's 10th value lies in its shell, whose near-ties a list of 32
    cannot prove uncapped; a cap below the shell leaves the row 3 targets."""
    rng = np.random.default_rng(seed)
    q = 2 * rng.standard_normal((nq, d)) / np.sqrt(d)
    close = np.repeat(q, 3, axis=0) + 1e-3 * rng.standard_normal((3 * nq, d))
    u = rng.standard_normal((nq * shell, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    rim = np.repeat(q, shell, axis=0) + radius * u * (1 + 1e-6 * rng.standard_normal((nq * shell, 1)))
    return q.astype(np.float32), np.concatenate([close, rim]).astype(np.float32)


@needs_torch
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("metric,cap", [("l2", 0.01), ("sqeuclidean", 1e-4), ("cosine", 0.99999)])
def test_the_gpu_cap_seeds_the_first_round_and_proves_short_rows(metric, cap, precision):
    """The cap is the searches' limit from the first candidate pass (``exact_topk(cap=)``): a
    seeded generator gets each row's cap limit on its first call, and rows with fewer than k
    targets within the cap are proven by it in that round. Uncapped, the same rows widen
    (:func:`_shells`), so the round count can fail."""
    from nearest_kernels import _gpu_prepare as gp
    from nearest_kernels import _gpu_search as gs

    queries, targets = _shells()
    qs, ts = gp.prepare_pair(torch.from_numpy(queries), torch.from_numpy(targets), metric, precision)
    calls = []

    def seeded(q, t, n_cand, seed=None, lower=False):
        calls.append(seed)
        return gs.torch_candidates(q, t, n_cand, lower=lower)

    gs.exact_topk(qs, ts, 10, seeded, seeded=True)
    assert len(calls) > 1 and calls[0] is None, "uncapped, the rows widen"
    calls.clear()
    v, i = gs.exact_topk(qs, ts, 10, seeded, seeded=True, cap=cap)
    assert_capped_topk(queries, targets, 10, metric, cap, v.numpy(), i.numpy(), backend_rtol("gpu"),
                       case=f"exact_topk {precision}")
    assert ((i >= 0).sum(dim=1) == 3).all()
    assert len(calls) == 1 and calls[0] is not None and torch.isfinite(calls[0]).all()


@needs_torch
@pytest.mark.parametrize("metric", ["l2", "sqeuclidean"])
def test_the_gpu_cap_applies_to_rows_searched_apart_in_float64(metric):
    """Query rows far beyond the block's working frame (``_gpu_search.far_topk``) take the cap
    too: the near row keeps its targets within the cap, the far row none, then all."""
    from nearest_kernels import _gpu_prepare as gp
    from nearest_kernels import _gpu_search as gs
    from nearest_kernels.gpu import knn_torch

    rng = np.random.default_rng(9)
    targets = rng.standard_normal((40, 3)).astype(np.float32)
    queries = np.array([[0.0, 0.0, 0.0], [1e25, 0.0, 0.0]], np.float32)
    side = gp.prepare_queries(torch.from_numpy(queries),
                              gp.prepare_targets_side(torch.from_numpy(targets), metric, "bf16"))
    assert gs.far_rows(side).tolist() == [False, True]
    values = key_values(oracle_keys(queries[:1], targets, metric), metric)
    for cap, counts in ((midpoint_cap(values, 0.2, False), (9, 0)), (1e26 if metric == "l2" else 1e52, (40, 40))):
        v, i = knn_torch(torch.from_numpy(queries), torch.from_numpy(targets), 45, metric, "bf16",
                         cap=cap)
        assert_capped_topk(queries, targets, 45, metric, cap, v.numpy(), i.numpy(), backend_rtol("gpu"),
                           case="far row")
        assert tuple((i >= 0).sum(dim=1).tolist()) == counts


@pytest.mark.parametrize("metric", METRIC_NAMES)
def test_capped_rows_need_no_float64_scan(request, metric, caplog):
    """A row with fewer than k targets within the cap is proven by the cap's key: the cpu
    kernel's float64 fallback search runs for no row (its debug line counts them)."""
    rng = _rng(request)
    queries = rng.standard_normal((200, 64)).astype(np.float32)
    targets = rng.standard_normal((3000, 64)).astype(np.float32)
    values = key_values(oracle_keys(queries, targets, metric), metric)
    cap = midpoint_cap(values, 0.001, DESCENDING[metric])
    with caplog.at_level(logging.DEBUG, logger="nearest_kernels.cpu"):
        _, indices = knn(queries, targets, 10, metric, backend="cpu", cap=cap)
    counts = (indices >= 0).sum(axis=1)
    assert (counts < 10).any() and (counts > 0).any()
    lines = [r.getMessage() for r in caplog.records if "float64 rows=" in r.getMessage()]
    assert lines and all(line.endswith("float64 rows=0") for line in lines), lines


@pytest.mark.parametrize("cap", [float("nan"), float("inf"), "1", True])
def test_bad_cap(cap):
    q = np.zeros((1, 2), np.float32)
    for backend in ("cpu", "reference"):
        with pytest.raises(ValueError, match="cap: expected None or a finite number"):
            knn(q, q, 1, "l2", backend=backend, cap=cap)
    if torch is not None:
        from nearest_kernels.gpu import knn_torch

        with pytest.raises(ValueError, match="cap: expected None or a finite number"):
            knn_torch(torch.from_numpy(q), torch.from_numpy(q), 1, "l2", cap=cap)


def test_a_backend_without_caps_is_refused_a_capped_call(monkeypatch):
    """A backend that does not declare ``caps`` would ignore the cap and return rows beyond it:
    the dispatcher refuses it by name, and ``auto`` passes over it to one that takes caps."""
    from nearest_kernels import dispatch
    from nearest_kernels.reference_backend import BACKEND as reference

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
