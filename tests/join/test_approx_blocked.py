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

from nearest_join.ivf import IVFIndex
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
    # inner product's own index: one of cosine routes a zero vector nowhere, while under inner
    # product it scores 0 against every target (and probes lists 0, 1, ...).
    return queries, targets, {"l2": _index(lists, "l2"), "cosine": _index(units, "cosine"),
                              "inner_product": _index(units, "inner_product")}


@pytest.fixture(scope="module")
def frames(spark, data):
    queries, targets, _ = data
    q = spark.createDataFrame([(i, None if i == NULL_QUERY else queries[i].tolist()) for i in range(NQ)],
                              "qid int, v array<float>")
    t = spark.createDataFrame([(j, None if j == NULL_TARGET else targets[j].tolist()) for j in range(NT)],
                              "tid int, w array<float>")
    return q.repartition(3), t.repartition(2)


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
    l2, cosine, inner = indexes["l2"], indexes["cosine"], indexes["inner_product"]
    far = CLUSTERS
    assert l2.route(queries[FAR_QUERY:FAR_QUERY + 1])[0, 0] == far
    assert not (l2.route(targets)[:, 0] == far).any()       # an empty list
    caps = _caps(queries, targets)
    # sqeuclidean and l2 (one routing, one search path), like cosine and inner product, differ
    # only in the kernels' metric, which the keyed blocked tests cover: a metric of each family,
    # and the caps in the third join.
    cases = {
        "l2 left": ("l2", l2, {"join_type": "left"}),
        "inner_product inner": ("inner_product", inner, {}),
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
    from nearest_join.kernels import knn

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
