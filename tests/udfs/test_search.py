"""udfs.search: the task's searcher, and the keyed search.

The executor's CPU searcher runs the backend the caller asked for, and the task's searcher is
the one the dispatcher chooses.

The keyed search of many tiny groups (udfs.search.grouped_search, nearest_kernels.segments;
issue 22): thousands of groups of 1-12 targets (some smaller than k, some with rows that cannot
rank) and one large group in one target block, against the float64 oracle over each query's
own group, with and without a cap; small groups must share one batched call (the task's kernel
sees only the large group). Then knn_segments and knn_probed (its sgemm form for large
segments) themselves: several segments per query (an IVF plan's probes), the tie rule, the
argument errors, and knn_probed's exact stage's fallbacks on ties.
"""
from __future__ import annotations

import numpy as np
import pytest

from nearest_kernels import cpu, knn
from nearest_kernels.segments import knn_probed, knn_segments
from tests.oracle import (
    assert_capped_topk,
    assert_knn_result,
    backend_rtol,
    key_values,
    oracle_keys,
)
from udfs import search as S
from udfs.search import SEGMENT_WORK, GroupSegments, grouped_search


# -- the task's searcher -------------------------------------------------------------------------

@pytest.mark.parametrize("asked, runs", [("cpu", "cpu"), ("reference", "reference"), ("auto", "auto")])
def test_block_searcher_runs_the_backend_asked_for(monkeypatch, asked, runs):
    """backend="cpu" used to become "auto" here, and "auto" prefers a visible GPU."""
    seen = []

    def spy(q, t, k, metric, backend, **options):
        seen.append(backend)
        return knn(q, t, k, metric, backend="reference")

    monkeypatch.setattr(S, "knn", spy)
    q = np.array([[0.0, 0.0]], np.float32)
    t = np.array([[3.0, 4.0], [1.0, 0.0]], np.float32)
    values, indices = S.BlockSearcher(S.SearchSettings(2, "l2", asked), threads=1).search(q, t)
    assert seen == [runs]
    assert indices.tolist() == [[1, 0]] and values.tolist() == [[1.0, 5.0]]


def test_an_explicit_cpu_backend_never_opens_a_gpu_searcher(monkeypatch):
    monkeypatch.setattr(S, "cuda_may_exist", lambda: True)
    chosen = S.open_block_searcher(S.SearchSettings(2, "l2", "cpu"))
    assert type(chosen) is S.BlockSearcher and chosen.backend == "cpu"


def test_auto_opens_the_gpu_searcher_the_dispatcher_chooses(monkeypatch):
    import udfs.gpu_search as G
    from nearest_kernels import dispatch

    monkeypatch.setattr(S, "cuda_may_exist", lambda: True)
    monkeypatch.setattr(dispatch, "choose_task_backend", lambda backend, skip=None: ("gpu", []))
    sentinel = object()
    monkeypatch.setattr(G, "gpu_searcher_or_none", lambda settings: sentinel)
    assert S.open_block_searcher(S.SearchSettings(2, "l2", "auto")) is sentinel


def test_auto_without_a_gpu_probe_skips_the_gpu_backend_with_a_reason(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(S, "cuda_may_exist", lambda: False)
    with caplog.at_level(logging.INFO, logger="udfs.search"):
        chosen = S.open_block_searcher(S.SearchSettings(2, "l2", "auto"))
    assert type(chosen) is S.BlockSearcher and chosen.backend == "cpu"
    assert "task backend cpu (gpu: no GPU assigned" in caplog.text


def test_an_explicit_gpu_backend_without_a_device_is_an_error(monkeypatch):
    import udfs.gpu_search as G

    monkeypatch.setattr(G, "gpu_searcher_or_none", lambda settings: None)
    with pytest.raises(RuntimeError, match="backend 'gpu' requested"):
        S.open_block_searcher(S.SearchSettings(2, "l2", "gpu"))


def test_a_cpu_task_searches_its_blocks_without_importing_torch(monkeypatch):
    """Where the probe finds no GPU, the task's CPU searcher runs "cpu" on every block: "auto"
    per block would load the GPU backend first (the registry imports its module, and with it
    torch: seconds per Python worker) only to hear that it has no device."""
    from nearest_kernels import dispatch

    loaded = []
    load = dispatch._load

    def spy(entry):
        loaded.append(entry.name)
        return load(entry)

    monkeypatch.setattr(dispatch, "_load", spy)
    monkeypatch.setattr(S, "cuda_may_exist", lambda: False)
    chosen = S.open_block_searcher(S.SearchSettings(2, "l2", "auto"))
    values, indices = chosen.search(np.array([[0.0, 0.0]], np.float32), np.array([[3.0, 4.0], [1.0, 0.0]], np.float32))
    assert chosen.backend == "cpu" and indices.tolist() == [[1, 0]]
    assert "gpu" not in loaded and "cpu" in loaded


def test_auto_whose_gpu_searcher_cannot_open_runs_the_next_backend(monkeypatch):
    import udfs.gpu_search as G
    from nearest_kernels import dispatch

    monkeypatch.setattr(S, "cuda_may_exist", lambda: True)
    real = dispatch.choose_task_backend
    monkeypatch.setattr(dispatch, "choose_task_backend",
                        lambda backend, skip=None: ("gpu", []) if not skip else real(backend, skip=skip))
    monkeypatch.setattr(G, "gpu_searcher_or_none", lambda settings: None)
    chosen = S.open_block_searcher(S.SearchSettings(2, "l2", "auto"))
    assert type(chosen) is S.BlockSearcher and chosen.backend == "cpu"


# -- the keyed search ----------------------------------------------------------------------------

METRICS = ("l2", "sqeuclidean", "cosine", "inner_product")
SIMILARITY = ("cosine", "inner_product")
N_KEYS, D, K = 2000, 8, 5
LARGE_GROUP = N_KEYS          # one group big enough for its own kernel call
LARGE_TARGETS, LARGE_QUERIES = 520, 300
RTOL = backend_rtol("cpu")


@pytest.fixture(scope="module")
def block():
    rng = np.random.default_rng(2202)
    sizes = rng.integers(1, 13, N_KEYS)                      # 1-12 targets: many below k
    t_groups = np.concatenate([np.repeat(np.arange(N_KEYS), sizes), np.full(LARGE_TARGETS, LARGE_GROUP),
                               [-1, -1]])
    rng.shuffle(t_groups)                                      # groups interleaved in the block
    targets = (rng.standard_normal((t_groups.size, D)) + 0.3).astype(np.float32)
    targets[rng.choice(t_groups.size, 40, replace=False)] = 0.0    # cosine cannot rank these
    targets[rng.choice(t_groups.size, 40, replace=False), 3] = np.nan
    # Queries of small groups, of the large one, of a group the block lacks, and of none.
    q_groups = np.concatenate([rng.integers(0, N_KEYS, 2 * N_KEYS), np.full(LARGE_QUERIES, LARGE_GROUP),
                               [N_KEYS + 7, -1]])
    rng.shuffle(q_groups)
    queries = (rng.standard_normal((q_groups.size, D)) + 0.3).astype(np.float32)
    queries[0] = np.nan
    assert LARGE_QUERIES * LARGE_TARGETS * D > SEGMENT_WORK and 4 * 12 * D < SEGMENT_WORK
    return queries, q_groups, targets, t_groups


def _cap(queries, q_groups, targets, t_groups, metric):
    """A cap that leaves some queries fewer than k of their group and some none: the value of
    a middling pair of the large group, moved half-way to its neighbour."""
    values = np.sort(key_values(oracle_keys(queries[q_groups == LARGE_GROUP][:20],
                                            targets[t_groups == LARGE_GROUP], metric), metric).ravel())
    values = values[np.isfinite(values)]
    at = int(values.size * (0.9 if metric in SIMILARITY else 0.1))
    return float((values[at] + values[at + 1]) / 2)


@pytest.mark.parametrize("capped", [False, True], ids=["uncapped", "capped"])
@pytest.mark.parametrize("metric", METRICS)
def test_many_tiny_groups_against_the_oracle(block, metric, capped):
    queries, q_groups, targets, t_groups = block
    cap = _cap(queries, q_groups, targets, t_groups, metric) if capped else None
    segments = GroupSegments.of(t_groups)
    calls = []

    def search(q, t):
        calls.append((q.shape[0], t.shape[0]))
        return knn(q, t, K, metric, backend="cpu", threads=2, cap=cap)

    values, rows = grouped_search(search, queries, q_groups, targets[segments.order], segments, K,
                                  metric, cap=cap, threads=2)
    # The 2,000 small groups share one batched call: the task's kernel sees the large group only.
    assert calls == [(LARGE_QUERIES, LARGE_TARGETS)]
    unbounded = -np.inf if metric in SIMILARITY else np.inf
    worst = -np.inf if metric in SIMILARITY else np.inf
    fewer = 0
    for g in np.unique(q_groups):
        members = np.flatnonzero(q_groups == g)
        allowed = np.flatnonzero(t_groups == g) if g >= 0 else np.zeros(0, np.int64)
        if allowed.size == 0:   # no group, or one the block lacks: empty slots
            assert (rows[members] == -1).all() and (values[members] == worst).all(), g
            continue
        local = np.where(rows[members] >= 0, np.searchsorted(allowed, rows[members]), -1)
        in_group = np.isin(rows[members], allowed) | (rows[members] < 0)
        assert in_group.all(), f"group {g}: rows {rows[members].tolist()} outside {allowed.tolist()}"
        assert (values[members][rows[members] < 0] == worst).all(), g
        assert_capped_topk(queries[members], targets[allowed], K, metric,
                           unbounded if cap is None else cap, values[members], local, RTOL,
                           case=f"group {g}")
        fewer += int((rows[members][:, -1] < 0).sum())
    assert fewer > 0    # some queries had fewer than k (small groups, the cap)


SEGMENT_SEARCHES = pytest.mark.parametrize("search", [knn_segments, knn_probed],
                                           ids=["knn_segments", "knn_probed"])


@SEGMENT_SEARCHES
@pytest.mark.parametrize("offset, scale", [(0.0, 1.0), (1e3, 1.0), (0.0, 1e-30), (0.0, 1e30)])
def test_segments_probe_several_segments_per_query(search, offset, scale):
    # An IVF plan's shape: each query searches the union of 0-3 segments (some empty), with
    # rows that cannot rank, far from the origin and at extreme magnitudes.
    rng = np.random.default_rng(7)
    starts = np.concatenate([[0], np.cumsum(rng.integers(0, 30, 40))])
    targets = ((rng.standard_normal((starts[-1], 33)) + offset) * scale).astype(np.float32)
    targets[5] = targets[6]     # a duplicate
    targets[9] = 0.0            # cosine cannot rank it
    targets[11, 2] = np.nan
    queries = ((rng.standard_normal((60, 33)) + offset) * scale).astype(np.float32)
    queries[3] = np.nan
    probes = [rng.choice(40, rng.integers(0, 4), replace=False) for _ in range(60)]
    probe_starts = np.concatenate([[0], np.cumsum([p.size for p in probes])])
    for metric in METRICS:
        values, indices = search(queries, targets, starts, probe_starts, np.concatenate(probes), 7,
                                 metric, threads=2)
        for i, p in enumerate(probes):
            rows = np.sort(np.concatenate([np.arange(starts[s], starts[s + 1]) for s in p] + [[]])).astype(int)
            # The oracle's rows: those that can rank (no NaN; no zero vector under cosine).
            rows = rows[np.isfinite(targets[rows]).all(axis=1) & (metric != "cosine" or targets[rows].any(axis=1))]
            if rows.size == 0 or not np.isfinite(queries[i]).all():   # probes nothing, cannot rank
                assert (indices[i] == -1).all(), (metric, i)
                continue
            local = np.where(indices[i] >= 0, np.searchsorted(rows, indices[i]), -1)
            assert np.isin(indices[i][indices[i] >= 0], rows).all(), (metric, i)
            assert_knn_result(queries[i:i + 1], targets[rows], 7, metric, values[i:i + 1], local[None],
                              RTOL, case=f"{metric} query {i}")


@SEGMENT_SEARCHES
def test_segments_ties_go_to_the_lower_row(search):
    targets = np.array([[1.0], [3.0], [1.0], [1.0], [9.0]], np.float32)
    values, indices = search(np.array([[2.0]], np.float32), targets, np.array([0, 2, 5]),
                             np.array([0, 2]), np.array([1, 0]), 4, "l2")
    assert indices.tolist() == [[0, 1, 2, 3]] and values.tolist() == [[1.0, 1.0, 1.0, 1.0]]


def test_each_segment_takes_the_fewest_tiles_padding_least():
    """A probed search's segment tile: a multiple of TILE_MULTIPLE up to TARGET_TILE, as few
    tiles as the segment needs at TARGET_TILE, and each pads fewer than TILE_MULTIPLE rows."""
    for rows in range(1, 3000):
        tile = cpu.segment_tile(rows)
        tiles = -(-rows // tile)
        assert tile % cpu.TILE_MULTIPLE == 0 and tile <= cpu.TARGET_TILE, rows
        assert tiles == -(-rows // cpu.TARGET_TILE), rows
        assert tiles * tile - rows < tiles * cpu.TILE_MULTIPLE, rows
    # the probed search takes all its segments' tiles at once
    assert cpu.segment_tile(np.arange(1, 3000)).tolist() == [cpu.segment_tile(rows) for rows in range(1, 3000)]


@pytest.mark.parametrize("copies", [300, 3000])
@pytest.mark.parametrize("metric", METRICS)
def test_knn_probed_ties_beyond_its_heap(copies, metric, monkeypatch):
    """A query among ``copies`` identical targets (a duplicate group, as real embeddings have)
    spread over three segments, near-copies one ulp away, and other rows: its k-th place is
    a tie the sgemm's heap cannot settle. 300 copies are settled by the collecting search,
    3000 (more than it keeps) by float64 keys over every probed row; either way the k
    lowest-indexed copies, as knn_segments ranks them."""
    rng = np.random.default_rng(copies)
    d = 24
    row = (rng.standard_normal(d) + 3.0).astype(np.float32)
    others = (rng.standard_normal((1000, d)) + 3.0).astype(np.float32)
    near = np.tile(row, (40, 1))
    near[np.arange(40), np.arange(40) % d] = np.nextafter(row[np.arange(40) % d], np.float32(np.inf))
    targets = np.concatenate([others[:500], np.tile(row, (copies, 1)), near, others[500:]])
    targets = targets[rng.permutation(targets.shape[0])]
    starts = np.array([0, targets.shape[0] // 3, targets.shape[0] // 2, targets.shape[0]])
    queries = np.stack([row, others[0]])
    probe_starts, probes = np.array([0, 3, 5]), np.array([2, 0, 1, 1, 2])
    fallbacks = []
    real = cpu._probed_float64
    monkeypatch.setattr(cpu, "_probed_float64", lambda *a: fallbacks.append(a[1]) or real(*a))
    for k in (1, 10, 100):
        expected = knn_segments(queries, targets, starts, probe_starts, probes, k, metric)
        values, indices = knn_probed(queries, targets, starts, probe_starts, probes, k, metric, threads=2)
        np.testing.assert_array_equal(indices, expected[1], err_msg=f"{metric} k={k}")
        np.testing.assert_allclose(values, expected[0], rtol=RTOL, err_msg=f"{metric} k={k}")
    assert bool(fallbacks) == (copies > cpu.COLLECT_WIDTH and metric != "inner_product"), fallbacks


@pytest.mark.parametrize("starts, probe_starts, probes, argument", [
    ([0, 3, 2], [0, 1], [0], "segment_starts"),
    ([0, 9], [0, 1], [0], "segment_starts"),
    ([0, 2], [0, 2], [0], "probe_starts"),
    ([0, 2], [0, 1], [1], "probe_segments"),
])
@SEGMENT_SEARCHES
def test_segments_errors_name_the_argument(search, starts, probe_starts, probes, argument):
    with pytest.raises(ValueError, match=f"^{argument}:"):
        search(np.zeros((1, 2), np.float32), np.zeros((3, 2), np.float32), np.array(starts),
                     np.array(probe_starts), np.array(probes), 2)
