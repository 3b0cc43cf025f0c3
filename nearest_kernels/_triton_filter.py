"""The threshold-filter first pass on the host: thresholds, buffers, launches, selection.

Where ``gpu.filter_refusal`` accepts (bf16, d >= 256, compute capability 9.x) the first pass
is instead a threshold filter (:func:`filter_candidates`: per-row thresholds from a sample,
one pass appending every key below them to a per-row buffer, no list in registers).
Its kernel is ``_triton_candidate_kernels.filter_kernel``; the thresholds come from a sample
pass of the register-list kernel (:func:`filter_threshold`), and :func:`filter_select` turns
a pass's buffers into the lists, indices and floor of ``triton_candidates``' contract.

Lists longer than the register lists' (``MAX_CANDIDATES``: k above ``_gpu_bound.LONG_LIST_K``,
whose first bf16 list holds about 2k) take the filter too, up to :data:`LONG_FILTER_MAX`: the
torch generator's ``topk`` of such a list over every target tile was most of their search
(benchmarks/gpu_notes.md, Large k). Their thresholds are the j-th of the torch generator's
keys over the sample (a sixteenth of the block; ``kthvalue``, no list), and no list is
selected: the pass ranks each row's hits where they lie (:func:`long_list_topk`: the k-th key
by bisection, the head and the rest within its limit re-ranked as packed (value, index)
entries, one sort), and returns the round's results (``_gpu_search.Ranked``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._gpu_bound import lower_bias_table, lower_levels
from ._gpu_prepare import PreparedSide, key_alpha
from ._gpu_search import Ranked, torch_kth_keys
from ._triton_candidate_kernels import EMPTY, FILTER_LANES, MAX_TARGETS, filter_kernel, unpack, unpack_key
from ._triton_candidates import kernel_buffer, triton_candidates
from ._triton_compile import AHEAD, load_refusal
from ._triton_plan import (
    BLOCK_N,
    MAX_CANDIDATES,
    SEG_CAND,
    SEGMENT_MIN_TILES,
    LaunchRefused,
    TileConfig,
    device_limits,
    plan_candidates,
)


_EMPTY = tl.constexpr(EMPTY)


@dataclass(frozen=True)
class FilterTiles:
    """The filter pass's launch shape: 128 x 256 tiles (two 64 x 256 wgmma warpgroups: the
    m64n256 product reads its operands from shared memory half as often per product as
    128 x 128 tiles, and with no list beside it the accumulator fits), d in 64-wide chunks,
    three chunk pairs in flight ((128 + 256) x 64 x 2 bytes each in bf16)."""

    block_m: int = 128
    block_n: int = 256
    block_d: int = 64
    num_warps: int = 8
    num_stages: int = 3


FILTER_TILES = FilterTiles()


# The longest first list the filter makes (``gpu.filter_refusal``): two register lists' worth,
# the list of k up to 2 ``LONG_LIST_K``. Longer lists run the torch path.
LONG_FILTER_MAX = 2 * MAX_CANDIDATES


def filter_sample(n_cand: int) -> tuple[int, int]:
    """(step, j) of the filter's thresholds for a first list of ``n_cand``: each row's j-th
    key over every step-th target, so that about ``step x j`` targets of the block pass it.
    Every 32nd target: at j = 5 for lists up to 64 (k up to about 32: about 160 hits a row,
    five times a list of 32, so the list's floor is mostly its own 32nd key; a row with
    fewer hits keeps the threshold as its floor, still far above its k-th key), at j = 20
    beyond (k = 100's list of 512: about 640 hits). The sample pass costs 1 / step of the
    block's product (every 16th target cost the short lists' search more in that pass than
    the wider spread of their hits costs the filter) and the selection reads more the more
    hits: the fastest pairs measured, with the appends of the time (an atomic per hit;
    benchmarks/gpu_notes.md). Lists longer than ``MAX_CANDIDATES`` (about 2k at k above
    ``LONG_LIST_K``): every 16th target at j = 9 n_cand / 128 (144 for 2048: about 1.125
    n_cand hits, so most rows cut their list at n_cand and its floor is the first key cut
    off, as the torch generator's list of n_cand; the sample's spread, about 16 sqrt(j) hits
    a standard deviation, leaves the fewest hits of a block's rows well above k + the
    bound's margin, where a row's floor is its threshold)."""
    if n_cand > MAX_CANDIDATES:
        return 16, 9 * n_cand // 128
    return (32, 5) if n_cand <= 64 else (32, 20)


def filter_cap(n_cand: int) -> int:
    """Buffer slots per row for :func:`filter_sample`'s thresholds: a row's hits are about
    ``step x j`` and its spread follows the sample's j-th order statistic (about
    ``step sqrt(j)`` hits a standard deviation): 1.25 step j + 6 step sqrt(j) + 64, up to a
    power of two (1024 for lists up to 64, 2048 up to ``MAX_CANDIDATES``, 4096 for a long
    list of 2048). A row past it overflows: its floor is -inf and the widening rounds search
    it (exact, slower)."""
    step, j = filter_sample(n_cand)
    return 1 << math.ceil(math.log2(1.25 * step * j + 6 * step * math.sqrt(j) + 64))


# Least positions of a buffer slice (many splits: few query rows, a small buffer).
FILTER_MIN_SLOTS = 8


def filter_slots(cap: int, splits: int) -> int:
    """Positions per slice of a row's filter buffer (``splits x FILTER_LANES`` slices,
    ``filter_kernel``): an equal share of ``cap``, at least ``FILTER_MIN_SLOTS``. A slice's
    hits are about its share of the row's, whose spread ``cap`` already covers; a row with
    a slice past it overflows (its floor is -inf and the widening rounds search it)."""
    return max(FILTER_MIN_SLOTS, cap // (splits * FILTER_LANES))


# The filter's sample must fill the segmented lists of its pass (n_cand up to 32 over at least
# 2 x SEGMENT_MIN_TILES tiles of every segment), else its pass would compile another kernel.
FILTER_MIN_SAMPLE = 4 * SEGMENT_MIN_TILES * BLOCK_N


# A long list's sample (torch's ``topk`` of j over it, no segments) holds at least this many
# times j rows: its j-th key then stands for a share of the block, not for a few targets.
LONG_MIN_SAMPLE_J = 8


def filter_sample_rows(nt: int, n_cand: int) -> int:
    """Rows of the sample the filter's thresholds take over ``nt`` targets (every step-th),
    0 where the sample would be too small for its pass (a long list's: for its j,
    ``LONG_MIN_SAMPLE_J``)."""
    step, j = filter_sample(n_cand)
    rows = -(-nt // step)
    least = LONG_MIN_SAMPLE_J * j if n_cand > MAX_CANDIDATES else FILTER_MIN_SAMPLE
    return rows if rows >= least else 0


def filter_splits(m: int, nt: int, tiles: FilterTiles, sms: int) -> int:
    """Target splits of the filter pass: two (the measured shape at 65,536 queries), more
    where the queries alone give fewer programs than two waves."""
    q_tiles = max(1, math.ceil(m / tiles.block_m))
    return max(1, min(max(2, math.ceil(2 * sms / q_tiles)), math.ceil(nt / tiles.block_n)))


def filter_arguments(q_chunk, t_op, bias, level, thr, count, buf, rows: int, nt: int, d: int, alpha: float,
                     stride_level: int, slots: int, splits: int, *, lower: bool, upcast: bool,
                     tiles: FilterTiles = FILTER_TILES):
    """(grid, args, kwargs) of one ``filter_kernel`` launch over ``rows`` query rows, ``slots``
    positions per buffer slice (``buf`` rows of ``splits x FILTER_LANES x slots``)."""
    if not upcast and tiles.block_m != 16 * tiles.num_warps:
        # the PTX appends keep one counter per row of a thread: one 16-row band per warp
        raise ValueError(f"filter tiles: BLOCK_M {tiles.block_m} must be 16 x num_warps ({tiles.num_warps})")
    q_desc = TensorDescriptor.from_tensor(q_chunk, [tiles.block_m, tiles.block_d])
    t_desc = TensorDescriptor.from_tensor(t_op, [tiles.block_n, tiles.block_d])
    grid = (math.ceil(rows / tiles.block_m), splits)
    row_slots = splits * FILTER_LANES * slots
    args = (q_desc, t_desc, bias, level, thr, count, buf, rows, nt, d, alpha, stride_level, row_slots, slots)
    kwargs = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d,
                  APPEND_PTX=not upcast, LEVELS=lower, DOT_UPCAST=upcast,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return grid, args, kwargs


def filter_threshold(queries: PreparedSide, targets: PreparedSide, n_cand: int, config: TileConfig | None,
                     *, lower: bool = False, buffer_bytes: int = 1 << 30) -> torch.Tensor | None:
    """Each row's threshold for a filter pass of ``n_cand`` (:func:`filter_sample`): its j-th
    key over every step-th target, by the search's compiled candidate kernel ``config`` (as
    :func:`sample_seed`: the sample's own prepared rows, kept in the block's cache; lower keys
    at the first pass's levels); for a list longer than ``MAX_CANDIDATES`` (plain keys, no
    register-list kernel in the search: ``config`` unread) by the torch generator's keys over
    the sample (``_gpu_search.torch_kth_keys``: chunked ``addmm``, ``kthvalue``). None where
    the sample is too small or its pass would not run the segmented kernel. Any threshold is
    exact (the floor follows it); this one is only what makes the filter's hits few and
    still more than the list."""
    step, j = filter_sample(n_cand)
    if not filter_sample_rows(targets.rows, n_cand):
        return None
    long_list = n_cand > MAX_CANDIDATES
    if not long_list:
        width = max(SEG_CAND, triton.next_power_of_2(j))
        plans = plan_candidates(queries.rows, filter_sample_rows(targets.rows, n_cand), queries.dim, width,
                                queries.precision, device_limits(queries.exact.device), config=config)
        if not plans or not plans[0].segmented:
            return None
    sample = targets.cache.get(("sample", step))
    if sample is None:
        sample = targets.take(torch.arange(0, targets.rows, step, device=targets.exact.device))
        targets.cache[("sample", step)] = sample
    if long_list:
        return torch_kth_keys(queries, sample, j, lower=lower)
    rank1 = {"rank1": queries.cache["rank1"]} if "rank1" in queries.cache else {}
    rows_view = dataclasses.replace(queries, cache=rank1)
    keys = triton_candidates(rows_view, sample, width, config=config, lower=lower,
                             levels=lower_levels(n_cand), buffer_bytes=buffer_bytes)[0]
    return keys[:, j - 1].contiguous()


def filter_select(count: torch.Tensor, buf: torch.Tensor, threshold: torch.Tensor, n_cand: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, indices, floor) of a filter pass's rows from their counters and buffers.

    ``count`` (rows, slices): the hits of each slice of a row's buffer, whose position ``p``
    of slice ``i`` is ``buf[row, p * slices + i]`` (``filter_kernel``). A row whose hits fit
    its list: all of them, floor just above its threshold (every key not appended exceeds
    it). More hits than ``n_cand``: the n_cand best, floor the lesser of that and the first
    key cut off. A slice with more hits than its positions (overflow): the n_cand best of
    those stored, floor -inf (not proven: ``_gpu_search.exact_topk`` widens it).

    One host sync (the largest count: only the positions below it are read) and a ``topk``
    in packed order (key, then the lower index). A long list's pass ranks its hits instead
    (:func:`long_list_topk`)."""
    rows, slices = count.shape
    slots = buf.shape[1] // slices
    deep = min(slots, max(1, int(count.max())))
    width = deep * slices
    live = torch.arange(deep, device=buf.device)[None, :, None] < count[:, None, :]
    part = torch.where(live, buf.view(rows, slots, slices)[:, :deep], EMPTY).view(rows, width)
    if width > n_cand:
        top = torch.topk(part, n_cand + 1, dim=1, largest=False, sorted=True).values
        lists, cut = top[:, :n_cand], unpack(top[:, n_cand])[0]
    else:
        lists = torch.sort(part, dim=1).values
        if width < n_cand:
            lists = torch.cat([lists, torch.full((rows, n_cand - width), EMPTY, dtype=lists.dtype,
                                                 device=lists.device)], dim=1)
        cut = torch.full((rows,), math.inf, dtype=torch.float32, device=buf.device)
    keys, idx = unpack(lists)
    above = torch.nextafter(threshold, torch.full_like(threshold, math.inf))
    floor = torch.where((count > slots).any(dim=1), -math.inf, torch.minimum(above, cut))
    return keys, idx, floor


@triton.jit
def _hits(buf_ptr, count_ptr, row, row_slots, slices, slots, BLOCK_W: tl.constexpr):
    """A row's filter buffer (``filter_kernel``'s layout) in registers: which positions hold
    a hit (below their slice's counter and its room), the hits' packed entries (EMPTY
    elsewhere) and their key words (the entries' high halves: int32 in the keys' order)."""
    pos = tl.arange(0, BLOCK_W)
    inside = pos < row_slots
    cnt = tl.load(count_ptr + row * slices + pos % slices, mask=inside, other=0)
    depth = pos // slices
    live = inside & (depth < cnt) & (depth < slots)
    entry = tl.load(buf_ptr + row * row_slots + pos, mask=live, other=_EMPTY)
    return live, entry, (entry >> 32).to(tl.int32)


@triton.jit
def _head_of(live, word, kth, k):
    """The head of a row's hits for its k-th key word ``kth``: every hit below it, then the
    hits at it in position order up to k in all."""
    below = live & (word.to(tl.int64) < kth)
    tie = live & (word.to(tl.int64) == kth)
    quota = k - tl.sum(below.to(tl.int32), axis=0)
    return below | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= quota))


@triton.jit(do_not_specialize=["row_slots", "slices", "slots", "k"])
def hits_head_kernel(buf_ptr, count_ptr, head_ptr, kth_ptr, row_slots, slices, slots, k,
                     BLOCK_W: tl.constexpr):
    """Per row (one program): the k hits of least key (all of them where it has fewer), their
    target indices packed into the row of ``head`` (k columns, position order; the caller
    fills it with -1), and the k-th key word (``kth``, int64; 2^31 - 1 where the row has
    fewer than k hits). The k-th word by bisection over the int32 words: 32 counts of the
    row's hits at or below a midpoint, no sort."""
    row = tl.program_id(0).to(tl.int64)
    live, entry, word = _hits(buf_ptr, count_ptr, row, row_slots, slices, slots, BLOCK_W)
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(32):   # the least word with at least k hits at or below it
        mid = (lo + hi) >> 1
        enough = tl.sum((live & (word.to(tl.int64) <= mid)).to(tl.int32), axis=0) >= k
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    head = _head_of(live, word, lo, k)
    at = tl.cumsum(head.to(tl.int32), axis=0) - 1
    tl.store(head_ptr + row * k + at, entry & 0xFFFFFFFF, mask=head)
    tl.store(kth_ptr + row, lo)


@triton.jit(do_not_specialize=["row_slots", "slices", "slots", "k", "width"])
def hits_rest_kernel(buf_ptr, count_ptr, kth_ptr, limit_ptr, rest_ptr, rest_n_ptr, row_slots, slices, slots, k,
                     width, BLOCK_W: tl.constexpr):
    """Per row (one program): the hits outside its head (:func:`hits_head_kernel`'s, from its
    k-th word) whose key is at most ``limit[row]``, their target indices packed into the row
    of ``rest`` (``width`` columns, position order; the caller fills it with -1), and how
    many there are (``rest_n``: more than ``width`` means some were left out)."""
    row = tl.program_id(0).to(tl.int64)
    live, entry, word = _hits(buf_ptr, count_ptr, row, row_slots, slices, slots, BLOCK_W)
    head = _head_of(live, word, tl.load(kth_ptr + row), k)
    rest = live & ~head & (unpack_key(entry) <= tl.load(limit_ptr + row))
    at = tl.cumsum(rest.to(tl.int32), axis=0) - 1
    tl.store(rest_ptr + row * width + at, entry & 0xFFFFFFFF, mask=rest & (at < width))
    tl.store(rest_n_ptr + row, tl.sum(rest.to(tl.int32), axis=0))


def hits_warps(block_w: int) -> int:
    """Warps of the head and rest kernels' programs (one row of ``block_w`` positions each):
    about 1,024 positions a warp, at least 4 (a row of many thin slices, few query rows
    beside many targets, can reach 16,384 positions)."""
    return min(32, max(4, block_w // 1024))


def long_rest_width(k: int) -> int:
    """Columns of a long list's rest (:func:`long_list_topk`): the hits past the head within
    its limit, about those whose keys lie within the bound of the k-th (a few hundred at
    k = 1000, more where a group of identical rows straddles the k-th place). ``next_pow2(k)``:
    the head and the rest still fit the one sort of 2048 entries a row that k alone needs;
    a row with more is not proven by the pass and widens."""
    return max(64, triton.next_power_of_2(k))


def long_list_topk(queries: PreparedSide, targets: PreparedSide, count: torch.Tensor, buf: torch.Tensor,
                   threshold: torch.Tensor, k: int, bound: torch.Tensor, cap: float | None = None,
                   cap_limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, indices, floor) of a long list's filter pass (rows of ``count``, ``buf``,
    ``threshold`` as :func:`filter_select` reads them): the rows' exact top k among their
    hits, ranked by (value, index) as ``_gpu_rerank.rerank`` ranks a list, and the floor of
    the hits (every target not among them has a key above the threshold; -inf where a slice
    overflowed or the rest did not fit).

    No list of keys is selected or sorted: the head (the k hits of least key,
    :func:`hits_head_kernel`) is re-ranked first, its worst value ``V0`` bounds the k-th
    (``_gpu_bound`` notes), and only the hits within ``value_limit(V0)`` (under a cap also
    within ``cap_limit``) are re-ranked after it (:func:`hits_rest_kernel`), in buffer order:
    each slice's hits arrive in target order, so the re-rank's gathers sweep the block
    together. The values are ``_triton_rerank.triton_ranked_entries``' (the re-rank's values,
    packed above their indices), so one sort of a row's entries ranks it. With a ``cap``,
    pairs beyond it by their float64 values are left out before the ranking, and a head
    holding such a pair bounds nothing (its rest is every hit within ``cap_limit``)."""
    from ._gpu_bound import value_limit
    from ._gpu_prepare import l2_form
    from ._gpu_rerank import beyond_cap, pair_values64
    from ._triton_rerank import entry_values, triton_ranked_entries

    rows, slices = count.shape
    row_slots = buf.shape[1]
    slots = row_slots // slices
    device = buf.device
    descending = not l2_form(queries.metric)
    block_w = triton.next_power_of_2(row_slots)
    head = torch.full((rows, k), -1, dtype=torch.int64, device=device)
    kth = torch.empty(rows, dtype=torch.int64, device=device)
    hits_head_kernel[(rows,)](buf, count, head, kth, row_slots, slices, slots, k, BLOCK_W=block_w,
                              num_warps=hits_warps(block_w))
    worst = -math.inf if descending else math.inf
    head_e = triton_ranked_entries(queries, targets, head)
    # Where a row has fewer than k hits its head bounds nothing: V0 is the worst value.
    bounded = entry_values(head_e, queries.metric)[0]
    if cap is not None:
        beyond = (head >= 0) & beyond_cap(pair_values64(queries, targets, head), cap, queries.metric)
        bounded = torch.where(beyond.any(dim=1, keepdim=True), worst, bounded)
        head_e = torch.where(beyond, EMPTY, head_e)
    v0 = bounded.min(dim=1).values if descending else bounded.max(dim=1).values
    limit = value_limit(v0, bound, queries)
    if cap_limit is not None:
        limit = torch.minimum(limit, cap_limit)
    width = long_rest_width(k)
    rest = torch.full((rows, width), -1, dtype=torch.int64, device=device)
    rest_n = torch.empty(rows, dtype=torch.int32, device=device)
    hits_rest_kernel[(rows,)](buf, count, kth, limit.contiguous(), rest, rest_n, row_slots, slices, slots, k, width,
                              BLOCK_W=block_w, num_warps=hits_warps(block_w))
    if cap is not None:
        rest = torch.where(beyond_cap(pair_values64(queries, targets, rest), cap, queries.metric), -1, rest)
    entries = torch.cat([head_e, triton_ranked_entries(queries, targets, rest)], dim=1)
    v, i = entry_values(torch.sort(entries, dim=1).values[:, :k], queries.metric)
    above = torch.nextafter(threshold, torch.full_like(threshold, math.inf))
    floor = torch.where((count > slots).any(dim=1) | (rest_n > width), -math.inf, above)
    return v, i, floor


def filter_candidates(queries: PreparedSide, targets: PreparedSide, n_cand: int, threshold: torch.Tensor,
                      *, lower: bool = False, levels: int | None = None, buffer_bytes: int = 1 << 30,
                      tiles: FilterTiles = FILTER_TILES, cap: int | None = None, splits: int | None = None,
                      slots: int | None = None, ranked=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first candidate pass by threshold filter: :func:`triton_candidates`'s contract.

    Returns keys float32 (m, n_cand) ascending (+inf empty), indices int64 (-1 empty) and
    ``floor`` (m,): every target not in a row's list has approximate key >= floor
    (:func:`filter_select`; -inf for a row that overflowed its buffer, which the proof
    never accepts). The keys are the candidate kernels' keys of the same operands
    (``lower``: lower keys from :func:`_gpu_bound.lower_bias_table` at ``levels``, default
    ``lower_levels(n_cand)``). ``threshold`` float32 (m,), usually :func:`filter_threshold`;
    any value is exact. ``cap``: buffer slots per row (default :func:`filter_cap`), in slices of
    ``slots`` positions (default :func:`filter_slots`); rows run in chunks whose int64 buffer
    fits ``buffer_bytes``; each chunk is one pass over the block. ``tiles``, ``splits`` and
    ``slots`` are for tests with tiny blocks. CUDA needs compute
    capability 9.x (TMA, the inline PTX); the interpreter runs the atomic form.
    :class:`LaunchRefused` when the compiled kernel does not load.

    ``ranked`` (a long list's pass): each chunk's hits are ranked instead of selected,
    ``ranked(r0, r1, count, buf, threshold[r0:r1]) -> (values, indices, floor)`` for rows r0:r1
    (:func:`long_list_topk` with the search's k, bound and values), and the pass returns
    those, rows in order, as ``_gpu_search.Ranked``.
    """
    m, nt, d = queries.rows, targets.rows, queries.dim
    device = queries.exact.device
    if nt > MAX_TARGETS:
        raise ValueError(f"targets: at most {MAX_TARGETS} rows per block, got {nt}")
    cap = cap or filter_cap(n_cand)
    keys_out = torch.full((m, n_cand), math.inf, dtype=torch.float32, device=device)
    idx_out = torch.full((m, n_cand), -1, dtype=torch.int64, device=device)
    floor_out = torch.full((m,), math.inf, dtype=torch.float32, device=device)
    if m == 0 or nt == 0:
        return keys_out, idx_out, floor_out
    upcast = device.type != "cuda"
    alpha = key_alpha(queries.metric)
    if lower:
        table, level_all = lower_bias_table(queries, targets, tiles.block_m, levels or lower_levels(n_cand))
    threshold = torch.nan_to_num(threshold.to(torch.float32), nan=-math.inf).contiguous()
    rows_per_launch = max(tiles.block_m, buffer_bytes // (8 * cap) // tiles.block_m * tiles.block_m)
    n_splits = splits or filter_splits(min(m, rows_per_launch), nt, tiles, device_limits(device).sms)
    slots = slots or filter_slots(cap, n_splits)
    slices = n_splits * FILTER_LANES
    rows_per_launch = max(tiles.block_m, buffer_bytes // (8 * slices * slots) // tiles.block_m * tiles.block_m)
    for r0 in range(0, m, rows_per_launch):
        r1 = min(m, r0 + rows_per_launch)
        rows = r1 - r0
        if lower:   # rows_per_launch is a multiple of block_m: programs stay aligned
            bias, level, stride_level = table, level_all[r0 // tiles.block_m:], table.stride(0)
        else:
            bias, level, stride_level = targets.bias, targets.bias, 0   # level unread without LEVELS
        count = torch.zeros((rows, slices), dtype=torch.int32, device=device)
        buf = kernel_buffer((rows, slices * slots), torch.int64, device)
        grid, args, kwargs = filter_arguments(
            queries.operand[r0:r1], targets.operand, bias, level, threshold[r0:r1], count, buf, rows, nt, d,
            alpha, stride_level, slots, n_splits, lower=lower, upcast=upcast, tiles=tiles)
        if r0 == 0:
            AHEAD.wait()
            refusal = load_refusal(filter_kernel, grid, args, kwargs, device)
            if refusal is not None:
                raise LaunchRefused(f"filter kernel: {refusal}")
        filter_kernel[grid](*args, **kwargs)
        if ranked is None:
            keys_out[r0:r1], idx_out[r0:r1], floor_out[r0:r1] = filter_select(count, buf, threshold[r0:r1], n_cand)
            continue
        got = ranked(r0, r1, count, buf, threshold[r0:r1])
        if rows == m:
            return Ranked(*got)
        if r0 == 0:
            ranked_out = [torch.empty((m,) + part.shape[1:], dtype=part.dtype, device=device) for part in got]
        for out, part in zip(ranked_out, got):
            out[r0:r1] = part
    return Ranked(*ranked_out) if ranked is not None else (keys_out, idx_out, floor_out)
