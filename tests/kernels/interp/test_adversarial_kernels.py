"""The fused Triton kernels on adversarial data (issue 18) under the Triton interpreter: offsets
far larger than the spread (float32 and float64 rows), magnitudes near 1e20, nearly parallel
vectors. Each case, in every metric it declares: the re-rank kernel equals the torch form, and
exact_topk through the kernels with tiny tiles (16 x 32: several tiles and splits of a 150-row
block) returns the true top k; then the default tile configurations through ``knn_torch``, as
the backend runs them. Every check is :func:`tests.adversarial.assert_true_topk` at the
tolerance the backend declares (``nearest_kernels.gpu.RTOL``).

The GPU runs every adversarial case in every precision (tests/kernels/test_gpu_exactness.py,
``-m gpu``); here one precision per case, alternating bf16 / tf32, keeps the interpreter's
cost to a few program instances per search.

Collected only under ``TRITON_INTERPRET=1`` (see ``conftest.py`` here).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nearest_kernels import _gpu_prepare as gp
from nearest_kernels import _gpu_rerank as gr
from nearest_kernels import _gpu_search as gs
from nearest_kernels import _triton_rerank as trerank
from nearest_kernels.gpu import RTOL, knn_torch
from tests import adversarial as adv
from tests.kernels.interp.test_fused_kernels import Small

CASES = [lambda: adv.offset_case(16, 10.0, 0.1, nq=6, nt=150, seed=3),
         lambda: adv.offset_case(3, 1e3, 0.1, nq=6, nt=150, seed=4, dtype=np.float64),
         lambda: adv.magnitude_case(1e20, nq=6, nt=150, seed=5),
         lambda: adv.parallel_case(16, nq=6, nt=150, seed=6)]
IDS = ["offset10-d16-float32", "offset1000-d3-float64", "magnitude1e20", "parallel-d16"]


# Tiny tiles: the row-list kernel for short lists, the torch path for wider ones.
small = Small("rowlist")


@pytest.mark.parametrize("n", range(len(CASES)), ids=IDS)
def test_fused_kernels_return_the_true_top_k_on_adversarial_cases(n):
    case = CASES[n]()
    q, t = torch.from_numpy(case.queries), torch.from_numpy(case.targets)
    precision = ("bf16", "tf32")[n % 2]
    assert case.metrics, case.name
    for metric in case.metrics:
        qs, ts = gp.prepare_pair(q, t, metric, precision)
        # The re-rank kernel equals the torch form (float64 sums, rounded once).
        idx = torch.from_numpy(np.random.default_rng(n).integers(-1, len(case.targets), (len(case.queries), 9)))
        want, got = gr.exact_values(qs, ts, idx), trerank.triton_exact_values(qs, ts, idx)
        assert torch.equal(torch.isnan(got), idx < 0), (case.name, metric)
        assert torch.allclose(torch.nan_to_num(got), torch.nan_to_num(want), rtol=2.0 ** -22, atol=0), \
            (case.name, metric)
        v, i = gs.exact_topk(qs, ts, 5, small, max_candidates=256, values=trerank.triton_exact_values,
                             seeded=True, lower=metric != "inner_product")
        adv.assert_true_topk(case.queries, case.targets, 5, metric, v.numpy(), i.numpy(), RTOL,
                             case=f"{case.name} {metric} {precision}")
    # The default tile configurations, as the backend runs them (auto: the fused kernel in bf16).
    metric = case.metrics[0]
    v, i = knn_torch(q, t, 10, metric, "bf16")
    adv.assert_true_topk(case.queries, case.targets, 10, metric, v.numpy(), i.numpy(), RTOL,
                         case=f"{case.name} {metric} default tiles")


@pytest.mark.parametrize("metric", ["l2", "cosine", "inner_product"])
def test_groups_of_identical_rows_through_the_fused_kernel(metric):
    """Groups of identical targets (60 copies led by the queries' own row, 20 and 40 beside
    it) through ``knn_torch`` in bf16: the fused kernel's first pass, whose lists fill with
    exact ties, then the widening rounds, at k below the group (10) and above it (80). The
    result is the float64 reference's, indices exactly (ties to the lower index)."""
    from nearest_kernels._common import resolve_metric
    from nearest_kernels.reference import knn_reference

    q, t, groups = adv.tie_groups(6, 700, 16, (60, 20, 40), seed=9)
    for k in (10, 80):
        v, i = knn_torch(torch.from_numpy(q), torch.from_numpy(t), k, metric, "bf16")
        ref_v, ref_i = knn_reference(q, t, k, resolve_metric(metric))
        assert i[:3, : min(k, 60)].tolist() == [groups[0][: min(k, 60)].tolist()] * 3, (metric, k)
        np.testing.assert_array_equal(i.numpy(), ref_i, err_msg=f"{metric} k={k}")
        adv.assert_true_topk(q, t, k, metric, v.numpy(), i.numpy(), RTOL, case=f"tie groups {metric}")
