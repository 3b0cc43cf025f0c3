"""The keyed blocked plan (issue 22): on= keys when the target is too large to broadcast.

Three levels, cheapest first:

* the cut into cells (``planner.keyed_layout``) on group sizes alone: a key with half the
  targets is split so that no cell holds more than a bin's rows; 100,000 tiny groups share a
  few bins; groups without queries or without targets get no cell;
* the executor functions (``udfs.blocks.search_cell`` then ``merge_cells``) fed cells as
  the cogroup would, on adversarial vectors (large offsets, duplicate rows), a skewed group
  split over target and query parts, many tiny groups, NULL and one-sided groups: every
  metric, with and without a cap, against the float64 oracle per group;
* ``nearest_by_join`` in Spark with block sizes small enough to force the split: every
  metric, inner and left outer, NULL / one-sided / composite keys, caps, against the oracle
  per key group, and against Spark's equi-join + window formulation. Joins of several metrics
  share one Spark job (a union), so the Spark part stays a few jobs.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from pyspark.sql import Window
from pyspark.sql import functions as F

from nearest_join import explain_nearest_join, nearest_by_join
from nearest_join.planner import keyed_layout
from tests.adversarial import offset_case
from tests.join.test_keys import check_keyed
from tests.oracle import (
    assert_same_neighbours,
    group_rows,
    key_values,
    oracle_keys,
)
from udfs import columns as C
from udfs.blocks import merge_cells, search_cell
from udfs.context import JoinContext, SearchSettings
from udfs.context import SideLayout

METRICS = ("l2", "sqeuclidean", "cosine", "inner_product")
SIMILARITY = ("cosine", "inner_product")
SPARK_FUNCTION = {"l2": F.vector_l2_distance, "cosine": F.vector_cosine_similarity,
                  "inner_product": F.vector_inner_product}
K = 4


# ------------------------------------------------------------------------------ the layout
def _cell_rows(layout, target_counts, query_counts):
    """Expected target and query rows of each cell of every bin (parts split evenly)."""
    t_cells, q_cells = {}, {}
    for g, base, tp, qp in zip(layout.groups, layout.base, layout.t_parts, layout.q_parts):
        t_cells[int(base)] = t_cells.get(int(base), 0) + target_counts[g] / tp
        q_cells[int(base)] = q_cells.get(int(base), 0) + query_counts[g] / qp
    return t_cells, q_cells


def test_layout_splits_a_skewed_key_and_batches_small_ones():
    rng = np.random.default_rng(5)
    target_counts = np.concatenate([[50_000], rng.integers(1, 40, 2_000)])
    target_counts[0] = target_counts[1:].sum()             # one key holds half the targets
    query_counts = np.concatenate([[4_000], rng.integers(0, 5, 2_000)])
    query_counts[7] = 0                                    # a group without queries: no cell
    layout = keyed_layout(target_counts, query_counts, unmatched_queries=300, target_block_rows=1_000,
                          query_block_rows=500, cores=2, dimension=8, keep_unmatched=True)
    assert 0 in layout.groups and 7 not in layout.groups
    assert layout.bin_target_rows == 1_000
    big = int(np.flatnonzero(layout.groups == 0)[0])
    assert layout.t_parts[big] == -(-target_counts[0] // 1_000)   # split into bin-sized parts
    assert layout.q_parts[big] == -(-query_counts[0] // 500)
    assert layout.split_groups == 1 and layout.largest_split == (layout.q_parts[big], layout.t_parts[big])
    # no cell holds more than a bin's target rows or a query block's query rows
    t_cells, q_cells = _cell_rows(layout, target_counts, query_counts)
    assert max(t_cells.values()) <= 1_000 and max(q_cells.values()) <= 500
    # small groups batched: far fewer bins than groups, each group in one bin
    assert layout.bins < layout.groups.size / 10
    assert layout.unmatched_parts == 1 and layout.unmatched_base == layout.cells - 1
    bins = np.unique(layout.base)
    assert bins.size == layout.bins
    assert layout.cells == int(sum(layout.q_parts[layout.base == b][0] * layout.t_parts[layout.base == b][0]
                                   for b in bins)) + 1
    summary = layout.summary()
    assert summary["split_groups"] == 1 and summary["unmatched_queries"] == 300
    inner = keyed_layout(target_counts, query_counts, unmatched_queries=300, target_block_rows=1_000,
                         query_block_rows=500, cores=2, dimension=8, keep_unmatched=False)
    assert inner.unmatched_parts == 0 and inner.cells == layout.cells - 1


def test_layout_of_many_tiny_groups_is_a_few_cells():
    rng = np.random.default_rng(6)
    target_counts = rng.poisson(2, 100_000).clip(1)
    query_counts = rng.poisson(0.2, 100_000)
    layout = keyed_layout(target_counts, query_counts, unmatched_queries=0, target_block_rows=131_072,
                          query_block_rows=40_000, cores=2, dimension=64, keep_unmatched=False)
    assert layout.split_groups == 0 and layout.bins <= 3 and layout.cells <= 3
    assert layout.groups.size == int(((target_counts > 0) & (query_counts > 0)).sum())


def test_layout_spreads_the_work_of_one_heavy_group():
    # One group holds nearly all the work and its rows fit one target block: it is cut into
    # at least a cell per core all the same (target parts: a bin holds at most a core's share
    # of the targets; query parts: by its work, even on one core).
    target_counts = np.array([100_000, 10, 10])
    query_counts = np.array([20_000, 5, 5])
    four = keyed_layout(target_counts, query_counts, unmatched_queries=0, target_block_rows=200_000,
                        query_block_rows=40_000, cores=4, dimension=512, keep_unmatched=False)
    assert four.q_parts[0] * four.t_parts[0] >= 4
    one = keyed_layout(target_counts, query_counts, unmatched_queries=0, target_block_rows=200_000,
                       query_block_rows=40_000, cores=1, dimension=512, keep_unmatched=False)
    assert one.t_parts[0] == 1 and one.q_parts[0] == 2
    small = keyed_layout(target_counts, query_counts, unmatched_queries=0, target_block_rows=200_000,
                         query_block_rows=40_000, cores=1, dimension=4, keep_unmatched=False)
    assert small.cells == 1      # too little work to be worth a second cell


# ----------------------------------------------------------------- executor functions, no Spark
def _context(metric, d, join_type, cap=None):
    query = SideLayout("qv", 1, d, 1, group_index=2)
    target = SideLayout("tv", 1, d, 1, group_index=2)
    schema = pa.schema([("tid", pa.int64()), ("tv", pa.list_(pa.float32()))])
    return JoinContext(SearchSettings(K, metric, "cpu"), query, target, join_type, True, schema, cap=cap)


def _local_keyed(queries, q_groups, targets, t_groups, ctx, layout, seed=0, block_rows=None):
    """The keyed blocked plan as Spark runs it (nearest_join.keyed), in-process: rows drawn
    into parts, sent to their cells (shuffled, as an exchange delivers them), each cell
    searched by search_cell, the partials merged per stage-2 block by merge_cells.

    ``q_groups[i]`` is query i's group (an int, -1: none) or, for an IVF query, the list of
    its groups nearest first; such queries get stage-2 blocks of ``block_rows`` row ids."""
    rng = np.random.default_rng(seed)
    info = {int(g): (int(b), int(tp), int(qp)) for g, b, tp, qp in
            zip(layout.groups, layout.base, layout.t_parts, layout.q_parts)}
    vec = pa.list_(pa.float32())
    q_cells: dict[int, list] = {}
    for i, groups in enumerate(q_groups):
        probes = not np.isscalar(groups)
        groups = list(groups) if probes else [int(groups)]
        if not groups and ctx.join_type == "leftouter":   # posexplode_outer: one NULL group
            groups = [-1]
        parts = {}             # one query part per bin, as the hash of the row id draws it
        for rank, g in enumerate(groups):
            known = info.get(int(g)) if g >= 0 else None
            if known is None:        # no group, or one the target lacks: a NULL group id
                if rank or not layout.unmatched_parts:
                    continue         # no cell; only the payload's copy goes to the unmatched cells
                known, g = (layout.unmatched_base, 1, layout.unmatched_parts), -1
            base, tp, qp = known
            part = parts.setdefault(base, base + int(rng.integers(qp)) * tp)
            block = i // block_rows if probes else part
            for t_part in range(tp):
                q_cells.setdefault(part + t_part, []).append(
                    (i, queries[i].tolist(), None if g < 0 else int(g), i, rank, block, t_part, part + t_part))
    t_cells: dict[int, list] = {}
    for j, g in enumerate(t_groups):
        if int(g) not in info:
            continue
        base, tp, qp = info[int(g)]
        t_part = int(rng.integers(tp))
        for q_part in range(qp):
            t_cells.setdefault(base + q_part * tp + t_part, []).append((j, targets[j].tolist(), int(g), j))
    q_schema = pa.schema([("qid", pa.int64()), ("qv", vec), (C.GROUP, pa.int32()), (C.Q_ROW, pa.int64()),
                          (C.PROBE, pa.int32()), (C.Q_BLOCK_ID, pa.int64()), (C.T_BLOCK_ID, pa.int64()),
                          (C.CELL, pa.int64())])
    t_schema = pa.schema([("tid", pa.int64()), ("tv", vec), (C.GROUP, pa.int32()), (C.T_ROW, pa.int64())])
    partials: dict[int, list] = {}
    for cell in sorted(set(q_cells) | set(t_cells)):
        q_rows, t_rows = q_cells.get(cell, []), t_cells.get(cell, [])
        rng.shuffle(q_rows)
        rng.shuffle(t_rows)
        q_table = pa.Table.from_pylist([dict(zip(q_schema.names, r)) for r in q_rows], q_schema)
        t_table = pa.Table.from_pylist([dict(zip(t_schema.names, r)) for r in t_rows], t_schema)
        out = search_cell(q_table, t_table, ctx)
        for r in range(out.num_rows):
            partials.setdefault(out.column(0)[r].as_py(), []).append(out.slice(r, 1).to_batches()[0])
    rows = []
    for key, batches in partials.items():
        rng.shuffle(batches)
        for out in merge_cells((key,), batches, ctx):
            rows.extend(out.to_pylist())
    return [{"qid": r[C.output_name(0)], "tid": r[C.output_name(2)], "d": r[C.output_name(4)]} for r in rows]


@pytest.fixture(scope="module")
def skewed_block():
    """Adversarial vectors (offset 100, spread 1, duplicate targets) in groups: one with
    half the targets, 120 of 1-3 targets, one smaller than k; NULL groups on both sides, a
    query group the target lacks."""
    case = offset_case(6, 100.0, 1.0, nq=160, nt=640, seed=22)
    rng = np.random.default_rng(22)
    t_groups = np.concatenate([np.zeros(320, np.int64), rng.integers(1, 121, 300), [121, 121],
                               np.full(18, -1)])
    rng.shuffle(t_groups)
    q_groups = np.concatenate([np.zeros(60, np.int64), rng.integers(1, 121, 70), [121] * 6, [500] * 8,
                               np.full(16, -1)])
    rng.shuffle(q_groups)
    return case.queries, q_groups, case.targets, t_groups


def _groups_of(ids):
    return [None if g < 0 else int(g) for g in ids]


def _layout(q_groups, t_groups, join_type):
    size = int(max(q_groups.max(), t_groups.max())) + 1
    t_counts = np.bincount(t_groups[t_groups >= 0], minlength=size)
    q_counts = np.bincount(q_groups[q_groups >= 0], minlength=size)
    return keyed_layout(t_counts, q_counts, unmatched_queries=int((q_groups < 0).sum()
                                                                   + (t_counts[np.maximum(q_groups, 0)][q_groups >= 0] == 0).sum()),
                        target_block_rows=64, query_block_rows=16, cores=2, dimension=6,
                        keep_unmatched=join_type == "leftouter")


@pytest.mark.parametrize("join_type", ["inner", "leftouter"])
@pytest.mark.parametrize("metric", METRICS)
def test_search_cells_against_the_oracle(skewed_block, metric, join_type):
    queries, q_groups, targets, t_groups = skewed_block
    layout = _layout(q_groups, t_groups, join_type)
    big = int(np.flatnonzero(layout.groups == 0)[0])
    assert layout.t_parts[big] >= 5 and layout.q_parts[big] >= 4     # the split path is taken
    rows = _local_keyed(queries, q_groups, targets, t_groups, _context(metric, 6, join_type), layout)
    check_keyed(rows, queries, targets, _groups_of(q_groups), _groups_of(t_groups), metric, K, join_type,
                case=f"{metric} {join_type}")


@pytest.mark.parametrize("metric", METRICS)
def test_search_cells_with_a_cap(skewed_block, metric):
    queries, q_groups, targets, t_groups = skewed_block
    big_q, big_t = queries[q_groups == 0], targets[t_groups == 0]
    values = np.sort(key_values(oracle_keys(big_q, big_t, metric), metric).ravel())
    at = int(values.size * (0.995 if metric in SIMILARITY else 0.005))
    cap = float((values[at] + values[at + 1]) / 2)
    layout = _layout(q_groups, t_groups, "leftouter")
    rows = _local_keyed(queries, q_groups, targets, t_groups, _context(metric, 6, "leftouter", cap), layout)
    check_keyed(rows, queries, targets, _groups_of(q_groups), _groups_of(t_groups), metric, K, "leftouter",
                cap=cap, case=f"{metric} cap {cap}")
    found = group_rows([r for r in rows if r["tid"] is not None and q_groups[r["qid"]] == 0],
                       lambda r: r["qid"], lambda r: r["tid"], lambda r: r["d"])
    sizes = [len(found.get(i, [])) for i in np.flatnonzero(q_groups == 0)]
    assert min(sizes) == 0 and 0 < max(sizes) and any(0 < s < K for s in sizes), sizes


def test_search_cell_ties_follow_the_row_ids():
    # Integer vectors tie everywhere: the winners are the targets of lowest row id whatever
    # order the shuffle delivers the cell's rows in.
    ctx = _context("l2", 2, "inner")
    vec = pa.list_(pa.float32())
    q = pa.table({"qid": pa.array([0], pa.int64()), "qv": pa.array([[0.0, 0.0]], vec),
                  C.GROUP: pa.array([3], pa.int32()), C.Q_ROW: pa.array([9], pa.int64()),
                  C.PROBE: pa.array([0], pa.int32()), C.Q_BLOCK_ID: pa.array([0], pa.int64()),
                  C.T_BLOCK_ID: pa.array([0], pa.int64()), C.CELL: pa.array([0], pa.int64())})
    ids = [40, 10, 30, 20, 50, 60]
    t = pa.table({"tid": pa.array(ids, pa.int64()), "tv": pa.array([[1.0, 0.0]] * 6, vec),
                  C.GROUP: pa.array([3] * 6, pa.int32()), C.T_ROW: pa.array(ids, pa.int64())})
    out = list(merge_cells((0,), search_cell(q, t, ctx).to_batches(), ctx))
    assert sorted(pa.Table.from_batches(out).column(2).to_pylist()) == [10, 20, 30, 40]


# -------------------------------------------------------------------------------- Spark
BLOCKED = {"broadcast_limit_bytes": 0, "query_block_rows": 16, "target_block_rows": 64}


@pytest.fixture(scope="module")
def frames(spark, skewed_block):
    queries, q_groups, targets, t_groups = skewed_block
    q = spark.createDataFrame([(i, _key(g), queries[i].tolist()) for i, g in enumerate(q_groups)],
                              "qid int, k string, qv array<float>")
    t = spark.createDataFrame([(j, _key(g), targets[j].tolist()) for j, g in enumerate(t_groups)],
                              "tid int, k string, tv array<float>")
    return q.repartition(3).cache(), t.repartition(2).cache()


def _key(g):
    return None if g < 0 else f"key{g}"


def _joins(q, t, cases):
    """One DataFrame of several joins (a ``case`` column): one Spark job for all of them.
    ``cases``: {name: (metric, keyword arguments)}."""
    out = None
    for name, (metric, arguments) in cases.items():
        joined = nearest_by_join(q, t, metric, K, vectors=("qv", "tv"), distance_col="d", on="k",
                                 **BLOCKED, **arguments)
        joined = joined.select("qid", "tid", F.col("d").cast("double").alias("d"), F.lit(name).alias("case"))
        out = joined if out is None else out.unionByName(joined)
    return out


def test_keyed_blocked_join_against_the_oracle(spark, skewed_block, frames):
    # Every metric and join type meet at the executor level above; through Spark a distance
    # inner and a similarity left outer (the caps test adds sqeuclidean and cosine).
    queries, q_groups, targets, t_groups = skewed_block
    q, t = frames
    cases = {"l2 inner": ("l2", {}), "inner_product left": ("inner_product", {"join_type": "left_outer"})}
    rows = _joins(q, t, cases).collect()
    for name, (metric, arguments) in cases.items():
        join_type = "leftouter" if arguments else "inner"
        check_keyed([r for r in rows if r["case"] == name], queries, targets, _groups_of(q_groups),
                    _groups_of(t_groups), metric, K, join_type, case=f"spark {name}")


def test_keyed_blocked_join_with_caps(spark, skewed_block, frames):
    queries, q_groups, targets, t_groups = skewed_block
    q, t = frames
    caps = {}
    for metric in ("sqeuclidean", "cosine"):
        values = np.sort(key_values(oracle_keys(queries[q_groups == 0], targets[t_groups == 0], metric),
                                    metric).ravel())
        at = int(values.size * (0.995 if metric in SIMILARITY else 0.005))
        caps[metric] = float((values[at] + values[at + 1]) / 2)
    cases = {metric: (metric, {"join_type": "left", ("max_distance" if metric not in SIMILARITY
                                                     else "min_similarity"): cap})
             for metric, cap in caps.items()}
    rows = _joins(q, t, cases).collect()
    for metric, cap in caps.items():
        mine = [r for r in rows if r["case"] == metric]
        check_keyed(mine, queries, targets, _groups_of(q_groups), _groups_of(t_groups), metric, K,
                    "leftouter", cap=cap, case=f"spark {metric} cap {cap}")
        sizes = [sum(1 for r in mine if r["qid"] == i and r["tid"] is not None)
                 for i in np.flatnonzero(q_groups == 0)]
        assert min(sizes) == 0 and any(0 < s < K for s in sizes), (metric, sizes)


def test_keyed_blocked_explanation_shows_the_split(spark, frames, skewed_block):
    _, q_groups, _, t_groups = skewed_block
    q, t = frames
    plan = explain_nearest_join(q, t, "l2", K, vectors=("qv", "tv"), on="k", join_type="left", **BLOCKED)
    groups = np.unique(t_groups[t_groups >= 0]).size
    assert plan.plan == "blocked" and plan.key_groups == groups and plan.largest_group == 320
    cells = plan.key_cells
    assert cells["split_groups"] >= 1 and cells["largest_split"][1] >= 5
    # NULL keys, and keys the target lacks (key500 and a few drawn at random)
    assert cells["unmatched_queries"] == int((~np.isin(q_groups, t_groups[t_groups >= 0])).sum())
    text = str(plan)
    assert f"keys: query.k = target.k (as string); {groups} target groups, the largest 320 rows" in text
    assert "both sides partitioned by key group" in text
    assert f"{cells['split_groups']} key group" in text and "split (skew), the most into" in text
    assert plan.to_dict()["key_cells"] == cells


def test_keyed_blocked_matches_the_window_formulation(spark):
    rng = np.random.default_rng(31)
    nq, nt, d = 60, 400, 4
    queries = rng.standard_normal((nq, d)).astype(np.float32)
    targets = rng.standard_normal((nt, d)).astype(np.float32)
    q_keys = rng.choice(["a", "b", "c", "x"], nq, p=[0.6, 0.2, 0.1, 0.1])
    t_keys = rng.choice(["a", "b", "c", "y"], nt, p=[0.5, 0.3, 0.1, 0.1])
    second = rng.integers(0, 2, (2, max(nq, nt)))
    q = spark.createDataFrame([(i, str(q_keys[i]), int(second[0, i]), queries[i].tolist()) for i in range(nq)],
                              "qid int, k string, n int, qv array<float>")
    t = spark.createDataFrame([(j, str(t_keys[j]), int(second[1, j]), targets[j].tolist()) for j in range(nt)],
                              "tid int, k string, m bigint, tv array<float>")
    # Composite key, the int side cast to bigint as SQL's = does; key "a" split in parts.
    ours, theirs = None, None
    for metric, cap in (("l2", 1.6), ("inner_product", None)):
        fn = SPARK_FUNCTION[metric]
        extra = {} if cap is None else {"max_distance": cap}
        mine = nearest_by_join(q, t, fn(q.qv, t.tv), K, distance_col="d", join_type="left",
                               on=(q.k == t.k) & (q.n == t.m), broadcast_limit_bytes=0, query_block_rows=8,
                               target_block_rows=40, **extra)
        mine = mine.select("qid", "tid", F.col("d").cast("double").alias("d"), F.lit(metric).alias("metric"))
        pairs = q.join(t, (q.k == t.k) & (q.n == t.m)).withColumn("d", fn(q.qv, t.tv))
        if cap is not None:
            pairs = pairs.where(F.col("d") <= cap)
        order = F.col("d").desc() if metric in SIMILARITY else F.col("d").asc()
        ranked = (pairs.withColumn("r", F.row_number().over(Window.partitionBy("qid").orderBy(order, "tid")))
                  .where(F.col("r") <= K).select("qid", "tid", "d"))
        window = (q.select("qid").join(ranked, "qid", "left")
                  .select("qid", "tid", F.col("d").cast("double").alias("d"), F.lit(metric).alias("metric")))
        ours = mine if ours is None else ours.unionByName(mine)
        theirs = window if theirs is None else theirs.unionByName(window)
    ours, theirs = ours.collect(), theirs.collect()
    key = (lambda r: r["qid"], lambda r: r["tid"], lambda r: r["d"])
    for metric in ("l2", "inner_product"):
        a = group_rows([r for r in ours if r["metric"] == metric], *key)
        b = group_rows([r for r in theirs if r["metric"] == metric], *key)
        assert set(a) == set(range(nq)) and sum(len(v) for v in a.values()) > nq
        assert_same_neighbours(a, b, metric in SIMILARITY)



def test_keyed_blocked_without_any_common_key(spark):
    # No group has both queries and targets: no cell but the unmatched queries' (left outer).
    q = spark.createDataFrame([(0, "a", [0.0, 1.0]), (1, None, [1.0, 1.0])], "qid int, k string, qv array<float>")
    t = spark.createDataFrame([(0, "b", [0.0, 0.0]), (1, None, [1.0, 0.0])], "tid int, k string, tv array<float>")
    arguments = dict(vectors=("qv", "tv"), on="k", broadcast_limit_bytes=0)
    assert nearest_by_join(q, t, "l2", 2, **arguments).collect() == []
    rows = nearest_by_join(q, t, "l2", 2, join_type="left", **arguments).collect()
    assert sorted((r["qid"], r["tid"]) for r in rows) == [(0, None), (1, None)]
