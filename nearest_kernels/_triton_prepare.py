"""A target block's preparation on CUDA: ``_gpu_prepare``'s sides in streaming passes.

:func:`triton_prepare_targets` is what ``gpu.prepare_targets`` runs on CUDA for every metric,
:func:`triton_prepare_queries` what ``gpu.prepare_queries`` runs there for the l2 form (cosine
included): the :class:`_gpu_prepare.PreparedSide` of the torch form (the same working rows and
operands in the same frame, the same norms up to the order of their float64 sums; cosine's
unit rows up to the rounding of their float64 normalisation, which the bound covers). Kernels
and their launches; also run under ``TRITON_INTERPRET=1`` on CPU tensors (the tests).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._gpu_prepare import PreparedSide, l2_form

# A target block's preparation (``_gpu_prepare.working_frame`` and ``prepare_side``) in three
# streaming passes over its rows: column sums (the centre), the rows' distances from it (the
# scale), then the working rows, operands, norms, residuals and biases; cosine first a fourth,
# each row's float64 1 / |x|, which the others multiply in (the unit rows are never stored).
# The torch form makes float64 copies of each chunk and reads them again per quantity (cosine
# normalises every chunk three times): at embedding sizes that was a large share of
# knn_torch's time (benchmarks/gpu_notes.md).
PREP_ROWS = 32          # rows per program of the row passes
PREP_D = 128            # columns per chunk
PREP_SUM_ROWS = 4096    # rows per program of the column sums (one float64 partial row each)
# The passes are one kernel (``_prepare_kernel``'s runtime ``mode``): one compilation and one
# launcher (each a C module built on a process's first launch of a signature) instead of one
# per pass, on every new executor's first call.
PREP_SUMS, PREP_SPREAD, PREP_FILL, PREP_UNIT = 0, 1, 2, 3


@triton.jit
def _prepare_inverse_norms(x_ptr, f_ptr, n, d, stride_x, PEAK: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """float64 ``1 / |x|`` per row (cosine's normalisation), into ``f_ptr``. float32 rows
    square in float64 without over- or underflow; ``PEAK`` (float64 rows): each row divided by
    its largest magnitude first, as ``_gpu_prepare._unit64`` does (elements from 1e-300 to
    1e300). Zero rows never get here (they cannot rank)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n
    rows64 = rows.to(tl.int64)
    peak = tl.full([BLOCK_R], 1.0, dtype=tl.float64)
    if PEAK:
        top = tl.zeros([BLOCK_R], dtype=tl.float64)
        for d0 in range(0, d, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            ok = live[:, None] & (cols < d)[None, :]
            x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float64)
            top = tl.maximum(top, tl.max(tl.abs(x), axis=1))
        peak = tl.where(top > 0, top, 1.0)
    acc = tl.zeros([BLOCK_R], dtype=tl.float64)
    for d0 in range(0, d, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = live[:, None] & (cols < d)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float64)
        if PEAK:
            x = x / peak[:, None]
        acc += tl.sum(x * x, axis=1)
    tl.store(f_ptr + rows, 1.0 / tl.sqrt(tl.where(live, acc, 1.0)) / peak, mask=live)


@triton.jit
def _prepare_column_sums(x_ptr, f_ptr, part_ptr, n, d, stride_x, COSINE: tl.constexpr, ROWS: tl.constexpr,
                         SUB: tl.constexpr, BLOCK_D: tl.constexpr):
    """float64 sums of rows [pid_r ROWS, (pid_r + 1) ROWS) over the column chunk ``pid_d``,
    into row ``pid_r`` of ``part`` (the host sums the partial rows: deterministic); ``COSINE``:
    of the unit rows ``x * f`` (``f_ptr``: each row's 1 / |x|)."""
    pid_r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([SUB, BLOCK_D], dtype=tl.float64)
    r_start = pid_r * ROWS
    for r0 in range(r_start, tl.minimum(n, r_start + ROWS), SUB):
        rows = r0 + tl.arange(0, SUB)
        ok = (rows < n)[:, None] & (cols < d)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=ok,
                    other=0.0).to(tl.float64)
        if COSINE:
            x = x * tl.load(f_ptr + rows, mask=rows < n, other=0.0)[:, None]
        acc += x
    tl.store(part_ptr + pid_r.to(tl.int64) * d + cols, tl.sum(acc, axis=0), mask=cols < d)


@triton.jit
def _prepare_spread(x_ptr, f_ptr, c_ptr, spread_ptr, n, d, stride_x, COSINE: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """float64 ``sum((x - c)^2)`` per row (``COSINE``: of the unit row ``x * f``)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    f = tl.zeros([BLOCK_R], dtype=tl.float64)
    if COSINE:
        f = tl.load(f_ptr + rows, mask=rows < n, other=0.0)
    acc = tl.zeros([BLOCK_R], dtype=tl.float64)
    for d0 in range(0, d, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = (rows < n)[:, None] & (cols < d)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=ok,
                    other=0.0).to(tl.float64)
        if COSINE:
            x = x * f[:, None]
        c = tl.load(c_ptr + cols, mask=cols < d, other=0.0)
        diff = tl.where(ok, x - c[None, :], 0.0)
        acc += tl.sum(diff * diff, axis=1)
    tl.store(spread_ptr + rows, acc, mask=rows < n)


@triton.jit
def _prepare_fill(x_ptr, c_ptr, f_ptr, exact_ptr, op_ptr, norm_ptr, op_norm_ptr, res_ptr, bias_ptr,
                  n, d, stride_x, up, L2: tl.constexpr, COSINE: tl.constexpr, OPERAND: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``_gpu_prepare.prepare_side`` of target rows: working rows ``(x - c) scale`` (float64,
    rounded once to float32, as the torch form), operands (``OPERAND`` 0: none, the working
    rows are; 1: tf32, ``round_to_tf32``; 2: bf16; both to nearest, ties even, as torch rounds
    them), and per row the float64 norms of the working rows, the operands and their
    difference, written as float32 times ``up`` (never rounded down: ``_gpu_prepare._up32``),
    and the bias |exact|^2. ``f_ptr``: the rows' factors (float64; a float32 argument could not
    hold the scales of float64 rows): the frame's power of two, read from the first, or
    (``COSINE``) each row's ``scale / |x|`` with ``c_ptr`` the centre times the scale, so that
    a working row is ``x f - c scale``, the shifted unit row that the re-rank's ``x f`` is
    (both products exact powers of two apart from the unit row's own rounding)."""
    scale = tl.load(f_ptr)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n
    rows64 = rows.to(tl.int64)
    f = tl.zeros([BLOCK_R], dtype=tl.float64)
    if COSINE:
        f = tl.load(f_ptr + rows, mask=live, other=0.0)
    n2 = tl.zeros([BLOCK_R], dtype=tl.float64)
    o2 = tl.zeros([BLOCK_R], dtype=tl.float64)
    r2 = tl.zeros([BLOCK_R], dtype=tl.float64)
    for d0 in range(0, d, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = live[:, None] & (cols < d)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float64)
        c = tl.load(c_ptr + cols, mask=cols < d, other=0.0)
        if COSINE:
            e = (x * f[:, None] - c[None, :]).to(tl.float32)
        else:
            e = ((x - c[None, :]) * scale).to(tl.float32)
        e = tl.where(ok, e, 0.0)
        tl.store(exact_ptr + rows64[:, None] * d + cols[None, :], e, mask=ok)
        e64 = e.to(tl.float64)
        n2 += tl.sum(e64 * e64, axis=1)
        if OPERAND != 0:
            # Round to nearest, ties to even, on the bits (as round_to_tf32): the rounded
            # value is a tf32 / bf16 value, so the bf16 cast below is exact in any mode
            # (the interpreter's cast truncates).
            bits = e.to(tl.int32, bitcast=True)
            if OPERAND == 1:
                bits = (bits + (0xFFF + ((bits >> 13) & 1))) & ~0x1FFF
            else:
                bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & ~0xFFFF
            o = bits.to(tl.float32, bitcast=True)
            o64 = o.to(tl.float64)
            if OPERAND == 1:
                tl.store(op_ptr + rows64[:, None] * d + cols[None, :], o, mask=ok)
            else:
                tl.store(op_ptr + rows64[:, None] * d + cols[None, :], o.to(tl.bfloat16), mask=ok)
            o2 += tl.sum(o64 * o64, axis=1)
            delta = o64 - e64
            r2 += tl.sum(delta * delta, axis=1)
    norm64 = tl.sqrt(n2)
    norm = (norm64 * up).to(tl.float32)
    tl.store(norm_ptr + rows, norm, mask=live)
    if OPERAND != 0:
        tl.store(op_norm_ptr + rows, (tl.sqrt(o2) * up).to(tl.float32), mask=live)
        tl.store(res_ptr + rows, (tl.sqrt(r2) * up).to(tl.float32), mask=live)
    else:
        tl.store(op_norm_ptr + rows, norm, mask=live)
        tl.store(res_ptr + rows, tl.zeros([BLOCK_R], dtype=tl.float32), mask=live)
    if L2:
        tl.store(bias_ptr + rows, (norm64 * norm64).to(tl.float32), mask=live)
    else:
        tl.store(bias_ptr + rows, tl.zeros([BLOCK_R], dtype=tl.float32), mask=live)


@triton.jit(do_not_specialize=["n", "mode"])
def _prepare_kernel(x_ptr, c_ptr, part_ptr, spread_ptr, f_ptr, exact_ptr, op_ptr, norm_ptr,
                    op_norm_ptr, res_ptr, bias_ptr, n, d, stride_x, up, mode,
                    L2: tl.constexpr, COSINE: tl.constexpr, PEAK: tl.constexpr, OPERAND: tl.constexpr,
                    SUM_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """One pass of a side's preparation (:func:`triton_prepare_targets`) by ``mode``:
    ``PREP_UNIT`` (cosine) each row's 1 / |x| into ``f_ptr``, ``PREP_SUMS`` (grid (row groups,
    column chunks)) the centre's partial sums, ``PREP_SPREAD`` each row's squared distance
    from the centre ``c_ptr``, ``PREP_FILL`` the working rows, operands, norms, residuals and
    biases. Every pass takes every argument (one signature, one compiled kernel per metric
    family); each reads and writes only its own."""
    if mode == 0:
        _prepare_column_sums(x_ptr, f_ptr, part_ptr, n, d, stride_x, COSINE, SUM_ROWS, BLOCK_R, BLOCK_D)
    elif mode == 1:
        _prepare_spread(x_ptr, f_ptr, c_ptr, spread_ptr, n, d, stride_x, COSINE, BLOCK_R, BLOCK_D)
    elif mode == 2:
        _prepare_fill(x_ptr, c_ptr, f_ptr, exact_ptr, op_ptr, norm_ptr, op_norm_ptr, res_ptr,
                      bias_ptr, n, d, stride_x, up, L2, COSINE, OPERAND, BLOCK_R, BLOCK_D)
    else:
        _prepare_inverse_norms(x_ptr, f_ptr, n, d, stride_x, PEAK, BLOCK_R, BLOCK_D)


def _prepare_pass(mode: int, grid, x, center, part, spread, factor, exact, operand, norm, op_norm,
                  residual, bias, metric: str, precision: str) -> None:
    from ._gpu_prepare import U32, l2_form

    n, d = x.shape
    # No fused multiply-adds: cosine's working rows are ``x f - c`` with the product rounded,
    # as the interpreter and the torch form compute them (the tests compare bits).
    _prepare_kernel[grid](x, center, part, spread, factor, exact, operand, norm, op_norm, residual,
                          bias, n, d, x.stride(0), 1 + 4 * U32, mode, L2=l2_form(metric),
                          COSINE=metric == "cosine", PEAK=x.dtype == torch.float64,
                          OPERAND={"fp32": 0, "tf32": 1, "bf16": 2}[precision],
                          SUM_ROWS=PREP_SUM_ROWS, BLOCK_R=PREP_ROWS, BLOCK_D=PREP_D, num_warps=4,
                          enable_fp_fusion=False)


def _prepare_buffers(x: torch.Tensor, precision: str):
    """(exact, operand, norm, operand norm, residual, bias, factor) of ``x``'s rows, unwritten."""
    n, d = x.shape
    device = x.device
    exact = torch.empty((n, d), dtype=torch.float32, device=device)
    operand = (exact if precision == "fp32" else
               torch.empty((n, d), dtype=torch.float32 if precision == "tf32" else torch.bfloat16,
                           device=device))
    vectors = [torch.empty(n, dtype=torch.float32, device=device) for _ in range(4)]
    return exact, operand, *vectors, torch.empty(n, dtype=torch.float64, device=device)


def _inverse_norms(source: torch.Tensor, metric: str, precision: str, bufs) -> None:
    """Cosine: each row's float64 1 / |x| into the factor buffer (``bufs[-1]``), which the
    other passes multiply in (:func:`_prepare_kernel`'s ``PREP_UNIT``); other metrics: none."""
    if metric == "cosine":
        _prepare_pass(PREP_UNIT, (triton.cdiv(source.shape[0], PREP_ROWS),), source, bufs[-1], bufs[-1],
                      bufs[-1], bufs[-1], *bufs[:-1], metric, precision)


def triton_working_frame(targets: torch.Tensor, metric: str, precision: str = "bf16", buffers=None):
    """``_gpu_prepare.working_frame`` by :func:`_prepare_kernel`'s sums and spread passes
    (cosine: of the unit rows, ``buffers``' factor holding each row's 1 / |x| from
    :func:`_inverse_norms`, computed here without ``buffers``). The same frame up to the order
    of the float64 sums (cosine: and the rounding of the unit rows); one host sync.
    ``precision`` and ``buffers`` (:func:`_prepare_buffers`): those of the fill pass that
    follows, whose signature every pass shares."""
    from ._gpu_prepare import Frame, pow2_below

    n, d = targets.shape
    assert n and d
    x = targets.contiguous()
    bufs = buffers
    if bufs is None:
        bufs = _prepare_buffers(x, precision)
        _inverse_norms(x, metric, precision, bufs)
    blocks_r = triton.cdiv(n, PREP_SUM_ROWS)
    part = torch.empty((blocks_r, d), dtype=torch.float64, device=x.device)
    spread = torch.empty(n, dtype=torch.float64, device=x.device)
    factor = bufs[-1]
    _prepare_pass(PREP_SUMS, (blocks_r, triton.cdiv(d, PREP_D)), x, part[0], part, spread, factor,
                  *bufs[:-1], metric, precision)
    center = part.sum(dim=0) / n
    _prepare_pass(PREP_SPREAD, (triton.cdiv(n, PREP_ROWS),), x, center, part, spread, factor,
                  *bufs[:-1], metric, precision)
    extent, peak, center_norm = torch.stack([spread.max().sqrt(), center.abs().max(),
                                             torch.linalg.vector_norm(center)]).tolist()
    if not (extent > 0 and math.isfinite(extent)):
        extent = peak if peak > 0 and math.isfinite(peak) else 1.0
    return Frame(center, pow2_below(extent), metric == "inner_product", center_norm)


def _fill_side(source: torch.Tensor, metric: str, precision: str, frame, bufs) -> PreparedSide:
    """The fill pass of :func:`_prepare_kernel` over ``source`` (float32 or float64,
    contiguous) in ``frame`` (its centre set): the side ``_gpu_prepare.prepare_side`` makes of
    rows shifted by the centre and scaled (targets, and the queries of the l2 form; cosine:
    their unit rows, ``bufs``' factor holding each row's 1 / |x|, :func:`_inverse_norms`)."""
    exact, operand, norm, op_norm, residual, bias, factor = bufs
    center = frame.center
    if metric == "cosine":
        # The re-rank's factor scale / |x| (a power of two: exact), and the centre in the
        # same units: the fill's working rows are x factor - center scale.
        factor.mul_(frame.scale)
        center = center * frame.scale
    else:
        factor.fill_(frame.scale)
    _prepare_pass(PREP_FILL, (triton.cdiv(source.shape[0], PREP_ROWS),), source, center,
                  factor, factor, factor, exact, operand, norm, op_norm, residual, bias, metric,
                  precision)
    return PreparedSide(exact, operand, norm, op_norm, residual, bias, metric, precision,
                        source, factor, None, frame)


def _float_source(rows: torch.Tensor) -> torch.Tensor:
    source = rows if rows.dtype in (torch.float32, torch.float64) else rows.to(torch.float32)
    return source.contiguous()


def triton_prepare_targets(targets: torch.Tensor, metric: str, precision: str) -> PreparedSide:
    """``_gpu_prepare.prepare_targets_side`` in three streaming passes (:func:`_prepare_kernel`;
    cosine four, its rows' 1 / |x| first): the same working rows and operands in the same
    frame (bit for bit, given the frame; cosine: given its rows' 1 / |x| too, which equals the
    torch form's up to the rounding of the float64 normalisation), the same norms up to the
    order of their float64 sums (each rounded up to float32 the same way). Rows finite (cosine:
    non-zero), at least one row and one column."""
    source = _float_source(targets)
    bufs = _prepare_buffers(source, precision)
    _inverse_norms(source, metric, precision, bufs)
    frame = triton_working_frame(source, metric, precision, bufs)
    return _fill_side(source, metric, precision, frame, bufs)


def triton_prepare_queries(queries: torch.Tensor, targets: PreparedSide) -> PreparedSide:
    """``_gpu_prepare.prepare_queries`` by the fill pass alone (cosine: after its rows'
    1 / |x|), for the l2 form (l2, sqeuclidean, cosine: queries shift and scale as the targets
    do) in a frame with a centre (a block of :func:`triton_prepare_targets`): the torch form's
    working rows and operands bit for bit (cosine: given the rows' 1 / |x|), its norms up to
    the order of their float64 sums; one pass over the rows where the torch form made float64
    copies of each chunk and read them again per quantity. Rows finite (cosine: non-zero), at
    least one row and one column."""
    assert l2_form(targets.metric) and targets.frame.center is not None
    source = _float_source(queries)
    bufs = _prepare_buffers(source, targets.precision)
    _inverse_norms(source, targets.metric, targets.precision, bufs)
    return _fill_side(source, targets.metric, targets.precision, targets.frame, bufs)
