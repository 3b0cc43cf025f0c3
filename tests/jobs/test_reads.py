"""A batch job reads its inputs once for facts: one facts job serves the plan, the explanation
and the summary (issue 21: it used to count each side, explain, then plan again)."""
import json

import nearest_join.join
from jobs import runner
from jobs.spec import SUMMARY_FILE, load_spec
from nearest_join.planner import side_facts

from .test_cli import QUERY_ROWS, TARGET_ROWS, job  # noqa: F401 - job is a fixture


def _counting_side_facts(monkeypatch) -> list:
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return side_facts(*args, **kwargs)

    monkeypatch.setattr(nearest_join.join, "side_facts", counted)
    return calls


def _spark_jobs(spark, group: str, fn):
    """(fn's result, the Spark jobs it ran), through a job group of this thread."""
    sc = spark.sparkContext
    sc.setJobGroup(group, group)
    try:
        result = fn()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    return result, sorted(sc.statusTracker().getJobIdsForGroup(group))


def test_prepare_runs_at_most_one_facts_job(job, spark, monkeypatch):  # noqa: F811
    calls = _counting_side_facts(monkeypatch)
    spec = load_spec(job.spec, [f"output.path={job.base / 'out'}"])
    prepared, prepare_jobs = _spark_jobs(spark, "nj-test-prepare", lambda: runner.prepare(spec, spark))
    # Inputs that are plain Parquet scans: the facts are counted from their files (the footers,
    # pyarrow), and reading, checking and planning run no Spark job at all.
    assert calls == [] and prepare_jobs == []
    assert (prepared.query_rows, prepared.target_rows) == (QUERY_ROWS, TARGET_ROWS)
    # Inputs Spark must read (a filter that keeps every row): one facts job, no more: no job to
    # open the inputs (their footers give Spark the schema), no counts, no second facts job.
    read = runner._read_side
    monkeypatch.setattr(runner, "_read_side",
                        lambda spark, side, schema=None: read(spark, side, schema).where("spark_partition_id() >= 0"))
    _, filtered_jobs = _spark_jobs(spark, "nj-test-filtered", lambda: runner.prepare(spec, spark))
    assert len(calls) == 1
    _, facts_jobs = _spark_jobs(spark, "nj-test-facts", lambda: side_facts(*calls[0]))
    assert len(facts_jobs) >= 1
    assert len(filtered_jobs) == len(facts_jobs), (filtered_jobs, facts_jobs)
    # Without the footers' schema, opening the inputs is a Spark job each side.
    _, open_jobs = _spark_jobs(spark, "nj-test-open", lambda: [
        runner._read_side(spark, side) for side in (spec.query, spec.target)])
    assert len(open_jobs) >= 1


def test_a_run_plans_once_and_its_summary_uses_those_facts(job, spark, monkeypatch):  # noqa: F811
    calls = _counting_side_facts(monkeypatch)
    out = job.base / "out"
    spec = load_spec(job.spec, [f"output.path={out}"])
    summary = runner.run_job(spec, spark)
    assert calls == []   # counted from the Parquet inputs' files (test above)
    assert summary["input_rows"] == {"query": QUERY_ROWS, "target": TARGET_ROWS}
    written = json.loads((out / SUMMARY_FILE).read_text())
    assert written["plan"]["query_rows"] == QUERY_ROWS and written["plan"]["target_rows"] == TARGET_ROWS
    assert summary["output_rows"] == (QUERY_ROWS - 1) * spec.join.options.num_results  # one NaN query
    # the default precision, and what it runs on each kind of executor
    assert summary["precision"] == written["plan"]["precision"] == "auto"
    assert summary["precision_runs"].startswith("auto: bf16 on GPUs of compute capability >= 8.0, fp32 on older")
    # this process's kernel warm-up: its seconds, of which compiling (0 where numba's cache had them)
    assert 0 <= written["kernel_compile_s"] <= written["kernel_warm_up_s"]
    assert f"compiling {written['kernel_compile_s']:.2f} s" in runner.format_summary(written)
