"""The target-preparation kernels (``_triton_prepare.triton_prepare_targets``) against the torch
form (``_gpu_prepare.prepare_targets_side``) under the Triton interpreter: the same frame (its
centre up to the order of the float64 sums, the same power of two), the same working rows and
operands bit for bit in the torch form's frame, and norms, residuals and biases never below
their float64 values and within a float32 rounding of the torch form's. Cosine normalises its
rows in float64 apart from the torch form: its factors ``scale / |x|`` within a few float64
roundings of the torch form's, and its working rows exactly ``x f - c s`` rounded once (the
shifted unit rows the re-rank computes), within a float32 step of the torch form's. Rows with
an offset (non-centred, as embeddings are; nearly parallel for cosine), one and several
column-sum programs, d not a multiple of the kernels' column chunk, fewer rows than a
program's, float32 and float64 sources (float64 rows of magnitudes 1e-200 to 1e200), every
precision, l2 form, cosine and inner product.

Collected only under ``TRITON_INTERPRET=1`` (see ``conftest.py`` here).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nearest_kernels import _gpu_prepare as gp
from nearest_kernels import _triton_prepare as tprep

CASES = [("l2", "bf16", torch.float32, 37, 130), ("sqeuclidean", "tf32", torch.float64, 70, 3),
         ("inner_product", "fp32", torch.float32, 5, 129), ("l2", "bf16", torch.float64, 33, 256),
         ("cosine", "bf16", torch.float32, 37, 130), ("cosine", "tf32", torch.float64, 70, 3),
         ("cosine", "fp32", torch.float32, 5, 129)]


def _rows(n, d, dtype, seed, metric="l2"):
    gen = torch.Generator().manual_seed(seed)
    offset = 10 + torch.randn(d, generator=gen, dtype=torch.float64)
    rows = offset + 0.1 * torch.randn((n, d), generator=gen, dtype=torch.float64)
    if metric == "cosine" and dtype == torch.float64:
        # Row magnitudes from 1e-200 to 1e200 (cosine ranks directions): their squares would
        # leave float64's range without the division by each row's peak.
        rows = rows * 10.0 ** (400 * torch.rand((n, 1), generator=gen, dtype=torch.float64) - 200)
    return rows.to(dtype)


def _steps(x):
    return torch.nextafter(x, torch.full_like(x, np.inf)) - x


def _check_norm(got, ref, truth, steps=1):
    """``got`` (float32) never below the float64 ``truth``, and at most ``steps`` float32
    steps from the torch form's ``ref`` (one: both round the same inflated float64 value;
    cosine's working rows may differ from the torch form's by a step each: two)."""
    assert bool((got.double() >= truth).all())
    assert bool(((got - ref).abs() <= steps * _steps(ref)).all())


def _operand(exact, precision):
    """The operands of float32 working rows: themselves, or rounded to nearest tf32 / bf16."""
    if precision == "fp32":
        return exact
    return gp.round_to_tf32(exact) if precision == "tf32" else exact.to(torch.bfloat16)


def _check_cosine_rows(side, source, ref):
    """Cosine's working rows in a frame: ``x f - c s`` in float64, rounded once to float32,
    with the side's own factors ``f = s / |x|`` (the re-rank's unit rows, shifted), within a
    float32 step of the torch form's ``ref``; operands those rows rounded."""
    s = side.frame.scale
    want = (source.double() * side.factor[:, None] - side.frame.center * s).to(torch.float32)
    assert torch.equal(side.exact, want)
    assert bool(((side.exact - ref.exact).abs() <= _steps(ref.exact.abs())).all())
    assert side.operand.dtype == ref.operand.dtype
    assert torch.equal(side.operand.float(), _operand(side.exact, side.precision).float())
    # The factors: the torch form's up to the rounding of its normalisation.
    torch.testing.assert_close(side.factor, ref.factor, rtol=2 ** -48, atol=0)


@pytest.mark.parametrize("metric,precision,dtype,n,d", CASES)
@pytest.mark.parametrize("sum_rows", [tprep.PREP_SUM_ROWS, tprep.PREP_ROWS])
def test_the_kernels_prepare_the_torch_forms_side(metric, precision, dtype, n, d, sum_rows, monkeypatch):
    # PREP_ROWS rows per column-sum program: several partial sums (the block's own: one).
    monkeypatch.setattr(tprep, "PREP_SUM_ROWS", sum_rows)
    x = _rows(n, d, dtype, n + d, metric)
    ref = gp.prepare_targets_side(x, metric, precision)
    got = tprep.triton_prepare_targets(x, metric, precision)
    assert got.frame.scale == ref.frame.scale
    assert got.frame.row_scaled == ref.frame.row_scaled
    # (Cosine: the mean of unit rows, each within a few float64 roundings of the torch form's.)
    torch.testing.assert_close(got.frame.center, ref.frame.center, rtol=1e-13,
                               atol=2 ** -48 if metric == "cosine" else 0)
    assert got.frame.center_norm == pytest.approx(ref.frame.center_norm, rel=1e-13)
    assert got.source is not None and torch.equal(got.source, x)
    if metric != "cosine":
        assert torch.equal(got.factor, ref.factor)
    assert got.offset is None and got.metric == metric and got.precision == precision

    # In the torch form's frame the working rows and operands are the same bits.
    tr_frame = tprep.triton_working_frame
    try:
        tprep.triton_working_frame = lambda rows, m, *rest, frame=ref.frame: frame
        same = tprep.triton_prepare_targets(x, metric, precision)
    finally:
        tprep.triton_working_frame = tr_frame
    if metric == "cosine":
        _check_cosine_rows(same, x, ref)
    else:
        assert torch.equal(same.exact, ref.exact)
        assert same.operand.dtype == ref.operand.dtype
        assert torch.equal(same.operand.float(), ref.operand.float())
    if precision == "fp32":
        assert same.operand is same.exact
    _check_side_norms(same, ref)


def _check_side_norms(side, ref):
    """Norms, residuals and biases never below the float64 values of the side's own rows, and
    within a step (cosine: two) of the torch form's; inner product's biases 0."""
    steps = 2 if side.metric == "cosine" else 1
    exact64, op64 = side.exact.double(), side.operand.double()
    _check_norm(side.norm, ref.norm, torch.linalg.vector_norm(exact64, dim=1), steps)
    _check_norm(side.operand_norm, ref.operand_norm, torch.linalg.vector_norm(op64, dim=1), steps)
    _check_norm(side.residual, ref.residual, torch.linalg.vector_norm(op64 - exact64, dim=1), steps)
    if side.metric == "inner_product":
        assert bool((side.bias == 0).all())
    else:
        torch.testing.assert_close(side.bias, ref.bias, rtol=2 ** -22 if steps == 2 else 2 ** -23, atol=0)


@pytest.mark.parametrize("metric,precision,dtype,n,d",
                         [case for case in CASES if case[0] != "inner_product"])
def test_the_fill_pass_prepares_the_torch_forms_queries(metric, precision, dtype, n, d):
    # Queries off the block (another offset): the targets' frame, not their own.
    ts = tprep.triton_prepare_targets(_rows(n, d, torch.float32, 1), metric, precision)
    q = _rows(11, d, dtype, 2, metric) + (3 if metric != "cosine" else 0)
    ref = gp.prepare_queries(q, ts)
    got = tprep.triton_prepare_queries(q, ts)
    assert got.frame is ts.frame and got.offset is None and torch.equal(got.source, q)
    if metric == "cosine":
        _check_cosine_rows(got, q, ref)
    else:
        assert torch.equal(got.factor, ref.factor)
        assert torch.equal(got.exact, ref.exact)
        assert got.operand.dtype == ref.operand.dtype and torch.equal(got.operand.float(), ref.operand.float())
    _check_side_norms(got, ref)
