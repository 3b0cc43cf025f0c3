"""mode="approx" on the keyed blocked plan (issue 23): IVF lists for a target too large to
broadcast (``nearest_join.keyed`` with a query row in ``nprobe`` groups).

One data set, one Spark session: clustered targets with one dense cluster (half the rows:
one huge list, split over target parts by the small blocks), a list no target row is in (a
centroid far from the data) that one query is nearest to (its payload's copy has no cell),
NULL vectors on both sides and a zero query vector (no cosine candidate). The indexes are
built from the clusters' centres (no training job), so the lists are known. Joins of several
metrics share one Spark job (a union). Checked against the float64 oracle per query
(``tests.join.test_keys.check_keyed`` over one group); the recall target against the exact
pairs.
"""
from __future__ import annotations

import numpy as np
import pytest
from pyspark.sql import functions as F

from nearest_join.ivf_index import IVFIndex
from nearest_join.join import plan_join
from nearest_join.options import JoinOptions
from tests.join.test_keys import check_keyed

NQ, NT, D, K = 80, 800, 6, 5
CLUSTERS = 16
SIMILARITY = ("cosine", "inner_product")
BLOCKED = {"broadcast_limit_bytes": 0, "query_block_rows": 16, "target_block_rows": 64}
NULL_QUERY, ZERO_QUERY, FAR_QUERY, NULL_TARGET = 7, 5, 3, 9


def _index(centroids: np.ndarray, metric: str) -> IVFIndex:
    centroids = np.ascontiguousarray(centroids, dtype=np.float32)
    centroids.setflags(write=False)
    return IVFIndex(centroids, metric, 0, NT, 0)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(23)
    centres = rng.standard_normal((CLUSTERS, D)) * 2.5
    targets = centres[rng.integers(1, CLUSTERS, NT)] + 0.7 * rng.standard_normal((NT, D))
    targets[: NT // 2] = centres[0] + 0.05 * rng.standard_normal((NT // 2, D))   # the huge list
    queries = centres[rng.integers(0, CLUSTERS, NQ)] + 0.7 * rng.standard_normal((NQ, D))
    queries[: NQ // 4] = centres[0] + 0.05 * rng.standard_normal((NQ // 4, D))
    far = 40.0 * centres[1] / np.linalg.norm(centres[1])
    queries[FAR_QUERY] = far + 0.1 * rng.standard_normal(D)
    queries[ZERO_QUERY] = 0.0
    queries, targets = queries.astype(np.float32), targets.astype(np.float32)
    lists = np.vstack([centres, far])
    units = lists / np.linalg.norm(lists, axis=1, keepdims=True)
    # one index of the similarities serves both: the inner product join below routes by the
    # cosine index, and its zero query (score 0 against every target) must probe lists 0, 1, ...
    # as the join ranks it, not be dropped as cosine would.
    return queries, targets, {"l2": _index(lists, "l2"), "cosine": _index(units, "cosine")}


@pytest.fixture(scope="module")
def frames(spark, data):
    queries, targets, _ = data
    q = spark.createDataFrame([(i, None if i == NULL_QUERY else queries[i].tolist()) for i in range(NQ)],
                              "qid int, v array<float>")
    t = spark.createDataFrame([(j, None if j == NULL_TARGET else targets[j].tolist()) for j in range(NT)],
                              "tid int, w array<float>")
    return q.repartition(3).cache(), t.repartition(2).cache()


def _planned(q, t, metric, index, **options):
    return plan_join(q, t, metric, JoinOptions(num_results=K, mode="approx", vectors=("v", "w"),
                                               distance_col="d", index=index, **BLOCKED, **options))


def _keys(metric):
    """check_keyed's groups: every query and target in one, but the rows that cannot rank."""
    q_keys = ["a"] * NQ
    q_keys[NULL_QUERY] = None
    if metric == "cosine":
        q_keys[ZERO_QUERY] = None
    t_keys = ["a"] * NT
    t_keys[NULL_TARGET] = None
    return q_keys, t_keys


def _caps(queries, targets):
    """A cap per capped metric that leaves some queries fewer than k rows (the oracle's
    0.5% / 99.5% quantile of all pairs, between two values)."""
    from tests.oracle import key_values, oracle_keys

    caps = {}
    for metric in ("cosine",):
        values = np.sort(key_values(oracle_keys(queries, targets, metric), metric).ravel())
        values = values[np.isfinite(values)]
        at = int(values.size * (0.995 if metric in SIMILARITY else 0.005))
        caps[metric] = float((values[at] + values[at + 1]) / 2)
    return caps


def test_every_list_gives_the_exact_result(spark, data, frames):
    """nprobe == nlist through the blocked IVF plan: a distance and the similarities, both
    join types, and a cap, against the oracle; the huge list is split over target parts, the far list has no
    target, and the query nearest to it still gets its neighbours from the other lists."""
    queries, targets, indexes = data
    q, t = frames
    l2, cosine = indexes["l2"], indexes["cosine"]
    far = CLUSTERS
    assert l2.route(queries[FAR_QUERY:FAR_QUERY + 1])[0, 0] == far
    assert not (l2.route(targets)[:, 0] == far).any()       # an empty list
    caps = _caps(queries, targets)
    # sqeuclidean and l2 (one routing, one search path), like cosine and inner product, differ
    # only in the kernels' metric, which the keyed blocked tests cover: a metric of each family,
    # and the caps in the third join.
    cases = {
        "l2 left": ("l2", l2, {"join_type": "left"}),
        "inner_product inner": ("inner_product", cosine, {}),
        "cosine cap left": ("cosine", cosine, {"join_type": "left", "min_similarity": caps["cosine"]}),
    }
    joined = None
    for name, (metric, index, options) in cases.items():
        planned = _planned(q, t, metric, index, nprobe=index.nlist, **options)
        plan = planned.plan
        assert plan.plan == "blocked" and plan.ivf["runs"] == "ivf", str(plan)
        assert "on the keyed blocked plan" in plan.ivf["explanation"] and "every list, the exact result" in str(plan)
        if metric == "l2":
            cells = plan.key_cells
            assert cells["split_groups"] >= 1 and cells["largest_split"][1] >= 4, cells   # the huge list
            assert cells["groups"] == CLUSTERS                   # the far list has no cell
        df = planned.dataframe().select("qid", "tid", F.col("d").cast("double").alias("d"),
                                        F.lit(name).alias("case"))
        joined = df if joined is None else joined.unionByName(df)
    rows = joined.collect()
    for name, (metric, _, options) in cases.items():
        join_type = "leftouter" if options.get("join_type") == "left" else "inner"
        cap = options.get("max_distance", options.get("min_similarity"))
        mine = [r for r in rows if r["case"] == name]
        q_keys, t_keys = _keys(metric)
        check_keyed(mine, queries, targets, q_keys, t_keys, metric, K, join_type, cap=cap, case=name)
        sizes = [sum(1 for r in mine if r["qid"] == i and r["tid"] is not None) for i in range(NQ)]
        if cap is None:       # the query whose nearest list is empty: k rows from the others
            assert sizes[FAR_QUERY] == K, name
        else:                 # the cap prunes: some queries keep fewer than k rows
            assert min(sizes) < K and max(sizes) == K, (name, sizes)


def test_recall_target_met_and_the_same_rows_twice(spark, data, frames):
    """recall=0.9: the estimate picks nprobe < nlist, the measured recall@k against the exact
    pairs meets the target, the distances returned are exact, and a second run of the same
    plan gives the same rows (the row ids, parts and ties are functions of the input)."""
    from nearest_kernels import knn

    queries, targets, indexes = data
    q, t = frames
    target = 0.9
    planned = _planned(q, t, "l2", indexes["l2"], recall=target)
    ivf = planned.plan.ivf
    assert planned.plan.plan == "blocked" and ivf["runs"] == "ivf", str(planned.plan)
    assert 1 <= ivf["nprobe"] < indexes["l2"].nlist and ivf["recall_interval"][0] >= target
    df = planned.dataframe()
    first = sorted((r.qid, r.tid, r.d) for r in df.collect())
    assert sorted((r.qid, r.tid, r.d) for r in df.collect()) == first
    ranked, ranked_targets = queries.astype(np.float64), targets.astype(np.float64)
    ranked[NULL_QUERY], ranked_targets[NULL_TARGET] = np.nan, np.nan
    _, exact = knn(ranked, ranked_targets, K, "l2", backend="reference")
    truth = {(i, int(j)) for i, row in enumerate(exact) for j in row if j >= 0}
    found = {(a, b) for a, b, _ in first}
    assert len(found) == len(first) and len(found & truth) / len(truth) >= target
    for a, b, d in first:
        want = float(np.sqrt(((ranked[a] - ranked_targets[b]) ** 2).sum()))
        assert abs(d - want) <= 1e-5 * max(want, 1.0), (a, b, d, want)


# ----------------------------------------------------------------- executor functions, no Spark
def _probe_layout(q_probes, t_groups, join_type):
    """keyed_layout as nearest_join.keyed.layout_of counts an IVF query side: each query once
    per probed group; a query whose first group has no target rows (or, LEFT OUTER, that
    probes none) in the unmatched cells."""
    from nearest_join.planner import keyed_layout

    size = int(max(max((max(p) for p in q_probes if p), default=0), t_groups.max())) + 1
    t_counts = np.bincount(t_groups[t_groups >= 0], minlength=size)
    q_counts = np.bincount([g for p in q_probes for g in p], minlength=size)
    unmatched = sum(1 for p in q_probes if (p and t_counts[p[0]] == 0) or (not p and join_type == "leftouter"))
    return keyed_layout(t_counts, q_counts, unmatched_queries=unmatched, target_block_rows=64,
                        query_block_rows=16, cores=2, dimension=6, keep_unmatched=True)


@pytest.mark.parametrize("join_type", ["inner", "leftouter"])
@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "cosine", "inner_product"])
def test_probed_cells_against_the_oracle(metric, join_type):
    """search_cell and merge_cells with queries in several groups, as the blocked IVF plan
    feeds them (tests.join.test_keyed_blocked._local_keyed: cells shuffled, partials in any
    order), on adversarial vectors (offset 100, duplicate targets): one group of half the
    targets split over target and query parts, many small groups batched (a query's groups
    often share a bin, and so its cells), groups absent from the target (also as a query's
    first group), queries probing none. Each query's rows are its true top k among the
    targets of all its groups (the float64 oracle); with a cap for the similarities."""
    from tests.adversarial import offset_case
    from tests.join.test_keyed_blocked import K as CELL_K
    from tests.join.test_keyed_blocked import _context, _local_keyed
    from tests.oracle import (
        assert_capped_topk,
        group_rows,
        join_arrays,
        key_values,
        operator_rtol,
        oracle_keys,
    )

    case = offset_case(6, 100.0, 1.0, nq=120, nt=640, seed=22)
    queries, targets = case.queries, case.targets
    rng = np.random.default_rng(5)
    t_groups = np.concatenate([np.zeros(320, np.int64), rng.integers(1, 121, 310), np.full(10, -1)])
    rng.shuffle(t_groups)
    present = set(t_groups[t_groups >= 0].tolist())
    q_probes = [rng.choice(np.r_[0:125, 500], rng.integers(1, 5), replace=False).tolist() for _ in queries]
    for i in range(0, 120, 7):                  # the split group first (probes are distinct)
        q_probes[i] = [0] + [g for g in q_probes[i] if g != 0]
    q_probes[3], q_probes[4] = [500, 0, 7], []  # first group absent from the target; no group
    cap = None
    if metric in ("cosine", "inner_product"):
        values = np.sort(key_values(oracle_keys(queries, targets, metric), metric).ravel())
        cap = float((values[int(values.size * 0.9)] + values[int(values.size * 0.9) + 1]) / 2)
    layout = _probe_layout(q_probes, t_groups, join_type)
    big = int(np.flatnonzero(layout.groups == 0)[0])
    assert layout.t_parts[big] >= 3 and layout.q_parts[big] >= 2     # the split path is taken
    rows = _local_keyed(queries, q_probes, targets, t_groups, _context(metric, 6, join_type, cap), layout,
                        block_rows=16)
    grouped = group_rows(rows, lambda r: r["qid"], lambda r: r["tid"], lambda r: r["d"])
    unbounded = -np.inf if metric in SIMILARITY else np.inf
    for i, probes in enumerate(q_probes):
        allowed = np.flatnonzero(np.isin(t_groups, probes))
        mine = grouped.get(i, [])
        found = [t for _, t in mine if t is not None]
        if allowed.size:
            values, indices = join_arrays({i: mine}, CELL_K, metric, [i], allowed.tolist(), f"query {i}")
            assert_capped_topk(queries[i:i + 1], targets[allowed], CELL_K, metric, unbounded if cap is None else cap,
                               values.astype(np.float32), indices, operator_rtol,
                               case=f"{metric} {join_type} query {i} probes {probes}")
        if not found:
            assert mine == ([(None, None)] if join_type == "leftouter" else []), (i, probes, mine)
    assert len(grouped.get(3, [])) == CELL_K and not any(t for _, t in grouped.get(4, []))
