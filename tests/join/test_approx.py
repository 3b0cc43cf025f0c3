"""mode="approx" (issue 23): the IVF plan.

Most checks run without Spark: the probed search of the executors (udfs.search.probed_search,
through udfs.search.grouped_search) against the float64 oracle restricted to each query's
probed lists, on the adversarial inputs; the index artefact (nearest_join.ivf); the recall
estimate and the choice of nprobe. A few small Spark joins check the plan end to end.
"""
from __future__ import annotations

import json
import re
import time

import numpy as np
import pyarrow as pa
import pytest

from nearest_join import explain_nearest_join, nearest_by_join
from nearest_kernels import rankable_rows, resolve_metric
from tests.adversarial import ALL_METRICS, cases
from tests.oracle import assert_true_topk, operator_rtol
from udfs.decode import group_ids
from udfs.search import SEGMENT_WORK, GroupSegments, grouped_search


def _knn_search(k: int, metric: str):
    from nearest_kernels import knn

    return lambda q, t: knn(q, t, k, metric, backend="cpu")


def _probe_column(probes: list[list[int] | None]) -> pa.Array:
    return pa.array(probes, pa.list_(pa.int32()))


def _assert_probed(queries, targets, target_groups, probes, k, metric, values, rows, case=""):
    """Each query row holds its true top k among the rankable targets of its probed groups
    (tests.oracle.assert_true_topk on those targets), then empty slots."""
    ok = rankable_rows(targets, resolve_metric(metric))
    for i, groups in enumerate(probes):
        allowed = np.flatnonzero(ok & np.isin(target_groups, np.asarray(groups or [], np.int64)))
        if not rankable_rows(queries[i:i + 1], resolve_metric(metric))[0]:
            allowed = allowed[:0]
        width = min(k, allowed.size)
        assert (rows[i, width:] < 0).all(), f"{case} row {i}: {rows[i].tolist()} beyond {width} candidates"
        if width == 0:
            continue
        local = np.searchsorted(allowed, rows[i, :width])
        assert (allowed[np.minimum(local, allowed.size - 1)] == rows[i, :width]).all(), (
            f"{case} row {i}: rows {rows[i].tolist()} outside its lists")
        rtol = operator_rtol(queries[i:i + 1], targets[allowed], width, metric)
        assert_true_topk(queries[i:i + 1], targets[allowed], width, metric, values[i:i + 1, :width],
                         local[None, :], rtol, case=f"{case} row {i}")


PROBE_CASES = [c for c in cases(dims=(1, 3, 16, 128)) if c.targets.shape[0] >= 40]


@pytest.mark.parametrize("segment_work", [0, 3000, 1 << 40], ids=["all-large", "mixed", "all-small"])
@pytest.mark.parametrize("case", PROBE_CASES, ids=repr)
def test_probed_search_is_exact_within_the_probed_lists(case, segment_work):
    from udfs.search import probed_search

    rng = np.random.default_rng(7)
    n_groups, k = 9, 5
    t_groups = rng.integers(-1, n_groups, case.targets.shape[0])   # -1: a row in no list
    t_groups[: case.targets.shape[0] // 3] = 4                       # one dense list
    probes = [sorted(rng.choice(n_groups + 2, rng.integers(0, 4), replace=False).tolist())
              for _ in range(case.queries.shape[0])]                 # groups 9, 10: absent
    probes[0] = None
    segments = GroupSegments.of(t_groups)
    sorted_targets = np.ascontiguousarray(case.targets[segments.order])
    scale = np.abs(case.targets).max()
    squares_leave_float32 = not 1e-19 < scale < 1e19
    for metric in case.metrics:
        if squares_leave_float32 and metric in ("sqeuclidean", "inner_product") and segment_work != 1 << 40:
            # Parts merge on their float32 values (the shared merge), and squares of these
            # magnitudes read 0 or inf in float32: ties, as docs/exactness.md says of every plan's merge.
            continue
        values, rows = probed_search(_knn_search(k, metric), case.queries, group_ids(_probe_column(probes)),
                                     sorted_targets, segments, k, metric, segment_work=segment_work)
        assert values.shape == rows.shape == (case.queries.shape[0], k)
        _assert_probed(case.queries, case.targets, t_groups, probes, k, metric, values, rows,
                       case=f"{case.name} {metric}")


@pytest.mark.parametrize("metric", ALL_METRICS)
def test_grouped_search_takes_probes_and_caps(metric):
    # grouped_search hands list<int> groups to the probed search, cap included.
    rng = np.random.default_rng(3)
    queries = rng.standard_normal((60, 6)).astype(np.float32)
    targets = rng.standard_normal((400, 6)).astype(np.float32)
    t_groups = rng.integers(0, 12, 400)
    probes = [rng.choice(12, 3, replace=False).tolist() for _ in range(60)]
    segments = GroupSegments.of(t_groups)
    sorted_targets = np.ascontiguousarray(targets[segments.order])
    cap = 2.0 if metric in ("l2", "sqeuclidean") else 0.3
    from nearest_kernels import knn

    values, rows = grouped_search(lambda q, t: knn(q, t, 4, metric, backend="cpu", cap=cap), queries,
                                  group_ids(_probe_column(probes)), sorted_targets, segments, 4, metric,
                                  cap=cap)
    m = resolve_metric(metric)
    for i in range(60):
        allowed = np.flatnonzero(np.isin(t_groups, probes[i]))
        full_v, full_i = knn(queries[i:i + 1], targets[allowed], 4, metric, backend="reference", cap=cap)
        np.testing.assert_array_equal(rows[i], np.where(full_i[0] >= 0, allowed[np.maximum(full_i[0], 0)], -1))
        np.testing.assert_allclose(values[i], full_v[0], rtol=1e-5)
        assert ((values[i] >= cap) if m.descending else (values[i] <= cap))[rows[i] >= 0].all()


def test_probes_of_arrow():
    from udfs.decode import Probes

    p = Probes.of_arrow(_probe_column([[3, 1], None, [], [2]]))
    assert p.rows == 4
    np.testing.assert_array_equal(p.starts, [0, 2, 2, 2, 3])
    np.testing.assert_array_equal(p.groups, [3, 1, 2])
    sliced = Probes.of_arrow(_probe_column([[9], [3, 1], None, [2]]).slice(1))
    np.testing.assert_array_equal(sliced.starts, [0, 2, 2, 3])
    np.testing.assert_array_equal(sliced.groups, [3, 1, 2])


# ----------------------------------------------------------------------------- the index
def _clustered(n: int, d: int, clusters: int, seed: int, spread: float = 0.3):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d)) * 3
    return (centres[rng.integers(0, clusters, n)] + spread * rng.standard_normal((n, d))).astype(np.float32)


def test_index_save_load_round_trip(tmp_path):
    from nearest_join.ivf_index import IVFIndex

    x = _clustered(2000, 7, 12, seed=1)
    index = IVFIndex.train(x, "cosine", 12, seed=4, column="emb")
    assert (index.nlist, index.dimension, index.metric, index.seed, index.sample_rows) == (12, 7, "cosine", 4, 2000)
    index.save(tmp_path / "ix")
    loaded = IVFIndex.load(tmp_path / "ix")
    np.testing.assert_array_equal(loaded.centroids, index.centroids)
    assert (loaded.nlist, loaded.metric, loaded.seed, loaded.sample_rows, loaded.iterations, loaded.column) == \
        (index.nlist, index.metric, index.seed, index.sample_rows, index.iterations, "emb")
    assert repr(loaded).endswith(f"iterations={index.iterations}, column='emb')")
    np.testing.assert_array_equal(loaded.route(x, 3), index.route(x, 3))
    assert not loaded.centroids.flags.writeable
    # the same sample and seed: the same index
    np.testing.assert_array_equal(IVFIndex.train(x, "cosine", 12, seed=4).centroids, index.centroids)


def test_index_load_errors(tmp_path):
    from nearest_join.ivf_index import IVFIndex

    with pytest.raises(ValueError, match="expected an IVF index directory"):
        IVFIndex.load(tmp_path)
    IVFIndex.train(_clustered(100, 3, 2, seed=0), "l2", 2).save(tmp_path / "ix")
    (tmp_path / "ix" / "ivf_index.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="expected format 'nearest_join.ivf_index/1'"):
        IVFIndex.load(tmp_path / "ix")


def _saved(tmp_path, metric: str = "l2", nlist: int = 4, d: int = 3):
    """An index saved under ``tmp_path / "ix"``, its directory and its parameters as written."""
    from nearest_join.ivf_index import IVFIndex

    directory = tmp_path / "ix"
    IVFIndex.train(_clustered(200, d, nlist, seed=0), metric, nlist).save(directory)
    return directory, json.loads((directory / "ivf_index.json").read_text())


@pytest.mark.parametrize("metric, row, value", [
    ("l2", 1, np.nan), ("l2", 0, np.inf), ("cosine", 3, -np.inf), ("inner_product", 2, np.nan),
])
def test_a_saved_index_with_a_non_finite_centroid_is_refused(tmp_path, metric, row, value):
    """A NaN centroid is a target no row can rank against: the join would drop rows silently,
    even at nprobe = nlist. Loading it is the error, naming the file."""
    from nearest_join.ivf_index import IVFIndex

    directory, _ = _saved(tmp_path, metric)
    centroids = np.load(directory / "centroids.npy")
    centroids[row, 1] = value
    np.save(directory / "centroids.npy", centroids)
    with pytest.raises(ValueError, match=f"^'{directory / 'centroids.npy'}': expected finite numbers, "
                                         f"got NaN or infinity in centroid {row} of 4") as caught:
        IVFIndex.load(directory)
    assert type(caught.value) is ValueError
    # built by hand, the same centroids are refused too, naming the field
    with pytest.raises(ValueError, match="^centroids: expected finite numbers"):
        IVFIndex(centroids, metric, 0, 200, 0)


@pytest.mark.parametrize("metric", ["cosine", "inner_product"])
def test_a_zero_centroid_is_refused_where_lists_are_probed_by_cosine(tmp_path, metric):
    """nearest_kernels.kmeans.route ranks lists by cosine for the similarities, where a zero vector
    cannot rank: a zero centroid's list gets no row, and with every centroid zero every row
    is dropped. Under l2 a zero centroid is a point like any other."""
    from nearest_kernels.kmeans import route
    from nearest_join.ivf_index import IVFIndex

    x = _clustered(50, 3, 2, seed=0)
    assert (route(x, np.zeros((2, 3), np.float32), metric, 2) == -1).all()   # why it is refused
    directory, _ = _saved(tmp_path, metric)
    centroids = np.load(directory / "centroids.npy")
    centroids[2] = 0.0
    np.save(directory / "centroids.npy", centroids)
    with pytest.raises(ValueError, match=f"^'{directory / 'centroids.npy'}': expected no zero centroid in an "
                                         f"index for '{metric}'.* got zeros in centroid 2 of 4"):
        IVFIndex.load(directory)
    l2 = IVFIndex(np.zeros((2, 3), np.float32), "l2", 0, 2, 0)
    np.testing.assert_array_equal(l2.route(x[:1], 2), [[0, 1]])
    # duplicate centroids are fine for every metric: the lower one takes the ties
    IVFIndex(np.ones((2, 3), np.float32), metric, 0, 2, 0)


# (what is done to the saved index, the file the error names, what the message says)
_META_FAULTS = [
    ("meta", {"nlist": None}, "ivf_index.json", "key 'nlist' missing"),
    ("meta", {"metric": None}, "ivf_index.json", "key 'metric' missing"),
    ("meta", {"normalised": True}, "ivf_index.json", "unknown key 'normalised'"),
    ("meta", {"seed": "7"}, "ivf_index.json", "key seed: expected an int >= 0, got str '7'"),
    ("meta", {"seed": 1.5}, "ivf_index.json", "key seed: expected an int >= 0, got float 1.5"),
    ("meta", {"seed": -1}, "ivf_index.json", "key seed: expected an int >= 0, got -1"),
    ("meta", {"nlist": True}, "ivf_index.json", "key nlist: expected an int between 1 and 65536, got bool True"),
    ("meta", {"nlist": 0}, "ivf_index.json", "key nlist: expected an int between 1 and 65536, got 0"),
    ("meta", {"nlist": 70000}, "ivf_index.json", "key nlist: expected an int between 1 and 65536, got 70000"),
    ("meta", {"dimension": 0}, "ivf_index.json", "key dimension: expected an int >= 1, got 0"),
    ("meta", {"sample_rows": 3}, "ivf_index.json", "key sample_rows: expected at least nlist = 4"),
    ("meta", {"iterations": -2}, "ivf_index.json", "key iterations: expected an int >= 0, got -2"),
    ("meta", {"metric": "manhattan"}, "ivf_index.json",
     r"key metric: expected one of \['cosine', 'inner_product', 'l2', 'sqeuclidean'\], got 'manhattan'"),
    ("meta", {"column": 5}, "ivf_index.json", "key column: expected None or a column name, got int 5"),
    ("meta", {"nlist": 5}, "centroids.npy", r"expected float32 centroids of shape \(5, 3\).* got dtype float32 "
                                            r"of shape \(4, 3\)"),
    ("npy", "missing", "centroids.npy", "missing; expected float32 centroids of shape"),
    ("npy", "truncated", "centroids.npy", "got 43 bytes of data where the header says 48: truncated"),
    ("npy", "appended", "centroids.npy", "got 49 bytes of data where the header says 48: trailing bytes"),
    ("npy", "text", "centroids.npy", "the magic string is not correct"),
    ("npy", "empty", "centroids.npy", "EOF: reading magic string"),
    ("npy", "float64", "centroids.npy", r"got dtype float64 of shape \(4, 3\)"),
    ("npy", "3-D", "centroids.npy", r"got dtype float32 of shape \(4, 3, 1\)"),
    ("npy", "object", "centroids.npy", r"got dtype object of shape \(4, 3\)"),
]


@pytest.mark.parametrize("kind, fault, at_fault, message", _META_FAULTS,
                         ids=[",".join(f"{k}={v}" for k, v in fault.items()) if isinstance(fault, dict)
                              else f"npy-{fault}" for _, fault, *_ in _META_FAULTS])
def test_a_malformed_saved_index_is_one_value_error_naming_the_file(tmp_path, kind, fault, at_fault, message):
    """Every malformed part of a saved index is a ValueError (not a KeyError, a numpy EOF, a
    pickle complaint, nor a bad metric found only at join time) that starts with the file at
    fault and says what was expected and found."""
    from nearest_join.ivf_index import IVFIndex

    directory, meta = _saved(tmp_path)
    npy = directory / "centroids.npy"
    if kind == "meta":
        for key, value in fault.items():
            if value is None:
                del meta[key]
            else:
                meta[key] = value
        (directory / "ivf_index.json").write_text(json.dumps(meta))
    elif fault == "missing":
        npy.unlink()
    elif fault in ("truncated", "appended"):
        data = npy.read_bytes()
        npy.write_bytes(data[:-5] if fault == "truncated" else data + b"\0")
    elif fault in ("text", "empty"):
        npy.write_text("" if fault == "empty" else "0.1 0.2 0.3\n" * 4)
    else:
        centroids = np.load(npy)
        changed = {"float64": centroids.astype(np.float64), "3-D": centroids[:, :, None],
                   "object": centroids.astype(object)}[fault]
        np.save(npy, changed, allow_pickle=True)
    with pytest.raises(ValueError) as caught:
        IVFIndex.load(directory)
    assert type(caught.value) is ValueError, caught.value
    text = str(caught.value)
    assert text.startswith(f"'{directory / at_fault}': "), text
    assert re.search(message, text), text


def test_an_older_saved_index_without_its_column_still_loads(tmp_path):
    from nearest_join.ivf_index import IVFIndex

    directory, meta = _saved(tmp_path)
    meta.pop("column")
    (directory / "ivf_index.json").write_text(json.dumps(meta))
    loaded = IVFIndex.load(directory)
    assert loaded.column is None and "column=None" in repr(loaded)
    assert loaded.nlist == meta["nlist"] and loaded.dimension == meta["dimension"]


def test_a_jobs_saved_index_that_cannot_serve_is_an_index_error(tmp_path):
    """load_or_build (the job spec's join.index) reports a bad saved index under ``index``,
    so the job names join.index, and does not silently train a new one over it; nor does it
    hand a join an index of the other metric family."""
    from nearest_join.errors import ArgumentError
    from nearest_join.ivf_index import load_or_build

    directory, meta = _saved(tmp_path, "cosine")
    arguments = {"rebuild": False, "target": None, "column": "w", "nlist": None, "seed": 0}
    assert load_or_build(str(directory), metric="inner_product", **arguments).metric == "cosine"
    with pytest.raises(ArgumentError, match="index: expected an index built for l2 and sqeuclidean") as caught:
        load_or_build(str(directory), metric="l2", **arguments)
    assert caught.value.argument == "index"
    (directory / "ivf_index.json").write_text(json.dumps({**meta, "metric": "manhattan"}))
    with pytest.raises(ArgumentError, match=f"^index: '{directory / 'ivf_index.json'}': key metric") as caught:
        load_or_build(str(directory), metric="cosine", **arguments)
    assert caught.value.argument == "index"


def test_index_serves_its_metric_family_and_dimension():
    from nearest_join.errors import ArgumentError
    from nearest_join.ivf_index import IVFIndex

    index = IVFIndex.train(_clustered(300, 4, 3, seed=0), "l2", 3)
    index.check_join("sqeuclidean", 4)
    with pytest.raises(ArgumentError, match="index: expected an index built for cosine and inner_product "
                                            r"\(the join ranks by 'inner_product'\), got one built for 'l2'"):
        index.check_join("inner_product", 4)
    with pytest.raises(ArgumentError, match="index: expected an index of dimension 5"):
        index.check_join("l2", 5)
    with pytest.raises(ArgumentError, match="nlist: expected at most the 300 rankable"):
        IVFIndex.train(_clustered(300, 4, 3, seed=0), "l2", 301)


def test_default_sizes():
    from nearest_join.ivf_index import (
        MAX_LISTS,
        MAX_SAMPLE_ROWS,
        default_nlist,
        default_sample_rows,
    )

    # sqrt(q t / (q + t)): about sqrt(q) for few queries, sqrt(t / 2) for as many of each
    assert default_nlist(1_000_000, 100_000) == 302
    assert default_nlist(1_000_000, 1_000_000) == default_nlist(1_000_000) == 707
    assert default_nlist(10**8, 10_000) == 100
    assert default_nlist(0) == 1 and default_nlist(0, 0) == 1 and default_nlist(10, 0) == 1
    assert default_nlist(10**12) == MAX_LISTS
    assert default_sample_rows(1000, 1_000_000) == 50_000
    assert default_sample_rows(1000, 20_000) == 20_000
    assert default_sample_rows(60_000, 10**9) == MAX_SAMPLE_ROWS


# ----------------------------------------------------------------------------- recall
def test_recall_curve_counts_neighbours_in_probed_lists():
    from nearest_join.recall import recall_curve

    order = np.array([[2, 0, 1, 3], [1, 3, 0, 2], [0, 1, 2, 3]])
    lists = [np.array([2, 2, 0, 3]), np.array([1]), np.array([], np.int64)]   # the third: no neighbour
    curve = recall_curve(order, lists)
    assert curve.queries == 2
    # nprobe 1: (2/4 + 1) / 2; 2: (3/4 + 1) / 2; 3: same; 4: all
    np.testing.assert_allclose(curve.recall, [0.75, 0.875, 0.875, 1.0])
    assert curve.at(4) == (1.0, 1.0, 1.0)
    estimate, lower, upper = curve.at(2)
    assert estimate == 0.875 and lower < estimate < upper <= 1.0


def test_wilson_interval_and_the_choice_of_nprobe():
    from nearest_join.recall import RecallCurve, wilson_interval

    lower, upper = wilson_interval(1.0, 1000)
    assert 0.995 < lower < 1.0 and upper == 1.0
    lower, upper = wilson_interval(0.5, 100)
    assert abs(lower - 0.4038) < 1e-3 and abs(upper - 0.5962) < 1e-3
    # drawn without replacement: a sample of every value is the mean itself; of half of them,
    # the variance of the mean halves (n counts as n (N - 1) / (N - n) = 200 here)
    assert wilson_interval(0.97, 300, 0.01, population=300) == (0.97, 0.97)
    assert wilson_interval(0.97, 100, 0.01, population=199) == pytest.approx(wilson_interval(0.97, 200, 0.01))
    assert wilson_interval(0.97, 100, 0.01, population=10**9) == pytest.approx(wilson_interval(0.97, 100, 0.01))
    # another level: the 97.5% interval is wider
    assert wilson_interval(0.97, 100, 0.01, z=2.2414)[0] < wilson_interval(0.97, 100, 0.01)[0]
    curve = RecallCurve(np.array([0.5, 0.9, 0.96, 0.99, 0.999, 1.0, 1.0, 1.0]), 1000)
    assert curve.smallest_nprobe(0.95) == 4        # 0.96's lower bound is below 0.95
    assert curve.smallest_nprobe(0.9) == 3
    assert curve.smallest_nprobe(1.0) == 8         # only every list is certain
    assert curve.smallest_nprobe(0.1) == 1


def test_the_estimate_sample_is_cut_where_lists_select_sharply():
    from nearest_join import ivf

    queries = np.arange(1000, dtype=np.float32)[:, None]
    assert ivf.estimate_sample(queries, 0.1, 64_000, 0) is queries   # the search dwarfs the scan
    cut = ivf.estimate_sample(queries, 1 / 300, 100_000, 0)[:, 0]
    assert cut.size == ivf.MIN_RECALL_QUERIES and np.all(np.diff(cut) > 0)
    # A uniform draw, not a prefix (the sample's rows come in input order): each quarter of
    # the sample gives about a quarter of the cut.
    assert all(40 <= c <= 85 for c in np.bincount((cut // 250).astype(int), minlength=4))
    assert np.array_equal(cut, ivf.estimate_sample(queries, 1 / 300, 100_000, 0)[:, 0])   # seeded
    assert ivf.estimate_sample(queries, 0.01, 100_000, 1).shape == (500, 1)


def test_the_sample_draws_every_partition_alike(spark):
    """The recall estimate's queries and the training rows are a uniform sample: the last
    partition gives its share (a sample cut by limit kept the first partitions' rows and gave
    the last a third of its share), the count is exact, and the same seed draws the same rows."""
    from nearest_join.ivf_index import sample_table

    df = spark.range(0, 20000, 1, numPartitions=4)       # partition p holds 5000 p .. 5000 p + 4999
    ids = sample_table(df, 1000, 20000, seed=3).column(0).to_numpy()
    assert ids.size == 1000 and np.unique(ids).size == 1000
    for p in range(4):
        assert 200 < np.count_nonzero((ids >= 5000 * p) & (ids < 5000 * (p + 1))) < 300   # 250 +- 3.5 sd
    assert (sample_table(df, 1000, 20000, seed=3).column(0).to_numpy() == ids).all()
    assert sample_table(df, 30000, 20000, seed=3).num_rows == 20000


def test_the_interval_takes_the_queries_own_variance():
    """Per-query recalls that vary less than a coin's give a narrower interval (fewer probes
    for the same target); the variance is the sample's, at every nprobe; a sample whose
    recalls agree still gets an interval, and a variance above the bound is clipped to it."""
    from nearest_join.recall import recall_of_ranks, wilson_interval

    assert wilson_interval(0.96, 1000, 0.96 * 0.04) == wilson_interval(0.96, 1000)
    assert wilson_interval(0.96, 1000, 1.0) == wilson_interval(0.96, 1000)
    narrow, wide = wilson_interval(0.96, 1000, 0.01), wilson_interval(0.96, 1000)
    assert wide[0] < narrow[0] < 0.96 < narrow[1] < wide[1]
    lower, upper = wilson_interval(1.0, 1000, 0.0)
    assert 0.995 < lower < 1.0 and upper == 1.0
    assert wilson_interval(1.0, 10, 0.0)[0] < 0.8          # few queries: still wide

    rng = np.random.default_rng(0)
    ranks = [rng.integers(0, 12, size=rng.integers(1, 11)) for _ in range(400)] + [np.zeros(0, np.int64)]
    curve = recall_of_ranks(ranks, 8)
    assert curve.queries == 400
    per_query = np.array([[np.mean(r < p) for p in range(1, 9)] for r in ranks[:400]])
    np.testing.assert_allclose(curve.recall, per_query.mean(axis=0), atol=1e-12)
    np.testing.assert_allclose(curve.variance, per_query.var(axis=0, ddof=1), atol=1e-12)
    estimate, lower, upper = curve.at(3)
    assert (lower, upper) == pytest.approx(wilson_interval(estimate, 400, per_query[:, 2].var(ddof=1)), abs=1e-12)
    assert recall_of_ranks(ranks[:1], 8).variance is None   # one query: no sample variance


def test_recall_estimate_against_measured_recall_without_spark():
    """The estimate's mechanism (lists of the true neighbours against the query's probe
    order) is the measured recall of the probed search, on the whole query set."""
    from nearest_join.ivf_index import IVFIndex
    from nearest_join.recall import recall_curve
    from nearest_kernels import knn
    from udfs.decode import Probes
    from udfs.search import probed_search

    targets = _clustered(4000, 8, 30, seed=2, spread=0.8)
    queries = _clustered(300, 8, 30, seed=3, spread=0.8)
    index = IVFIndex.train(targets, "l2", 30, seed=0)
    t_lists = index.route(targets)[:, 0]
    _, true = knn(queries, targets, 10, "l2", backend="cpu")
    curve = recall_curve(index.route(queries, index.nlist), [t_lists[row] for row in true])
    segments = GroupSegments.of(t_lists)
    sorted_targets = np.ascontiguousarray(targets[segments.order])
    for nprobe in (1, 2, 5):
        probes = index.route(queries, nprobe)
        starts = np.arange(0, probes.size + 1, nprobe, dtype=np.int64)
        _, rows = probed_search(_knn_search(10, "l2"), queries, Probes(starts, probes.reshape(-1)),
                                sorted_targets, segments, 10, "l2", segment_work=SEGMENT_WORK)
        measured = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows.tolist(), true.tolist())])
        assert abs(measured - curve.recall[nprobe - 1]) < 1e-12


@pytest.mark.parametrize("metric", ALL_METRICS)
@pytest.mark.parametrize("capped", [False, True], ids=["no-cap", "cap"])
@pytest.mark.parametrize("scan_rows", [1, None], ids=["search-per-batch", "one-search"])
def test_the_estimates_target_scan_finds_the_true_neighbours_lists(metric, capped, scan_rows, monkeypatch):
    """udfs.ivf.sample_topk (the estimate's one scan of the target) over several batches,
    a NULL vector and an all-NULL batch among them, searched batch by batch (each merged
    into the running top k) or gathered into one search: per sampled query, the lists of
    its exact top k (the float64 reference, under the cap), each slot once."""
    import udfs.ivf
    from nearest_join.ivf_index import IVFIndex
    from nearest_kernels import knn
    from udfs.context import SideLayout
    from udfs.ivf import SAMPLE_SCHEMA, sample_topk

    if scan_rows is not None:
        monkeypatch.setattr(udfs.ivf, "SCAN_ROWS", scan_rows)

    targets = _clustered(900, 5, 12, seed=8)
    queries = _clustered(40, 5, 12, seed=9)
    index = IVFIndex.train(targets, metric, 12, seed=1)
    vectors = [None if j == 17 else targets[j].tolist() for j in range(900)]
    batches = [pa.record_batch([pa.array(vectors[a:b], pa.list_(pa.float32()))], names=["w"])
               for a, b in ((0, 300), (300, 301), (301, 700), (700, 900))]
    batches.insert(2, pa.record_batch([pa.array([None, None], pa.list_(pa.float32()))], names=["w"]))
    cap = None
    if capped:   # about half of the queries keep fewer than k neighbours
        cap = float(np.median(knn(queries, targets, 6, metric, backend="reference")[0][:, 3]))
    out = pa.Table.from_batches(list(sample_topk(
        batches, layout=SideLayout("w", 0, 5, 1), queries=queries, centroids=np.asarray(index.centroids),
        k=6, metric=metric, cap=cap)), schema=SAMPLE_SCHEMA)
    ranked = targets.copy()
    ranked[17] = np.nan
    want_v, want_rows = knn(queries, ranked, 6, metric, backend="reference", cap=cap)
    t_lists = index.route(targets)[:, 0]
    query, lists, value = (out.column(c).to_numpy() for c in ("query", "list", "value"))
    order = out.column("order").to_numpy()
    assert np.unique(query.astype(np.int64) * (1 << 50) + order).size == out.num_rows   # each slot once
    for i in range(queries.shape[0]):
        mine = query == i
        found = want_rows[i][want_rows[i] >= 0]
        assert sorted(lists[mine].tolist()) == sorted(t_lists[found].tolist()), f"query {i}"
        np.testing.assert_allclose(np.sort(value[mine]), np.sort(want_v[i][want_rows[i] >= 0]), rtol=1e-5)
    assert out.num_rows < 6 * queries.shape[0] if capped else out.num_rows == 6 * queries.shape[0]


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize("arguments, argument, message", [
    ({"recall": 0}, "recall", r"expected a number in \(0, 1\]"),
    ({"recall": 1.5}, "recall", r"expected a number in \(0, 1\]"),
    ({"recall": "high"}, "recall", "expected a number"),
    ({"nlist": 0}, "nlist", "expected None or an int between 1 and 65536"),
    ({"nprobe": 0}, "nprobe", "expected None or an int >= 1"),
    ({"nlist": 4, "nprobe": 5}, "nprobe", "expected at most nlist = 4"),
    ({"seed": -1}, "seed", "expected an int >= 0"),
    ({"seed": 1.5}, "seed", "expected an int >= 0"),
    ({"index": "path/to/index"}, "index", "expected None or an IVFIndex"),
    ({"mode": "exact", "nlist": 4}, "nlist", "applies to mode='approx'"),
    ({"mode": "exact", "nprobe": 2}, "nprobe", "applies to mode='approx'"),
])
def test_bad_approx_options(arguments, argument, message):
    from nearest_join.options import JoinOptions

    with pytest.raises((ValueError, TypeError), match=message) as caught:
        JoinOptions(**{"mode": "approx", **arguments})
    assert caught.value.argument == argument


def test_index_options_checked_against_the_index():
    from nearest_join.ivf_index import IVFIndex
    from nearest_join.options import JoinOptions

    index = IVFIndex.train(_clustered(200, 3, 4, seed=0), "l2", 4)
    with pytest.raises(ValueError, match="nprobe: expected at most nlist = 4"):
        JoinOptions(mode="approx", index=index, nprobe=5)
    with pytest.raises(ValueError, match="nlist: expected None with index"):
        JoinOptions(mode="approx", index=index, nlist=4)
    with pytest.raises(ValueError, match="index: applies to mode='approx'"):
        JoinOptions(index=index)
    assert JoinOptions(mode="APPROX", index=index, nprobe=4, recall=1).recall == 1.0


# ----------------------------------------------------------------------------- Spark
NT, NQ, D = 2400, 160, 6


@pytest.fixture(scope="module")
def frames(spark):
    """Clustered targets with one dense cluster (60% of the rows: a huge list) and duplicate
    rows (k-means then has more centroids than distinct points there: empty lists), NULL
    vectors on both sides, a zero query vector."""
    rng = np.random.default_rng(11)
    targets = _clustered(NT, D, 25, seed=5, spread=0.4)
    targets[: NT * 6 // 10] = (2.0 + 0.05 * rng.standard_normal((NT * 6 // 10, D))).astype(np.float32)
    targets[NT - 40:] = targets[NT - 80: NT - 40]
    queries = _clustered(NQ, D, 25, seed=6, spread=0.4)
    queries[: NQ // 3] = (2.0 + 0.05 * rng.standard_normal((NQ // 3, D))).astype(np.float32)
    queries[5] = 0.0
    q_rows = [(i, None if i == 7 else queries[i].tolist()) for i in range(NQ)]
    t_rows = [(j, None if j == 9 else targets[j].tolist()) for j in range(NT)]
    q = spark.createDataFrame(q_rows, "qid int, v array<float>").repartition(2)
    t = spark.createDataFrame(t_rows, "tid int, w array<float>").repartition(3)
    return queries, targets, q, t


def _rows(df):
    return sorted((r.qid, r.tid, r.d) for r in df.collect())


@pytest.mark.parametrize("metric", ["l2", "inner_product"])
def test_all_lists_give_exactly_the_exact_result(frames, metric):
    _, _, q, t = frames
    args = {"vectors": ("v", "w"), "join_type": "left_outer", "distance_col": "d"}
    exact = _rows(nearest_by_join(q, t, metric, 7, **args))
    approx = _rows(nearest_by_join(q, t, metric, 7, "approx", nlist=20, nprobe=20, **args))
    assert [(a, b) for a, b, _ in approx] == [(a, b) for a, b, _ in exact]
    np.testing.assert_allclose([c for *_, c in approx if c is not None],
                               [c for *_, c in exact if c is not None], rtol=1e-6)


def _exact_pairs(queries, targets, metric: str, k: int) -> set:
    """The exact (qid, tid) pairs, NULL vectors (query 7, target 9) as NaN rows: never ranked
    (the float64 reference backend; these rows have no ties)."""
    from nearest_kernels import knn

    queries, targets = queries.copy(), targets.copy()
    queries[7], targets[9] = np.nan, np.nan
    _, rows = knn(queries, targets, k, metric, backend="reference")
    return {(i, int(j)) for i, row in enumerate(rows) for j in row if j >= 0}


def test_recall_target_met_and_explained(frames):
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    queries, targets, q, t = frames
    target = 0.9
    planned = plan_join(q, t, "l2", JoinOptions(num_results=10, mode="approx", vectors=("v", "w"),
                                                nlist=40, recall=target, distance_col="d"))
    ivf = planned.plan.ivf
    assert ivf["runs"] == "ivf" and ivf["nlist"] == 40 and ivf["recall_target"] == target
    lower, upper = ivf["recall_interval"]
    assert target <= lower <= ivf["recall_estimate"] <= upper <= 1.0
    # every query with a vector sampled (all but the NULL one, which the population counts):
    # the estimate is nearly the join's recall, its interval nearly closed
    assert ivf["recall_queries"] == NQ - 1 and upper - lower < 0.01, ivf
    assert 1 <= ivf["nprobe"] < 40, "clustered data should need a few lists, not all"
    assert "estimated recall@10" in str(planned.plan) and f"nprobe={ivf['nprobe']}" in str(planned.plan)
    approx = planned.dataframe().collect()
    found = {(r.qid, r.tid) for r in approx}
    assert len(found) == len(approx)
    exact = _exact_pairs(queries, targets, "l2", 10)
    assert len(found & exact) / len(exact) >= target
    # the distances returned are exact for the pairs returned
    for r in approx:
        want = np.sqrt(((queries[r.qid].astype(np.float64) - targets[r.tid]) ** 2).sum())
        assert abs(r.d - want) <= 1e-5 * max(want, 1.0)


def test_same_seed_same_rows_and_a_saved_index(frames, tmp_path):
    from nearest_join import IVFIndex, build_ivf_index

    _, _, q, t = frames
    index = build_ivf_index(t, column="w", metric="cosine", nlist=16, seed=3)
    assert (index.nlist, index.dimension, index.seed) == (16, D, 3)
    index.save(tmp_path / "ix")
    loaded = IVFIndex.load(tmp_path / "ix")
    args = {"vectors": ("v", "w"), "distance_col": "d", "nprobe": 2}
    trained = _rows(nearest_by_join(q, t, "cosine", 5, "approx", nlist=16, seed=3, **args))
    reused = _rows(nearest_by_join(q, t, "cosine", 5, "approx", index=loaded, **args))
    assert reused == trained
    assert len(trained) == 5 * (NQ - 2)   # NULL and zero query vectors: no cosine candidate


def test_small_joins_and_small_keys_run_exact(frames):
    _, _, q, t = frames
    plan = explain_nearest_join(q, t, "l2", 3, "approx", vectors=("v", "w"))
    assert plan.ivf["runs"] == "exact" and "too few for IVF to win" in str(plan)
    keyed = explain_nearest_join(q.withColumn("g", q.qid % 2), t.withColumn("g", t.tid % 2), "l2", 3,
                                 "approx", vectors=("v", "w"), on="g", nlist=4)
    # two keys of 1200 target rows each, within 4 lists' worth (4 x 2400 / 4 rows): each searched whole
    assert keyed.ivf["runs"] == "exact" and "every key has at most 2400 target rows" in str(keyed)


def test_index_of_another_metric_or_dimension(frames):
    from nearest_join.errors import ArgumentError
    from nearest_join.ivf_index import IVFIndex

    _, _, q, t = frames
    with pytest.raises(ArgumentError, match="index: expected an index built for l2 and sqeuclidean"):
        explain_nearest_join(q, t, "l2", 3, "approx", vectors=("v", "w"),
                             index=IVFIndex.train(_clustered(100, D, 3, seed=0), "cosine", 3))
    with pytest.raises(ArgumentError, match="index: expected an index of dimension 6"):
        explain_nearest_join(q, t, "l2", 3, "approx", vectors=("v", "w"),
                             index=IVFIndex.train(_clustered(100, D + 1, 3, seed=0), "l2", 3))


def _no_job(*args, **kwargs):
    raise AssertionError("a Spark job ran before the index was checked")


def test_an_index_of_the_other_family_is_refused_before_any_spark_job(frames, monkeypatch):
    from nearest_join import join
    from nearest_join.errors import ArgumentError
    from nearest_join.ivf_index import IVFIndex

    _, _, q, t = frames
    monkeypatch.setattr(join, "side_facts", _no_job)   # the planner's facts job, its first
    index = IVFIndex.train(_clustered(100, D, 3, seed=0), "cosine", 3)
    with pytest.raises(ArgumentError, match="index: expected an index built for l2 and sqeuclidean") as caught:
        explain_nearest_join(q, t, "sqeuclidean", 3, "approx", vectors=("v", "w"), index=index)
    assert caught.value.argument == "index"


def test_an_index_of_another_dimension_is_refused_right_after_the_facts_job(frames, monkeypatch):
    """The dimension is known once the facts job has run, and checked then: before the keyed
    blocked plan's group count, any sampling, training or routing, and whatever plan an
    empty target would take."""
    from nearest_join import ivf, ivf_index, keyed
    from nearest_join.errors import ArgumentError

    _, _, q, t = frames
    # Each where it is called from: the planner trains and samples through ivf's names.
    for module, name in ((keyed, "layout_of"), (ivf, "training_sample"), (ivf, "sample_vectors"),
                         (ivf_index, "sample_vectors")):
        monkeypatch.setattr(module, name, _no_job)
    index = ivf_index.IVFIndex.train(_clustered(100, D + 1, 3, seed=0), "l2", 3)
    with pytest.raises(ArgumentError, match=f"index: expected an index of dimension {D} "):
        explain_nearest_join(q.withColumn("g", q.qid % 2), t.withColumn("g", t.tid % 2), "l2", 3, "approx",
                             vectors=("v", "w"), on="g", index=index, broadcast_limit_bytes=0)
    with pytest.raises(ArgumentError, match=f"index: expected an index of dimension {D} "):
        explain_nearest_join(q, t.limit(0), "l2", 3, "approx", vectors=("v", "w"), index=index)


def test_an_index_built_on_another_column_name_serves_and_the_plan_says_so(frames):
    """A renamed target column (a job's prefix, an alias) is the same vectors: not an error,
    but the plan names the column the index was built on."""
    from nearest_join.ivf_index import IVFIndex

    _, targets, q, t = frames
    index = IVFIndex.train(targets, "l2", 8, column="w")
    renamed = explain_nearest_join(q, t.withColumnRenamed("w", "emb"), "l2", 3, "approx", vectors=("v", "emb"),
                                   index=index, nprobe=2)
    assert renamed.ivf["runs"] == "ivf"
    assert renamed.ivf["index"] == "given, built on target column `w`, not the join's `emb`"
    assert "IVF: nlist=8 (given, built on target column `w`, not the join's `emb`, seed 0;" in str(renamed)
    same = explain_nearest_join(q, t, "l2", 3, "approx", vectors=("v", "w"), index=index, nprobe=2)
    assert same.ivf["index"] == "given, built on target column `w`"
    unrecorded = IVFIndex(index.centroids, "l2", 0, index.sample_rows, 0)
    plan = explain_nearest_join(q, t, "l2", 3, "approx", vectors=("v", "w"), index=unrecorded, nprobe=2)
    assert plan.ivf["index"] == "given, built on an unrecorded target column"


def test_a_recall_that_needs_many_lists_runs_exact(monkeypatch):
    """The planner's choice without Spark: a curve that needs a quarter of the lists or more
    runs the exact plan (its figures kept); an explicit nprobe always runs IVF."""
    from types import SimpleNamespace

    from nearest_join import ivf
    from nearest_join.ivf_index import IVFIndex
    from nearest_join.join import PlannedJoin
    from nearest_join.options import JoinOptions
    from nearest_join.planner import JoinPlan
    from nearest_join.recall import RecallCurve

    index = IVFIndex.train(_clustered(400, 3, 16, seed=0), "l2", 16)
    curve = RecallCurve(np.array([0.5, 0.99, 0.999, 0.9999] + [1.0] * 12), 5000)
    monkeypatch.setattr(ivf, "estimate_recall", lambda planned, index, seed: curve)
    plan = JoinPlan(plan="broadcast", reason="", metric="l2", k=5, mode="approx", join_type="inner",
                    query_column="v", target_column="w", dimension=3, query_rows=10, target_rows=400,
                    target_bytes=4800, broadcast_limit_bytes=1 << 30, task_memory_bytes=1 << 26, cores=2,
                    query_block_rows=10, target_block_rows=400, query_blocks=1, target_blocks=1,
                    query_partitions=None, target_partitions=None, backend="cpu", precision="auto",
                    distance_col=None)

    def planned(**options):
        return PlannedJoin(None, None, "l2", JoinOptions(mode="approx", index=index, **options), plan,
                           SimpleNamespace(metric="l2", target_column="w"), "distance")

    low = ivf.plan_approx(planned(recall=0.95))
    assert low.plan.ivf["runs"] == "ivf" and low.plan.ivf["nprobe"] == 2 and low.ivf.nprobe == 2
    high = ivf.plan_approx(planned(recall=0.9999))   # no lower bound reaches it: every list
    assert high.plan.ivf["runs"] == "exact" and high.plan.ivf["nprobe"] == 16 and high.ivf is None
    assert "IVF would be slower than the exact search" in high.plan.ivf["explanation"]
    assert high.plan.ivf["recall_estimate"] == 1.0
    forced = ivf.plan_approx(planned(nprobe=12))
    assert forced.plan.ivf["runs"] == "ivf" and forced.ivf.nprobe == 12


def test_gpu_tasks_run_exact_unless_ivf_is_forced(monkeypatch):
    """Tasks that search on GPUs (backend="gpu"; under "auto" executors given GPUs, or a local
    master on a host with a device and torch) run the exact plan, and the plan says why: the
    exact GPU search beats IVF's CPU routing and list-by-list search. A forced nprobe still runs
    IVF. No Spark: the session is a stand-in with a configuration."""
    import importlib.util
    from types import SimpleNamespace

    import udfs.context
    from nearest_join import ivf
    from nearest_join.ivf_index import IVFIndex
    from nearest_join.join import PlannedJoin
    from nearest_join.options import JoinOptions
    from nearest_join.planner import JoinPlan, gpu_tasks
    from nearest_join.recall import RecallCurve

    def session(**conf):
        return SimpleNamespace(conf=SimpleNamespace(get=lambda key, default=None: conf.get(key, default)))

    device = {"present": False}
    monkeypatch.setattr(udfs.context, "cuda_may_exist", lambda: device["present"])
    local = session(**{"spark.master": "local[2]"})
    assert gpu_tasks(local, "gpu") == "backend='gpu'"
    assert gpu_tasks(local, "auto") is None and gpu_tasks(local, "cpu") is None
    executors = session(**{"spark.master": "spark://h:7077", "spark.executor.resource.gpu.amount": "1"})
    assert gpu_tasks(executors, "auto") == "spark.executor.resource.gpu.amount=1"
    assert gpu_tasks(executors, "cpu") is None
    assert gpu_tasks(session(**{"spark.executor.resource.gpu.amount": "0"}), "auto") is None
    device["present"] = True
    has_torch = importlib.util.find_spec("torch") is not None
    assert (gpu_tasks(local, "auto") is not None) == has_torch
    assert gpu_tasks(session(**{"spark.master": "spark://h:7077"}), "auto") is None   # not this host

    index = IVFIndex.train(_clustered(400, 128, 16, seed=0), "l2", 16)
    monkeypatch.setattr(ivf, "estimate_recall", lambda planned, index, seed: RecallCurve(np.ones(16), 5000))
    plan = JoinPlan(plan="broadcast", reason="", metric="l2", k=5, mode="approx", join_type="inner",
                    query_column="v", target_column="w", dimension=128, query_rows=10**6, target_rows=10**6,
                    target_bytes=512 << 20, broadcast_limit_bytes=1 << 30, task_memory_bytes=1 << 26, cores=2,
                    query_block_rows=10**5, target_block_rows=10**6, query_blocks=10, target_blocks=1,
                    query_partitions=None, target_partitions=None, backend="gpu", precision="auto",
                    distance_col=None)

    def planned(spark, **options):
        return PlannedJoin(None, SimpleNamespace(sparkSession=spark), "l2", JoinOptions(mode="approx", **options),
                           plan, SimpleNamespace(metric="l2", target_column="w"), "distance")

    for spark, backend, why in [(local, "gpu", "backend='gpu'"),
                                (executors, "auto", "spark.executor.resource.gpu.amount=1")]:
        exact = ivf.plan_approx(planned(spark, backend=backend))
        assert exact.plan.ivf["runs"] == "exact" and exact.ivf is None
        assert f"the tasks search on GPUs ({why})" in exact.plan.ivf["explanation"]
    forced = ivf.plan_approx(planned(executors, index=index, nprobe=3))
    assert forced.plan.ivf["runs"] == "ivf" and forced.ivf.nprobe == 3


def test_the_training_sample_screen_stops_only_what_the_target_estimate_would():
    """The screen (each sampled query against the index's own training sample) sends a join to
    the exact plan (IVF_SCREEN_SHARE of the lists or more) only where the estimate against the
    whole target would too (IVF_MAX_PROBED_SHARE or more): it does on isotropic Gaussians, and
    lets clustered data through. No Spark."""
    from nearest_join.ivf import IVF_MAX_PROBED_SHARE, IVF_SCREEN_SHARE, screen_recall
    from nearest_join.ivf_index import IVFIndex
    from nearest_join.recall import recall_curve
    from nearest_kernels import knn

    rng = np.random.default_rng(4)
    data = {"gaussian": (rng.standard_normal((20_000, 32)).astype(np.float32),
                         rng.standard_normal((1000, 32)).astype(np.float32)),
            "clustered": (_clustered(20_000, 32, 40, seed=4), _clustered(1000, 32, 40, seed=5))}
    for name, (targets, queries) in data.items():
        sample = targets[rng.choice(targets.shape[0], 2000, replace=False)]
        index = IVFIndex.train(sample, "l2", 40, seed=0)
        _, true = knn(queries, targets, 10, "l2", backend="cpu")
        t_lists = index.route(targets)[:, 0]
        whole = recall_curve(index.route(queries, index.nlist), [t_lists[row] for row in true])
        screen = screen_recall(index, queries, sample, 10, "l2", None)
        assert screen.queries == whole.queries == 1000
        for recall in (0.9, 0.95):
            stops = screen.smallest_nprobe(recall) >= IVF_SCREEN_SHARE * index.nlist
            assert stops == (name == "gaussian"), (name, recall, screen.smallest_nprobe(recall))
            if stops:
                assert whole.smallest_nprobe(recall) >= IVF_MAX_PROBED_SHARE * index.nlist


def test_gaussian_data_runs_exact_without_the_estimates_scan(spark, monkeypatch):
    """Isotropic Gaussians: the screen on the training sample sends the join to the exact plan
    before the recall estimate's scan of the target (which would raise here), and the plan
    says why; clustered data of the same size passes the screen and is estimated."""
    from nearest_join import ivf

    rng = np.random.default_rng(8)
    scanned = []
    real = ivf.estimate_recall

    def spy(*args, **kwargs):
        scanned.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ivf, "estimate_recall", spy)
    for name, (queries, targets) in {
            "gaussian": (rng.standard_normal((600, 32)), rng.standard_normal((3000, 32))),
            "clustered": (_clustered(600, 32, 30, seed=8), _clustered(3000, 32, 30, seed=9))}.items():
        q = spark.createDataFrame([(i, row.tolist()) for i, row in enumerate(queries.astype(np.float32))],
                                  "qid int, v array<float>")
        t = spark.createDataFrame([(i, row.tolist()) for i, row in enumerate(targets.astype(np.float32))],
                                  "tid int, w array<float>")
        scanned.clear()
        plan = explain_nearest_join(q, t, "l2", 10, "approx", vectors=("v", "w"), nlist=30, recall=0.95)
        if name == "gaussian":
            assert plan.ivf["runs"] == "exact" and not scanned
            assert plan.ivf["recall_against"] == "training sample" and plan.ivf["nprobe"] >= 12
            assert "against the index's own 1500 training rows" in plan.ivf["explanation"]
            # The verdict came from the first iterations' centroids: training stopped there.
            assert plan.ivf["index"].startswith(f"screened with the centroids of {ivf.SCREEN_ITERATIONS} Lloyd")
        else:
            assert plan.ivf["runs"] == "ivf" and scanned and plan.ivf["recall_against"] == "target"


def test_samples_drawn_beside_the_facts_job_plan_as_those_drawn_after_it(spark, frames, tmp_path, monkeypatch):
    """Inputs whose rows are known without a job (Parquet files, a built cache) have their IVF
    samples drawn beside the facts job (ivf.EarlySamples): the plan and the rows are those of
    the same inputs drawn after the facts (their rows unknown). Early samples that assumed
    other counts than the facts' are not used."""
    import pyarrow.parquet as pq

    from nearest_join import ivf, planner
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    queries, targets, _, _ = frames
    for name, matrix, ids, vectors, parts in (("q", queries, "qid", "v", 2), ("t", targets, "tid", "w", 3)):
        (tmp_path / name).mkdir()
        for p, rows in enumerate(np.array_split(np.arange(matrix.shape[0]), parts)):
            pq.write_table(pa.table({ids: pa.array(rows, pa.int32()),
                                     vectors: pa.array([None if (name, r) in (("q", 7), ("t", 9)) else matrix[r].tolist()
                                                        for r in rows], pa.list_(pa.float32()))}),
                           tmp_path / name / f"part-{p}.parquet")
    q, t = spark.read.parquet(str(tmp_path / "q")), spark.read.parquet(str(tmp_path / "t"))
    used = []
    real = ivf.EarlySamples.result

    def spy(self, query_rows, target_rows):
        drawn = real(self, query_rows, target_rows)
        used.append(drawn is not None)
        return drawn

    monkeypatch.setattr(ivf.EarlySamples, "result", spy)

    def planned(q, t, **options):
        used.clear()
        planned = plan_join(q, t, "l2", JoinOptions(num_results=10, mode="approx", vectors=("v", "w"),
                                                    distance_col="d", **options))
        return planned, list(used), sorted((r.qid, r.tid, r.d) for r in planned.dataframe().collect())

    def drawn_late(*sides, **options):   # their rows unknown to the early draw: drawn after the facts
        with monkeypatch.context() as unknown:
            unknown.setattr(planner, "known_rows", lambda df: None)
            late, late_used, late_rows = planned(*sides, **options)
        assert late_used == [] and late.plan.ivf["runs"] == "ivf"
        return late, late_rows

    screened = {"nlist": 40, "recall": 0.9}
    for options in (screened, {"nlist": 40, "nprobe": 3}):
        late, late_rows = drawn_late(q, t, **options)
        early, early_used, early_rows = planned(q, t, **options)
        assert early_used == [True], options
        assert early.plan.ivf == late.plan.ivf and early_rows == late_rows, options
        if options is screened:
            screened_plan, screened_rows = late.plan.ivf, late_rows
        cached = t.cache()   # (t itself then reads the cache, not its files)
        try:
            cached.count()
            late, late_rows = drawn_late(q, cached, **options)
            early, early_used, early_rows = planned(q, cached, **options)
            assert early_used == [True], options
            assert early.plan.ivf == late.plan.ivf and early_rows == late_rows, options
        finally:
            cached.unpersist()
    monkeypatch.setattr(planner, "known_rows", lambda df: 1 + df.count())
    other, other_used, other_rows = planned(q, t, **screened)
    assert other_used == [False] and other.plan.ivf == screened_plan and other_rows == screened_rows


def test_a_failing_early_draw_leaves_the_plan_s_own_error_and_no_draw_running(spark, monkeypatch):
    """Samples drawn beside the facts job from bad input: a ragged target fails the facts job
    with its dimension error; an element the decode refuses fails the plan's own draw with the
    decode's error (the early draw's failure is not what the user sees). Either way the early
    draw has ended when the call raises: no Spark job of the planning outlives it."""
    from nearest_join import ivf

    events = []
    draw = ivf.draw_samples

    def spy(*args, **kwargs):
        events.append("start")
        try:
            if events == ["slow", "start"]:   # the early draw, slower than the facts job that fails
                time.sleep(2)
            return draw(*args, **kwargs)
        finally:
            events.append("end")

    monkeypatch.setattr(ivf, "draw_samples", spy)
    q = spark.createDataFrame([(i, [float(i), 1.0]) for i in range(40)], "qid int, v array<double>")
    ragged = spark.createDataFrame([(i, [float(i), 2.0] + ([3.0] if i == 7 else [])) for i in range(60)],
                                   "tid int, w array<double>")
    tiny = spark.createDataFrame([(i, [1e-310, 2e-310] if i == 7 else [float(i), 2.0]) for i in range(60)],
                                 "tid int, w array<double>")
    for t, condition, draws in ((ragged, "VECTOR_DIMENSION_MISMATCH", 1), (tiny, "VECTOR_ELEMENT_OUT_OF_RANGE", 2)):
        events[:] = ["slow"] if draws == 1 else []
        with pytest.raises(Exception, match=re.escape(f"[{condition}]")):
            explain_nearest_join(q, t, "l2", 3, "approx", vectors=("v", "w"), nlist=4)
        assert [e for e in events if e != "slow"] == ["start", "end"] * draws, condition
