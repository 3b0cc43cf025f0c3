"""The target-preparation kernels (``_triton_prepare.triton_prepare_targets``) against the torch
form (``_gpu_prepare.prepare_targets_side``) under the Triton interpreter: the same frame (its
centre up to the order of the float64 sums, the same power of two), the same working rows and
operands bit for bit in the torch form's frame, and norms, residuals and biases never below
their float64 values and within a float32 rounding of the torch form's. Rows with an offset
(non-centred, as embeddings are), one and several column-sum programs, d not a multiple of the kernels' column chunk, fewer rows
than a program's, float32 and float64 sources, every precision, l2 form and inner product.

Collected only under ``TRITON_INTERPRET=1`` (see ``conftest.py`` here).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nearest_kernels import _gpu_prepare as gp
from nearest_kernels import _triton_prepare as tprep

CASES = [("l2", "bf16", torch.float32, 37, 130), ("sqeuclidean", "tf32", torch.float64, 70, 3),
         ("inner_product", "fp32", torch.float32, 5, 129), ("l2", "bf16", torch.float64, 33, 256)]


def _rows(n, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    offset = 10 + torch.randn(d, generator=gen, dtype=torch.float64)
    return (offset + 0.1 * torch.randn((n, d), generator=gen, dtype=torch.float64)).to(dtype)


def _check_norm(got, ref, truth):
    """``got`` (float32) never below the float64 ``truth``, and at most one float32 step
    from the torch form's ``ref`` (both round the same inflated float64 value)."""
    assert bool((got.double() >= truth).all())
    step = torch.nextafter(ref, torch.full_like(ref, np.inf)) - ref
    assert bool(((got - ref).abs() <= step).all())


@pytest.mark.parametrize("metric,precision,dtype,n,d", CASES)
@pytest.mark.parametrize("sum_rows", [tprep.PREP_SUM_ROWS, tprep.PREP_ROWS])
def test_the_kernels_prepare_the_torch_forms_side(metric, precision, dtype, n, d, sum_rows, monkeypatch):
    # PREP_ROWS rows per column-sum program: several partial sums (the block's own: one).
    monkeypatch.setattr(tprep, "PREP_SUM_ROWS", sum_rows)
    x = _rows(n, d, dtype, n + d)
    ref = gp.prepare_targets_side(x, metric, precision)
    got = tprep.triton_prepare_targets(x, metric, precision)
    assert got.frame.scale == ref.frame.scale
    assert got.frame.row_scaled == ref.frame.row_scaled
    torch.testing.assert_close(got.frame.center, ref.frame.center, rtol=1e-13, atol=0)
    assert got.frame.center_norm == pytest.approx(ref.frame.center_norm, rel=1e-13)
    assert got.source is not None and torch.equal(got.source, x)
    assert torch.equal(got.factor, ref.factor)
    assert got.offset is None and got.metric == metric and got.precision == precision

    # In the torch form's frame the working rows and operands are the same bits.
    tr_frame = tprep.triton_working_frame
    try:
        tprep.triton_working_frame = lambda rows, m, *rest, frame=ref.frame: frame
        same = tprep.triton_prepare_targets(x, metric, precision)
    finally:
        tprep.triton_working_frame = tr_frame
    assert torch.equal(same.exact, ref.exact)
    assert same.operand.dtype == ref.operand.dtype
    assert torch.equal(same.operand.float(), ref.operand.float())
    if precision == "fp32":
        assert same.operand is same.exact
    exact64, op64 = ref.exact.double(), ref.operand.double()
    _check_norm(same.norm, ref.norm, torch.linalg.vector_norm(exact64, dim=1))
    _check_norm(same.operand_norm, ref.operand_norm, torch.linalg.vector_norm(op64, dim=1))
    _check_norm(same.residual, ref.residual, torch.linalg.vector_norm(op64 - exact64, dim=1))
    if metric == "inner_product":
        assert bool((same.bias == 0).all())
    else:
        torch.testing.assert_close(same.bias, ref.bias, rtol=2 ** -23, atol=0)


@pytest.mark.parametrize("metric,precision,dtype,n,d",
                         [case for case in CASES if case[0] != "inner_product"])
def test_the_fill_pass_prepares_the_torch_forms_queries(metric, precision, dtype, n, d):
    # Queries off the block (another offset): the targets' frame, not their own.
    ts = tprep.triton_prepare_targets(_rows(n, d, torch.float32, 1), metric, precision)
    q = _rows(11, d, dtype, 2) + 3
    ref = gp.prepare_queries(q, ts)
    got = tprep.triton_prepare_queries(q, ts)
    assert got.frame is ts.frame and got.offset is None and torch.equal(got.source, q)
    assert torch.equal(got.factor, ref.factor)
    assert torch.equal(got.exact, ref.exact)
    assert got.operand.dtype == ref.operand.dtype and torch.equal(got.operand.float(), ref.operand.float())
    exact64, op64 = ref.exact.double(), ref.operand.double()
    _check_norm(got.norm, ref.norm, torch.linalg.vector_norm(exact64, dim=1))
    _check_norm(got.operand_norm, ref.operand_norm, torch.linalg.vector_norm(op64, dim=1))
    _check_norm(got.residual, ref.residual, torch.linalg.vector_norm(op64 - exact64, dim=1))
    torch.testing.assert_close(got.bias, ref.bias, rtol=2 ** -23, atol=0)
