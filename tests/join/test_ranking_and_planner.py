"""Reading rankings without the JVM, and the planner's arithmetic."""
from __future__ import annotations

import doctest
import math

import pytest
from pyspark.sql import functions as F

import nearest_join.join
from nearest_join.planner import (JoinPlan, choose_plan, cluster_cores, gpu_task_share, keep_gpu_targets,
                                  parse_bytes, task_memory_bytes)
from nearest_join.options import JoinOptions
from nearest_join.ranking import JoinKey, Ranking, parse_ranking


@pytest.fixture(scope="module")
def frames(spark):
    q = spark.createDataFrame([(1, [1.0], [1.0])], "id int, v array<float>, a array<float>")
    t = spark.createDataFrame([(1, [1.0], [1.0])], "id int, w array<float>, `my col` array<float>")
    return q, t


def test_reads_vector_functions_in_either_order(frames):
    q, t = frames
    assert parse_ranking(F.vector_l2_distance(q.v, t.w), q, t) == Ranking("l2", "v", "w", "Column<'vector_l2_distance(v, w)'>")
    assert parse_ranking(F.vector_inner_product(t.w, q.v), q, t).query_column == "v"
    assert parse_ranking(F.vector_cosine_similarity("v", "W"), q, t).target_column == "w"
    assert parse_ranking(F.vector_l2_distance(q.v, t["my col"]), q, t).target_column == "my col"


def _columns(ranking: Ranking) -> tuple[str, str]:
    return ranking.query_column, ranking.target_column


def test_unreadable_rankings_go_to_spark(frames):
    q, t = frames
    assert parse_ranking(F.vector_l2_distance(q.v, F.array(F.lit(1.0).cast("float"))), q, t) is None
    assert parse_ranking(-F.vector_l2_distance(q.v, t.w), q, t) is None
    assert parse_ranking(F.vector_norm(q.v), q, t) is None
    # both arguments on one side, whatever their names
    assert parse_ranking(F.vector_l2_distance(q.v, q.a), q, t) is None
    assert parse_ranking(F.vector_l2_distance(t.w, t["my col"]), q, t) is None


def test_sides_come_from_spark_not_from_names(frames):
    q, t = frames
    # Both sides have both names: the analyzer places each column on its side.
    q2 = q.withColumn("w", q.v)
    t2 = t.withColumn("v", t.w)
    assert _columns(parse_ranking(F.vector_l2_distance(q2.v, t2.w), q2, t2)) == ("v", "w")
    assert _columns(parse_ranking(F.vector_l2_distance(t2.v, q2.w), q2, t2)) == ("w", "v")
    # t.v against t.w, the query having a `v` too: two target columns, not query.v vs target.w
    assert parse_ranking(F.vector_l2_distance(t2.v, t2.w), q, t2) is None
    # plain names found on both sides carry no side
    with pytest.raises(ValueError, match="columns `v` and `w` resolve on both the query and the target"):
        parse_ranking(F.vector_l2_distance("v", "w"), q2, t2)
    # ... unless they name the same column: each row against the other side's rows
    assert _columns(parse_ranking(F.vector_l2_distance("v", "v"), q2, t2)) == ("v", "v")


def test_self_join_rankings(frames):
    q, _ = frames
    assert _columns(parse_ranking(F.vector_l2_distance(q.v, q.v), q, q)) == ("v", "v")
    with pytest.raises(ValueError, match=r"`v` and `a` resolve on both .* vectors=\('v', 'a'\)"):
        parse_ranking(F.vector_inner_product(q.v, q.a), q, q)
    with pytest.raises(ValueError, match=r"`a` and `v` resolve on both .* vectors=\('a', 'v'\)"):
        parse_ranking(F.vector_inner_product(q.a, q.v), q, q.filter("id > 0"))


def test_vector_functions_over_double_and_ml_vectors(spark):
    """Spark's vector functions take array<float>; over array<double> or VectorUDT columns its
    analyzer refuses the ranking before it places a column on a side, so each argument is
    placed on its own (test_double_vectors_are_placed_by_their_references_not_guessed)."""
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql.types import ArrayType, IntegerType, StructField, StructType

    q = spark.createDataFrame([(1, [1.0], [2.0])], "id int, v array<double>, x array<double>")
    t = spark.createDataFrame([(1, [1.0])], "id int, w array<double>")
    assert _columns(parse_ranking(F.vector_l2_distance(q.v, t.w), q, t)) == ("v", "w")
    assert _columns(parse_ranking(F.vector_cosine_similarity(t.w, q.v), q, t)) == ("v", "w")
    mixed = spark.createDataFrame([(1, [1.0])], "id int, w array<float>")
    assert parse_ranking(F.vector_inner_product(q.v, mixed.w), q, mixed).metric == "inner_product"
    ml = spark.createDataFrame([(1, Vectors.dense([1.0]))], StructType([
        StructField("id", IntegerType()), StructField("w", VectorUDT())]))
    assert _columns(parse_ranking(F.vector_l2_distance(q.v, ml.w), q, ml)) == ("v", "w")
    # a self-join through aliases: one reading, whichever argument is the query's
    a, b = q.alias("a"), q.alias("b")
    assert _columns(parse_ranking(F.vector_l2_distance(F.col("a.v"), F.col("b.v")), a, b)) == ("v", "v")
    # names present on both sides: no single reading, an error that says what to write
    both = t.withColumn("v", t.w)
    with pytest.raises(ValueError, match=r"ranking: .*take array<float>.*query `v` \(array<double>\) and "
                                         r"target `w` \(array<double>\).*vectors=\('v', 'w'\)"):
        parse_ranking(F.vector_l2_distance(q.v, both.w), q.withColumn("w", q.v), both)
    ints = spark.createDataFrame([(1, [1])], StructType([
        StructField("id", IntegerType()), StructField("w", ArrayType(IntegerType()))]))
    with pytest.raises(TypeError, match="target column 'w'.*got array<int>"):
        parse_ranking(F.vector_l2_distance(q.v, ints.w), q, ints)


def test_double_vectors_are_placed_by_their_references_not_guessed(spark):
    """Over array<double> the analyzer refuses the ranking, but not its arguments as bare
    column references: an argument named through a side's alias is on that side. A plain name
    that two columns of one side could carry is an error, not a guess: the ranking may be over
    two target columns (Spark's own join, were they array<float>)."""
    S = spark.createDataFrame([(1, [1.0], [2.0])], "id int, v array<double>, w array<double>")
    a, b = S.alias("a"), S.alias("b")
    for ranking in (F.vector_l2_distance(F.col("a.v"), F.col("b.w")), F.vector_cosine_similarity(b.w, a.v),
                    F.vector_inner_product(F.col("b.w"), F.col("a.v"))):
        assert _columns(parse_ranking(ranking, a, b)) == ("v", "w")
    assert _columns(parse_ranking(F.vector_l2_distance(F.col("a.w"), F.col("b.v")), a, b)) == ("w", "v")
    q = spark.createDataFrame([(1, [1.0])], "id int, v array<double>")
    with pytest.raises(ValueError, match=r"ranking: .*take array<float>.*query `v` \(array<double>\) and target "
                                         r"`w` \(array<double>\); target `v` \(array<double>\) and target `w` "
                                         r"\(array<double>\).*vectors=\('v', 'w'\).*F\.col\('q\.v'\)"):
        parse_ranking(F.vector_l2_distance(S.v, S.w), q, S)
    # ... which a qualifier settles
    assert _columns(parse_ranking(F.vector_l2_distance(F.col("x.v"), S.w), q.alias("x"), S)) == ("v", "w")
    # a plain name that both sides carry, against a column of one side: the one reading
    assert _columns(parse_ranking(F.vector_l2_distance(q.v, S.v), q, S)) == ("v", "v")


def test_metric_name_rankings(frames):
    q, t = frames
    assert parse_ranking("sqeuclidean", q, t, ("a", "w")) == Ranking("sqeuclidean", "a", "w", "sqeuclidean")
    with pytest.raises(ValueError, match="vectors: query column 'w' not found"):
        parse_ranking("l2", q, t, "w")
    with pytest.raises(ValueError, match="vectors: only used with a metric-name ranking"):
        parse_ranking(F.vector_l2_distance(q.v, t.w), q, t, "v")


class _Conf:
    def __init__(self, values):
        self.values = values

    def get(self, key, default=None):
        return self.values.get(key, default)


class _Spark:
    def __init__(self, **values):
        self.conf = _Conf({k.replace("__", "."): v for k, v in values.items()})


def test_cores_and_memory_from_configuration():
    assert cluster_cores(_Spark(spark__master="local[3]")) == 3
    assert cluster_cores(_Spark(spark__master="local-cluster[2,2,1024]", spark__task__cpus="2")) == 2
    assert cluster_cores(_Spark(spark__master="yarn", spark__executor__instances="10",
                                spark__executor__cores="4")) == 40
    # a quarter of a task's share of the executor's unified memory: (8g - 300m) x 0.6 / 4 / 4
    assert task_memory_bytes(_Spark(spark__master="yarn", spark__executor__memory="8g",
                                    spark__executor__cores="4")) == int(((8 << 30) - (300 << 20)) * 0.6 / 16)
    assert task_memory_bytes(_Spark(**{"spark__nearestJoin__taskMemoryBytes": "128m"})) == 128 << 20
    # local mode: the tasks share the driver's heap (a 1g local[2] driver's JVM ran out of
    # heap at 128m per task, not at 64m); at least 64m
    assert task_memory_bytes(_Spark(spark__master="local[2]", spark__driver__memory="1g")) == 64 << 20
    # concurrent tasks, not cores: 16 cores of 8 per task (the GPU profile) are two tasks
    assert task_memory_bytes(_Spark(spark__master="yarn", spark__executor__memory="32g",
                                    spark__executor__cores="16", spark__task__cpus="8")) == \
        int(((32 << 30) - (300 << 20)) * 0.6 / 8)
    assert task_memory_bytes(_Spark(spark__master="local[4]", spark__driver__memory="8g")) == \
        int(((8 << 30) - (300 << 20)) * 0.6 / 16)
    assert parse_bytes("1.5g") == 3 << 29 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="expected a size"):
        parse_bytes("lots")


def test_gpu_task_share_setting():
    assert gpu_task_share(_Spark()) == 1.0
    assert gpu_task_share(_Spark(spark__task__resource__gpu__amount="0.5")) == 0.5
    assert gpu_task_share(_Spark(spark__task__resource__gpu__amount="2")) == 1.0
    for raw in ("0", "-1", "half"):
        with pytest.raises(ValueError, match=rf"spark.task.resource.gpu.amount: expected a number > 0, got '{raw}'"):
            gpu_task_share(_Spark(spark__task__resource__gpu__amount=raw))


def test_keep_gpu_targets_setting():
    assert keep_gpu_targets(_Spark()) is True
    assert keep_gpu_targets(_Spark(spark__nearestJoin__gpu__keepTargets="False")) is False
    with pytest.raises(ValueError, match=r"gpu.keepTargets: expected true or false, got 'sometimes'"):
        keep_gpu_targets(_Spark(spark__nearestJoin__gpu__keepTargets="sometimes"))


def _options(**kw) -> JoinOptions:
    return JoinOptions(num_results=10, **kw)


def test_few_queries_against_a_large_target_broadcast_the_query_blocks():
    """A query side at most 1/128 of a target of 64 MiB or more: the blocked plan with the
    query blocks broadcast, the target read in its own partitions, under the broadcast limit
    or over it, with keys too (searched by key in each target partition: the explanation says
    so); not for approx, not for a smaller target or a larger query."""
    spark = _Spark(spark__master="local[2]", spark__driver__memory="4g")

    def plan(query_rows, target_rows, **kw):
        return choose_plan(spark=spark, ranking=Ranking("l2", "v", "w", "l2"), options=_options(**kw),
                           dimension=128, itemsize=4, query_rows=query_rows, target_rows=target_rows)

    for target_rows in (200_000, 4_000_000):     # 102 MB (under the limit), 2 GB (over it)
        chosen = plan(1000, target_rows)
        assert (chosen.plan, chosen.queries_broadcast, chosen.query_partitions, chosen.target_partitions) == \
               ("blocked", True, 0, None)
        assert "the query blocks are broadcast" in chosen.reason and "broadcast to every target" in str(chosen)
    assert not plan(1000, 100_000).queries_broadcast                # a 51 MB target
    assert not plan(20_000, 200_000).queries_broadcast              # a query 1/10 of the target
    assert not plan(2_000, 200_000).queries_broadcast               # 1/100
    assert not plan(1000, 200_000, mode="approx").queries_broadcast
    keyed = choose_plan(spark=spark, ranking=Ranking("l2", "v", "w", "l2"), options=_options(), dimension=128,
                        itemsize=4, query_rows=1000, target_rows=200_000,
                        keys=[JoinKey("g", "g", "int", "int", "int")])
    assert keyed.queries_broadcast and keyed.key_cells is None
    assert "each target partition's rows are grouped by key" in str(keyed)


def test_a_small_join_of_cheap_inputs_runs_in_one_task():
    """Below ONE_TASK_WORK multiply-adds and ONE_TASK_ELEMENTS vector elements to read and
    emit, inputs cheap to read in one task: the broadcast plan in one task, every query row in
    its block; from that work or those elements up, or with an input that is not cheap (a
    Python UDF, a large scan), the broadcast job."""
    from nearest_join.planner import ONE_TASK_ELEMENTS, ONE_TASK_WORK

    spark = _Spark(spark__master="local[2]", spark__driver__memory="1g")

    def plan(query_rows, cheap=True, k=10, target_rows=20_000, **kw):
        return choose_plan(spark=spark, ranking=Ranking("l2", "v", "w", "l2"),
                           options=JoinOptions(num_results=k, **kw),
                           dimension=64, itemsize=4, query_rows=query_rows, target_rows=target_rows,
                           query_input_partitions=4, inputs_cheap=cheap)

    below = ONE_TASK_WORK // (20_000 * 64) - 1
    small = plan(below)
    assert (small.plan, small.one_task, small.query_blocks, small.query_partitions) == ("broadcast", True, 1, 0)
    assert "one task" in str(small)
    assert not plan(below + 2).one_task and plan(below + 2).plan == "broadcast"
    assert not plan(below, cheap=False).one_task
    assert plan(below, query_block_rows=1000).query_blocks == math.ceil(below / 1000)
    # Under the work, over the elements: many query rows against a few targets (their rows and
    # the output's, converted serially in one task, cost more than a broadcast job).
    many = ONE_TASK_ELEMENTS // (64 * 11)
    assert 100 * many * 64 < ONE_TASK_WORK and not plan(many, target_rows=100).one_task
    assert plan(many // 2, target_rows=100).one_task
    assert not plan(below, broadcast_limit_bytes=0).one_task   # the blocked plan


def _plan(target_rows, query_input_partitions=None, **kw) -> JoinPlan:
    spark = _Spark(spark__master="local[2]", spark__driver__memory="1g")
    return choose_plan(spark=spark, ranking=Ranking("l2", "v", "w", "l2"), options=_options(**kw),
                       dimension=128, itemsize=4, query_rows=20_000, target_rows=target_rows,
                       query_input_partitions=query_input_partitions)


def test_broadcast_when_target_fits_else_blocked_with_bounded_blocks():
    small = _plan(150_000)
    # one equal query block per core, spread by a row-level shuffle (the join is large)
    assert (small.plan, small.query_blocks, small.query_partitions) == ("broadcast", 2, 2)
    assert small.query_block_rows == 10_000
    # a small join on an input with enough partitions keeps them: no shuffle
    tiny = _plan(2_000, query_input_partitions=4)
    assert tiny.plan == "broadcast" and tiny.query_partitions == 0
    # ... and one of fewer partitions than the cores too, when one task searches it faster
    # than a shuffle round starts; a larger join on one partition is spread over the cores
    assert _plan(2_000, query_input_partitions=1).query_partitions == 0
    assert _plan(20_000, query_input_partitions=1).query_partitions == 2
    # a per-task memory budget smaller than one block per core gives more blocks, a multiple of the cores
    tight = choose_plan(spark=_Spark(spark__master="local[2]", **{"spark__nearestJoin__taskMemoryBytes": "64m"}),
                        ranking=Ranking("l2", "v", "w", "l2"), options=_options(), dimension=128,
                        itemsize=4, query_rows=200_000, target_rows=1_000)
    assert tight.query_blocks % 2 == 0 and tight.query_block_rows * (128 * 4 + 160) <= (64 << 20) // 4
    big = _plan(10_000_000)
    assert big.plan == "blocked"
    # blocks are bounded by the task budget, not by the table size
    assert big.target_block_rows * 128 * 4 <= big.task_memory_bytes
    assert big.target_blocks == -(-10_000_000 // big.target_block_rows)
    bigger = _plan(100_000_000)
    assert bigger.target_block_rows == big.target_block_rows
    forced = _plan(200_000, broadcast_limit_bytes=0, query_block_rows=100, target_block_rows=1000)
    assert (forced.plan, forced.query_blocks, forced.target_blocks) == ("blocked", 200, 200)


def test_docstring_example_runs(spark):
    result = doctest.testmod(nearest_join.join, extraglobs={"spark": spark}, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0


def _plan_with(conf, **kw) -> JoinPlan:
    spark = _Spark(spark__master="local[2]", spark__driver__memory="1g",
                   **{"spark__nearestJoin__" + k: v for k, v in conf.items()})
    return choose_plan(spark=spark, ranking=Ranking("l2", "v", "w", "l2"), options=_options(**kw),
                       dimension=128, itemsize=4, query_rows=20_000, target_rows=150_000)


def test_query_blocks_per_task_and_broadcast_target_block_size():
    plain = _plan_with({})
    assert plain.target_block_rows == (64 << 20) // 512
    split = _plan_with({"queryBlocksPerTask": "4", "broadcastTargetBlockBytes": "1m"})
    # the same two tasks (partitions), each cut into four query blocks
    assert (split.query_partitions, split.query_blocks, split.query_block_rows) == (2, 8, 2_500)
    assert split.target_block_rows == (1 << 20) // 512
    for conf, match in [({"queryBlocksPerTask": "0"}, "queryBlocksPerTask: expected an integer >= 1, got '0'"),
                        ({"queryBlocksPerTask": "2.5"}, "queryBlocksPerTask"),
                        ({"broadcastTargetBlockBytes": "2g"}, "broadcastTargetBlockBytes: expected a size"),
                        ({"broadcastTargetBlockBytes": "lots"}, "broadcastTargetBlockBytes: expected a size such as")]:
        with pytest.raises(ValueError, match=match):
            _plan_with(conf)


def test_broadcast_limit_respects_driver_and_executor_memory():
    """A 0.92 GB target under the 1 GiB default limit, with a 1g driver: broadcasting it
    killed the driver JVM (OutOfMemoryError); the plan is blocked and says why. The cap
    counts the copies one JVM holds: the table, its pieces and one per task running there
    (on local-cluster[2,1,1024], a 205 MB target under the old 1/4-of-the-heap cap lost an
    executor to OutOfMemoryError in the join's row copies; 138 MB did not)."""
    from nearest_join.planner import broadcast_limit

    def unified(heap):   # (heap - 300 MiB) x spark.memory.fraction
        return int((heap - (300 << 20)) * 0.6)

    rows = 920_000_000 // (128 * 4)
    one_gig = _Spark(spark__master="local[2]", spark__driver__memory="1g")
    plan = choose_plan(spark=one_gig, ranking=Ranking("l2", "v", "w", "l2"), options=_options(),
                       dimension=128, itemsize=4, query_rows=200_000, target_rows=rows)
    assert plan.plan == "blocked" and not plan.queries_broadcast
    assert "5 copies of it (3, and one per task of 2 at once) in the unified memory of " \
           "spark.driver.memory 1073741824 B" in plan.reason
    assert broadcast_limit(one_gig, None) == unified(1 << 30) // 5
    # local-cluster[n, cores, MiB]: its executors' heap, one task each
    small = _Spark(spark__master="local-cluster[2,1,1024]")
    assert broadcast_limit(small, None) == unified(1 << 30) // 3
    for target_bytes, expected in ((205_000_000, "blocked"), (138_000_000, "broadcast")):
        plan = choose_plan(spark=small, ranking=Ranking("l2", "v", "w", "l2"), options=_options(),
                           dimension=128, itemsize=4, query_rows=100_000, target_rows=target_bytes // 512)
        assert plan.plan == expected and not plan.queries_broadcast
    # a cluster: the smaller quotient decides (4g executors, one task each: 3 copies); an
    # explicit limit is capped the same way
    cluster = _Spark(spark__master="yarn", spark__driver__memory="16g", spark__executor__memory="4g")
    assert broadcast_limit(cluster, None) == unified(4 << 30) // 3
    assert broadcast_limit(cluster, 10 << 30) == unified(4 << 30) // 3
    wide = _Spark(spark__master="yarn", spark__driver__memory="16g", spark__executor__memory="16g",
                  spark__executor__cores="8")
    assert broadcast_limit(wide, None) == unified(16 << 30) // 10
    huge = _Spark(spark__master="yarn", spark__driver__memory="256g", spark__executor__memory="128g",
                  spark__nearestJoin__broadcastLimitBytes="64g")
    assert broadcast_limit(huge, None) == 8 << 30             # Spark's broadcast table limit
    assert broadcast_limit(huge, 0) == 0


def test_a_broadcast_target_s_other_columns_count_against_the_memory_cap():
    """`nearest-join demo --query-rows 100000 --target-rows 900000` under conf/local.yaml
    (local[2], a 2g driver) broadcast 230 MB of vectors with 29 MB of ids and names, under a
    cap of 4 copies of the vectors alone, and the search's tasks died of OutOfMemoryError;
    700,000 rows (201 MB with their columns) did not. A local JVM holds the collected rows,
    the pieces and the table, and one copy per task; every copy carries the other columns.
    The vectors alone still meet the broadcast limit (a user's setting is about vectors)."""
    from nearest_join.planner import broadcast_memory_cap

    local = _Spark(spark__master="local[2]", spark__driver__memory="2g")
    cap, why = broadcast_memory_cap(local)
    assert cap == int(((2 << 30) - (300 << 20)) * 0.6) // 5 and "5 copies of it (3, and one per task of 2" in why
    ranking = Ranking("l2", "vec", "target_vec", "l2")

    def plan(rows, payload_per_row):
        return choose_plan(spark=local, ranking=ranking, options=_options(), dimension=64, itemsize=4,
                           query_rows=100_000, target_rows=rows, target_payload=rows * payload_per_row)

    assert plan(900_000, 32).plan == "blocked"
    blocked = plan(800_000, 32)   # vectors 205 MB < cap, with their columns 230 MB > cap
    assert 800_000 * 256 <= cap < 800_000 * 288
    assert blocked.plan == "blocked" and not blocked.queries_broadcast
    assert f"target vectors 204800000 B and its other columns 25600000 B > the broadcast's memory cap {cap} B" \
           in blocked.reason
    assert plan(800_000, 0).plan == "broadcast"
    assert plan(700_000, 32).plan == "broadcast"

    # The query-broadcast plan's query blocks likewise: 20,000 queries (5 MB of vectors)
    # against 8,000,000 targets, with 1 KB of text each (20 MB) or 12 KB (246 MB > cap).
    def queries(payload_per_row):
        return choose_plan(spark=local, ranking=ranking, options=_options(), dimension=64, itemsize=4,
                           query_rows=20_000, target_rows=8_000_000, query_payload=20_000 * payload_per_row)

    assert queries(1024).queries_broadcast and not queries(12 * 1024).queries_broadcast
    assert queries(12 * 1024).plan == "blocked"


@pytest.mark.parametrize("keyed", [False, True])
def test_small_inputs_give_their_facts_in_one_job(spark, monkeypatch, keyed):
    """Inputs Spark estimates small are aggregated in one task: one Spark job, and the same
    facts (rows, input partitions, shortest and longest vector, key groups) as the shuffled
    aggregation over their partitions; an input Spark has no estimate for (Python rows in an
    RDD) takes the shuffle."""
    from nearest_join import planner

    # Ranges, not rows: Spark evaluates a projection of rows (a local relation) on the driver,
    # as one partition.
    lengths = (1 + F.col("id") / 2).cast("int")   # 1 and 2
    q = spark.range(3, numPartitions=3).select(
        "id", F.when(F.col("id") == 1, None).otherwise(F.array_repeat(F.lit(1.0).cast("float"), lengths))
        .alias("v"), F.when(F.col("id") != 1, F.lit("a")).alias("g"))
    t = spark.range(20, numPartitions=2).select(
        "id", F.array_repeat(F.col("id").cast("float"), (2 + F.col("id") % 2).cast("int")).alias("w"),
        F.when(F.col("id") % 5 != 0, F.when(F.col("id") % 2 == 0, "a").otherwise("b")).alias("g"))
    keys = [t["g"]] if keyed else None
    tracker = spark.sparkContext.statusTracker()

    def facts(group):
        group += f" keyed={keyed}"   # the tracker keeps a group's finished jobs
        spark.sparkContext.setJobGroup(group, group)
        try:
            return planner.side_facts(q, "v", t, "w", target_keys=keys), len(tracker.getJobIdsForGroup(group))
        finally:
            spark.sparkContext.setJobGroup("", "")

    assert planner.estimated_bytes(q) is not None and planner.estimated_bytes(t) is not None
    rows = spark.sparkContext.parallelize([(1, [1.0])]).toDF("id int, v array<float>")
    assert planner.estimated_bytes(rows) is None
    # Small but running Python (an embedding model, say): not squeezed into one task.
    python = t.withColumn("w", F.udf(lambda w: w, "array<float>")("w"))
    arrow = t.mapInArrow(lambda batches: batches, t.schema)
    assert planner.in_one_task_when_small(t) is not t
    assert all(planner.in_one_task_when_small(df) is df for df in (rows, python, arrow))
    one_task, jobs = facts("one task")
    monkeypatch.setattr(planner, "ONE_TASK_BYTES", -1)
    shuffled, shuffled_jobs = facts("shuffled")
    assert one_task == shuffled
    # each side's other columns: an 8-byte id, and g's byte (2 of the query's rows, 16 of the
    # target's) and 4-byte offset (every row)
    assert one_task[:2] == (planner.SideFacts(rows=3, partitions=3, shortest=1, longest=2, payload=38),
                            planner.SideFacts(rows=20, partitions=2, shortest=2, longest=3, payload=256))
    if keyed:   # ids 1, 3, 7, 9, ... are "b" (8 rows), 2, 4, 6, 8, ... "a" (8 rows), 0, 5, 10, 15 NULL
        assert one_task[2] == planner.KeyFacts(groups=2, largest=8)
    assert jobs == 1 and shuffled_jobs > 1


def test_the_facts_job_measures_the_bytes_of_the_target_s_other_columns(spark):
    """A broadcast carries them with the vectors (the memory cap above): fixed widths, the
    bytes of strings and binaries with their offsets, an array of fixed-width elements by its
    length, anything else at a default size; the vector column is not counted."""
    from nearest_join import planner

    t = spark.createDataFrame(
        [(1, "abc", [1.0, 2.0], b"\x00\x01", {"k": 1}, [0.5, 0.5]),
         (2, None, None, None, None, [0.5, 0.5]),
         (3, "\u00e9", [1.0], b"", {}, [0.5, 0.5])],
        "id long, name string, extra array<double>, raw binary, m map<string,int>, w array<float>")
    total = t.select(F.sum(planner.payload_bytes(t, "w")).alias("b")).first()["b"]
    ids, names, extras, raws, maps = 3 * 8, (3 + 0 + 2) + 3 * 4, (16 + 0 + 8) + 3 * 4, (2 + 0 + 0) + 3 * 4, \
        3 * planner.PAYLOAD_VALUE_BYTES
    assert total == ids + names + extras + raws + maps
    nulls = t.withColumn("n", F.lit(None))   # NullType: nothing travels
    assert nulls.select(F.sum(planner.payload_bytes(nulls, "w")).alias("b")).first()["b"] == total
    q = spark.createDataFrame([(1, [0.0, 0.0])], "id int, v array<float>")
    assert planner.side_facts(q, "v", t, "w")[1].payload == total
    assert planner.side_facts(q, "v", t, "w")[0].payload == 4   # the query's int id
