"""The register-list candidate pass on the host: launches of ``rowlist_kernel``, their lists.

:func:`triton_candidates` is the fused candidate generator of ``_gpu_search.exact_topk``
(``gpu.search_prepared`` passes it): it takes the first launch configuration of
``_triton_plan`` that the device loads, runs the kernel of ``_triton_candidate_kernels`` over
the queries in chunks and merges the segments' or splits' lists into each row's candidates
and floor. Long first lists can start from a sample pass's seeds (:func:`sample_seed`).
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

from ._gpu_bound import lower_bias_table, lower_levels
from ._gpu_prepare import PreparedSide, key_alpha
from ._triton_candidate_kernels import MAX_TARGETS, VIRTUAL_INDEX, floor_key, merge_segments, rowlist_kernel, unpack
from ._triton_compile import AHEAD, load_refusal
from ._triton_plan import (
    MAX_CANDIDATES,
    SKIP_TEST_SHARE,
    CandidatePlan,
    LaunchRefused,
    TileConfig,
    device_limits,
    plan_candidates,
    skip_share,
    target_descriptor,
)

logger = logging.getLogger(__name__)


def rowlist_arguments(plan: CandidatePlan, q_chunk, t_arg, t_op, bias, out, seed_chunk, level,
                      rows: int, nt: int, d: int, alpha: float, stride_level: int, *,
                      skip_test: bool, lower: bool, precision: str, upcast: bool):
    """(grid, args, kwargs) of one ``rowlist_kernel`` launch of ``plan``; ``seed_chunk``
    float32 (rows,), +inf where a row has no seed. ``t_arg``: the target operand ``t_op`` or
    its descriptor (:func:`target_descriptor`); with d in chunks the query chunks then go by
    descriptor too (both or neither)."""
    cfg = plan.config
    grid = (math.ceil(rows / cfg.block_m), plan.n_splits)
    q_arg = q_chunk
    if t_arg is not t_op and not plan.single_dot:
        q_arg = target_descriptor(q_chunk, cfg.block_m, plan.block_d)
        if q_arg is q_chunk:
            t_arg = t_op
    args = (q_arg, t_arg, bias, out, seed_chunk, level, rows, nt, d,
            plan.per_split // cfg.block_n, q_chunk.stride(0), t_op.stride(0), alpha, stride_level)
    kwargs = dict(N_CAND=plan.list_len, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=plan.block_d,
                  EXTRA_PASSES=cfg.extra_passes, SINGLE_DOT=plan.single_dot,
                  INPUT_PRECISION="ieee" if precision == "fp32" else "tf32", DOT_UPCAST=upcast,
                  EVEN_D=d % plan.block_d == 0, STRIDED=plan.segmented, SKIP_TEST=skip_test,
                  LEVELS=lower, T_DESC=t_arg is not t_op,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return grid, args, kwargs


def skip_test_of(plan: CandidatePlan, nt: int) -> bool:
    """Whether a register-list launch of ``plan`` over ``nt`` targets takes the row-minimum
    test (``SKIP_TEST``): the config's choice, else by :func:`skip_share` of its programs' tiles."""
    cfg = plan.config
    if cfg.skip_test is not None:
        return cfg.skip_test
    program_tiles = (math.ceil(math.ceil(nt / cfg.block_n) / plan.n_splits) if plan.segmented
                     else plan.per_split // cfg.block_n)
    return skip_share(program_tiles, cfg.block_m, plan.list_len) >= SKIP_TEST_SHARE


def candidate_launch(plan: CandidatePlan, q_chunk, t_arg, t_op, bias, level, seed_chunk,
                     rows: int, nt: int, d: int, alpha: float, stride_level: int, *, lower: bool,
                     precision: str, upcast: bool, out_rows: int | None = None):
    """(kernel, grid, args, kwargs, output) of one candidate-kernel launch of ``plan`` over
    ``rows`` query rows: the register lists' output (rows, splits x list), allocated here for
    ``out_rows`` rows (default ``rows``: :func:`compile_ahead` compiles on one-row tensors,
    which specialise alike)."""
    alloc = rows if out_rows is None else out_rows
    out = kernel_buffer((alloc, plan.n_splits * plan.list_len), torch.int64, q_chunk.device)
    grid, args, kwargs = rowlist_arguments(
        plan, q_chunk, t_arg, t_op, bias, out, seed_chunk, level, rows, nt, d, alpha, stride_level,
        skip_test=skip_test_of(plan, nt), lower=lower, precision=precision, upcast=upcast)
    return rowlist_kernel, grid, args, kwargs, out


def kernel_buffer(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised output or scratch buffer of a candidate kernel, which writes every
    slot it reads back (the tests fill these with garbage to check it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def triton_candidates(queries: PreparedSide, targets: PreparedSide, n_cand: int,
                      *, config: TileConfig | None = None, splits: int | None = None,
                      buffer_bytes: int = 1 << 30,
                      seed: torch.Tensor | None = None, lower: bool = False,
                      levels: int | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``n_cand`` best approximate keys per query from the fused kernel, and a floor.

    Returns keys float32 (m, n_cand) ascending (+inf empty), indices int64 (-1 empty), ties
    resolved to the lower index, and ``floor`` float32 (m,): every target not in a row's list
    has approximate key >= floor (the contract of :func:`_gpu_search.exact_topk`).

    One register list per row (``"rowlist"``) holds each row's n_cand best: floor is the last
    key, or +inf when the list holds every target. The segmented mode (``config.kernel ==
    "segmented"``, the default above ``ROWLIST_MAX``) runs the register-list kernel with
    ``seg_cand``-long lists over ``S`` target segments (:func:`segment_count`; segment s
    holds tiles s, s + S, ..., so that neighbours stored together spread over the segments)
    and returns the n_cand best of the union of their lists with the floor of
    :func:`merge_segments`; the list may then miss some of the row's n_cand best, but never
    one below the floor, which is what the margin test needs. Memory traffic against one
    long list: the target tiles are read as often as before (once per query tile); each
    segment program loads its query tile once and stores rows x S x seg_cand int64, which
    the merge reads back. The cost is list work: S lists that each start empty take
    ~S * seg_cand * (1 + ln(targets per segment / seg_cand)) insertions per row against
    ~n_cand * (1 + ln(nt / n_cand)) for one list.
    The union (2 n_cand wide) is cut to n_cand: the re-rank gathers one d-vector per column,
    the cut keeps the floor valid, and a row that the cut leaves unproven needed more than
    n_cand candidates within its margin, more than ``candidate_width`` plans for. Where the
    targets are too few for enough segments one register list runs instead, up to
    ``ROWLIST_MAX`` entries (:func:`plan_candidates`; longer lists: :class:`LaunchRefused`).

    The launch configuration is the first of :func:`plan_candidates` (shared memory within
    the device's limit by estimate) whose compiled kernel the device can load (:func:`load_refusal`);
    :class:`LaunchRefused` when none can (the caller then runs the torch path).

    ``splits`` forces the number of target splits (segments in the segmented mode).
    ``buffer_bytes`` bounds the lists' output: queries run in chunks that fit it.
    ``seed`` (float32 (m,), +inf = none): keys above a row's seed cannot matter to the caller
    (the widening rounds of :func:`_gpu_search.exact_topk`); the register-list kernels then
    never insert them and the row's floor is at most just above its seed (:func:`floor_key`).
    ``lower``: the keys are lower keys (EXACT mode's per-target bound): each program reads
    its row of ``_gpu_bound.lower_bias_table`` as the bias; no other work per key.
    ``levels``: that table's levels (default ``_gpu_bound.lower_levels(n_cand)``).
    """
    if n_cand & (n_cand - 1) or n_cand > MAX_CANDIDATES:
        raise ValueError(f"n_cand: expected a power of two <= {MAX_CANDIDATES}, got {n_cand}")
    m, nt, d = queries.rows, targets.rows, queries.dim
    device = queries.exact.device
    if nt > MAX_TARGETS:
        raise ValueError(f"targets: at most {MAX_TARGETS} rows per block, got {nt}")
    keys_out = torch.full((m, n_cand), math.inf, dtype=torch.float32, device=device)
    idx_out = torch.full((m, n_cand), -1, dtype=torch.int64, device=device)
    floor_out = torch.full((m,), math.inf, dtype=torch.float32, device=device)
    if m == 0 or nt == 0:
        return keys_out, idx_out, floor_out
    precision = queries.precision
    limits = device_limits(device)
    plans = plan_candidates(m, nt, d, n_cand, precision, limits, config=config, splits=splits)
    if not plans:
        raise LaunchRefused(f"no fused-kernel configuration for n_cand={n_cand} at d={d} in "
                            f"{precision} fits {limits.shared_bytes} bytes of shared memory ({limits.name})")
    q_op, t_op = queries.operand, targets.operand
    alpha = key_alpha(queries.metric)
    upcast = device.type != "cuda"
    seeded = seed is not None
    n_levels = levels or lower_levels(n_cand)
    if lower:   # one table for every row of the call: the bound's rank-1 form (lower_key_bound)
        table, levels = lower_bias_table(queries, targets, plans[0].config.block_m, n_levels)
    refusals = []
    for plan in plans:
        cfg = plan.config
        if lower and cfg.block_m != plans[0].config.block_m:   # the table's levels are per program
            table, levels = lower_bias_table(queries, targets, cfg.block_m, n_levels)
        segmented, list_len = plan.segmented, plan.list_len
        rows_per_launch = max(cfg.block_m,
                              (buffer_bytes // (8 * list_len * plan.n_splits)) // cfg.block_m * cfg.block_m)
        t_arg = target_descriptor(t_op, cfg.block_n, plan.block_d) if plan.t_desc else t_op
        launched = False
        for r0 in range(0, m, rows_per_launch):
            r1 = min(m, r0 + rows_per_launch)
            rows = r1 - r0
            q_chunk = q_op[r0:r1]
            if lower:   # rows_per_launch is a multiple of block_m: programs stay aligned
                bias, level, stride_level = table, levels[r0 // cfg.block_m:], table.stride(0)
            else:
                bias, level, stride_level = targets.bias, targets.bias, 0   # level unread without LEVELS
            seed_chunk = (torch.nan_to_num(seed[r0:r1].to(torch.float32), nan=math.inf).contiguous()
                          if seeded else torch.full((rows,), math.inf, device=device))
            kernel, grid, args, kwargs, lists = candidate_launch(
                plan, q_chunk, t_arg, t_op, bias, level, seed_chunk, rows, nt, d, alpha,
                stride_level, lower=lower, precision=precision, upcast=upcast)
            if not launched:
                AHEAD.wait()   # a compilation of this search's first pass started ahead
                refusal = load_refusal(kernel, grid, args, kwargs, device)
                if refusal is not None:
                    refusals.append(f"{cfg} block_d={plan.block_d} single_dot={plan.single_dot}: {refusal}")
                    logger.info("fused kernel configuration refused by the device, trying the next: %s",
                                refusals[-1])
                    break
                launched = True
            kernel[grid](*args, **kwargs)
            if segmented:
                lists, floor = merge_segments(lists, plan.n_splits, n_cand)
                floor_out[r0:r1] = floor
            elif plan.n_splits > 1:
                # Merge the splits' lists: sorting packed keys sorts by (key, index).
                lists = torch.topk(lists, n_cand, dim=1, largest=False, sorted=True).values
            else:  # register lists come back unsorted
                lists = torch.sort(lists, dim=1).values
            k_vals, k_idx = unpack(lists)
            if seeded:   # placeholders of seeded lists: empty slots
                virtual = k_idx == VIRTUAL_INDEX
                k_vals = torch.where(virtual, math.inf, k_vals)
                k_idx = torch.where(virtual, -1, k_idx)
            width = lists.shape[1]
            keys_out[r0:r1, :width] = k_vals
            idx_out[r0:r1, :width] = k_idx
            if not segmented and (nt > n_cand or seeded):
                # The list's n_cand best: the last key (just above a seed's placeholder).
                floor_out[r0:r1] = floor_key(lists[:, -1])
        if launched:
            return keys_out, idx_out, floor_out
    raise LaunchRefused("no fused-kernel configuration loads on this device: " + "; ".join(refusals))


# The sample pass of a long first list (:func:`sample_seed`) keeps lists of this length.
SAMPLE_LIST = 32


def sample_rows(nt: int, n_cand: int) -> int:
    """Rows of the sample :func:`sample_seed` takes for a first list of ``n_cand`` over ``nt``
    targets (every ``n_cand / SAMPLE_LIST``-th), 0 where it takes none."""
    step = n_cand // SAMPLE_LIST
    return 0 if step < 2 or nt < step * SAMPLE_LIST * 2 else -(-nt // step)


def sample_seed(queries: PreparedSide, targets: PreparedSide, n_cand: int, config: TileConfig,
                *, lower: bool = False, buffer_bytes: int = 1 << 30) -> torch.Tensor | None:
    """Seeds for an unseeded first pass of ``n_cand`` candidates: each row's ``SAMPLE_LIST``-th
    key over every ``n_cand / SAMPLE_LIST``-th target, about its ``n_cand``-th key over the
    block (None where the sample would be too small to say).

    A long list that starts empty spends its pass inserting: every segment's list takes most
    of the targets of its first tiles (an argmin pass each), and most rows keep inserting to the
    end. Seeded, a list keeps only keys at most its seed, so the pass costs little more than
    its product; the sample pass reads a ``SAMPLE_LIST / n_cand`` share of the block. Any seed
    is exact (a seeded list's floor never exceeds its seed, :func:`floor_key`): where the
    sample's key lies below a row's n_cand-th, the row holds fewer candidates, and if it is
    then not proven it widens like any other. None too where the pass has no launch
    configuration (too few targets for its segments: the torch path runs it). The sample (its own prepared rows, contiguous)
    is kept in the target block's cache; the pass runs ``config``, the search's compiled
    kernel, with the rows' lower keys over the sample at the first pass's levels (a bias
    table of its own: the rows' table cache is not shared, ``lower_bias_table``), so its keys
    are the first pass's keys of the same targets.
    """
    step = n_cand // SAMPLE_LIST
    if not sample_rows(targets.rows, n_cand):
        return None
    if not plan_candidates(queries.rows, targets.rows, queries.dim, n_cand, queries.precision,
                           device_limits(queries.exact.device), config=config):
        return None   # the pass itself cannot run (LaunchRefused): nothing to compile for it
    sample = targets.cache.get(("sample", step))
    if sample is None:
        rows = torch.arange(0, targets.rows, step, device=targets.exact.device)
        sample = targets.take(rows)
        targets.cache[("sample", step)] = sample
    rank1 = {"rank1": queries.cache["rank1"]} if "rank1" in queries.cache else {}
    rows_view = dataclasses.replace(queries, cache=rank1)
    keys = triton_candidates(rows_view, sample, SAMPLE_LIST, config=config, lower=lower,
                             levels=lower_levels(n_cand), buffer_bytes=buffer_bytes)[0]
    return keys[:, -1]
