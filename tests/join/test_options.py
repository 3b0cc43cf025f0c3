"""JoinOptions: one validated object for every option of a join (no Spark needed)."""
import dataclasses
import doctest
import pickle

import pytest

import nearest_join.options
from nearest_join.errors import ArgumentError, ArgumentTypeError, NearestByJoinError, VectorTypeError
from nearest_join.options import JoinOptions


def test_docstring_examples_run():
    result = doctest.testmod(nearest_join.options, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 2 and result.failed == 0


def test_defaults_and_normalisation():
    default = JoinOptions()
    assert (default.num_results, default.k, default.mode, default.join_type, default.backend,
            default.precision) == (1, 1, "exact", "inner", "auto", "auto")
    spelled = JoinOptions(num_results=7, mode="EXACT", direction="Distance", join_type="LEFT_OUTER",
                          vectors=["qv", "tv"])
    assert (spelled.mode, spelled.direction, spelled.join_type, spelled.vectors) == (
        "exact", "distance", "leftouter", ("qv", "tv"))
    assert JoinOptions(join_type="left").join_type == "leftouter"
    assert (default.recall, default.seed) == (None, None)
    approx = JoinOptions(mode="approx")
    assert (approx.recall, approx.seed) == (0.95, 0)
    assert JoinOptions(vectors="v").vectors == "v"
    # normalised values are valid input: replace() of a normalised object keeps them
    assert dataclasses.replace(spelled, num_results=3) == JoinOptions(
        num_results=3, direction="distance", join_type="leftouter", vectors=("qv", "tv"))


BAD = [
    # (keyword arguments, error type, argument, message fragment)
    ({"num_results": "3"}, ArgumentTypeError, "num_results",
     "num_results: expected an int between 1 and 100000, got str '3'"),
    ({"num_results": True}, ArgumentTypeError, "num_results", "got bool True"),
    ({"num_results": 0}, NearestByJoinError, "num_results", "The number of results 0 must be between 1 and 100000"),
    ({"num_results": 100_001}, NearestByJoinError, "num_results", "100001"),
    ({"mode": "fast"}, NearestByJoinError, "mode", "Unsupported nearest-by join mode 'fast'"),
    ({"direction": "far"}, NearestByJoinError, "direction", "direction 'far'"),
    ({"join_type": "full_outer"}, NearestByJoinError, "join_type", "join type full_outer"),
    ({"backend": "tpu"}, ArgumentError, "backend",
     "backend: expected one of ['auto', 'cpu', 'gpu', 'reference'], got 'tpu'"),
    ({"precision": "fp16"}, ArgumentError, "precision",
     "precision: expected one of ['auto', 'fp32', 'tf32', 'bf16'], got 'fp16'"),
    ({"distance_col": ""}, ArgumentError, "distance_col", "distance_col: expected None or a non-empty column name, got ''"),
    ({"distance_col": 3}, ArgumentError, "distance_col", "got 3"),
    ({"keep_vectors": "no"}, ArgumentTypeError, "keep_vectors", "keep_vectors: expected True or False, got str 'no'"),
    ({"vectors": ("a",)}, ArgumentError, "vectors", "vectors: expected a column name present on both sides"),
    ({"vectors": ("a", 2)}, ArgumentError, "vectors", "got ('a', 2)"),
    ({"broadcast_limit_bytes": -1}, ArgumentError, "broadcast_limit_bytes",
     "broadcast_limit_bytes: expected None or an int >= 0, got -1"),
    ({"broadcast_limit_bytes": "1g"}, ArgumentTypeError, "broadcast_limit_bytes", "got str '1g'"),
    ({"query_block_rows": 0}, ArgumentError, "query_block_rows",
     "query_block_rows: expected None or an int between 1 and 16777215, got 0"),
    ({"target_block_rows": 1 << 24}, ArgumentError, "target_block_rows", "got 16777216"),
    ({"target_block_rows": 2.5}, ArgumentTypeError, "target_block_rows", "got float 2.5"),
    # the IVF plan's options in the exact mode: a forgotten mode="approx", refused alike
    ({"recall": 0.9}, ArgumentError, "recall", "recall: applies to mode='approx' (the IVF plan), got 0.9"),
    ({"seed": 3}, ArgumentError, "seed", "seed: applies to mode='approx' (the IVF plan), got 3"),
    ({"nprobe": 2}, ArgumentError, "nprobe", "nprobe: applies to mode='approx'"),
]


@pytest.mark.parametrize("kwargs,error,argument,message", BAD, ids=[f"{b[2]}={b[0][b[2]]!r}" for b in BAD])
def test_bad_options_name_the_argument_and_value(kwargs, error, argument, message):
    with pytest.raises(error) as info:
        JoinOptions(**kwargs)
    assert info.value.argument == argument
    assert message in str(info.value)
    # replace() runs the same checks: no invalid JoinOptions can exist
    with pytest.raises(error):
        dataclasses.replace(JoinOptions(), **kwargs)


def test_spark_order_of_checks():
    # Spark checks k before the mode and the mode before the direction.
    with pytest.raises(NearestByJoinError) as info:
        JoinOptions(num_results=0, mode="fast", direction="far")
    assert info.value.getCondition() == "NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE"
    with pytest.raises(NearestByJoinError) as info:
        JoinOptions(mode="fast", direction="far")
    assert info.value.getCondition() == "NEAREST_BY_JOIN.UNSUPPORTED_MODE"


def test_frozen_and_picklable():
    options = JoinOptions(num_results=4, vectors=("qv", "tv"), precision="bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_results = 5
    assert pickle.loads(pickle.dumps(options)) == options


def test_errors_keep_their_fields_through_pickle():
    for error in (ArgumentError("backend", "expected one of [...], got 'x'"),
                  ArgumentTypeError("num_results", "expected an int, got str 'x'"),
                  VectorTypeError("target", "tv", "array<int>")):
        again = pickle.loads(pickle.dumps(error))
        assert (type(again), again.argument, str(again)) == (type(error), error.argument, str(error))
    vector = pickle.loads(pickle.dumps(VectorTypeError("target", "tv", "array<int>")))
    assert (vector.side, vector.column, vector.argument) == ("target", "tv", "vectors")
    assert str(vector) == ("target column 'tv': expected array<float>, array<double> or a dense "
                           "pyspark.ml VectorUDT, got array<int>")
    mismatch = pickle.loads(pickle.dumps(NearestByJoinError(
        "VECTOR_DIMENSION_MISMATCH", function="f", left=2, right=3, detail="d")))
    assert mismatch.argument == "vectors"


def test_huge_values_are_quoted_briefly():
    huge = ["x"] * 9
    for _ in range(6):
        huge = [huge] * 9
    with pytest.raises(ArgumentTypeError) as info:
        JoinOptions(num_results=huge)
    assert len(str(info.value)) < 200 and "list of 9 items" in str(info.value)


def test_explain_takes_the_join_s_arguments_and_each_option_is_one_of_them():
    import inspect

    from nearest_join import explain_nearest_join, nearest_by_join

    join = inspect.signature(nearest_by_join)
    assert list(inspect.signature(explain_nearest_join).parameters.values()) == list(join.parameters.values())
    # Every option is a keyword of the public functions (JoinOptions.from_arguments reads them by name).
    assert {f.name for f in dataclasses.fields(JoinOptions)} <= set(join.parameters)
    with pytest.raises(TypeError, match="bogus"):
        explain_nearest_join(None, None, "l2", 3, bogus=1)
