"""The compilation of a search's first kernels on threads, while its blocks are prepared.

:func:`compile_ahead` (``gpu.compile_first_pass``) predicts from a search's shape the kernels
it launches first, with the configurations and arguments its launches will have: the
candidate kernel (``_triton_plan``, ``_triton_candidates``), the threshold filter
(``_triton_filter``) and the re-rank (``_triton_rerank``); it compiles them on threads
(``_triton_compile.AHEAD``), which those launches wait for. The top of the Triton modules:
it imports the launchers.
"""
from __future__ import annotations

import math

import torch
import triton

from ._gpu_prepare import key_alpha, l2_form
from ._triton_candidate_kernels import FILTER_LANES, filter_kernel
from ._triton_candidates import candidate_launch
from ._triton_compile import AHEAD, load_refusal
from ._triton_filter import (
    FILTER_TILES,
    filter_arguments,
    filter_cap,
    filter_slots,
    filter_splits,
    hits_head_kernel,
    hits_rest_kernel,
    hits_warps,
)
from ._triton_plan import MAX_CANDIDATES, device_limits, plan_candidates, search_tiles, target_descriptor
from ._triton_rerank import rerank_arguments, rerank_kernel


def compile_ahead(m: int, nt: int, d: int, n_cand: int | None, precision: str, metric: str, lower: bool,
                  device: torch.device, sources: tuple = (torch.float32, torch.float32),
                  filter_cand: int | None = None) -> bool:
    """Compile, on threads, the kernels a search of ``m`` x ``nt`` rows at ``d`` launches
    first: the candidate kernel for ``n_cand`` candidates (None: the torch path makes them;
    its sample pass and widening rounds run the same kernel), the configuration
    :func:`triton_candidates` would pick, with the same tiles (:func:`search_tiles`), plans
    and arguments; and the re-rank (:func:`triton_exact_values`) of query and target rows
    of the dtypes ``sources``; ``filter_cand``: the first pass is the threshold filter
    (:func:`filter_candidates`) of a list of that width: its kernel too (the candidate kernel
    then runs its sample pass and the widening rounds; a list longer than the register
    lists' has no candidate kernel, ``n_cand`` None). On one-row tensors of the operands'
    dtypes: sizes are not specialised, dtypes, alignment and the dimension are. Once per shape and process; True
    when it started. CUDA only."""
    if device.type != "cuda" or min(m, nt, d) < 1:
        return False
    key = (str(device), m, nt, d, n_cand, precision, metric, lower, filter_cand)

    def rerank():
        torch.cuda.set_device(device)
        one = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in (
            ("q", (1, d), sources[0]), ("t", (1, d), sources[1]), ("qf", (1,), torch.float64),
            ("tf", (1,), torch.float64), ("center", (d,), torch.float64), ("idx", (1, 1), torch.int64),
            ("width", (1,), torch.int32), ("out", (1, 1), torch.float32))}
        grid, args, kwargs = rerank_arguments(one["q"], one["t"], one["qf"], one["tf"], one["center"],
                                              one["idx"], one["width"], one["out"], metric)
        load_refusal(rerank_kernel, grid, args, kwargs, device)

    started = AHEAD.start((str(device), d, l2_form(metric), sources), rerank)

    def work():
        torch.cuda.set_device(device)   # the thread's current device: the launch's cache
        limits = device_limits(device)
        config = search_tiles(m, nt, d, n_cand, precision, limits)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        q_op = torch.empty((1, d), dtype=dtype, device=device)
        t_op = torch.empty((1, d), dtype=dtype, device=device)
        bias = torch.empty(16, dtype=torch.float32, device=device)
        level = torch.zeros(1, dtype=torch.int32, device=device)
        seed = torch.full((1,), math.inf, dtype=torch.float32, device=device)
        for plan in plan_candidates(m, nt, d, n_cand, precision, limits, config=config):
            t_arg = target_descriptor(t_op, plan.config.block_n, plan.block_d) if plan.t_desc else t_op
            kernel, grid, args, kwargs, _ = candidate_launch(
                plan, q_op, t_arg, t_op, bias, level if lower else bias, seed, m, nt, d,
                key_alpha(metric), 16 if lower else 0, lower=lower, precision=precision,
                upcast=False, out_rows=1)
            if load_refusal(kernel, grid, args, kwargs, device) is None:
                return

    def filter_work():
        torch.cuda.set_device(device)
        limits = device_limits(device)
        q_op = torch.empty((1, d), dtype=torch.bfloat16, device=device)
        t_op = torch.empty((1, d), dtype=torch.bfloat16, device=device)
        bias = torch.empty(16, dtype=torch.float32, device=device)
        level = torch.zeros(1, dtype=torch.int32, device=device)
        thr = torch.empty(1, dtype=torch.float32, device=device)
        count = torch.empty(1, dtype=torch.int32, device=device)
        buf = torch.empty(1, dtype=torch.int64, device=device)
        splits = filter_splits(m, nt, FILTER_TILES, limits.sms)
        grid, args, kwargs = filter_arguments(
            q_op, t_op, bias, level if lower else bias, thr, count, buf, m, nt, d, key_alpha(metric),
            16 if lower else 0, filter_slots(filter_cap(filter_cand), splits), splits, lower=lower, upcast=False)
        load_refusal(filter_kernel, grid, args, kwargs, device)

    def long_work():
        # A long list ranks its hits itself: the head and rest kernels and the packed re-rank.
        torch.cuda.set_device(device)
        splits = filter_splits(m, nt, FILTER_TILES, device_limits(device).sms)
        slots = filter_slots(filter_cap(filter_cand), splits)
        row_slots = splits * FILTER_LANES * slots
        block_w = triton.next_power_of_2(row_slots)
        one = {name: torch.empty(1, dtype=dtype, device=device) for name, dtype in (
            ("buf", torch.int64), ("count", torch.int32), ("head", torch.int64), ("kth", torch.int64),
            ("limit", torch.float32), ("rest_n", torch.int32))}
        shape = {"BLOCK_W": block_w, "num_warps": hits_warps(block_w)}   # (k and widths: not specialised)
        load_refusal(hits_head_kernel, (1,), (one["buf"], one["count"], one["head"], one["kth"], row_slots,
                                              splits * FILTER_LANES, slots, filter_cand), shape, device)
        load_refusal(hits_rest_kernel, (1,), (one["buf"], one["count"], one["kth"], one["limit"], one["head"],
                                              one["rest_n"], row_slots, splits * FILTER_LANES, slots,
                                              filter_cand, filter_cand), shape, device)
        rows = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in (
            ("q", (1, d), sources[0]), ("t", (1, d), sources[1]), ("qf", (1,), torch.float64),
            ("tf", (1,), torch.float64), ("center", (d,), torch.float64), ("idx", (1, 1), torch.int64),
            ("width", (1,), torch.int32), ("out", (1, 1), torch.int64))}
        grid, args, kwargs = rerank_arguments(rows["q"], rows["t"], rows["qf"], rows["tf"], rows["center"],
                                              rows["idx"], rows["width"], rows["out"], metric,
                                              packed=True)
        load_refusal(rerank_kernel, grid, args, kwargs, device)

    if filter_cand is not None:
        started = AHEAD.start(key + ("filter",), filter_work) or started
        if filter_cand > MAX_CANDIDATES:
            started = AHEAD.start(key + ("long",), long_work) or started
    if n_cand is None or n_cand < 1:
        return started
    return AHEAD.start(key, work) or started
