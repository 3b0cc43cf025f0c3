"""The gpu backend against the float64 reference.

Here (no GPU): the torch path on CPU tensors, the fused Triton kernels under
``TRITON_INTERPRET=1`` (the modules of ``tests/kernels/interp``, run in one subprocess so the
variable never reaches other tests), and the backend's refusal. On a CUDA machine (``-m gpu``): the full matrix of metrics x precisions x
k x data, with near-tie (clustered) data, poisoned kernel buffers and fresh data per check.

Every result goes through the tests' one oracle (:func:`check_result`, which is
:func:`tests.oracle.assert_knn_result` at ``nearest_kernels.gpu.RTOL``): the true top k
of the float64 difference form, ties within that tolerance, squared distances compared.
"""
from __future__ import annotations

import importlib.util
import math
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from nearest_kernels import knn, resolve_metric
from tests import adversarial as adv
from tests import background
from tests.oracle import assert_knn_result, backend_rtol

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


def check_result(q, t, k, metric, values, indices) -> None:
    """The oracle's check (:func:`tests.oracle.assert_knn_result`) at the tolerance the gpu
    backend declares (``nearest_kernels.gpu.RTOL``)."""
    assert_knn_result(q, t, k, metric, np.asarray(values), np.asarray(indices), backend_rtol("gpu"),
                      case=f"gpu {q.shape} x {t.shape}")


# ----------------------------------------------------------------------------- no GPU needed
def test_backend_refuses_without_cuda_and_names_why():
    from nearest_kernels.gpu import BACKEND

    q = np.zeros((2, 3), np.float32)
    reason = BACKEND.refuse(q, q, 1, resolve_metric("l2"))
    if torch is not None and torch.cuda.is_available():
        assert reason is None
    else:
        assert reason and ("CUDA" in reason or "torch" in reason)


def test_invalid_precision_is_a_value_error_naming_the_argument():
    from nearest_kernels.gpu import BACKEND

    q = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="precision"):
        BACKEND.refuse(q, q, 1, resolve_metric("l2"), precision="fp16")


@needs_torch
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", ["gaussian", "clustered"])
@pytest.mark.parametrize("d,k", [(1, 3), (3, 7), (33, 40), (31, 400)], ids=lambda v: str(v))
def test_torch_path_on_cpu_matches_reference(metric, precision, kind, d, k):
    from nearest_kernels.gpu import knn_torch

    seed = zlib.crc32(repr((metric, precision, kind, d, k)).encode())
    q, t = make_data(kind, 37, 301, d, seed)
    v, i = knn_torch(torch.from_numpy(q), torch.from_numpy(t), k, metric, precision)
    check_result(q, t, k, metric, v.numpy(), i.numpy())


@needs_torch
@pytest.mark.parametrize("metric", METRICS)
def test_rows_that_cannot_rank_never_match(metric):
    from nearest_kernels.gpu import knn_torch

    q, t = make_data("gaussian", 6, 40, 5, 3)
    q[1, 2] = np.nan
    t[4, 0] = np.inf
    t[11] = 0.0
    v, i = knn_torch(torch.from_numpy(q), torch.from_numpy(t), 50, metric, "bf16")
    ref_v, ref_i = knn(q, t, 50, metric, backend="reference")
    np.testing.assert_array_equal(i.numpy(), ref_i)
    assert (i.numpy()[1] == -1).all()


@needs_torch
def test_ties_go_to_the_lower_index():
    from nearest_kernels.gpu import knn_torch

    t = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 0.0], [0.0, -1.0]], np.float32)
    q = np.zeros((1, 2), np.float32)
    for precision in PRECISIONS:
        v, i = knn_torch(torch.from_numpy(q), torch.from_numpy(t), 4, "l2", precision)
        assert i.tolist() == [[0, 1, 2, 3]] and v.tolist() == [[1.0] * 4]


@needs_torch
def test_the_check_catches_a_plain_bf16_search():
    """Without the re-rank, bf16 scrambles near ties: the oracle must notice (it can fail).
    The plain search is bf16 mm + topk, as a user without this backend would write it."""
    q, t = make_data("clustered", 40, 400, 64, 5)
    qb, tb = torch.from_numpy(q).bfloat16(), torch.from_numpy(t).bfloat16()
    dist = (qb.float() ** 2).sum(1)[:, None] - 2 * (qb @ tb.T).float() + (tb.float() ** 2).sum(1)[None, :]
    v, i = torch.topk(dist, 10, dim=1, largest=False)
    with pytest.raises(AssertionError):
        check_result(q, t, 10, "sqeuclidean", v.numpy(), i.numpy())


# ----------------------------------------------------------------------------- floors
def _prepared(q, t, metric="sqeuclidean", precision="fp32"):
    from nearest_kernels import _gpu_prepare as gp

    return (gp.prepare_side(torch.from_numpy(q), metric, precision),
            gp.prepare_side(torch.from_numpy(t), metric, precision))


@needs_torch
@pytest.mark.parametrize("lower", [False, True])
def test_torch_candidates_in_target_chunks_equal_one_pass(lower):
    """The torch generator converts and scans the targets chunk by chunk (its float32 copy
    of a bf16 operand is bounded by chunk_elements): the lists do not depend on the chunks."""
    from nearest_kernels import _gpu_search as gs

    q, t = make_data("gaussian", 5, 1000, 16, 11)
    qs, ts = _prepared(q, t, "l2", "bf16")
    whole = gs.torch_candidates(qs, ts, 32, lower=lower)
    chunked = gs.torch_candidates(qs, ts, 32, lower=lower, chunk_elements=16 * 40)   # 25 chunks
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert bool((whole[1] >= 0).all())


@needs_torch
def test_a_floor_above_the_margin_proves_a_list_whose_last_key_does_not():
    """8 targets tie at squared distance 1 from the query, the rest are at 9. The 8-long list
    ends on a tie (last key = theta: the plain rule widens); a floor of 9 proves it."""
    from nearest_kernels import _gpu_bound as gb
    from nearest_kernels import _gpu_search as gs

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
        keys, idx = gs.torch_candidates(qq, tt, n_cand + 1)
        return keys[:, :n_cand], idx[:, :n_cand], keys[:, n_cand]   # next key: a valid floor

    v, i = gs.exact_topk(qs, ts, 3, with_floor)
    assert calls == [gb.candidate_width(3, "fp32")], calls            # proven, not widened
    assert i.tolist() == [[10, 11, 12]] * 2
    check_result(q, t, 3, "sqeuclidean", v.numpy(), i.numpy())


@needs_torch
def test_a_floor_below_the_margin_widens_a_list_that_looks_complete():
    """The first list leaves out each row's best target and ends in empty slots, which by
    the plain rule means "every target is here"; its floor (the left-out key) says otherwise:
    the rows must widen and find the target."""
    from nearest_kernels import _gpu_bound as gb
    from nearest_kernels import _gpu_search as gs

    q, t = make_data("gaussian", 5, 200, 8, 2)
    qs, ts = _prepared(q, t)
    calls = []

    def holey(qq, tt, n_cand):
        calls.append(n_cand)
        keys, idx = gs.torch_candidates(qq, tt, n_cand)
        if len(calls) > 1:
            return keys, idx
        rows = keys.shape[0]
        keys = torch.cat([keys[:, 1:], torch.full((rows, 1), float("inf"))], 1)
        idx = torch.cat([idx[:, 1:], torch.full((rows, 1), -1)], 1)
        return keys, idx, gs.torch_candidates(qq, tt, 1)[0][:, 0]

    v, i = gs.exact_topk(qs, ts, 3, holey)
    n0 = gb.candidate_width(3, "fp32")
    assert calls == [n0, gb.widened(n0)], calls
    check_result(q, t, 3, "sqeuclidean", v.numpy(), i.numpy())
    # few_rows: a widening round over at most that many rows runs the torch generator (the
    # fused kernel's fixed costs dominate a round over a handful of rows): the same result.
    for few, expected in ((4, [n0, gb.widened(n0)]), (5, [n0])):
        calls.clear()
        v, i = gs.exact_topk(qs, ts, 3, holey, few_rows=few)
        assert calls == expected, (few, calls)
        check_result(q, t, 3, "sqeuclidean", v.numpy(), i.numpy())


@needs_torch
def test_the_rerank_skips_candidates_beyond_the_value_limit():
    from nearest_kernels import _gpu_bound as gb
    from nearest_kernels import _gpu_prepare as gp
    from nearest_kernels import _gpu_rerank as gr
    from nearest_kernels import _gpu_search as gs

    keys = torch.tensor([[0.0, 1.0, 2.0, 3.0, 3.5, 9.0, 10.0, 11.0],
                         [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]])
    idx = torch.arange(16).view(2, 8)
    # Row 0: keys <= 3 (inclusive): 4 columns read. Row 1: keys <= 1.2: 3 columns.
    kept = gb.skip_beyond(keys, idx, torch.tensor([3.0, 1.2]))
    assert kept.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1], [8, 9, 10, -1, -1, -1, -1, -1]]
    # Through the re-rank: the values function never sees a column beyond the limit, and
    # the k best are those of every column (a limit from the head's k-th value).
    q = torch.tensor([[0.0, 0.0]])
    t = torch.tensor([[float(j), 0.0] for j in range(8)])
    qs, ts = gp.prepare_side(q, "l2", "fp32"), gp.prepare_side(t, "l2", "fp32")
    seen = []

    def spy(queries, targets, sel):
        seen.append(sel.clone())
        return gr.exact_values(queries, targets, sel)
    tkeys = (t * t).sum(1)[None, :]                  # exact keys of this query: |t|^2
    v, i = gr.rerank(qs, ts, tkeys, torch.arange(8)[None, :], torch.tensor([0.5]), 3, spy)
    assert i.tolist() == [[0, 1, 2]] and v.tolist() == [[0.0, 1.0, 4.0]]
    # head: columns 0-2 (V0 = 4), the rest up to key 4 + 0.5: none of columns 3..7 (9+).
    assert seen[0].tolist() == [[0, 1, 2]] and seen[1].tolist() == [[-1, -1, -1, -1, -1]], seen
    # The fused re-rank reads a row up to its last candidate left (live_width).
    assert gr.live_width(torch.tensor([[4, -1, 2, -1], [-1, -1, -1, -1], [1, 2, 3, 4]])).tolist() == [3, 0, 4]
    # value_limit: key(V) + E, never rounded down. l2: key = V - |q|^2; similarities: -V.
    q = np.array([[3.0, 4.0], [1.0, 0.0]], np.float32)            # |q|^2 = 25, 1
    qs = gp.prepare_side(torch.from_numpy(q), "l2", "fp32")
    lim = gb.value_limit(torch.tensor([30.0, 2.0]), torch.tensor([0.5, 0.25]), qs).double()
    assert (lim >= torch.tensor([5.5, 1.25], dtype=torch.float64)).all(), lim
    assert torch.allclose(lim, torch.tensor([5.5, 1.25], dtype=torch.float64), atol=1e-4), lim
    qs = gp.prepare_side(torch.from_numpy(q), "inner_product", "fp32")
    lim = gb.value_limit(torch.tensor([30.0, 2.0]), torch.tensor([0.5, 0.25]), qs).double()
    assert (lim >= torch.tensor([-29.5, -1.75], dtype=torch.float64)).all(), lim
    assert bool(torch.isinf(gb.value_limit(torch.tensor([math.inf, math.inf]), torch.tensor([0.5, 0.25]),
                                           gp.prepare_side(torch.from_numpy(q), "l2", "fp32"))).all())
    # Through exact_topk: Gaussian data, fp32 (a tiny bound): the re-rank reads fewer columns.
    q, t = make_data("gaussian", 7, 300, 16, 3)
    qs, ts = _prepared(q, t)
    widths = []
    real = gr.exact_values

    def spy(queries, targets, idx, **kw):
        widths.append((idx.shape[1], int((idx >= 0).sum())))   # (columns, pairs read)
        return real(queries, targets, idx, **kw)

    gr.exact_values = spy
    try:
        v, i = gs.exact_topk(qs, ts, 3, gs.torch_candidates)
    finally:
        gr.exact_values = real
    n0 = gb.candidate_width(3, "fp32")
    assert widths[0] == (3, 7 * 3) and widths[1][0] == n0 - 3, widths
    assert sum(read for _, read in widths) < 7 * n0, widths
    check_result(q, t, 3, "sqeuclidean", v.numpy(), i.numpy())


@needs_torch
def test_a_long_head_is_read_in_target_order_and_ranks_as_every_column():
    # k above LONG_LIST_K: the first k columns reach the values function sorted by target
    # index, empty slots last (the re-rank's L2 window), and the result is the exact top k
    # of every column by (value, index), as the key-ordered head gave it.
    import torch

    from nearest_kernels import _gpu_bound as gb
    from nearest_kernels import _gpu_rerank as gr

    k = gb.LONG_LIST_K + 8
    q, t = make_data("gaussian", 3, 900, 8, 5)
    qs, ts = _prepared(q, t)
    gen = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(900, generator=gen)[:700] for _ in range(3)])
    idx[2, 300:] = -1                                          # fewer candidates than k: empties
    keys = torch.sort(torch.rand((3, 700), generator=gen), dim=1).values
    seen = []

    def spy(queries, targets, sel):
        seen.append(sel.clone())
        return gr.exact_values(queries, targets, sel)
    v, i = gr.rerank(qs, ts, keys, idx, torch.full((3,), math.inf), k, spy)
    head = seen[0]
    for r in range(3):
        live = head[r][head[r] >= 0]
        assert live.tolist() == sorted(idx[r, :k][idx[r, :k] >= 0].tolist()), r
        assert bool((head[r, live.numel():] == -1).all()), r
    want_v, want_i = gr.rank_exact(gr.exact_values(qs, ts, idx), idx, k, descending=False)
    assert torch.equal(i, want_i) and torch.equal(v, want_v)
    assert int((i[2] >= 0).sum()) == 300


@needs_torch
@pytest.mark.parametrize("metric", ["sqeuclidean", "inner_product"])
def test_the_reranked_values_prove_a_list_the_keys_alone_cannot(metric):
    """bf16 keys, k=3, lists of 8: the 3 nearest targets, then 5 more about 1.5 E further
    (E the error bound). The key-only test needs a gap of 2E and would widen; the re-ranked
    3rd value lies within the actual error of the 3rd key, far inside E, and proves the
    list. The setup itself is asserted, so the test cannot pass vacuously."""
    from nearest_kernels import _gpu_bound as gb
    from nearest_kernels import _gpu_prepare as gp
    from nearest_kernels import _gpu_search as gs

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

    qs = gp.prepare_side(torch.from_numpy(q), metric, "bf16")
    ts = gp.prepare_side(torch.from_numpy(build(1.0)), metric, "bf16")
    e = float(gb.key_error_bound(qs, gb.TargetStats.of(ts), metric)[0])
    t = build(e)
    ts = gp.prepare_side(torch.from_numpy(t), metric, "bf16")
    bound = gb.key_error_bound(qs, gb.TargetStats.of(ts), metric)
    n_cand = gb.candidate_width(k, "bf16")
    assert n_cand == 8
    keys, idx = gs.torch_candidates(qs, ts, n_cand)
    assert not bool(gb.margin_holds(keys, bound, k)[0]), "setup: the keys alone must not prove the list"
    calls = []

    def counted(qq, tt, n):
        calls.append(n)
        return gs.torch_candidates(qq, tt, n)

    v, i = gs.exact_topk(qs, ts, k, counted)
    assert calls == [n_cand], calls                 # proven by the values: no widening
    check_result(q, t, k, metric, v.numpy(), i.numpy())


@needs_torch
@pytest.mark.parametrize("metric", ["sqeuclidean", "cosine", "inner_product"])
@pytest.mark.parametrize("k", [10, 400])
def test_groups_of_identical_rows_return_their_lowest_indices(metric, k):
    """Groups of identical targets tie exactly: a query on a group of 300 copies at k = 10
    (the whole list of ties, the k lowest indices wanted) and at k = 400 (the group and the
    next 100), with groups of 40 and 90 elsewhere. The result is the float64 reference's,
    indices exactly (the tie rule: lower index first)."""
    from nearest_kernels.gpu import knn_torch
    from nearest_kernels.reference import knn_reference

    q, t, groups = adv.tie_groups(8, 5000, 8, (300, 40, 90), seed=11)
    for precision in PRECISIONS:
        v, i = knn_torch(torch.from_numpy(q), torch.from_numpy(t), k, metric, precision)
        ref_v, ref_i = knn_reference(q, t, k, resolve_metric(metric))
        assert i[:4, : min(k, 300)].tolist() == [groups[0][: min(k, 300)].tolist()] * 4, precision
        np.testing.assert_array_equal(i.numpy(), ref_i, err_msg=f"{metric} {precision}")
        check_result(q, t, k, metric, v.numpy(), i.numpy())


@needs_torch
def test_a_seeded_torch_list_counts_the_targets_at_or_below_its_seed():
    """Seeded (a widening round's limits), the torch generator keeps only keys at or below
    each row's seed, counts them, and states a floor just above the seed where its list holds
    them all (else its last key): what a list must hold when exact ties fill it."""
    from nearest_kernels import _gpu_search as gs

    q, t, groups = adv.tie_groups(6, 700, 8, (60,), seed=3)
    qs, ts = _prepared(q, t, "sqeuclidean", "bf16")
    ref = gs.torch_candidates(qs, ts, 700)[0]          # every key of every row, ascending
    seed = torch.stack([ref[0, 59], ref[1, 20], ref[2, 100], ref[3, 5], ref[4, 699],
                        torch.tensor(-math.inf)])
    for n_cand in (32, 128):
        keys, idx, floor, below = gs.torch_candidates(qs, ts, n_cand, seed=seed)
        assert below.tolist() == (ref <= seed[:, None]).sum(dim=1).tolist()
        held = torch.minimum(below, torch.tensor(n_cand))
        for r in range(6):
            h = int(held[r])
            assert keys[r, :h].tolist() == ref[r, :h].tolist() and bool((idx[r, :h] >= 0).all())
            assert bool(torch.isposinf(keys[r, h:]).all()) and bool((idx[r, h:] == -1).all())
            if below[r] <= n_cand:
                assert floor[r] > seed[r] and floor[r] == torch.nextafter(seed[r], torch.tensor(math.inf))
            else:
                assert floor[r] == keys[r, -1]
    # The query on the group of 60 copies: all 60 at its seed, the list of 32 holds 32 of them.
    assert int(below[0]) >= 60


@needs_torch
def test_rows_whose_lists_ties_fill_jump_to_the_width_the_ties_need():
    """A query on a group of 300 identical targets at k = 10: every list up to 300 entries
    is full of ties at its k-th value, so no floor proves it. The first widening round
    (seeded) counts the targets at or below each row's limit, and the next round takes a
    list one longer than that count: proven there, instead of one fixed widening after
    another (32, 64, 256, 1024)."""
    from nearest_kernels import _gpu_bound as gb
    from nearest_kernels import _gpu_search as gs
    from nearest_kernels.reference import knn_reference

    q, t, groups = adv.tie_groups(4, 20_000, 8, (300,), seed=5)
    qs, ts = _prepared(q, t, "sqeuclidean", "bf16")
    calls = []

    def counted(qq, tt, n, **kw):
        calls.append(n)
        return gs.torch_candidates(qq, tt, n, **kw)

    v, i = gs.exact_topk(qs, ts, 10, counted, seeded=True)
    n0 = gb.candidate_width(10, "bf16")
    assert calls == [n0, gb.widened(n0), 512], calls
    ref_v, ref_i = knn_reference(q, t, 10, resolve_metric("sqeuclidean"))
    np.testing.assert_array_equal(i.numpy(), ref_i)
    assert i[:2].tolist() == [groups[0][:10].tolist()] * 2


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
    from nearest_kernels import _gpu_bound as gb
    from nearest_kernels import _gpu_prepare as gp
    from nearest_kernels import _gpu_search as gs

    q, t = _spread_norms("gaussian", 40, 500, 48, 9)
    qs, ts = _prepared(q, t, metric, precision)
    stats = gb.TargetStats.of(ts)
    rest = gb.lower_key_bound(qs, stats, metric).double()[:, None]
    assert bool((rest < gb.key_error_bound(qs, stats, metric).double()[:, None]).all())
    lower, l_idx = gs.torch_candidates(qs, ts, ts.rows, lower=True)
    plain, p_idx = gs.torch_candidates(qs, ts, ts.rows)
    t64 = ts.exact.double()
    bias = (t64 ** 2).sum(1) if gp.l2_form(metric) else torch.zeros(ts.rows, dtype=torch.float64)
    exact = bias[None, :] - gp.key_alpha(metric) * (qs.exact.double() @ t64.T)
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
    from nearest_kernels import _gpu_bound as gb
    from nearest_kernels import _gpu_search as gs

    q, t = _spread_norms("gaussian", 45, 300, 24, 3)
    if metric != "cosine":
        q[7] = 0.0
    qs, ts = _prepared(q, t, metric, precision)
    q_w, t_w = gb.lower_key_weights(qs, ts)
    per_row = ts.bias.double() - q_w[0].double()[:, None] * t_w[0].double() - q_w[1].double()[:, None] * t_w[1].double()
    shift = gb.lower_shift(qs, gb.TargetStats.of(ts), metric)
    for levels in (None, 3, 8):
        table, level = gb.lower_bias_table(qs, ts, 8, levels)
        assert table.shape == (levels or gb.LOWER_LEVELS, 300) and level.shape == (6,)
        assert bool((level >= 0).all()) and bool((level < table.shape[0]).all())
        bias = table.double()[level.long().repeat_interleave(8)[:45]]
        assert bool((bias <= per_row).all()), levels
        # (the table's float32 rounding, down, adds at most an ulp of the bias)
        assert bool((ts.bias.double() - bias <= shift * (1 + 1e-6) + 2.0 ** -22 * ts.bias.double().abs()).all())
    # Rows a widening round takes keep the table (no new one built) and get valid levels of it.
    table, _ = gb.lower_bias_table(qs, ts, 8, 8)
    retry = torch.tensor([1, 7, 8, 20, 33, 44])
    child = gs._widened_rows(qs, retry, lower=True)
    child_table, child_level = gb.lower_bias_table(child, ts, 4, 8)
    assert child_table is table and child_level.shape == (2,)
    bias = table.double()[child_level.long().repeat_interleave(4)[:6]]
    assert bool((bias <= per_row[retry]).all())
    # ... and their bound carries over: at least the one computed for them alone.
    stats = gb.TargetStats.of(ts)
    own = gb.lower_key_bound(qs.take(retry), stats, metric)
    assert bool((gb.lower_key_bound(qs, stats, metric)[retry] >= own).all())


@needs_torch
@pytest.mark.parametrize("precision,d,k,expected", [
    ("bf16", 16, 5, True), ("bf16", 128, 10, True),       # small k: lower keys up to d = 128
    ("bf16", 200, 10, False), ("bf16", 200, 70, True),    # above it only from k = 64
    ("tf32", 16, 70, False), ("fp32", 16, 5, False)])
def test_search_ranks_by_lower_keys_where_the_rule_says(precision, d, k, expected, monkeypatch):
    """EXACT searches pass ``lower`` to exact_topk by precision, k and dimension
    (gpu.LOWER_KEYS, LOWER_KEYS_SMALL_K_MAX_D: at d=768 bf16 k=10 the lower-key start cost
    1.54x the plain search against 1.07), and the answer is exact either way."""
    from nearest_kernels import _gpu_search as gs
    from nearest_kernels import gpu as kgpu

    seen = []
    exact_topk = gs.exact_topk

    def spy(*args, **kwargs):
        seen.append(kwargs.get("lower"))
        return exact_topk(*args, **kwargs)
    monkeypatch.setattr(gs, "exact_topk", spy)
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
    from nearest_kernels import _gpu_bound as gb
    from nearest_kernels import _gpu_search as gs

    rng = np.random.default_rng(5)
    d, k = 32, 10
    lean = np.full(d, 3 / np.sqrt(d))
    q = (rng.standard_normal((200, d)) + lean).astype(np.float32)
    t = rng.standard_normal((4000, d))
    t[::200] = -30 * (lean + 0.1 * rng.standard_normal((20, d)))
    t = t.astype(np.float32)
    qs, ts = _prepared(q, t, metric, "bf16")
    monkeypatch.setitem(gb._EXTRA, "bf16", lambda k: 0)
    widened = {}
    for lower in (False, True):
        calls = []

        def counted(qq, tt, n, **kw):
            assert kw.get("lower", False) == lower
            calls.append(qq.rows)
            return gs.torch_candidates(qq, tt, n, **kw)

        v, i = gs.exact_topk(qs, ts, k, counted, lower=lower)
        check_result(q, t, k, metric, v.numpy(), i.numpy())
        widened[lower] = sum(calls[1:])
    assert widened[True] * 10 < widened[False], widened   # measured: 0 against 198-200


@pytest.mark.skipif(not HAS_TRITON or torch is None, reason="triton (and torch) are not installed")
def test_skip_share_predicts_the_tiles_without_survivors():
    """The model behind the row-minimum test's switch against a simulated scan: random keys,
    each row's threshold the list_len-th best so far, a tile skipped when no row reaches it."""
    from nearest_kernels import _triton_plan as tplan

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
        predicted = tplan.skip_share(n_tiles, block_m, list_len)
        assert abs(np.mean(shares) - predicted) < 0.05, (block_m, list_len, np.mean(shares), predicted)
    assert tplan.skip_share(0, 128, 16) == 0.0
    assert tplan.skip_share(7813, 128, 16) > tplan.skip_share(7813, 128, 32) > tplan.skip_share(488, 128, 16)


@pytest.mark.skipif(not HAS_TRITON or torch is None, reason="triton (and torch) are not installed")
def test_merging_segments_keeps_the_floor_of_every_held_back_target():
    from nearest_kernels import _triton_candidate_kernels as tkernels

    def pack(key, index):
        bits = torch.tensor([key], dtype=torch.float32).view(torch.int32).to(torch.int64)
        mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return int((mono << 32) | index)

    E = tkernels.EMPTY
    # Three segments of 3 slots, unsorted. Segment 0 full (held back keys >= 5), segment 1
    # full (>= 2.5), segment 2 not full (holds its whole segment).
    row = [pack(5.0, 1), pack(-1.0, 0), pack(3.0, 2),
           pack(2.5, 10), pack(0.5, 11), pack(2.0, 12),
           pack(1.0, 20), E, E]
    lists = torch.tensor([row, row], dtype=torch.int64)
    merged, floor = tkernels.merge_segments(lists, 3, 8)
    keys, idx = tkernels.unpack(merged)
    assert idx[0].tolist() == [0, 11, 20, 12, 10, 2, 1, -1]
    assert floor.tolist() == [2.5, 2.5]
    # Cut to 5: the first dropped key is 3.0, segment 1 still bounds its own at 2.5.
    merged, floor = tkernels.merge_segments(lists, 3, 5)
    assert tkernels.unpack(merged)[1][0].tolist() == [0, 11, 20, 12, 10]
    assert floor.tolist() == [2.5, 2.5]
    # Cut to 2: the first dropped key (1.0) is the floor.
    merged, floor = tkernels.merge_segments(lists, 3, 2)
    assert tkernels.unpack(merged)[1][0].tolist() == [0, 11]
    assert floor.tolist() == [1.0, 1.0]


@pytest.mark.skipif(not HAS_TRITON or torch is None, reason="triton (and torch) are not installed")
def test_target_tiles_by_descriptor_only_where_tma_can_address_them(monkeypatch):
    from nearest_kernels import _triton_plan as tplan

    def form(t, block_d=64):
        out = tplan.target_descriptor(t, 32, block_d)
        return "descriptor" if isinstance(out, tplan.TensorDescriptor) else ("operand" if out is t else "?")

    # CPU tensors (the interpreter) take the descriptor form where the operand allows, as Hopper.
    t32, t16 = torch.zeros(203, 40), torch.zeros(203, 40, dtype=torch.bfloat16)
    assert form(t32) == form(t16) == "descriptor"
    desc = tplan.target_descriptor(t16, 32, 64)
    assert list(desc.shape) == [203, 40] and list(desc.block_shape) == [32, 64]
    # Rows whose stride is not a multiple of 16 bytes (d=33 float32, d=36 bf16), a column
    # slice (last stride not 1), a misaligned start, a block wider than a TMA box: pointers.
    assert form(torch.zeros(203, 33)) == form(torch.zeros(203, 36, dtype=torch.bfloat16)) == "operand"
    assert form(torch.zeros(40, 203).T) == form(torch.zeros(204, 40).view(-1)[1:8121].view(203, 40)) == "operand"
    assert form(torch.zeros(203, 512, dtype=torch.bfloat16), block_d=512) == "operand"
    # CUDA devices: Hopper (9.0) and later only; below it Triton would rewrite the descriptor
    # into pointer loads, a form the kernel was never measured in.
    majors = {0: 8, 1: 9}
    monkeypatch.setattr(tplan, "_cuda_major", lambda index: majors[index])
    assert not tplan.has_tma(torch.device("cuda", 0)) and tplan.has_tma(torch.device("cuda", 1))
    assert tplan.has_tma(torch.device("cpu")) and not tplan.has_tma(torch.device("meta"))


background.register(
    "triton-interpreter",
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/interp"],
    env={"TRITON_INTERPRET": "1"}, timeout=1200, junit=True)


@pytest.mark.background("triton-interpreter")
@pytest.mark.skipif(not HAS_TRITON or torch is None, reason="triton (and torch) are not installed")
def test_kernels_under_the_triton_interpreter(background_result):
    """Every module of tests/kernels/interp (the fused kernels with tiny tiles) in one pytest
    run under ``TRITON_INTERPRET=1``: one interpreter start for all of them, started beside the main run (tests/background.py). Every test there must pass;
    none may skip."""
    report = background_result.junit()
    assert background_result.returncode == 0, background_result.tail()
    # The fused kernels' module 17, the adversarial cases' 4, the caps' 4, the filter's 5, the
    # interpreter shortcuts' 2, the target and query preparation's 20: fewer means a module was
    # not collected.
    assert report["tests"] >= 52 and report["failures"] == report["errors"] == 0, report
    assert report["skipped"] == 0, report


# ----------------------------------------------------------------------------- on a GPU
def poison_kernel_buffers(monkeypatch):
    """Make every output and scratch buffer of the fused candidate kernels start as garbage
    (they allocate them uninitialised): a slot a kernel reads back without writing it, or a
    stale one, then shows in the results. Both launchers allocate through ``kernel_buffer``,
    each by its own name for it: the register lists' and the threshold filter's."""
    from nearest_kernels import _triton_candidates as tcands
    from nearest_kernels import _triton_filter as tfilter

    allocate = tcands.kernel_buffer

    def poisoned(shape, dtype, device):
        buf = allocate(shape, dtype, device)
        return buf.fill_(0x5A5A5A5A5A5A5A5A if dtype == torch.int64 else -7)

    for launcher in (tcands, tfilter):
        monkeypatch.setattr(launcher, "kernel_buffer", poisoned)


@pytest.fixture
def poisoned_buffers(monkeypatch):
    poison_kernel_buffers(monkeypatch)


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
@pytest.mark.parametrize("k", [10, 100])
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("metric", METRICS)
def test_gpu_widening_through_search_prepared(metric, precision, k, poisoned_buffers):
    """Widening rounds (seeded lists) by plain and by lower keys, as the library chooses them
    (``gpu.uses_lower_keys``: tf32 and bf16 k=10 at d=200 by plain keys, bf16 at d <= 128 and
    k=100 by lower keys): clustered data makes rows widen. Through ``search_prepared`` (as the
    executors call it, not through knn, which drops unrankable rows first), with a non-finite
    query row riding along: it must come back empty."""
    from nearest_kernels import gpu as kgpu

    shapes = [(517, 3001, 128), (19, 20_011, 33)] + ([(131, 5003, 200)] if precision == "bf16" else [])
    lower = {kgpu.uses_lower_keys(k, precision, d) for _, _, d in shapes}
    assert lower == ({False} if precision == "tf32" else {True, k >= 64})
    _check_search_prepared_with_a_nan_row(metric, precision, k, ("widening", metric, precision, k), shapes)


def _check_search_prepared_with_a_nan_row(metric, precision, k, tag, shapes):
    """search_prepared on clustered data (rows widen) with a NaN query row: exact results,
    the NaN row empty."""
    from nearest_kernels import gpu as kgpu

    dev = torch.device("cuda")
    seed = zlib.crc32(repr(tag).encode())
    for nq, nt, d in shapes:
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
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_torch_fallback_and_tensor_inputs(metric, precision):
    from nearest_kernels import gpu as kgpu
    from nearest_kernels.gpu import knn_torch

    q, t = make_data("clustered", 300, 2000, 96, 11)
    qd, td = torch.from_numpy(q).cuda(), torch.from_numpy(t).cuda()
    # k=25: the fused kernel (fp32: cuBLAS candidates); k=600 and 1100: a low-precision
    # first list of about 2k, beyond the fused kernel's: the torch path in every precision
    # (gpu.choose, _gpu_bound.LONG_LIST_K).
    for k in (25, 600, 1100):
        assert (kgpu.choose(k, precision, qd.device)[0].name == "torch") == (precision == "fp32" or k > 512)
        v, i = knn_torch(qd, td, k, metric, precision)
        assert v.device.type == "cuda"
        check_result(q, t, k, metric, v.cpu().numpy(), i.cpu().numpy())


@pytest.mark.gpu
@needs_cuda
def test_the_sample_kept_with_a_block_has_the_rows_its_budget_counts():
    # udfs.gpu_search budgets a block with kept_sample_rows: the sample a sampled first pass keeps
    from nearest_kernels import gpu

    # (a block large enough for the first pass's segments: a smaller one runs it on the torch
    # path, without a sample, which the budget counts as if it took one)
    q, t = make_data("gaussian", 2048, 500_000, 384, 5)
    prepared = gpu.prepare_targets(torch.from_numpy(t).cuda(), "l2", "bf16")
    gpu.search_prepared(torch.from_numpy(q).cuda(), prepared, 100)
    samples = [v for key, v in prepared.side.cache.items() if isinstance(key, tuple) and key[0] == "sample"]
    assert [s.rows for s in samples] == [gpu.kept_sample_rows(500_000, 384, 100, "bf16", torch.device("cuda"))]
    assert samples[0].rows > 0


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


_AHEAD_SCRIPT = r"""
import json, os, sys, tempfile, threading
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-ahead-")
sys.path.insert(0, sys.argv[1])
import torch
from triton.runtime.jit import JITFunction
from nearest_kernels.gpu import knn_torch

compiled = []
real = JITFunction._do_compile

def recorded(self, *args, **kwargs):
    compiled.append((self.fn.__name__, threading.current_thread().name))
    return real(self, *args, **kwargs)

JITFunction._do_compile = recorded
gen = torch.Generator(device="cuda").manual_seed(3)
for precision, d, k, nq, nt in json.loads(sys.argv[2]):
    first = len(compiled)
    q = torch.randn((nq, d), generator=gen, device="cuda") + 1.0
    t = torch.randn((nt, d), generator=gen, device="cuda") + 1.0
    knn_torch(q, t, k, "l2", precision)
    torch.cuda.synchronize()
    print(json.dumps(compiled[first:]), flush=True)
"""


@pytest.mark.gpu
@needs_cuda
def test_the_first_pass_compiles_ahead_on_its_thread_and_once():
    # knn_torch starts compiling its first candidate pass and its re-rank on threads before it
    # prepares the target block (gpu.compile_first_pass). The configurations predicted from the
    # shape must be the ones the search launches: were they not, the search would compile its
    # own on the calling thread. A fresh process with an empty Triton cache.
    import json
    import subprocess
    import sys
    from pathlib import Path

    cases = [("bf16", 3, 1, 2048, 60_000), ("tf32", 128, 10, 2048, 60_000), ("fp32", 200, 10, 2048, 60_000),
             ("bf16", 384, 100, 2048, 60_000), ("bf16", 64, 10, 7, 300), ("tf32", 1536, 10, 65, 20_000),
             ("bf16", 768, 10, 2048, 140_000),   # the threshold filter (on 9.x)
             ("bf16", 384, 1000, 1024, 40_000)]  # a long list: the filter, no register lists
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", _AHEAD_SCRIPT, root, json.dumps(cases)], capture_output=True,
                         text=True, timeout=600, check=True).stdout.splitlines()
    assert len(out) == len(cases), out
    for case, line in zip(cases, out):
        # The candidate kernel (the fp32 case's come from cuBLAS) and the re-rank: at most one
        # compilation each, on the thread that started before the preparation (a long list's
        # re-rank twice: its packed entries for the first round, values for widening rounds).
        for kernel in ("rowlist_kernel", "rerank_kernel", "filter_kernel", "hits_head_kernel", "hits_rest_kernel"):
            threads = [thread for name, thread in json.loads(line) if name == kernel]
            most = 2 if kernel == "rerank_kernel" and case[2] > 512 else 1
            assert set(threads) <= {"nj-compile-ahead"} and len(threads) <= most, (case, kernel, line)
    if torch.cuda.get_device_capability()[0] == 9:   # the filter kernel compiled, ahead, once
        assert [name for name, _ in json.loads(out[-2])].count("filter_kernel") == 1, out[-2]
        long_list = [name for name, _ in json.loads(out[-1])]   # and a long list's own kernels
        assert long_list.count("hits_head_kernel") == long_list.count("hits_rest_kernel") == 1, out[-1]
    assert "rowlist_kernel" not in [name for name, _ in json.loads(out[-1])], out[-1]
    first = [name for name, _ in json.loads(out[0])]
    assert first.count("rowlist_kernel") == 1 and first.count("rerank_kernel") == 1, out[0]
    assert json.loads(out[2]), "the fp32 case compiled nothing (no other case re-ranks at d=200)"
    # (a process compiles a given re-rank and candidate kernel once: later cases may find theirs)
