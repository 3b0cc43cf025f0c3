"""The threshold-filter first pass (``_triton_filter.filter_candidates``) under the Triton
interpreter with tiny tiles (16 x 32 x 16): the host selection's floor, cut and overflow on
hand-made buffers; the kernel's appends (its interpreter form: ``tl.atomic_add`` and
``tl.store``; the inline PTX runs on the device, tests/kernels/test_gpu_exactness.py) against
float64 keys of the same operands; its lower keys against the register-list kernel's; and
exact_topk through it, a row that overflows a slice of its buffer included, against the float64 oracle.
The buffer starts as garbage: only the positions below a slice's counter may be read.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from nearest_kernels import _gpu_prepare as gp
from nearest_kernels import _gpu_search as gs
from nearest_kernels import _triton_candidates as tcands
from nearest_kernels import _triton_filter as tfilter
from nearest_kernels import _triton_plan as tplan
from tests.kernels.test_gpu import check_result, make_data, poison_kernel_buffers

TINY = tfilter.FilterTiles(block_m=16, block_n=32, block_d=16, num_warps=4, num_stages=1)


def _packed(keys, idx):
    bits = torch.tensor(keys, dtype=torch.float32).view(torch.int32).long()
    mono = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (mono << 32) | torch.tensor(idx, dtype=torch.int64)


def test_the_sample_and_the_buffer_follow_their_rules():
    assert tfilter.filter_sample(32) == (32, 5) and tfilter.filter_sample(64) == (32, 5)
    assert tfilter.filter_sample(512) == (32, 20)
    # 1.25 step j + 6 step sqrt(j) + 64, up to a power of two
    assert tfilter.filter_cap(32) == 1024 and tfilter.filter_cap(512) == 2048
    for n in (8, 32, 128, 512, 1024):
        step, j = tfilter.filter_sample(n)
        assert tfilter.filter_cap(n) >= 1.25 * step * j + 6 * step * math.sqrt(j)
    assert tfilter.filter_sample_rows(32 * tfilter.FILTER_MIN_SAMPLE, 32) == tfilter.FILTER_MIN_SAMPLE
    # a row's slots in equal slices, one per (split, lane of the quad); never fewer than the least
    assert tfilter.filter_slots(2048, 2) == 256 and tfilter.filter_slots(1024, 2) == 128
    assert tfilter.filter_slots(2048, 264) == tfilter.FILTER_MIN_SLOTS
    assert tfilter.filter_sample_rows(32 * tfilter.FILTER_MIN_SAMPLE - 32, 32) == 0
    # Long lists (k above LONG_LIST_K: about 2k): every 16th target, about 1.125 n_cand hits,
    # a sample of at least LONG_MIN_SAMPLE_J x j rows, no longer list than LONG_FILTER_MAX.
    assert tfilter.filter_sample(2048) == (16, 144) and tfilter.filter_cap(2048) == 4096
    least = 16 * tfilter.LONG_MIN_SAMPLE_J * 144
    assert tfilter.filter_sample_rows(least, 2048) == least // 16
    assert tfilter.filter_sample_rows(least - 16, 2048) == 0
    assert tfilter.LONG_FILTER_MAX == 2 * tplan.MAX_CANDIDATES


def _sliced(buf, row, slices, keys, idx):
    """The entries of one slice of each list, in turn, at their positions of the row's buffer
    (position p of slice i at p * slices + i, as the kernel stores them)."""
    for i, (k, j) in enumerate(zip(keys, idx)):
        buf[row, torch.arange(len(k)) * slices + i] = _packed(k, j)


def test_the_selection_states_a_floor_for_every_row():
    slices, slots, n_cand = 2, 4, 4
    buf = torch.full((4, slices * slots), 0x5A5A5A5A5A5A5A5A, dtype=torch.int64)   # garbage past the counts
    _sliced(buf, 0, slices, [[3.0, 1.0], [2.0]], [[7, 5], [6]])                      # 3 hits <= n_cand
    _sliced(buf, 1, slices, [[6.0, 1.0, 5.0], [2.0, 2.0, 4.0]], [[1, 2, 3], [9, 4, 5]])   # 6 hits: cut at 4
    buf[2] = _packed([-1.0] * slices * slots, list(range(slices * slots)))          # slice 0 overflowed
    count = torch.tensor([[2, 1], [3, 3], [5, 2], [0, 0]], dtype=torch.int32)
    thr = torch.tensor([3.5, 6.0, 0.0, -2.0])
    keys, idx, floor = tfilter.filter_select(count, buf, thr, n_cand)
    assert idx[0].tolist() == [5, 6, 7, -1] and keys[0, :3].tolist() == [1.0, 2.0, 3.0]
    assert floor[0] == torch.nextafter(torch.tensor(3.5), torch.tensor(math.inf))   # keys left out exceed 3.5
    # the four least keys (equal keys in either order: a list of more than half the buffer is
    # sorted by key alone); the floor is the first key cut off (5.0), below the threshold's
    assert keys[1].tolist() == [1.0, 2.0, 2.0, 4.0] and float(floor[1]) == 5.0
    assert idx[1, 0] == 2 and sorted(idx[1, 1:3].tolist()) == [4, 9] and idx[1, 3] == 5
    assert float(floor[2]) == -math.inf                                    # overflow: not proven
    assert idx[3].tolist() == [-1] * n_cand and torch.isinf(keys[3]).all()
    assert floor[3] > -2.0


def _keys64(qs, ts):
    return ts.bias.double()[None, :] - gp.key_alpha(qs.metric) * (qs.operand.double() @ ts.operand.double().T)


def test_the_kernel_appends_exactly_the_keys_at_most_the_threshold(monkeypatch):
    poison_kernel_buffers(monkeypatch)
    q, t = make_data("gaussian", 37, 203, 40, 7)            # 3 query tiles, 7 target tiles, 3 d-chunks
    qs = gp.prepare_side(torch.from_numpy(q), "l2", "bf16")
    ts = gp.prepare_side(torch.from_numpy(t), "l2", "bf16", frame=qs.frame)
    ref = _keys64(qs, ts)
    ordered = torch.sort(ref, dim=1).values
    thr = ((ordered[:, 11] + ordered[:, 12]) / 2).float()   # midway: 12 hits a row, none at the threshold
    thr[0] = -1e30                                           # no hit
    thr[1] = math.inf                                        # every target: overflows 32 slots
    keys, idx, floor = tfilter.filter_candidates(qs, ts, 8, thr, tiles=TINY, cap=32, splits=3)
    tol = 1e-5 * float(ref.abs().max())
    assert float(floor[1]) == -math.inf and bool((idx[1] >= 0).all())
    assert bool((idx[0] == -1).all()) and floor[0] > -1e30
    for r in range(2, qs.rows):
        assert idx[r].tolist() == ref[r].argsort()[:8].tolist(), r
        assert torch.allclose(keys[r].double(), ref[r, idx[r]], atol=tol), r
        assert abs(float(floor[r]) - float(ordered[r, 8])) <= tol, r   # the first key cut off
    # Fewer hits than the list: every one of them, the floor just above the threshold.
    keys, idx, floor = tfilter.filter_candidates(qs, ts, 16, thr, tiles=TINY, cap=32, splits=2)
    for r in range(2, qs.rows):
        assert sorted(idx[r][idx[r] >= 0].tolist()) == sorted(ref[r].argsort()[:12].tolist())
        assert float(floor[r]) > float(thr[r]) and float(floor[r]) <= float(ordered[r, 12]) + tol


def test_lower_keys_are_the_register_lists_lower_keys(monkeypatch):
    poison_kernel_buffers(monkeypatch)
    q, t = make_data("clustered", 21, 150, 48, 8)
    qs = gp.prepare_side(torch.from_numpy(q), "sqeuclidean", "bf16")
    ts = gp.prepare_side(torch.from_numpy(t), "sqeuclidean", "bf16", frame=qs.frame)
    inf = torch.full((qs.rows,), math.inf)
    got = tfilter.filter_candidates(qs, ts, 16, inf, lower=True, levels=4, tiles=TINY, cap=256)
    lists = tplan.TileConfig(16, 32, 4, kernel="rowlist", extra_passes=2)
    want = tcands.triton_candidates(qs, ts, 16, config=lists, splits=1, lower=True, levels=4)
    tol = 1e-5 * float(want[0].abs().max())
    assert torch.allclose(got[0], want[0], atol=tol)
    assert (got[1] == want[1]).float().mean() > 0.95        # (near-ties in clustered data may swap)


def test_exact_topk_through_the_filter_with_an_overflowing_row(monkeypatch):
    poison_kernel_buffers(monkeypatch)
    q, t = make_data("gaussian", 24, 180, 24, 9)
    t[40:120] = t[3]          # 81 copies of one row: query 0 at it has 81 hits at one key
    q[0] = t[3]
    qs = gp.prepare_side(torch.from_numpy(q), "l2", "bf16")
    ts = gp.prepare_side(torch.from_numpy(t), "l2", "bf16", frame=qs.frame)
    rounds = []

    def generator(q_side, t_side, n_cand, seed=None, lower=False):
        if not rounds:
            ordered = torch.sort(_keys64(q_side, t_side), dim=1).values
            thr = ((ordered[:, 20] + ordered[:, 21]) / 2).float()   # midway: 21 hits a row
            thr[0] = ((ordered[0, 80] + ordered[0, 81]) / 2).float()  # the 81 copies: 8 a slice
            rounds.append(tfilter.filter_candidates(q_side, t_side, n_cand, thr, lower=lower, tiles=TINY, cap=64,
                                                    slots=4))
            return rounds[-1]
        rounds.append(None)
        return gs.torch_candidates(q_side, t_side, n_cand, lower=lower)

    for k in (1, 5):
        rounds.clear()
        v, i = gs.exact_topk(qs, ts, k, generator, seeded=True)
        check_result(q, t, k, "l2", v.numpy(), i.numpy())
        assert float(rounds[0][2][0]) == -math.inf and len(rounds) >= 2   # the overflow widened
        assert i[0].tolist() == ([3] + list(range(40, 120)))[:k]           # ties to the lower index


def _long_case(nq: int = 16, nt: int = 16 * 8 * 144 + 77, d: int = 24):
    """Clustered rows (many near-ties within bf16's error), a block just large enough for a
    long list's sample: query 0 sits on a group of 41 identical rows, query 1 on one of
    2,201, longer than its list (exact ties at the k-th place: not proven by the first list)."""
    q, t = make_data("clustered", nq, nt, d, 13)
    t[1000:1040] = t[5]
    q[0] = t[5]
    t[3000:5200] = t[7]
    q[1] = t[7]
    qs = gp.prepare_side(torch.from_numpy(q), "l2", "bf16")
    ts = gp.prepare_side(torch.from_numpy(t), "l2", "bf16", frame=qs.frame)
    return q, t, qs, ts


def test_a_long_lists_threshold_is_the_jth_key_of_every_16th_target():
    _, _, qs, ts = _long_case()
    step, j = tfilter.filter_sample(2048)
    thr = tfilter.filter_threshold(qs, ts, 2048, None)
    ref = torch.sort(_keys64(qs, ts)[:, ::step], dim=1).values[:, j - 1]
    tol = 1e-5 * float(ref.abs().max())
    assert thr.shape == (qs.rows,) and torch.allclose(thr.double(), ref, atol=tol)
    assert ts.cache[("sample", step)].rows == len(range(0, ts.rows, step))   # kept for the next search
    small = ts.take(torch.arange(16 * tfilter.LONG_MIN_SAMPLE_J * j - 16))
    assert tfilter.filter_threshold(qs, small, 2048, None) is None         # too small a sample


def test_exact_topk_through_a_long_lists_filter_and_torch_widening(monkeypatch):
    """k = 1000 (a first list of 2048, the filter's thresholds from the torch generator over
    the sample) against the float64 oracle; the widening rounds (rows whose threshold fell
    short of the proof, the group's ties) run the torch generator."""
    from nearest_kernels import gpu

    poison_kernel_buffers(monkeypatch)
    q, t, qs, ts = _long_case()
    calls = []
    real = tfilter.filter_candidates

    def recorded(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(tfilter, "filter_candidates", recorded)
    widened = []
    torch_rounds = gs.torch_candidates

    def torch_round(q_side, *args, **kwargs):
        widened.append(q_side.rows)
        return torch_rounds(q_side, *args, **kwargs)

    monkeypatch.setattr(gs, "torch_candidates", torch_round)
    k = 1000
    v, i = gs.exact_topk(qs, ts, k, gpu._long_list_candidates(1 << 30, k), seeded=True)
    assert calls == [2048] and widened and max(widened) < qs.rows    # some rows widened, not all
    check_result(q, t, k, "l2", v.numpy(), i.numpy())
    assert i[0, :41].tolist() == [5] + list(range(1000, 1040))       # ties to the lower index
    assert i[1].tolist() == [7] + list(range(3000, 3000 + k - 1))


def test_a_long_lists_head_and_rest_come_from_its_hits_without_a_sort():
    """The head kernel's k least keys (ties at the k-th key in position order, every hit of a
    row with fewer than k) and the rest kernel's hits past the head within a limit, both
    packed in position order, on hand-made buffers with garbage past the counters."""
    slices, slots, k = 2, 4, 3
    buf = torch.full((4, slices * slots), 0x5A5A5A5A5A5A5A5A, dtype=torch.int64)
    _sliced(buf, 0, slices, [[5.0, 1.0], [3.0, 2.0, 4.0]], [[10, 11], [12, 13, 14]])
    _sliced(buf, 1, slices, [[2.0, 2.0], [1.0, 2.0]], [[20, 21], [22, 23]])      # ties at the k-th key
    _sliced(buf, 2, slices, [[-7.0], []], [[30], []])                            # fewer hits than k
    _sliced(buf, 3, slices, [[-1.0, -2.0, -3.0, -4.0], [0.5]], [[40, 41, 42, 43], [44]])   # negative keys
    count = torch.tensor([[2, 3], [2, 2], [1, 0], [4, 1]], dtype=torch.int32)
    head = torch.full((4, k), -1, dtype=torch.int64)
    kth = torch.empty(4, dtype=torch.int64)
    grid = (4,)
    tfilter.hits_head_kernel[grid](buf, count, head, kth, slices * slots, slices, slots, k, BLOCK_W=8)
    # position order: p * slices + slice
    assert head[0].tolist() == [12, 11, 13]
    assert head[1].tolist() == [20, 22, 21]          # 1.0, then the first two of the three 2.0s
    assert head[2].tolist() == [30, -1, -1] and int(kth[2]) == 2 ** 31 - 1
    assert head[3].tolist() == [41, 42, 43]
    limit = torch.tensor([4.5, 2.0, math.inf, 1.0])
    width = 2
    rest = torch.full((4, width), -1, dtype=torch.int64)
    rest_n = torch.empty(4, dtype=torch.int32)
    tfilter.hits_rest_kernel[grid](buf, count, kth, limit, rest, rest_n, slices * slots, slices, slots, k, width,
                                   BLOCK_W=8)
    assert rest[0].tolist() == [14, -1] and rest[1].tolist() == [23, -1] and rest[2].tolist() == [-1, -1]
    assert rest[3].tolist() == [40, 44] and rest_n.tolist() == [1, 1, 0, 2]
    rest_1 = torch.full((4, 1), -1, dtype=torch.int64)
    tfilter.hits_rest_kernel[grid](buf, count, kth, limit, rest_1, rest_n, slices * slots, slices, slots, k, 1,
                                   BLOCK_W=8)
    assert rest_1[3].tolist() == [40] and int(rest_n[3]) == 2      # past the width: counted, not stored


def test_a_long_list_under_a_cap_ranks_only_pairs_within_it(monkeypatch):
    """k = 1000 under a distance cap through the long list's filter and its own ranking, every
    row against the capped float64 oracle: the cap's limit seeds the thresholds, and a head
    holding a pair beyond the cap re-ranks every hit within the limit."""
    from nearest_kernels import gpu
    from tests.oracle import assert_capped_topk, backend_rtol, key_values, oracle_keys

    poison_kernel_buffers(monkeypatch)
    q, t, qs, ts = _long_case()
    values = key_values(oracle_keys(q, t, "l2"), "l2")
    k = 1000
    cap = float(np.quantile(values, 0.05))        # about 1,100 targets a row within it: some rows fewer than k
    ranked = []
    real = tfilter.long_list_topk

    def recorded(*args, **kwargs):
        ranked.append(args[2].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(tfilter, "long_list_topk", recorded)
    v, i = gs.exact_topk(qs, ts, k, gpu._long_list_candidates(1 << 30, k, cap=cap), seeded=True, cap=cap)
    assert ranked == [qs.rows]
    assert_capped_topk(q, t, k, "l2", cap, v.numpy(), i.numpy(), backend_rtol("gpu"), case="long list")
    counts = (i >= 0).sum(dim=1)
    assert (counts < k).any() and (counts == k).any(), counts


def test_ranked_entries_carry_the_re_ranks_values_in_ranking_order():
    """The packed re-rank (a long list's ranking): each entry unpacks to the value the
    re-rank computes and its index (the worst value and -1 in empty slots), and one sort of
    a row's entries is its order by (value, index), similarities best first, equal values
    (duplicate targets) to the lower index."""
    from nearest_kernels import _triton_rerank as trerank
    from nearest_kernels._gpu_rerank import rank_exact

    q, t = make_data("clustered", 5, 60, 20, 9)
    t[30:33] = t[4]                                   # equal values at several indices
    for metric in ("l2", "inner_product"):
        qs, ts = gp.prepare_pair(torch.from_numpy(q), torch.from_numpy(t), metric, "bf16")
        idx = torch.stack([torch.randperm(60)[:24] for _ in range(5)])
        idx[:, 5:8] = torch.tensor([32, 4, 31])
        idx[1, 10:] = -1
        want = trerank.triton_exact_values(qs, ts, idx)
        entries = trerank.triton_ranked_entries(qs, ts, idx)
        v, i = trerank.entry_values(entries, metric)
        worst = math.inf if metric == "l2" else -math.inf
        assert torch.equal(i, idx) and torch.equal(v, torch.where(idx >= 0, want, worst))
        v, i = trerank.entry_values(torch.sort(entries, dim=1).values, metric)
        ref_v, ref_i = rank_exact(want, idx, 24, metric != "l2")
        assert torch.equal(i, ref_i) and torch.equal(v, ref_v), metric
