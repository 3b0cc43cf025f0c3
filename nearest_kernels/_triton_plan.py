"""Launch configurations of the fused candidate kernel: tiles, segments, splits, device limits.

Every list width of the candidate pass runs by default in the *segmented* mode:
``SEG_CAND``-long lists over S target segments, whose union, with a floor on every key it
left out, is the candidate list (see ``_triton_candidates.triton_candidates``: exact because
the margin test uses the floor), so that a search compiles one candidate kernel whatever
widths its rows widen to. :func:`tile_config` picks; one register list of up to
``ROWLIST_MAX`` entries runs where the targets are too few for the segments, and a longer
list there runs the torch path (:func:`plan_candidates`).

:func:`plan_candidates` lists every configuration of a pass that fits a device
(:class:`DeviceLimits`) by its shared-memory estimate, best first; the launch
(``_triton_candidates``) takes the first whose compiled kernel the device loads
(``_triton_compile.load_refusal``). Host code only: the kernels are in
``_triton_candidate_kernels``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

BLOCK_N = 128
# d is consumed in chunks of BLOCK_D (one compiled variant for every d > 32).
BLOCK_D = 64
# Largest candidate list the kernel keeps: the segmented mode merges 2 x n_cand per row on
# the host.
MAX_CANDIDATES = 1024


@dataclass(frozen=True)
class TileConfig:
    """One compiled variant of ``rowlist_kernel``. ``kernel``: ``"rowlist"`` (one register
    list per row, small n_cand) or ``"segmented"`` (register lists of ``seg_cand`` entries
    over several target segments, long n_cand; see :func:`triton_candidates`).
    ``extra_passes``: the argmin passes before the bitonic top-k (lists longer than
    ``LOOP_CAND``) and ``skip_test`` the row-minimum test (see ``rowlist_kernel``)."""

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


# Lists up to this long live in registers (rowlist_kernel); longer ones are the union of
# SEG_CAND-long register lists over target segments (or, where that does not suit, the torch
# path: :func:`plan_candidates`).
ROWLIST_MAX = 64
# Segment list length. S x SEG_CAND = 2 n_cand whatever SEG_CAND, and so is the number of
# insertions per row; shorter lists make each insert (a reduction over the list) and each
# merge cheaper: 16 was the fastest of 16, 32 and 64 in bf16 and tf32 (benchmarks/gpu_notes.md).
# The floor keeps the search exact whatever a segment holds back.
SEG_CAND = 16
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
    (:func:`load_refusal`); tests/kernels/test_gpu_launch.py compiles them for sm_80 and sm_90.
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
        if segmented:   # strided segments (see rowlist_kernel): at most one per tile
            n_split, per_split = min(n_splits, math.ceil(nt / c.block_n)), 0
        else:
            n_split = splits or split_count(m, nt, c.block_m, limits.sms)
            n_split, per_split = _split_targets(nt, n_split, c.block_n)
        plans.append(CandidatePlan(c, list_len, n_split, per_split, block_d, single_dot, t_desc, estimate))
    return plans
