"""udfs.gpu_search and what it is built from (udfs.gpu_memory, the task's GPU in udfs.context):
device choice from the task's GPU address, the CPU fallback, the searcher loop, staging,
resident and kept target blocks.

The searcher runs here on a CPU torch device (no streams, no pinning) with the torch path:
batching, the resident target block and the row filtering are the same code as on a GPU.
"""
import dataclasses

import numpy as np
import pytest

from nearest_kernels import knn
from tests.oracle import assert_knn_result, backend_rtol
from udfs import columns as C
from udfs.context import JoinContext, SearchSettings, SideLayout

torch = pytest.importorskip("torch", reason="torch is not installed")

from udfs import context, gpu_memory  # noqa: E402
from udfs import gpu_search as G  # noqa: E402


def test_memory_budget_is_the_fraction_of_the_tasks_share():
    gib = 1 << 30
    assert G.memory_budget(100 * gib, 140 * gib) == int(100 * gib * G.MEMORY_FRACTION)
    # Two tasks per GPU (spark.task.resource.gpu.amount 0.5): each at most half the device,
    # also when it opens first and sees it all free.
    assert G.memory_budget(140 * gib, 140 * gib, 0.5) == int(70 * gib * G.MEMORY_FRACTION)
    assert G.memory_budget(40 * gib, 140 * gib, 0.5) == int(40 * gib * G.MEMORY_FRACTION)
    assert G.memory_budget(140 * gib, 140 * gib, 2.0) == int(140 * gib * G.MEMORY_FRACTION)


def test_address_is_the_cuda_ordinal():
    assert context.address_to_ordinal("1") == 1
    with pytest.raises(ValueError, match="GPU address"):
        context.address_to_ordinal("GPU-3f2a")


def test_task_address_and_scope_outside_spark_come_from_the_local_task():
    assert context.task_gpu_address() is None and context.task_scope() is None
    with context.local_task(gpu="1", scope="stage 2"):
        assert context.task_gpu_address() == "1" and context.task_scope() == "stage 2"
        with context.local_task(scope="stage 3"):
            assert context.task_gpu_address() is None and context.task_scope() == "stage 3"
        assert context.task_scope() == "stage 2"
    assert context.task_gpu_address() is None and context.task_scope() is None


def test_no_searcher_without_cuda_or_for_cpu_backends(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert G.gpu_searcher_or_none(SearchSettings(3, "l2", "auto")) is None
    assert G.gpu_searcher_or_none(SearchSettings(3, "l2", "cpu")) is None


@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_searcher_batches_and_resident_targets_match_the_reference(metric, precision):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((53, 7)).astype(np.float64)   # float64, as Spark's doubles arrive
    t = rng.standard_normal((211, 7)).astype(np.float32)
    q[4] = np.nan
    t[10] = 0.0
    searcher = G.GpuBlockSearcher(SearchSettings(6, metric, "gpu", precision), torch.device("cpu"),
                                  batch_rows=20)
    ref_v, ref_i = knn(q, t, 6, metric, backend="reference")
    for _ in range(2):   # the second call reuses the resident block
        v, i = searcher.search(q, t, target_key=("block", 1))
        np.testing.assert_array_equal(i, ref_i)
        np.testing.assert_allclose(v, ref_v, rtol=1e-5, atol=1e-5)
    resident = searcher._targets
    searcher.search(q, t, target_key=("block", 1))
    assert searcher._targets is resident
    other = t[::-1].copy()
    v, i = searcher.search(q, other, target_key=("block", 2))
    np.testing.assert_array_equal(i, knn(q, other, 6, metric, backend="reference")[1])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_float64_rows_are_searched_from_their_own_values(precision):
    """Map-like float64 coordinates 0.01 apart at 1e8 (float32 spacing there: 8): staged as
    float32 every target would be the same point; the searcher keeps the float64 rows, so
    the answer is the oracle's true top k."""
    rng = np.random.default_rng(5)
    t = 1e8 + 0.01 * rng.permutation(400)[:, None] + np.array([[0.0, 0.0]])
    q = 1e8 + 4.0 * rng.random((9, 2))
    assert np.unique(t.astype(np.float32), axis=0).shape[0] < 5     # what float32 would see
    searcher = G.GpuBlockSearcher(SearchSettings(5, "l2", "gpu", precision), torch.device("cpu"))
    v, i = searcher.search(q, t, target_key="map")
    assert searcher._targets.side.source.dtype == torch.float64
    assert_knn_result(q, t, 5, "l2", v, i, backend_rtol("gpu"), case=f"float64 {precision}")


def test_a_one_batch_query_block_stays_on_the_device_for_the_same_memory():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((40, 5)).astype(np.float32)
    t1 = rng.standard_normal((90, 5)).astype(np.float32)
    t2 = rng.standard_normal((70, 5)).astype(np.float32)
    searcher = G.GpuBlockSearcher(SearchSettings(3, "l2", "gpu"), torch.device("cpu"))
    searcher.search(q, t1, target_key=1)
    cached = searcher._query_cache[1]
    view = q[:]                                   # another array object over the same memory
    _, i = searcher.search(view, t2, target_key=2)
    assert searcher._query_cache[1] is cached
    np.testing.assert_array_equal(i, knn(q, t2, 3, "l2", backend="reference")[1])
    other = q + 1.0                               # same shape, other memory: uploaded again
    _, i = searcher.search(other, t2, target_key=2)
    np.testing.assert_array_equal(i, knn(other, t2, 3, "l2", backend="reference")[1])


def test_a_prefetched_query_block_is_searched_from_its_device_copy():
    """prefetch (the broadcast plan's main thread, while the worker searches) stages the
    next query block; its search uses that copy, and only for the same memory."""
    rng = np.random.default_rng(9)
    q1, q2 = (rng.standard_normal((40, 5)).astype(np.float32) for _ in range(2))
    t = rng.standard_normal((90, 5)).astype(np.float32)
    searcher = G.GpuBlockSearcher(SearchSettings(3, "l2", "gpu"), torch.device("cpu"))
    searcher.search(q1, t, target_key=1)
    searcher.prefetch(q2)
    staged = searcher.staging.ahead[0][1]
    q2[0] += 100.0          # the copy was taken at prefetch: a search must not read it again
    _, i = searcher.search(q2, t, target_key=1)
    assert searcher.staging.ahead == [] and searcher._query_cache[1] is staged
    expected = q2.copy()
    expected[0] -= 100.0
    np.testing.assert_array_equal(i, knn(expected, t, 3, "l2", backend="reference")[1])
    # Another array (even equal values) is not the prefetched one: copied as usual.
    searcher.prefetch(q1)
    other = q1.copy()
    _, i = searcher.search(other, t, target_key=1)
    assert len(searcher.staging.ahead) == 1 and searcher._query_cache[1] is not searcher.staging.ahead[0][1]
    np.testing.assert_array_equal(i, knn(q1, t, 3, "l2", backend="reference")[1])
    # A block of more than one batch is not staged.
    small = G.GpuBlockSearcher(SearchSettings(3, "l2", "gpu"), torch.device("cpu"), batch_rows=16)
    small.prefetch(q1)
    assert small.staging.ahead == []


def test_two_blocks_staged_before_the_first_search_are_both_used():
    """At a task's start the main thread may decode and stage the second query block before
    the worker's first search (which waits for the target block) takes the first: both stay
    staged, in their own slots; a third replaces the oldest."""
    rng = np.random.default_rng(10)
    qs = [rng.standard_normal((40, 5)).astype(np.float32) for _ in range(3)]
    t = rng.standard_normal((90, 5)).astype(np.float32)
    searcher = G.GpuBlockSearcher(SearchSettings(3, "l2", "gpu"), torch.device("cpu"))
    searcher.prefetch(qs[0])
    searcher.prefetch(qs[1])
    searcher.prefetch(qs[1])                  # already staged: nothing more
    staged = [entry[1] for entry in searcher.staging.ahead]
    assert len(staged) == 2 and {entry[3] for entry in searcher.staging.ahead} == {"ahead0", "ahead1"}
    for q in qs[:2]:
        q[0] += 100.0                         # the searches must use the staged copies
    for n in range(2):
        _, i = searcher.search(qs[n], t, target_key=1)
        assert searcher._query_cache[1] is staged[n]
        expected = qs[n].copy()
        expected[0] -= 100.0
        np.testing.assert_array_equal(i, knn(expected, t, 3, "l2", backend="reference")[1])
    assert searcher.staging.ahead == []
    for q in qs:
        searcher.prefetch(q)
    assert [entry[0] is q for entry, q in zip(searcher.staging.ahead, qs[1:])] == [True, True]
    # Searching the newest drops the one staged before it (blocks are searched in order).
    searcher.search(qs[2], t, target_key=1)
    assert searcher.staging.ahead == []


def test_target_blocks_stay_resident_within_the_budget_least_recent_out_first():
    rng = np.random.default_rng(12)
    q = rng.standard_normal((30, 4)).astype(np.float32)
    blocks = [rng.standard_normal((50, 4)).astype(np.float32) for _ in range(3)]
    block_bytes = gpu_memory.prepared_bytes(50, 4, "fp32", 4)
    # Room for two blocks in TARGET_SHARE of the budget.
    searcher = G.GpuBlockSearcher(SearchSettings(2, "l2", "gpu"), torch.device("cpu"),
                                  memory_bytes=int(2.5 * block_bytes / G.TARGET_SHARE))
    for key in (0, 1, 0, 2):             # 0 is used again, so 1 is the one evicted by 2
        _, i = searcher.search(q, blocks[key], target_key=key)
        np.testing.assert_array_equal(i, knn(q, blocks[key], 2, "l2", backend="reference")[1])
    assert list(searcher._resident) == [0, 2]
    kept = searcher._resident.prepared(0)
    searcher.search(q, blocks[0], target_key=0)
    assert searcher._targets is kept


@pytest.fixture
def no_kept_blocks():
    """Tests that open searchers under a task scope start and end with nothing kept."""
    gpu_memory._KEPT.clear()
    yield
    gpu_memory._KEPT.clear()


def _counting_prepare(monkeypatch):
    from nearest_kernels import gpu as kgpu

    calls = []
    real = kgpu.prepare_targets

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(kgpu, "prepare_targets", counted)
    return calls


def test_broadcast_blocks_are_kept_for_the_next_task_of_the_same_scope(monkeypatch, no_kept_blocks):
    """Tasks of one stage (one scope) reuse a kept broadcast block; blocks a task keeps only
    for itself are not shared; another scope, a changed block or keep_targets off start
    afresh. Every search is checked against the reference."""
    rng = np.random.default_rng(31)
    q = rng.standard_normal((25, 6)).astype(np.float32)
    t = rng.standard_normal((120, 6)).astype(np.float32)
    settings = SearchSettings(4, "l2", "gpu")
    prepared = _counting_prepare(monkeypatch)
    ref = knn(q, t, 4, "l2", backend="reference")[1]

    def task(scope, targets=t, keep=True, settings=settings):
        with context.local_task(scope=scope):
            searcher = G.GpuBlockSearcher(settings, torch.device("cpu"))
        fold = searcher.search_fold(q, targets, 7, 7, 0, None, keep=keep)
        return searcher, fold.to_numpy()[3]

    first, rows = task("stage 3")
    np.testing.assert_array_equal(rows, ref)
    assert len(prepared) == 1 and len(first._resident) == 0
    second, rows = task("stage 3")                 # next task, same stage: reused
    np.testing.assert_array_equal(rows, ref)
    assert len(prepared) == 1 and second._targets is first._targets
    _, rows = task("stage 3", keep=False)          # a block the task keeps to itself
    np.testing.assert_array_equal(rows, ref)
    assert len(prepared) == 2
    changed = t[::-1].copy()                                 # same key, other content
    _, rows = task("stage 3", targets=changed)
    np.testing.assert_array_equal(rows, knn(q, changed, 4, "l2", backend="reference")[1])
    assert len(prepared) == 3
    _, rows = task("stage 4")                      # another stage: its own copy
    np.testing.assert_array_equal(rows, ref)
    assert len(prepared) == 4 and list(gpu_memory._KEPT) == ["cpu"] and gpu_memory._KEPT["cpu"][0] == "stage 4"
    off = dataclasses.replace(settings, keep_targets=False)
    task("stage 4", settings=off)                  # keep_targets off frees them
    assert len(prepared) == 5 and not gpu_memory._KEPT
    task(None)                                               # no scope: nothing kept
    assert not gpu_memory._KEPT


def test_kept_blocks_count_against_the_budget_and_make_room_first(no_kept_blocks, monkeypatch):
    rng = np.random.default_rng(32)
    q = rng.standard_normal((10, 4)).astype(np.float32)
    blocks = [rng.standard_normal((50, 4)).astype(np.float32) for _ in range(3)]
    block_bytes = gpu_memory.prepared_bytes(50, 4, "fp32", 4)
    with context.local_task(scope="stage 1"):
        searcher = G.GpuBlockSearcher(SearchSettings(2, "l2", "gpu"), torch.device("cpu"),
                                      memory_bytes=int(2.5 * block_bytes / G.TARGET_SHARE))
    searcher.search_fold(q, blocks[0], 0, 0, 0, None, keep=True)
    searcher.search(q, blocks[1], target_key=1)               # a block of this task only
    assert searcher._target_bytes == 2 * block_bytes
    fold = searcher.search_fold(q, blocks[2], 2, 2, 0, None, keep=True)   # evicts kept 0 first
    np.testing.assert_array_equal(fold.to_numpy()[3], knn(q, blocks[2], 2, "l2", backend="reference")[1])
    assert list(gpu_memory._KEPT["cpu"][1]) == [(2, "l2", "fp32")] and list(searcher._resident) == [1]


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")]),
])
@pytest.mark.parametrize("metric", ["l2", "inner_product"])
@pytest.mark.parametrize("plan", ["broadcast", "broadcast-streamed"])
def test_broadcast_plan_folding_on_the_device_matches_the_reference(monkeypatch, metric, device, plan):
    """The GPU searcher's device-side fold (here on a CPU torch device) through the broadcast
    plan: many target blocks, duplicate target vectors across blocks (ties go to the lower
    global key), payload rows follow their vectors."""
    import pyarrow as pa

    from udfs import blocks as B
    from udfs.local import local_join

    rng = np.random.default_rng(21)
    nq, nt, d, k = 37, 260, 5, 7
    Q = rng.standard_normal((nq, d)).astype(np.float32)
    T = rng.standard_normal((nt, d)).astype(np.float32)
    T[200:230] = T[10:40]                      # exact duplicates in later blocks
    qt = pa.table({"qid": np.arange(nq), "qv": pa.array(list(Q), type=pa.list_(pa.float32()))})
    tt = pa.table({"tid": np.arange(nt), "tv": pa.array(list(T), type=pa.list_(pa.float32()))})
    settings = SearchSettings(k, metric, "gpu")
    monkeypatch.setattr(B, "open_block_searcher",
                        lambda s: G.GpuBlockSearcher(s, torch.device(device)))
    ctx = JoinContext(settings, SideLayout("qv", 1, d, 10), SideLayout("tv", 1, d, 20),
                      "inner", True, tt.schema)
    out = local_join(qt, tt, ctx, plan=plan, partitions=2)
    values, indices = knn(Q, T, k, metric, backend="reference")
    got = {}
    for qid, tid, tv in zip(out.column(0).to_pylist(), out.column(2).to_pylist(), out.column(3).to_pylist()):
        got.setdefault(qid, []).append(tid)
        np.testing.assert_array_equal(np.array(tv, np.float32), T[tid])
    for q in range(nq):
        assert sorted(got[q]) == sorted(indices[q].tolist()), q


def test_task_scope_inside_spark_is_the_execution_and_stage(spark, monkeypatch):
    """Tasks of one stage share a scope (they read the same broadcast); running the same
    DataFrame again is another stage, so nothing kept by the first run is reused."""
    import pyarrow as pa

    def scopes(batches):
        from udfs.context import local_task, task_scope

        with local_task(scope="ignored inside Spark"):
            for _ in batches:
                yield pa.RecordBatch.from_pydict({"scope": [task_scope()]})

    df = spark.range(0, 64, numPartitions=4).mapInArrow(scopes, "scope string")
    first = {r.scope for r in df.collect()}
    again = {r.scope for r in df.collect()}
    assert len(first) == 1 and len(again) == 1 and first != again, (first, again)
    assert next(iter(first)).startswith("execution ")


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")]),
])
@pytest.mark.parametrize("plan", ["broadcast", "blocked", "broadcast-streamed", "blocked-streamed"])
@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_capped_joins_run_on_the_gpu_searcher(monkeypatch, metric, plan, device):
    """A join's cap reaches the GPU searcher (its search and its device fold) and the kernels
    take it: rows with fewer than k targets within the cap, some with none (inner join: no
    row), against the reference backend under the same cap."""
    import pyarrow as pa

    from tests.kernels.test_caps import midpoint_cap
    from tests.oracle import key_values, oracle_keys
    from udfs import blocks as B
    from udfs.local import local_join

    rng = np.random.default_rng(22)
    nq, nt, d, k = 29, 240, 6, 5
    Q = rng.standard_normal((nq, d)).astype(np.float32)
    T = rng.standard_normal((nt, d)).astype(np.float32)
    cap = midpoint_cap(key_values(oracle_keys(Q, T, metric), metric), 0.006, metric == "cosine")
    qt = pa.table({"qid": np.arange(nq), "qv": pa.array(list(Q), type=pa.list_(pa.float32()))})
    tt = pa.table({"tid": np.arange(nt), "tv": pa.array(list(T), type=pa.list_(pa.float32()))})
    opened = []

    def open_gpu(settings):
        opened.append(G.GpuBlockSearcher(settings, torch.device(device)))
        return opened[-1]

    monkeypatch.setattr(B, "open_block_searcher", open_gpu)
    ctx = JoinContext(SearchSettings(k, metric, "gpu", "bf16"), SideLayout("qv", 1, d, 8),
                      SideLayout("tv", 1, d, 50), "inner", True, tt.schema, cap=cap)
    out = local_join(qt, tt, ctx, plan=plan, partitions=2)
    assert opened
    _, indices = knn(Q, T, k, metric, backend="reference", cap=cap)
    got = {}
    for qid, tid in zip(out.column(0).to_pylist(), out.column(2).to_pylist()):
        got.setdefault(qid, []).append(tid)
    counts = (indices >= 0).sum(axis=1)
    assert (counts == 0).any() and ((counts > 0) & (counts < k)).any(), counts
    for q in range(nq):
        assert sorted(got.get(q, [])) == sorted(indices[q][indices[q] >= 0].tolist()), q


@pytest.mark.parametrize("device", [
    None,   # the task's own searcher (the CPU kernels)
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")]),
])
@pytest.mark.parametrize("metric", ["l2", "inner_product"])
def test_keyed_streamed_targets_match_the_keyed_broadcast(monkeypatch, metric, device):
    """on= keys with the query blocks broadcast (the target's rows streamed, grouped by key per
    task, one partial per query block and task) give the keyed broadcast plan's rows exactly:
    exact duplicate targets in other blocks and tasks, queries equal to targets (ties at the
    best value), a group smaller than k, queries of a group the target lacks and NULL groups."""
    import pyarrow as pa

    from udfs import blocks as B
    from udfs.local import local_join

    rng = np.random.default_rng(31)
    nq, nt, d, k = 50, 400, 6, 5
    T = rng.standard_normal((nt, d)).astype(np.float32)
    T[300:360] = T[:60]                              # copies in later blocks and tasks
    Q = rng.standard_normal((nq, d)).astype(np.float32)
    Q[:10] = T[:10]
    t_groups = rng.integers(0, 4, nt)
    t_groups[300:360] = t_groups[:60]
    t_groups[t_groups == 3] = 2
    t_groups[[5, 77, 140]] = 3                        # group 3: three targets, fewer than k
    q_groups = rng.integers(0, 5, nq).astype(object)  # group 4: no target
    q_groups[:10] = t_groups[:10]
    q_groups[[11, 12]] = None
    qt = pa.table({"qid": np.arange(nq), "qv": pa.array(list(Q), type=pa.list_(pa.float32())),
                   "g": pa.array(list(q_groups), pa.int32())})
    tt = pa.table({"tid": np.arange(nt), "tv": pa.array(list(T), type=pa.list_(pa.float32())),
                   "g": pa.array(t_groups, pa.int32())})
    if device is not None:
        monkeypatch.setattr(B, "open_block_searcher", lambda s: G.GpuBlockSearcher(s, torch.device(device)))
    ctx = JoinContext(SearchSettings(k, metric, "auto" if device is None else "gpu"),
                      SideLayout("qv", 1, d, 16, group_index=2), SideLayout("tv", 1, d, 45, group_index=2),
                      "leftouter", True, tt.select([0, 1]).schema)
    order = [(C.output_name(0), "ascending"), (C.output_name(4), "ascending"), (C.output_name(2), "ascending")]
    broadcast = local_join(qt, tt, ctx, plan="broadcast").sort_by(order)
    streamed = local_join(qt, tt, ctx, plan="blocked-streamed", partitions=3).sort_by(order)
    assert streamed.equals(broadcast)
    # not vacuous: the reference per group, ties to the lower target (the first copy)
    rows = {}
    for qid, tid in zip(streamed.column(0).to_pylist(), streamed.column(2).to_pylist()):
        rows.setdefault(qid, []).append(tid)
    for i in range(nq):
        members = np.flatnonzero(t_groups == q_groups[i]) if q_groups[i] is not None else np.array([], int)
        if not len(members):
            assert rows[i] == [None], i
            continue
        _, indices = knn(Q[i:i + 1], T[members], min(k, len(members)), metric, backend="reference")
        assert sorted(rows[i]) == sorted(members[indices[0]].tolist()), i
    assert rows[0][0] == 0 if metric == "l2" else True   # a query equal to a target and its copy


def test_a_searcher_compiles_the_plans_configuration_once_per_worker(monkeypatch):
    """``SearchSettings.warm_shape`` (the plan's block pair): the searcher's opening runs one
    search of that shape, in the plan's dtypes, with its k, metric and precision, once per
    worker process and configuration; without it, none."""
    from nearest_kernels import gpu as kgpu

    monkeypatch.setattr(G, "_WARMED", set())
    calls = []
    real = kgpu.search_prepared

    def spy(queries, targets, k, **options):
        calls.append((tuple(queries.shape), queries.dtype, targets.side.rows, targets.side.source.dtype,
                      k, targets.metric, targets.precision))
        return real(queries, targets, k, **options)

    monkeypatch.setattr(kgpu, "search_prepared", spy)
    settings = SearchSettings(7, "cosine", "gpu", "bf16", warm_shape=(300, 1000, 12, "float32", "float64"))
    cpu = torch.device("cpu")
    first = G.GpuBlockSearcher(settings, cpu, batch_rows=128)
    # The first query batch (128 of the block's 300 rows) against a whole target block.
    assert calls == [((128, 12), torch.float32, 1000, torch.float64, 7, "cosine", "bf16")]
    G.GpuBlockSearcher(settings, cpu, batch_rows=128)       # the worker's next task
    assert len(calls) == 1
    G.GpuBlockSearcher(dataclasses.replace(settings, k=8), cpu, batch_rows=128)
    assert len(calls) == 2 and calls[1][4] == 8
    G.GpuBlockSearcher(dataclasses.replace(settings, warm_shape=None, k=9), cpu)
    assert len(calls) == 2
    # The searcher still searches as before (the warm-up kept nothing resident).
    assert first._targets is None and len(first._resident) == 0
    rng = np.random.default_rng(2)
    q, t = rng.standard_normal((20, 12)).astype(np.float32), rng.standard_normal((90, 12))
    _, i = first.search(q, t, target_key=1)
    np.testing.assert_array_equal(i, knn(q, t, 7, "cosine", backend="reference")[1])
