"""nearest_join.parquet_scan: the columns of a plain Parquet scan read by pyarrow hold the rows
Spark reads; anything that is not a plain scan is left to Spark (None)."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F

from nearest_join.parquet_scan import plain_parquet_scan
from nearest_join.planner import known_rows


@pytest.fixture()
def files(tmp_path):
    """Two Parquet files of (id, `my.vec` array<float>, g), a NULL vector and a NULL element."""
    path = tmp_path / "side"
    path.mkdir()
    for i, rows in enumerate(([(1, [1.0, 2.0]), (2, None)], [(3, [3.0, None]), (4, [5.0, 6.0]), (5, [7.0, 8.0])])):
        pq.write_table(pa.table({"id": pa.array([r[0] for r in rows], pa.int64()),
                                 "my.vec": pa.array([r[1] for r in rows], pa.list_(pa.float32())),
                                 "g": pa.array([r[0] % 2 for r in rows], pa.int32())}),
                       path / f"part-{i}.parquet")
    return path


def _rows(table):
    return sorted(zip(table["id"].to_pylist(), table["v"].to_pylist()), key=lambda r: r[0])


def test_a_plain_scan_reads_what_spark_reads(spark, files):
    df = spark.read.parquet(str(files)).select(F.col("id").alias("qid"), "`my.vec`", "g")
    scan = plain_parquet_scan(df, ["qid", "my.vec"])
    assert scan is not None and scan.columns == ("id", "my.vec")
    got = scan.read(["id", "v"])
    assert [c.num_chunks for c in got.columns] == [1, 1]
    assert _rows(got) == sorted((r["qid"], r["my.vec"]) for r in df.collect())
    # a column's name in another case resolves to the file's
    assert plain_parquet_scan(spark.read.parquet(str(files)), ["ID", "G"]).columns == ("id", "g")


def test_anything_but_a_plain_scan_is_left_to_spark(spark, files, tmp_path):
    side = spark.read.parquet(str(files))
    spark.read.parquet(str(files)).write.partitionBy("g").parquet(str(tmp_path / "by_g"))
    side.write.json(str(tmp_path / "json"))
    not_plain = {
        "filter": side.where("id > 1"),
        "cast": side.select(F.col("id").cast("string").alias("id"), "`my.vec`"),
        "computed": side.select((F.col("id") + 1).alias("id"), "`my.vec`"),
        "union": side.union(side),
        "local rows": spark.createDataFrame([(1, [1.0])], "id long, `my.vec` array<float>"),
        "json": spark.read.schema(side.schema).json(str(tmp_path / "json")),
    }
    for what, df in not_plain.items():
        assert plain_parquet_scan(df, ["id", "my.vec"]) is None, what
    by_g = spark.read.parquet(str(tmp_path / "by_g"))
    assert plain_parquet_scan(by_g, ["id", "g"]) is None                  # a partition column
    assert _rows(plain_parquet_scan(by_g, ["id", "my.vec"]).read(["id", "v"])) == _rows(
        plain_parquet_scan(side, ["id", "my.vec"]).read(["id", "v"]))
    cached = spark.read.parquet(str(files)).cache()
    try:
        assert plain_parquet_scan(cached, ["id", "my.vec"]) is None
    finally:
        cached.unpersist()
    scan = plain_parquet_scan(side, ["id", "my.vec"])
    next(files.glob("*.parquet")).unlink()                               # gone since Spark listed it
    assert scan.read(["id", "v"]) is None


def test_rows_known_without_a_job_are_the_rows_spark_counts(spark, files, tmp_path):
    """known_rows: projections of a Parquet relation (its footers, partition columns or not), of
    local rows, of a cached relation once built; None for anything that can change the rows or
    hides them."""
    side = spark.read.parquet(str(files))
    side.write.partitionBy("g").parquet(str(tmp_path / "by_g"))
    known = {
        "scan": side,
        "projection": side.select((F.col("id") + 1).alias("x"), "`my.vec`"),
        "partitioned": spark.read.parquet(str(tmp_path / "by_g")).select("id", "g"),
        "local rows": spark.createDataFrame(pa.concat_tables([pq.read_table(f) for f in files.glob("*.parquet")])),
    }
    for what, df in known.items():
        assert known_rows(df) == df.count() == 5, what
    unknown = {
        "filter": side.where("id > 1"),
        "partition filter": spark.read.parquet(str(tmp_path / "by_g")).where("g = 1"),
        "union": side.union(side),
        "limit": side.limit(2),
        "range": spark.range(5),
    }
    for what, df in unknown.items():
        assert known_rows(df) is None, what
    cached = spark.read.parquet(str(files)).select("id").cache()
    try:
        cached.count()
        built = cached.select((F.col("id") * 2).alias("y"))
        assert "InMemoryRelation" in built._jdf.queryExecution().optimizedPlan().toString()
        assert known_rows(built) == 5
    finally:
        cached.unpersist()
