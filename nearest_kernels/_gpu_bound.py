"""The error bound of the GPU searches' candidate pass, and the proofs it allows.

A candidate list is trusted only where this bound proves that it holds the exact top k
(``_gpu_search.exact_topk`` runs the rounds): the bound per query (:func:`key_error_bound`;
:func:`lower_key_bound` for keys ranked by the lower key, with the fused kernel's bias rows
:func:`lower_bias_table`), the margin tests (:func:`margin_holds`, :func:`value_limit`,
:func:`skip_beyond`), a distance cap as a value in working units (:func:`cap_values`), and
the candidate lists' widths that the margin calls for (:func:`candidate_width`,
:func:`widened`). Its terms are the prepared sides' norms and residuals (``_gpu_prepare``).

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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._gpu_prepare import U32, PreparedSide, key_alpha, l2_form

_SAFETY = 1.01                    # inflation for the rounding of the bound's own arithmetic


# ----------------------------------------------------------------------------- list widths
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


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# Above LONG_LIST_K (half the fused kernel's longest list) a low-precision first list holds
# next_pow2(2k): the plain width next_pow2(k) leaves as few as k + 1 .. k + 24 candidates, and
# the keys between a row's k-th and last candidate then lie closer together than the bf16
# bound, so that list proves no row and the bf16 pass is wasted (benchmarks/gpu_notes.md,
# Large k). Such lists are longer than the register lists': the threshold filter makes them
# where it runs (``gpu.filter_refusal``), else the torch generator.
LONG_LIST_K = 512


def candidate_width(k: int, precision: str, lower: bool = False) -> int:
    """Width of the first candidate list for ``k`` results in ``precision``; ranked by lower
    keys (``lower``), the plain width: they prove nearly every row from it (module notes).
    Low precision above LONG_LIST_K: next_pow2(2k)."""
    if precision != "fp32" and k > LONG_LIST_K:
        return next_pow2(2 * k)
    return max(MIN_CANDIDATES, next_pow2(k + (0 if lower else _EXTRA[precision](k))))


def widened(n_cand: int) -> int:
    """The next round's list width for rows a list of ``n_cand`` left unproven."""
    return n_cand * (SHORT_WIDEN if n_cand <= SHORT_LIST else WIDEN_FACTOR)


# ----------------------------------------------------------------------------- the bound
def gamma(d: int) -> float:
    """gamma_{d+2}(2^-23): the accumulation factor of the bound (see the module notes)."""
    n_u = (d + 2) * 2.0 ** -23
    return n_u / (1.0 - n_u)


# Absolute slack for working-row components that round to float32 subnormals or zero (each at
# most 2^-150 off; keys and values of the working frame are O(1)).
_TINY = 2.0 ** -120


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
        # One host sync for the three maxima.
        n, op, res = torch.stack([targets.norm.max(), targets.operand_norm.max(),
                                  targets.residual.max()]).tolist()
        return cls(n, op, res, n * n, targets.frame.scale)

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


# ----------------------------------------------------------------------------- lower keys
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


# ----------------------------------------------------------------------------- the proofs
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
