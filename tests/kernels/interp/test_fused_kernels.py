"""The fused Triton kernels under the Triton interpreter, with tiny tiles (16 x 32) so that
about a hundred targets make several tiles, splits and segments and every path is taken: their
candidate keys equal the torch path's, their lower keys (EXACT mode's per-target bound) never
exceed the per-row ones, exact_topk through them returns the exact top k, seeded lists hold
what the seed allows, the tensor-descriptor (TMA) form equals the pointer form, d in chunks
equals one dot, a sample pass's seeds keep a search exact, the re-rank kernel equals the torch
form, and a segment's floor keeps a crowded row from being proven.
The kernels' output and scratch buffers start filled with garbage: every slot they read back
must have been written.

Collected only under ``TRITON_INTERPRET=1`` (see ``conftest.py`` here): the main run runs this
folder in one subprocess, ``tests/kernels/test_gpu.py::test_kernels_under_the_triton_interpreter``.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from nearest_kernels import _gpu_bound as gb
from nearest_kernels import _gpu_prepare as gp
from nearest_kernels import _gpu_rerank as gr
from nearest_kernels import _gpu_search as gs
from nearest_kernels import _triton_candidates as tcands
from nearest_kernels import _triton_plan as tplan
from nearest_kernels import _triton_rerank as trerank
from tests.kernels.test_gpu import check_result, make_data, poison_kernel_buffers

KERNELS = ["rowlist", "segmented"]
SEGMENTED = tplan.TileConfig(16, 32, 4, kernel="segmented", seg_cand=8, extra_passes=2)
CASES = [("l2", "fp32", "gaussian", 5), ("sqeuclidean", "bf16", "clustered", 5),
         ("inner_product", "tf32", "clustered", 3), ("cosine", "bf16", "gaussian", 40)]
# The interpreter runs every program instance in Python, so each kernel gets two cases, not
# all four (the GPU runs the full metric x precision x data matrix: tests/kernels/test_gpu.py,
# -m gpu): one on gaussian data (no near ties: the candidate order is checked) and one on
# clustered data (widening rounds), one ranking by the lower key and one not, and between
# them every case, every precision and a k beyond the first list.
PAIRS = [("rowlist", 0), ("rowlist", 1), ("segmented", 2), ("segmented", 3)]
# 21 queries: two query tiles, the second partial. 101 targets: four target tiles (the last
# partial) in two splits or two segments; the clustered data's two clusters widen the lists
# from 16 to every target (128) in three rounds. d = 33: two d-chunks, the second of one.
NQ, NT, D = 21, 101, 33


@pytest.fixture(autouse=True)
def poisoned_tiny_segments(monkeypatch):
    poison_kernel_buffers(monkeypatch)
    # Tiny tiles make segments of 2+ tiles (101 targets: up to 2 segments; 603: up to 9).
    monkeypatch.setattr(tplan, "SEGMENT_MIN_TILES", 2)


class Small:
    """The candidate generator of one kernel with tiny tiles; records the seeds that
    exact_topk's widening rounds pass."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.seeds = []

    def __call__(self, q, t, n_cand, seed=None, lower=False):
        if seed is not None:
            self.seeds.append(seed)
        try:
            if self.kernel == "segmented":   # 8-long lists per segment; one list where too few
                return tcands.triton_candidates(q, t, n_cand, config=SEGMENTED, seed=seed, lower=lower)
            if n_cand <= 32:
                cfg = tplan.TileConfig(16, 32, 4, kernel="rowlist", extra_passes=2)
                return tcands.triton_candidates(q, t, n_cand, config=cfg, splits=2, seed=seed, lower=lower)
        except tplan.LaunchRefused:
            pass
        # As gpu.search_prepared: a list the kernel cannot keep runs the torch path.
        return gs.torch_candidates(q, t, n_cand, lower=lower)


def check_seeded(qs, ts, n_cand, gen, kernel):
    # Seeds: +inf, midway between the 3rd and 4th best keys and between the 12th and 13th,
    # below every key (midway: the kernel's float32 keys differ from these by rounding).
    # Each row's list must hold the n_cand best targets with key <= seed (all of them when
    # fewer) and nothing else; every target left out must have key >= floor (to rounding),
    # and a row with room left must have a floor above its seed.
    ref = (ts.bias[None, :] - gp.key_alpha(qs.metric) * (qs.operand.double() @ ts.operand.double().T)).float()
    tol = 1e-5 * float(ref.abs().max())
    ordered = torch.sort(ref, dim=1).values
    m = ref.shape[0]
    seed = torch.full((m,), float("inf"))
    seed[1::4] = (ordered[1::4, 2] + ordered[1::4, 3]) / 2
    seed[2::4] = (ordered[2::4, 11] + ordered[2::4, 12]) / 2
    seed[3::4] = ordered[3::4, 0] - 1.0
    _keys, idx, floor = gen(qs, ts, n_cand, seed)
    for r in range(m):
        allowed = (ref[r] <= seed[r]).nonzero().flatten()
        got = idx[r][idx[r] >= 0]
        assert set(got.tolist()) <= set(allowed.tolist()), r
        if kernel != "segmented":   # segments may hold back more (their floors say so)
            assert got.numel() == min(n_cand, allowed.numel()), (r, got.numel(), allowed.numel())
        left = torch.ones(ref.shape[1], dtype=torch.bool)
        left[got] = False
        assert bool((ref[r][left] >= floor[r] - tol).all()), r
        if got.numel() < n_cand and torch.isfinite(seed[r]):
            assert floor[r] > seed[r] or kernel == "segmented", (r, float(floor[r]), float(seed[r]))
            if kernel != "segmented":
                assert set(got.tolist()) == set(allowed.tolist()), r


def prepared(q, t, metric, precision):
    return (gp.prepare_side(torch.from_numpy(q), metric, precision),
            gp.prepare_side(torch.from_numpy(t), metric, precision))


def test_the_pairs_cover_every_kernel_case_and_mode():
    assert {kernel for kernel, _ in PAIRS} == set(KERNELS)
    assert {n for _, n in PAIRS} == set(range(len(CASES)))
    for kernel in KERNELS:
        cases = [CASES[n] for kk, n in PAIRS if kk == kernel]
        assert {kind for _, _, kind, _ in cases} == {"gaussian", "clustered"}, kernel
        assert {n % 2 for kk, n in PAIRS if kk == kernel} == {0, 1}, kernel   # lower keys or not


@pytest.mark.parametrize("kernel,n", PAIRS, ids=[f"{kk}-" + "-".join(map(str, CASES[n])) for kk, n in PAIRS])
def test_candidates_lower_keys_and_exact_topk(kernel, n):
    metric, precision, kind, k = CASES[n]
    small = Small(kernel)
    q, t = make_data(kind, NQ, NT, D, n)
    qs, ts = prepared(q, t, metric, precision)
    # The kernel's candidate keys equal the torch path's exactly computed keys.
    keys, idx, _ = small(qs, ts, 16)
    ref = ts.bias[None, :] - gp.key_alpha(metric) * (qs.operand.double() @ ts.operand.double().T)
    order = torch.sort(ref.float(), dim=1, stable=True)
    if kind == "gaussian":  # no near ties: the same order as float64 keys
        assert torch.equal(idx[:, :8], order.indices[:, :8]), (metric, precision)
    # Lower keys (EXACT mode's per-target bound): each 16-row program reads its row of the
    # bias table; the keys are that table's, to float32 rounding, and never above the
    # per-row lower keys of the torch path (the table's levels only lower them).
    keys, idx, _ = small(qs, ts, 16, lower=True)
    table, level = gb.lower_bias_table(qs, ts, 16, gb.lower_levels(16))
    prod = qs.operand.double() @ ts.operand.double().T
    lower = table.double()[level.long().repeat_interleave(16)[:NQ]] - gp.key_alpha(metric) * prod
    q_w, t_w = gb.lower_key_weights(qs, ts)
    per_row = ref - q_w[0].double()[:, None] * t_w[0].double() - q_w[1].double()[:, None] * t_w[1].double()
    tol = 1e-5 * float(ref.abs().max())
    assert bool((lower <= per_row + tol).all()), metric
    assert (idx >= 0).all() and torch.allclose(keys.double(), torch.gather(lower, 1, idx), rtol=1e-5, atol=tol), metric
    if kind == "gaussian":
        assert torch.equal(idx[:, :8], torch.sort(lower.float(), dim=1, stable=True).indices[:, :8]), metric
    # Half the cases rank by the lower key (EXACT bf16's default).
    v, i = gs.exact_topk(qs, ts, k, small, max_candidates=256, values=trerank.triton_exact_values,
                         seeded=True, lower=n % 2 == 1)
    check_result(q, t, k, metric, v.numpy(), i.numpy())


@pytest.mark.parametrize("kernel", ["rowlist", "segmented"])
def test_seeded_lists(kernel):
    small = Small(kernel)
    # Seeded lists (the widening rounds' limit): fp32 keys, so the reference order is exact.
    q, t = make_data("gaussian", 12, NT, D, 21)
    qs, ts = prepared(q, t, "l2", "fp32")
    check_seeded(qs, ts, 16, small, kernel)
    # exact_topk passes seeds in its widening rounds: a first list too short to prove the
    # clustered rows (near ties within the bf16 error) makes them widen, seeded.
    q, t = make_data("clustered", NQ, NT, D, 22)
    qs, ts = prepared(q, t, "sqeuclidean", "bf16")
    before = len(small.seeds)
    v, i = gs.exact_topk(qs, ts, 5, small, max_candidates=256, values=trerank.triton_exact_values, seeded=True)
    check_result(q, t, 5, "sqeuclidean", v.numpy(), i.numpy())
    assert len(small.seeds) > before, "no widening round: the seeded path went untested"


def _unaligned_rows(side):
    """The same prepared side with its operand in rows of d + 1 elements (a view): rows no
    longer 16-byte aligned, so target_descriptor keeps pointer tiles (the form below Hopper)."""
    op = side.operand
    wide = torch.zeros((op.shape[0], op.shape[1] + 1), dtype=op.dtype)
    wide[:, :op.shape[1]] = op
    return dataclasses.replace(side, operand=wide[:, :op.shape[1]], cache={})


@pytest.mark.parametrize("kernel", ["rowlist", "segmented"])
def test_descriptor_form_equals_pointer_form(kernel):
    small = Small(kernel)
    # Target tiles by tensor descriptor (TMA on Hopper and in the interpreter): d=40 rows are
    # 16-byte aligned in bf16 and float32, so the descriptor form runs (d=33 above does not);
    # the same operand in unaligned rows takes pointer tiles. Its lists must be the pointer
    # form's (keys to float32 rounding: the interpreter may sum the products in another
    # order): plain lists, lower keys (bf16) and seeded lists (fp32).
    for n, (metric, precision) in enumerate((("l2", "fp32"), ("sqeuclidean", "bf16"), ("inner_product", "tf32"))):
        q, t = make_data("gaussian", NQ, NT, 40, 30 + n)
        qs, ts = prepared(q, t, metric, precision)
        ordered = torch.sort(ts.bias[None, :] - gp.key_alpha(metric) * (qs.operand.double() @ ts.operand.double().T),
                             dim=1).values
        seed = torch.full((NQ,), float("inf"))
        seed[::3] = ((ordered[:, 5] + ordered[:, 6]) / 2).float()[::3]   # midway: no key at the seed
        for kw in [{}] + [{"lower": True}] * (precision == "bf16") + [{"seed": seed}] * (precision == "fp32"):
            got = {}
            for form, side in (("descriptor", ts), ("pointer", _unaligned_rows(ts))):
                assert isinstance(tplan.target_descriptor(side.operand, 32, 64), tplan.TensorDescriptor) == (form == "descriptor")
                got[form] = small(qs, side, 16, **kw)
            (k1, i1, f1), (k2, i2, f2) = got["descriptor"], got["pointer"]
            assert torch.equal(i1, i2), (metric, list(kw))
            tol = 1e-5 * float(k2[torch.isfinite(k2)].abs().max())
            assert torch.allclose(k1, k2, rtol=1e-5, atol=tol) and torch.allclose(f1, f2, rtol=1e-5, atol=tol)


def test_rowlist_rerank_kernel_equals_the_torch_form():
    # The re-rank kernel against the torch form: d within one chunk and over two, empty
    # slots (NaN there) anywhere, rows with none, rows whose candidates end early (a suffix
    # of empty slots: the kernel reads each row up to its last candidate), several programs
    # and column steps, both value forms.
    rng = np.random.default_rng(3)
    for metric, d in (("sqeuclidean", 33), ("inner_product", 70), ("cosine", 16)):
        q, t = make_data("gaussian", 37, 50, d, d)
        qs, ts = prepared(q, t, metric, "fp32")
        idx = torch.from_numpy(rng.integers(-1, 50, (37, 23)))
        idx[3] = -1
        idx[5:30:4, 6:] = -1
        idx[20:, 15:] = -1
        want = gr.exact_values(qs, ts, idx)
        got = trerank.triton_exact_values(qs, ts, idx[:, 2:])
        assert torch.equal(torch.isnan(got), idx[:, 2:] < 0), metric
        assert torch.allclose(torch.nan_to_num(got), torch.nan_to_num(want[:, 2:]), rtol=1e-5, atol=1e-5), metric


def test_rowlist_long_scan_and_exact_ties():
    # One long scan (128 tiles of 32, one split): late tiles mostly have no survivor or one
    # per row, the paths the first tiles never take. The lists must be the exact 8 best.
    # With and without the row-minimum test (skip_test): the same lists. Then exact ties:
    # every target three times in a row (the copies meet in one tile or across a tile edge),
    # so a list of 8 takes two triples and two of a third: the lower indices (tie rule).
    q, t = make_data("gaussian", 16, 4096, 33, 7)
    for name, targets in (("long scan", t), ("triples", np.repeat(t[:1365], 3, axis=0))):
        qs, ts = prepared(q, targets, "l2", "fp32")
        ref = ts.bias[None, :] - 2 * (qs.operand.double() @ ts.operand.double().T)
        want = torch.sort(ref, dim=1, stable=True).indices[:, :8]
        for skip_test in (True, False):
            cfg = tplan.TileConfig(16, 32, 4, kernel="rowlist", extra_passes=2, skip_test=skip_test)
            _keys, idx, _ = tcands.triton_candidates(qs, ts, 8, config=cfg, splits=1)
            assert torch.equal(idx, want), (name, skip_test)


def test_one_tile_with_more_survivors_than_the_list_takes_its_exact_best():
    # One tile of 32 targets, one split: every target survives into the empty lists, so the
    # tile's argmin passes alone must leave each row its exact n_cand best (one pass short
    # leaves a slot empty). Lists of 16 (the loop over up to n_cand passes) and of 32 (the
    # bitonic top-k past extra_passes); targets in pairs of exact copies, so ties go to the
    # lower index.
    q, t = make_data("gaussian", 16, 16, 33, 11)
    targets = np.repeat(t, 2, axis=0)
    qs, ts = prepared(q, targets, "l2", "fp32")
    ref = ts.bias[None, :] - 2 * (qs.operand.double() @ ts.operand.double().T)
    order = torch.sort(ref, dim=1, stable=True).indices
    for n_cand in (8, 16, 32):
        cfg = tplan.TileConfig(16, 32, 4, kernel="rowlist", extra_passes=2)
        _keys, idx, _ = tcands.triton_candidates(qs, ts, n_cand, config=cfg, splits=1)
        assert torch.equal(idx, order[:, :n_cand]), n_cand


def test_segment_floors_keep_crowded_rows_unproven():
    small = Small("segmented")
    # 603 targets = 19 tiles; 8 segments (segment s: tiles s, s + 8, s + 16), 8-long lists,
    # n_cand 32 (bf16, k=10).
    # Crowding: each of queries 0-3 has 12 near targets inside one tile, so one segment holds
    # them all and keeps only 8. The union's last key is far above theta + 2E (the plain
    # rule would prove the row and miss some neighbours); the segment's floor must not.
    # Spread ties: queries 4 and 5 have 36 targets at near-equal distances (1e-3 apart in
    # squared distance, within bf16's error), 2 per tile in tiles 0-17, so at most 6 per
    # segment: every segment list keeps its ties, but cutting the union to 32 drops 4, so
    # only the first dropped key, not the segments' floors, keeps the row from being proven.
    # A run: query 6 has 64 near targets (spread distances) stored together in tiles 14-17;
    # strided segments give each of 4 segments 16 of them, and the row is proven at once
    # (contiguous segments would crowd 48 into one and widen it).
    rng = np.random.default_rng(11)
    q = rng.standard_normal((16, 33)).astype(np.float32)
    t = rng.standard_normal((603, 33)).astype(np.float32)
    crowded, spread, run = [0, 1, 2, 3], [4, 5], 6
    for j in crowded:
        t[32 * (4 * j + 1):32 * (4 * j + 1) + 12] = q[j] + 0.3 * rng.standard_normal((12, 33))
    for j, cols in zip(spread, ((20, 24), (28, 30))):
        at = np.array([32 * m + c for m in range(18) for c in cols])
        u = rng.standard_normal((len(at), 33))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        r = np.sqrt(4 + 1e-3 * rng.permutation(len(at)))
        t[at] = q[j] + r[:, None] * u
    at = np.array([32 * m + c for m in range(14, 18) for c in range(16)])
    u = rng.standard_normal((len(at), 33))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    t[at] = q[run] + np.sqrt(4 + 0.5 * rng.permutation(len(at)))[:, None] * u
    qs, ts = prepared(q, t, "sqeuclidean", "bf16")
    k = 10
    n_cand = gb.candidate_width(k, "bf16")
    assert tplan.segment_count(16, 603, n_cand, SEGMENTED, 4) == 8
    keys, idx, floor = small(qs, ts, n_cand)
    bound = gb.key_error_bound(qs, gb.TargetStats.of(ts), "sqeuclidean")
    plain = gb.margin_holds(keys, bound, k)
    proven = gb.margin_holds(keys, bound, k, floor)
    ref = ts.bias[None, :] - 2 * (qs.operand.double() @ ts.operand.double().T)
    top = torch.sort(ref, dim=1, stable=True).indices[:, :k]
    for j in crowded:
        missing = set(top[j].tolist()) - set(idx[j].tolist())
        assert plain[j] and missing and not proven[j], (j, missing, bool(proven[j]))
    assert not proven[spread].any(), proven
    assert proven[run:].all(), proven         # elsewhere the floor proves the rows
    # Widening: 128 candidates need more segments than 603 targets allow -> the torch path.
    assert tplan.segment_count(16, 603, 4 * n_cand, SEGMENTED, 4) == 0
    v, i = gs.exact_topk(qs, ts, k, small, max_candidates=256, values=trerank.triton_exact_values)
    check_result(q, t, k, "sqeuclidean", v.numpy(), i.numpy())


def test_two_segments_make_the_list_exact():
    # Two segments at least (config.segments), as the bf16 n_cand 32 default: the union of
    # two 8-long lists is the 16-candidate list; exact through the re-ranked margin.
    two = tplan.TileConfig(16, 32, 4, kernel="segmented", seg_cand=8, segments=2, extra_passes=2)
    assert tplan.segment_count(3, 603, 16, two, 4) == 2
    q, t = make_data("gaussian", 3, 603, 33, 12)
    qs, ts = prepared(q, t, "l2", "bf16")
    _, _, floor = tcands.triton_candidates(qs, ts, 16, config=two)
    assert torch.isfinite(floor).all()
    v, i = gs.exact_topk(qs, ts, 5, lambda a, b, n: tcands.triton_candidates(a, b, n, config=two if n == 16 else None),
                         max_candidates=256, values=trerank.triton_exact_values)
    check_result(q, t, 5, "l2", v.numpy(), i.numpy())


@pytest.mark.parametrize("form", ["descriptor", "pointer"])
def test_d_in_chunks_equals_one_dot(form, monkeypatch):
    """The flat (tile, d-chunk) loop of the register-list kernel (d too large for one dot:
    SINGLE_DOT_BYTES 0 here) against the single-dot form on the same rows: d = 136 in chunks
    of BLOCK_D = 64 (two full chunks and one of 8), both operands by
    descriptor where the rows are 16-byte aligned, else block pointers; plain lists, lower
    keys and seeds. Keys to float32 rounding (the chunks sum in another order)."""
    q, t = make_data("gaussian", NQ, NT, 136, 41)
    qs, ts = prepared(q, t, "sqeuclidean", "bf16")
    if form == "pointer":
        ts = _unaligned_rows(ts)
    assert isinstance(tplan.target_descriptor(ts.operand, 32, 64), tplan.TensorDescriptor) == (form == "descriptor")
    small = Small("segmented")
    seed = torch.full((NQ,), float("inf"))
    ordered = torch.sort(ts.bias[None, :] - 2 * (qs.operand.double() @ ts.operand.double().T), dim=1).values
    seed[::3] = ((ordered[:, 5] + ordered[:, 6]) / 2).float()[::3]
    for kw in ({}, {"lower": True}, {"seed": seed}):
        one = small(qs, ts, 16, **kw)
        with monkeypatch.context() as patch:
            patch.setattr(tplan, "SINGLE_DOT_BYTES", 0)
            plan = tplan.plan_candidates(NQ, NT, 136, 16, "bf16", tplan.device_limits(torch.device("cpu")),
                                         config=SEGMENTED)[0]
            assert not plan.single_dot   # (the pointer form: target_descriptor declines its rows)
            chunked = small(qs, ts, 16, **kw)
        assert torch.equal(one[1], chunked[1]), list(kw)
        for a, b in zip((one[0], one[2]), (chunked[0], chunked[2])):
            tol = 1e-5 * float(b[torch.isfinite(b)].abs().max())
            assert torch.allclose(a, b, rtol=1e-5, atol=tol), list(kw)


def test_sample_seed_is_a_sampled_key_and_the_seeded_search_is_exact():
    """sample_seed: each row's seed is the 32nd key of the union of the sample pass's
    segment lists over every (n_cand / 32)-th target, so at least the sample's 32nd key and
    one of its keys; a search whose first pass takes those seeds (as gpu.search_prepared's
    sampled first pass) returns the exact top k, lower keys or not."""
    q, t = make_data("gaussian", NQ, 1101, 33, 42)
    for metric, lower in (("l2", True), ("inner_product", False)):
        qs, ts = prepared(q, t, metric, "bf16")
        cfg = tplan.TileConfig(16, 32, 4, kernel="segmented", seg_cand=8, extra_passes=2)
        # 128 candidates: 1,101 targets make 17 segments of 8 (SEGMENT_MIN_TILES 2 here), so
        # the first pass runs the kernel; the sample is every 4th target.
        seed = tcands.sample_seed(qs, ts, 128, cfg)
        sample = ts.take(torch.arange(0, ts.rows, 4))
        keys = (sample.bias[None, :] - gp.key_alpha(metric) * (qs.operand.double() @ sample.operand.double().T)).float()
        ordered = torch.sort(keys, dim=1).values
        tol = 1e-5 * float(ordered.abs().max())
        assert bool((seed >= ordered[:, tcands.SAMPLE_LIST - 1] - tol).all())
        assert bool(((keys - seed[:, None]).abs() <= tol).any(dim=1).all())
        assert tcands.sample_seed(qs, ts.take(torch.arange(300)), 128, cfg) is None   # too few targets

        first = []

        def seeded_first(q_, t_, n_cand, seed=None, lower=False):
            if not first:
                first.append(n_cand)
                seed = tcands.sample_seed(q_, t_, n_cand, cfg, lower=lower)
            try:
                return tcands.triton_candidates(q_, t_, n_cand, config=cfg, seed=seed, lower=lower)
            except tplan.LaunchRefused:   # a widened list too long for the segments: as the library
                return gs.torch_candidates(q_, t_, n_cand, lower=lower)

        v, i = gs.exact_topk(qs, ts, 70, seeded_first, max_candidates=256, values=trerank.triton_exact_values,
                             seeded=True, lower=lower, first_width=128)
        assert first == [128]
        check_result(q, t, 70, metric, v.numpy(), i.numpy())
