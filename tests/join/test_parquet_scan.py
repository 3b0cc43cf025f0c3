"""nearest_join.parquet_scan: the columns of a plain Parquet scan read by pyarrow hold the rows
Spark reads; anything that is not a plain scan is left to Spark (None). A join's side read
from its files in the tasks (udfs.files) joins as Spark's reading of it does."""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F

from nearest_join.parquet_scan import file_rows, plain_parquet_scan
from nearest_join.planner import known_rows
from udfs.files import FileRows


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


# --------------------------------------------------------------- sides read from their files
def _side(path, prefix: str, sizes: list[tuple[int, int]], d: int, seed: int):
    """Parquet files at ``path``: per (rows, row group rows) one file, ids counting on across
    them; a payload column of each type the tasks read; one NULL vector per file."""
    path.mkdir()
    rng = np.random.default_rng(seed)
    first = 0
    for i, (rows, group) in enumerate(sizes):
        ids = np.arange(first, first + rows)
        first += rows
        vectors = [list(v) for v in rng.standard_normal((rows, d)).astype(np.float32)]
        if rows:
            vectors[rows // 2] = None
        pq.write_table(pa.table({
            f"{prefix}id": pa.array(ids, pa.int64()),
            f"{prefix}v": pa.array(vectors, pa.list_(pa.float32())),
            "name": pa.array([f"{prefix}{j}" if j % 7 else None for j in ids], pa.string()),
            "raw": pa.array([bytes([j % 256]) for j in ids], pa.binary()),
            "small": pa.array(ids % 100, pa.int8()),
            "half": pa.array(ids % 3 == 0),
            "x": pa.array(ids * 0.5),
            "tags": pa.array([[f"t{j}", None] for j in ids], pa.list_(pa.string())),
        }), path / f"part-{i}.parquet", row_group_size=max(group, 1))


@pytest.fixture()
def file_sides(tmp_path):
    """A query of 2 files and a target of 3 (one empty), of unequal sizes and row groups."""
    _side(tmp_path / "q", "q", [(170, 64), (93, 40)], 16, 1)
    _side(tmp_path / "t", "t", [(700, 128), (0, 1), (555, 200)], 16, 2)
    return tmp_path / "q", tmp_path / "t"


@pytest.mark.parametrize("plan", ["broadcast", "blocked", "queries broadcast", "ivf", "left outer", "one task",
                                  "local"])
def test_sides_read_from_their_files_join_as_spark_reads_them(spark, file_sides, monkeypatch, request, plan):
    """Where a side is a plain Parquet scan of the types pyarrow reads as Spark does, its tasks
    read their shares of the files' rows themselves (the local plan's driver collects them from
    the files): every plan returns the rows (every column, every value) that the same sides
    read by Spark return."""
    from nearest_join import explain_nearest_join, nearest_by_join, planner
    import nearest_join.join as join_module

    read, counted, collected = [], [], []
    monkeypatch.setattr(join_module, "file_rows", lambda *a: read.append(file_rows(*a)) or read[-1])
    monkeypatch.setattr(join_module, "side_facts", lambda *a, **kw: counted.append(1) or planner.side_facts(*a, **kw))
    monkeypatch.setattr(FileRows, "table", lambda self, real=FileRows.table: collected.append(1) or real(self))
    if plan == "local":
        request.getfixturevalue("local_plan")
    elif plan != "one task":
        monkeypatch.setattr(planner, "ONE_TASK_WORK", 0)
    options = dict(k=4, distance_col="dist")
    if plan == "blocked":
        options.update(broadcast_limit_bytes=0, query_block_rows=50, target_block_rows=120)
    elif plan == "queries broadcast":
        monkeypatch.setattr(planner, "QUERY_BROADCAST_MIN_TARGET_BYTES", 0)
        monkeypatch.setattr(planner, "QUERY_BROADCAST_RATIO", 0)
        options.update(target_block_rows=150)
    elif plan == "ivf":
        options.update(mode="approx", nlist=6, nprobe=6)   # every list probed: the exact rows
    elif plan == "left outer":
        options.update(join_type="left", target_block_rows=100)
    k = options.pop("k")
    q, t = (spark.read.parquet(str(p)) for p in file_sides)
    explained = explain_nearest_join(q, t, F.vector_l2_distance(q.qv, t.tv), k, **options)
    assert explained.plan == {"blocked": "blocked", "queries broadcast": "blocked", "local": "local"}.get(plan,
                                                                                                         "broadcast")
    assert (explained.queries_broadcast, explained.one_task) == (plan == "queries broadcast",
                                                                 plan in ("one task", "local"))
    assert len(collected) == (2 if plan == "local" else 0)
    ours = nearest_by_join(q, t, F.vector_l2_distance(q.qv, t.tv), k, **options).collect()
    # Planning read the footers and counted the facts from the files (no facts job), twice.
    assert len(read) == 4 and all(r is not None for r in read) and counted == []
    assert [r.rows for r in read[2:]] == [263, 1255] and sum(read[3].files[1][1]) == 0   # (the empty file)
    qc, tc = q.cache(), t.cache()   # not plain scans: Spark reads them
    try:
        spark_read = nearest_by_join(qc, tc, F.vector_l2_distance(qc.qv, tc.tv), k, **options).collect()
        assert read[4:] == [None, None] and counted == ([] if plan == "local" else [1])   # (local: collected)
        # The same plan (an index trained on another draw of the same rows aside).
        spark_plan = explain_nearest_join(qc, tc, F.vector_l2_distance(qc.qv, tc.tv), k, **options).to_dict()
        assert {**spark_plan, "ivf": None} == {**explained.to_dict(), "ivf": None}
    finally:
        qc.unpersist()
        tc.unpersist()
    assert len(ours) == (263 - 2) * k + (2 if plan == "left outer" else 0)
    assert sorted(map(tuple, ours), key=repr) == sorted(map(tuple, spark_read), key=repr)


def test_facts_counted_from_the_files_are_the_facts_spark_counts(spark, file_sides):
    """file_side_facts (pyarrow, on the driver) counts what side_facts' Spark job counts: rows,
    the shortest and longest non-NULL vector (NULL vectors, an empty vector, a ragged one), and
    the bytes of every other column by its type's rule."""
    from nearest_join.planner import file_side_facts, side_facts

    q_path, t_path = file_sides
    ragged = q_path.parent / "ragged"
    ragged.mkdir()
    for f in q_path.glob("*.parquet"):
        table = pq.read_table(f)
        if f.name == "part-1.parquet":   # an empty vector and one of 17 elements
            vectors = table["qv"].to_pylist()
            vectors[0], vectors[1] = [], [0.5] * 17
            table = table.set_column(1, "qv", pa.array(vectors, pa.list_(pa.float32())))
        pq.write_table(table, ragged / f.name)
    for path in (q_path, t_path, ragged):
        df = spark.read.parquet(str(path))
        vector = df.columns[1]
        source = file_rows(df, list(df.columns), 3)
        spark_facts = side_facts(df, vector, df, vector)[0]
        assert file_side_facts(source, 1, 3) == dataclasses.replace(spark_facts, partitions=3), path.name
    assert (spark_facts.shortest, spark_facts.longest) == (0, 17)


def test_a_side_pyarrow_would_read_otherwise_is_left_to_spark(spark, file_sides, tmp_path):
    """No FileRows for a type outside the ones the tasks read (a timestamp), a file that lacks
    a column or holds it in another type, columns of one name, or a session that skips bad
    files; the join reads those sides through Spark."""
    q_path, t_path = file_sides
    q = spark.read.parquet(str(q_path))
    names = [f"c{i}" for i in range(len(q.columns))]
    assert file_rows(q, names, 2).rows == 263
    assert file_rows(q.withColumn("at", F.current_timestamp()), names + ["at"], 2) is None
    stamped = tmp_path / "stamped"
    q.withColumn("at", F.to_timestamp(F.lit("2026-01-01 00:00:00"))).write.parquet(str(stamped))
    assert file_rows(spark.read.parquet(str(stamped)), names + ["at"], 2) is None
    wider = tmp_path / "wider"
    wider.mkdir()
    for f in q_path.glob("*.parquet"):
        f_table = pq.read_table(f)
        if f.name == "part-1.parquet":   # one file holds `small` as int16: Spark reads it as it does
            f_table = f_table.set_column(f_table.schema.get_field_index("small"), "small",
                                         f_table["small"].cast(pa.int16()))
        pq.write_table(f_table, wider / f.name)
    assert file_rows(spark.read.schema(q.schema).parquet(str(wider)), names, 2) is None
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    for f in q_path.glob("*.parquet"):
        f_table = pq.read_table(f)
        pq.write_table(f_table.drop_columns(["x"]) if f.name == "part-1.parquet" else f_table, fewer / f.name)
    assert file_rows(spark.read.schema(q.schema).parquet(str(fewer)), names, 2) is None
    assert file_rows(q.select("qid", F.col("qid").alias("qid2"), "qv").toDF("qid", "qid", "qv"), names[:3], 2) is None
    spark.conf.set("spark.sql.files.ignoreCorruptFiles", "true")
    try:
        assert file_rows(q, names, 2) is None
    finally:
        spark.conf.unset("spark.sql.files.ignoreCorruptFiles")


@pytest.mark.parametrize("batch_rows", [2, 10_000])
def test_file_shares_cover_every_row_once_in_the_files_order(tmp_path, monkeypatch, batch_rows):
    """FileRows: the tasks' shares are contiguous, of equal rows (+-1) and together every row
    once in the files' order, whatever the tasks, row groups and batches (more tasks than rows,
    an empty file, batches smaller than a row group: no batch over BATCH_ROWS); a file whose
    row groups changed since the plan read them fails its task."""
    from udfs import files as files_module

    monkeypatch.setattr(files_module, "BATCH_ROWS", batch_rows)
    paths = []
    for i, (rows, group) in enumerate([(10, 3), (0, 1), (7, 7), (1, 1)]):
        paths.append(str(tmp_path / f"f{i}.parquet"))
        pq.write_table(pa.table({"a": pa.array(range(100 * i, 100 * i + rows), pa.int64())}), paths[-1],
                       row_group_size=group)
    files = tuple((p, tuple(pq.ParquetFile(p).metadata.row_group(g).num_rows
                            for g in range(pq.ParquetFile(p).num_row_groups))) for p in paths)
    everything = [*range(10), *range(200, 207), 300]
    for tasks in (1, 2, 3, 5, 18, 40):
        rows = FileRows(files, ("a",), ("c0",), (pa.int64(),), tasks)
        shares = [[v for b in rows.batches([task]) for v in b.column(0).to_pylist()] for task in range(tasks)]
        assert [v for share in shares for v in share] == everything, tasks
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        assert all(b.schema.names == ["c0"] and 0 < b.num_rows <= batch_rows for b in rows.batches(range(tasks)))
    pq.write_table(pa.table({"a": pa.array(range(10), pa.int64())}), paths[0], row_group_size=5)
    with pytest.raises(RuntimeError, match="changed while the join read it"):
        list(FileRows(files, ("a",), ("c0",), (pa.int64(),), 1).batches([0]))


def test_a_sample_drawn_from_the_files_is_seeded_uniform_and_without_nulls(tmp_path):
    """ivf_index.file_sample: ``rows`` of the files' rows drawn by the seed (the same rows for the
    same seed, others for another), their NULL values left out, in the files' order; every
    non-NULL value where the files hold no more rows than asked."""
    from nearest_join.ivf_index import file_sample

    paths = []
    for i, (first, rows) in enumerate([(0, 600), (600, 400)]):
        paths.append(str(tmp_path / f"f{i}.parquet"))
        values = [None if v % 10 == 3 else v for v in range(first, first + rows)]
        pq.write_table(pa.table({"a": pa.array(values, pa.int64())}), paths[-1], row_group_size=128)
    files = tuple((p, tuple(pq.ParquetFile(p).metadata.row_group(g).num_rows
                            for g in range(pq.ParquetFile(p).num_row_groups))) for p in paths)
    source = FileRows(files, ("a",), ("c0",), (pa.int64(),), 2)
    drawn = file_sample(source, 300, seed=5).to_pylist()
    assert drawn == file_sample(source, 300, seed=5).to_pylist() != file_sample(source, 300, seed=6).to_pylist()
    assert drawn == sorted(drawn) and len(set(drawn)) == len(drawn) and None not in drawn
    assert 250 <= len(drawn) <= 290 and all(v % 10 != 3 for v in drawn)   # 300 rows, about 10% NULL
    assert 100 < sum(v >= 600 for v in drawn) < 140                          # both files, in proportion
    assert file_sample(source, 1000, seed=5).to_pylist() == [v for v in range(1000) if v % 10 != 3]


def test_an_index_built_on_parquet_files_runs_no_spark_job(spark, file_sides):
    """build_ivf_index over a plain Parquet scan counts its rows from the footers and draws its
    sample from the files: no Spark job; the index is the one trained on that sample."""
    from nearest_join import build_ivf_index
    from nearest_join.ivf_index import IVFIndex, file_sample
    from udfs.decode import decode_vectors

    t = spark.read.parquet(str(file_sides[1]))
    sc = spark.sparkContext
    sc.setJobGroup("nj-test-index", "nj-test-index")
    try:
        index = build_ivf_index(t, column="tv", metric="l2", nlist=8, seed=3, sample=400)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert sc.statusTracker().getJobIdsForGroup("nj-test-index") == []
    sample = decode_vectors(file_sample(file_rows(t, list(t.columns), 1).only(1), 400, 3), None, label="tv")
    expected = IVFIndex.train(sample, "l2", 8, 3, column="tv")
    assert (index.nlist, index.sample_rows, index.column) == (8, sample.shape[0], "tv")
    np.testing.assert_array_equal(index.centroids, expected.centroids)
