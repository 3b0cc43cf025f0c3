"""The fused Triton kernels: tiled dot products folded into per-query candidate lists on chip.

The candidate kernel, ``_rowlist_kernel``, keeps each query's list in registers (see its
docstring) in the packed (key, index) format. Every list width runs by default in the
*segmented* mode: ``SEG_CAND``-long lists over S target segments, whose union, with a floor
on every key it left out, is the candidate list (see :func:`triton_candidates`: exact because
the margin test uses the floor), so that a search compiles one candidate kernel whatever
widths its rows widen to. :func:`tile_config` picks; one register list of up to
``ROWLIST_MAX`` entries runs where the targets are too few for the segments, and a longer
list there runs the torch path (:func:`plan_candidates`). Long first lists can start from a
sample pass's seeds (:func:`sample_seed`).
Where ``gpu.filter_refusal`` accepts (bf16, d >= 256, compute capability 9.x) the first pass
is instead a threshold filter (:func:`filter_candidates`: per-row thresholds from a sample,
one pass appending every key below them to a per-row buffer, no list in registers).

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
  worst entry (see ``_rowlist_kernel`` for how a tile with several survivors is taken).

Memory traffic per program: the target tiles (shared through L2 by the programs that scan
them at the same time; read by TMA where the operand allows, :func:`target_descriptor`) and
one query tile per d-chunk; the lists are stored once at the end. Splits of the target range
produce ``n_splits`` lists per query; the host merges them by sorting the packed keys (same
tie rule as :func:`nearest_kernels.merge_topk`).

Besides the candidate kernel: the exact re-rank (:func:`triton_exact_values`), a target
block's preparation in three streaming passes (:func:`triton_prepare_targets`, what
``gpu.prepare_targets`` runs on CUDA for every metric but cosine), and the compilation of a
search's first candidate kernel and re-rank on threads while its blocks are prepared
(:func:`compile_ahead`).

Everything here also runs under ``TRITON_INTERPRET=1`` on CPU tensors (the tests).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._gpu_bound import lower_bias_table, lower_levels
from ._gpu_prepare import PreparedSide, key_alpha, l2_form
from ._gpu_rerank import live_width

logger = logging.getLogger(__name__)

BLOCK_N = 128
# d is consumed in chunks of BLOCK_D (one compiled variant for every d > 32).
BLOCK_D = 64
# Packed "no candidate": key +inf (0x7F800000) and index 0x7FFFFFFF; sorts after every real one.
EMPTY = 0x7F8000007FFFFFFF
_EMPTY = tl.constexpr(EMPTY)
# Index of a seeded list's placeholder entries (seed key, this index): no real target has it.
VIRTUAL_INDEX = 0x7FFFFFFF
_VIRTUAL = tl.constexpr(VIRTUAL_INDEX)
MAX_TARGETS = (1 << 31) - 1   # indices are packed as non-negative int32
# Largest candidate list the kernel keeps: the segmented mode merges 2 x n_cand per row on
# the host.
MAX_CANDIDATES = 1024


@dataclass(frozen=True)
class TileConfig:
    """One compiled variant of ``_rowlist_kernel``. ``kernel``: ``"rowlist"`` (one register
    list per row, small n_cand) or ``"segmented"`` (register lists of ``seg_cand`` entries
    over several target segments, long n_cand; see :func:`triton_candidates`).
    ``extra_passes``: the argmin passes before the bitonic top-k (lists longer than
    ``LOOP_CAND``) and ``skip_test`` the row-minimum test (see ``_rowlist_kernel``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 3
    kernel: str = "rowlist"
    extra_passes: int = 3
    seg_cand: int = 0
    skip_test: bool | None = None   # register lists: None = by skip_share (SKIP_TEST_SHARE)
    segments: int = 0               # segmented: at least this many segments (0: segment_count's rule)
    block_d: int = 0                # d-chunk where d does not fit one dot (0: BLOCK_D)


# Lists up to this long live in registers (_rowlist_kernel); longer ones are the union of
# SEG_CAND-long register lists over target segments (or, where that does not suit, the torch
# path: :func:`plan_candidates`).
ROWLIST_MAX = 64
# Segment list length. S x SEG_CAND = 2 n_cand whatever SEG_CAND, and so is the number of
# insertions per row; shorter lists make each insert (a reduction over the list) and each
# merge cheaper: 16 was the fastest of 16, 32 and 64 in bf16 and tf32 (benchmarks/gpu_notes.md).
# The floor keeps the search exact whatever a segment holds back.
SEG_CAND = 16
# Register lists up to this long take every tile where a row has several survivors by argmin
# passes, one per survivor up to the list's length, in a loop: the bitonic top-k that longer
# lists take past ``extra_passes`` survivors was most of the kernel's compile time.
LOOP_CAND = SEG_CAND
_LOOP_CAND = tl.constexpr(LOOP_CAND)
# Each segment scans at least this many target tiles (as split_count). A segment's list
# starts empty: while a row still gains several entries per tile (about the first SEG_CAND
# tiles: ~SEG_CAND / j survivors per row at tile j) its tiles take several argmin passes, so
# segments much shorter than a few SEG_CAND tiles cost mostly insertions.
SEGMENT_MIN_TILES = 8
# One tl.dot per tile (query tile loaded once) when the query tile is at most this large and
# the configuration fits the device's shared memory (:func:`plan_candidates`: fewer target
# tiles in flight, then d in chunks, where it does not).
SINGLE_DOT_BYTES = 64 * 1024
# Register-list kernels read target tiles by TMA (a tensor descriptor) on Hopper and later
# (:func:`has_tma`) where the operand allows it (:func:`target_descriptor`); elsewhere pointer
# tiles (cp.async). The interpreter (CPU tensors) takes the descriptor form like Hopper, and
# the pointer form where the operand's rows are not 16-byte aligned: tests run both.


# bf16 lists longer than 2 SEG_CAND take d in 128-wide chunks from this dimension.
CHUNK128_LONG_MIN_D = 1025


def tile_config(n_cand: int, d: int, precision: str = "bf16") -> TileConfig:
    """Tile shapes by list width and operand size; every width runs the segmented mode, so
    that a search compiles one candidate kernel whatever widths its rows widen to (issue 20:
    each list width was a compilation of several seconds, and widening rows compiled one per
    width they reached). ``SEG_CAND``-long register lists over :func:`segment_count` target
    segments: one segment for a list of up to ``SEG_CAND``, two for up to twice that (as
    many insertions as one list of 32, each a reduction over 16 entries, so cheaper; the
    floor, the lesser segment's 16th key, with the re-ranked margin proved 99.8% of the rows
    at k=10, simulated on Gaussian d=128), twice the width beyond.

    Tiles: 128 x 128 (two wgmma warpgroups of 64 x 128), three target tiles in flight (two for
    4-byte operands); bf16 lists of up to 32 at d <= 128: 64 x 128 tiles, 4 warps, two
    programs per SM (one program's list work overlaps the other's MMAs, which the compiler
    does not do within one program; benchmarks/gpu_notes.md). A search's widening rounds run
    its first pass's tiles (``gpu.search_prepared``), so those too share the kernel.
    :func:`plan_candidates` falls back to one register list where the targets are too few
    for the segments, and to the torch path where that list would be longer than
    ``ROWLIST_MAX``.
    """
    wide = precision != "bf16"
    if not wide and n_cand <= 2 * SEG_CAND and d <= 128:
        return TileConfig(64, BLOCK_N, 4, num_stages=3, kernel="segmented", seg_cand=SEG_CAND)
    # bf16 short lists take d in chunks of 128 where d does not fit one dot: fewer, longer
    # wgmma runs per target tile: faster passes at d = 384 and 1536 (k=10); the long lists of
    # k=100 only above CHUNK128_LONG_MIN_D (slower at d=768, faster at 1536: gpu_notes.md).
    chunk = 2 * BLOCK_D if not wide and (n_cand <= 2 * SEG_CAND or d >= CHUNK128_LONG_MIN_D) else 0
    return TileConfig(128, BLOCK_N, 8, num_stages=2 if wide else 3, kernel="segmented",
                      seg_cand=SEG_CAND, block_d=chunk)


def search_tiles(m: int, nt: int, d: int, n_cand: int, precision: str,
                 limits: "DeviceLimits") -> TileConfig:
    """The tiles of a search's first pass of ``n_cand`` candidates for ``m`` x ``nt`` rows,
    with its row-minimum test (``skip_test``) resolved: its widening rounds pass this config,
    so that every round of the search runs one compiled kernel (the rounds have other row
    counts and segments, which would otherwise choose the test anew)."""
    cfg = tile_config(n_cand, d, precision)
    n_seg = segment_count(m, nt, n_cand, cfg, limits.sms)
    if n_seg:
        program_tiles = math.ceil(math.ceil(nt / cfg.block_n) / n_seg)
        cfg = dataclasses.replace(
            cfg, skip_test=skip_share(program_tiles, cfg.block_m, cfg.seg_cand) >= SKIP_TEST_SHARE)
    return cfg


@triton.jit
def _pack(key, index):
    # Order-preserving int32 image of the float (negatives flipped), then the index below it.
    bits = key.to(tl.int32, bitcast=True)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | index.to(tl.int64)


@triton.jit
def _unpack_key(packed):
    mono = (packed >> 32).to(tl.int32)
    bits = mono ^ ((mono >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


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
    cand = tl.where(key < float("inf"), _pack(key, index), _EMPTY)
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
    register lists ``best`` (see :func:`_rowlist_kernel` for the paths)."""
    offs_n = tl.arange(0, BLOCK_N)
    BLOCK_M: tl.constexpr = key.shape[0]
    PASSES: tl.constexpr = max(2, 1 + EXTRA_PASSES)   # longer lists: argmin passes before the top-k
    row_min = tl.min(key, axis=1)
    thr = _unpack_key(worst)
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
                              _pack(key, cols[None, :] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)),
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
def _rowlist_kernel(
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
    worst = _pack(seed, tl.full([BLOCK_M], _VIRTUAL, tl.int32))   # +inf: EMPTY
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


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def split_count(nq: int, nt: int, block_m: int, num_sms: int) -> int:
    """Target splits: enough programs for two waves when the queries alone give fewer."""
    q_tiles = max(1, math.ceil(nq / block_m))
    wanted = math.ceil(2 * num_sms / q_tiles)
    most = max(1, math.ceil(nt / (BLOCK_N * 8)))   # keep >= 8 tiles per split
    return max(1, min(wanted, most))


def _split_targets(nt: int, n_splits: int, block_n: int) -> tuple[int, int]:
    """(splits, targets per split): whole tiles per split, no empty split."""
    per_split = math.ceil(math.ceil(nt / n_splits) / block_n) * block_n
    return math.ceil(nt / per_split), per_split


def segment_count(nq: int, nt: int, n_cand: int, config: TileConfig, num_sms: int) -> int:
    """Target segments for the segmented mode, or 0 where it does not suit.

    Lists up to ``2 seg_cand``: just enough segments to hold them (one, or two for 32
    candidates: the re-ranked margin proves nearly every row from them). Longer lists: enough
    that the segments hold twice the candidates (``S * seg_cand >= 2 * n_cand``: the best
    n_cand of a row then rarely crowd more than ``seg_cand`` into one segment, which would
    lower the floor and fail the margin). At least the occupancy choice of
    :func:`split_count`, and at least ``SEGMENT_MIN_TILES`` tiles each. ``config.segments``
    replaces the first rules where set. 0 when the targets are too few for the union
    of the lists to fill even n_cand entries: those rows would all fail the margin; one
    register list (n_cand <= ROWLIST_MAX) keeps a full list instead, or the torch path.
    """
    n_tiles = math.ceil(nt / config.block_n)
    seg = config.seg_cand
    lists = math.ceil(n_cand / seg) if n_cand <= 2 * seg else math.ceil(2 * n_cand / seg)
    wanted = max(config.segments or lists, split_count(nq, nt, config.block_m, num_sms))
    n_seg = min(wanted, max(1, n_tiles // SEGMENT_MIN_TILES))
    return n_seg if n_seg * config.seg_cand >= n_cand else 0


def skip_share(n_tiles: int, block_m: int, list_len: int) -> float:
    """Expected share of a register-list program's tiles where no row has a survivor.

    A row's list holds the best ``list_len`` of the ``j`` tiles scanned so far, so tile ``j``
    holds one of them with about ``list_len / j`` survivors per row (random order), and no
    survivor in any of ``block_m`` rows with probability ``exp(-block_m * list_len / j)``:
    the mean over ``j = 1 .. n_tiles`` (a log-spaced trapezoid sum).
    """
    if n_tiles < 1:
        return 0.0
    c = float(block_m * list_len)
    points = [n_tiles ** (i / 64) for i in range(65)]
    total = 0.0
    for a, b in zip(points, points[1:]):
        total += (b - a) * (math.exp(-c / a) + math.exp(-c / b)) / 2
    return total / n_tiles


# The row-minimum test before the survivor count (SKIP_TEST) costs a second block-wide
# reduction on tiles with survivors and saves the count on tiles without: worth it from this
# share: it helped clearly above it, was a wash near 0.5 and cost time on segments, where the
# share is about 0 (benchmarks/gpu_notes.md).
SKIP_TEST_SHARE = 0.6


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


def has_tma(device: torch.device) -> bool:
    """Whether target tiles go by TMA on ``device``: CUDA devices of compute capability 9.0+
    (Hopper; Triton rewrites descriptors into pointer loads below it, a form this kernel was
    never measured in), and CPU tensors (the interpreter, which then checks the form Hopper
    runs)."""
    if device.type == "cuda":
        return _cuda_major(device.index or 0) >= 9
    return device.type == "cpu"


@functools.lru_cache(maxsize=None)
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def target_descriptor(t_op: torch.Tensor, block_n: int, block_d: int):
    """A TMA descriptor of the (nt, d) target operand with (block_n, block_d) blocks, or the
    operand itself where :func:`has_tma` says no or TMA cannot address it (rows not 16-byte
    aligned, a block wider than a TMA box)."""
    size = t_op.element_size()
    if (not has_tma(t_op.device) or t_op.dim() != 2 or t_op.stride(1) != 1 or t_op.data_ptr() % 16
            or (t_op.stride(0) * size) % 16 or block_d > 256 or block_n > 256):
        return t_op
    return TensorDescriptor.from_tensor(t_op, [block_n, block_d])


# ----------------------------------------------------------------------------- launch limits
@dataclass(frozen=True)
class DeviceLimits:
    """What a launch configuration must fit on a device: the opt-in shared memory of one
    block (bytes), the multiprocessor count (the split choice) and whether target tiles may
    go by TMA (:func:`has_tma`)."""

    name: str
    shared_bytes: int
    sms: int
    tma: bool


# The two compute capabilities the fused kernel is built for (CUDA's opt-in limits per block).
SM80 = DeviceLimits("sm_80", 166912, 108, False)
SM90 = DeviceLimits("sm_90", 232448, 132, True)


class LaunchRefused(RuntimeError):
    """No configuration of a fused kernel fits the device: the caller runs the torch path."""


def device_limits(device: torch.device) -> DeviceLimits:
    """The limits of ``device``; the interpreter (CPU tensors) gets sm_90's shared memory, so
    the tests see the configurations an H100/H200 gets, and four "multiprocessors"."""
    if device.type != "cuda":
        return DeviceLimits("interpreter", SM90.shared_bytes, 4, has_tma(device))
    return _cuda_limits(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_limits(index: int) -> DeviceLimits:
    props = torch.cuda.get_device_properties(index)
    shared = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return DeviceLimits(f"sm_{props.major}{props.minor}", int(shared), props.multi_processor_count,
                        has_tma(torch.device("cuda", index)))


# Shared memory beyond the operand tiles: barriers, and the layout conversions of the row
# reductions and of the bitonic merges, which the compiler overlaps with the operand buffers
# where their lifetimes allow (not always: tests/kernels/test_gpu_launch.py compares this
# estimate with compiled kernels for both limits).
SHARED_SLACK = 4 * 1024


def shared_estimate(cfg: TileConfig, block_d: int, single_dot: bool, element_size: int,
                    list_len: int, t_desc: bool = False) -> int:
    """Bytes of shared memory a configuration asks for: the query tile once and
    ``num_stages`` target tiles in flight (single dot), or ``num_stages`` (query, target)
    chunk pairs (d in ``block_d`` chunks); the bitonic merges' exchange of
    (BLOCK_M, 2 list_len) packed keys where that is larger; plus :data:`SHARED_SLACK`.
    Without TMA (``t_desc``) the kernel holds two copies of each operand tile in flight (the
    cp.async buffer and the transposed operand: sm_80, 128 x 128 bf16 tiles at d=128 and
    three stages compiled to 229,376 bytes, seven tiles; d in 64-chunks at d=96, 196,608
    bytes, twice the chunks)."""
    stages = max(1, cfg.num_stages)
    copies = 1 if t_desc else 2
    if single_dot:
        tiles = (cfg.block_m + copies * stages * cfg.block_n) * block_d * element_size
    else:   # the flat (tile, chunk) loop: both operands, as the single dot
        tiles = copies * stages * (cfg.block_m + cfg.block_n) * block_d * element_size
    exchange = cfg.block_m * 2 * list_len * 8
    return max(tiles, exchange) + SHARED_SLACK


@dataclass(frozen=True)
class CandidatePlan:
    """One launch configuration of the candidate pass, as :func:`plan_candidates` returns it.

    ``config``: tiles, warps, stages and kernel (``rowlist`` or ``segmented``);
    ``list_len`` the kernel's N_CAND (a segment's list in the segmented mode); ``n_splits``
    target splits (segments) and ``per_split`` targets per split (0: strided segments);
    ``block_d`` the d-chunk (the padded d with ``single_dot``); ``t_desc``: target tiles by TMA.
    """

    config: TileConfig
    list_len: int
    n_splits: int
    per_split: int
    block_d: int
    single_dot: bool
    t_desc: bool
    shared_estimate: int

    @property
    def segmented(self) -> bool:
        return self.config.kernel == "segmented"


def _layouts(cfg: TileConfig, d: int, element_size: int):
    """(config, block_d, single_dot) in order of preference: the chosen tiles with the whole
    query tile (single dot) and fewer target tiles in flight down to two, then d in the
    config's chunks (``block_d``) down to two stages, then in BLOCK_D chunks with fewer stages
    down to one (no software pipelining). Every later entry needs less shared memory than an
    earlier one of its form."""
    d_pad = max(16, triton.next_power_of_2(d))
    if cfg.block_m * d_pad * element_size <= SINGLE_DOT_BYTES:
        for stages in range(cfg.num_stages, 1, -1):
            yield dataclasses.replace(cfg, num_stages=stages), d_pad, True
    if d <= 32:
        chunks = [d_pad]
    elif cfg.block_d and cfg.block_d != BLOCK_D:
        chunks = [cfg.block_d, BLOCK_D]   # the config's chunks while pipelined, then BLOCK_D
    else:
        chunks = [BLOCK_D]
    for chunk_d in chunks:
        last = 0 if chunk_d == chunks[-1] else 1
        for stages in range(cfg.num_stages, last, -1):
            yield dataclasses.replace(cfg, num_stages=stages), chunk_d, False


def plan_candidates(m: int, nt: int, d: int, n_cand: int, precision: str, limits: DeviceLimits,
                    *, config: TileConfig | None = None, splits: int | None = None
                    ) -> list[CandidatePlan]:
    """Every launch configuration of the candidate pass for this shape that fits ``limits``
    by :func:`shared_estimate`, best first (:func:`_layouts`); empty when none does.

    :func:`triton_candidates` launches the first whose compiled kernel the device can load
    (:func:`_loads`); tests/kernels/test_gpu_launch.py compiles them for sm_80 and sm_90.
    """
    cfg = config or tile_config(n_cand, d, precision)
    n_splits = 0
    if cfg.kernel == "segmented":
        seg = cfg.seg_cand
        if seg < 1 or seg & (seg - 1) or seg > cfg.block_n:
            raise ValueError(f"config: seg_cand must be a power of two <= BLOCK_N {cfg.block_n}, "
                             f"got {seg}")
        n_splits = splits or segment_count(m, nt, n_cand, cfg, limits.sms)
        if n_splits == 0 and n_cand <= min(ROWLIST_MAX, cfg.block_n):
            cfg = TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, num_stages=cfg.num_stages,
                             kernel="rowlist")
        elif n_splits == 0:
            # Too few targets for segments and a list too long for one register list: the
            # torch path (LaunchRefused), whose cost at so few targets is small. (A kernel with
            # a candidate buffer and a bitonic selection compiled too slowly: gpu_notes.md.)
            return []
    segmented = cfg.kernel == "segmented"
    list_len = cfg.seg_cand if segmented else n_cand
    if list_len > cfg.block_n:
        raise ValueError(f"config: a register list needs n_cand {list_len} <= BLOCK_N {cfg.block_n}")
    element_size = 2 if precision == "bf16" else 4
    plans = []
    for c, block_d, single_dot in _layouts(cfg, d, element_size):
        # TMA needs 16-byte rows (target_descriptor; the operands are contiguous, d wide);
        # d in chunks, the query chunks go by TMA too.
        t_desc = (limits.tma and block_d <= 256 and c.block_n <= 256
                  and c.block_m <= 256 and (d * element_size) % 16 == 0)
        estimate = shared_estimate(c, block_d, single_dot, element_size, list_len, t_desc)
        if estimate > limits.shared_bytes:
            continue
        if segmented:   # strided segments (see _rowlist_kernel): at most one per tile
            n_split, per_split = min(n_splits, math.ceil(nt / c.block_n)), 0
        else:
            n_split = splits or split_count(m, nt, c.block_m, limits.sms)
            n_split, per_split = _split_targets(nt, n_split, c.block_n)
        plans.append(CandidatePlan(c, list_len, n_split, per_split, block_d, single_dot, t_desc, estimate))
    return plans


# Verdicts of _loads: (kernel name, compiled kernel's hash, device) -> None or the refusal.
_LOAD_VERDICTS: dict[tuple, str | None] = {}


def _loads(kernel, grid, args, kwargs, device: torch.device) -> str | None:
    """Why the compiled ``kernel`` for these arguments cannot run on ``device`` (shared
    memory or registers over its limits, read from the compiled kernel's metadata as the
    launch would), or None. Compiles without launching (``warmup``); the launch that follows
    reuses the compiled kernel. Under the interpreter nothing is compiled: None."""
    if device.type != "cuda":
        return None
    from triton.runtime.errors import OutOfResources

    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), compiled.hash, str(device))
    if key not in _LOAD_VERDICTS:
        try:
            compiled._init_handles()
            verdict = None
        except OutOfResources as exc:
            verdict = str(exc)
        _LOAD_VERDICTS[key] = verdict
    return _LOAD_VERDICTS[key]


def rowlist_arguments(plan: CandidatePlan, q_chunk, t_arg, t_op, bias, out, seed_chunk, level,
                      rows: int, nt: int, d: int, alpha: float, stride_level: int, *,
                      skip_test: bool, lower: bool, precision: str, upcast: bool):
    """(grid, args, kwargs) of one ``_rowlist_kernel`` launch of ``plan``; ``seed_chunk``
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
    out = _kernel_buffer((alloc, plan.n_splits * plan.list_len), torch.int64, q_chunk.device)
    grid, args, kwargs = rowlist_arguments(
        plan, q_chunk, t_arg, t_op, bias, out, seed_chunk, level, rows, nt, d, alpha, stride_level,
        skip_test=skip_test_of(plan, nt), lower=lower, precision=precision, upcast=upcast)
    return _rowlist_kernel, grid, args, kwargs, out


class _CompileAhead:
    """The compilation of a search's first candidate pass started on a thread before the
    search prepares its blocks (:func:`compile_ahead`): the target preparation's own kernel
    compiles meanwhile (Triton's compiler releases the GIL), and the first launch waits for
    it (:meth:`wait`) instead of compiling the same kernel again."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._started: set = set()
        self._running = 0

    def start(self, key, work) -> bool:
        with self._lock:
            if key in self._started:
                return False
            self._started.add(key)
            self._running += 1
            self._idle.clear()

        def run():
            try:
                work()
            except Exception:   # the launch compiles it then, and reports what fails
                logger.debug("compiling ahead %s failed", key, exc_info=True)
            finally:
                with self._lock:
                    self._running -= 1
                    if not self._running:
                        self._idle.set()

        threading.Thread(target=run, name="nj-compile-ahead", daemon=True).start()
        return True

    def wait(self) -> None:
        self._idle.wait()


_AHEAD = _CompileAhead()


def compile_ahead(m: int, nt: int, d: int, n_cand: int | None, precision: str, metric: str, lower: bool,
                  device: torch.device, sources: tuple = (torch.float32, torch.float32),
                  filtered: bool = False) -> bool:
    """Compile, on threads, the kernels a search of ``m`` x ``nt`` rows at ``d`` launches
    first: the candidate kernel for ``n_cand`` candidates (None: the torch path makes them;
    its sample pass and widening rounds run the same kernel), the configuration
    :func:`triton_candidates` would pick, with the same tiles (:func:`search_tiles`), plans
    and arguments; and the re-rank (:func:`triton_exact_values`) of query and target rows
    of the dtypes ``sources``; ``filtered``: the first pass is the threshold filter
    (:func:`filter_candidates`): its kernel too (the candidate kernel then runs its sample
    pass and the widening rounds). On one-row tensors of the operands' dtypes: sizes are not
    specialised, dtypes, alignment and the dimension are. Once per shape and process; True
    when it started. CUDA only."""
    if device.type != "cuda" or min(m, nt, d) < 1:
        return False
    key = (str(device), m, nt, d, n_cand, precision, metric, lower, filtered)

    def rerank():
        torch.cuda.set_device(device)
        one = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in (
            ("q", (1, d), sources[0]), ("t", (1, d), sources[1]), ("qf", (1,), torch.float64),
            ("tf", (1,), torch.float64), ("center", (d,), torch.float64), ("idx", (1, 1), torch.int64),
            ("width", (1,), torch.int32), ("out", (1, 1), torch.float32))}
        grid, args, kwargs = rerank_arguments(one["q"], one["t"], one["qf"], one["tf"], one["center"],
                                              one["idx"], one["width"], one["out"], metric)
        _loads(_rerank_kernel, grid, args, kwargs, device)

    started = _AHEAD.start((str(device), d, l2_form(metric), sources), rerank)
    if n_cand is None or n_cand < 1:
        return started

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
            if _loads(kernel, grid, args, kwargs, device) is None:
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
            16 if lower else 0, filter_slots(filter_cap(n_cand), splits), splits, lower=lower, upcast=False)
        _loads(_filter_kernel, grid, args, kwargs, device)

    if filtered:
        started = _AHEAD.start(key + ("filter",), filter_work) or started
    return _AHEAD.start(key, work) or started


def _kernel_buffer(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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
    the device's limit by estimate) whose compiled kernel the device can load (:func:`_loads`);
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
                _AHEAD.wait()   # a compilation of this search's first pass started ahead
                refusal = _loads(kernel, grid, args, kwargs, device)
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


# ------------------------------------------------------------- threshold-filter first pass
# Slices of a row's buffer per program of the filter pass: one per lane of the quad that holds
# the row in the accumulator's layout (wgmma: each row of a warp's 16 lies in the four lanes
# of one quad, two columns of every eight each), so each slice has one writer.
FILTER_LANES = 4
_FILTER_LANES = tl.constexpr(FILTER_LANES)


def _append_ptx(pack: int) -> str:
    """PTX for the appends of ``pack`` keys of one thread (one ``inline_asm_elementwise``
    invocation of :func:`_filter_kernel`). A miss costs a compare (the pack's compares or-ed
    into one predicate) and one branch per pack: nearly every key misses, and a warp whose
    lanes all miss skips the rest. On a hit: the slot is the thread's own counter for the
    key's row (``%fk_c0`` / ``%fk_c1``: registers of the whole kernel, :func:`_filter_init_ptx`,
    one per row of the thread, told apart by ``sel``), which counts on past the slice's
    ``slots``; if the slice has room, the entry (the key's order-preserving bits above the
    index, :func:`_pack`'s format) goes to position ``slot * slices + lane`` of the row's
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
def _filter_kernel(q_desc, t_desc, bias_ptr, level_ptr, thr_ptr, count_ptr, buf_ptr, nq, nt, d, alpha,
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
    ``_rowlist_kernel``), and one compare. Nothing per row lives in registers but the
    threshold and a counter: no list, no reduction per tile.

    A row's buffer is ``S x FILTER_LANES`` interleaved slices (position ``p * slices +
    slice``, ``slots`` positions each): the slice of split ``s`` and lane ``l`` of the quad
    holding the row is ``s * FILTER_LANES + l``. A hit takes the next position of its slice
    and stores one 8-byte packed entry (:func:`_pack`'s format) where the slice has room; the
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
                entry = _pack(keys, cols[None, :] + tl.zeros([BLOCK_M, BLOCK_N], tl.int32))
                tl.store(row_base[:, None] + slot * slices + lane, entry, mask=hit & (slot < slots))
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if APPEND_PTX:   # the counters, from the accumulator's layout (the threads that hold them)
        args = [count_base.to(tl.int64)[:, None] + tl.zeros([BLOCK_M, BLOCK_N], tl.int64),
                offs_n[None, :] + acc.to(tl.int32), sel[:, None], (rows < nq).to(tl.int32)[:, None]]
        tl.inline_asm_elementwise(_FLUSH_PTX, _FLUSH_CONSTRAINTS, args, dtype=tl.int32,
                                  is_pure=False, pack=_FILTER_PACK)


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
    benchmarks/gpu_notes.md)."""
    return (32, 5) if n_cand <= 64 else (32, 20)


def filter_cap(n_cand: int) -> int:
    """Buffer slots per row for :func:`filter_sample`'s thresholds: a row's hits are about
    ``step x j`` and its spread follows the sample's j-th order statistic (about
    ``step sqrt(j)`` hits a standard deviation): 1.25 step j + 6 step sqrt(j) + 64, up to a
    power of two (1024 for lists up to 64, 2048 beyond). A row past it overflows: its floor
    is -inf and the widening rounds search it (exact, slower)."""
    step, j = filter_sample(n_cand)
    return 1 << math.ceil(math.log2(1.25 * step * j + 6 * step * math.sqrt(j) + 64))


# Least positions of a buffer slice (many splits: few query rows, a small buffer).
FILTER_MIN_SLOTS = 8


def filter_slots(cap: int, splits: int) -> int:
    """Positions per slice of a row's filter buffer (``splits x FILTER_LANES`` slices,
    ``_filter_kernel``): an equal share of ``cap``, at least ``FILTER_MIN_SLOTS``. A slice's
    hits are about its share of the row's, whose spread ``cap`` already covers; a row with
    a slice past it overflows (its floor is -inf and the widening rounds search it)."""
    return max(FILTER_MIN_SLOTS, cap // (splits * FILTER_LANES))


# The filter's sample must fill the segmented lists of its pass (n_cand up to 32 over at least
# 2 x SEGMENT_MIN_TILES tiles of every segment), else its pass would compile another kernel.
FILTER_MIN_SAMPLE = 4 * SEGMENT_MIN_TILES * BLOCK_N


def filter_sample_rows(nt: int, n_cand: int) -> int:
    """Rows of the sample the filter's thresholds take over ``nt`` targets (every step-th),
    0 where the sample would be too small for its pass."""
    step, _ = filter_sample(n_cand)
    rows = -(-nt // step)
    return rows if rows >= FILTER_MIN_SAMPLE else 0


def filter_splits(m: int, nt: int, tiles: FilterTiles, sms: int) -> int:
    """Target splits of the filter pass: two (the measured shape at 65,536 queries), more
    where the queries alone give fewer programs than two waves."""
    q_tiles = max(1, math.ceil(m / tiles.block_m))
    return max(1, min(max(2, math.ceil(2 * sms / q_tiles)), math.ceil(nt / tiles.block_n)))


def filter_arguments(q_chunk, t_op, bias, level, thr, count, buf, rows: int, nt: int, d: int, alpha: float,
                     stride_level: int, slots: int, splits: int, *, lower: bool, upcast: bool,
                     tiles: FilterTiles = FILTER_TILES):
    """(grid, args, kwargs) of one ``_filter_kernel`` launch over ``rows`` query rows, ``slots``
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


def filter_threshold(queries: PreparedSide, targets: PreparedSide, n_cand: int, config: TileConfig,
                     *, lower: bool = False, buffer_bytes: int = 1 << 30) -> torch.Tensor | None:
    """Each row's threshold for a filter pass of ``n_cand`` (:func:`filter_sample`): its j-th
    key over every step-th target, by the search's compiled candidate kernel ``config`` (as
    :func:`sample_seed`: the sample's own prepared rows, kept in the block's cache; lower keys
    at the first pass's levels). None where the sample is too small or its pass would not
    run the segmented kernel. Any threshold is exact (the floor follows it); this one is
    only what makes the filter's hits few and still more than the list."""
    step, j = filter_sample(n_cand)
    if not filter_sample_rows(targets.rows, n_cand):
        return None
    width = max(SEG_CAND, triton.next_power_of_2(j))
    plans = plan_candidates(queries.rows, filter_sample_rows(targets.rows, n_cand), queries.dim, width,
                            queries.precision, device_limits(queries.exact.device), config=config)
    if not plans or not plans[0].segmented:
        return None
    sample = targets.cache.get(("sample", step))
    if sample is None:
        sample = targets.take(torch.arange(0, targets.rows, step, device=targets.exact.device))
        targets.cache[("sample", step)] = sample
    rank1 = {"rank1": queries.cache["rank1"]} if "rank1" in queries.cache else {}
    rows_view = dataclasses.replace(queries, cache=rank1)
    keys = triton_candidates(rows_view, sample, width, config=config, lower=lower,
                             levels=lower_levels(n_cand), buffer_bytes=buffer_bytes)[0]
    return keys[:, j - 1].contiguous()


def filter_select(count: torch.Tensor, buf: torch.Tensor, threshold: torch.Tensor, n_cand: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, indices, floor) of a filter pass's rows from their counters and buffers.

    ``count`` (rows, slices): the hits of each slice of a row's buffer, whose position ``p``
    of slice ``i`` is ``buf[row, p * slices + i]`` (``_filter_kernel``). A row whose hits fit
    its list: all of them, floor just above its threshold (every key not appended exceeds
    it). More hits than ``n_cand``: the n_cand best (packed order: key, then the lower
    index), floor the lesser of that and the first key cut off. A slice with more hits than
    its positions (overflow): the n_cand best of those stored, floor -inf (not proven:
    ``_gpu_search.exact_topk`` widens it). One host sync (the largest count: only the
    positions below it are read)."""
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


def filter_candidates(queries: PreparedSide, targets: PreparedSide, n_cand: int, threshold: torch.Tensor,
                      *, lower: bool = False, levels: int | None = None, buffer_bytes: int = 1 << 30,
                      tiles: FilterTiles = FILTER_TILES, cap: int | None = None, splits: int | None = None,
                      slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        buf = _kernel_buffer((rows, slices * slots), torch.int64, device)
        grid, args, kwargs = filter_arguments(
            queries.operand[r0:r1], targets.operand, bias, level, threshold[r0:r1], count, buf, rows, nt, d,
            alpha, stride_level, slots, n_splits, lower=lower, upcast=upcast, tiles=tiles)
        if r0 == 0:
            _AHEAD.wait()
            refusal = _loads(_filter_kernel, grid, args, kwargs, device)
            if refusal is not None:
                raise LaunchRefused(f"filter kernel: {refusal}")
        _filter_kernel[grid](*args, **kwargs)
        keys_out[r0:r1], idx_out[r0:r1], floor_out[r0:r1] = filter_select(count, buf, threshold[r0:r1], n_cand)
    return keys_out, idx_out, floor_out


# ----------------------------------------------------------------------------- exact re-rank
# Query rows and candidate columns per step of the re-rank kernel, and the d-chunk it reads at
# a time: a step gathers RERANK_ROWS x RERANK_COLS target rows' chunks (one 128-byte line each
# in float32) against one chunk of each query row.
RERANK_ROWS = 16
RERANK_COLS = 8
RERANK_D = 32


# Sizes only bound loops and masks (one compiled variant for every row and column count).
@triton.jit(do_not_specialize=["m", "c"])
def _rerank_kernel(q_ptr, t_ptr, qf_ptr, tf_ptr, c_ptr, idx_ptr, width_ptr, out_ptr, m, c, d, stride_q,
                   stride_t, L2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_D: tl.constexpr):
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
        tl.store(out_ptr + rows64[:, None] * c + cols[None, :], tl.where(ok, acc.to(tl.float32), float("nan")),
                 mask=live[:, None] & (cols[None, :] < c))


def _center(queries: PreparedSide, targets: PreparedSide) -> torch.Tensor:
    """The frame's centre as the kernels read it (zeros for the origin; l2 never reads it)."""
    center = targets.frame.center
    if center is None:
        return torch.zeros(max(1, queries.dim), dtype=torch.float64, device=targets.source.device)
    return center.contiguous()


def triton_exact_values(queries: PreparedSide, targets: PreparedSide, idx: torch.Tensor) -> torch.Tensor:
    """:func:`_gpu_rerank.exact_values` by :func:`_rerank_kernel`: the same values up to the
    order of the float64 summation (the error bound covers any order)."""
    m, c = idx.shape
    out = torch.full((m, c), math.nan, dtype=torch.float32, device=idx.device)
    if m == 0 or c == 0:
        return out
    _AHEAD.wait()   # its compilation may have started ahead (compile_ahead)
    grid, args, kwargs = rerank_arguments(queries.source, targets.source, queries.factor.contiguous(),
                                          targets.factor, _center(queries, targets), idx.contiguous(),
                                          live_width(idx), out, queries.metric)
    _rerank_kernel[grid](*args, **kwargs)
    return out


def rerank_arguments(q, t, q_factor, t_factor, center, idx, width, out, metric: str):
    """(grid, args, kwargs) of the :func:`_rerank_kernel` launch of :func:`triton_exact_values`."""
    m, c = idx.shape
    d = q.shape[1]
    block_d = min(RERANK_D, max(16, triton.next_power_of_2(d)))
    return ((triton.cdiv(m, RERANK_ROWS),),
            (q, t, q_factor, t_factor, center, idx, width, out, m, c, d, q.stride(0), t.stride(0)),
            {"L2": l2_form(metric), "BLOCK_R": RERANK_ROWS, "BLOCK_C": RERANK_COLS, "BLOCK_D": block_d,
             "num_warps": 4})


# ----------------------------------------------------------------------------- preparation
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
