"""The CPU backend's operand choice and exact ranking step (``nearest_kernels.cpu``).

The search's exactness on every input is checked in ``test_exactness.py``; these tests pin the
two decisions that exactness must not depend on: whether a block is multiplied as it is or
shifted and scaled, and the (key, index) order of the candidates.
"""
from __future__ import annotations

import numpy as np
import pytest

from nearest_kernels import _cpu_kernels, cpu
from nearest_kernels._common import resolve_metric
from tests import adversarial


def _operands(targets, metric="l2", queries=None):
    queries = targets[:7] if queries is None else queries
    return cpu._Operands(queries, targets, resolve_metric(metric))


@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "inner_product"])
def test_centred_float32_block_is_multiplied_as_it_is(metric):
    targets = np.random.default_rng(0).standard_normal((500, 16)).astype(np.float32)
    ops = _operands(targets, metric)
    assert ops.targets32 is ops.targets


@pytest.mark.parametrize("nq, threads", [(7, 1), (7, 2), (3000, 2)], ids=["one item", "splits", "query tiles"])
def test_deferred_inner_product_bound_equals_the_bound_from_a_read_of_the_block(nq, threads):
    """An uncapped inner product on a float32 block used as it is takes the block's largest
    norm and element from the search's tiles: every target counted once, whatever the split
    into items, so the bound is the one a read of the whole block gives."""
    rng = np.random.default_rng(3)
    targets = rng.standard_normal((2100, 24)).astype(np.float32)
    targets[1777] *= 40    # one long row, in a middle tile
    queries = rng.standard_normal((nq, 24)).astype(np.float32)
    read = cpu._Operands(queries, targets, resolve_metric("inner_product"))
    deferred = cpu._Operands(queries, targets, resolve_metric("inner_product"), defer_target_stats=True)
    assert deferred.deferred and not read.deferred and np.shares_memory(deferred.targets32, targets)
    with cpu.thread_limits(threads) as used:
        query_tile, target_tile, n_split = cpu.plan_tiles(nq, targets.shape[0], used)
        heaps, stats = cpu._search(deferred, 10, query_tile, target_tile, n_split)
        want, _ = cpu._search(read, 10, query_tile, target_tile, n_split)
    assert stats.shape[0] == -(-nq // query_tile) * n_split > 0
    assert deferred.finish(stats) and not deferred.deferred
    np.testing.assert_allclose(deferred.margin, read.margin, rtol=1e-12)
    np.testing.assert_array_equal(heaps, want)


def test_deferred_block_with_huge_elements_is_searched_again_scaled():
    """Elements beyond AS_IS_PEAKS void the deferred search (its float32 products may
    overflow); finish says so, and the kernel answers from scaled operands (the oracle)."""
    from tests.oracle import assert_knn_result

    rng = np.random.default_rng(4)
    targets = (rng.standard_normal((900, 8)) * 1e30).astype(np.float32)
    queries = (rng.standard_normal((20, 8)) * 1e30).astype(np.float32)
    deferred = cpu._Operands(queries, targets, resolve_metric("inner_product"), defer_target_stats=True)
    with cpu.thread_limits(1) as used:
        query_tile, target_tile, n_split = cpu.plan_tiles(20, 900, used)
        _, stats = cpu._search(deferred, 10, query_tile, target_tile, n_split)
    assert not deferred.finish(stats)
    values, indices = cpu.BACKEND.run(queries, targets, 5, resolve_metric("inner_product"), threads=1)
    assert_knn_result(queries, targets, 5, "inner_product", values, indices, cpu.RANK_TOLERANCE)


@pytest.mark.parametrize("make, why", [
    (lambda t: t + np.float32(10.0), "offset: shifted by the mean"),
    (lambda t: t.astype(np.float64), "float64 rows are rounded to float32"),
    (lambda t: t * np.float32(1e-30), "tiny: scaled up"),
    (lambda t: t * np.float32(1e20), "huge: scaled down"),
])
def test_other_blocks_are_shifted_or_scaled(make, why):
    targets = make(np.random.default_rng(1).standard_normal((500, 16)).astype(np.float32))
    ops = _operands(targets)
    assert ops.targets32 is not ops.targets, why
    assert ops.targets32.dtype == np.float32


def test_cosine_always_uses_unit_copies():
    targets = np.random.default_rng(2).standard_normal((300, 8)).astype(np.float32)
    assert not np.shares_memory(_operands(targets, "cosine").targets32, targets)


def test_queries_far_beyond_the_targets_rescale_both():
    targets = np.random.default_rng(3).standard_normal((300, 8)).astype(np.float32)
    queries = targets[:5] * np.float32(2.0 ** 50)
    ops = _operands(targets, "l2", queries)
    assert ops.targets32 is not ops.targets
    assert np.abs(ops.scaled).max() <= 2.0 * 2.0 ** cpu.QUERY_HEADROOM


@pytest.mark.parametrize("offset, spread, as_is", [(0.02, 1.0, True), (10.0, 0.1, False)],
                         ids=["nearly centred", "offset"])
@pytest.mark.parametrize("metric", ["l2", "inner_product"])
def test_both_operand_choices_agree_with_the_oracle(offset, spread, as_is, metric):
    case = adversarial.offset_case(128, offset, spread, nq=40, nt=2000, seed=32)
    assert np.shares_memory(_operands(case.targets, metric).targets32, case.targets) is as_is
    values, indices = cpu.BACKEND.run(case.queries, case.targets, 10, resolve_metric(metric), threads=1)
    adversarial.assert_true_topk(case.queries, case.targets, 10, metric, values, indices,
                                 rtol=cpu.RANK_TOLERANCE, case=case.name)


def _lexsorted(keys, cand, width):
    order = np.lexsort((np.where(cand >= 0, cand, np.iinfo(np.int64).max), keys), axis=1)[:, :width]
    return np.take_along_axis(keys, order, 1), np.take_along_axis(cand, order, 1)


@pytest.mark.parametrize("kind", ["nearly sorted", "ties", "shuffled", "one column"])
def test_best_by_key_orders_by_key_then_index(kind):
    rng = np.random.default_rng(hash(kind) % 2 ** 32)
    rows, n = 40, {"one column": 1}.get(kind, 150)
    if kind == "nearly sorted":      # what the search hands over: float32 order, exact keys
        keys = np.sort(rng.standard_normal((rows, n)), axis=1) + 1e-3 * rng.standard_normal((rows, n))
    elif kind == "ties":             # integer data: the insertion sort gives up, merge sorts
        keys = rng.integers(0, 3, (rows, n)).astype(np.float64)
    else:
        keys = rng.standard_normal((rows, n))
    cand = np.stack([rng.permutation(4 * n)[:n] for _ in range(rows)]).astype(np.int64)
    empty = rng.random((rows, n)) < 0.1
    cand[empty], keys[empty] = -1, np.inf
    for width in sorted({1, n // 2 or 1, n}):
        best_key, best_index = np.empty((rows, width)), np.empty((rows, width), np.int64)
        _cpu_kernels.best_by_key(keys, cand, best_key, best_index)
        want_key, want_index = _lexsorted(keys, cand, width)
        np.testing.assert_array_equal(best_key, want_key)
        np.testing.assert_array_equal(best_index, want_index)


@pytest.mark.parametrize("nq, nt, d, kept", [
    (7, 700, 8, 1000),    # heap wider than the first tile, which is the padded tail
    (50, 300, 4, 64),     # one tile, padded: padding must never enter
    (50, 3000, 3, 100),   # seeded, then folded
    (30, 2000, 1, 63),    # just below SEED_WIDTH: inserts only
], ids=["wide", "tail only", "seeded", "inserts"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("capped", [False, True], ids=["uncapped", "capped"])
def test_search_keeps_the_smallest_scores_ties_to_the_lower_index(nq, nt, d, kept, threads, capped):
    """The fused search (seeded by a selection for wide heaps) keeps exactly each row's
    ``kept`` smallest float32 scores, ties to the lower target, whatever the target split;
    under a cap's initial key, only those within it (the other slots keep that key)."""
    rng = np.random.default_rng(nq + nt)
    queries = rng.integers(-2, 3, (nq, d)).astype(np.float32)     # integers: many ties
    targets = rng.integers(-2, 3, (nt, d)).astype(np.float32)
    bias = (targets.astype(np.float64) ** 2).sum(axis=1).astype(np.float32)
    kept = min(kept, nt)
    scores = ((-2 * queries) @ targets.T + bias).astype(np.float32)   # exact: small integers
    # a cap at each row's median score: admits the scores <= it, about half the targets
    cap = np.median(scores, axis=1).astype(np.float64) if capped else np.full(nq, np.inf)
    with cpu.thread_limits(threads) as used:
        query_tile, target_tile, n_split = cpu.plan_tiles(nq, nt, used)
        tail, tail_bias = cpu._tail_tile(targets, bias, target_tile)
        heaps = np.empty((n_split, nq, kept), dtype=np.uint64)
        heaps[:] = _cpu_kernels.cap_key(cap)[None, :, None]
        _cpu_kernels.search_tiles(-2 * queries, targets, bias, tail, tail_bias, heaps, query_tile,
                                  np.zeros((0, 2)))
    keys = np.sort(np.concatenate(list(heaps), axis=1), axis=1)[:, :kept]
    _, found = _cpu_kernels.decode(keys)
    for i in range(nq):
        within = np.flatnonzero(scores[i] <= cap[i])
        want = within[np.lexsort((within, scores[i][within]))][:kept]
        np.testing.assert_array_equal(found[i][:len(want)], want)
        assert (found[i][len(want):] == _cpu_kernels.EMPTY_INDEX).all()


def _search_counts(caplog) -> tuple[int, int]:
    """(collected rows, float64 rows) of the last cpu knn debug line."""
    line = [r.getMessage() for r in caplog.records if "float64 rows=" in r.getMessage()][-1]
    return int(line.split("collected rows=")[1].split()[0]), int(line.split("float64 rows=")[1])


@pytest.mark.parametrize("metric, cap", [("l2", None), ("inner_product", None), ("cosine", None),
                                         ("l2", 4.5)], ids=["l2", "inner_product", "cosine", "l2-capped"])
def test_exact_ties_at_the_kth_place_are_settled_without_the_float64_scan(metric, cap, caplog):
    """Integer data: many targets tie exactly at a row's k-th distance, which no float32
    score can prove. Those rows are searched again keeping every target that can be within
    their k-th key and ranked exactly (ties to the lower target); none needs the float64 scan."""
    from tests.oracle import assert_capped_topk, assert_knn_result

    rng = np.random.default_rng(8)
    d = 8 if metric == "cosine" else 16   # (directions of small integer vectors tie often in d=8)
    queries = rng.integers(0, 3 if metric == "cosine" else 4, (300, d)).astype(np.float32)
    targets = rng.integers(0, 3 if metric == "cosine" else 4, (5000, d)).astype(np.float32)
    queries[:, 0] += 1    # no zero rows (cosine)
    targets[:, 0] += 1
    m = resolve_metric(metric)
    with caplog.at_level("DEBUG", logger="nearest_kernels.cpu"):
        values, indices = cpu.BACKEND.run(queries, targets, 10, m, threads=2, cap=cap)
    collected, scanned = _search_counts(caplog)
    assert collected > 0 and scanned == 0, (collected, scanned)
    if cap is None:
        assert_knn_result(queries, targets, 10, metric, values, indices, cpu.RANK_TOLERANCE)
    else:
        assert_capped_topk(queries, targets, 10, metric, cap, values, indices, cpu.RANK_TOLERANCE)


def test_rows_tied_with_more_targets_than_collected_are_searched_in_float64(caplog):
    """Every target equal: each row ties with all of them, more than the second search keeps,
    so the float64 search of every target answers (the k lowest targets, exactly)."""
    nt = cpu.COLLECT_WIDTH + 500
    targets = np.tile(np.float32([1.0, 2.0, 3.0]), (nt, 1))
    queries = np.float32([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [5.0, -1.0, 2.0]])
    with caplog.at_level("DEBUG", logger="nearest_kernels.cpu"):
        values, indices = cpu.BACKEND.run(queries, targets, 5, resolve_metric("l2"), threads=1)
    assert _search_counts(caplog) == (3, 3)
    np.testing.assert_array_equal(indices, np.tile(np.arange(5), (3, 1)))
    want = np.sqrt(((queries.astype(np.float64) - [1.0, 2.0, 3.0]) ** 2).sum(axis=1)).astype(np.float32)
    np.testing.assert_array_equal(values, np.repeat(want[:, None], 5, axis=1))


@pytest.mark.parametrize("metric", ["l2", "inner_product", "cosine"])
def test_the_kernels_compile_one_variant_whatever_flags_the_caller_s_rows_carry(metric):
    # numba types a read-only array apart from a writable one: the wrappers pass every array a
    # kernel only reads read-only, so rows of either kind run the same compiled variants.
    from numba.core.registry import CPUDispatcher

    from nearest_kernels import _cpu_kernels, knn

    def variants() -> dict:
        return {name: len(f.signatures) for name, f in vars(_cpu_kernels).items() if isinstance(f, CPUDispatcher)}

    rng = np.random.default_rng(5)
    queries = rng.standard_normal((9, 8)).astype(np.float32)
    targets = rng.standard_normal((300, 8)).astype(np.float32)
    knn(queries, targets, 3, metric, backend="cpu")
    before = variants()
    queries.flags.writeable = targets.flags.writeable = False
    knn(queries, targets, 3, metric, backend="cpu")
    assert variants() == before
    assert not queries.flags.writeable and not targets.flags.writeable   # the caller's flags, as they were
    writable = rng.standard_normal((300, 8)).astype(np.float32)
    knn(writable[:9], writable, 3, metric, backend="cpu")
    assert variants() == before and writable.flags.writeable
