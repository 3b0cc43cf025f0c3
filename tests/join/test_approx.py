"""mode="approx" (issue 23): the IVF plan.

Most checks run without Spark: the probed search of the executors (udfs.probes, through
udfs.groups.grouped_search) against the float64 oracle restricted to each query's probed
lists, on the adversarial inputs; the index artefact (nearest_join.ivf); the recall estimate
and the choice of nprobe. A few small Spark joins check the plan end to end.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from nearest_join.kernels import rankable_rows, resolve_metric
from tests.adversarial import ALL_METRICS, cases
from tests.oracle import assert_true_topk, operator_rtol
from udfs.groups import GroupSegments, group_ids, grouped_search


def _knn_search(k: int, metric: str):
    from nearest_join.kernels import knn

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
    from udfs.probes import probed_search

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
            # magnitudes read 0 or inf in float32: ties, as the README says of every plan's merge.
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
    from nearest_join.kernels import knn

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
    from udfs.probes import Probes

    p = Probes.of_arrow(_probe_column([[3, 1], None, [], [2]]))
    assert p.rows == 4
    np.testing.assert_array_equal(p.starts, [0, 2, 2, 2, 3])
    np.testing.assert_array_equal(p.groups, [3, 1, 2])
    sliced = Probes.of_arrow(_probe_column([[9], [3, 1], None, [2]]).slice(1))
    np.testing.assert_array_equal(sliced.starts, [0, 2, 2, 3])
    np.testing.assert_array_equal(sliced.groups, [3, 1, 2])
