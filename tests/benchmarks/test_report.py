"""benchmarks/report.py renders RESULTS.md from the benchmark records; the committed file is its output."""
from __future__ import annotations

import json

import pytest

from benchmarks import report
from benchmarks._record import Recorder
from benchmarks.report import RESULTS_DIR, read_records

MACHINE = {"cpu": "Test CPU", "cores": 2, "memory_gib": 8,
           "blas": {"OPENBLAS_CORETYPE": "Haswell", "libraries": ["libtest_openblas 1.0 Haswell"]}}


def recorder(tmp_path, benchmark, date, **kw):
    return Recorder(benchmark, results_dir=tmp_path, date=date, commit=kw.pop("commit", "abc1234"),
                    command=kw.pop("command", f"python benchmarks/{benchmark}.py"), machine=MACHINE, **kw)


@pytest.fixture
def fixture_dir(tmp_path):
    spark = recorder(tmp_path, "spark_join", "2026-01-02T03:04:05+00:00")
    spark.add("operator", engine="Spark nearestByJoin", nq=10, nt=100, d=4, k=3, seconds=8.0, pairs_per_s=125.0)
    spark.add("operator", engine="nearest_by_join", nq=10, nt=100, d=4, k=3, seconds=2.0, pairs_per_s=500.0,
              identical_rows=True, plan="local", remark="A remark of this run.")
    gpu = recorder(tmp_path, "gpu_kernel", "2026-03-01T00:00:00+00:00", gpu=True)
    for procs, share in ((1, 0.5), (2, 0.75)):
        gpu.add("arrow_concurrent", plan="broadcast", query_blocks=2, target_blocks=1, precision="bf16", k=10,
                threads_per_task=8, processes=procs, share_of_kernel=share)
    other = recorder(tmp_path, "new_bench", "2025-06-01")
    other.add("whatever", size=3, seconds=0.123456)
    return tmp_path


def section(text: str, title_start: str) -> str:
    parts = text.split("\n## ")
    return next(p for p in parts if p.startswith(title_start))


def test_tables_render_with_provenance_and_peer_ratios(fixture_dir):
    text = report.render(fixture_dir)
    spark = section(text, "Spark operator")
    assert "2026-01-02 03:04 UTC" in spark
    assert "; commit `abc1234`, command `python benchmarks/spark_join.py`; parameters:" in spark
    assert "`OPENBLAS_CORETYPE=Haswell`; BLAS kernels: libtest_openblas 1.0 Haswell" in spark
    # pairs/s against the Spark row of the same run: 500 / 125
    assert "| nearest_by_join | local | 10 x 100 | 4 | 2.000 | 5.00e2 | 4.00x | yes |" in spark
    assert "| Spark nearestByJoin | - | 10 x 100 | 4 | 8.000 | 1.25e2 | 1.00x | - |" in spark
    assert "A remark of this run." in spark
    assert "; parameters: k = 3" in spark
    # pivoted: one row per shape, the two-task share over the one-task share
    concurrent = section(text, "GPU Arrow path, tasks sharing")
    assert "| broadcast | 2 x 1 | 10 | 8 | 50% | 75% | 1.50x | - | - | - |" in concurrent
    # a benchmark without a spec still renders every field
    generic = section(text, "new_bench: whatever")
    assert "| size | seconds |" in generic and "| 3 | 0.1235 |" in generic
    # newest first
    assert text.index("GPU Arrow path") < text.index("Spark operator") < text.index("new_bench")


def test_a_run_replaces_only_its_own_tables(fixture_dir):
    again = recorder(fixture_dir, "spark_join", "2026-02-01T00:00:00+00:00", commit="def5678")
    again.add("operator", engine="nearest_by_join", nq=1, nt=1, d=1, k=1, seconds=1.0, pairs_per_s=1.0)
    again.add("operator", engine="nearest_by_join", nq=2, nt=2, d=1, k=1, seconds=1.0, pairs_per_s=4.0)
    again.add("other", x=1)
    records = read_records(fixture_dir / "spark_join.jsonl")
    assert [(r["table"], r["commit"], r.get("nq")) for r in records] == [
        ("operator", "def5678", 1), ("operator", "def5678", 2), ("other", "def5678", None)]
    assert len(read_records(fixture_dir / "gpu_kernel.jsonl")) == 2


def test_reserved_fields_are_refused(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        recorder(tmp_path, "x", "2026-01-01").add("t", commit="mine")


def test_records_carry_provenance(tmp_path):
    record = Recorder("probe", results_dir=tmp_path, gpu=False).add("t", value=1)
    assert set(record) >= {"date", "machine", "commit", "command", "run"}
    assert record["machine"]["cores"] >= 1 and "OPENBLAS_CORETYPE" in record["machine"]["blas"]
    assert json.loads((tmp_path / "probe.jsonl").read_text())["value"] == 1


def test_results_md_is_the_report_of_the_committed_records():
    assert sorted(RESULTS_DIR.glob("*.jsonl")), "no benchmark records"
    expected = report.render(RESULTS_DIR)
    assert report.RESULTS_MD.read_text() == expected, "benchmarks/RESULTS.md is stale: run make bench-report"
    # One current table per benchmark, about 12 lines each: a longer file means history crept in.
    tables = expected.count("\n## ")
    assert expected.count("\n") < 10 + 13 * tables, (expected.count("\n"), tables)
