"""The schema a job gives Spark from its inputs' footers is the one Spark infers itself, or none.

A wrong schema would not fail loudly everywhere: Spark reads a Parquet column under the type it
is told where it can. So each case compares the footers' schema with Spark's own inference of
the same files, and the rows read both ways.
"""
import datetime as dt
import decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.inputs import check_parquet_input, footer_schema
from jobs.spec import InputSpec


def _side(path) -> InputSpec:
    return InputSpec("query", (str(path),), "vec", None, None, "")


def _write_arrow(directory, tables) -> None:
    directory.mkdir(parents=True)
    for i, table in enumerate(tables):
        pq.write_table(table, directory / f"part-{i:05d}.parquet")


def _plain_table(offset: int) -> pa.Table:
    return pa.table({
        "id": pa.array([offset, offset + 1], pa.int64()),
        "small": pa.array([1, 2], pa.int8()),
        "short": pa.array([1, None], pa.int16()),
        "int": pa.array([3, 4], pa.int32()),
        "flag": pa.array([True, None]),
        "score": pa.array([0.5, 1.5], pa.float64()),
        "ratio": pa.array([0.25, None], pa.float32()),
        "name": pa.array(["a", None]),
        "big_name": pa.array(["b", "c"], pa.large_string()),
        "day": pa.array([dt.date(2026, 12, 1), None]),
        "vec": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32())),
        "wide": pa.array([[1.0] * 3, [2.0] * 3], pa.list_(pa.float64(), 3)),
        "tags": pa.array([["x"], []], pa.large_list(pa.string())),
        "info": pa.array([{"a": 1, "b": "x"}, None], pa.struct([("a", pa.int32()), ("b", pa.string())])),
    })


def _same_as_spark(spark, path, schema) -> None:
    inferred = spark.read.parquet(str(path))
    assert schema is not None
    assert schema == inferred.schema, (schema.simpleString(), inferred.schema.simpleString())
    told = spark.read.schema(schema).parquet(str(path))
    assert sorted(told.collect()) == sorted(inferred.collect())


def test_plain_columns_written_by_arrow(spark, tmp_path):
    directory = tmp_path / "plain"
    _write_arrow(directory, [_plain_table(0), _plain_table(2)])
    _same_as_spark(spark, directory, check_parquet_input(_side(directory)))


def test_files_written_by_spark_carry_spark_types(spark, tmp_path):
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import types as T

    schema = T.StructType([
        T.StructField("id", T.LongType()), T.StructField("at", T.TimestampType()),
        T.StructField("at_ntz", T.TimestampNTZType()), T.StructField("price", T.DecimalType(12, 3)),
        T.StructField("raw", T.BinaryType()), T.StructField("attrs", T.MapType(T.StringType(), T.IntegerType())),
        T.StructField("features", T.ArrayType(T.FloatType())),
    ])
    rows = [(i, dt.datetime(2026, 12, 1, 3, i), dt.datetime(2026, 12, 2, 4, i), decimal.Decimal(f"{i}.125"),
             bytes([i]), {"k": i}, [float(i), 1.0]) for i in range(4)]
    directory = tmp_path / "spark"
    frame = spark.createDataFrame(rows, schema)
    from pyspark.ml.functions import array_to_vector

    frame.withColumn("vec", array_to_vector("features")).repartition(2).write.parquet(str(directory))
    found = check_parquet_input(_side(directory))
    _same_as_spark(spark, directory, found)
    assert type(found["vec"].dataType).__name__ == "VectorUDT"
    assert Vectors.dense([0.0, 1.0]) in [r.vec for r in spark.read.schema(found).parquet(str(directory)).collect()]


@pytest.mark.parametrize("column", [
    pa.array([dt.datetime(2026, 12, 1)], pa.timestamp("us")),       # INT96 or not: Spark's setting
    pa.array([dt.datetime(2026, 12, 1)], pa.timestamp("ms", "UTC")),
    pa.array([7], pa.uint32()),
    pa.array([b"x"]),                                                # binaryAsString
    pa.array([decimal.Decimal("1.5")], pa.decimal128(5, 2)),
    pa.array([{"k": 1}], pa.map_(pa.string(), pa.int32())),
    pa.array([[1]], pa.list_(pa.uint8())),
], ids=["timestamp", "timestamp tz", "uint32", "binary", "decimal", "map", "list of uint8"])
def test_a_type_whose_reading_spark_decides_is_left_to_spark(column):
    table = pa.table({"id": pa.array([1], pa.int64()), "c": column})
    assert footer_schema([table.schema]) is None


def test_files_that_differ_are_left_to_spark(tmp_path):
    table = _plain_table(0)
    reordered = table.select(["vec", "id"])
    assert footer_schema([table.schema, table.schema]) is not None
    assert footer_schema([table.select(["id", "vec"]).schema, reordered.schema]) is None   # order
    assert footer_schema([table.schema, table.drop_columns(["name"]).schema]) is None     # columns
    doubles = table.set_column(table.schema.get_field_index("vec"), "vec",
                               pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float64())))
    assert footer_schema([table.schema, doubles.schema]) is None                          # types
    twins = pa.table({"Id": pa.array([1]), "id": pa.array([2])})
    assert footer_schema([twins.schema]) is None                 # one column to Spark, by case
    assert footer_schema([]) is None


def test_partitioned_and_remote_inputs_are_left_to_spark(tmp_path):
    directory = tmp_path / "by_day"
    _write_arrow(directory / "day=1", [_plain_table(0)])
    assert check_parquet_input(_side(directory)) is None   # Spark adds `day` from the path
    flat = tmp_path / "flat"
    _write_arrow(flat, [_plain_table(0)])
    assert check_parquet_input(_side(flat)) is not None
    both = InputSpec("query", (str(flat), "s3a://bucket/flat"), "vec", None, None, "")
    assert check_parquet_input(both) is None
