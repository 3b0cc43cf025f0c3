"""Distance caps through the fused Triton kernels (issue 22) under the Triton interpreter.

Under a cap the first candidate pass is seeded with each row's cap limit (the register-list
kernel's placeholders: keys above it never enter); the rows come back with fewer than k, or
none, exactly as the float64 oracle has them (:func:`tests.oracle.assert_capped_topk` at the
backend's tolerance). Tiny tiles (16 x 32, two splits) on an adversarial offset case with
duplicate targets, then the default tile configuration through ``knn_torch``. The GPU runs
the full matrix (tests/kernels/test_caps.py, ``-m gpu``).

Collected only under ``TRITON_INTERPRET=1`` (see ``conftest.py`` here).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nearest_kernels import _gpu_prepare as gp
from nearest_kernels import _gpu_search as gs
from nearest_kernels import _triton_rerank as trerank
from nearest_kernels.gpu import knn_torch
from tests import adversarial as adv
from tests.kernels.interp.test_fused_kernels import Small
from tests.oracle import assert_capped_topk, backend_rtol, key_values, oracle_keys

SIMILARITIES = ("cosine", "inner_product")


# Tiny tiles: the row-list kernel for short lists, the torch path for wider ones.
small = Small("rowlist")


def _cap(values: np.ndarray, share: float, metric: str) -> float:
    """A cap midway between two consecutive distinct values, about ``share`` of them within."""
    distinct = np.unique(values)
    if metric in SIMILARITIES:
        distinct = distinct[::-1]
    n = max(0, min(distinct.size - 2, round(share * distinct.size)))
    return float((distinct[n] + distinct[n + 1]) / 2)


@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "cosine", "inner_product"])
def test_capped_search_through_the_fused_kernels(metric):
    case = adv.offset_case(16, 10.0, 0.1, nq=8, nt=150, seed=51)
    q, t = torch.from_numpy(case.queries), torch.from_numpy(case.targets)
    values = key_values(oracle_keys(case.queries, case.targets, metric), metric)
    cap = _cap(values, 0.02, metric)      # about 3 targets of 150 per row: some none, some < k
    rtol = backend_rtol("gpu")
    qs, ts = gp.prepare_pair(q, t, metric, "bf16")
    v, i = gs.exact_topk(qs, ts, 5, small, max_candidates=256, values=trerank.triton_exact_values,
                         seeded=True, lower=metric != "inner_product", cap=cap)
    assert_capped_topk(case.queries, case.targets, 5, metric, cap, v.numpy(), i.numpy(), rtol,
                       case=f"{case.name} tiny tiles")
    counts = (i >= 0).sum(dim=1)
    assert (counts < 5).any() and (counts > 0).any(), counts
    # The default tile configuration, as the backend runs it (auto: the fused kernel in bf16).
    v, i = knn_torch(q, t, 5, metric, "bf16", cap=cap)
    assert_capped_topk(case.queries, case.targets, 5, metric, cap, v.numpy(), i.numpy(), rtol,
                       case=f"{case.name} default tiles")
