"""triton_exact_tail (the fused re-rank and proof) under the Triton interpreter: it equals
the torch sequence it replaces (rerank, value_limit, the margin tests) bit for bit, with ties,
empty slots, +-0 values and floors of every kind; exact_topk with it returns the exact top k.

Collected only under ``TRITON_INTERPRET=1`` (see ``conftest.py`` here).
"""
from __future__ import annotations

import pytest
import torch

from nearest_join.kernels import _gpu_torch as gt
from nearest_join.kernels import _gpu_triton as tr
from tests.kernels.test_gpu import check_result, make_data

inf = float("inf")
CASES = [("l2", "bf16", 33, 16, 5), ("sqeuclidean", "tf32", 70, 32, 10),
         ("inner_product", "bf16", 16, 8, 8), ("cosine", "fp32", 33, 16, 3), ("l2", "bf16", 33, 64, 20)]


@pytest.mark.parametrize("n", range(len(CASES)), ids=lambda n: "-".join(map(str, CASES[n])))
def test_fused_tail_equals_the_torch_sequence(n):
    metric, precision, d, w, k = CASES[n]
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
    # A list shorter than k: the fused tail declines (the torch sequence takes it).
    assert tr.triton_exact_tail(qs, ts, keys[:, :3], idx[:, :3], floor, bound, k + 1) is None
