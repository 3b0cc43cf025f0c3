"""A target block's preparation on CUDA: ``_gpu_prepare``'s sides in three streaming passes.

:func:`triton_prepare_targets` is what ``gpu.prepare_targets`` runs on CUDA for every metric
but cosine, :func:`triton_prepare_queries` what ``gpu.prepare_queries`` runs there for the l2
form: the :class:`_gpu_prepare.PreparedSide` of the torch form (the same working rows and
operands in the same frame, the same norms up to the order of their float64 sums). Kernels
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
# scale), then the working rows, operands, norms, residuals and biases. The torch form makes
# float64 copies of each chunk and reads them again per quantity: at embedding sizes that was a
# large share of knn_torch's time (benchmarks/gpu_notes.md).
PREP_ROWS = 32          # rows per program of the row passes
PREP_D = 128            # columns per chunk
PREP_SUM_ROWS = 4096    # rows per program of the column sums (one float64 partial row each)
# The three passes are one kernel (``_prepare_kernel``'s runtime ``mode``): one compilation
# and one launcher (each a C module built on a process's first launch of a signature) instead
# of three, on every new executor's first call.
PREP_SUMS, PREP_SPREAD, PREP_FILL = 0, 1, 2


@triton.jit
def _prepare_column_sums(x_ptr, part_ptr, n, d, stride_x, ROWS: tl.constexpr, SUB: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """float64 sums of rows [pid_r ROWS, (pid_r + 1) ROWS) over the column chunk ``pid_d``,
    into row ``pid_r`` of ``part`` (the host sums the partial rows: deterministic)."""
    pid_r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([SUB, BLOCK_D], dtype=tl.float64)
    r_start = pid_r * ROWS
    for r0 in range(r_start, tl.minimum(n, r_start + ROWS), SUB):
        rows = r0 + tl.arange(0, SUB)
        ok = (rows < n)[:, None] & (cols < d)[None, :]
        acc += tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=ok,
                       other=0.0).to(tl.float64)
    tl.store(part_ptr + pid_r.to(tl.int64) * d + cols, tl.sum(acc, axis=0), mask=cols < d)


@triton.jit
def _prepare_spread(x_ptr, c_ptr, spread_ptr, n, d, stride_x, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """float64 ``sum((x - c)^2)`` per row."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float64)
    for d0 in range(0, d, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = (rows < n)[:, None] & (cols < d)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=ok,
                    other=0.0).to(tl.float64)
        c = tl.load(c_ptr + cols, mask=cols < d, other=0.0)
        diff = tl.where(ok, x - c[None, :], 0.0)
        acc += tl.sum(diff * diff, axis=1)
    tl.store(spread_ptr + rows, acc, mask=rows < n)


@triton.jit
def _prepare_fill(x_ptr, c_ptr, scale_ptr, exact_ptr, op_ptr, norm_ptr, op_norm_ptr, res_ptr, bias_ptr,
                  n, d, stride_x, up, L2: tl.constexpr, OPERAND: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``_gpu_prepare.prepare_side`` of target rows: working rows ``(x - c) scale`` (float64,
    rounded once to float32, as the torch form), operands (``OPERAND`` 0: none, the working
    rows are; 1: tf32, ``round_to_tf32``; 2: bf16; both to nearest, ties even, as torch rounds
    them), and per row the float64 norms of the working rows, the operands and their
    difference, written as float32 times ``up`` (never rounded down: ``_gpu_prepare._up32``),
    and the bias |exact|^2. ``scale_ptr``: the frame's power of two as a float64 scalar (a
    float32 argument could not hold the scales of float64 rows)."""
    scale = tl.load(scale_ptr)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n
    rows64 = rows.to(tl.int64)
    n2 = tl.zeros([BLOCK_R], dtype=tl.float64)
    o2 = tl.zeros([BLOCK_R], dtype=tl.float64)
    r2 = tl.zeros([BLOCK_R], dtype=tl.float64)
    for d0 in range(0, d, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = live[:, None] & (cols < d)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float64)
        c = tl.load(c_ptr + cols, mask=cols < d, other=0.0)
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
def _prepare_kernel(x_ptr, c_ptr, part_ptr, spread_ptr, scale_ptr, exact_ptr, op_ptr, norm_ptr,
                    op_norm_ptr, res_ptr, bias_ptr, n, d, stride_x, up, mode,
                    L2: tl.constexpr, OPERAND: tl.constexpr, SUM_ROWS: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """One pass of a target block's preparation (:func:`triton_prepare_targets`) by ``mode``:
    ``PREP_SUMS`` (grid (row groups, column chunks)) the centre's partial sums,
    ``PREP_SPREAD`` each row's squared distance from the centre ``c_ptr``, ``PREP_FILL`` the
    working rows, operands, norms, residuals and biases. Every pass takes every argument (one
    signature, one compiled kernel); each reads and writes only its own."""
    if mode == 0:
        _prepare_column_sums(x_ptr, part_ptr, n, d, stride_x, SUM_ROWS, BLOCK_R, BLOCK_D)
    elif mode == 1:
        _prepare_spread(x_ptr, c_ptr, spread_ptr, n, d, stride_x, BLOCK_R, BLOCK_D)
    else:
        _prepare_fill(x_ptr, c_ptr, scale_ptr, exact_ptr, op_ptr, norm_ptr, op_norm_ptr, res_ptr,
                      bias_ptr, n, d, stride_x, up, L2, OPERAND, BLOCK_R, BLOCK_D)


def _prepare_pass(mode: int, grid, x, center, part, spread, scale, exact, operand, norm, op_norm,
                  residual, bias, metric: str, precision: str) -> None:
    from ._gpu_prepare import U32, l2_form

    n, d = x.shape
    _prepare_kernel[grid](x, center, part, spread, scale, exact, operand, norm, op_norm, residual,
                          bias, n, d, x.stride(0), 1 + 4 * U32, mode, L2=l2_form(metric),
                          OPERAND={"fp32": 0, "tf32": 1, "bf16": 2}[precision],
                          SUM_ROWS=PREP_SUM_ROWS, BLOCK_R=PREP_ROWS, BLOCK_D=PREP_D, num_warps=4)


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


def triton_working_frame(targets: torch.Tensor, metric: str, precision: str = "bf16", buffers=None):
    """``_gpu_prepare.working_frame`` by :func:`_prepare_kernel`'s first two passes (not cosine:
    its unit rows stay with the torch form). The same frame up to the order of the float64
    sums; one host sync. ``precision`` and ``buffers`` (:func:`_prepare_buffers`): those of the
    fill pass that follows, whose signature every pass shares."""
    from ._gpu_prepare import Frame, pow2_below

    n, d = targets.shape
    assert metric != "cosine" and n and d
    x = targets.contiguous()
    bufs = buffers or _prepare_buffers(x, precision)
    blocks_r = triton.cdiv(n, PREP_SUM_ROWS)
    part = torch.empty((blocks_r, d), dtype=torch.float64, device=x.device)
    spread = torch.empty(n, dtype=torch.float64, device=x.device)
    scale = bufs[-1]
    _prepare_pass(PREP_SUMS, (blocks_r, triton.cdiv(d, PREP_D)), x, part[0], part, spread, scale,
                  *bufs[:-1], metric, precision)
    center = part.sum(dim=0) / n
    _prepare_pass(PREP_SPREAD, (triton.cdiv(n, PREP_ROWS),), x, center, part, spread, scale,
                  *bufs[:-1], metric, precision)
    extent, peak, center_norm = torch.stack([spread.max().sqrt(), center.abs().max(),
                                             torch.linalg.vector_norm(center)]).tolist()
    if not (extent > 0 and math.isfinite(extent)):
        extent = peak if peak > 0 and math.isfinite(peak) else 1.0
    return Frame(center, pow2_below(extent), metric == "inner_product", center_norm)


def _fill_side(source: torch.Tensor, metric: str, precision: str, frame, bufs) -> PreparedSide:
    """The fill pass of :func:`_prepare_kernel` over ``source`` (float32 or float64,
    contiguous) in ``frame`` (its centre set): the side ``_gpu_prepare.prepare_side`` makes of
    rows shifted by the centre and scaled (targets, and the queries of the l2 form)."""
    exact, operand, norm, op_norm, residual, bias, factor = bufs
    factor.fill_(frame.scale)
    _prepare_pass(PREP_FILL, (triton.cdiv(source.shape[0], PREP_ROWS),), source, frame.center,
                  factor, factor, factor, exact, operand, norm, op_norm, residual, bias, metric,
                  precision)
    return PreparedSide(exact, operand, norm, op_norm, residual, bias, metric, precision,
                        source, factor, None, frame)


def _float_source(rows: torch.Tensor) -> torch.Tensor:
    source = rows if rows.dtype in (torch.float32, torch.float64) else rows.to(torch.float32)
    return source.contiguous()


def triton_prepare_targets(targets: torch.Tensor, metric: str, precision: str) -> PreparedSide:
    """``_gpu_prepare.prepare_targets_side`` in three streaming passes (:func:`_prepare_kernel`):
    the same working rows and operands in the same frame (bit for bit, given the frame), the
    same norms up to the order of their float64 sums (each rounded up to float32 the same
    way). Rows finite, at least one row and one column, metric not cosine."""
    source = _float_source(targets)
    bufs = _prepare_buffers(source, precision)
    frame = triton_working_frame(source, metric, precision, bufs)
    return _fill_side(source, metric, precision, frame, bufs)


def triton_prepare_queries(queries: torch.Tensor, targets: PreparedSide) -> PreparedSide:
    """``_gpu_prepare.prepare_queries`` by the fill pass alone, for the l2 form (l2,
    sqeuclidean: queries shift and scale as the targets do) in a frame with a centre (a block
    of :func:`triton_prepare_targets`): the torch form's working rows and operands bit for
    bit, its norms up to the order of their float64 sums; one pass over the rows where the
    torch form made float64 copies of each chunk and read them again per quantity. Rows
    finite, at least one row and one column."""
    assert l2_form(targets.metric) and targets.frame.center is not None
    source = _float_source(queries)
    return _fill_side(source, targets.metric, targets.precision, targets.frame,
                      _prepare_buffers(source, targets.precision))
