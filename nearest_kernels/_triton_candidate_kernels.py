"""The candidate pass's Triton kernels: tiled dot products folded into per-query lists on chip.

Device code, with the packed (key, index) format both kernels write and its reading on the
host (:func:`unpack`, :func:`floor_key`, :func:`merge_segments`). The register-list kernel
(``rowlist_kernel``) is launched by ``_triton_candidates``, the threshold filter
(``filter_kernel``) by ``_triton_filter``; their launch configurations are ``_triton_plan``'s.

The candidate kernel, ``rowlist_kernel``, keeps each query's list in registers (see its
docstring) in the packed (key, index) format, one list per row or, in the *segmented* mode,
one per row and target segment (``_triton_plan``).

One program owns ``BLOCK_M`` queries and a contiguous range of targets (the whole block, or
one split of it when there are few queries). For each ``BLOCK_N``-target tile it computes
the ``BLOCK_M x BLOCK_N`` dot products with ``tl.dot`` (IEEE float32 FMA, tf32 or bf16 tensor
cores), turns them into keys ``bias_t - alpha * dot`` (smaller is better, see
``_gpu_prepare.key_alpha``) and never writes the tile to memory:

* **Threshold test.** Each query keeps ``thr``, the ``n_cand``-th best key known so far.
  One row minimum per tile and one compare per query reject the tile when no key beats its
  row's threshold; this is the common case once the lists have filled (the number of
  insertions per query grows only with ``n_cand * log(nt / n_cand)``).
* **Survivors** (keys below ``thr``) are packed with their target index into one int64
  (order-preserving float bits << 32 | index: sorting the int64 sorts by key, then by the
  lower index, the tie rule) and inserted into the query's register list, replacing its
  worst entry (see ``rowlist_kernel`` for how a tile with several survivors is taken).

Memory traffic per program: the target tiles (shared through L2 by the programs that scan
them at the same time; read by TMA where the operand allows, ``_triton_plan.target_descriptor``)
and one query tile per d-chunk; the lists are stored once at the end. Splits of the target range
produce ``n_splits`` lists per query; the host merges them by sorting the packed keys (same
tie rule as :func:`nearest_kernels.merge_topk`).

The threshold filter (``filter_kernel``, the first pass where ``gpu.filter_refusal`` accepts)
keeps no list: it appends every key below a per-row threshold to a per-row buffer (see its
docstring).

Everything here also runs under ``TRITON_INTERPRET=1`` on CPU tensors (the tests).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._triton_plan import SEG_CAND

# Packed "no candidate": key +inf (0x7F800000) and index 0x7FFFFFFF; sorts after every real one.
EMPTY = 0x7F8000007FFFFFFF
_EMPTY = tl.constexpr(EMPTY)
# Index of a seeded list's placeholder entries (seed key, this index): no real target has it.
VIRTUAL_INDEX = 0x7FFFFFFF
_VIRTUAL = tl.constexpr(VIRTUAL_INDEX)
MAX_TARGETS = (1 << 31) - 1   # indices are packed as non-negative int32
# Register lists up to this long take every tile where a row has several survivors by argmin
# passes, one per survivor up to the list's length, in a loop: the bitonic top-k that longer
# lists take past ``extra_passes`` survivors was most of the kernel's compile time.
LOOP_CAND = SEG_CAND
_LOOP_CAND = tl.constexpr(LOOP_CAND)


@triton.jit
def pack(key, index):
    # Order-preserving int32 image of the float (negatives flipped), then the index below it.
    bits = key.to(tl.int32, bitcast=True)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | index.to(tl.int64)


@triton.jit
def unpack_key(packed):
    mono = (packed >> 32).to(tl.int32)
    bits = mono ^ ((mono >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------- register-list kernel
@triton.jit
def _query_tile(q_ptr, nq, d, stride_q, m0, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT_UPCAST: tl.constexpr, EVEN_D: tl.constexpr):
    """The program's whole query tile (BLOCK_D >= d), loaded once for every target tile."""
    a_blk = tl.make_block_ptr(q_ptr, (nq, d), (stride_q, 1), (m0, 0), (BLOCK_M, BLOCK_D), (1, 0))
    if EVEN_D:
        a = tl.load(a_blk, boundary_check=(0,), padding_option="zero")
    else:
        a = tl.load(a_blk, boundary_check=(0, 1), padding_option="zero")
    if DOT_UPCAST:  # the interpreter's tl.dot misreads bf16; the upcast is exact
        a = a.to(tl.float32)
    return a


@triton.jit
def _tile_keys(q, q_ptr, t_ptr, bias_ptr, nq, nt, d, stride_q, stride_t, alpha, m0, n0,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               SINGLE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
               EVEN_D: tl.constexpr, T_DESC: tl.constexpr = False):
    """Keys ``bias_t - alpha * q.t`` of one BLOCK_M x BLOCK_N tile (+inf past the end).

    SINGLE_DOT: ``q`` is the whole query tile and one ``tl.dot`` covers d: the target loop then
    has no inner loop and the pipeliner prefetches the next target tiles. Else d is consumed
    in BLOCK_D chunks (large d; that inner loop is what gets pipelined).
    EVEN_D (BLOCK_D divides d): no bounds check along d, so that the rows load as 16-byte vectors
    (cp.async needs at least 4 bytes per copy: a per-element mask on 2-byte bf16 kept the
    pipeliner from prefetching at all).
    """
    cols = n0 + tl.arange(0, BLOCK_N)
    if T_DESC:
        # t_ptr is a (nt, d) tensor descriptor with (BLOCK_N, BLOCK_D) blocks: one TMA copy
        # per tile, zero-filled past the end, issued by one thread; the pointer tile below
        # costs each thread ~14 instructions of address and bounds arithmetic per 16-byte
        # copy, half of a tile's instructions on the path without survivors (sm_90 SASS).
        b = tl.trans(t_ptr.load([n0, 0]))
        if DOT_UPCAST:
            b = b.to(tl.float32)
        acc = tl.dot(q, b, input_precision=INPUT_PRECISION)
    elif SINGLE_DOT:
        b_blk = tl.make_block_ptr(t_ptr, (d, nt), (1, stride_t), (0, n0), (BLOCK_D, BLOCK_N), (0, 1))
        if EVEN_D:
            b = tl.load(b_blk, boundary_check=(1,), padding_option="zero")
        else:
            b = tl.load(b_blk, boundary_check=(0, 1), padding_option="zero")
        if DOT_UPCAST:
            b = b.to(tl.float32)
        acc = tl.dot(q, b, input_precision=INPUT_PRECISION)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, d, BLOCK_D):
            # Block pointers (_chunk_operands): the compiler addresses the tiles itself instead
            # of holding a 64-bit pointer per element in registers (those spilled once).
            a, b = _chunk_operands(q_ptr, t_ptr, nq, nt, d, stride_q, stride_t, m0, n0, d0,
                                   BLOCK_M, BLOCK_N, BLOCK_D, DOT_UPCAST, EVEN_D, False)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    # bias = +inf past the end: those keys are +inf and never become candidates.
    bias = tl.load(bias_ptr + cols, mask=cols < nt, other=float("inf"))
    # One FMA per key. alpha is 1 or 2 (key_alpha), so alpha * acc is exact and this equals
    # bias - alpha * acc rounded once, as the torch path computes it.
    return tl.fma(acc, -alpha, bias[None, :])


@triton.jit
def _row_argmin(key, row_min, BLOCK_N: tl.constexpr):
    """Column of each row's minimum ``row_min``, ties to the lower column (the lower index):
    a compare, a select and a min per key, against seven ops for a min with indices."""
    offs_n = tl.arange(0, BLOCK_N)
    return tl.min(tl.where(key == row_min[:, None], offs_n[None, :], BLOCK_N), axis=1)


@triton.jit
def _insert(best, worst, worst_slot, key, index, N_CAND: tl.constexpr):
    """Per row: put (key, index) in place of the row's worst entry if it is better.

    ``best`` (BLOCK_M, N_CAND) packed, unsorted; ``worst`` its row maxima and ``worst_slot``
    their columns, carried from the previous insert so that each insert costs one reduction
    over the list (the new maximum), not two. +inf keys (past the end of the targets) never
    enter. Real entries are distinct (distinct indices), so only EMPTY slots tie for the
    maximum, and any one of them is the right slot to fill.
    """
    cand = tl.where(key < float("inf"), pack(key, index), _EMPTY)
    take = cand < worst
    hit = take[:, None] & (tl.arange(0, N_CAND)[None, :] == worst_slot[:, None])
    best = tl.where(hit, cand[:, None], best)
    worst, worst_slot = tl.max(best, axis=1, return_indices=True)
    return best, worst, worst_slot


@triton.jit
def _argmin_passes(key, best, worst, worst_slot, n0, passes, N_CAND: tl.constexpr, BLOCK_N: tl.constexpr):
    """``passes`` rounds of: insert each row's least remaining key of the tile (its column
    then masked out). A loop, not unrolled: one copy of the pass in the compiled kernel."""
    offs_n = tl.arange(0, BLOCK_N)
    rest = key
    for _ in range(0, passes):
        low_key = tl.min(rest, axis=1)
        col = _row_argmin(rest, low_key, BLOCK_N)
        best, worst, worst_slot = _insert(best, worst, worst_slot, low_key, n0 + col, N_CAND)
        rest = tl.where(offs_n[None, :] == col[:, None], float("inf"), rest)
    return best, worst, worst_slot


@triton.jit
def _list_update(key, best, worst, worst_slot, n0, N_CAND: tl.constexpr, BLOCK_N: tl.constexpr,
                 EXTRA_PASSES: tl.constexpr, SKIP_TEST: tl.constexpr):
    """One target tile's keys (BLOCK_M, BLOCK_N), first column ``n0``, folded into the
    register lists ``best`` (see :func:`rowlist_kernel` for the paths)."""
    offs_n = tl.arange(0, BLOCK_N)
    BLOCK_M: tl.constexpr = key.shape[0]
    PASSES: tl.constexpr = max(2, 1 + EXTRA_PASSES)   # longer lists: argmin passes before the top-k
    row_min = tl.min(key, axis=1)
    thr = unpack_key(worst)
    if SKIP_TEST:
        reached = tl.max((row_min <= thr).to(tl.int32), axis=0) > 0
    else:
        reached = True
    if reached:
        # Survivors counted against the key alone (ties at the threshold included):
        # a superset of the entries that beat ``worst``; only the path choice uses it.
        most = tl.max(tl.sum((key <= thr[:, None]).to(tl.int32), axis=1), axis=0)
    else:
        most = 0
    if most == 1:
        col = _row_argmin(key, row_min, BLOCK_N)
        best, worst, worst_slot = _insert(best, worst, worst_slot, row_min, n0 + col, N_CAND)
    elif most > 1:
        if N_CAND <= _LOOP_CAND:
            # A row's best N_CAND of the tile are all its list can take from it.
            best, worst, worst_slot = _argmin_passes(key, best, worst, worst_slot, n0,
                                                     tl.minimum(most, N_CAND), N_CAND, BLOCK_N)
        elif most <= PASSES:
            best, worst, worst_slot = _argmin_passes(key, best, worst, worst_slot, n0, most,
                                                     N_CAND, BLOCK_N)
        else:
            cols = n0 + offs_n
            packed = tl.where(key < float("inf"),
                              pack(key, cols[None, :] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)),
                              _EMPTY)
            # topk keeps the largest: complement (an order-reversing bijection on int64).
            tile_best = ~tl.topk(~packed, N_CAND)
            both = tl.reshape(tl.join(best, tile_best), [BLOCK_M, 2 * N_CAND])
            best = ~tl.topk(~both, N_CAND)
            worst, worst_slot = tl.max(best, axis=1, return_indices=True)
    return best, worst, worst_slot


@triton.jit
def _chunk_operands(q_ptr, t_ptr, nq, nt, d, stride_q, stride_t, m0, n0, d0,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_UPCAST: tl.constexpr, EVEN_D: tl.constexpr, T_DESC: tl.constexpr):
    """The (BLOCK_M, BLOCK_D) query chunk and (BLOCK_D, BLOCK_N) target chunk at (m0, n0, d0),
    zero past the ends: by TMA (``T_DESC``: both pointers are tensor descriptors, one copy
    per chunk) or block pointers."""
    if T_DESC:
        a = q_ptr.load([m0, d0])
        b = tl.trans(t_ptr.load([n0, d0]))
    else:
        a_blk = tl.make_block_ptr(q_ptr, (nq, d), (stride_q, 1), (m0, d0), (BLOCK_M, BLOCK_D), (1, 0))
        b_blk = tl.make_block_ptr(t_ptr, (d, nt), (1, stride_t), (d0, n0), (BLOCK_D, BLOCK_N), (0, 1))
        if EVEN_D:
            a = tl.load(a_blk, boundary_check=(0,), padding_option="zero")
            b = tl.load(b_blk, boundary_check=(1,), padding_option="zero")
        else:
            a = tl.load(a_blk, boundary_check=(0, 1), padding_option="zero")
            b = tl.load(b_blk, boundary_check=(0, 1), padding_option="zero")
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit(do_not_specialize=["nq", "nt", "tiles_per_split"])
def rowlist_kernel(
    q_ptr, t_ptr, bias_ptr, out_ptr, seed_ptr, level_ptr,
    nq, nt, d, tiles_per_split, stride_q, stride_t, alpha, stride_level,
    N_CAND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EXTRA_PASSES: tl.constexpr, SINGLE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, EVEN_D: tl.constexpr = False,
    STRIDED: tl.constexpr = False, SKIP_TEST: tl.constexpr = True,
    LEVELS: tl.constexpr = False, T_DESC: tl.constexpr = False,
):
    """Short lists (n_cand <= ROWLIST_MAX, or one segment's list in the segmented mode):
    each query's n_cand best of the program's target range live in registers.

    ``best`` holds the exact n_cand best (key, index) of the targets scanned so far, so the
    threshold (its row maximum ``worst``) is always the current n_cand-th best and survivors
    are as rare as they can be: about n_cand * BLOCK_N / (targets scanned) per row and tile.
    Per tile, one row minimum; ``SKIP_TEST``: when no row's minimum reaches its threshold
    (most tiles late in a long scan, see :func:`skip_share`) that is all: one FMA and one
    min per key. Else one survivor count (``key <= threshold``, a superset) picks the path:
    * no row has a survivor: no list work at all;
    * every row has at most one (the steady state): it is the row minimum; insert it (one
      reduction over the list: the slot of the worst entry is carried from the last insert);
    * more (the first tiles, mostly): one argmin pass per survivor of the fullest row, up to
      n_cand (a row's best n_cand of the tile are all its list can take), in a loop
      (:func:`_argmin_passes`); lists longer than ``LOOP_CAND`` take passes only up to
      1 + EXTRA_PASSES survivors (at least 2) and past that the tile's best n_cand by
      bitonic top-k, merged with ``best``.
    No inner loop and no global buffer: the target loop is software-pipelined (target tiles
    prefetched ``num_stages`` ahead) and the only memory traffic is the operand tiles (each
    target tile read once per program, shared through L2) and one (BLOCK_M, N_CAND) store.
    Where d is too large for one dot, the loop runs over (tile, d-chunk) pairs, still no inner
    loop: the pipeliner prefetches across tiles (a nested d loop drained its pipeline at every
    tile), both operands' chunks by TMA where they allow (:func:`_chunk_operands`), the list
    work after each tile's last chunk.
    ``STRIDED`` (segments): split ``s`` of ``n_splits`` scans tiles s, s + n_splits, ... instead
    of a contiguous range (``tiles_per_split`` unused), so that targets stored next to each
    other (a cluster, data sorted by place) spread over the segments at tile granularity
    rather than crowding one segment's short list. The programs running at the same time
    share ``pid_s`` (grid dimension 0 varies fastest) and read the same tiles either way.
    Seeds: each row's list starts full of placeholders (its seed key from ``seed_ptr``,
    index ``VIRTUAL_INDEX``), so the threshold starts at the seed: keys above it never enter
    and, once the row minimum stays above every seed, tiles cost the product and one minimum.
    A placeholder left at the end means every target of the range with key <= seed is in the
    list (none was evicted: the worst entry was a placeholder). A seed of +inf makes the
    placeholder EMPTY (same bits), so an unseeded search passes +inf seeds and runs the same
    compiled kernel as the widening rounds of its width (one compilation, not two).
    ``LEVELS`` (EXACT mode's lower keys): the bias is this program's row ``level_ptr[pid_m]``
    of a table (``_gpu_bound.lower_bias_table``); the product and the keys' one FMA are as
    without.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    if LEVELS:  # rows 16-aligned (stride_level % 16 == 0): the bias loads stay vectorised
        bias_ptr += tl.load(level_ptr + pid_m).to(tl.int64) * stride_level
    n_splits = tl.num_programs(1)
    m0 = pid_m * BLOCK_M
    offs_n = tl.arange(0, BLOCK_N)
    slots = tl.arange(0, N_CAND)
    if STRIDED:
        t_start = pid_s * BLOCK_N
        t_step = n_splits * BLOCK_N
        n_tiles = tl.cdiv(tl.cdiv(nt, BLOCK_N) - pid_s, n_splits)
    else:
        t_start = pid_s * tiles_per_split * BLOCK_N
        t_step = BLOCK_N
        n_tiles = tl.minimum(tiles_per_split, tl.cdiv(nt - t_start, BLOCK_N))
    if SINGLE_DOT:
        q = _query_tile(q_ptr, nq, d, stride_q, m0, BLOCK_M, BLOCK_D, DOT_UPCAST, EVEN_D)
    else:
        q = 0.0
    seed_rows = m0 + tl.arange(0, BLOCK_M)
    seed = tl.load(seed_ptr + seed_rows, mask=seed_rows < nq, other=float("inf"))
    worst = pack(seed, tl.full([BLOCK_M], _VIRTUAL, tl.int32))   # +inf: EMPTY
    best = tl.zeros([BLOCK_M, N_CAND], dtype=tl.int64) + worst[:, None]
    worst_slot = tl.zeros([BLOCK_M], dtype=tl.int32)   # any slot of an all-EMPTY list
    if SINGLE_DOT:
        for tile in range(0, n_tiles):
            n0 = t_start + tile * t_step
            key = _tile_keys(q, q_ptr, t_ptr, bias_ptr, nq, nt, d, stride_q, stride_t, alpha, m0, n0,
                             BLOCK_M, BLOCK_N, BLOCK_D, SINGLE_DOT, INPUT_PRECISION, DOT_UPCAST, EVEN_D,
                             T_DESC)
            best, worst, worst_slot = _list_update(key, best, worst, worst_slot, n0, N_CAND, BLOCK_N,
                                                   EXTRA_PASSES, SKIP_TEST)
    else:
        # d in BLOCK_D chunks, one flat loop over (tile, chunk): the software pipeliner
        # prefetches across target tiles (a nested d loop drains its pipeline every tile),
        # and the list work runs after a tile's last chunk.
        n_chunks = (d + BLOCK_D - 1) // BLOCK_D
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for it in range(0, n_tiles * n_chunks):
            tile = it // n_chunks
            d0 = (it - tile * n_chunks) * BLOCK_D
            n0 = t_start + tile * t_step
            a, b = _chunk_operands(q_ptr, t_ptr, nq, nt, d, stride_q, stride_t, m0, n0, d0,
                                   BLOCK_M, BLOCK_N, BLOCK_D, DOT_UPCAST, EVEN_D, T_DESC)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if d0 + BLOCK_D >= d:
                cols = n0 + offs_n
                bias = tl.load(bias_ptr + cols, mask=cols < nt, other=float("inf"))
                key = tl.fma(acc, -alpha, bias[None, :])
                best, worst, worst_slot = _list_update(key, best, worst, worst_slot, n0, N_CAND,
                                                       BLOCK_N, EXTRA_PASSES, SKIP_TEST)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    rows = m0 + tl.arange(0, BLOCK_M)
    out = out_ptr + rows.to(tl.int64)[:, None] * (n_splits * N_CAND) + pid_s * N_CAND + slots[None, :]
    tl.store(out, best, mask=(rows < nq)[:, None])


# ----------------------------------------------------------------- the packed lists on the host
def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed candidates -> (keys float32, indices int64 with -1 for empty)."""
    mono = (packed >> 32).to(torch.int32)
    bits = mono ^ ((mono >> 31) & 0x7FFFFFFF)
    keys = bits.view(torch.float32)
    index = packed & 0xFFFFFFFF
    empty = packed == EMPTY
    return torch.where(empty, math.inf, keys), torch.where(empty, -1, index)


def floor_key(packed: torch.Tensor) -> torch.Tensor:
    """The least key a target left out of a list ending in ``packed`` can have: the key
    itself, or just above it for a seeded list's placeholder (targets at the seed entered);
    +inf for EMPTY."""
    keys = unpack(packed)[0]
    virtual = ((packed & 0xFFFFFFFF) == VIRTUAL_INDEX) & torch.isfinite(keys)
    return torch.where(virtual, torch.nextafter(keys, torch.full_like(keys, math.inf)), keys)


def merge_segments(lists: torch.Tensor, n_segments: int, n_cand: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of the segments' lists: (its n_cand best, sorted, packed; floor float32).

    ``lists`` (rows, n_segments * seg_cand) packed, each segment's list unsorted, EMPTY in
    unused slots. A segment whose list is full (its maximum is not EMPTY) held back only
    targets whose keys are at least its seg_cand-th key; a list that is not full holds its
    whole segment. Truncating the sorted union to n_cand holds back keys at least the first
    dropped one. So every target outside the result has key >= floor = the least of those.
    """
    rows = lists.shape[0]
    seg_worst = lists.view(rows, n_segments, -1).max(dim=2).values
    floor = floor_key(seg_worst).min(dim=1).values
    width = lists.shape[1]
    merged = torch.topk(lists, min(width, n_cand + 1), dim=1, largest=False, sorted=True).values
    if width > n_cand:
        floor = torch.minimum(floor, floor_key(merged[:, n_cand]))
        merged = merged[:, :n_cand]
    return merged, floor


# ------------------------------------------------------------- threshold-filter first pass
# Slices of a row's buffer per program of the filter pass: one per lane of the quad that holds
# the row in the accumulator's layout (wgmma: each row of a warp's 16 lies in the four lanes
# of one quad, two columns of every eight each), so each slice has one writer.
FILTER_LANES = 4
_FILTER_LANES = tl.constexpr(FILTER_LANES)


def _append_ptx(pack: int) -> str:
    """PTX for the appends of ``pack`` keys of one thread (one ``inline_asm_elementwise``
    invocation of :func:`filter_kernel`). A miss costs a compare (the pack's compares or-ed
    into one predicate) and one branch per pack: nearly every key misses, and a warp whose
    lanes all miss skips the rest. On a hit: the slot is the thread's own counter for the
    key's row (``%fk_c0`` / ``%fk_c1``: registers of the whole kernel, :func:`_filter_init_ptx`,
    one per row of the thread, told apart by ``sel``), which counts on past the slice's
    ``slots``; if the slice has room, the entry (the key's order-preserving bits above the
    index, :func:`pack`'s format) goes to position ``slot * slices + lane`` of the row's
    buffer from ``row`` (the row's slice base of this split). No atomic: nothing waits for a
    slot from memory, and the store is not waited for. Operands, each ``pack`` long in turn:
    out (1 on a hit, unused), key, threshold, row, target index, sel, slots, slices. The
    labels and registers of a PTX {} block are its own, so it can be inlined once per
    invocation."""
    def op(arg, e):
        return f"${(1 + arg) * pack + e}"
    lines = ["{", ".reg .pred %any, %hit, %room, %hi;", ".reg .b32 %slot, %next, %lane, %pos, %bits, %sign;",
             ".reg .b64 %addr, %entry;"]
    lines += [f"mov.b32 ${e}, 0;" for e in range(pack)]
    lines.append(f"setp.le.f32 %any, {op(0, 0)}, {op(1, 0)};")
    lines += [f"setp.le.or.f32 %any, {op(0, e)}, {op(1, e)}, %any;" for e in range(1, pack)]
    lines.append("@!%any bra done;")
    for e in range(pack):
        key, thr, row, index, sel, slots, slices = (op(arg, e) for arg in range(7))
        lines += [f"setp.le.f32 %hit, {key}, {thr};", f"@!%hit bra next{e};", f"mov.b32 ${e}, 1;",
                  f"setp.ne.u32 %hi, {sel}, 0;", "selp.b32 %slot, %fk_c1, %fk_c0, %hi;",
                  "add.u32 %next, %slot, 1;", "selp.b32 %fk_c1, %next, %fk_c1, %hi;",
                  "selp.b32 %fk_c0, %fk_c0, %next, %hi;",
                  f"setp.lt.u32 %room, %slot, {slots};", f"@!%room bra next{e};",
                  "mov.u32 %lane, %laneid;", f"and.b32 %lane, %lane, {FILTER_LANES - 1};",
                  f"mad.lo.u32 %pos, %slot, {slices}, %lane;",
                  f"mov.b32 %bits, {key};", "shr.s32 %sign, %bits, 31;",
                  "and.b32 %sign, %sign, 0x7FFFFFFF;", "xor.b32 %bits, %bits, %sign;",
                  f"mov.b64 %entry, {{{index}, %bits}};", "mul.wide.u32 %addr, %pos, 8;",
                  f"add.s64 %addr, %addr, {row};", "st.global.b64 [%addr], %entry;",
                  f"next{e}:"]
    lines += ["done:", "}"]
    return "\n".join(lines)


def _filter_init_ptx() -> str:
    """PTX declaring the thread's two counters (kernel scope: no {} block) and zeroing them;
    inlined once, before the tile loop. Operands: out, one input (both unused)."""
    return "\n".join([".reg .b32 %fk_c0, %fk_c1;", "mov.b32 %fk_c0, 0;", "mov.b32 %fk_c1, 0;",
                      "mov.b32 $0, 0;"])


def _flush_ptx(pack: int) -> str:
    """PTX storing the thread's counters after the tile loop: for each of the ``pack`` keys
    in the first eight columns (``col``, the column in the tile) of a row below ``nq``
    (``live``), the row's counter (``sel``) to ``count + lane`` (``count``: the row's counters
    of this split). Operands, each ``pack`` long: out (unused), count, col, sel, live."""
    def op(arg, e):
        return f"${(1 + arg) * pack + e}"
    lines = ["{", ".reg .pred %p, %hi;", ".reg .b32 %lane, %value;", ".reg .b64 %addr;",
             "mov.u32 %lane, %laneid;", f"and.b32 %lane, %lane, {FILTER_LANES - 1};"]
    for e in range(pack):
        count, col, sel, live = (op(arg, e) for arg in range(4))
        lines += [f"mov.b32 ${e}, 0;", f"setp.lt.u32 %p, {col}, 8;", f"setp.ne.and.u32 %p, {live}, 0, %p;",
                  f"@!%p bra skip{e};", f"setp.ne.u32 %hi, {sel}, 0;", "selp.b32 %value, %fk_c1, %fk_c0, %hi;",
                  "mul.wide.u32 %addr, %lane, 4;", f"add.s64 %addr, %addr, {count};",
                  "st.global.b32 [%addr], %value;", f"skip{e}:"]
    lines.append("}")
    return "\n".join(lines)


# Keys per append branch of the filter's inline PTX (a faster pass than one per key).
FILTER_PACK = 4
_FILTER_PACK = tl.constexpr(FILTER_PACK)
_APPEND_PTX = tl.constexpr(_append_ptx(FILTER_PACK))
_APPEND_CONSTRAINTS = tl.constexpr("=r," * FILTER_PACK + ("f," * FILTER_PACK) * 2 + ("l," * FILTER_PACK)
                                   + ",".join(["r"] * (4 * FILTER_PACK)))
_INIT_PTX = tl.constexpr(_filter_init_ptx())
_FLUSH_PTX = tl.constexpr(_flush_ptx(FILTER_PACK))
_FLUSH_CONSTRAINTS = tl.constexpr("=r," * FILTER_PACK + ("l," * FILTER_PACK) + ",".join(["r"] * (3 * FILTER_PACK)))


@triton.jit(do_not_specialize=["nq", "nt", "row_slots", "slots"])
def filter_kernel(q_desc, t_desc, bias_ptr, level_ptr, thr_ptr, count_ptr, buf_ptr, nq, nt, d, alpha,
                  stride_level, row_slots, slots, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, APPEND_PTX: tl.constexpr,
                  LEVELS: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Append every key ``<= thr[row]`` of the block to the row's buffer (``row_slots`` slots).

    One program per query tile and target split; split ``s`` of ``S`` scans target tiles
    s, s + S, ... (as the strided segments). d in BLOCK_D chunks, one flat (tile, chunk) loop
    (the software pipeliner prefetches across tiles), both operands by TMA: per step one
    BLOCK_M x BLOCK_D query chunk and one BLOCK_N x BLOCK_D target chunk (the target tiles
    shared through L2 by the programs scanning them together), one ``tl.dot``; after a
    tile's last chunk one FMA per key, ``bias - alpha * dot`` as every candidate kernel
    computes it (``LEVELS``: the program's row of the lower-key bias table, as
    ``rowlist_kernel``), and one compare. Nothing per row lives in registers but the
    threshold and a counter: no list, no reduction per tile.

    A row's buffer is ``S x FILTER_LANES`` interleaved slices (position ``p * slices +
    slice``, ``slots`` positions each): the slice of split ``s`` and lane ``l`` of the quad
    holding the row is ``s * FILTER_LANES + l``. A hit takes the next position of its slice
    and stores one 8-byte packed entry (:func:`pack`'s format) where the slice has room; the
    slice's counter counts on past ``slots``, so the host sees an overflow. The counters go
    to ``count[row, slice]`` at the end. Memory traffic beyond the operands: the hits'
    entries and the counters, nothing per tile.

    ``APPEND_PTX`` (CUDA): the appends are the inline PTX of :func:`_append_ptx`, in the
    accumulator's own layout, one branch per FILTER_PACK keys, each thread's counters in two
    registers of its own (one writer per slice, so no atomic and no wait for a slot; the
    layout must give each row to one quad: BLOCK_M = 16 x num_warps, which
    ``filter_arguments`` checks): ``tl.atomic_add`` and ``tl.store`` on the tile make Triton
    convert the tile to a blocked layout through shared memory, and the 128 x 256 tile then
    spills. Else (the interpreter) the slice is the lane the layout would give the column
    (``(col % 8) // 2``), its counter an atomic in ``count``.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    if LEVELS:  # rows 16-aligned (stride_level % 16 == 0): the bias loads stay vectorised
        bias_ptr += tl.load(level_ptr + pid_m).to(tl.int64) * stride_level
    n_splits = tl.num_programs(1)
    slices = n_splits * _FILTER_LANES
    m0 = pid_m * BLOCK_M
    n_tiles = tl.cdiv(tl.cdiv(nt, BLOCK_N) - pid_s, n_splits)
    n_chunks = (d + BLOCK_D - 1) // BLOCK_D
    offs_n = tl.arange(0, BLOCK_N)
    rows = m0 + tl.arange(0, BLOCK_M)
    # Rows past the end never hit (no key is <= -inf: past the block's end the bias is +inf).
    thr = tl.load(thr_ptr + rows, mask=rows < nq, other=float("-inf"))
    row_base = buf_ptr + rows.to(tl.int64) * row_slots + pid_s * _FILTER_LANES
    count_base = count_ptr + rows.to(tl.int64) * slices + pid_s * _FILTER_LANES
    sel = ((rows % 16) >= 8).to(tl.int32)
    if APPEND_PTX:
        tl.inline_asm_elementwise(_INIT_PTX, "=r,r", [tl.zeros([1], tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(0, n_tiles * n_chunks):
        tile = it // n_chunks
        c = it - tile * n_chunks
        n0 = (pid_s + tile * n_splits) * BLOCK_N
        a = q_desc.load([m0, c * BLOCK_D])
        b = tl.trans(t_desc.load([n0, c * BLOCK_D]))
        if DOT_UPCAST:  # the interpreter's tl.dot misreads bf16; the upcast is exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        if c == n_chunks - 1:
            cols = n0 + offs_n
            bias = tl.load(bias_ptr + cols, mask=cols < nt, other=float("inf"))
            keys = tl.fma(acc, -alpha, bias[None, :])
            if APPEND_PTX:
                args = [keys, thr[:, None], row_base.to(tl.int64)[:, None], cols[None, :], sel[:, None],
                        tl.full([BLOCK_M, BLOCK_N], slots, tl.int32),
                        tl.full([BLOCK_M, BLOCK_N], slices, tl.int32)]
                tl.inline_asm_elementwise(_APPEND_PTX, _APPEND_CONSTRAINTS, args, dtype=tl.int32,
                                          is_pure=False, pack=_FILTER_PACK)
            else:
                hit = keys <= thr[:, None]
                lane = (cols[None, :] % 8) // 2 + tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
                slot = tl.atomic_add(count_base[:, None] + lane, 1, mask=hit, sem="relaxed")
                entry = pack(keys, cols[None, :] + tl.zeros([BLOCK_M, BLOCK_N], tl.int32))
                tl.store(row_base[:, None] + slot * slices + lane, entry, mask=hit & (slot < slots))
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if APPEND_PTX:   # the counters, from the accumulator's layout (the threads that hold them)
        args = [count_base.to(tl.int64)[:, None] + tl.zeros([BLOCK_M, BLOCK_N], tl.int64),
                offs_n[None, :] + acc.to(tl.int32), sel[:, None], (rows < nq).to(tl.int32)[:, None]]
        tl.inline_asm_elementwise(_FLUSH_PTX, _FLUSH_CONSTRAINTS, args, dtype=tl.int32,
                                  is_pure=False, pack=_FILTER_PACK)
