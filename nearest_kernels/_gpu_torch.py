"""Torch half of the GPU backend: operand preparation, the error bound, candidates, re-rank.

Every GPU search runs in two stages that share this module:

1. **Candidates.** A low-precision pass (the fused Triton kernel, or :func:`torch_candidates`:
   tiled ``addmm`` + ``topk``) returns, per query, the ``n_cand`` best targets by an
   approximate *key* (smaller is better; see :func:`key_alpha`).
2. **Exact re-rank.** :func:`exact_topk` recomputes the candidates' values in float64 from
   the input rows, checks with a rigorous error bound that no true neighbour can lie
   outside the candidate list, widens the list for the rows where it could (switching rows
   whose bound admits too much of the block to float32 operands), and sorts by
   (value, target index): ties go to the lower index, as in every backend.

Runs on CUDA and on CPU tensors (the tests here have no GPU). Imports neither pyspark nor
pandas.

Working frame (:class:`Frame`, :func:`working_frame`)
-----------------------------------------------------
The rounding error of a product grows with the norms of its operands, not with the spread
of the data: on rows ``10 + 0.1 x noise`` the norms are 100 times the distances, a bf16 key
carries an error 10^4 times a distance's, and the candidate margin admits the whole block.
So every search works in its target block's frame: both sides are shifted by the block's
float64 mean ``c`` and scaled by a power of two ``s`` (exact) that brings the largest
``|t - c|`` into [1/2, 1), and rounded once to float32 from float64 (the working rows,
``PreparedSide.exact``); the operands are those rows rounded to tf32 / bf16. l2 and
sqeuclidean are translation-invariant. Cosine ranks by ``|q/|q| - t/|t||^2 = 2 - 2 cos``:
the unit rows (normalised in float64) are shifted the same way, so nearly parallel vectors
keep their precision. Inner product ranks ``q . t`` as ``q . (t - c)`` (``q . c`` is the
same for every target of a row): the targets are shifted, each query row is scaled by its
own power of two instead (a positive factor per row never changes its order). Norms,
residuals and the bound below are all those of the working rows, so they follow the spread.

The re-rank (:func:`exact_values`, ``_gpu_triton.triton_exact_values``) computes each value
in working units from the *source* rows (float32 or float64, as given) in float64:
``sum((f_q q - f_t t)^2)`` with each side's factor (``s``, or ``s / |x|`` for cosine), or
``sum(f_q q * s (t - c))``, rounded once to float32. Every scaled coordinate is O(1): no
square over- or underflows for float32 elements of 1e-24 or 1e20, or float64 ones of 1e30.
:func:`final_values` maps them back in float64 (``sqrt(W) / s``, ``W / s^2``,
``1 - W / (2 s^2)``, ``W / (f_q s) + q . c``), so values are +-inf only where the true value
exceeds float32's range. Query rows more than FAR_NORM block extents away (l2 only) are
searched apart in float64 (:func:`far_topk`).

The error bound (:func:`key_error_bound`)
-----------------------------------------
Let ``q``, ``t`` be the float32 working rows and ``q^``, ``t^`` the operands the product
sees (float32 itself, or rounded to nearest tf32 / bf16 *by us*, so the rounding is known;
tensor cores would otherwise truncate tf32). With ``r_q = |q^ - q|`` and ``r_t = |t^ - t|``
(computed exactly per row):

    |q^.t^ - q.t| = |q^.(t^ - t) + (q^ - q).t| <= |q^| r_t + r_q |t|          (Cauchy-Schwarz)

Products of tf32 or bf16 operands are exact in float32 (11 + 11 and 8 + 8 significant
bits); their float32 accumulation over d terms adds at most ``gamma * |q^| |t^|`` with
``gamma = gamma_{d+2}(2^-23) = (d+2) u / (1 - (d+2) u)``, twice the unit roundoff of
round-to-nearest because tensor cores may truncate while accumulating (Fasi et al., 2021,
"Numerical behavior of NVIDIA tensor cores"). A float32 (IEEE) product of float32 operands is
covered by the same gamma with ``r = 0``. A key is ``bias_t - alpha * dot`` with
``bias_t = |t|^2`` (l2 form, cosine included: alpha 2) or 0 (inner product, alpha 1):
``bias_t`` carries at most ``u |t|^2``, the final subtraction one rounding of
``|key| <= |t|^2 + alpha |q||t|``.
The keys are compared with the re-ranked values, which come from the exact (real) working
rows, not from their float32 roundings: each coordinate of a working row is within ``u`` of
it, which moves a squared difference by at most ``2u (|q| + |t|)^2`` (a dot by ``2u |q||t|``),
and the value's own float32 rounding and float64 sum add ``(u + (d + 4) 2^-52)`` of that
size; :func:`key_error_bound` adds ``4u (|q| + |t|)^2`` (l2 form) or ``4u |q||t|`` for both,
and for cosine the difference of the two float64 normalisations (``8 (d + 4) 2^-53 s
(|q| + |t|)``). So the candidate list holds every target that the re-rank could place in
the top k. Per query the bound takes the maximum of each target term over the target block,
and is inflated by 1% for the rounding of the bound's own arithmetic.

With ``E`` that bound and ``theta`` the k-th smallest approximate key of a query, the true
k-th value is at most ``theta + E`` and every target that can rank in the top k has an
approximate key at most ``theta + 2E``. A candidate generator states a *floor* per query:
every target not in its list has approximate key >= floor (for a list of the n_cand best,
the last key; +inf when the list holds every target). A list whose floor exceeds
``theta + 2E`` (or is +inf) provably contains the exact top k.

The re-rank tightens both tests by the values it computes. Let ``V_k`` be the k-th best
float32 value among re-ranked candidates and ``key(V_k)`` its key (``V_k - |q|^2`` for the
l2 family, ``-V_k`` for similarities). A target whose approximate key exceeds
``key(V_k) + E`` has exact key above ``key(V_k)``, so a float32 value worse than ``V_k``
(E covers both errors): it can neither rank nor tie into the top k. Hence

* the re-rank first computes the k best-by-key candidates' values (their worst is an upper
  bound ``V0`` of the final ``V_k``) and skips every column whose key exceeds
  ``key(V0) + E``;
* a list whose floor exceeds ``key(V_k) + E`` is proven. Since ``V_k`` lies within the
  *actual* error of ``theta``, not within ``E``, this margin is about half the key-only one:
  on Gaussian data (d=128, 10^6 targets) a bf16 list of 16 proves 89% of the rows at k=10
  against 36%, a list of 128 66% at k=100 against none.

``|q|^2`` enters rounded down and every limit is summed in float64, then rounded up to
float32, so no comparison rounds in the proof's favour.

Per-target bounds (``lower=True``)
----------------------------------
In bf16 the residual terms ``alpha (|q^| r_t + r_q |t|)`` are ~98% of ``E``, and ``E`` takes
them at the block's largest ``r_t`` and ``|t|`` (1.55x and 1.31x the median on Gaussian
d=128 data). A generator may instead rank by the *lower key*

    L = key - (|q^| w1_t + r_q w2_t),    w1_t = alpha S r_t,   w2_t = alpha S |t|

(:func:`lower_key_weights`; ``S`` the 1% inflation, every weight rounded up): with
``E' = E - alpha S (|q^| max r_t + r_q max |t|)`` plus the roundings of the two extra
products (:func:`lower_key_bound`), every exact key is at least ``L - E'``. The re-ranked
tests above need only that direction, so they hold with ``L`` for the keys and ``E'`` for
``E``; the keys-only test (which needs the upper direction too) is not used. On Gaussian data
(d=128, 10^6 targets, simulated) a bf16 list of 128 at k=100 then proves 99.6% of the rows
against 71%, a list of 16 at k=10 99.6% against 95%.

The torch path subtracts each pair's terms (:func:`lower_key_weights`). The fused kernel,
where two more FMAs per key would slow the pass noticeably (benchmarks/gpu_notes.md), uses a rank-1 form with one bias
row per program instead (:func:`lower_bias_table`): rows sorted by their factor share a
level, and the keys cost what plain keys cost. Simulated, it keeps most of the gain (a list
of 128 at k=100: 99.2% of the rows proven with rows sorted, 97.3% unsorted).


Distance caps (``exact_topk(cap=)``)
------------------------------------
A cap (inclusive: a distance ``<= cap``, a similarity ``>= cap``) is a value ``V_cap`` in
working units per row (:func:`cap_values`, rounded outwards), and the re-ranked tests above
hold for it as for ``V_k``: a target whose key exceeds ``key(V_cap) + E`` (``value_limit``)
is beyond the cap. That limit is the searches' threshold from the first round: it seeds the
first candidate lists (the fused kernel then never keeps a key above it), candidates above it
are not re-ranked, and a row is proven when its floor exceeds the lesser of its k-th limit and
the cap's, so a row with fewer than k targets within the cap is proven by the cap. The
candidates below the limit are decided by their float64 values (:func:`pair_values64`), as
the cpu kernel decides them, before they are ranked: ranking is by float32 values, and a pair
beyond the cap whose float32 value equals that of one within it must not take its slot.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "tf32", "bf16")
U32 = 2.0 ** -24                  # unit roundoff of float32 round-to-nearest
_SAFETY = 1.01                    # inflation for the rounding of the bound's own arithmetic

# Candidate-list width per precision: next power of two >= k + extra(k). The widths cover
# the margin on unclustered data (simulated on Gaussian d=128, 10^6 targets: the margin held
# at most 15 / 28 targets for k=10 in tf32 / bf16 and 112 / 179 for k=100); rows where the
# bound says a neighbour could be missing are widened (:func:`widened`), then left to the
# torch path. Without lower keys bf16 from k = 64 starts at the plain width: the seeded
# widening rounds finish the unproven rows for less than a wider first list costs, while at
# small k the wider first list is cheaper (benchmarks/gpu_notes.md).
_EXTRA = {
    "fp32": lambda k: 1,
    "tf32": lambda k: k // 8 + 4,
    "bf16": lambda k: k if k < 64 else 0,
}
# With lower keys (``gpu.LOWER_KEYS``) the first list is the plain width (no extra): few
# enough rows are left unproven that a widening round over them costs less than a wider list.
MIN_CANDIDATES = 8
WIDEN_FACTOR = 4
# Lists of at most SHORT_LIST candidates widen SHORT_WIDEN-fold: the rows a bf16 list of 16
# leaves unproven at k=10 a list of 32 proves, for less than one of 64 costs. Longer lists
# widen WIDEN_FACTOR-fold: from k=100's list of 128, 512 proves the unproven rows in one round
# where 256 leaves a few to a third (benchmarks/gpu_notes.md).
SHORT_LIST = 32
SHORT_WIDEN = 2
# Widening rounds over at most this many rows run the torch generator (one addmm + topk over
# the targets) instead of the fused kernel (``exact_topk(few_rows=)``, passed by
# ``gpu.search_prepared``): for a handful of rows a fused pass is mostly fixed costs.
TORCH_ROUND_ROWS = 64


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def candidate_width(k: int, precision: str, lower: bool = False) -> int:
    """Width of the first candidate list for ``k`` results in ``precision``; ranked by lower
    keys (``lower``), the plain width: they prove nearly every row from it (module notes)."""
    return max(MIN_CANDIDATES, next_pow2(k + (0 if lower else _EXTRA[precision](k))))


def widened(n_cand: int) -> int:
    """The next round's list width for rows a list of ``n_cand`` left unproven."""
    return n_cand * (SHORT_WIDEN if n_cand <= SHORT_LIST else WIDEN_FACTOR)


def gamma(d: int) -> float:
    """gamma_{d+2}(2^-23): the accumulation factor of the bound (see the module notes)."""
    n_u = (d + 2) * 2.0 ** -23
    return n_u / (1.0 - n_u)


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest tf32 value (10 explicit mantissa bits, ties even).

    Done here rather than by the tensor cores, which truncate: the residual ``x^ - x`` is
    then known exactly and the products of two rounded values are exact in float32.
    """
    bits = x.contiguous().view(torch.int32)
    bits = bits + (0xFFF + ((bits >> 13) & 1))
    return (bits & ~0x1FFF).view(torch.float32)


# ----------------------------------------------------------------------------- working frame
# Rows per chunk of the float64 preparation work (a chunk's float64 temporaries are a few
# times CHUNK_ELEMENTS values): a block of 10^6 x 128 takes 8 chunks.
PREP_CHUNK_ELEMENTS = 1 << 24
# Absolute slack for working-row components that round to float32 subnormals or zero (each at
# most 2^-150 off; keys and values of the working frame are O(1)).
_TINY = 2.0 ** -120


def l2_form(metric: str) -> bool:
    """Whether ``metric`` ranks by a squared difference in the working frame: l2, sqeuclidean,
    and cosine (the squared difference of the unit rows, 2 - 2 cos). Inner product ranks by
    the dot product of its working rows."""
    return metric != "inner_product"


@dataclass(frozen=True)
class Frame:
    """The working coordinates of a target block's searches (module notes, "Working frame").

    A row ``x`` works as ``scale * (x - center)`` (cosine: its unit row ``x / |x|``; inner
    product queries: ``query_scale(x) * x``, not shifted). ``center`` is a float64 (d,) tensor
    or None (the origin); ``scale`` a power of two, so scaling is exact. ``row_scaled``: inner
    product queries get their own power of two each (a positive factor per row never changes
    its ranking). :meth:`identity` (no shift, no scale) is what :func:`prepare_side` uses
    without a frame: both sides of a search must be prepared with the same frame.
    """

    center: torch.Tensor | None = None
    scale: float = 1.0
    row_scaled: bool = False
    center_norm: float = 0.0       # |center| (float64): bounds how far a query row can work

    @classmethod
    def identity(cls) -> "Frame":
        return cls()


def pow2_below(x: float) -> float:
    """The power of two ``2^-e`` with ``x * 2^-e`` in [1/2, 1) (x > 0 finite)."""
    return math.ldexp(1.0, -math.frexp(x)[1])


def _unit64(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unit rows float64, 1 / |row| float64): each row divided by its largest magnitude first,
    so that no square over- or underflows (float64 elements from 1e-300 to 1e300)."""
    x = rows.double()
    peak = x.abs().amax(dim=1, keepdim=True) if x.shape[1] else torch.ones((x.shape[0], 1), dtype=x.dtype,
                                                                           device=x.device)
    peak = torch.where(peak > 0, peak, 1.0)
    y = x / peak
    inv = 1.0 / torch.linalg.vector_norm(y, dim=1, keepdim=True)
    return y * inv, (inv / peak).flatten()


def _chunks(n: int, d: int):
    rows = max(1, PREP_CHUNK_ELEMENTS // max(1, d))
    for r0 in range(0, n, rows):
        yield r0, min(n, r0 + rows)


def working_frame(targets: torch.Tensor, metric: str) -> Frame:
    """The frame of a target block (rows finite; non-zero for cosine): ``center`` the float64
    mean of the rows (of the unit rows for cosine), ``scale`` the power of two that brings the
    largest ``|t - center|`` into [1/2, 1). Where every row equals the centre, the scale comes
    from the centre's largest magnitude (or is 1). One host sync (the scale)."""
    n, d = targets.shape
    if n == 0 or d == 0:
        return Frame(None, 1.0, metric == "inner_product")
    total = torch.zeros(d, dtype=torch.float64, device=targets.device)
    for r0, r1 in _chunks(n, d):
        rows = _unit64(targets[r0:r1])[0] if metric == "cosine" else targets[r0:r1].double()
        total += rows.sum(dim=0)
    center = total / n
    extent = torch.zeros((), dtype=torch.float64, device=targets.device)
    for r0, r1 in _chunks(n, d):
        rows = _unit64(targets[r0:r1])[0] if metric == "cosine" else targets[r0:r1].double()
        extent = torch.maximum(extent, torch.linalg.vector_norm(rows - center, dim=1).max())
    extent, peak, center_norm = torch.stack([extent, center.abs().max(),
                                             torch.linalg.vector_norm(center)]).tolist()
    if not (extent > 0 and math.isfinite(extent)):
        extent = peak if peak > 0 and math.isfinite(peak) else 1.0
    return Frame(center, pow2_below(extent), metric == "inner_product", center_norm)


# Query rows whose working norm exceeds this are searched apart (:func:`far_topk`): their
# squared working distances (up to (FAR_NORM + 1)^2 < 2^128) would leave float32's range.
FAR_NORM = 2.0 ** 60


def may_be_far(metric: str, frame: Frame, peak: float, d: int) -> bool:
    """Whether some query row whose largest magnitude is at most ``peak`` could work beyond
    FAR_NORM: ``scale (|q| + |center|)`` bounds its working norm. Never for cosine (unit rows)
    or inner product (rows scaled each by its own power of two). NaN ``peak``: maybe."""
    if metric not in ("l2", "sqeuclidean"):
        return False
    reach = frame.scale * (peak * math.sqrt(max(1, d)) + frame.center_norm)
    return not reach <= FAR_NORM / 2


def far_rows(queries: PreparedSide) -> torch.Tensor | None:
    """Boolean mask of the query rows beyond FAR_NORM (their float32 working norm, +inf where
    it overflowed), or None when there is none (one host sync)."""
    far = ~(queries.norm <= FAR_NORM)
    return far if bool(far.any()) else None


def far_topk(queries: PreparedSide, targets: PreparedSide, k: int,
             chunk_elements: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values float32, indices int64) of l2 / sqeuclidean query rows far from the block
    (FAR_NORM), in float64: each row is scaled by its own power of two ``r`` (``r |q - c|``
    in [1/2, 1)) and ranks by ``r |t - c|^2 - 2 r (q - c).(t - c)`` (a float64 product; for a
    far row its error, ~d 2^-52 r |q - c| |t - c|, is far inside RTOL of the shifted
    problem's size ~|q - c|^2), ties to the lower index; the values of the k best come from
    the float64 difference form. Rows far from the block are rare: nothing here is tuned."""
    m, nt, d = queries.rows, targets.rows, queries.dim
    device = queries.exact.device
    center = targets.frame.center
    q = queries.source.double()
    qc = q if center is None else q - center
    spread = torch.linalg.vector_norm(qc, dim=1)
    exp = torch.frexp(torch.where(spread > 0, spread, 1.0))[1]
    r = torch.ldexp(torch.ones_like(spread), -exp.to(torch.float64))
    qr = qc * r[:, None]
    width = min(k, nt)
    vals = torch.empty((m, 0), dtype=torch.float64, device=device)
    idx = torch.empty((m, 0), dtype=torch.int64, device=device)
    t_chunk = max(width, chunk_elements // max(1, m, d))
    for t0 in range(0, nt, t_chunk):
        t1 = min(nt, t0 + t_chunk)
        tc = targets.source[t0:t1].double()
        tc = tc if center is None else tc - center
        keys = (tc * tc).sum(dim=1)[None, :] * r[:, None] - 2.0 * (qr @ tc.T)
        vals = torch.cat([vals, keys], dim=1)
        idx = torch.cat([idx, torch.arange(t0, t1, device=device).expand(m, -1)], dim=1)
        order = best_order(vals, idx, width, descending=False)
        vals, idx = torch.gather(vals, 1, order), torch.gather(idx, 1, order)
    diff = (q[:, None, :] - targets.source[idx].double()) * r[:, None, None]
    w = (diff * diff).sum(dim=2)
    out = torch.sqrt(w) / r[:, None] if queries.metric == "l2" else w / r[:, None] / r[:, None]
    out_v = torch.full((m, k), math.inf, dtype=torch.float32, device=device)
    out_i = torch.full((m, k), -1, dtype=torch.int64, device=device)
    out_v[:, :width] = out.to(torch.float32)
    out_i[:, :width] = idx
    return out_v, out_i


# ----------------------------------------------------------------------------- preparation
@dataclass
class PreparedSide:
    """One side's tensors for a search, computed once (a target block stays on the device).

    ``source`` the rows as given (float32 or float64: the re-rank's input); ``exact`` the
    float32 working rows (``frame``; unit rows for cosine), what the bound calls exact;
    ``operand`` what the low-precision product reads (float32, tf32-rounded float32, or
    bfloat16); ``norm`` and ``operand_norm`` are ``|exact|`` and ``|operand|`` (rounded up);
    ``residual`` is ``|operand - exact|``; ``bias`` is ``|exact|^2`` for the l2 form
    (:func:`l2_form`), 0 otherwise (used on the target side). ``factor`` (float64, per row)
    maps a source row to working units in the re-rank (:func:`exact_values`): ``scale``,
    ``scale / |x|`` (cosine) or the row's power of two (inner product queries); ``offset``
    (inner product queries) is ``q . center``, float64, added back to the values.
    """

    exact: torch.Tensor
    operand: torch.Tensor
    norm: torch.Tensor
    operand_norm: torch.Tensor
    residual: torch.Tensor
    bias: torch.Tensor
    metric: str
    precision: str
    source: torch.Tensor | None = None
    factor: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    frame: Frame = field(default_factory=Frame.identity)
    # Derived tensors computed once per prepared side: a block's lower-key weights, rows'
    # rank-1 form and bias tables (carried to widened rows by exact_topk, not by take), the
    # float32 view of a low-precision block (:meth:`as_fp32`).
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def rows(self) -> int:
        return self.exact.shape[0]

    @property
    def dim(self) -> int:
        return self.exact.shape[1]

    def take(self, rows: torch.Tensor) -> "PreparedSide":
        """The prepared rows ``rows``, an index tensor or a slice (widening re-runs a subset
        of the queries)."""
        return PreparedSide(self.exact[rows], self.operand[rows], self.norm[rows],
                            self.operand_norm[rows], self.residual[rows], self.bias[rows],
                            self.metric, self.precision, self.source[rows], self.factor[rows],
                            None if self.offset is None else self.offset[rows], self.frame)

    def as_fp32(self) -> "PreparedSide":
        """The same rows with IEEE float32 operands: the working rows themselves (no copy),
        residual 0. The precision that low-precision rows switch to when their bound admits
        too many targets (:func:`exact_topk`). Kept in the cache for a target block."""
        if self.precision == "fp32":
            return self
        view = self.cache.get("fp32")
        if view is None:
            view = PreparedSide(self.exact, self.exact, self.norm, self.norm,
                                torch.zeros_like(self.residual), self.bias, self.metric, "fp32",
                                self.source, self.factor, self.offset, self.frame)
            self.cache["fp32"] = view
        return view


def _up32(norm64: torch.Tensor) -> torch.Tensor:
    """float64 norms to float32, inflated so that they never round down (the bound's inputs)."""
    return (norm64 * (1 + 4 * U32)).to(torch.float32)


def prepare_side(x: torch.Tensor, metric: str, precision: str, frame: Frame | None = None,
                 *, queries: bool = False) -> PreparedSide:
    """Working rows, operands, norms and residuals of one side (rows must be finite; non-zero
    for cosine), in ``frame`` (default :meth:`Frame.identity`; a search prepares its target
    block with :func:`working_frame` and its queries with that frame: :func:`prepare_queries`).
    ``queries``: the query side (inner product queries are scaled per row, not shifted).
    Computed in float64 chunk by chunk, then rounded once to float32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {list(PRECISIONS)}, got {precision!r}")
    frame = frame or Frame.identity()
    source = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    source = source.contiguous()
    n, d = source.shape
    device = source.device
    l2 = l2_form(metric)
    exact = torch.empty((n, d), dtype=torch.float32, device=device)
    factor = torch.empty(n, dtype=torch.float64, device=device)
    offset = torch.zeros(n, dtype=torch.float64, device=device) if (queries and not l2) else None
    center = frame.center
    for r0, r1 in _chunks(n, d):
        if metric == "cosine":
            rows, inv = _unit64(source[r0:r1])
            factor[r0:r1] = inv * frame.scale
        else:
            rows = source[r0:r1]
            factor[r0:r1] = frame.scale
        if queries and not l2:
            # q . t ranks as q . (t - center): the query is not shifted; its own power of two
            # keeps the product in range (a positive factor per row leaves its order alone).
            rows = rows.double()
            if center is not None:
                offset[r0:r1] = rows @ center
            if frame.row_scaled:
                peak = rows.abs().amax(dim=1) if d else torch.ones(r1 - r0, dtype=torch.float64, device=device)
                exp = torch.frexp(torch.where(peak > 0, peak, 1.0))[1]
                factor[r0:r1] = torch.ldexp(torch.ones_like(peak), -exp.to(torch.float64))
            else:
                factor[r0:r1] = 1.0
            work = rows * factor[r0:r1, None]
        else:
            # float32 rows promote to float64 inside the subtraction (no separate copy)
            work = rows.double() if center is None else rows - center
            work = work.mul_(frame.scale) if work is not rows else work * frame.scale
        exact[r0:r1] = work
    if precision == "fp32":
        operand = exact
    elif precision == "tf32":
        operand = round_to_tf32(exact)
    else:
        operand = exact.to(torch.bfloat16)
    norm = torch.empty(n, dtype=torch.float32, device=device)
    operand_norm = torch.empty_like(norm)
    residual = torch.empty_like(norm)
    bias = torch.zeros_like(norm)
    for r0, r1 in _chunks(n, d):
        norm64 = torch.linalg.vector_norm(exact[r0:r1], dim=1, dtype=torch.float64)
        norm[r0:r1] = _up32(norm64)
        if precision == "fp32":
            operand_norm[r0:r1] = norm[r0:r1]
            residual[r0:r1] = 0.0
        else:
            operand_norm[r0:r1] = _up32(torch.linalg.vector_norm(operand[r0:r1], dim=1, dtype=torch.float64))
            # A float32 value less its tf32 / bf16 rounding is exact in float32.
            residual[r0:r1] = _up32(torch.linalg.vector_norm(operand[r0:r1] - exact[r0:r1], dim=1,
                                                             dtype=torch.float64))
        if l2:
            bias[r0:r1] = (norm64 * norm64).to(torch.float32)
    return PreparedSide(exact, operand, norm, operand_norm, residual, bias, metric, precision,
                        source, factor, offset, frame)


def prepare_targets_side(targets: torch.Tensor, metric: str, precision: str) -> PreparedSide:
    """A target block in its own working frame (:func:`working_frame`)."""
    return prepare_side(targets, metric, precision, working_frame(targets, metric))


def prepare_queries(queries: torch.Tensor, targets: PreparedSide) -> PreparedSide:
    """Query rows in the frame, metric and precision of a prepared target block."""
    return prepare_side(queries, targets.metric, targets.precision, targets.frame, queries=True)


def prepare_pair(queries: torch.Tensor, targets: torch.Tensor, metric: str,
                 precision: str) -> tuple[PreparedSide, PreparedSide]:
    """(queries, targets) prepared for one search, in the targets' working frame."""
    ts = prepare_targets_side(targets, metric, precision)
    return prepare_queries(queries, ts), ts


def is_similarity(metric: str) -> bool:
    """Whether ``metric`` is a similarity (best first is largest): cosine, inner product."""
    return metric in ("cosine", "inner_product")


def key_alpha(metric: str) -> float:
    """Keys are ``bias_t - alpha * dot``: alpha 2 for the l2 form, 1 for inner product."""
    return 2.0 if l2_form(metric) else 1.0


@dataclass(frozen=True)
class TargetStats:
    """Maxima over a target block of the terms the bound needs (plain floats), and the
    block's frame scale (the cosine term of the bound)."""

    norm: float
    operand_norm: float
    residual: float
    sq_norm: float
    scale: float = 1.0

    @classmethod
    def of(cls, targets: PreparedSide) -> "TargetStats":
        if targets.rows == 0:
            return cls(0.0, 0.0, 0.0, 0.0, targets.frame.scale)
        n = float(targets.norm.max())
        return cls(n, float(targets.operand_norm.max()), float(targets.residual.max()), n * n,
                   targets.frame.scale)

    def as_fp32(self) -> "TargetStats":
        """The stats of :meth:`PreparedSide.as_fp32`: operands are the working rows."""
        return TargetStats(self.norm, self.norm, 0.0, self.sq_norm, self.scale)


def key_error_bound(queries: PreparedSide, stats: TargetStats, metric: str) -> torch.Tensor:
    """Per-query bound E on |approximate key - key of the re-ranked value| (module notes)."""
    g = gamma(queries.dim)
    a = key_alpha(metric)
    qn, qop, rq = queries.norm.double(), queries.operand_norm.double(), queries.residual.double()
    T, Top, Rt, T2 = stats.norm, stats.operand_norm, stats.residual, stats.sq_norm
    # The product of the operands against that of the working rows, and its accumulation.
    dot_err = qop * Rt + rq * T + g * qop * Top
    # The key's one rounding (|key| <= |t|^2 + alpha |q||t|) and the bias's.
    bound = a * dot_err + 2 * U32 * (T2 + a * qn * T)
    if l2_form(metric):
        # Working rows against the exact shifted rows (each coordinate rounded once: the
        # squared differences move by <= 2u (|q| + |t|)^2) and the re-ranked value's float32
        # rounding and float64 sum (<= (u + (d + 4) 2^-52) (|q| + |t|)^2).
        bound = bound + 4 * U32 * (qn + T) ** 2
        if metric == "cosine":
            # The float64 unit rows of the preparation and of the re-rank, computed apart.
            bound = bound + 8 * (queries.dim + 4) * 2.0 ** -53 * stats.scale * (qn + T)
    else:
        # Working rows against the exact ones (2u |q||t|), the value's rounding and sum (u + d 2^-52).
        bound = bound + 4 * U32 * qn * T
    bound = bound + _TINY * (1 + qn + T) ** 2
    return (bound * _SAFETY).to(torch.float32)


def _round_up32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, never below the float64 value."""
    y = x.to(torch.float32)
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def lower_target_weights(targets: PreparedSide) -> torch.Tensor:
    """The target half of :func:`lower_key_weights`, float32 (2, nt), computed once per
    prepared target block (its cache): every search of the block's EXACT lower keys reads it."""
    cached = targets.cache.get("lower_w")
    if cached is None:
        a = key_alpha(targets.metric) * _SAFETY
        cached = torch.stack([_round_up32(targets.residual.double() * a),
                              _round_up32(targets.norm.double() * a)]).contiguous()
        targets.cache["lower_w"] = cached
    return cached


def lower_key_weights(queries: PreparedSide, targets: PreparedSide) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query (2, m) and per-target (2, nt) float32 weights of the lower key (module notes):
    ``L = key - q_w[0] t_w[0] - q_w[1] t_w[1]``, every weight rounded up."""
    q_w = torch.stack([queries.operand_norm, queries.residual])
    return q_w.contiguous(), lower_target_weights(targets)


def lower_rank1(queries: PreparedSide) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-1 form of the lower key's query side: ``(c float64 (m,), rho float64 0-dim)`` with
    ``c_i t_w[0] + c_i rho t_w[1] >= q_w[0, i] t_w[0] + q_w[1, i] t_w[1]`` for every target:
    ``rho`` the largest ``r_q / |q^|`` of the rows, ``c = max(|q^|, r_q / rho)``.
    Tensors only (no host sync): a search queues its whole round behind the candidate pass.
    Computed once per prepared side (its cache): a round's bound and bias table share it."""
    cached = queries.cache.get("rank1")
    if cached is not None:
        return cached
    qop, rq = queries.operand_norm.double(), queries.residual.double()
    if queries.rows:
        pos = qop > 0
        rho = torch.where(pos, rq / torch.where(pos, qop, 1.0), 0.0).max()
    else:
        rho = torch.zeros((), dtype=torch.float64, device=qop.device)
    rho = torch.clamp(rho * (1 + 2.0 ** -40), min=2.0 ** -40)
    queries.cache["rank1"] = torch.maximum(qop, rq / rho), rho
    return queries.cache["rank1"]


def lower_shift(queries: PreparedSide, stats: TargetStats, metric: str) -> torch.Tensor:
    """The most any lower key of these rows lies below its key (rank-1 form, levels rounded
    up by at most the top level): what the roundings of a shifted key are relative to.
    float64 0-dim tensor (no host sync)."""
    if queries.rows == 0:
        return torch.zeros((), dtype=torch.float64, device=queries.exact.device)
    c, rho = lower_rank1(queries)
    return c.max() * (key_alpha(metric) * _SAFETY) * (stats.residual + rho * stats.norm) * (1 + 2.0 ** -20)


def lower_key_bound(queries: PreparedSide, stats: TargetStats, metric: str) -> torch.Tensor:
    """``E'`` per query: the bound left for keys ranked by the lower key.

    :func:`key_error_bound` less its residual terms, plus four float32 roundings of a value
    at most ``|key|`` + the largest shift (:func:`lower_shift`): the products and
    subtractions of the lower key (torch; the fused kernel's table is rounded down)."""
    a = key_alpha(metric)
    qn, qop, rq = queries.norm.double(), queries.operand_norm.double(), queries.residual.double()
    residual = a * (qop * stats.residual + rq * stats.norm) * _SAFETY
    full = key_error_bound(queries, stats, metric).double()
    shift = torch.clamp(lower_shift(queries, stats, metric), min=0.0)
    rounding = 4 * U32 * (stats.sq_norm + a * qn * stats.norm + residual + shift)
    rest = torch.clamp(full - residual, min=0.0) + rounding * _SAFETY
    return _round_up32(rest)


# Bias levels of the fused kernel's lower keys (:func:`lower_bias_table`), by the first
# list's width: each program reads its level's bias row (nt floats) from L2 beside the target
# tiles, so more levels prove more rows but cost the pass more; short lists, whose pass is
# cheap, gain less from the extra rows proven than the reads cost.
LOWER_LEVELS = 16
LOWER_LEVELS_SHORT = 8      # lists of at most SHORT_LIST candidates


def lower_levels(n_cand: int) -> int:
    """Bias levels of a fused pass for lists of ``n_cand`` (LOWER_LEVELS, or
    LOWER_LEVELS_SHORT for short lists)."""
    return LOWER_LEVELS_SHORT if n_cand <= SHORT_LIST else LOWER_LEVELS


def _round_down32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, never above the float64 value."""
    y = x.to(torch.float32)
    return torch.where(y.double() > x, torch.nextafter(y, torch.full_like(y, -math.inf)), y)


# The bias table is built this many bytes of float64 levels at a time (at least one level):
# one chunk of every level up to 8 levels of 10^6 targets, so few small ops per search (each a
# launch the GPU waits for before the pass), and bounded temporaries for larger blocks.
TABLE_CHUNK_BYTES = 64 << 20


def lower_table_bytes(nt: int) -> int:
    """Device memory of a search's bias table for ``nt`` targets, temporaries included (the
    chunk's float64 rows and their rounding: about three times the chunk)."""
    return nt * 4 * LOWER_LEVELS + 3 * max(TABLE_CHUNK_BYTES, nt * 8)


def lower_bias_table(queries: PreparedSide, targets: PreparedSide, block_m: int,
                     levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Target biases that make the fused kernel's keys lower keys, with no work per key.

    Rank-1 form (:func:`lower_rank1`): every lower key of row i is at least
    ``key - c_i w_t`` with ``w_t = t_w[0] + rho t_w[1]``. A program of ``block_m`` rows
    subtracts ``C w_t`` with C at least its rows' largest c, rounded up to one of ``levels``
    (default ``LOWER_LEVELS``) geometric levels ``top / ratio^n`` (top the largest C, the
    ratio spanning down to the least positive one): its bias is row ``level[program]`` of the
    returned table ``bias_t - C_n w_t`` (float64, rounded down to float32). Callers order
    rows by c (:func:`exact_topk` does) so that a program's rows have nearly equal c.
    Tensors only, every level built: no host sync, so the table and the pass queue behind
    whatever the GPU is running. The table is kept in the rows' cache with the rank-1 form's
    ``rho`` it was built for: rows that :func:`exact_topk` widens carry both on (a subset's
    C never exceeds the top level), so a widening round only assigns its programs' levels.
    Returns (table float32 (levels, nt), rows 16-float aligned, level int32 (programs,)).
    """
    levels = levels or LOWER_LEVELS
    c, rho = lower_rank1(queries)
    device = c.device
    n_blocks = -(-queries.rows // block_m)
    pad = torch.zeros(n_blocks * block_m - queries.rows, dtype=torch.float64, device=device)
    big = torch.cat([c, pad]).view(n_blocks, block_m).max(dim=1).values
    cached = queries.cache.get(("table", levels))
    if cached is not None and cached[2] is rho:
        table, values = cached[0], cached[1]
    else:
        top = big.max()
        low = torch.where(big > 0, big, math.inf).min()        # +inf when no C is positive
        span = torch.where(top > 0, top / low, 1.0)
        ratio = torch.clamp(span ** (1 / max(1, levels - 1)), min=1.01)
        values = top / ratio ** torch.arange(levels, dtype=torch.float64, device=device)
        t_w = lower_target_weights(targets)
        nt = targets.rows
        w = t_w[0].double() + rho * t_w[1].double()
        bias = targets.bias.double()
        # Rows start at multiples of 16 floats (aligned vector loads in the kernel).
        table = torch.empty((levels, -(-nt // 16) * 16), dtype=torch.float32, device=device)[:, :nt]
        step = max(1, TABLE_CHUNK_BYTES // max(1, 8 * nt))    # levels per float64 chunk
        for l0 in range(0, levels, step):
            table[l0:l0 + step] = _round_down32(bias[None, :] - values[l0:l0 + step, None] * w[None, :])
        queries.cache[("table", levels)] = (table, values, rho)
    # A block's level: the last (least) one still >= its C. Levels decrease from values[0],
    # the largest C of the rows the table was built for (a zero C takes the last level).
    n = (values[None, :] >= big[:, None]).sum(dim=1) - 1
    return table, n.clamp(min=0).to(torch.int32)


# ----------------------------------------------------------------------------- candidates
@contextmanager
def _tf32_matmul(enabled: bool):
    """Let cuBLAS use tf32 tensor cores for operands that are tf32- or bf16-exact."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def torch_candidates(queries: PreparedSide, targets: PreparedSide, n_cand: int,
                     *, chunk_elements: int = 1 << 26, lower: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n_cand`` smallest approximate keys per query by tiled ``addmm`` + ``topk``.

    Returns keys float32 (m, n_cand) sorted ascending (+inf in empty slots) and target indices
    int64 (-1 in empty slots). Ties at the list's end may be cut arbitrarily: the margin test
    in :func:`exact_topk` never trusts the last key's ties. ``lower``: rank by the lower key
    (module notes), computed elementwise in float32 (no tf32 rounding of the weights).
    """
    m, nt = queries.rows, targets.rows
    device = queries.exact.device
    width = min(n_cand, nt)
    keys_out = torch.full((m, n_cand), math.inf, dtype=torch.float32, device=device)
    idx_out = torch.full((m, n_cand), -1, dtype=torch.int64, device=device)
    if m == 0 or nt == 0:
        return keys_out, idx_out
    alpha = key_alpha(queries.metric)
    # Operands that hold tf32 / bf16 values multiply exactly in tf32: allow tensor cores.
    low = queries.precision != "fp32"
    q_w, t_w = lower_key_weights(queries, targets) if lower else (None, None)
    # Target chunks also bound the float32 copy of a bf16 operand (chunk_elements floats),
    # whatever the block's size: a widening round over a few rows runs here too.
    t_chunk = max(width, min(nt, chunk_elements // max(1, min(m, 4096)),
                             chunk_elements // max(1, queries.dim)))
    q_chunk = max(1, chunk_elements // t_chunk)
    with _tf32_matmul(low):
        for q0 in range(0, m, q_chunk):
            q1 = min(m, q0 + q_chunk)
            q_op = queries.operand[q0:q1].to(torch.float32)
            best_k = best_i = None
            for t0 in range(0, nt, t_chunk):
                t1 = min(nt, t0 + t_chunk)
                t_op = targets.operand[t0:t1].to(torch.float32)
                keys = torch.addmm(targets.bias[t0:t1], q_op, t_op.T, beta=1.0, alpha=-alpha)
                if lower:
                    keys -= q_w[0, q0:q1, None] * t_w[0, t0:t1]
                    keys -= q_w[1, q0:q1, None] * t_w[1, t0:t1]
                kk = min(width, t1 - t0)
                v, i = torch.topk(keys, kk, dim=1, largest=False, sorted=False)
                i = i + t0
                if best_k is not None:
                    v = torch.cat([best_k, v], dim=1)
                    i = torch.cat([best_i, i], dim=1)
                    if v.shape[1] > width:
                        v, pick = torch.topk(v, width, dim=1, largest=False, sorted=False)
                        i = torch.gather(i, 1, pick)
                best_k, best_i = v, i
            v, order = torch.sort(best_k, dim=1)
            keys_out[q0:q1, :width] = v
            idx_out[q0:q1, :width] = torch.gather(best_i, 1, order)
    return keys_out, idx_out


# candidates(queries, targets, n_cand) -> (keys, idx) or (keys, idx, floor): keys float32
# (m, n_cand) ascending (+inf empty), idx int64 (-1 empty), floor float32 (m,) with every
# target not in a row's list at approximate key >= floor (-inf: the row is not proven). Without a floor the list must be the
# row's n_cand best (floor = its last key). Generators that :func:`exact_topk` calls with
# ``lower=True`` rank by the lower key instead (:func:`lower_key_weights`).
CandidateFn = Callable[[PreparedSide, PreparedSide, int], tuple]


# ----------------------------------------------------------------------------- re-rank
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


def margin_limit(theta: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """``theta + 2 * bound`` rounded up to float32: comparisons against it never round in
    the proof's favour (summed in float64, then one float32 step up)."""
    limit = (theta.double() + 2 * bound.double()).to(torch.float32)
    return torch.nextafter(limit, torch.full_like(limit, math.inf))


def margin_holds(keys: torch.Tensor, bound: torch.Tensor, k: int,
                 floor: torch.Tensor | None = None) -> torch.Tensor:
    """Rows whose candidate list provably holds the exact top k (module notes).

    ``floor``: every target not in the row's list has approximate key >= floor. By default
    the last key: a sorted list of the row's n_cand best, whose last slot is +inf (empty)
    when it holds every target of the block.
    """
    if floor is None:
        floor = keys[:, -1]
    if keys.shape[1] < k:   # too short for k results: only a list of every target will do
        return torch.isposinf(floor)
    return torch.isposinf(floor) | (floor > margin_limit(keys[:, k - 1], bound))


def value_limit(values_k: torch.Tensor, bound: torch.Tensor, queries: PreparedSide) -> torch.Tensor:
    """``key(V) + E`` rounded up to float32, per row (module notes): a target whose
    approximate key exceeds it has a float32 value strictly worse than ``V``.

    ``values_k`` are ranking values (squared distances for the l2 family); +inf / NaN for a
    row without one gives a limit that proves nothing.
    """
    v = values_k.double()
    if l2_form(queries.metric):
        # |q|^2 rounded down: bias is float32 |q|^2, within 2^-24 of it.
        key = v - queries.bias.double() * (1 - 2.0 ** -22)
    else:
        key = -v
    limit = (key + bound.double()).to(torch.float32)
    return torch.nextafter(limit, torch.full_like(limit, math.inf))


def skip_beyond(keys: torch.Tensor, idx: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``idx`` with -1 (an empty slot: not read, never ranked) where the key exceeds the
    row's ``limit`` (:func:`value_limit`): such a target's value is worse than the row's
    k-th, so it cannot rank. Elementwise: no host sync."""
    return torch.where(keys <= limit[:, None], idx, -1)


# values(queries, targets, idx) -> float32 (m, c): the pairs' exact values, NaN where idx < 0
# (:func:`exact_values`, or the fused kernel's ``_gpu_triton.triton_exact_values``).
ValuesFn = Callable[[PreparedSide, PreparedSide, torch.Tensor], torch.Tensor]


def live_width(idx: torch.Tensor) -> torch.Tensor:
    """int32 (m,): per row, the columns up to its last candidate (``idx >= 0``), 0 for a row
    with none. A list's candidates lie in its first columns (lists are sorted, empty slots
    last, and :func:`skip_beyond` empties a suffix of a sorted list), so the re-rank reads
    no column past it (``_gpu_triton.triton_exact_values``)."""
    cols = torch.arange(1, idx.shape[1] + 1, dtype=torch.int32, device=idx.device)
    return torch.where(idx >= 0, cols, 0).amax(dim=1).to(torch.int32)


def rerank(queries: PreparedSide, targets: PreparedSide, keys: torch.Tensor, idx: torch.Tensor,
           bound: torch.Tensor, k: int, values: ValuesFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (values, indices) of each row's k best among its candidates, in two steps.

    The first k columns first: their worst value ``V0`` bounds the final k-th, so columns
    whose keys exceed ``value_limit(V0)`` cannot rank (module notes) and are not read
    (:func:`skip_beyond`; the fused re-rank reads each row only up to its last candidate
    left, :func:`live_width`). No host sync: a search queues its whole round behind the
    candidate pass, and the GPU runs it without waiting for Python between the steps.
    """
    values = values or exact_values
    descending = not l2_form(queries.metric)
    head = min(k, idx.shape[1])
    vals = values(queries, targets, idx[:, :head])
    if idx.shape[1] > head:
        filled = idx[:, :head] >= 0
        worst = math.inf if not descending else -math.inf
        v0 = torch.where(filled, vals, worst)
        v0 = v0.min(dim=1).values if descending else v0.max(dim=1).values
        rest = skip_beyond(keys[:, head:], idx[:, head:], value_limit(v0, bound, queries))
        vals = torch.cat([vals, values(queries, targets, rest)], dim=1)
        idx = torch.cat([idx[:, :head], rest], dim=1)
    return rank_exact(vals, idx, k, descending)


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
def cap_values(queries: PreparedSide, stats: TargetStats, cap: float) -> torch.Tensor:
    """Per row, float64 (m,): the cap (the metric's units, inclusive) as a ranking value in
    working units, rounded outwards, so that a target whose re-ranked float32 value is worse
    than it is beyond the cap by its float64 value (:func:`beyond_cap`). Then
    ``value_limit(cap_values, bound, rows)`` is a key above which no target is within the cap
    (module notes, the re-ranked tests): the first round's seed and a proof of the rows with
    fewer than k targets within the cap.

    The cap's value: ``(cap s)^2`` (l2; -1 below 0: no distance is negative), ``cap s^2``
    (sqeuclidean), ``2 s^2 (1 - cap)`` (cosine), ``(cap - q . c) f_q s`` (inner product). The
    outward slack covers the float32 rounding of the re-ranked value and two float64 sums of
    the pair (a relative 2^-20 of the value; of ``|q| (max |t - c| + |c|)`` for inner product,
    whose float64 value is the plain dot ``q . t``), and the float64 translation of the cap
    (2^-40 of ``2 s^2`` for cosine, which cancels when the cap is near 1), as the cpu
    kernel's ``cap_keys`` rounds its cap outwards. Slack only widens what is searched: the
    returned pairs are decided by their float64 values."""
    metric = queries.metric
    s = queries.frame.scale
    device = queries.exact.device
    qn = queries.norm.double()
    tiny = _TINY * (1 + qn + stats.norm) ** 2
    if metric == "inner_product":
        offset = queries.offset if queries.offset is not None else torch.zeros_like(qn)
        w = (cap - offset) * queries.factor * s
        slack = 2.0 ** -20 * (w.abs() + qn * (stats.norm + s * queries.frame.center_norm)) + tiny
        return w - slack
    if metric == "l2":
        w = (cap * s) ** 2 if cap >= 0 else -1.0
    elif metric == "sqeuclidean":
        w = cap * s * s
    else:
        w = 2.0 * s * s * (1.0 - cap)
    unit = 2.0 * s * s if metric == "cosine" else 0.0
    w = torch.full((queries.rows,), w, dtype=torch.float64, device=device)
    return w + 2.0 ** -20 * w.abs() + 2.0 ** -40 * unit + tiny


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


# Low-precision rows whose next list would hold more than this share of the target block
# (and more than FALLBACK_MIN_CANDIDATES), or more than the fused kernel's longest list, switch
# to float32 operands instead (:func:`exact_topk`): their bound admits too much of the block
# for low precision to pay. Small blocks keep widening in low precision up to every target:
# such lists cost little, and seeded rounds skip most of them.
FALLBACK_SHARE = 1 / 16
FALLBACK_MIN_CANDIDATES = 256


def falls_back(precision: str, wider: int, nt: int, max_candidates: int | None) -> bool:
    """Whether rows of ``precision`` that need a list of ``wider`` candidates of ``nt`` switch
    to float32 operands (FALLBACK_SHARE)."""
    if precision == "fp32":
        return False
    if max_candidates is not None and wider > max_candidates:
        return True
    return wider > max(nt * FALLBACK_SHARE, FALLBACK_MIN_CANDIDATES)


def exact_topk(queries: PreparedSide, targets: PreparedSide, k: int,
               candidates: CandidateFn, *, max_candidates: int | None = None,
               stats: TargetStats | None = None, values: ValuesFn | None = None,
               seeded: bool = False, lower: bool = False, few_rows: int = 0,
               cap: float | None = None,
               first_width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float32 top-k from a low-precision candidate generator (module notes).

    ``candidates(queries, targets, n_cand)`` returns sorted approximate keys and indices, and
    optionally a floor (see :data:`CandidateFn`); rows whose margin test fails are widened
    ``WIDEN_FACTOR``-fold; above ``max_candidates`` (the fused kernel's limit), or when the
    list cannot grow any more, the torch generator takes over, up to every target.
    ``values`` computes the re-rank's exact values (default :func:`exact_values`).
    ``seeded``: ``candidates`` takes ``seed=`` (float32 per row): the widening rounds pass
    each row's ``value_limit`` of the round before, above which no target can rank (module
    notes), so the generator need not keep such targets (the fused kernel then skips them).
    ``lower``: every generator ranks by the lower key (``lower=True``, module notes) and the
    proofs use :func:`lower_key_bound`.
    ``few_rows``: widening rounds over at most this many rows run :func:`torch_candidates`.
    ``cap`` (the metric's units, inclusive; None: no cap): only targets within it rank, so a
    row may end with fewer than k (:func:`drop_beyond_cap`'s padding). The cap is a limit from
    the first round on: its key (:func:`cap_values`, :func:`value_limit`) seeds every round
    of a seeded generator (the least of it and the round before's limit) and empties the
    candidates above it before the re-rank, and a row is proven when its floor is above the
    lesser of its k-th value's limit and the cap's; the pairs returned are decided by their
    float64 values (:func:`drop_beyond_cap`).
    ``first_width``: the first list's width instead of :func:`candidate_width`'s.
    """
    metric = queries.metric
    stats = stats or TargetStats.of(targets)
    targets_given = targets            # (rows that fall back search targets.as_fp32())
    m, nt = queries.rows, targets.rows
    device = queries.exact.device
    out_v = torch.empty((m, k), dtype=torch.float32, device=device)
    out_i = torch.empty((m, k), dtype=torch.int64, device=device)
    pending = torch.arange(m, device=device)
    subset = queries
    n_cand = first_width or candidate_width(k, queries.precision, lower)
    generator = candidates
    seed = None
    bound = None                       # per row, computed once (the first round's pass)
    widening = False                   # the first round runs the given generator
    extra = {"lower": True} if lower else {}
    cap_v = None if cap is None else cap_values(queries, stats, cap)   # per row, working units
    if lower:
        # Rows in order of their lower key's factor: a fused program's rows share one bias
        # level (lower_bias_table), the tighter the more alike they are.
        c, rho = lower_rank1(queries)
        pending = torch.argsort(c)
        subset = queries.take(pending)
        subset.cache["rank1"] = (c[pending], rho)     # the same rows, reordered
        if cap_v is not None:
            cap_v = cap_v[pending]
    cap_limit = None
    if cap_v is not None:
        # The cap's limit needs the bound before the first pass (its seed).
        bound = (lower_key_bound if lower else key_error_bound)(subset, stats, metric)
        cap_limit = value_limit(cap_v, bound, subset)
        if seeded:
            seed = cap_limit
    while pending.numel():
        if max_candidates is not None and n_cand > max_candidates and generator is candidates:
            logger.debug("widening %d rows to %d candidates: torch path", pending.numel(), n_cand)
            generator = torch_candidates
        elif widening and pending.numel() <= few_rows:
            generator = torch_candidates   # a widening round over a few rows
        # The pass first: the bound, the re-rank and the proof (no host sync until
        # ``ok.all()``) queue behind it while it runs.
        if seed is not None and generator is candidates:
            found = generator(subset, targets, n_cand, seed=seed, **extra)
        else:
            found = generator(subset, targets, n_cand, **extra)
        if bound is None:
            bound = (lower_key_bound if lower else key_error_bound)(subset, stats, metric)
        keys, idx = found[0], found[1]
        floor = found[2] if len(found) > 2 else None
        if floor is None:
            floor = keys[:, -1]
            if n_cand >= nt:                  # a list of the n_cand best holds every target
                floor = torch.full_like(floor, math.inf)
        if cap_limit is not None:
            # Candidates above the cap's limit are beyond the cap: never re-ranked. The rest
            # are decided by their float64 values before the ranking, so that a pair beyond
            # the cap never takes the slot of one within it (equal float32 values either side
            # of the cap, the lower index beyond it).
            idx = skip_beyond(keys, idx, cap_limit)
            idx = torch.where(beyond_cap(pair_values64(subset, targets, idx), cap, metric), -1, idx)
        v, i = rerank(subset, targets, keys, idx, bound, k, values)
        # Proven by the keys alone, or by the re-ranked k-th value (module notes); under a
        # cap also by the cap's limit (no target outside the list is within the cap).
        limit = value_limit(v[:, k - 1], bound, subset)
        if cap_limit is not None:
            limit = torch.minimum(limit, cap_limit)
        # (A floor of +inf: the list holds every target; -inf: the generator cannot say, as
        # for a row that overflowed the filter's buffer, so the row is not proven.)
        ok = torch.isposinf(floor) | (floor > limit)
        if not lower:
            ok |= margin_holds(keys, bound, k, floor)
        # Every row of the round: a row widened below is written again by a later round.
        out_v[pending] = v
        out_i[pending] = i
        if bool(ok.all()):
            break
        retry = (~ok).nonzero().flatten()
        logger.debug("%d of %d rows widen from %d candidates", retry.numel(), ok.numel(), n_cand)
        pending = pending[retry]
        widening = True
        if seeded:
            # Targets above key(V_k) + E cannot rank; V_k only improves in a wider list.
            # (Under a cap the limit is already the lesser of the two.)
            seed = limit[retry]
        subset = _widened_rows(subset, retry, lower)
        # The rows' bound carries over: per row (lower keys: its shift term is the largest
        # of the first round's rows, at least the subset's own), so no new launches for it.
        bound = bound[retry]
        if cap_v is not None:
            cap_v, cap_limit = cap_v[retry], cap_limit[retry]
        wider = min(widened(n_cand), next_pow2(nt))
        if falls_back(subset.precision, wider, nt, max_candidates):
            # The bound admits too much of the block for low precision: these rows search
            # again with float32 operands (the working rows, no copy) and the float32 bound,
            # through cuBLAS; the list keeps its width (it widens from there in float32, up to
            # every target: bounded). The seed and lower keys were the low precision's.
            logger.debug("%d rows switch from %s to fp32 at %d candidates", retry.numel(),
                         subset.precision, n_cand)
            subset = subset.as_fp32()
            targets = targets.as_fp32()
            stats = stats.as_fp32()
            bound = key_error_bound(subset, stats, metric)
            if cap_v is not None:
                cap_limit = value_limit(cap_v, bound, subset)
            lower, extra, seed = False, {}, None
            generator = torch_candidates
            continue
        if wider == n_cand:
            # A generator with a floor may hold back targets even at n_cand >= nt (the
            # segmented kernel's segments each keep their best few): the torch path's list
            # of every target ends the loop.
            generator = torch_candidates
        n_cand = wider
    return drop_beyond_cap(queries, targets_given, final_values(out_v, queries), out_i, cap)


def _widened_rows(rows: PreparedSide, retry: torch.Tensor, lower: bool) -> PreparedSide:
    """The rows ``retry`` of ``rows`` for a widening round. With lower keys they keep the
    rank-1 form's ``rho`` (at least their own largest ratio, so still valid) and with it
    the bias tables built for ``rows`` (:func:`lower_bias_table` then only assigns levels)."""
    subset = rows.take(retry)
    if lower:
        c, rho = lower_rank1(rows)
        subset.cache["rank1"] = (c[retry], rho)
        subset.cache.update({key: entry for key, entry in rows.cache.items()
                             if isinstance(key, tuple) and key[0] == "table"})
    return subset
