"""mode="approx" with on= keys (issue 23): the IVF plan inside key groups.

One index over the whole target; a query probes its nprobe nearest lists among those its
key's targets occupy; small keys are searched whole. The executors' routing
(udfs.ivf.key_probes, target_key_ids) is checked without Spark; the joins share one pair
of frames, and every approx result is compared with the exact keyed join of the same frames.

The keys: two large clustered keys ("big1", "big2"), a key "far" whose targets sit in one
region and whose queries sit in another, where only "big1" targets are (so the lists a
"far" query would probe unrestricted hold no "far" target), a small key searched whole,
one key only on the target side, one only on the query side, and NULL keys on both.
"""
from __future__ import annotations

import numpy as np
import pytest

from nearest_join import nearest_by_join
from udfs.ivf import key_probes, target_key_ids

NLIST, D, K = 40, 6, 5
T_SIZES = {"big1": 1200, "big2": 1000, "far": 700, "small": 60, "tonly": 40, None: 30}
Q_SIZES = {"big1": 60, "big2": 50, "far": 20, "small": 15, "qonly": 10, None: 10}
FAR_TARGETS, FAR_QUERIES = 12.0, -12.0   # "far" centred on +12 e0; its queries on -12 e0


def test_key_probes_stay_inside_their_key():
    rng = np.random.default_rng(0)
    centroids = rng.standard_normal((6, 3)).astype(np.float32)
    nlist = 6
    # key 0 occupies lists 1, 3, 4; key 2 occupies list 5; key 1 (and any other) is searched whole
    codes = np.array([0 * nlist + 1, 0 * nlist + 3, 0 * nlist + 4, 2 * nlist + 5], np.int64)
    vectors = rng.standard_normal((6, 3)).astype(np.float32)
    vectors[4] = np.nan
    groups = np.array([0, 0, 1, 2, 0, -1], np.int64)
    probes = key_probes(vectors, groups, codes, centroids, "l2", nprobe=2)
    assert probes.shape == (6, 2)
    for i in (0, 1):   # its 2 nearest among lists 1, 3, 4 (positions 0, 1, 2 of codes)
        distances = ((centroids[[1, 3, 4]] - vectors[i]) ** 2).sum(axis=1)
        assert probes[i].tolist() == np.argsort(distances)[:2].tolist()
    assert probes[2].tolist() == [codes.size + 1, -1]   # key 1: whole, one id
    assert probes[3].tolist() == [3, -1]                # key 2: its one list
    assert probes[4].tolist() == [-1, -1]               # a vector that cannot rank
    assert probes[5].tolist() == [-1, -1]               # no key group
    lists = np.array([3, 0, 2, 5, -1, 1, 4], np.int64)
    t_groups = np.array([0, 0, 1, 2, 0, -1, 3], np.int64)
    # (0, 0): a pair the table lacks; (0, -1): cannot rank; key 3: whole
    assert target_key_ids(t_groups, lists, codes, nlist).tolist() == [1, -1, codes.size + 1, 3, -1, -1,
                                                                      codes.size + 3]
    assert target_key_ids(t_groups, lists, codes[:0], nlist).tolist() == [0, 0, 1, 2, 0, -1, 3]


def _clustered(rng, n: int, centres: np.ndarray, spread: float = 0.3) -> np.ndarray:
    return (centres[rng.integers(0, centres.shape[0], n)] + spread * rng.standard_normal((n, D))).astype(np.float32)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(31)
    centres = rng.standard_normal((24, D)) * 3
    centres[0] = 0
    centres[0, 0] = FAR_QUERIES   # a "big1" cluster where the "far" queries are
    far = np.zeros((1, D))
    far[0, 0] = FAR_TARGETS

    def side(sizes, far_centre):
        rows = []
        for key, n in sizes.items():
            source = {"big1": centres[:12], "big2": centres[12:], "far": far_centre}.get(key, centres)
            rows += [(key, v) for v in _clustered(rng, n, source)]
        order = rng.permutation(len(rows))
        return [rows[i] for i in order]

    far_queries = np.zeros((1, D))
    far_queries[0, 0] = FAR_QUERIES
    t_rows, q_rows = side(T_SIZES, far), side(Q_SIZES, far_queries)
    t_keys = [k for k, _ in t_rows]
    q_keys = [k for k, _ in q_rows]
    return (np.stack([v for _, v in q_rows]), q_keys, np.stack([v for _, v in t_rows]), t_keys)


@pytest.fixture(scope="module")
def frames(spark, data):
    queries, q_keys, targets, t_keys = data
    q = spark.createDataFrame([(i, q_keys[i], queries[i].tolist()) for i in range(len(q_keys))],
                              "qid int, k string, v array<float>").repartition(2).cache()
    t = spark.createDataFrame([(j, t_keys[j], targets[j].tolist()) for j in range(len(t_keys))],
                              "tid int, k string, w array<float>").repartition(3).cache()
    return q, t


ARGS = {"vectors": ("v", "w"), "on": "k", "join_type": "left_outer", "distance_col": "d"}


def _rows(df):
    return sorted((r.qid, r.tid, r.d) for r in df.collect())


@pytest.fixture(scope="module")
def exact(frames):
    q, t = frames
    return {metric: _rows(nearest_by_join(q, t, metric, K, **ARGS)) for metric in ("l2", "cosine")}


def _assert_same(approx, exact):
    assert [(a, b) for a, b, _ in approx] == [(a, b) for a, b, _ in exact]
    np.testing.assert_allclose([c for *_, c in approx if c is not None],
                               [c for *_, c in exact if c is not None], rtol=1e-6)


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_all_lists_give_exactly_the_exact_keyed_result(frames, exact, metric):
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    q, t = frames
    planned = plan_join(q, t, metric, JoinOptions(num_results=K, mode="approx", nlist=NLIST, nprobe=NLIST, **ARGS))
    plan = planned.plan
    assert plan.ivf["runs"] == "ivf" and plan.ivf["keys_by_lists"] == 3, plan   # big1, big2, far
    assert "among those its key's targets occupy" in str(plan) and "the other 2 keys searched whole" in str(plan)
    _assert_same(_rows(planned.dataframe()), exact[metric])


def test_small_key_groups_run_the_exact_keyed_plan(frames):
    # by default IVF must win inside a key: the largest key group's rows decide, not the target's
    from nearest_join import explain_nearest_join

    q, t = frames
    plan = explain_nearest_join(q, t, "l2", K, "approx", **ARGS)
    assert plan.ivf["runs"] == "exact" and "target rows in the largest key group" in str(plan), plan.ivf


@pytest.fixture(scope="module")
def one_probe(frames):
    """nprobe=1 with an index built before (seed 3): each query searches one list of its key."""
    from nearest_join import build_ivf_index
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    q, t = frames
    index = build_ivf_index(t, column="w", metric="l2", nlist=NLIST, seed=3)
    planned = plan_join(q, t, "l2", JoinOptions(num_results=K, mode="approx", index=index, nprobe=1, **ARGS))
    return index, _rows(planned.dataframe()), planned


def test_one_probe_inside_the_key(data, exact, one_probe):
    queries, q_keys, targets, t_keys = data
    index, one_probe, _ = one_probe
    by_query: dict[int, list] = {}
    for qid, tid, d in one_probe:
        by_query.setdefault(qid, []).append((tid, d))
    exact_by_query: dict[int, list] = {}
    for qid, tid, d in exact["l2"]:
        exact_by_query.setdefault(qid, []).append((tid, d))
    for i, key in enumerate(q_keys):
        got = by_query[i]
        if key in (None, "qonly"):   # NULL key, key without targets: LEFT OUTER's one NULL row
            assert got == [(None, None)], (i, key, got)
            continue
        # k rows of its own key, distances exact; the far key's too, though the lists
        # nearest its queries hold only big1 targets
        assert len(got) == K and all(t_keys[tid] == key for tid, _ in got), (i, key, got)
        for tid, d in got:
            want = np.sqrt(((queries[i].astype(np.float64) - targets[tid]) ** 2).sum())
            assert abs(d - want) <= 1e-5 * max(want, 1.0)
        if key == "small":   # searched whole: the exact rows
            assert sorted(got) == sorted(exact_by_query[i]), (i, got)
    far = [i for i, key in enumerate(q_keys) if key == "far"]
    # unrestricted, a far query's nearest list would be a big1 list: no far target in it
    t_lists = index.route(targets)[:, 0]
    far_lists = {int(t_lists[j]) for j, key in enumerate(t_keys) if key == "far"}
    assert not far_lists & set(index.route(queries[far])[:, 0].tolist())


def test_the_keyed_estimate_is_the_measured_recall(exact, one_probe):
    """The estimate's curve at nprobe=1 (every query with a key group sampled, each ranked
    within its key) against the recall the nprobe=1 join measured with the same index."""
    from nearest_join.ivf_keys import estimate_keyed_recall, keyed_inputs

    index, rows, planned = one_probe
    curve = estimate_keyed_recall(planned, index, planned.ivf.lists, *keyed_inputs(planned), seed=0)
    found = {(a, b) for a, b, _ in rows if b is not None}
    true = {(a, b) for a, b, _ in exact["l2"] if b is not None}
    assert curve.queries == sum(n for key, n in Q_SIZES.items() if key not in (None, "qonly"))
    assert curve.recall.shape == (planned.ivf.lists.widest,)
    assert len(found & true) / len(true) == pytest.approx(curve.recall[0], abs=1e-12)
    assert curve.recall[0] < 1 and curve.recall[-1] == pytest.approx(1.0)


def test_same_seed_same_rows(spark, frames, one_probe):
    # trained in the join from the same seed: the index built before, the same rows; in many
    # Arrow batches (the count, the routing and the packing go batch by batch)
    q, t = frames
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "37")
    try:
        rows = _rows(nearest_by_join(q, t, "l2", K, "approx", nlist=NLIST, nprobe=1, seed=3, **ARGS))
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert rows == one_probe[1]


def test_recall_target_met_and_estimated_within_keys(frames, exact):
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    q, t = frames
    target = 0.9
    planned = plan_join(q, t, "l2", JoinOptions(num_results=K, mode="approx", nlist=NLIST, recall=target, **ARGS))
    ivf = planned.plan.ivf
    assert ivf["runs"] == "ivf", ivf
    lower, upper = ivf["recall_interval"]
    assert target <= lower <= ivf["recall_estimate"] <= upper <= 1.0
    assert 1 <= ivf["nprobe"] < NLIST / 4
    # sampled queries: those with a key that has targets (NULL and "qonly" keys have none)
    assert ivf["recall_queries"] == sum(n for key, n in Q_SIZES.items() if key not in (None, "qonly"))
    assert "each within its own key" in str(planned.plan)
    found = {(a, b) for a, b, _ in _rows(planned.dataframe()) if b is not None}
    true = {(a, b) for a, b, _ in exact["l2"] if b is not None}
    # every query with a key group is sampled (fewer than RECALL_QUERIES) and each has k true
    # neighbours, so the estimate is the measured recall itself
    assert len(found & true) / len(true) == pytest.approx(ivf["recall_estimate"], abs=1e-12)
    assert len(found & true) / len(true) >= target


def test_caps_inside_keys(frames, data, exact):
    # the estimate's scan and the search both prune with the cap
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    q, t = frames
    _, q_keys, _, t_keys = data
    cap = 0.6
    # the exact capped rows: the exact rows within the cap (they are a prefix of each top k)
    true: dict[int, set] = {i: set() for i in range(len(q_keys))}
    for a, b, d in exact["l2"]:
        if b is not None and d <= cap:
            true[a].add(b)
    assert any(len(true[i]) < K for i, key in enumerate(q_keys) if key == "big1"), "the cap should bind"
    planned = plan_join(q, t, "l2", JoinOptions(num_results=K, mode="approx", nlist=NLIST, recall=0.9,
                                                max_distance=cap, **ARGS))
    assert planned.plan.ivf["runs"] == "ivf", planned.plan.ivf   # the estimate ran under the cap
    estimated = _rows(planned.dataframe())
    for qid, tid, d in estimated:
        if tid is not None:
            assert t_keys[tid] == q_keys[qid] and d <= cap
    found = {(a, b) for a, b, _ in estimated}
    for i, near in true.items():   # LEFT OUTER: nothing within the cap, one NULL row
        if not near:
            assert (i, None) in found
    # every query is sampled here, so the estimate (mean recall per query with a neighbour,
    # its lower bound >= 0.9) is the measured recall
    measured = np.mean([len({b for b in bs if (a, b) in found}) / len(bs) for a, bs in true.items() if bs])
    assert measured == pytest.approx(planned.plan.ivf["recall_estimate"], abs=1e-12) and measured >= 0.9


def test_the_keyed_plan_choice_without_spark(monkeypatch):
    """With keys: no key larger than its lists' worth runs the exact keyed plan without the
    count job; a recall needing a quarter of the widest key's lists runs exact; an explicit
    nprobe runs the keyed IVF search."""
    from types import SimpleNamespace

    from nearest_join import ivf, ivf_keys
    from nearest_join.ivf_index import IVFIndex
    from nearest_join.join import PlannedJoin
    from nearest_join.options import JoinOptions
    from nearest_join.planner import JoinPlan
    from nearest_join.recall import RecallCurve

    rng = np.random.default_rng(0)
    index = IVFIndex.train(rng.standard_normal((400, 3)).astype(np.float32), "l2", 16)
    # two keys of 12 and 8 lists: group ids 0..19
    lists = ivf_keys.KeyLists(np.array([16 * 0 + i for i in range(12)] + [16 * 3 + i for i in range(8)], np.int64),
                         np.full(20, 30, np.int64), 16, 100)
    assert (lists.keys, lists.widest) == (2, 12)
    monkeypatch.setattr(ivf_keys, "keyed_inputs", lambda planned: ((None, None), ("v", "w")))
    monkeypatch.setattr(ivf_keys, "key_lists", lambda t_input, name, planned, index: lists)
    curve = RecallCurve(np.array([0.5, 0.99, 0.999, 0.9999] + [1.0] * 8), 5000)
    monkeypatch.setattr(ivf_keys, "estimate_keyed_recall", lambda *args: curve)

    def planned(largest: int, **options):
        plan = JoinPlan(plan="broadcast", reason="", metric="l2", k=5, mode="approx", join_type="inner",
                        query_column="v", target_column="w", dimension=3, query_rows=10, target_rows=400,
                        target_bytes=4800, broadcast_limit_bytes=1 << 30, task_memory_bytes=1 << 26, cores=2,
                        query_block_rows=10, target_block_rows=400, query_blocks=1, target_blocks=1,
                        query_partitions=None, target_partitions=None, backend="cpu", precision="auto",
                        distance_col=None, largest_group=largest)
        return PlannedJoin(None, None, "l2", JoinOptions(mode="approx", index=index, **options), plan,
                           SimpleNamespace(metric="l2", target_column="w"), "distance", keys=("k",))

    small = ivf.plan_approx(planned(100, recall=0.95))   # 100 <= 4 lists' worth (4 * 400 // 16)
    assert small.plan.ivf["runs"] == "exact" and "every key has at most 100 target rows" in str(small.plan)
    low = ivf.plan_approx(planned(300, recall=0.95))
    assert low.plan.ivf["runs"] == "ivf" and low.ivf.nprobe == 2 and low.ivf.lists is lists
    assert low.plan.ivf["keys_by_lists"] == 2 and low.plan.ivf["key_list_pairs"] == 20
    high = ivf.plan_approx(planned(300, recall=0.999))   # nprobe 4 >= a quarter of 12 lists
    assert high.plan.ivf["runs"] == "exact" and "of the 12 lists the widest key occupies" in str(high.plan)
    forced = ivf.plan_approx(planned(300, nprobe=12))
    assert forced.plan.ivf["runs"] == "ivf" and forced.ivf.nprobe == 12
    assert "every list of every key, the exact result" in str(forced.plan)


def test_key_ranks_against_each_keys_sorted_lists():
    """The estimate's ranks (nearest_join.ivf_keys.key_ranks) over more queries than one routing
    chunk, the chunks' keys of different widths: each neighbour's list ranked among its key's
    lists by float64 distance; a whole key's neighbours at rank 0."""
    from nearest_join.ivf_index import IVFIndex
    from nearest_join.ivf_keys import KeyLists, key_ranks

    rng = np.random.default_rng(4)
    nlist = 30
    index = IVFIndex.train(rng.standard_normal((600, 5)).astype(np.float32), "l2", nlist)
    key_of = {0: np.arange(0, 3), 1: np.arange(5, 30)}   # key 0: 3 lists, key 1: 25; key 2 whole
    codes = np.concatenate([g * nlist + ls for g, ls in key_of.items()]).astype(np.int64)
    lists = KeyLists(codes, np.ones(codes.size, np.int64), nlist, 10)
    groups = np.array([0] * 256 + [1] * 40 + [2] * 10, np.int64)   # the first chunk: key 0 only
    queries = rng.standard_normal((groups.size, 5)).astype(np.float32)
    neighbours = [rng.choice(key_of.get(int(g), np.arange(nlist)), 4) for g in groups]
    ranks = key_ranks(queries, groups, neighbours, lists, index, "l2")
    for i, g in enumerate(groups):
        if g == 2:
            assert ranks[i].tolist() == [0] * 4
            continue
        own = key_of[int(g)]
        distances = ((index.centroids[own].astype(np.float64) - queries[i]) ** 2).sum(axis=1)
        order = own[np.argsort(distances)].tolist()
        assert ranks[i].tolist() == [order.index(x) for x in neighbours[i]], i


@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "cosine", "inner_product"])
@pytest.mark.parametrize("capped", [False, True], ids=["no-cap", "cap"])
@pytest.mark.parametrize("scan_rows", [None, 100], ids=["one-search", "searches-of-100-rows"])
def test_the_keyed_estimate_scan_ranks_within_each_key(metric, capped, scan_rows, monkeypatch):
    """udfs.ivf.sample_topk with the sampled queries' key groups, over several batches (a
    NULL vector, a NULL group, an all-NULL batch among them), searched at once or in chunks
    of rows across the batches: per query, the lists and values of its exact top k among its
    own key's rows (the float64 reference, under the cap)."""
    import pyarrow as pa

    import udfs.ivf
    from nearest_join.ivf_index import IVFIndex
    from nearest_kernels import knn
    from udfs.context import SideLayout
    from udfs.ivf import SAMPLE_SCHEMA, sample_topk

    if scan_rows is not None:
        monkeypatch.setattr(udfs.ivf, "SCAN_ROWS", scan_rows)

    rng = np.random.default_rng(9)
    targets = rng.standard_normal((700, 5)).astype(np.float32)
    queries = rng.standard_normal((30, 5)).astype(np.float32)
    t_groups = rng.integers(0, 4, 700)
    t_groups[rng.random(700) < 0.05] = -1                 # rows of no group
    t_groups[t_groups == 3] = 2                           # no target of group 3
    q_groups = rng.integers(-1, 4, 30)                    # -1: no group; 3: a group without targets
    index = IVFIndex.train(targets, metric, 10, seed=1)
    vectors = [None if j == 17 else targets[j].tolist() for j in range(700)]
    groups = [None if g < 0 else int(g) for g in t_groups]
    batches = [pa.record_batch([pa.array(vectors[a:b], pa.list_(pa.float32())), pa.array(groups[a:b], pa.int32())],
                               names=["w", "g"]) for a, b in ((0, 250), (250, 251), (251, 600), (600, 700))]
    batches.insert(2, pa.record_batch([pa.array([None, None], pa.list_(pa.float32())), pa.array([0, 1], pa.int32())],
                                      names=["w", "g"]))
    cap = None
    if capped:
        cap = float(np.median(knn(queries, targets, 6, metric, backend="reference")[0][:, 5]))
    out = pa.Table.from_batches(list(sample_topk(
        batches, layout=SideLayout("w", 0, 5, 1, group_index=1), queries=queries,
        centroids=np.asarray(index.centroids), k=6, metric=metric, cap=cap,
        query_groups=q_groups.astype(np.int64))), schema=SAMPLE_SCHEMA)
    t_lists = index.route(targets)[:, 0]
    query, lists, value = (out.column(c).to_numpy() for c in ("query", "list", "value"))
    for i in range(30):
        mine = query == i
        own = np.flatnonzero((t_groups == q_groups[i]) & (np.arange(700) != 17)) if q_groups[i] >= 0 else []
        if len(own) == 0:
            assert not mine.any(), i
            continue
        want_v, want_rows = knn(queries[i:i + 1], targets[own], 6, metric, backend="reference", cap=cap)
        found = own[want_rows[0][want_rows[0] >= 0]]
        assert sorted(lists[mine].tolist()) == sorted(t_lists[found].tolist()), f"query {i}"
        np.testing.assert_allclose(np.sort(value[mine]), np.sort(want_v[0][want_rows[0] >= 0]), rtol=1e-5)


BLOCKED = {"broadcast_limit_bytes": 0, "query_block_rows": 16, "target_block_rows": 64}


def test_the_keyed_blocked_plan_takes_the_key_list_groups(frames, exact, one_probe):
    """A target too large to broadcast: the (key, list) groups ride the keyed blocked plan
    (cells, the big keys' lists split into target parts), with the same rows as the broadcast
    keyed search at nprobe=1 (the same index) and the exact keyed rows at nprobe=nlist."""
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    q, t = frames
    index, broadcast_rows, _ = one_probe
    for nprobe, want in ((1, broadcast_rows), (NLIST, exact["l2"])):
        planned = plan_join(q, t, "l2", JoinOptions(num_results=K, mode="approx", index=index, nprobe=nprobe,
                                                    **ARGS, **BLOCKED))
        plan = planned.plan
        assert plan.plan == "blocked" and plan.ivf["runs"] == "ivf", plan
        assert "on the keyed blocked plan, the (key, list) group id as the key" in str(plan), plan
        assert plan.key_cells["cells"] > 1
        _assert_same(_rows(planned.dataframe()), want)
