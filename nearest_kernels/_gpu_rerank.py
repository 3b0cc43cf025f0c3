"""The exact stage of the GPU searches: the candidates' values from the source rows, ranked.

The re-rank (:func:`exact_values`, ``_triton_rerank.triton_exact_values``) computes each value
in working units from the *source* rows (float32 or float64, as given) in float64:
``sum((f_q q - f_t t)^2)`` with each side's factor (``s``, or ``s / |x|`` for cosine), or
``sum(f_q q * s (t - c))``, rounded once to float32. Every scaled coordinate is O(1): no
square over- or underflows for float32 elements of 1e-24 or 1e20, or float64 ones of 1e30.
:func:`final_values` maps them back in float64 (``sqrt(W) / s``, ``W / s^2``,
``1 - W / (2 s^2)``, ``W / (f_q s) + q . c``), so values are +-inf only where the true value
exceeds float32's range.

:func:`rerank` takes a round's candidates (``_gpu_search.exact_topk``), leaves out those that
the bound rules out (``_gpu_bound.value_limit``) and ranks the rest by (value, index)
(:func:`best_order`: every backend's tie rule). Under a distance cap the pairs are decided
by their float64 values (:func:`pair_values64`, :func:`drop_beyond_cap`).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ._gpu_bound import LONG_LIST_K, skip_beyond, value_limit
from ._gpu_prepare import PreparedSide, is_similarity, l2_form

# values(queries, targets, idx) -> float32 (m, c): the pairs' exact values, NaN where idx < 0
# (:func:`exact_values`, or the fused kernel's ``_triton_rerank.triton_exact_values``).
ValuesFn = Callable[[PreparedSide, PreparedSide, torch.Tensor], torch.Tensor]


def rerank_rows(queries: PreparedSide, targets: PreparedSide, idx: torch.Tensor,
                chunk_elements: int = 1 << 24):
    """The re-rank's float64 rows in working units, chunk by chunk: yields
    ``(r0, r1, q (r, d), t (r, c, d), sel)`` with ``q`` the query rows times their factor and
    ``t`` the candidates' source rows times theirs (inner product: ``scale (t - center)``)."""
    m, c = idx.shape
    rows = max(1, chunk_elements // max(1, c * queries.dim))
    center = targets.frame.center
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        sel = idx[r0:r1]
        safe = sel.clamp(min=0)
        t = targets.source[safe].double()
        if not l2_form(queries.metric) and center is not None:
            t = t - center
        t = t * targets.factor[safe][..., None]
        q = queries.source[r0:r1].double() * queries.factor[r0:r1, None]
        yield r0, r1, q, t, sel


def exact_values(queries: PreparedSide, targets: PreparedSide, idx: torch.Tensor,
                 *, chunk_elements: int = 1 << 24) -> torch.Tensor:
    """float32 ranking values of the (query, idx) pairs, in working units, computed in float64
    from the SOURCE rows (not the rounded working rows): the squared difference
    ``sum((f_q q - f_t t)^2)`` for the l2 form (cosine: of the unit rows), else the dot
    ``sum(f_q q * s (t - center))``. Each scaled coordinate is O(1) (no over- or underflow for
    float32 elements of any size); the float64 sum is rounded once. Empty slots (-1) get NaN.
    """
    m, c = idx.shape
    out = torch.empty((m, c), dtype=torch.float32, device=idx.device)
    for r0, r1, q, t, sel in rerank_rows(queries, targets, idx, chunk_elements):
        if l2_form(queries.metric):
            diff = q[:, None, :] - t
            val = (diff * diff).sum(dim=2)
        else:
            val = (t * q[:, None, :]).sum(dim=2)
        out[r0:r1] = torch.where(sel >= 0, val.to(torch.float32), torch.nan)
    return out


def best_order(values: torch.Tensor, idx: torch.Tensor, k: int, descending: bool) -> torch.Tensor:
    """Columns of each row's ``min(k, columns)`` best entries by (value, index), best first.

    The tie rule of every backend: equal values go to the lower index; empty slots (index
    -1) come last. Shared by the re-rank and by folds of per-block results on the device.
    """
    big = torch.iinfo(torch.int64).max
    # Sort by index first, then stably by value: equal values keep ascending index order.
    by_index, order = torch.sort(torch.where(idx >= 0, idx, big), dim=1)
    vals = torch.gather(values, 1, order)
    key = torch.where(by_index != big, -vals if descending else vals, math.inf)
    _, order2 = torch.sort(key, dim=1, stable=True)
    return torch.gather(order, 1, order2[:, : min(k, idx.shape[1])])


def rank_exact(values: torch.Tensor, idx: torch.Tensor, k: int, descending: bool):
    """Top ``k`` of candidate rows by (value, index): best first, ties to the lower index."""
    m, c = idx.shape
    width = min(k, c)
    top = best_order(values, idx, k, descending)
    worst = -math.inf if descending else math.inf
    out_i = torch.gather(idx, 1, top)
    out_v = torch.gather(values, 1, top)
    empty = out_i < 0
    out_i = torch.where(empty, -1, out_i)
    out_v = torch.where(empty, worst, out_v)
    if width < k:
        out_i = torch.cat([out_i, torch.full((m, k - width), -1, dtype=torch.int64, device=idx.device)], 1)
        out_v = torch.cat([out_v, torch.full((m, k - width), worst, dtype=torch.float32, device=idx.device)], 1)
    return out_v, out_i


def live_width(idx: torch.Tensor) -> torch.Tensor:
    """int32 (m,): per row, the columns up to its last candidate (``idx >= 0``), 0 for a row
    with none. A list's candidates lie in its first columns (lists are sorted, empty slots
    last, and :func:`skip_beyond` empties a suffix of a sorted list), so the re-rank reads
    no column past it (``_triton_rerank.triton_exact_values``)."""
    cols = torch.arange(1, idx.shape[1] + 1, dtype=torch.int32, device=idx.device)
    return torch.where(idx >= 0, cols, 0).amax(dim=1).to(torch.int32)


def rerank(queries: PreparedSide, targets: PreparedSide, keys: torch.Tensor, idx: torch.Tensor,
           bound: torch.Tensor, k: int, values: ValuesFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (values, indices) of each row's k best among its candidates, in two steps.

    The first k columns first: their worst value ``V0`` bounds the final k-th, so columns
    whose keys exceed ``value_limit(V0)`` cannot rank (``_gpu_bound`` notes) and are not read
    (:func:`skip_beyond`; the fused re-rank reads each row only up to its last candidate
    left, :func:`live_width`). No host sync: a search queues its whole round behind the
    candidate pass, and the GPU runs it without waiting for Python between the steps.

    First columns longer than ``LONG_LIST_K`` (k = 1000) are read in target order (sorted by
    index, empty slots last; the ranking sorts the columns again anyway): each row's columns
    then sweep the block from its first rows to its last, and the re-rank's programs, which
    run together, sweep it together, so that their gathers share a window of target rows in
    L2; in key order each gather is a random row of the whole block, which at such k
    outgrows L2 (benchmarks/gpu_notes.md, Large k). Shorter first columns keep key order:
    no gain measured at k = 10 or 100.
    """
    values = values or exact_values
    descending = not l2_form(queries.metric)
    head = min(k, idx.shape[1])
    head_idx = idx[:, :head]
    if head > LONG_LIST_K:
        big = torch.iinfo(torch.int64).max
        by_target = torch.sort(torch.where(head_idx >= 0, head_idx, big), dim=1).values
        head_idx = torch.where(by_target != big, by_target, -1)
    vals = values(queries, targets, head_idx)
    if idx.shape[1] > head:
        filled = head_idx >= 0
        worst = math.inf if not descending else -math.inf
        v0 = torch.where(filled, vals, worst)
        v0 = v0.min(dim=1).values if descending else v0.max(dim=1).values
        rest = skip_beyond(keys[:, head:], idx[:, head:], value_limit(v0, bound, queries))
        vals = torch.cat([vals, values(queries, targets, rest)], dim=1)
        head_idx = torch.cat([head_idx, rest], dim=1)
    return rank_exact(vals, head_idx, k, descending)


def final_values(values: torch.Tensor, queries: PreparedSide) -> torch.Tensor:
    """The user's float32 values from working ranking values (module notes): l2
    ``sqrt(W) / s``, sqeuclidean ``W / s^2``, cosine ``1 - W / (2 s^2)``, inner product
    ``W / (f_q s) + q . center``; in float64, so that +-inf appears only where the true value
    exceeds float32's range. Empty slots (+inf for the l2 form, -inf else) become the
    metric's worst value."""
    return _user_values64(values.double(), queries).to(torch.float32)


def _user_values64(w: torch.Tensor, queries: PreparedSide) -> torch.Tensor:
    """:func:`final_values` in float64, before the one rounding to float32."""
    metric = queries.metric
    s = queries.frame.scale
    if metric == "l2":
        return torch.sqrt(torch.clamp(w, min=0.0)) / s
    if metric == "sqeuclidean":
        return torch.clamp(w, min=0.0) / s / s
    if metric == "cosine":
        return 1.0 - torch.clamp(w, min=0.0) / s / s / 2.0
    out = w / queries.factor[:, None] / s
    if queries.offset is not None:
        out = out + queries.offset[:, None]
    return out


# ----------------------------------------------------------------------------- distance caps
def pair_values64(queries: PreparedSide, targets: PreparedSide, idx: torch.Tensor,
                  chunk_elements: int = 1 << 24) -> torch.Tensor:
    """float64 values (the metric's units) of the (query, idx) pairs from the source rows, as
    the float64 oracle computes them: the difference form (l2 family; cosine of the float64
    unit rows) through :func:`rerank_rows`, the plain dot ``q . t`` for inner product (no
    shift: integer rows give integer values). NaN where idx < 0. What a cap decides by."""
    m, c = idx.shape
    out = torch.full((m, c), math.nan, dtype=torch.float64, device=idx.device)
    if m == 0 or c == 0:
        return out
    if l2_form(queries.metric):
        for r0, r1, q, t, sel in rerank_rows(queries, targets, idx, chunk_elements):
            diff = q[:, None, :] - t
            w = (diff * diff).sum(dim=2)
            out[r0:r1] = torch.where(sel >= 0, _user_values64(w, queries), math.nan)  # (no per-row terms)
        return out
    rows = max(1, chunk_elements // max(1, c * queries.dim))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        sel = idx[r0:r1]
        t = targets.source[sel.clamp(min=0)].double()
        dot = (t * queries.source[r0:r1].double()[:, None, :]).sum(dim=2)
        out[r0:r1] = torch.where(sel >= 0, dot, math.nan)
    return out


def beyond_cap(values64: torch.Tensor, cap: float, metric: str) -> torch.Tensor:
    """Where float64 values are beyond the cap, which is inclusive (``_common.within_cap``:
    a distance ``<= cap`` or a similarity ``>= cap`` is within; NaN, an empty slot, is not)."""
    return ~(values64 >= cap if is_similarity(metric) else values64 <= cap)


def drop_beyond_cap(queries: PreparedSide, targets: PreparedSide, values: torch.Tensor,
                    idx: torch.Tensor, cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (index -1, the metric's worst value) every returned pair beyond ``cap`` by its
    float64 value (:func:`pair_values64`), the kept ones first in their order: the padding of
    short rows the cpu backend uses (``_common.drop_beyond_cap``). :func:`exact_topk` has
    already emptied the candidates beyond the cap before ranking them; this is the contract's
    last step for every row, whatever searched it."""
    if cap is None:
        return values, idx
    metric = queries.metric
    beyond = beyond_cap(pair_values64(queries, targets, idx), cap, metric)
    order = torch.sort(beyond.to(torch.int8), dim=1, stable=True).indices
    beyond = torch.gather(beyond, 1, order)
    worst = -math.inf if is_similarity(metric) else math.inf
    values = torch.where(beyond, worst, torch.gather(values, 1, order))
    idx = torch.where(beyond, -1, torch.gather(idx, 1, order))
    return values, idx
