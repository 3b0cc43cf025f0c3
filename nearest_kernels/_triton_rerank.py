"""The exact re-rank on CUDA: ``_gpu_rerank.exact_values`` as one Triton kernel, and its launch.

:func:`triton_exact_values` is the ``values`` of ``_gpu_search.exact_topk`` wherever the fused
kernels run (``gpu.search_prepared``): it reads each candidate's source row in place, where the
torch form gathers them into float64 (rows, candidates, d) tensors. Also runs under
``TRITON_INTERPRET=1`` on CPU tensors (the tests).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._gpu_prepare import PreparedSide, l2_form
from ._gpu_rerank import live_width
from ._triton_candidate_kernels import EMPTY, pack, unpack
from ._triton_compile import AHEAD

_EMPTY = tl.constexpr(EMPTY)

# Query rows and candidate columns per step of the re-rank kernel, and the d-chunk it reads at
# a time: a step gathers RERANK_ROWS x RERANK_COLS target rows' chunks (one 128-byte line each
# in float32) against one chunk of each query row.
RERANK_ROWS = 16
RERANK_COLS = 8
RERANK_D = 32


# Sizes only bound loops and masks (one compiled variant for every row and column count).
@triton.jit(do_not_specialize=["m", "c"])
def rerank_kernel(q_ptr, t_ptr, qf_ptr, tf_ptr, c_ptr, idx_ptr, width_ptr, out_ptr, m, c, d, stride_q,
                  stride_t, L2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  BLOCK_D: tl.constexpr, PACKED: tl.constexpr = 0):
    """float32 working values of (query row, candidate) pairs, summed in float64 from the
    source rows (float32 or float64) and rounded once: ``sum((qf q - tf t)^2)`` (l2 form) or
    ``sum(qf q * tf (t - c))``; each scaled coordinate is O(1), so nothing over- or
    underflows (the torch form, ``_gpu_rerank.exact_values``). NaN in empty slots.

    One program owns BLOCK_R query rows and reads only their first ``width[row]`` columns
    (the caller's count: past it every slot is empty), BLOCK_C columns at a time: per
    d-chunk one load of the rows' query chunk, broadcast over the columns, and a gather of
    BLOCK_R x BLOCK_C target chunks. Columns past the program's widest row are not visited:
    the caller fills them with NaN. Nothing is materialised besides the (m, c) values (the
    torch form writes a (rows, c, d) tensor several times).
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < m
    rows64 = rows.to(tl.int64)
    width = tl.load(width_ptr + rows, mask=live, other=0)
    qf = tl.load(qf_ptr + rows, mask=live, other=0.0)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    for c0 in range(0, tl.max(width, axis=0), BLOCK_C):
        cols = c0 + offs_c
        ix = tl.load(idx_ptr + rows64[:, None] * c + cols[None, :],
                     mask=live[:, None] & (cols[None, :] < width[:, None]), other=-1)
        ok = ix >= 0
        tf = tl.load(tf_ptr + ix, mask=ok, other=0.0)
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
        for d0 in range(0, d, BLOCK_D):
            dd = d0 + offs_d
            inside = dd < d
            tv = tl.load(t_ptr + ix[:, :, None] * stride_t + dd[None, None, :],
                         mask=ok[:, :, None] & inside[None, None, :], other=0.0).to(tl.float64)
            qv = tl.load(q_ptr + rows64[:, None, None] * stride_q + dd[None, None, :],
                         mask=live[:, None, None] & inside[None, None, :], other=0.0).to(tl.float64)
            if L2:
                diff = qv * qf[:, None, None] - tv * tf[:, :, None]
                acc += tl.sum(diff * diff, axis=2)
            else:
                cv = tl.load(c_ptr + dd, mask=inside, other=0.0)
                acc += tl.sum((qv * qf[:, None, None]) * ((tv - cv[None, None, :]) * tf[:, :, None]), axis=2)
        if PACKED:
            val = acc.to(tl.float32)
            if PACKED == 2:
                val = -val
            val = tl.where(val == 0.0, 0.0, val)   # one zero: -0.0 and 0.0 tie, to the lower index
            tl.store(out_ptr + rows64[:, None] * c + cols[None, :], tl.where(ok, pack(val, ix), _EMPTY),
                     mask=live[:, None] & (cols[None, :] < c))
        else:
            tl.store(out_ptr + rows64[:, None] * c + cols[None, :], tl.where(ok, acc.to(tl.float32), float("nan")),
                     mask=live[:, None] & (cols[None, :] < c))


def triton_ranked_entries(queries: PreparedSide, targets: PreparedSide, idx: torch.Tensor) -> torch.Tensor:
    """int64 (m, c): each pair's ranking entry in the candidate lists' packed format
    (``_triton_candidate_kernels.pack``: its float32 value's order-preserving bits, negated
    first for similarities so that smaller is better, -0.0 as 0.0, above its target index),
    EMPTY in empty slots: one sort of a row's entries orders it by (value, index)."""
    m, c = idx.shape
    out = torch.full((m, c), EMPTY, dtype=torch.int64, device=idx.device)
    if m == 0 or c == 0:
        return out
    AHEAD.wait()
    grid, args, kwargs = rerank_arguments(queries.source, targets.source, queries.factor.contiguous(),
                                          targets.factor, _center(queries, targets), idx.contiguous(),
                                          live_width(idx), out, queries.metric, packed=True)
    rerank_kernel[grid](*args, **kwargs)
    return out


def entry_values(entries: torch.Tensor, metric: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32, indices int64) of :func:`triton_ranked_entries`' entries: the worst
    value and -1 for EMPTY."""
    keys, index = unpack(entries)
    return (keys if l2_form(metric) else -keys), index


def _center(queries: PreparedSide, targets: PreparedSide) -> torch.Tensor:
    """The frame's centre as the kernels read it (zeros for the origin; l2 never reads it)."""
    center = targets.frame.center
    if center is None:
        return torch.zeros(max(1, queries.dim), dtype=torch.float64, device=targets.source.device)
    return center.contiguous()


def triton_exact_values(queries: PreparedSide, targets: PreparedSide, idx: torch.Tensor) -> torch.Tensor:
    """:func:`_gpu_rerank.exact_values` by :func:`rerank_kernel`: the same values up to the
    order of the float64 summation (the error bound covers any order)."""
    m, c = idx.shape
    out = torch.full((m, c), math.nan, dtype=torch.float32, device=idx.device)
    if m == 0 or c == 0:
        return out
    AHEAD.wait()   # its compilation may have started ahead (compile_ahead)
    grid, args, kwargs = rerank_arguments(queries.source, targets.source, queries.factor.contiguous(),
                                          targets.factor, _center(queries, targets), idx.contiguous(),
                                          live_width(idx), out, queries.metric)
    rerank_kernel[grid](*args, **kwargs)
    return out


def rerank_arguments(q, t, q_factor, t_factor, center, idx, width, out, metric: str, packed: bool = False):
    """(grid, args, kwargs) of the :func:`rerank_kernel` launch of :func:`triton_exact_values`
    (``packed``: of :func:`triton_ranked_entries`)."""
    m, c = idx.shape
    d = q.shape[1]
    block_d = min(RERANK_D, max(16, triton.next_power_of_2(d)))
    return ((triton.cdiv(m, RERANK_ROWS),),
            (q, t, q_factor, t_factor, center, idx, width, out, m, c, d, q.stride(0), t.stride(0)),
            {"L2": l2_form(metric), "BLOCK_R": RERANK_ROWS, "BLOCK_C": RERANK_COLS, "BLOCK_D": block_d,
             "PACKED": (1 if l2_form(metric) else 2) if packed else 0, "num_warps": 4})
