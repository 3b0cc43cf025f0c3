"""Every user error of nearest_by_join, matched on its message, raised before output exists."""
from __future__ import annotations

import os

import pytest
from pyspark.sql import functions as F

from nearest_join import explain_nearest_join, nearest_by_join
from nearest_join.errors import NearestByJoinError


@pytest.fixture(scope="module")
def sides(spark):
    q = spark.createDataFrame([(1, [1.0, 0.0], "x")], "qid int, qv array<float>, s string")
    t = spark.createDataFrame([(1, [0.0, 1.0])], "tid int, tv array<float>")
    return q, t


def _raises(condition, call, match):
    with pytest.raises(NearestByJoinError, match=match) as info:
        call()
    assert info.value.getCondition() == condition
    return info.value


@pytest.mark.parametrize("k", [0, -3, 100_001])
def test_num_results_out_of_range(sides, k):
    q, t = sides
    _raises("NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE",
            lambda: nearest_by_join(q, t, F.vector_l2_distance(q.qv, t.tv), k),
            f"The number of results {k} must be between 1 and 100000")


def test_num_results_wrong_type(sides):
    q, t = sides
    with pytest.raises(TypeError, match="num_results: expected an int .* got str '3'"):
        nearest_by_join(q, t, "l2", "3", vectors=("qv", "tv"))


def test_unsupported_mode_direction_join_type(sides):
    q, t = sides
    r = F.vector_l2_distance(q.qv, t.tv)
    _raises("NEAREST_BY_JOIN.UNSUPPORTED_MODE", lambda: nearest_by_join(q, t, r, 1, "fast"),
            "Unsupported nearest-by join mode 'fast'")
    _raises("NEAREST_BY_JOIN.UNSUPPORTED_DIRECTION", lambda: nearest_by_join(q, t, r, 1, "exact", "far"),
            "Unsupported nearest-by join direction 'far'")
    for bad in ("right", "cross", "full_outer"):
        _raises("NEAREST_BY_JOIN.UNSUPPORTED_JOIN_TYPE",
                lambda: nearest_by_join(q, t, r, 1, join_type=bad), f"Unsupported nearest-by join type {bad}")


@pytest.mark.parametrize("spelling", ["left", "left_outer", "LeftOuter", "leftouter"])
def test_left_outer_spellings(sides, spelling):
    q, t = sides
    assert explain_nearest_join(q, t, "l2", 1, vectors=("qv", "tv"), join_type=spelling).join_type == "leftouter"


def test_direction_contradicting_metric(sides):
    q, t = sides
    _raises("NEAREST_BY_JOIN.DIRECTION_CONTRADICTS_METRIC",
            lambda: nearest_by_join(q, t, F.vector_l2_distance(q.qv, t.tv), 1, "exact", "similarity"),
            "direction 'similarity' contradicts the metric 'l2'")
    _raises("NEAREST_BY_JOIN.DIRECTION_CONTRADICTS_METRIC",
            lambda: nearest_by_join(q, t, "cosine", 1, "exact", "distance", vectors=("qv", "tv")),
            "use direction='similarity'")


def test_wrong_vector_type(spark, sides):
    q, t = sides
    with pytest.raises(TypeError, match="query column 's': expected array<float>, array<double> .* got string"):
        nearest_by_join(q, t, "l2", 1, vectors=("s", "tv"))
    ti = spark.createDataFrame([(1, [1, 2])], "tid int, tv array<int>")
    with pytest.raises(TypeError, match="target column 'tv': .* got array<int>"):
        nearest_by_join(q, ti, "l2", 1, vectors=("qv", "tv"))


def test_bad_ranking_and_vectors_arguments(sides):
    q, t = sides
    with pytest.raises(ValueError, match="ranking: expected a vector function Column or one of"):
        nearest_by_join(q, t, "manhattan", 1, vectors="qv")
    with pytest.raises(ValueError, match="vectors: expected a column name"):
        nearest_by_join(q, t, "l2", 1)
    with pytest.raises(ValueError, match="vectors: target column 'nope' not found"):
        nearest_by_join(q, t, "l2", 1, vectors=("qv", "nope"))
    with pytest.raises(TypeError, match="ranking: expected a Column or a metric name, got int"):
        nearest_by_join(q, t, 3, 1)
    with pytest.raises(ValueError, match="backend: expected one of"):
        nearest_by_join(q, t, "l2", 1, vectors=("qv", "tv"), backend="tpu")


def test_dimension_mismatch_up_front(spark, sides):
    q, _ = sides
    t3 = spark.createDataFrame([(1, [0.0, 1.0, 2.0])], "tid int, tv array<float>")
    err = _raises("VECTOR_DIMENSION_MISMATCH",
                  lambda: nearest_by_join(q, t3, F.vector_l2_distance(q.qv, t3.tv), 1),
                  "query column `qv` has dimension 2, target column `tv` has dimension 3")
    assert "got 2 and 3" in str(err)


def test_ragged_target_is_an_error_at_call_time(spark, sides, tmp_path):
    q, _ = sides
    rows = [(i, [float(i), 1.0]) for i in range(20)] + [(99, [1.0, 2.0, 3.0]), (100, None)]
    ragged = spark.createDataFrame(rows, "tid int, tv array<float>").coalesce(1)
    path = str(tmp_path / "out")
    err = _raises("VECTOR_DIMENSION_MISMATCH",
                  lambda: nearest_by_join(q, ragged, F.vector_l2_distance(q.qv, ragged.tv), 2).write.parquet(path),
                  "query column `qv` has dimension 2, target column `tv` has vectors of dimension 2 "
                  "and of dimension 3")
    assert "got 2 and 3" in str(err) and not os.path.exists(path)
    _raises("VECTOR_DIMENSION_MISMATCH", lambda: explain_nearest_join(q, ragged, "l2", 2, vectors=("qv", "tv")),
            "target column `tv` has vectors of dimension 2 and of dimension 3")


def test_ragged_query_is_an_error_at_call_time(spark, sides):
    from pyspark.ml.linalg import Vectors

    _, t = sides
    # a sparse ml vector counts by its size, as Spark's vector functions see it
    rows = [(0, Vectors.dense([1.0, 0.0])), (1, Vectors.sparse(4, [1], [1.0])), (2, None)]
    ragged = spark.createDataFrame(rows, ["qid", "emb.qv"])
    err = _raises("VECTOR_DIMENSION_MISMATCH",
                  lambda: nearest_by_join(ragged, t, "cosine", 1, vectors=("emb.qv", "tv")),
                  "query column `emb.qv` has vectors of dimension 2 and of dimension 4, target column "
                  "`tv` has dimension 2")
    assert "got 2 and 4" in str(err)


@pytest.mark.parametrize("local", [True, False], ids=["local plan", "executors"])
@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_a_float64_element_too_small_for_the_kernels_is_an_error(spark, request, metric, local):
    # Rows whose elements are all below 2^-960 lost every neighbour before (cosine and l2 on
    # the CPU: no candidate, a silent gap under an inner join): now the decode refuses them.
    if local:   # the default limit, as a new user's (the suite's session turns the local plan off)
        request.getfixturevalue("local_plan")
    q = spark.createDataFrame([(1, [1e-310, 2e-310]), (2, [1.0, 0.5])], "qid int, qv array<double>")
    t = spark.createDataFrame([(i, [float(i), 1.0]) for i in range(1, 6)], "tid int, tv array<double>")
    with pytest.raises(Exception, match=r"\[VECTOR_ELEMENT_OUT_OF_RANGE\] column `qv` holds the float64 "
                                        r"element 1e-310: expected 0 or a magnitude of at least 2\^-960"):
        nearest_by_join(q, t, metric, 2, vectors=("qv", "tv")).collect()
