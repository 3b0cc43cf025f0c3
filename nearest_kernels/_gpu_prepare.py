"""Operand preparation of the GPU searches: the working frame and each side's prepared tensors.

A search prepares its target block once (:func:`prepare_targets_side`: the block's
:class:`Frame`, :func:`working_frame`) and each query batch in that frame
(:func:`prepare_queries`). The :class:`PreparedSide` it gets is what every later stage reads:
the working rows, the operands of the low-precision product and their norms and residuals
(the terms of the error bound, ``_gpu_bound``), the keys' biases (:func:`key_alpha`) and the
factors that map the source rows to working units (the re-rank, ``_gpu_rerank``). On CUDA
the preparation kernels compute the same sides (``_triton_prepare``). The first of the GPU
modules: it imports none of the others.

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
residuals and the bound (``_gpu_bound``) are all those of the working rows, so they follow
the spread. Query rows more than FAR_NORM block extents away (l2 only) are searched apart
in float64 (``_gpu_search.far_topk``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PRECISIONS = ("fp32", "tf32", "bf16")
U32 = 2.0 ** -24                  # unit roundoff of float32 round-to-nearest


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
