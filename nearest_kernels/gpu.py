"""The ``gpu`` backend: exact top-k on a CUDA device, fused Triton kernel or torch fallback.

Two implementations share one pipeline (``_gpu_search``): a low-precision candidate pass,
then an exact float32 re-rank whose candidate list is proven complete by an error bound:

* ``triton`` (preferred): the fused kernel (``_triton_candidate_kernels``) keeps each distance
  tile on chip and folds it into per-query candidate lists. Needs triton and a GPU of compute
  capability 8.0 or newer, tf32 or bf16 operands (fp32 products run on cuBLAS, which the
  fused kernel's CUDA-core form did not match), and a candidate list of at most
  ``MAX_CANDIDATES`` (1024) entries: k up to 512 (above it a low-precision first list holds
  about 2k, ``_gpu_bound.LONG_LIST_K``: the torch path runs such searches, with the threshold
  filter's first pass where :func:`filter_refusal` accepts it).
* ``torch``: tiled ``addmm`` + ``topk``. Any k, any CUDA GPU, and CPU tensors (tests).

``precision`` picks the operands of the candidate pass: ``"auto"`` (the default: bf16 on GPUs
of compute capability 8.0 or newer, fp32 elsewhere; :func:`resolve_precision`), ``"fp32"``
(IEEE float32, no tensor-core rounding), ``"tf32"`` or ``"bf16"`` (tensor cores). Which
implementation computes the candidates is chosen like the backends (:func:`choose`, reasons
logged at DEBUG). Every search runs
in the target block's working frame (both sides shifted by the block's mean, scaled by a power
of two: the rounding bound follows the spread of the data, not its offset) and re-ranks its
candidates from the input rows in float64; results are the same in every precision (within
:data:`RTOL`), which only changes the speed. Rows whose bound admits too much of the block in
bf16 / tf32 switch to float32 operands.

:func:`knn_torch` takes torch tensors (CUDA or CPU) and keeps the results on their device;
``knn(..., backend="gpu")`` takes numpy arrays and goes through :data:`BACKEND`.
:func:`prepare_targets` / :func:`search_prepared` let a caller keep a target block resident
on the device across many query batches (``udfs.gpu_search``).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from ._common import Metric, check_cap, resolve_metric

logger = logging.getLogger(__name__)

try:  # optional dependency: `import nearest_kernels` must never need torch
    import torch
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    torch = None
    _TORCH_ERROR = f"torch is not installed ({_exc})"
else:
    _TORCH_ERROR = None

PRECISIONS = ("auto", "fp32", "tf32", "bf16")

# The backend's tolerance against the float64 difference-form oracle (``rtol`` of
# tests/adversarial.py's assert_true_topk): relative to the size of the shifted problem, (|q - c|
# + max |t - c|)^2 for the l2 family (cosine: of the unit rows), |q| max |t - c| for inner
# product, c the targets' mean. Every result is the exact top k, ties to the lower index, of
# float32 roundings of values computed in float64 from the input rows in the working frame
# (``_gpu_rerank`` notes); each is within 2^-24 (and a float64 sum's d 2^-53) of the true value,
# which is at most that size, so a returned key exceeds the true k-th by at most about
# 2 x 2^-24 of it. 2^-22 leaves a factor of two. (float64 inputs are searched from their own
# float64 rows: the same tolerance.)
RTOL = 2.0 ** -22


# Value tolerances of the exact results against the float64 reference, per float32 value:
# l2 family relative to the squared distance (difference form), similarities relative to
# |q||t| (cosine: 1); tests/kernels/test_gpu.py's tie-aware check on centred data.
def value_tolerance(d: int) -> float:
    n_u = (d + 2) * 2.0 ** -24
    return 4 * n_u / (1 - n_u)


def _check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {list(PRECISIONS)}, got {precision!r}")
    return precision


def resolve_precision(precision: str, device) -> str:
    """The precision a search runs in: ``"auto"`` is the fastest exact one of ``device`` (a
    torch.device): bf16 on CUDA devices of compute capability 8.0 or newer (tensor cores;
    the re-rank keeps results exact), fp32 elsewhere (older GPUs, CPU tensors)."""
    _check_precision(precision)
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        resolved = "bf16"
    else:
        resolved = "fp32"
    if (str(device), resolved) not in _LOGGED_AUTO:
        _LOGGED_AUTO.add((str(device), resolved))
        logger.info("precision auto -> %s on %s", resolved, device)
    return resolved


_LOGGED_AUTO: set = set()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_refusal(device) -> str | None:
    """Why the fused kernel cannot run on ``device`` (a torch.device), or None."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    if device.type != "cuda":
        return None if _interpreting() else f"device {device} is not CUDA (set TRITON_INTERPRET=1 to interpret)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"compute capability {major}.{minor} < 8.0 (tf32/bf16 tl.dot)"
    return None


@dataclass
class PreparedTargets:
    """A target block ready for search: operands, norms and bound terms on one device."""

    side: object          # _gpu_prepare.PreparedSide
    stats: object         # _gpu_bound.TargetStats
    rankable: object      # bool tensor (nt,): rows that can rank
    rows: object          # int64 tensor of rankable row numbers, or None when all are

    @property
    def metric(self) -> str:
        return self.side.metric

    @property
    def precision(self) -> str:
        return self.side.precision


def rankable_mask(x, metric: str):
    """Device-side twin of :func:`_common.rankable_rows`: finite, and non-zero for cosine."""
    ok = torch.isfinite(x).all(dim=1)
    if metric == "cosine":
        ok &= (x != 0).any(dim=1)
    return ok


def prepare_targets(targets, metric: str, precision: str = "auto") -> PreparedTargets:
    """Prepare a (nt, d) float tensor once for many :func:`search_prepared` calls: the block's
    working frame (its mean and a power-of-two scale, ``_gpu_prepare.working_frame``), operands,
    norms and bound terms. float64 rows stay float64 for the re-rank. ``precision="auto"`` is
    resolved for the tensor's device (:func:`resolve_precision`; ``.precision`` says which).
    On CUDA the preparation kernels compute it (``_triton_prepare.triton_prepare_targets``: the
    torch form's side, in three passes over the rows; cosine four)."""
    from ._gpu_bound import TargetStats
    from ._gpu_prepare import prepare_targets_side

    m = resolve_metric(metric).name
    precision = resolve_precision(precision, targets.device)
    # A row with a NaN or an infinite element has a non-finite sum (cosine: norm, which is 0
    # for a zero row): where every row's is finite (cosine: and positive), every row ranks (one
    # read of the rows, nothing written per element); else (an overflowing sum or norm too)
    # the element test decides.
    fine = None
    if targets.numel():
        if m == "cosine":
            norms = torch.linalg.vector_norm(targets, dim=1)
            fine = torch.isfinite(norms) & (norms > 0)
        else:
            fine = torch.isfinite(targets.sum(dim=1))
    if fine is not None and bool(fine.all()):
        ok, rows = torch.ones(targets.shape[0], dtype=torch.bool, device=targets.device), None
    else:
        ok = rankable_mask(targets, m)
        rows = None if bool(ok.all()) else ok.nonzero().flatten()
    block = targets if rows is None else targets[rows]
    if block.device.type == "cuda" and block.numel() and triton_refusal(block.device) is None:
        # The same side in three streaming passes (cosine: four).
        from ._triton_prepare import triton_prepare_targets
        side = triton_prepare_targets(block, m, precision)
    else:
        side = prepare_targets_side(block, m, precision)
    return PreparedTargets(side, TargetStats.of(side), ok, rows)


def prepare_queries(queries, targets):
    """Query rows (finite, a float tensor) in the frame, metric and precision of a prepared
    target side (``_gpu_prepare.PreparedSide``): on CUDA for the l2 form (cosine included) in a
    centred frame by the preparation kernel's fill pass (``_triton_prepare.triton_prepare_queries``),
    else the torch form (``_gpu_prepare.prepare_queries``)."""
    from . import _gpu_prepare as gp

    if (gp.l2_form(targets.metric) and targets.frame.center is not None
            and queries.device.type == "cuda" and queries.numel() and triton_refusal(queries.device) is None):
        from ._triton_prepare import triton_prepare_queries
        return triton_prepare_queries(queries, targets)
    return gp.prepare_queries(queries, targets)


@dataclass(frozen=True)
class Implementation:
    """One way of computing the GPU backend's candidates, chosen like the backends
    (:mod:`nearest_kernels.dispatch`): it states its devices, precisions and widest
    candidate list, and :meth:`refuse` says why it cannot run a call (None: it can)."""

    name: str
    devices: tuple[str, ...]
    precisions: tuple[str, ...]
    max_candidates: int | None

    def refuse(self, k: int, precision: str, device) -> str | None:
        from ._gpu_bound import candidate_width

        if self.name == "triton":
            reason = triton_refusal(device)
            if reason is not None:
                return reason
        elif device.type not in self.devices:
            return f"device {device} is not one of {list(self.devices)}"
        if precision not in self.precisions:
            # IEEE float32 products run on CUDA cores, where the fused kernel's one dot per
            # tile is far off cuBLAS sgemm (benchmarks/RESULTS.md): fp32 candidates come from
            # the torch path, and the fused kernel still re-ranks them.
            return f"{precision} candidates run cuBLAS sgemm + topk (the fused kernel is built for tensor cores)"
        if self.max_candidates is not None:
            width = candidate_width(k, precision)
            if width > self.max_candidates:
                return (f"k={k} in {precision} needs {width} candidates, more than the "
                        f"{self.max_candidates} of its lists")
        return None


def _max_fused_candidates() -> int:
    try:
        from ._triton_plan import MAX_CANDIDATES
    except ImportError:   # no triton: triton_refusal names it
        return 0
    return MAX_CANDIDATES


# Preference order: the fused kernel, then the torch path (any k, any device).
IMPLEMENTATION_ORDER = (
    Implementation("triton", ("cuda",), ("tf32", "bf16"), 1024),
    Implementation("torch", ("cuda", "cpu"), ("fp32", "tf32", "bf16"), None),
)


def choose(k: int, precision: str, device) -> tuple[Implementation, list[str]]:
    """(implementation, the reasons of those before it) for a search of ``k`` in a resolved
    ``precision`` on ``device``: the first of :data:`IMPLEMENTATION_ORDER` that accepts it.
    A pure function of the call's shape and device, so tests ask it what a search runs."""
    reasons = []
    for candidate in IMPLEMENTATION_ORDER:
        reason = candidate.refuse(k, precision, device)
        if reason is None:
            return candidate, reasons
        reasons.append(f"{candidate.name}: {reason}")
    raise ValueError("no GPU implementation accepts this search:\n  " + "\n  ".join(reasons))


# EXACT searches that rank candidates by the per-target lower key (``_gpu_bound`` module
# notes, "Per-target bounds"), as {precision: smallest k}: a margin about 1.4x tighter for
# one bias row per fused program, so that the first list can be the plain width and far
# fewer rows widen. Not tf32: its plain bound already proves nearly every row, and the
# bias rows cost more than the widening they save (benchmarks/gpu_notes.md).
LOWER_KEYS = {"bf16": 1}
# Below k = LOWER_KEYS_ANY_D_FROM_K, only up to this dimension: at larger d a short list with
# lower keys costs more than a wider list without them (benchmarks/gpu_notes.md).
LOWER_KEYS_SMALL_K_MAX_D = 128
LOWER_KEYS_ANY_D_FROM_K = 64


def uses_lower_keys(k: int, precision: str, d: int) -> bool:
    """Whether an EXACT search of ``k`` in ``precision`` at dimension ``d`` ranks by lower
    keys (LOWER_KEYS; small k only up to LOWER_KEYS_SMALL_K_MAX_D; not above
    ``_gpu_bound.LONG_LIST_K``)."""
    from ._gpu_bound import LONG_LIST_K

    if precision not in LOWER_KEYS or k < LOWER_KEYS[precision]:
        return False
    if k > LONG_LIST_K:
        # The list of about 2k proves its rows by plain keys (benchmarks/gpu_notes.md, Large
        # k); on the torch path lower keys cost two more passes over every key tile.
        return False
    return k >= LOWER_KEYS_ANY_D_FROM_K or d <= LOWER_KEYS_SMALL_K_MAX_D


def sampled_first_pass(k: int, precision: str, d: int) -> bool:
    """Whether a fused search of ``k`` in ``precision`` at dimension ``d`` starts from a list
    ``widened`` once and seeded by a sample pass (``_triton_candidates.sample_seed``): lower-key
    searches of k >= LOWER_KEYS_ANY_D_FROM_K above LOWER_KEYS_SMALL_K_MAX_D, where the plain
    first list left most rows unproven (their margin grows with d) and the widening round
    that proved them rescanned the block: the wider list proves them in one pass, and its
    seeds keep that pass from paying for the longer lists (benchmarks/gpu_notes.md)."""
    return (uses_lower_keys(k, precision, d) and k >= LOWER_KEYS_ANY_D_FROM_K
            and d > LOWER_KEYS_SMALL_K_MAX_D)


def sampled_width(k: int, precision: str, d: int) -> int | None:
    """The first list's width of a search with a sampled first pass (:func:`sampled_first_pass`;
    None without one): its rows' list widened once."""
    if not sampled_first_pass(k, precision, d):
        return None
    from . import _gpu_bound as gb
    from ._triton_plan import MAX_CANDIDATES

    return min(gb.widened(gb.candidate_width(k, precision, uses_lower_keys(k, precision, d))), MAX_CANDIDATES)


def first_list_width(k: int, precision: str, d: int) -> int:
    """The first candidate list's width of a fused search: the sampled first pass's
    (:func:`sampled_width`) or :func:`_gpu_bound.candidate_width`."""
    from ._gpu_bound import candidate_width

    return sampled_width(k, precision, d) or candidate_width(k, precision, uses_lower_keys(k, precision, d))


# The threshold filter is the first pass from this dimension (bf16, compute capability 9.x):
# below it the register lists' pass is about as fast as the product itself and the filter's
# sample pass and selection cost more than it saves (benchmarks/gpu_notes.md).
FILTER_MIN_D = 256


def filter_refusal(nt: int, d: int, k: int, precision: str, device) -> str | None:
    """Why a search of ``k`` over ``nt`` targets at ``d`` on ``device`` does not take the
    threshold filter as its first pass (``_triton_filter.filter_candidates``), or None when it
    does: sample thresholds, one pass of 128 x 256 tiles appending each row's hits to a buffer,
    then the list (faster than the register lists at these shapes: benchmarks/gpu_notes.md).
    The sampled first pass or the plain register lists run where it refuses. Lists longer than
    the register lists' (k above ``_gpu_bound.LONG_LIST_K``, up to the filter's
    ``LONG_FILTER_MAX``) take it too, in front of the torch path's widening rounds: the torch
    generator's ``topk`` over every target tile made the list where it refuses."""
    if torch is None or getattr(device, "type", None) != "cuda":
        return f"device {device} is not CUDA"
    if precision != "bf16":
        return f"{precision} operands (the filter was measured in bf16)"
    if d < FILTER_MIN_D:
        return f"d={d} < {FILTER_MIN_D} (the register lists' pass is as fast)"
    if d % 8:
        return f"d={d}: bf16 rows not 16-byte aligned (TMA)"
    if triton_refusal(device) is not None:
        return triton_refusal(device)
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"compute capability {major}.{minor}: the appends are sm_90 inline PTX"
    from ._triton_filter import LONG_FILTER_MAX, filter_sample_rows

    width = first_list_width(k, precision, d)
    if width > LONG_FILTER_MAX:
        return f"k={k} needs {width} candidates, more than the filter's {LONG_FILTER_MAX}"
    if not filter_sample_rows(nt, width):
        return f"nt={nt}: too few targets for the filter's sample"
    return None


def kept_sample_rows(nt: int, d: int, k: int, precision: str, device=None) -> int:
    """Target rows of the sample that searches of ``k`` keep with a prepared block of ``nt``
    rows on ``device`` (``_triton_candidates.sample_seed`` or, where :func:`filter_refusal` accepts,
    ``filter_threshold``: its own prepared rows, as many bytes a row as the block's), 0 where
    they take none: what a device memory budget adds to the block's. An upper bound: where
    the first pass has no launch configuration (a block too small for its segments) the
    torch path runs it, unsampled; without ``device``, the larger of the two samples."""
    from ._triton_candidates import sample_rows
    from ._triton_filter import filter_sample_rows

    width = first_list_width(k, precision, d)
    seeded = sample_rows(nt, width) if sampled_first_pass(k, precision, d) else 0
    if device is None:
        filtered = filter_sample_rows(nt, width) if precision == "bf16" and d >= FILTER_MIN_D else 0
        return max(seeded, filtered)
    return filter_sample_rows(nt, width) if filter_refusal(nt, d, k, precision, device) is None else seeded


def lower_table_bytes(nt: int) -> int:
    """Device memory of one lower-key search's bias table for ``nt`` targets, temporaries
    included (``_gpu_bound.lower_table_bytes``): what a device memory budget adds to a
    block's where :func:`uses_lower_keys`."""
    from ._gpu_bound import lower_table_bytes as table_bytes

    return table_bytes(nt)


def best_order(values, idx, k: int, descending: bool):
    """Columns of each row's ``min(k, columns)`` best entries by (value, index), best first,
    on the tensors' device: every backend's tie rule (``_gpu_rerank.best_order``), for a caller
    that folds per-block results on the device."""
    from ._gpu_rerank import best_order as order

    return order(values, idx, k, descending)


def compile_first_pass(nq: int, nt: int, d: int, k: int, metric: str, precision: str, device,
                       dtypes: tuple = ("float32", "float32")) -> bool:
    """Start compiling, on threads, the Triton kernels that a search of ``nq`` x ``nt`` rows
    (of the torch dtypes named ``dtypes``) launches first (``_triton_warmup.compile_ahead``: its
    first candidate pass where the fused kernel makes the candidates, and the re-rank), before
    the caller prepares the blocks: the preparation (its own kernel's compilation included)
    runs meanwhile, and the search's first launch waits for them. True when it started;
    False off CUDA or without Triton, or when it was started for this shape before."""
    if torch is None or getattr(device, "type", None) != "cuda" or triton_refusal(device) is not None:
        return False
    from ._triton_plan import MAX_CANDIDATES
    from ._triton_warmup import compile_ahead

    precision = resolve_precision(precision, device)
    lower = uses_lower_keys(k, precision, d)
    n_cand = None
    if choose(k, precision, device)[0].name == "triton":
        n_cand = first_list_width(k, precision, d)
        if n_cand > MAX_CANDIDATES:
            n_cand = None
    filter_cand = None
    if filter_refusal(nt, d, k, precision, device) is None:
        filter_cand = first_list_width(k, precision, d)
    # The re-rank reads the rows as given: float32 or float64 (other floats as float32).
    sources = tuple(torch.float64 if name == "float64" else torch.float32 for name in dtypes)
    return compile_ahead(nq, nt, d, n_cand, precision, resolve_metric(metric).name, lower, device, sources,
                         filter_cand=filter_cand)


def search_prepared(queries, targets: PreparedTargets, k: int, *, buffer_bytes: int = 1 << 30,
                    cap: float | None = None):
    """Exact top-k of every query row (a float tensor on the targets' device) against ``targets``.

    Returns (values float32 (nq, k), indices int64 (nq, k)) on that device, the contract of
    :func:`nearest_kernels.knn`. ``cap`` (the metric's units, inclusive, or None): only
    targets within it rank, a row may have fewer than k (``_gpu_search.exact_topk``: the cap
    is the searches' limit from their first candidate pass).
    """
    from . import _gpu_rerank as gr
    from . import _gpu_search as gs

    metric, precision = targets.metric, targets.precision
    m = resolve_metric(metric)
    nq = queries.shape[0]
    device = queries.device
    values = torch.full((nq, k), m.worst, dtype=torch.float32, device=device)
    indices = torch.full((nq, k), -1, dtype=torch.int64, device=device)
    q_ok = rankable_mask(queries, metric)
    frame = targets.side.frame
    # One host sync for both: whether every row ranks, and whether some row could lie so far
    # from the block (in its scale) that its working values would leave float32's range.
    all_ok, peak = torch.stack([q_ok.all().double(), queries.abs().amax().double()]).tolist() \
        if nq else (1.0, 0.0)
    q_rows = None if all_ok else q_ok.nonzero().flatten()
    q_run = queries if q_rows is None else queries[q_rows]
    if q_run.shape[0] == 0 or targets.side.rows == 0:
        return values, indices
    side = prepare_queries(q_run, targets.side)
    far = None
    if gs.may_be_far(metric, frame, peak, side.dim):
        far = gs.far_rows(side)
    lower = uses_lower_keys(k, precision, side.dim)
    implementation, reasons = choose(k, precision, device)
    chosen = implementation.name
    logger.debug("gpu knn nq=%d nt=%d d=%d k=%d %s %s -> %s%s", side.rows, targets.side.rows,
                 side.dim, k, metric, precision, chosen, "".join(f" ({r})" for r in reasons))
    few_rows, first_width = 0, None
    if chosen == "triton":
        from ._triton_candidates import sample_seed, triton_candidates
        from ._triton_plan import MAX_CANDIDATES, LaunchRefused, device_limits, search_tiles
        from ._triton_rerank import triton_exact_values

        first_tiles = []
        no_filter = filter_refusal(targets.side.rows, side.dim, k, precision, device)
        filtered = no_filter is None
        first_width = sampled_width(k, precision, side.dim)
        sampled = first_width is not None and not filtered
        if filtered:
            first_width = first_list_width(k, precision, side.dim)
        logger.debug("first pass: %s", "threshold filter" if filtered else
                     f"{'sampled' if sampled else 'plain'} register lists ({no_filter})")

        def candidates(q, t, n_cand, seed=None, lower=False):
            # Every round runs the first pass's tiles: one compiled kernel per search.
            first = not first_tiles
            if first:
                first_tiles.append(search_tiles(q.rows, t.rows, q.dim, n_cand, q.precision,
                                                device_limits(q.exact.device)))
            if first and filtered:
                got = _filtered_first_pass(q, t, n_cand, first_tiles[0], seed, lower, buffer_bytes)
                if got is not None:
                    return got
            try:
                if first and (sampled or filtered):   # the first pass's seed: the sample's (and a cap's)
                    sample = sample_seed(q, t, n_cand, first_tiles[0], lower=lower,
                                         buffer_bytes=buffer_bytes)
                    if sample is not None:
                        seed = sample if seed is None else torch.minimum(seed.to(sample.dtype), sample)
                return triton_candidates(q, t, n_cand, config=first_tiles[0], buffer_bytes=buffer_bytes,
                                         seed=seed, lower=lower)
            except LaunchRefused as exc:
                # No configuration of the fused kernel fits the device for this list: the
                # torch path computes the same keys (lower keys too) and a list without a seed.
                logger.info("torch candidates for %d rows: %s", q.rows, exc)
                return gs.torch_candidates(q, t, n_cand, lower=lower)
        # Widening rounds seed the fused kernel's lists with each row's limit: keys above it
        # cannot rank, so the kernel never inserts them.
        max_cand, values_fn, seeded = MAX_CANDIDATES, triton_exact_values, True
        few_rows = gs.torch_round_rows(targets.side.rows)
    else:
        candidates, max_cand, values_fn, seeded = gs.torch_candidates, None, None, False
        if device.type == "cuda" and triton_refusal(device) is None:
            # fp32's cuBLAS candidates (and lists beyond the fused kernel's), re-ranked by
            # the fused kernel: it reads candidates' rows in place, where the torch form
            # gathers them into float64 (rows, candidates, d) tensors.
            from ._triton_rerank import triton_exact_values as values_fn
            if filter_refusal(targets.side.rows, side.dim, k, precision, device) is None:
                # Lists beyond the register lists': the threshold filter's first pass, then the
                # torch generator's seeded widening rounds.
                candidates, seeded = _long_list_candidates(buffer_bytes, k, targets.stats, cap), True
                logger.debug("first pass: threshold filter of a long list, torch widening rounds")
    near = side if far is None else side.take(~far)
    v, i = gs.exact_topk(near, targets.side, k, candidates, max_candidates=max_cand,
                         stats=targets.stats, values=values_fn, seeded=seeded,
                         lower=lower, few_rows=few_rows, cap=cap, first_width=first_width)
    if far is not None:
        # Rows too far from the block for its working frame: the float64 difference form over
        # every target, each row in its own scale (rare: 2^60 block extents away).
        v_all = torch.empty((side.rows, k), dtype=torch.float32, device=device)
        i_all = torch.empty((side.rows, k), dtype=torch.int64, device=device)
        v_all[~far], i_all[~far] = v, i
        far_side = side.take(far)
        v_all[far], i_all[far] = gr.drop_beyond_cap(far_side, targets.side,
                                                    *gs.far_topk(far_side, targets.side, k), cap)
        v, i = v_all, i_all
    if targets.rows is not None:
        i = torch.where(i >= 0, targets.rows[i.clamp(min=0)], -1)
    if q_rows is None:
        return v, i
    values[q_rows] = v
    indices[q_rows] = i
    return values, indices


def _filtered_first_pass(q, t, n_cand: int, config, seed, lower: bool, buffer_bytes: int, ranked=None):
    """The threshold filter's first list (``_triton_filter.filter_candidates``): each row's
    threshold the sample's (``filter_threshold``; under a seed, a cap's limit, the lesser of
    the two); ``ranked``: a long list's ranking of the hits (``filter_candidates``). None
    where the filter cannot run (a sample too small, a launch the device refuses): the
    search's own generator makes the first list then."""
    from ._triton_filter import filter_candidates, filter_threshold
    from ._triton_plan import LaunchRefused

    try:
        threshold = filter_threshold(q, t, n_cand, config, lower=lower, buffer_bytes=buffer_bytes)
        if threshold is None:
            return None
        if seed is not None:
            threshold = torch.minimum(threshold, seed.to(threshold.dtype))
        return filter_candidates(q, t, n_cand, threshold, lower=lower, buffer_bytes=buffer_bytes, ranked=ranked)
    except LaunchRefused as exc:
        logger.info("first pass without the threshold filter: %s", exc)
        return None


def _long_list_candidates(buffer_bytes: int, k: int, stats=None, cap: float | None = None):
    """The candidate generator of a search of ``k`` whose first list is longer than the
    register lists' (:func:`filter_refusal` accepts it): its first call the threshold filter
    (:func:`_filtered_first_pass`, thresholds from the torch generator over the sample), whose
    hits it re-ranks itself (``_triton_filter.long_list_topk``, with the block's ``stats`` and
    the search's ``cap``: a ``_gpu_search.Ranked`` round); every later call (a widening round, seeded) the torch
    generator, which also makes the first list where the filter cannot run."""
    from . import _gpu_search as gs
    from ._gpu_bound import TargetStats, key_error_bound

    first = True

    def candidates(q, t, n_cand, seed=None, lower=False):
        nonlocal first
        if first:
            first = False
            from ._triton_filter import long_list_topk

            # Long lists rank by plain keys (uses_lower_keys); the first round's seed is the
            # cap's limit.
            bound = key_error_bound(q, stats or TargetStats.of(t), q.metric)

            def ranked(r0, r1, count, buf, threshold):
                return long_list_topk(q.take(slice(r0, r1)), t, count, buf, threshold, k, bound[r0:r1], cap,
                                      None if seed is None else seed[r0:r1])

            got = _filtered_first_pass(q, t, n_cand, None, seed, lower, buffer_bytes, ranked=ranked)
            if got is not None:
                return got
        return gs.torch_candidates(q, t, n_cand, lower=lower, seed=seed)

    return candidates


def knn_torch(queries, targets, k: int, metric: str = "l2", precision: str = "auto",
              *, cap: float | None = None):
    """Exact k nearest targets of every query row, for torch tensors (CUDA or CPU).

    Parameters
    ----------
    queries, targets : torch.Tensor (nq, d), (nt, d), float32/float64/bfloat16, one device
    k : int >= 1
    metric : {"l2", "sqeuclidean", "inner_product", "cosine"}
    precision : {"auto", "fp32", "tf32", "bf16"}
        Operands of the candidate pass; results are exact float32 in every precision.
        ``auto``: bf16 on GPUs of compute capability >= 8.0, else fp32 (:func:`resolve_precision`).
    cap : float or None
        Only targets within it rank (inclusive: a distance ``<= cap``, a similarity
        ``>= cap``, by the pair's float64 value); a row may then have fewer than k.

    Returns
    -------
    values : float32 tensor (nq, k), indices : int64 tensor (nq, k), on the inputs' device.
    Same contract as :func:`nearest_kernels.knn` (order, ties, missing slots, rows that
    cannot rank).

    Raises
    ------
    TypeError, ValueError
        Not tensors, wrong shapes or dtypes, different devices, k < 1, unknown options.
    """
    if torch is None:
        raise RuntimeError(_TORCH_ERROR)
    for name, x in (("queries", queries), ("targets", targets)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D tensor (rows, dimension), got shape {tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a floating-point dtype, got {x.dtype}")
    if queries.shape[1] != targets.shape[1]:
        raise ValueError(f"targets: expected dimension {queries.shape[1]} (the dimension of "
                         f"queries), got {targets.shape[1]}")
    if queries.device != targets.device:
        raise ValueError(f"targets: expected device {queries.device} (the queries'), got {targets.device}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k: expected an integer >= 1, got {k!r}")
    cap = check_cap(cap)
    compile_first_pass(queries.shape[0], targets.shape[0], queries.shape[1], int(k), metric, precision,
                       queries.device, (str(queries.dtype)[6:], str(targets.dtype)[6:]))
    prepared = prepare_targets(targets, metric, precision)
    return search_prepared(queries, prepared, int(k), cap=cap)


def cuda_device(device) -> "torch.device":
    """``device`` option -> torch.device: an ordinal, "cuda:N", or None for the current one."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, (int, np.integer)) and not isinstance(device, bool):
        dev = torch.device("cuda", int(device))
    elif isinstance(device, str):
        dev = torch.device(device)
    else:
        raise ValueError(f"device: expected a CUDA ordinal, 'cuda:N' or None, got {device!r}")
    if dev.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {dev}")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device: expected an ordinal in [0, {torch.cuda.device_count()}), got {index}")
    return torch.device("cuda", index)


class GpuBackend:
    """``knn(..., backend="gpu")``: numpy in, numpy out, computed on one CUDA device."""

    name = "gpu"
    devices = ("cuda",)
    dtypes = ("float32", "float64")   # float64 rows are re-ranked from float64; values are float32
    metrics = ("l2", "sqeuclidean", "inner_product", "cosine")
    max_k = None                      # k beyond the fused kernel's lists runs the torch path
    caps = True                       # knn's ``cap``: the searches' limit from the first pass

    def refuse_task(self) -> str | None:
        """Why no search of this process can run here (no torch, no CUDA device), or None."""
        if torch is None:
            return _TORCH_ERROR
        if not torch.cuda.is_available():
            return f"no CUDA device (torch {torch.__version__})"
        return None

    def refuse(self, queries, targets, k, metric: Metric, **options) -> str | None:
        _check_precision(options.get("precision", "auto"))
        reason = self.refuse_task()
        if reason is not None:
            return reason
        if queries.dtype not in (np.float32, np.float64):
            return f"dtype {queries.dtype} is not float32/float64"
        cuda_device(options.get("device"))
        return None

    def explain(self, queries, targets, k, metric, **options) -> str:
        """Which precision and implementation would run, and why the ones before it refused."""
        dev = cuda_device(options.get("device"))
        precision = resolve_precision(options.get("precision", "auto"), dev)
        chosen, reasons = choose(k, precision, dev)
        return f"{precision} {chosen.name}" + "".join(f"; {r}" for r in reasons)

    def run(self, queries, targets, k, metric: Metric, **options):
        dev = cuda_device(options.get("device"))
        precision = resolve_precision(options.get("precision", "auto"), dev)
        with torch.cuda.device(dev):
            # float64 rows stay float64: the working frame and the re-rank read them as given.
            q = torch.from_numpy(np.ascontiguousarray(queries)).to(dev, non_blocking=True)
            t = torch.from_numpy(np.ascontiguousarray(targets)).to(dev, non_blocking=True)
            v, i = knn_torch(q, t, k, resolve_metric(metric).name, precision,
                             cap=options.get("cap"))
            return v.cpu().numpy(), i.cpu().numpy()


BACKEND = GpuBackend()
