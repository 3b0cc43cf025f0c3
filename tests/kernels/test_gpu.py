"""The gpu backend against the float64 reference.

Here (no GPU): the torch path on CPU tensors, the fused Triton kernel under
``TRITON_INTERPRET=1`` (in a subprocess, so the variable never reaches other tests), and the
backend's refusal. On a CUDA machine (``-m gpu``): the full matrix of metrics x precisions x
k x data, with near-tie (clustered) data, poisoned kernel buffers and fresh data per check.

Every comparison is tie-aware: a returned index may differ from the reference's only where
its exact (float64) score equals the reference's score at that slot within the float32
tolerance of ``nearest_join.kernels.gpu.value_tolerance``. Distances are compared squared: the
square root halves relative errors and would hide a wrong ranking of close pairs.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

from nearest_join.kernels import knn, resolve_metric
from nearest_join.kernels.reference import knn_reference, scores_float64

try:
    import torch
except ImportError:  # the torch tests skip with a reason
    torch = None

REPO = Path(__file__).resolve().parents[2]
METRICS = ["l2", "sqeuclidean", "inner_product", "cosine"]
PRECISIONS = ["fp32", "tf32", "bf16"]
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
needs_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                                reason="needs a CUDA device (run on the GPU machine: pytest -m gpu)")
HAS_TRITON = importlib.util.find_spec("triton") is not None


# ----------------------------------------------------------------------------- data + oracle
def make_data(kind: str, nq: int, nt: int, d: int, seed: int):
    """Fresh float32 data. ``clustered``: tight clusters, so many targets tie to within the
    bf16/tf32 error but are distinct in float32 (the case the exact re-rank exists for)."""
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return (rng.standard_normal((nq, d)).astype(np.float32),
                rng.standard_normal((nt, d)).astype(np.float32))
    centers = 3.0 * rng.standard_normal((max(2, nt // 100), d))
    q = centers[rng.integers(0, len(centers), nq)] + 1e-3 * rng.standard_normal((nq, d))
    t = centers[rng.integers(0, len(centers), nt)] + 1e-3 * rng.standard_normal((nt, d))
    return q.astype(np.float32), t.astype(np.float32)


def _tolerance(q, t, metric: str) -> np.ndarray:
    """Per-query absolute tolerance on the ranking value (squared distance or similarity)."""
    from nearest_join.kernels.gpu import value_tolerance

    tol = value_tolerance(q.shape[1])
    if metric in ("l2", "sqeuclidean"):
        return None  # relative, applied per slot
    if metric == "cosine":
        return np.full(q.shape[0], 4 * tol + 8 * 2.0 ** -24)
    qn = np.linalg.norm(q.astype(np.float64), axis=1)
    tn = np.linalg.norm(t.astype(np.float64), axis=1).max() if len(t) else 0.0
    return 4 * tol * qn * tn


def check_result(q, t, k, metric, values, indices) -> int:
    """Assert the contract against the float64 reference; return the number of near-tie swaps."""
    from nearest_join.kernels.gpu import value_tolerance

    m = resolve_metric(metric)
    values = np.asarray(values)
    indices = np.asarray(indices)
    assert values.dtype == np.float32 and indices.dtype == np.int64
    assert values.shape == indices.shape == (q.shape[0], k)
    ref_v, ref_i = knn_reference(q, t, k, m)
    np.testing.assert_array_equal(indices < 0, ref_i < 0, err_msg="empty slots differ")
    assert np.all(values[indices < 0] == m.worst)
    valid = indices >= 0
    for row in range(q.shape[0]):
        picked = indices[row][valid[row]]
        assert len(np.unique(picked)) == len(picked), f"row {row}: duplicate targets {picked}"
    # Exact float64 scores of what was returned, and of the reference's choice.
    scores = scores_float64(q, t, m)
    if metric == "l2":
        scores = scores ** 2           # compare squared distances (see the module notes)
        ref_rank = ref_v.astype(np.float64) ** 2
        got_val = values.astype(np.float64) ** 2
    else:
        ref_rank = ref_v.astype(np.float64)
        got_val = values.astype(np.float64)
    got_exact = np.where(valid, np.take_along_axis(scores, np.maximum(indices, 0), 1), 0.0)
    ref_rank = np.where(valid, ref_rank, 0.0)
    got_val = np.where(valid, got_val, 0.0)
    if metric in ("l2", "sqeuclidean"):
        rel = 4 * value_tolerance(q.shape[1]) + 8 * 2.0 ** -24
        tol = rel * np.maximum(np.abs(ref_rank), np.abs(got_exact)) + 1e-30
    else:
        tol = np.broadcast_to(_tolerance(q, t, metric)[:, None], values.shape)
    # The k-th best exact score must be as good as the reference's, slot by slot.
    bad = valid & (np.abs(got_exact - ref_rank) > tol)
    assert not bad.any(), (
        f"{int(bad.sum())} slots rank a target whose exact score is off the reference's by more "
        f"than the float32 tolerance; first at {np.argwhere(bad)[0]}: got index "
        f"{indices[bad][0]} score {got_exact[bad][0]!r}, reference index {ref_i[bad][0]} score "
        f"{ref_rank[bad][0]!r}")
    off = valid & (np.abs(got_val - got_exact) > tol)
    assert not off.any(), f"{int(off.sum())} returned values differ from their pair's exact score"
    # Best first within each row (allowing float32-level near ties).
    sign = -1.0 if m.descending else 1.0
    steps = sign * np.diff(got_exact, axis=1)
    assert np.all((steps >= -tol[:, 1:]) | ~valid[:, 1:]), "rows are not sorted best first"
    return int((indices != ref_i).sum())


# ----------------------------------------------------------------------------- no GPU needed
def test_backend_refuses_without_cuda_and_names_why():
    from nearest_join.kernels.gpu import BACKEND

    q = np.zeros((2, 3), np.float32)
    reason = BACKEND.refuse(q, q, 1, resolve_metric("l2"))
    if torch is not None and torch.cuda.is_available():
        assert reason is None
    else:
        assert reason and ("CUDA" in reason or "torch" in reason)


def test_invalid_precision_is_a_value_error_naming_the_argument():
    from nearest_join.kernels.gpu import BACKEND

    q = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="precision"):
        BACKEND.refuse(q, q, 1, resolve_metric("l2"), precision="fp16")


@needs_torch
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", ["gaussian", "clustered"])
@pytest.mark.parametrize("d,k", [(1, 3), (3, 7), (33, 40), (31, 400)], ids=lambda v: str(v))
def test_torch_path_on_cpu_matches_reference(metric, precision, kind, d, k):
    from nearest_join.kernels.gpu import knn_torch

    seed = zlib.crc32(repr((metric, precision, kind, d, k)).encode())
    q, t = make_data(kind, 37, 301, d, seed)
    v, i = knn_torch(torch.from_numpy(q), torch.from_numpy(t), k, metric, precision, impl="torch")
    check_result(q, t, k, metric, v.numpy(), i.numpy())


@needs_torch
@pytest.mark.parametrize("metric", METRICS)
def test_rows_that_cannot_rank_never_match(metric):
    from nearest_join.kernels.gpu import knn_torch

    q, t = make_data("gaussian", 6, 40, 5, 3)
    q[1, 2] = np.nan
    t[4, 0] = np.inf
    t[11] = 0.0
    v, i = knn_torch(torch.from_numpy(q), torch.from_numpy(t), 50, metric, "bf16", impl="torch")
    ref_v, ref_i = knn(q, t, 50, metric, backend="reference")
    np.testing.assert_array_equal(i.numpy(), ref_i)
    assert (i.numpy()[1] == -1).all()


@needs_torch
def test_ties_go_to_the_lower_index():
    from nearest_join.kernels.gpu import knn_torch

    t = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 0.0], [0.0, -1.0]], np.float32)
    q = np.zeros((1, 2), np.float32)
    for precision in PRECISIONS:
        v, i = knn_torch(torch.from_numpy(q), torch.from_numpy(t), 4, "l2", precision, impl="torch")
        assert i.tolist() == [[0, 1, 2, 3]] and v.tolist() == [[1.0] * 4]


@needs_torch
def test_the_check_catches_a_plain_bf16_search():
    """Without the re-rank, bf16 scrambles near ties: the oracle must notice (it can fail)."""
    from nearest_join.kernels import _gpu_torch as gt

    q, t = make_data("clustered", 40, 400, 64, 5)
    qs = gt.prepare_side(torch.from_numpy(q), "sqeuclidean", "bf16")
    ts = gt.prepare_side(torch.from_numpy(t), "sqeuclidean", "bf16")
    v, i = gt.approximate_topk(qs, ts, 10, gt.torch_candidates)
    with pytest.raises(AssertionError):
        check_result(q, t, 10, "sqeuclidean", v.numpy(), i.numpy())


# ----------------------------------------------------------------------------- floors
def _prepared(q, t, metric="sqeuclidean", precision="fp32"):
    from nearest_join.kernels import _gpu_torch as gt

    return (gt.prepare_side(torch.from_numpy(q), metric, precision),
            gt.prepare_side(torch.from_numpy(t), metric, precision))


@needs_torch
@pytest.mark.parametrize("lower", [False, True])
def test_torch_candidates_in_target_chunks_equal_one_pass(lower):
    """The torch generator converts and scans the targets chunk by chunk (its float32 copy
    of a bf16 operand is bounded by chunk_elements): the lists do not depend on the chunks."""
    from nearest_join.kernels import _gpu_torch as gt

    q, t = make_data("gaussian", 5, 1000, 16, 11)
    qs, ts = _prepared(q, t, "l2", "bf16")
    whole = gt.torch_candidates(qs, ts, 32, lower=lower)
    chunked = gt.torch_candidates(qs, ts, 32, lower=lower, chunk_elements=16 * 40)   # 25 chunks
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert bool((whole[1] >= 0).all())


@needs_torch
def test_a_floor_above_the_margin_proves_a_list_whose_last_key_does_not():
    """8 targets tie at squared distance 1 from the query, the rest are at 9. The 8-long list
    ends on a tie (last key = theta: the plain rule widens); a floor of 9 proves it."""
    from nearest_join.kernels import _gpu_torch as gt

    rng = np.random.default_rng(1)
    near = np.concatenate([np.eye(4), -np.eye(4)])
    far = rng.standard_normal((30, 4))
    far = 3 * far / np.linalg.norm(far, axis=1, keepdims=True)
    t = np.concatenate([far[:10], near, far[10:]]).astype(np.float32)
    q = np.zeros((2, 4), np.float32)
    qs, ts = _prepared(q, t)
    calls = []

    def with_floor(qq, tt, n_cand):
        calls.append(n_cand)
        keys, idx = gt.torch_candidates(qq, tt, n_cand + 1)
        return keys[:, :n_cand], idx[:, :n_cand], keys[:, n_cand]   # next key: a valid floor

    v, i = gt.exact_topk(qs, ts, 3, with_floor)
    assert calls == [gt.candidate_width(3, "fp32")], calls            # proven, not widened
    assert i.tolist() == [[10, 11, 12]] * 2
    check_result(q, t, 3, "sqeuclidean", v.numpy(), i.numpy())


@needs_torch
def test_a_floor_below_the_margin_widens_a_list_that_looks_complete():
    """The first list leaves out each row's best target and ends in empty slots, which by
    the plain rule means "every target is here"; its floor (the left-out key) says otherwise:
    the rows must widen and find the target."""
    from nearest_join.kernels import _gpu_torch as gt

    q, t = make_data("gaussian", 5, 200, 8, 2)
    qs, ts = _prepared(q, t)
    calls = []

    def holey(qq, tt, n_cand):
        calls.append(n_cand)
        keys, idx = gt.torch_candidates(qq, tt, n_cand)
        if len(calls) > 1:
            return keys, idx
        rows = keys.shape[0]
        keys = torch.cat([keys[:, 1:], torch.full((rows, 1), float("inf"))], 1)
        idx = torch.cat([idx[:, 1:], torch.full((rows, 1), -1)], 1)
        return keys, idx, gt.torch_candidates(qq, tt, 1)[0][:, 0]

    v, i = gt.exact_topk(qs, ts, 3, holey)
    n0 = gt.candidate_width(3, "fp32")
    assert calls == [n0, gt.widened(n0)], calls
    check_result(q, t, 3, "sqeuclidean", v.numpy(), i.numpy())
    # few_rows: a widening round over at most that many rows runs the torch generator (the
    # fused kernel's fixed costs dominate a round over a handful of rows): the same result.
    for few, expected in ((4, [n0, gt.widened(n0)]), (5, [n0])):
        calls.clear()
        v, i = gt.exact_topk(qs, ts, 3, holey, few_rows=few)
        assert calls == expected, (few, calls)
        check_result(q, t, 3, "sqeuclidean", v.numpy(), i.numpy())


@needs_torch
def test_the_rerank_skips_candidates_beyond_the_value_limit():
    from nearest_join.kernels import _gpu_torch as gt

    keys = torch.tensor([[0.0, 1.0, 2.0, 3.0, 3.5, 9.0, 10.0, 11.0],
                         [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]])
    idx = torch.arange(16).view(2, 8)
    # Row 0: keys <= 3 (inclusive): 4 columns read. Row 1: keys <= 1.2: 3 columns.
    kept = gt.skip_beyond(keys, idx, torch.tensor([3.0, 1.2]))
    assert kept.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1], [8, 9, 10, -1, -1, -1, -1, -1]]
    # Through the re-rank: the values function never sees a column beyond the limit, and
    # the k best are those of every column (a limit from the head's k-th value).
    q = torch.tensor([[0.0, 0.0]])
    t = torch.tensor([[float(j), 0.0] for j in range(8)])
    qs, ts = gt.prepare_side(q, "l2", "fp32"), gt.prepare_side(t, "l2", "fp32")
    seen = []

    def spy(queries, targets, sel):
        seen.append(sel.clone())
        return gt.exact_values(queries, targets, sel)
    tkeys = (t * t).sum(1)[None, :]                  # exact keys of this query: |t|^2
    v, i = gt.rerank(qs, ts, tkeys, torch.arange(8)[None, :], torch.tensor([0.5]), 3, spy)
    assert i.tolist() == [[0, 1, 2]] and v.tolist() == [[0.0, 1.0, 4.0]]
    # head: columns 0-2 (V0 = 4), the rest up to key 4 + 0.5: none of columns 3..7 (9+).
    assert seen[0].tolist() == [[0, 1, 2]] and seen[1].tolist() == [[-1, -1, -1, -1, -1]], seen
    # value_limit: key(V) + E, never rounded down. l2: key = V - |q|^2; similarities: -V.
    q = np.array([[3.0, 4.0], [1.0, 0.0]], np.float32)            # |q|^2 = 25, 1
    qs = gt.prepare_side(torch.from_numpy(q), "l2", "fp32")
    lim = gt.value_limit(torch.tensor([30.0, 2.0]), torch.tensor([0.5, 0.25]), qs).double()
    assert (lim >= torch.tensor([5.5, 1.25], dtype=torch.float64)).all(), lim
    assert torch.allclose(lim, torch.tensor([5.5, 1.25], dtype=torch.float64), atol=1e-4), lim
    qs = gt.prepare_side(torch.from_numpy(q), "inner_product", "fp32")
    lim = gt.value_limit(torch.tensor([30.0, 2.0]), torch.tensor([0.5, 0.25]), qs).double()
    assert (lim >= torch.tensor([-29.5, -1.75], dtype=torch.float64)).all(), lim
    assert bool(torch.isinf(gt.value_limit(torch.tensor([math.inf, math.inf]), torch.tensor([0.5, 0.25]),
                                           gt.prepare_side(torch.from_numpy(q), "l2", "fp32"))).all())
    # Through exact_topk: Gaussian data, fp32 (a tiny bound): the re-rank reads fewer columns.
    q, t = make_data("gaussian", 7, 300, 16, 3)
    qs, ts = _prepared(q, t)
    widths = []
    real = gt.exact_values

    def spy(queries, targets, idx, **kw):
        widths.append((idx.shape[1], int((idx >= 0).sum())))   # (columns, pairs read)
        return real(queries, targets, idx, **kw)

    gt.exact_values = spy
    try:
        v, i = gt.exact_topk(qs, ts, 3, gt.torch_candidates)
    finally:
        gt.exact_values = real
    n0 = gt.candidate_width(3, "fp32")
    assert widths[0] == (3, 7 * 3) and widths[1][0] == n0 - 3, widths
    assert sum(read for _, read in widths) < 7 * n0, widths
    check_result(q, t, 3, "sqeuclidean", v.numpy(), i.numpy())


@needs_torch
@pytest.mark.parametrize("metric", ["sqeuclidean", "inner_product"])
def test_the_reranked_values_prove_a_list_the_keys_alone_cannot(metric):
    """bf16 keys, k=3, lists of 8: the 3 nearest targets, then 5 more about 1.5 E further
    (E the error bound). The key-only test needs a gap of 2E and would widen; the re-ranked
    3rd value lies within the actual error of the 3rd key, far inside E, and proves the
    list. The setup itself is asserted, so the test cannot pass vacuously."""
    from nearest_join.kernels import _gpu_torch as gt

    rng = np.random.default_rng(4)
    d, k = 16, 3
    q = (10 * rng.standard_normal((1, d))).astype(np.float32)
    u = rng.standard_normal((40, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)

    def build(gap_e):
        # Keys rise along each row: sqeuclidean by radius, inner_product by the component
        # along q (all targets at one norm, so the bound's terms barely move).
        steps = np.concatenate([[0.0, 0.01, 0.02], 1.5 + 0.01 * np.arange(37)]) * gap_e
        if metric == "sqeuclidean":
            t = q + np.sqrt(4.0 + steps)[:, None] * u
        else:
            qn = q[0] / np.linalg.norm(q[0])
            perp = u - (u @ qn)[:, None] * qn
            perp /= np.linalg.norm(perp, axis=1, keepdims=True)
            cos = 0.9 - steps / (20 * np.linalg.norm(q[0]))     # dot falls by steps
            t = 20 * (cos[:, None] * qn + np.sqrt(1 - cos ** 2)[:, None] * perp)
        return rng.permutation(t).astype(np.float32)

    qs = gt.prepare_side(torch.from_numpy(q), metric, "bf16")
    ts = gt.prepare_side(torch.from_numpy(build(1.0)), metric, "bf16")
    e = float(gt.key_error_bound(qs, gt.TargetStats.of(ts), metric)[0])
    t = build(e)
    ts = gt.prepare_side(torch.from_numpy(t), metric, "bf16")
    bound = gt.key_error_bound(qs, gt.TargetStats.of(ts), metric)
    n_cand = gt.candidate_width(k, "bf16")
    assert n_cand == 8
    keys, idx = gt.torch_candidates(qs, ts, n_cand)
    assert not bool(gt.margin_holds(keys, bound, k)[0]), "setup: the keys alone must not prove the list"
    calls = []

    def counted(qq, tt, n):
        calls.append(n)
        return gt.torch_candidates(qq, tt, n)

    v, i = gt.exact_topk(qs, ts, k, counted)
    assert calls == [n_cand], calls                 # proven by the values: no widening
    check_result(q, t, k, metric, v.numpy(), i.numpy())


# ----------------------------------------------------------------------------- lower keys
def _spread_norms(kind, nq, nt, d, seed):
    """Data whose row norms span 0.1x to 10x: the block maxima of the bound's terms are far
    above most rows' own (the case per-target bounds are for)."""
    q, t = make_data(kind, nq, nt, d, seed)
    rng = np.random.default_rng(seed + 1)
    q = q * np.exp(rng.uniform(np.log(0.1), np.log(10), (nq, 1))).astype(np.float32)
    t = t * np.exp(rng.uniform(np.log(0.1), np.log(10), (nt, 1))).astype(np.float32)
    return q, t


@needs_torch
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_lower_keys_bound_every_exact_key_from_below(metric, precision):
    """L - E' <= the exact key for every pair (the per-target bound is valid), while the plain
    key - E' is above it for some pair (E' alone does not cover the residual terms, so the
    test fails if the lower key's weights were dropped)."""
    from nearest_join.kernels import _gpu_torch as gt

    q, t = _spread_norms("gaussian", 40, 500, 48, 9)
    qs, ts = _prepared(q, t, metric, precision)
    stats = gt.TargetStats.of(ts)
    rest = gt.lower_key_bound(qs, stats, metric).double()[:, None]
    assert bool((rest < gt.key_error_bound(qs, stats, metric).double()[:, None]).all())
    lower, l_idx = gt.torch_candidates(qs, ts, ts.rows, lower=True)
    plain, p_idx = gt.torch_candidates(qs, ts, ts.rows)
    t64 = ts.exact.double()
    bias = (t64 ** 2).sum(1) if gt.l2_form(metric) else torch.zeros(ts.rows, dtype=torch.float64)
    exact = bias[None, :] - gt.key_alpha(metric) * (qs.exact.double() @ t64.T)
    assert bool((lower.double() - rest <= exact.gather(1, l_idx)).all())
    assert bool((plain.double() - rest > exact.gather(1, p_idx)).any())


@needs_torch
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_the_bias_table_never_lifts_a_lower_key(metric, precision):
    """The fused kernel's lower keys (a bias level per block of rows) are at most the per-row
    lower keys, for rows of spread norms in any order and a zero row; the table has the
    levels asked for, and each row's shift is at most ``lower_shift`` (which the bound's
    roundings use)."""
    from nearest_join.kernels import _gpu_torch as gt

    q, t = _spread_norms("gaussian", 45, 300, 24, 3)
    if metric != "cosine":
        q[7] = 0.0
    qs, ts = _prepared(q, t, metric, precision)
    q_w, t_w = gt.lower_key_weights(qs, ts)
    per_row = ts.bias.double() - q_w[0].double()[:, None] * t_w[0].double() - q_w[1].double()[:, None] * t_w[1].double()
    shift = gt.lower_shift(qs, gt.TargetStats.of(ts), metric)
    for levels in (None, 3, 8):
        table, level = gt.lower_bias_table(qs, ts, 8, levels)
        assert table.shape == (levels or gt.LOWER_LEVELS, 300) and level.shape == (6,)
        assert bool((level >= 0).all()) and bool((level < table.shape[0]).all())
        bias = table.double()[level.long().repeat_interleave(8)[:45]]
        assert bool((bias <= per_row).all()), levels
        # (the table's float32 rounding, down, adds at most an ulp of the bias)
        assert bool((ts.bias.double() - bias <= shift * (1 + 1e-6) + 2.0 ** -22 * ts.bias.double().abs()).all())
    # Rows a widening round takes keep the table (no new one built) and get valid levels of it.
    table, _ = gt.lower_bias_table(qs, ts, 8, 8)
    retry = torch.tensor([1, 7, 8, 20, 33, 44])
    child = gt._widened_rows(qs, retry, lower=True)
    child_table, child_level = gt.lower_bias_table(child, ts, 4, 8)
    assert child_table is table and child_level.shape == (2,)
    bias = table.double()[child_level.long().repeat_interleave(4)[:6]]
    assert bool((bias <= per_row[retry]).all())
    # ... and their bound carries over: at least the one computed for them alone.
    stats = gt.TargetStats.of(ts)
    own = gt.lower_key_bound(qs.take(retry), stats, metric)
    assert bool((gt.lower_key_bound(qs, stats, metric)[retry] >= own).all())


@needs_torch
@pytest.mark.parametrize("precision,d,k,expected", [
    ("bf16", 16, 5, True), ("bf16", 128, 10, True),       # small k: lower keys up to d = 128
    ("bf16", 200, 10, False), ("bf16", 200, 70, True),    # above it only from k = 64
    ("tf32", 16, 70, False), ("fp32", 16, 5, False)])
def test_search_ranks_by_lower_keys_where_the_rule_says(precision, d, k, expected, monkeypatch):
    """EXACT searches pass ``lower`` to exact_topk by precision, k and dimension
    (gpu.LOWER_KEYS, LOWER_KEYS_SMALL_K_MAX_D: at d=768 bf16 k=10 the lower-key start cost
    1.54x the plain search against 1.07), and the answer is exact either way."""
    from nearest_join.kernels import _gpu_torch as gt
    from nearest_join.kernels import gpu as kgpu

    seen = []
    exact_topk = gt.exact_topk

    def spy(*args, **kwargs):
        seen.append(kwargs.get("lower"))
        return exact_topk(*args, **kwargs)
    monkeypatch.setattr(gt, "exact_topk", spy)
    q, t = make_data("gaussian", 9, 150, d, d + k)
    v, i = kgpu.knn_torch(torch.from_numpy(q), torch.from_numpy(t), k, "sqeuclidean", precision)
    assert seen == [expected]
    check_result(q, t, k, "sqeuclidean", v.numpy(), i.numpy())


@needs_torch
@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "inner_product"])
def test_lower_keys_prove_rows_the_block_maximum_cannot(metric, monkeypatch):
    """bf16, k=10, lists of 16 (the plain width, both ways). Queries lean one way; 20 of the
    4,000 targets have 30x the norm and point the other way: they never rank, but they set
    the block maxima of the bound's target terms. Ranked by the lower key, whose target
    terms are each row's own, fewer rows widen; both results are exact."""
    from nearest_join.kernels import _gpu_torch as gt

    rng = np.random.default_rng(5)
    d, k = 32, 10
    lean = np.full(d, 3 / np.sqrt(d))
    q = (rng.standard_normal((200, d)) + lean).astype(np.float32)
    t = rng.standard_normal((4000, d))
    t[::200] = -30 * (lean + 0.1 * rng.standard_normal((20, d)))
    t = t.astype(np.float32)
    qs, ts = _prepared(q, t, metric, "bf16")
    monkeypatch.setitem(gt._EXTRA, "bf16", lambda k: 0)
    widened = {}
    for lower in (False, True):
        calls = []

        def counted(qq, tt, n, **kw):
            assert kw.get("lower", False) == lower
            calls.append(qq.rows)
            return gt.torch_candidates(qq, tt, n, **kw)

        v, i = gt.exact_topk(qs, ts, k, counted, lower=lower)
        check_result(q, t, k, metric, v.numpy(), i.numpy())
        widened[lower] = sum(calls[1:])
    assert widened[True] * 10 < widened[False], widened   # measured: 0 against 198-200


@pytest.mark.skipif(not HAS_TRITON or torch is None, reason="triton (and torch) are not installed")
def test_skip_share_predicts_the_tiles_without_survivors():
    """The model behind the row-minimum test's switch against a simulated scan: random keys,
    each row's threshold the list_len-th best so far, a tile skipped when no row reaches it."""
    from nearest_join.kernels import _gpu_triton as tr

    rng = np.random.default_rng(5)
    for block_m, list_len, n_tiles in [(8, 4, 400), (4, 2, 300), (16, 8, 150)]:
        shares = []
        for _ in range(4):
            keys = rng.random((block_m, n_tiles, 16))
            skipped = 0
            best = np.full((block_m, list_len), np.inf)
            for j in range(n_tiles):
                tile = keys[:, j, :]
                if not (tile.min(axis=1) <= best.max(axis=1)).any():
                    skipped += 1
                best = np.sort(np.concatenate([best, tile], axis=1), axis=1)[:, :list_len]
            shares.append(skipped / n_tiles)
        predicted = tr.skip_share(n_tiles, block_m, list_len)
        assert abs(np.mean(shares) - predicted) < 0.05, (block_m, list_len, np.mean(shares), predicted)
    assert tr.skip_share(0, 128, 16) == 0.0
    assert tr.skip_share(7813, 128, 16) > tr.skip_share(7813, 128, 32) > tr.skip_share(488, 128, 16)


@pytest.mark.skipif(not HAS_TRITON or torch is None, reason="triton (and torch) are not installed")
def test_merging_segments_keeps_the_floor_of_every_held_back_target():
    from nearest_join.kernels import _gpu_triton as tr

    def pack(key, index):
        bits = torch.tensor([key], dtype=torch.float32).view(torch.int32).to(torch.int64)
        mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return int((mono << 32) | index)

    E = tr.EMPTY
    # Three segments of 3 slots, unsorted. Segment 0 full (held back keys >= 5), segment 1
    # full (>= 2.5), segment 2 not full (holds its whole segment).
    row = [pack(5.0, 1), pack(-1.0, 0), pack(3.0, 2),
           pack(2.5, 10), pack(0.5, 11), pack(2.0, 12),
           pack(1.0, 20), E, E]
    lists = torch.tensor([row, row], dtype=torch.int64)
    merged, floor = tr.merge_segments(lists, 3, 8)
    keys, idx = tr.unpack(merged)
    assert idx[0].tolist() == [0, 11, 20, 12, 10, 2, 1, -1]
    assert floor.tolist() == [2.5, 2.5]
    # Cut to 5: the first dropped key is 3.0, segment 1 still bounds its own at 2.5.
    merged, floor = tr.merge_segments(lists, 3, 5)
    assert tr.unpack(merged)[1][0].tolist() == [0, 11, 20, 12, 10]
    assert floor.tolist() == [2.5, 2.5]
    # Cut to 2: the first dropped key (1.0) is the floor.
    merged, floor = tr.merge_segments(lists, 3, 2)
    assert tr.unpack(merged)[1][0].tolist() == [0, 11]
    assert floor.tolist() == [1.0, 1.0]


@pytest.mark.skipif(not HAS_TRITON or torch is None, reason="triton (and torch) are not installed")
def test_target_tiles_by_descriptor_only_where_tma_can_address_them(monkeypatch):
    from nearest_join.kernels import _gpu_triton as tr

    def form(t, block_d=64):
        out = tr.target_descriptor(t, 32, block_d)
        return "descriptor" if isinstance(out, tr.TensorDescriptor) else ("operand" if out is t else "?")

    t32, t16 = torch.zeros(203, 40), torch.zeros(203, 40, dtype=torch.bfloat16)
    assert tr.TMA_DEVICES == {"cuda"} and form(t32) == "operand"   # CPU tensors: pointer tiles
    monkeypatch.setattr(tr, "TMA_DEVICES", {"cpu"})
    assert form(t32) == form(t16) == "descriptor"
    desc = tr.target_descriptor(t16, 32, 64)
    assert list(desc.shape) == [203, 40] and list(desc.block_shape) == [32, 64]
    # Rows whose stride is not a multiple of 16 bytes (d=33 float32, d=36 bf16), a column
    # slice (last stride not 1), a misaligned start, a block wider than a TMA box: pointers.
    assert form(torch.zeros(203, 33)) == form(torch.zeros(203, 36, dtype=torch.bfloat16)) == "operand"
    assert form(torch.zeros(40, 203).T) == form(torch.zeros(204, 40).view(-1)[1:8121].view(203, 40)) == "operand"
    assert form(torch.zeros(203, 512, dtype=torch.bfloat16), block_d=512) == "operand"
    # CUDA devices: Hopper (9.0) and later only; below it Triton would rewrite the descriptor
    # into pointer loads, a form the kernel was never measured in.
    majors = {0: 8, 1: 9}
    monkeypatch.setattr(tr, "TMA_DEVICES", {"cuda"})
    monkeypatch.setattr(tr, "_cuda_major", lambda index: majors[index])
    assert not tr.has_tma(torch.device("cuda", 0)) and tr.has_tma(torch.device("cuda", 1))
    assert not tr.has_tma(torch.device("cpu"))


# The start of every interpreter script (run with TRITON_INTERPRET=1 in a subprocess).
_INTERPRETER_PRELUDE = """
import numpy as np, torch
import triton.runtime.interpreter as interp
# triton 3.6's interpreter turns scalar arguments into 1-element arrays; numpy >= 2.4 no
# longer converts those with int(): index them explicitly.
_patch = interp._patch_lang_tensor
def _patched(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interp._patch_lang_tensor = _patched

from nearest_join.kernels import _gpu_torch as gt, _gpu_triton as tr
from tests.kernels.test_gpu import check_result, make_data
"""

_INTERPRETER_SCRIPT = _INTERPRETER_PRELUDE + """
tr.POISON_BUFFERS = True
# Tiny tiles make segments of 2+ tiles (203 targets: up to 3 segments; 603: up to 9).
tr.SEGMENT_MIN_TILES = 2

import sys
KERNEL = sys.argv[1]
SEGMENTED = tr.TileConfig(16, 32, 0, 4, kernel="segmented", seg_cand=8, extra_passes=2)

SEEDS = []   # the seeds exact_topk's widening rounds passed

def small(q, t, n_cand, seed=None, lower=False):
    # Tiny tiles so that 203 targets make several tiles and splits; every path is taken.
    if seed is not None:
        SEEDS.append(seed)
    cap = max(64, gt.next_pow2(n_cand + 32))
    if KERNEL == "segmented":   # 8-long lists per segment; the buffer kernel where too few
        return tr.triton_candidates(q, t, n_cand, config=SEGMENTED, seed=seed, lower=lower)
    if KERNEL == "rowlist" and n_cand <= 32:
        cfg = tr.TileConfig(16, 32, 0, 4, kernel="rowlist", extra_passes=2)
    else:
        cfg = tr.TileConfig(16, 32, cap, 4, pipelined=KERNEL != "legacy")
    return tr.triton_candidates(q, t, n_cand, config=cfg, splits=2, seed=seed, lower=lower)

def check_seeded(qs, ts, n_cand, gen):
    # Seeds: +inf, midway between the 3rd and 4th best keys and between the 12th and 13th,
    # below every key (midway: the kernel's float32 keys differ from these by rounding).
    # Each row's list must hold the n_cand best targets with key <= seed (all of them when
    # fewer) and nothing else; every target left out must have key >= floor (to rounding),
    # and a row with room left must have a floor above its seed.
    ref = (ts.bias[None, :] - gt.key_alpha(qs.metric) * (qs.operand.double() @ ts.operand.double().T)).float()
    tol = 1e-5 * float(ref.abs().max())
    ordered = torch.sort(ref, dim=1).values
    m = ref.shape[0]
    seed = torch.full((m,), float("inf"))
    seed[1::4] = (ordered[1::4, 2] + ordered[1::4, 3]) / 2
    seed[2::4] = (ordered[2::4, 11] + ordered[2::4, 12]) / 2
    seed[3::4] = ordered[3::4, 0] - 1.0
    keys, idx, floor = gen(qs, ts, n_cand, seed)
    for r in range(m):
        allowed = (ref[r] <= seed[r]).nonzero().flatten()
        got = idx[r][idx[r] >= 0]
        assert set(got.tolist()) <= set(allowed.tolist()), r
        if KERNEL != "segmented":   # segments may hold back more (their floors say so)
            assert got.numel() == min(n_cand, allowed.numel()), (r, got.numel(), allowed.numel())
        left = torch.ones(ref.shape[1], dtype=torch.bool)
        left[got] = False
        assert bool((ref[r][left] >= floor[r] - tol).all()), r
        if got.numel() < n_cand and torch.isfinite(seed[r]):
            assert floor[r] > seed[r] or KERNEL == "segmented", (r, float(floor[r]), float(seed[r]))
            if KERNEL != "segmented":
                assert set(got.tolist()) == set(allowed.tolist()), r
    return len(SEEDS)

def prepared(q, t, metric, precision):
    return (gt.prepare_side(torch.from_numpy(q), metric, precision),
            gt.prepare_side(torch.from_numpy(t), metric, precision))

cases = [("l2", "fp32", "gaussian", 5), ("sqeuclidean", "bf16", "clustered", 5),
         ("inner_product", "tf32", "clustered", 3), ("cosine", "bf16", "gaussian", 40)]
for n, (metric, precision, kind, k) in enumerate(cases):
    q, t = make_data(kind, 21, 203, 33, n)
    qs, ts = prepared(q, t, metric, precision)
    # The kernel's candidate keys equal the torch path's exactly computed keys.
    keys, idx, _ = small(qs, ts, 16)
    ref = ts.bias[None, :] - gt.key_alpha(metric) * (qs.operand.double() @ ts.operand.double().T)
    order = torch.sort(ref.float(), dim=1, stable=True)
    if kind == "gaussian":  # no near ties: the same order as float64 keys
        assert torch.equal(idx[:, :8], order.indices[:, :8]), (metric, precision)
    # Lower keys (EXACT mode's per-target bound): each 16-row program reads its row of the
    # bias table; the keys are that table's, to float32 rounding, and never above the
    # per-row lower keys of the torch path (the table's levels only lower them).
    keys, idx, _ = small(qs, ts, 16, lower=True)
    table, level = gt.lower_bias_table(qs, ts, 16, gt.lower_levels(16))
    prod = qs.operand.double() @ ts.operand.double().T
    lower = table.double()[level.long().repeat_interleave(16)[:21]] - gt.key_alpha(metric) * prod
    q_w, t_w = gt.lower_key_weights(qs, ts)
    per_row = ref - q_w[0].double()[:, None] * t_w[0].double() - q_w[1].double()[:, None] * t_w[1].double()
    tol = 1e-5 * float(ref.abs().max())
    assert bool((lower <= per_row + tol).all()), metric
    assert (idx >= 0).all() and torch.allclose(keys.double(), torch.gather(lower, 1, idx), rtol=1e-5, atol=tol), metric
    if kind == "gaussian":
        assert torch.equal(idx[:, :8], torch.sort(lower.float(), dim=1, stable=True).indices[:, :8]), metric
    # Half the cases rank by the lower key (EXACT bf16's default).
    v, i = gt.exact_topk(qs, ts, k, small, max_candidates=256, values=tr.triton_exact_values,
                         seeded=True, lower=n % 2 == 1)
    check_result(q, t, k, metric, v.numpy(), i.numpy())

if KERNEL in ("rowlist", "segmented"):
    # Seeded lists (the widening rounds' limit): fp32 keys, so the reference order is exact.
    q, t = make_data("gaussian", 12, 203, 33, 21)
    qs, ts = prepared(q, t, "l2", "fp32")
    check_seeded(qs, ts, 16, small)
    # exact_topk passes seeds in its widening rounds: a first list too short to prove the
    # clustered rows (near ties within the bf16 error) makes them widen, seeded.
    q, t = make_data("clustered", 21, 203, 33, 22)
    qs, ts = prepared(q, t, "sqeuclidean", "bf16")
    before = len(SEEDS)
    v, i = gt.exact_topk(qs, ts, 5, small, max_candidates=256, values=tr.triton_exact_values, seeded=True)
    check_result(q, t, 5, "sqeuclidean", v.numpy(), i.numpy())
    assert len(SEEDS) > before, "no widening round: the seeded path went untested"
    cases.append("seeded")

if KERNEL in ("rowlist", "segmented"):
    # Target tiles by tensor descriptor (TMA on a GPU; tr.TMA_DEVICES): d=40 rows are 16-byte
    # aligned in bf16 and float32, so the descriptor form runs here (d=33 above does not). Its
    # lists must be the pointer form's (keys to float32 rounding: the interpreter may sum the
    # products in another order): plain lists, lower keys (bf16) and seeded lists (fp32).
    for n, (metric, precision) in enumerate((("l2", "fp32"), ("sqeuclidean", "bf16"), ("inner_product", "tf32"))):
        q, t = make_data("gaussian", 21, 203, 40, 30 + n)
        qs, ts = prepared(q, t, metric, precision)
        ordered = torch.sort(ts.bias[None, :] - gt.key_alpha(metric) * (qs.operand.double() @ ts.operand.double().T),
                             dim=1).values
        seed = torch.full((21,), float("inf"))
        seed[::3] = ((ordered[:, 5] + ordered[:, 6]) / 2).float()[::3]   # midway: no key at the seed
        for kw in [{}] + [{"lower": True}] * (precision == "bf16") + [{"seed": seed}] * (precision == "fp32"):
            got = {}
            for form, devices in (("descriptor", {"cpu"}), ("pointer", set())):
                tr.TMA_DEVICES = devices
                assert isinstance(tr.target_descriptor(ts.operand, 32, 64), tr.TensorDescriptor) == (form == "descriptor")
                got[form] = small(qs, ts, 16, **kw)
            tr.TMA_DEVICES = {"cuda"}
            (k1, i1, f1), (k2, i2, f2) = got["descriptor"], got["pointer"]
            assert torch.equal(i1, i2), (metric, list(kw))
            tol = 1e-5 * float(k2[torch.isfinite(k2)].abs().max())
            assert torch.allclose(k1, k2, rtol=1e-5, atol=tol) and torch.allclose(f1, f2, rtol=1e-5, atol=tol)
    cases.append("descriptor")

if KERNEL == "rowlist":
    # The re-rank kernel against the torch form: d within one chunk and over two, empty
    # slots (NaN there), both value forms.
    rng = np.random.default_rng(3)
    for metric, d in (("sqeuclidean", 33), ("inner_product", 70), ("cosine", 16)):
        q, t = make_data("gaussian", 37, 50, d, d)
        qs, ts = prepared(q, t, metric, "fp32")
        idx = torch.from_numpy(rng.integers(-1, 50, (37, 9)))
        want = gt.exact_values(qs, ts, idx)
        got = tr.triton_exact_values(qs, ts, idx[:, 2:])
        assert torch.equal(torch.isnan(got), idx[:, 2:] < 0), metric
        assert torch.allclose(torch.nan_to_num(got), torch.nan_to_num(want[:, 2:]), rtol=1e-5, atol=1e-5), metric
    # One long scan (128 tiles of 32, one split): late tiles mostly have no survivor or one
    # per row, the paths the first tiles never take. The lists must be the exact 8 best.
    # With and without the row-minimum test (skip_test): the same lists. Then exact ties:
    # every target three times in a row (the copies meet in one tile or across a tile edge),
    # so a list of 8 takes two triples and two of a third: the lower indices (tie rule).
    q, t = make_data("gaussian", 16, 4096, 33, 7)
    for name, targets in (("long scan", t), ("triples", np.repeat(t[:1365], 3, axis=0))):
        qs, ts = prepared(q, targets, "l2", "fp32")
        ref = ts.bias[None, :] - 2 * (qs.operand.double() @ ts.operand.double().T)
        want = torch.sort(ref, dim=1, stable=True).indices[:, :8]
        for skip_test in (True, False):
            cfg = tr.TileConfig(16, 32, 0, 4, kernel="rowlist", extra_passes=2, skip_test=skip_test)
            keys, idx, _ = tr.triton_candidates(qs, ts, 8, config=cfg, splits=1)
            assert torch.equal(idx, want), (name, skip_test)
    cases.append("long scan")

if KERNEL == "segmented":
    # 603 targets = 19 tiles; 8 segments (segment s: tiles s, s + 8, s + 16), 8-long lists,
    # n_cand 32 (bf16, k=10).
    # Crowding: each of queries 0-3 has 12 near targets inside one tile, so one segment holds
    # them all and keeps only 8. The union's last key is far above theta + 2E (the plain
    # rule would prove the row and miss some neighbours); the segment's floor must not.
    # Spread ties: queries 4 and 5 have 36 targets at near-equal distances (1e-3 apart in
    # squared distance, within bf16's error), 2 per tile in tiles 0-17, so at most 6 per
    # segment: every segment list keeps its ties, but cutting the union to 32 drops 4, so
    # only the first dropped key, not the segments' floors, keeps the row from being proven.
    # A run: query 6 has 64 near targets (spread distances) stored together in tiles 14-17;
    # strided segments give each of 4 segments 16 of them, and the row is proven at once
    # (contiguous segments would crowd 48 into one and widen it).
    rng = np.random.default_rng(11)
    q = rng.standard_normal((16, 33)).astype(np.float32)
    t = rng.standard_normal((603, 33)).astype(np.float32)
    crowded, spread, run = [0, 1, 2, 3], [4, 5], 6
    for j in crowded:
        t[32 * (4 * j + 1):32 * (4 * j + 1) + 12] = q[j] + 0.3 * rng.standard_normal((12, 33))
    for j, cols in zip(spread, ((20, 24), (28, 30))):
        at = np.array([32 * m + c for m in range(18) for c in cols])
        u = rng.standard_normal((len(at), 33))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        r = np.sqrt(4 + 1e-3 * rng.permutation(len(at)))
        t[at] = q[j] + r[:, None] * u
    at = np.array([32 * m + c for m in range(14, 18) for c in range(16)])
    u = rng.standard_normal((len(at), 33))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    t[at] = q[run] + np.sqrt(4 + 0.5 * rng.permutation(len(at)))[:, None] * u
    qs, ts = prepared(q, t, "sqeuclidean", "bf16")
    k = 10
    n_cand = gt.candidate_width(k, "bf16")
    assert tr.segment_count(16, 603, n_cand, SEGMENTED, 4) == 8
    keys, idx, floor = small(qs, ts, n_cand)
    bound = gt.key_error_bound(qs, gt.TargetStats.of(ts), "sqeuclidean")
    plain = gt.margin_holds(keys, bound, k)
    proven = gt.margin_holds(keys, bound, k, floor)
    ref = ts.bias[None, :] - 2 * (qs.operand.double() @ ts.operand.double().T)
    top = torch.sort(ref, dim=1, stable=True).indices[:, :k]
    for j in crowded:
        missing = set(top[j].tolist()) - set(idx[j].tolist())
        assert plain[j] and missing and not proven[j], (j, missing, bool(proven[j]))
    assert not proven[spread].any(), proven
    assert proven[run:].all(), proven         # elsewhere the floor proves the rows
    # Widening: 128 candidates need more segments than 603 targets allow -> buffer kernel.
    assert tr.segment_count(16, 603, 4 * n_cand, SEGMENTED, 4) == 0
    v, i = gt.exact_topk(qs, ts, k, small, max_candidates=256, values=tr.triton_exact_values)
    check_result(q, t, k, "sqeuclidean", v.numpy(), i.numpy())
    cases.append("crowded")
    # Two segments at least (config.segments), as the bf16 n_cand 32 default: the union of
    # two 8-long lists is the 16-candidate list; exact through the re-ranked margin.
    two = tr.TileConfig(16, 32, 0, 4, kernel="segmented", seg_cand=8, segments=2, extra_passes=2)
    assert tr.segment_count(3, 603, 16, two, 4) == 2
    q, t = make_data("gaussian", 3, 603, 33, 12)
    qs, ts = prepared(q, t, "l2", "bf16")
    keys, idx, floor = tr.triton_candidates(qs, ts, 16, config=two)
    assert torch.isfinite(floor).all()
    v, i = gt.exact_topk(qs, ts, 5, lambda a, b, n: tr.triton_candidates(a, b, n, config=two if n == 16 else None),
                         max_candidates=256, values=tr.triton_exact_values)
    check_result(q, t, 5, "l2", v.numpy(), i.numpy())
print("interpreter ok", len(cases))
"""


_TAIL_SCRIPT = _INTERPRETER_PRELUDE + """
inf = float("inf")
cases = [("l2", "bf16", 33, 16, 5), ("sqeuclidean", "tf32", 70, 32, 10),
         ("inner_product", "bf16", 16, 8, 8), ("cosine", "fp32", 33, 16, 3), ("l2", "bf16", 33, 64, 20)]
for n, (metric, precision, d, w, k) in enumerate(cases):
    q, t = make_data("clustered", 19, 120, d, n)
    t[60:90] = t[0:30]                     # exact duplicates: equal values tie by index
    if metric == "inner_product":
        q[5] = 0.0                         # every value +-0: the index decides
    qs, ts = gt.prepare_side(torch.from_numpy(q), metric, precision), gt.prepare_side(torch.from_numpy(t), metric, precision)
    keys, idx = gt.torch_candidates(qs, ts, w)
    keys[0, w - 3:], idx[0, w - 3:] = inf, -1          # a short list (empty slots)
    floor = keys[:, -1].clone()
    floor[1] = inf                                     # a list of every target
    floor[2] = keys[2, k - 1]                          # a floor that proves nothing
    bound = gt.key_error_bound(qs, gt.TargetStats.of(ts), metric)
    v, i, limit, ok = tr.triton_exact_tail(qs, ts, keys, idx, floor, bound, k)
    rv, ri = gt.rerank(qs, ts, keys, idx, bound, k, tr.triton_exact_values)
    rlimit = gt.value_limit(rv[:, k - 1], bound, qs)
    rok = gt.margin_holds(keys, bound, k, floor) | (floor > rlimit)
    assert torch.equal(i, ri), (metric, (i != ri).nonzero()[:5])
    assert torch.equal(v, rv), metric
    assert torch.equal(limit, rlimit), metric
    assert torch.equal(ok, rok) and bool(ok[1]) and not bool(ok[2]), (metric, ok, rok)
    assert 0 < int(ok.sum()) < ok.numel() or metric == "cosine", (metric, ok)
    # Through exact_topk: widening from w to 4w (the kernel again up to 64, then torch).
    vv, ii = gt.exact_topk(qs, ts, k, gt.torch_candidates, values=tr.triton_exact_values,
                           tail=tr.triton_exact_tail)
    check_result(q, t, k, metric, vv.numpy(), ii.numpy())
assert tr.triton_exact_tail(qs, ts, keys[:, :3], idx[:, :3], floor, bound, 5) is None   # shorter than k
print("tail ok", len(cases))
"""


@pytest.mark.skipif(not HAS_TRITON or torch is None, reason="triton (and torch) are not installed")
def test_fused_exact_tail_under_the_triton_interpreter():
    """triton_exact_tail equals the torch sequence it replaces (rerank, value_limit, the
    margin tests), bit for bit under the interpreter: ties, empty slots, +-0 values, floors
    of every kind; and exact_topk with it returns the exact top-k."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_TAIL_SCRIPT)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tail ok 5" in proc.stdout


@pytest.mark.skipif(not HAS_TRITON or torch is None, reason="triton (and torch) are not installed")
@pytest.mark.parametrize("kernel,n_cases", [("rowlist", 7), ("segmented", 7), ("pipelined", 4),
                                            ("legacy", 4)])
def test_fused_kernel_under_the_triton_interpreter(kernel, n_cases):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_INTERPRETER_SCRIPT), kernel],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"interpreter ok {n_cases}" in proc.stdout


# ----------------------------------------------------------------------------- on a GPU
@pytest.fixture
def poisoned_buffers(monkeypatch):
    from nearest_join.kernels import _gpu_triton as tr

    monkeypatch.setattr(tr, "POISON_BUFFERS", True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["gaussian", "clustered"])
@pytest.mark.parametrize("k", [1, 10, 100, 1024])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("metric", METRICS)
def test_gpu_matrix(metric, precision, k, kind, poisoned_buffers):
    seed = zlib.crc32(repr((metric, precision, k, kind)).encode())
    for nq, nt, d in [(517, 3001, 128), (19, 20_011, 33)]:   # odd sizes; few queries -> splits
        q, t = make_data(kind, nq, nt, d, seed + nt)
        v, i = knn(q, t, k, metric, backend="gpu", precision=precision)
        check_result(q, t, k, metric, v, i)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lower", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("k", [10, 100])
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("metric", METRICS)
def test_gpu_widening_through_search_prepared(metric, precision, k, seeded, lower, poisoned_buffers, monkeypatch):
    """Widening rounds, with and without seeded lists (nearest_join.kernels.gpu.SEED_WIDENING)
    and lower keys (``LOWER_KEYS``): clustered data makes rows widen. Through
    ``search_prepared`` (as the executors call it, not through knn, which drops unrankable
    rows first), with a non-finite query row riding along: it must come back empty."""
    from nearest_join.kernels import gpu as kgpu

    monkeypatch.setattr(kgpu, "SEED_WIDENING", seeded)
    monkeypatch.setattr(kgpu, "LOWER_KEYS", {precision: 1} if lower else {})
    _check_search_prepared_with_a_nan_row(metric, precision, k, ("widening", metric, precision, k, seeded, lower))


def _check_search_prepared_with_a_nan_row(metric, precision, k, tag):
    """search_prepared on clustered data (rows widen) with a NaN query row: exact results,
    the NaN row empty."""
    from nearest_join.kernels import gpu as kgpu

    dev = torch.device("cuda")
    seed = zlib.crc32(repr(tag).encode())
    for nq, nt, d in [(517, 3001, 128), (19, 20_011, 33)]:
        q, t = make_data("clustered", nq, nt, d, seed + nt)
        q[3] = np.nan
        prepared = kgpu.prepare_targets(torch.from_numpy(t).to(dev), metric, precision)
        v, i = kgpu.search_prepared(torch.from_numpy(q).to(dev), prepared, k)
        v, i = v.cpu().numpy(), i.cpu().numpy()
        assert (i[3] == -1).all()
        keep = np.arange(nq) != 3
        check_result(q[keep], t, k, metric, v[keep], i[keep])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("k", [1, 10, 40])
def test_gpu_fused_exact_tail(metric, precision, k, poisoned_buffers, monkeypatch):
    """The fused re-rank and proof (nearest_join.kernels.gpu.FUSED_TAIL) through
    ``search_prepared`` on clustered data (rows widen), a non-finite query row riding along."""
    from nearest_join.kernels import gpu as kgpu

    monkeypatch.setattr(kgpu, "FUSED_TAIL", True)
    _check_search_prepared_with_a_nan_row(metric, precision, k, ("tail", metric, precision, k))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_torch_fallback_and_tensor_inputs(metric, precision):
    from nearest_join.kernels.gpu import knn_torch

    q, t = make_data("clustered", 300, 2000, 96, 11)
    qd, td = torch.from_numpy(q).cuda(), torch.from_numpy(t).cuda()
    for impl in ("torch", "triton"):
        v, i = knn_torch(qd, td, 25, metric, precision, impl=impl)
        assert v.device.type == "cuda"
        check_result(q, t, 25, metric, v.cpu().numpy(), i.cpu().numpy())


@pytest.mark.gpu
@needs_cuda
def test_gpu_exact_mode_equals_fp32_on_near_ties(poisoned_buffers):
    """tf32/bf16 return the float32 answer: identical indices to fp32 on clustered data."""
    q, t = make_data("clustered", 1000, 30_000, 128, 21)
    v32, i32 = knn(q, t, 50, "sqeuclidean", backend="gpu", precision="fp32")
    for precision in ("tf32", "bf16"):
        v, i = knn(q, t, 50, "sqeuclidean", backend="gpu", precision=precision)
        np.testing.assert_array_equal(i, i32)
        np.testing.assert_allclose(v, v32, rtol=1e-6)
