"""The GPU searches: candidates, exact re-rank, proof and widening, round after round.

Every GPU search runs in two stages:

1. **Candidates.** A low-precision pass (the fused Triton kernel, or :func:`torch_candidates`:
   tiled ``addmm`` + ``topk``) returns, per query, the ``n_cand`` best targets by an
   approximate *key* (smaller is better; see :func:`key_alpha`).
2. **Exact re-rank.** :func:`exact_topk` recomputes the candidates' values in float64 from
   the input rows, checks with a rigorous error bound that no true neighbour can lie
   outside the candidate list, widens the list for the rows where it could (switching rows
   whose bound admits too much of the block to float32 operands), and sorts by
   (value, target index): ties go to the lower index, as in every backend.

The pieces: the operands in the target block's working frame (``_gpu_prepare``; on CUDA
``_triton_prepare``), the error bound, its proofs and the lists' widths (``_gpu_bound``), the
values and their ranking (``_gpu_rerank``; on CUDA ``_triton_rerank``), the fused candidate
passes (``_triton_candidates``, ``_triton_filter``). ``gpu.search_prepared`` chooses the
candidate generator and calls :func:`exact_topk`; query rows too far from the block for its
frame it searches apart, in float64 (:func:`far_topk`).

Runs on CUDA and on CPU tensors (the tests here have no GPU). Imports neither pyspark nor
pandas.

Distance caps (``exact_topk(cap=)``)
------------------------------------
A cap (inclusive: a distance ``<= cap``, a similarity ``>= cap``) is a value ``V_cap`` in
working units per row (``_gpu_bound.cap_values``, rounded outwards), and the re-ranked tests
(``_gpu_bound`` notes) hold for it as for ``V_k``: a target whose key exceeds
``key(V_cap) + E`` (``value_limit``) is beyond the cap. That limit is the searches'
threshold from the first round: it seeds the first candidate lists (the fused kernel then
never keeps a key above it), candidates above it are not re-ranked, and a row is proven
when its floor exceeds the lesser of its k-th limit and the cap's, so a row with fewer than
k targets within the cap is proven by the cap. The candidates below the limit are decided
by their float64 values (``_gpu_rerank.pair_values64``), as the cpu kernel decides them,
before they are ranked: ranking is by float32 values, and a pair beyond the cap whose
float32 value equals that of one within it must not take its slot.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from ._gpu_bound import (
    TargetStats,
    candidate_width,
    cap_values,
    key_error_bound,
    lower_key_bound,
    lower_key_weights,
    lower_rank1,
    margin_holds,
    next_pow2,
    skip_beyond,
    value_limit,
    widened,
)
from ._gpu_prepare import Frame, PreparedSide, key_alpha
from ._gpu_rerank import ValuesFn, beyond_cap, best_order, drop_beyond_cap, final_values, pair_values64, rerank

logger = logging.getLogger(__name__)


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
                     *, chunk_elements: int = 1 << 26, lower: bool = False,
                     seed: torch.Tensor | None = None) -> tuple:
    """The ``n_cand`` smallest approximate keys per query by tiled ``addmm`` + ``topk``.

    Returns keys float32 (m, n_cand) sorted ascending (+inf in empty slots) and target indices
    int64 (-1 in empty slots). Ties at the list's end may be cut arbitrarily: the margin test
    in :func:`exact_topk` never trusts the last key's ties. ``lower``: rank by the lower key
    (``_gpu_bound`` notes), computed elementwise in float32 (no tf32 rounding of the weights).

    ``seed`` (float32 (m,), a widening round's limits): keys above a row's seed are left out,
    and the pass counts each row's targets at or below it. Returns then (keys, idx, floor,
    below): ``below`` int64 (m,) that count; ``floor`` just above the seed where the list holds
    all of them (every target left out has a key above the seed), else the last key. A list
    of ``below + 1`` candidates under the same seed holds every such target of its row: the
    width that :func:`exact_topk` jumps to where exact ties (groups of identical rows) fill a
    list, which a fixed widening would reach only round after round.
    """
    m, nt = queries.rows, targets.rows
    device = queries.exact.device
    width = min(n_cand, nt)
    keys_out = torch.full((m, n_cand), math.inf, dtype=torch.float32, device=device)
    idx_out = torch.full((m, n_cand), -1, dtype=torch.int64, device=device)
    below = None if seed is None else torch.zeros(m, dtype=torch.int64, device=device)
    if m == 0 or nt == 0:
        return (keys_out, idx_out) if seed is None else (keys_out, idx_out, _seeded_floor(keys_out, below, seed), below)
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
                keys = _key_tile(q_op, targets, q0, t0, t1, alpha, q_w, t_w)
                if seed is not None:
                    within = keys <= seed[q0:q1, None]
                    below[q0:q1] += within.sum(dim=1)
                    keys = torch.where(within, keys, math.inf)
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
            i = torch.gather(best_i, 1, order)
            idx_out[q0:q1, :width] = i if seed is None else torch.where(torch.isposinf(v), -1, i)
    if seed is None:
        return keys_out, idx_out
    return keys_out, idx_out, _seeded_floor(keys_out, below, seed), below


def _key_tile(q_op: torch.Tensor, targets: PreparedSide, q0: int, t0: int, t1: int, alpha: float,
              q_w: torch.Tensor | None, t_w: torch.Tensor | None) -> torch.Tensor:
    """float32 keys of the query operand rows ``q_op`` (from row ``q0``) against targets
    ``t0:t1`` by ``addmm`` (tf32 where :func:`_tf32_matmul` allows it); lower keys where the
    weights are given (:func:`lower_key_weights`)."""
    t_op = targets.operand[t0:t1].to(torch.float32)
    keys = torch.addmm(targets.bias[t0:t1], q_op, t_op.T, beta=1.0, alpha=-alpha)
    if q_w is not None:
        q1 = q0 + q_op.shape[0]
        keys -= q_w[0, q0:q1, None] * t_w[0, t0:t1]
        keys -= q_w[1, q0:q1, None] * t_w[1, t0:t1]
    return keys


def torch_kth_keys(queries: PreparedSide, targets: PreparedSide, j: int, *, chunk_elements: int = 1 << 26,
                   lower: bool = False) -> torch.Tensor:
    """float32 (m,): each query row's ``j``-th smallest approximate key over every target
    (1 <= j <= targets), the keys of :func:`torch_candidates`, by ``kthvalue``: one radix
    selection per row where a list of j would select, gather and sort j entries (a threshold
    needs only the j-th). Rows in chunks whose keys hold ``chunk_elements`` floats; targets in
    chunks of as many elements of their float32 copy."""
    m, nt = queries.rows, targets.rows
    device = queries.exact.device
    out = torch.empty(m, dtype=torch.float32, device=device)
    if m == 0:
        return out
    alpha = key_alpha(queries.metric)
    q_w, t_w = lower_key_weights(queries, targets) if lower else (None, None)
    q_chunk = max(1, chunk_elements // max(1, nt))
    t_chunk = max(1, chunk_elements // max(1, queries.dim))
    with _tf32_matmul(queries.precision != "fp32"):
        for q0 in range(0, m, q_chunk):
            q1 = min(m, q0 + q_chunk)
            q_op = queries.operand[q0:q1].to(torch.float32)
            if t_chunk >= nt:
                keys = _key_tile(q_op, targets, q0, 0, nt, alpha, q_w, t_w)
            else:
                keys = torch.cat([_key_tile(q_op, targets, q0, t0, min(nt, t0 + t_chunk), alpha, q_w, t_w)
                                  for t0 in range(0, nt, t_chunk)], dim=1)
            out[q0:q1] = torch.kthvalue(keys, j, dim=1).values
    return out


def _seeded_floor(keys: torch.Tensor, below: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """The floor of a seeded torch list (:func:`torch_candidates`): just above the seed where
    the list holds every target at or below it (``below`` fits), else its last key."""
    above = torch.nextafter(seed.to(torch.float32), torch.full_like(keys[:, -1], math.inf))
    return torch.where(below <= keys.shape[1], above, keys[:, -1])


# candidates(queries, targets, n_cand) -> (keys, idx) or (keys, idx, floor) or (keys, idx,
# floor, below): keys float32 (m, n_cand) ascending (+inf empty), idx int64 (-1 empty), floor
# float32 (m,) with every target not in a row's list at approximate key >= floor (-inf: the
# row is not proven), below int64 (m,) the number of targets at or below the row's seed (a
# seeded :func:`torch_candidates`). Without a floor the list must be the row's n_cand best
# (floor = its last key). Generators that :func:`exact_topk` calls with ``lower=True`` rank
# by the lower key instead (:func:`lower_key_weights`). Or :class:`Ranked`: the round's
# results, re-ranked by the generator itself.
CandidateFn = Callable[[PreparedSide, PreparedSide, int], tuple]


@dataclass
class Ranked:
    """A round that its generator re-ranked itself (a long list's threshold filter:
    ``_triton_filter.long_list_topk``): each row's exact top k among its candidates as
    :func:`rerank` returns them (working values float32 (m, k), indices int64 (m, k)), and
    the floor of the candidates (every target not among them has approximate key >= floor;
    -inf: not proven). :func:`exact_topk` proves these rows by their k-th value alone."""

    values: torch.Tensor
    indices: torch.Tensor
    floor: torch.Tensor


# ----------------------------------------------------------------------------- far rows
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


# ----------------------------------------------------------------------------- the rounds
# Widening rounds over at most this many rows, or this many keys (rows x targets), run the
# torch generator (one addmm + topk over the targets) instead of the fused kernel
# (``exact_topk(few_rows=)``, :func:`torch_round_rows`, passed by ``gpu.search_prepared``): for a
# handful of rows a fused pass is mostly fixed costs, and a seeded torch round counts each
# row's targets below its seed, so that rows whose lists exact ties fill (groups of identical
# rows at the k-th place) jump to the width they need (:func:`torch_candidates`).
TORCH_ROUND_ROWS = 64
TORCH_ROUND_KEYS = 1 << 28


def torch_round_rows(nt: int) -> int:
    """Widening rounds over at most this many rows of a block of ``nt`` targets run the torch
    generator (TORCH_ROUND_ROWS, TORCH_ROUND_KEYS)."""
    return max(TORCH_ROUND_ROWS, TORCH_ROUND_KEYS // max(1, nt))


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
    (``_gpu_bound.widened``), or, after a seeded :func:`torch_candidates` round, to a list one
    longer than the most targets a row has at or below its seed (exact ties); above
    ``max_candidates`` (the fused kernel's limit), or when the list cannot grow any more, the
    torch generator takes over, up to every target. The torch generator always takes the seed.
    ``values`` computes the re-rank's exact values (default :func:`exact_values`).
    ``seeded``: ``candidates`` takes ``seed=`` (float32 per row): the widening rounds pass
    each row's ``value_limit`` of the round before, above which no target can rank (module
    notes), so the generator need not keep such targets (the fused kernel then skips them).
    ``lower``: every generator ranks by the lower key (``lower=True``, ``_gpu_bound`` notes) and the
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
        logger.debug("round: %d rows, %d candidates, %s%s", pending.numel(), n_cand,
                     "torch" if generator is torch_candidates else "fused",
                     "" if seed is None else ", seeded")
        # The pass first: the bound, the re-rank and the proof (no host sync until
        # ``ok.all()``) queue behind it while it runs.
        if seed is not None and (generator is torch_candidates or (seeded and generator is candidates)):
            found = generator(subset, targets, n_cand, seed=seed, **extra)
        else:
            found = generator(subset, targets, n_cand, **extra)
        if bound is None:
            bound = (lower_key_bound if lower else key_error_bound)(subset, stats, metric)
        if isinstance(found, Ranked):
            keys, below, v, i, floor = None, None, found.values, found.indices, found.floor
        else:
            keys, idx = found[0], found[1]
            floor = found[2] if len(found) > 2 else None
            below = found[3] if len(found) > 3 else None
            if floor is None:
                floor = keys[:, -1]
                if n_cand >= nt:                  # a list of the n_cand best holds every target
                    floor = torch.full_like(floor, math.inf)
            if cap_limit is not None:
                # Candidates above the cap's limit are beyond the cap: never re-ranked. The
                # rest are decided by their float64 values before the ranking, so that a pair
                # beyond the cap never takes the slot of one within it (equal float32 values
                # either side of the cap, the lower index beyond it).
                idx = skip_beyond(keys, idx, cap_limit)
                idx = torch.where(beyond_cap(pair_values64(subset, targets, idx), cap, metric), -1, idx)
            v, i = rerank(subset, targets, keys, idx, bound, k, values)
        # Proven by the keys alone, or by the re-ranked k-th value (``_gpu_bound`` notes); under a
        # cap also by the cap's limit (no target outside the list is within the cap).
        limit = value_limit(v[:, k - 1], bound, subset)
        if cap_limit is not None:
            limit = torch.minimum(limit, cap_limit)
        # (A floor of +inf: the list holds every target; -inf: the generator cannot say, as
        # for a row that overflowed the filter's buffer, so the row is not proven.)
        ok = torch.isposinf(floor) | (floor > limit)
        if not lower and keys is not None:
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
        # Targets above key(V_k) + E cannot rank; V_k only improves in a wider list. (Under a
        # cap the limit is already the lesser of the two.) Generators that take a seed get it.
        seed = limit[retry]
        v_k = v[retry, k - 1]
        subset = _widened_rows(subset, retry, lower)
        # The rows' bound carries over: per row (lower keys: its shift term is the largest
        # of the first round's rows, at least the subset's own), so no new launches for it.
        bound = bound[retry]
        if cap_v is not None:
            cap_v, cap_limit = cap_v[retry], cap_limit[retry]
        if below is None:
            wider = min(widened(n_cand), next_pow2(nt))
        else:
            # A seeded round counted each row's targets at or below its seed; the next seed is
            # no higher, so a list one longer than the most holds all of them and proves every
            # row: exact ties at the k-th place (a group of identical rows) need a list of the
            # whole group, which fixed widening steps reach only round after round. (A row
            # without a finite seed counted every target: it widens as without a count.)
            need = torch.where(torch.isfinite(seed), below[retry] + 1, widened(n_cand))
            wider = min(next_pow2(int(need.max())), next_pow2(nt))
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
            # The seed in float32 keys: the k-th value so far bounds the final one from above.
            seed = value_limit(v_k, bound, subset)
            if cap_v is not None:
                cap_limit = value_limit(cap_v, bound, subset)
                seed = torch.minimum(seed, cap_limit)
            lower, extra = False, {}
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
