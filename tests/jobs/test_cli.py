"""``nearest-join`` end to end, in process, on the test suite's local SparkSession.

Inputs are Parquet files written here with pyarrow; results are compared with the float64
reference kernel. The data are well separated (checked below), so the (query id, target id)
pairs must match exactly.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from jobs import runner
from jobs.cli import _cause, main
from jobs.output import StagedOutput
from jobs.spec import REDACTED, SUMMARY_FILE
from nearest_kernels import knn

from .test_spec import _bomb_override, _bomb_spec

QUERY_ROWS, TARGET_ROWS, DIM = 40, 400, 8
NAN_QUERY = 1017  # this query row has a NaN element: it can never have a candidate


def _vectors(values: list[list[float]] | np.ndarray, value_type=pa.float32()) -> pa.Array:
    return pa.array([list(map(float, v)) if value_type != pa.int32() else list(map(int, v))
                     for v in values], type=pa.list_(value_type))


def _write(directory: Path, columns: dict[str, pa.Array], files: int = 2) -> None:
    directory.mkdir(parents=True)
    table = pa.table(columns)
    bounds = np.linspace(0, table.num_rows, files + 1).astype(int)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        pq.write_table(table.slice(lo, hi - lo), directory / f"part-{i}.parquet")


class Job:
    """Test inputs on disk and a spec that reads them."""

    def __init__(self, base: Path):
        rng = np.random.default_rng(7)
        self.base = base
        self.query = rng.normal(size=(QUERY_ROWS, DIM)).astype(np.float32)
        self.query[NAN_QUERY - 1000, 3] = np.nan
        self.target = rng.normal(size=(TARGET_ROWS, DIM)).astype(np.float32)
        self.query_ids = np.arange(1000, 1000 + QUERY_ROWS)
        self.target_ids = np.arange(5000, 5000 + TARGET_ROWS)
        _write(base / "in" / "query", {
            "id": pa.array(self.query_ids, pa.int64()),
            "vec": _vectors(self.query),
        })
        _write(base / "in" / "target", {
            "id": pa.array(self.target_ids, pa.int64()),
            "label": pa.array([f"t{i}" for i in self.target_ids]),
            "vec": _vectors(self.target),
            "ivec": _vectors(np.round(self.target * 10), pa.int32()),
        })
        self.spec = base / "job.yaml"
        self.write_spec(self.document())

    def document(self) -> dict:
        return {
            "name": "test-job",
            "query": {"path": str(self.base / "in" / "query"), "vector": "vec"},
            "target": {"path": str(self.base / "in" / "target"), "vector": "vec",
                       "columns": ["id", "label"], "prefix": "t_"},
            "join": {"metric": "l2", "k": 5, "distance_col": "distance"},
            "output": {"path": str(self.base / "unused")},
        }

    def write_spec(self, document: dict) -> Path:
        self.spec.write_text(yaml.safe_dump(document))
        return self.spec

    def reference(self, k: int) -> dict[int, list[tuple[int, float]]]:
        """query id -> [(target id, distance)] nearest first, from the float64 oracle."""
        values, indices = knn(self.query.astype(np.float64), self.target.astype(np.float64),
                              k + 1, "l2", backend="reference")
        expected = {}
        for row, qid in enumerate(self.query_ids):
            found = indices[row] >= 0
            # Near-ties would make the pairs ambiguous; this data has none (checked, not assumed).
            if found.all():
                assert values[row, k] - values[row, k - 1] > 1e-4, f"near-tie for query {qid}"
            expected[int(qid)] = [(int(self.target_ids[i]), float(v))
                                  for i, v in zip(indices[row, :k], values[row, :k]) if i >= 0]
        return expected


@pytest.fixture
def job(tmp_path, spark):  # spark: the suite's session must be active for main() to use it
    return Job(tmp_path)


def _read(path: Path) -> dict[int, list[tuple[int | None, float | None]]]:
    rows = pq.read_table(path).to_pylist()
    result: dict[int, list] = {}
    for row in rows:
        result.setdefault(row["id"], []).append((row["t_id"], row["distance"]))
    return {q: sorted(v, key=lambda p: (p[1] is None, p[1])) for q, v in result.items()}


def _summary(path: Path) -> dict:
    return json.loads((path / SUMMARY_FILE).read_text())


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("join_type,plan_sets,plan", [
    ("inner", [], "broadcast"),
    ("inner", [], "local"),
    ("left_outer", ["join.broadcast_limit_bytes=0", "join.target_block_rows=64",
                    "join.query_block_rows=16"], "blocked"),
], ids=["inner-broadcast", "inner-local", "left_outer-blocked"])
def test_run_matches_the_float64_reference(job, capsys, request, join_type, plan_sets, plan):
    if plan == "local":
        request.getfixturevalue("local_plan")
    out = job.base / "out"
    sets = [f"output.path={out}", "join.k=3", f"join.join_type={join_type}",
            "spark.spark.hadoop.fs.s3a.secret.key=hunter2", *plan_sets]
    code = main(["run", str(job.spec), *[a for s in sets for a in ("--set", s)]])
    captured = capsys.readouterr()
    assert code == 0, captured.err

    # --set won over the spec: k=3 (the spec says 5), and the output went to `out`.
    got = _read(out)
    expected = job.reference(3)
    for qid, pairs in expected.items():
        if qid == NAN_QUERY:
            continue
        assert [t for t, _ in got[qid]] == [t for t, _ in pairs], f"query {qid}"
        # float32 search vs float64 oracle; compare squared distances (what the kernel ranks)
        np.testing.assert_allclose([d * d for _, d in got[qid]], [d * d for _, d in pairs],
                                   rtol=1e-4, atol=1e-5)
    if join_type == "inner":
        assert NAN_QUERY not in got
        assert sum(map(len, got.values())) == 3 * (QUERY_ROWS - 1)
    else:
        assert got[NAN_QUERY] == [(None, None)]
        assert sum(map(len, got.values())) == 3 * (QUERY_ROWS - 1) + 1
    # vectors are left out of the output unless output.include_vectors
    assert pq.read_schema(next(out.glob("part-*.parquet"))).names == ["id", "t_id", "t_label", "distance"]

    summary = _summary(out)
    assert summary["status"] == "succeeded"
    assert summary["input_rows"] == {"query": QUERY_ROWS, "target": TARGET_ROWS}
    assert summary["output_rows"] == sum(map(len, got.values()))
    assert summary["queries_without_candidates"] == 1
    assert summary["plan"]["plan"] == plan
    assert summary["plan"]["k"] == 3
    assert summary["backend"] == summary["plan"]["backend"]
    assert summary["pairs"] == QUERY_ROWS * TARGET_ROWS and summary["pairs_per_s"] > 0
    assert set(summary["phases_s"]) == {"read", "plan", "search+write"}
    assert summary["wall_time_s"] >= sum(summary["phases_s"].values()) - 1e-3
    # the executors' seconds per phase (inside search+write, summed over tasks and threads)
    assert {"decode", "search", "encode"} <= set(summary["executor_s"]) and summary["executor_s"]["search"] > 0
    assert (out / "_SUCCESS").is_file()
    # Secrets never reach the summary, the log or the screen.
    assert summary["spark_settings"]["spark.hadoop.fs.s3a.secret.key"] == REDACTED
    assert summary["spec"]["spark"]["spark.hadoop.fs.s3a.secret.key"] == REDACTED
    assert "hunter2" not in (out / SUMMARY_FILE).read_text()
    assert "hunter2" not in captured.out + captured.err
    # The log names every phase with its counts; the screen ends with the summary.
    for phase in ("read: done", "plan: done", "search+write: done", "commit: done"):
        assert phase in captured.err
    assert f"query rows {QUERY_ROWS}" in captured.err
    assert "queries without candidates 1" in captured.err
    assert "nearest-join: job 'test-job' succeeded" in captured.out
    assert ("  driver       pack " if plan == "local" else "  executors    pack ") in captured.out
    assert f"{summary['output_rows']:,} rows in" in captured.out


def test_rerun_gives_the_same_result_and_partitioning_works(job, spark, capsys):
    out = job.base / "out"
    sets = [f"output.path={out}", "output.mode=overwrite", "output.partition_by=[t_label]",
            "output.num_files=1", "query.where=id < 1010", "query.columns=[id]",
            "spark.spark.sql.shuffle.partitions=3"]
    argv = ["run", str(job.spec), *[a for s in sets for a in ("--set", s)]]
    partitions = spark.conf.get("spark.sql.shuffle.partitions")
    assert main(argv) == 0, capsys.readouterr().err
    # The job's settings applied to the running session only while the job ran.
    assert spark.conf.get("spark.sql.shuffle.partitions") == partitions != "3"
    first = pq.read_table(out).to_pandas().sort_values(["id", "distance"]).reset_index(drop=True)
    first_summary = _summary(out)
    assert main(argv) == 0, capsys.readouterr().err
    second = pq.read_table(out).to_pandas().sort_values(["id", "distance"]).reset_index(drop=True)
    assert first.equals(second)
    assert sorted(first["id"].unique()) == list(range(1000, 1010))  # the where filter applied
    assert len(first) == 10 * 5
    labels = {p.name for p in out.iterdir() if p.is_dir()}
    assert labels == {f"t_label={v}" for v in first["t_label"].astype(str)}
    assert _summary(out)["started_at"] >= first_summary["started_at"]
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".out.")] == [".out.nj-lock"]


@pytest.mark.parametrize("join_type, case", [("inner", "no query row"), ("inner", "no match within the cap"),
                                             ("left_outer", "some within the cap")])
def test_counts_come_from_the_write(job, capsys, join_type, case):
    """The summary's counts are observed as the rows are written (no second pass): an empty
    query side, a cap no target meets, and a cap some queries meet, both join types."""
    out = job.base / "out"
    distances = np.linalg.norm(job.query[:, None, :].astype(np.float64) - job.target[None, :, :], axis=2)
    nearest = np.sort(distances.min(axis=1))          # the NaN query's NaN last
    # Caps half-way between two distances, so that float32 rounding cannot move a pair.
    cap = {"no query row": None, "no match within the cap": float(nearest[0]) / 2,
           "some within the cap": float(nearest[QUERY_ROWS // 2] + nearest[QUERY_ROWS // 2 + 1]) / 2}[case]
    sets = [f"output.path={out}", "join.k=3", f"join.join_type={join_type}"]
    if case == "no query row":
        sets.append("query.where=id < 0")
    if cap is not None:
        sets.append(f"join.max_distance={cap!r}")
    vectors = join_type == "left_outer"   # and the vectors emitted with the other columns
    if vectors:
        sets.append("output.include_vectors=true")
    assert main(["run", str(job.spec), *[a for s in sets for a in ("--set", s)]]) == 0, capsys.readouterr().err
    summary = _summary(out)
    rows = pq.read_table(out).to_pylist()
    within = np.zeros(QUERY_ROWS, np.int64) if cap is None else np.minimum(3, (distances <= cap).sum(axis=1))
    query_rows = 0 if case == "no query row" else QUERY_ROWS
    unmatched = 0 if case == "no query row" else int((within == 0).sum())
    assert summary["input_rows"]["query"] == query_rows
    assert summary["queries_without_candidates"] == unmatched
    expected_rows = 0 if case == "no query row" else int(within.sum()) + (unmatched if join_type == "left_outer" else 0)
    assert summary["output_rows"] == len(rows) == expected_rows
    assert not any(name.startswith("_nearest_join") for name in pq.read_schema(
        next(out.glob("part-*.parquet"))).names) if rows else True
    if vectors:
        for row in rows:
            assert row["vec"] == pytest.approx(job.query[row["id"] - 1000].tolist(), nan_ok=True)
            if row["t_id"] is not None:
                assert row["t_vec"] == pytest.approx(job.target[row["t_id"] - 5000].tolist())
            else:
                assert row["t_vec"] is None


def test_explain_prints_the_plan_and_runs_nothing(job, capsys):
    out = job.base / "out"
    code = main(["explain", str(job.spec), "--set", f"output.path={out}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"query   {QUERY_ROWS} rows" in captured.out
    assert f"target  {TARGET_ROWS} rows" in captured.out
    assert "nearest_by_join plan: broadcast" in captured.out
    assert "k=5, mode=exact, join=inner, d=8" in captured.out
    assert not out.exists() and not list(job.base.glob(".out*"))

    assert main(["explain", str(job.spec), "--json", "--set", "join.broadcast_limit_bytes=0"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"] == "blocked"
    assert (plan["query_rows"], plan["target_rows"], plan["dimension"], plan["k"]) == (
        QUERY_ROWS, TARGET_ROWS, DIM, 5)
    assert plan["metric"] == "l2" and plan["join_type"] == "inner"


def test_error_if_exists_keeps_the_first_output(job, capsys):
    out = job.base / "out"
    argv = ["run", str(job.spec), "--set", f"output.path={out}"]
    assert main(argv) == 0, capsys.readouterr().err
    before = _files(out)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"output.path: '{out}' already exists and output.mode is 'error-if-exists'" in err
    assert "nothing was written" in err
    assert _files(out) == before


def _document_with(job, change):
    document = job.document()
    change(document)
    return document


BAD_SPECS = [
    ("missing key", lambda d: d["join"].pop("metric"), "join.metric: missing (required)"),
    ("unknown metric", lambda d: d["join"].update(metric="manhattan"),
     "join.metric: unknown metric 'manhattan'; expected one of"),
    ("missing input path", lambda d: d["query"].update(path="/nonexistent/query"),
     "query.path: does not exist: '/nonexistent/query'"),
    ("wrong vector type", lambda d: d["target"].update(vector="ivec"),
     "target.vector: target column 'ivec': expected array<float>, array<double> or a dense "
     "pyspark.ml VectorUDT, got array<int>"),
    ("missing vector column", lambda d: d["query"].update(vector="embedding"),
     "query.vector: column 'embedding' not found"),
    ("missing payload column", lambda d: d["target"].update(columns=["id", "colour"]),
     "target.columns: column(s) ['colour'] not found"),
    ("bad filter", lambda d: d["query"].update(where="nosuchcol > 1"), "query.where: "),
    ("duplicate output column", lambda d: d["target"].update(prefix=""),
     "target.columns: output column 'id' is also produced by query.columns"),
    # join.on is checked with the other columns, before the plan, among the user's columns
    # (not the runner's internal row id)
    ("missing key column", lambda d: d["join"].update(on="country"),
     "join.on: column 'country' not found in the query input ("),
    ("key column not selected", lambda d: d["join"].update(on=[["id", "id"]]) or d["target"].update(columns=["label"]),
     "join.on: column 'id' not found in the target input (target.columns); its columns: ['label', 'vec']"),
    ("bad join type", lambda d: d["join"].update(join_type="full_outer"),
     "join.join_type: [NEAREST_BY_JOIN.UNSUPPORTED_JOIN_TYPE] Invalid nearest-by join. "
     "Unsupported nearest-by join type full_outer"),
    ("bad backend", lambda d: d["join"].update(backend="tpu"),
     "join.backend: expected one of ['auto', 'cpu', 'gpu', 'reference'], got 'tpu'"),
]


@pytest.mark.parametrize("change,message", [b[1:] for b in BAD_SPECS], ids=[b[0] for b in BAD_SPECS])
def test_bad_spec_exits_2_and_writes_nothing(job, capsys, change, message):
    out = job.base / "out"
    document = _document_with(job, change)
    document["output"]["path"] = str(out)
    job.write_spec(document)
    before = sorted(p.name for p in job.base.iterdir())
    assert main(["run", str(job.spec)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "nothing was written" in err
    assert "_nearest_join_" not in err   # the runner's own columns are not the user's
    assert sorted(p.name for p in job.base.iterdir()) == before  # no output, staging or lock


def test_ragged_vector_exits_2_and_publishes_nothing(job, capsys):
    ragged = job.base / "in" / "ragged"
    _write(ragged, {"id": pa.array([1, 2, 3], pa.int64()),
                    "vec": _vectors([[0.0] * DIM, [1.0] * (DIM - 1), [2.0] * DIM])}, files=1)
    out = job.base / "out"
    code = main(["run", str(job.spec), "--set", f"output.path={out}",
                 "--set", f"target.path={ragged}", "--set", "target.columns=null"])
    err = capsys.readouterr().err
    assert code == 2, err
    # found by the planner's facts job, before the search: both lengths named
    assert "query.vector/target.vector: [VECTOR_DIMENSION_MISMATCH]" in err, err
    assert f"of dimension {DIM - 1} and of dimension {DIM}" in err, err
    assert not out.exists() and not [p for p in job.base.iterdir() if p.name.startswith(".out.nj-staging")]


def test_a_float64_element_too_small_for_the_kernels_exits_2_and_publishes_nothing(job, capsys):
    # Found where an executor decodes the vectors (not by the facts job): the failed Spark job
    # reads as the spec key, the column and the value.
    tiny = job.base / "in" / "tiny"
    _write(tiny, {"id": pa.array([1, 2, 3], pa.int64()),
                  "vec": _vectors([[0.5] * DIM, [1e-300] + [1.0] * (DIM - 1), [2.0] * DIM], pa.float64())}, files=1)
    out = job.base / "out"
    code = main(["run", str(job.spec), "--set", f"output.path={out}",
                 "--set", f"target.path={tiny}", "--set", "target.columns=null"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("query.vector/target.vector: [VECTOR_ELEMENT_OUT_OF_RANGE] column `t_vec` holds the float64 element "
            "1e-300: expected 0 or a magnitude of at least 2^-960") in err, err
    assert not out.exists() and not [p for p in job.base.iterdir() if p.name.startswith(".out.nj-staging")]


def _tree(base: Path) -> list[str]:
    """Every path under ``base``, hidden ones included (staging, lock files)."""
    return sorted(str(p.relative_to(base)) for p in base.rglob("*"))


@pytest.mark.parametrize("where", ["file", "--set"])
def test_alias_bomb_exits_2_at_once(tmp_path, capsys, where):
    spec = _bomb_spec(tmp_path)
    argv = ["run", str(spec)]
    if where == "--set":
        spec.write_text(yaml.safe_dump({"query": {"path": "q", "vector": "v"},
                                        "target": {"path": "t", "vector": "v"},
                                        "join": {"metric": "l2"}, "output": {"path": "o"}}))
        argv += ["--set", _bomb_override()]
    before = _tree(tmp_path)
    start = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - start < 2.0  # was 88 s, 3.4 GB and a MemoryError
    err = capsys.readouterr().err
    assert "nearest-join: error: join.k: the sequence at line" in err
    assert "expands to more than 10,000,000 values and characters" in err
    assert "nothing was written" in err and len(err) < 1000
    assert _tree(tmp_path) == before


def test_output_through_a_symlink_into_an_input_exits_2(job, capsys):
    link = job.base / "qlink"
    link.symlink_to(job.base / "in" / "query", target_is_directory=True)
    before = _tree(job.base)
    assert main(["run", str(job.spec), "--set", f"output.path={link / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert (f"output.path: '{link / 'out'}' (really '{job.base / 'in' / 'query' / 'out'}') "
            f"overlaps the query input '{job.base / 'in' / 'query'}'") in err
    assert _tree(job.base) == before  # nothing inside the input, no lock beside it


def _bad_input(job, kind: str) -> tuple[Path, Path, Path]:
    """A target directory of one good file and one odd file: (directory, good, odd)."""
    directory = job.base / "in" / "bad"
    _write(directory, {"id": pa.array([1, 2], pa.int64()),
                       "vec": _vectors([[0.0] * DIM, [1.0] * DIM])}, files=1)
    good, odd = directory / "part-0.parquet", directory / "part-1.parquet"
    if kind == "not parquet":
        odd.write_text("id,vec\n1,0.5\n")
    elif kind == "column type":
        pq.write_table(pa.table({"id": pa.array(["a", "b"]),
                                 "vec": _vectors([[2.0] * DIM, [3.0] * DIM])}), odd)
    else:  # vector type
        pq.write_table(pa.table({"id": pa.array([3, 4], pa.int64()),
                                 "vec": _vectors([[2.0] * DIM, [3.0] * DIM], pa.float64())}), odd)
    (directory / "_SUCCESS").touch()  # skipped, as Spark skips it
    (directory / "part-2.parquet").touch()  # empty: skipped, as Spark skips it
    return directory, good, odd


@pytest.mark.parametrize("kind,message", [
    ("not parquet", "target.path: '{odd}' is not a readable Parquet file (Parquet magic bytes "
                    "not found in footer"),
    ("column type", "target.path: column 'id' is string in '{odd}' but bigint in '{good}'; all "
                    "files of one input need the same column types"),
    ("vector type", "target.path: column 'vec' is array<double> in '{odd}' but array<float> in "
                    "'{good}'"),
], ids=["not parquet", "column type", "vector type"])
def test_bad_input_file_exits_2_naming_it(job, capsys, monkeypatch, kind, message):
    directory, good, odd = _bad_input(job, kind)
    read_by_spark = []
    real_read_side = runner._read_side

    def read_side(spark, side, schema=None):
        read_by_spark.append(side.side)
        return real_read_side(spark, side, schema)

    monkeypatch.setattr(runner, "_read_side", read_side)
    out = job.base / "new" / "out"  # its parent too is made for the lock, then taken back
    before = _tree(job.base)
    code = main(["run", str(job.spec), "--set", f"target.path={directory}",
                 "--set", "target.columns=null", "--set", f"output.path={out}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(odd=odd, good=good) in err
    assert "nothing was written" in err
    assert read_by_spark == []  # found before Spark read either side
    assert _tree(job.base) == before


@pytest.mark.parametrize("plan", ["executors", "local"])
@pytest.mark.parametrize("kind", ["not parquet", "column type"])
def test_spark_read_failures_are_bad_input_too(job, capsys, monkeypatch, request, kind, plan):
    # What the footer check cannot see (s3a:// inputs, a file changed after the check) fails
    # inside Spark; its error condition still makes it exit 2, naming the file (the local
    # plan's collect wraps the failure in an exception of its own).
    if plan == "local":
        request.getfixturevalue("local_plan")
    monkeypatch.setattr(runner, "check_parquet_input", lambda side: None)
    directory, _, odd = _bad_input(job, kind)
    out = job.base / "out"
    before = _tree(job.base)
    code = main(["run", str(job.spec), "--set", f"target.path={directory}",
                 "--set", "target.columns=null", "--set", f"output.path={out}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "nearest-join: error: target.path: Spark cannot read file:" in err
    assert f"{odd}: [FAILED_READ_FILE." in err
    assert _tree(job.base) == before


@pytest.mark.parametrize("command", ["run", "explain"])
def test_output_under_a_file_exits_2_before_reading(job, capsys, command):
    (job.base / "afile").write_text("x")
    out = job.base / "afile" / "out"
    before = _tree(job.base)
    assert main([command, str(job.spec), "--set", f"output.path={out}"]) == 2
    err = capsys.readouterr().err
    assert f"output.path: cannot create '{out}': '{job.base / 'afile'}' is not a directory" in err
    assert "read: started" not in err
    assert _tree(job.base) == before


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"),
                    reason="needs Linux sysfs, where no user, root included, can make a directory")
def test_output_on_an_unwritable_filesystem_exits_2_before_reading(job, capsys):
    # Permission bits say /sys is writable to root; only trying tells. The run tries when
    # it takes the output's lock, before it reads anything.
    out = Path("/sys") / f"nearest-join-test-{uuid.uuid4().hex[:8]}" / "out"
    start = time.perf_counter()
    assert main(["run", str(job.spec), "--set", f"output.path={out}"]) == 2
    assert time.perf_counter() - start < 5.0
    err = capsys.readouterr().err
    assert f"nearest-join: error: output.path: cannot write '{out}': " in err
    assert "read: started" not in err
    assert not out.parent.exists()


def test_a_busy_output_fails_before_reading_the_inputs(job, capsys):
    out = job.base / "out"
    with StagedOutput(out):  # another run holds the lock
        before = _tree(job.base)
        start = time.perf_counter()
        code = main(["run", str(job.spec), "--set", f"output.path={out}"])
        elapsed = time.perf_counter() - start
        assert _tree(job.base) == before  # the holder's lock file is still there
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"another nearest-join run is writing {out}" in err
    assert "read: started" not in err and elapsed < 5.0  # was found after the search


def test_a_run_that_dies_while_writing_leaves_the_old_output(job, capsys, monkeypatch):
    out = job.base / "out"
    argv = ["run", str(job.spec), "--set", f"output.path={out}", "--set", "output.mode=overwrite"]
    assert main(argv) == 0, capsys.readouterr().err
    before = _files(out)

    real_write = runner.write_parquet

    def write_then_die(df, path, partition_by, num_files):
        real_write(df, path, partition_by, num_files)  # part files are in staging now...
        assert list(Path(path).glob("part-*.parquet"))
        raise OSError(28, "No space left on device (simulated)")  # ...and the run dies

    monkeypatch.setattr(runner, "write_parquet", write_then_die)
    assert main([*argv, "--set", "join.k=2"]) == 1
    err = capsys.readouterr().err
    assert "nearest-join: failed: OSError" in err
    assert f"the previous output at {out}, if any, is untouched" in err
    assert _files(out) == before  # byte for byte: same part files, same summary
    assert sorted(p.name for p in job.base.iterdir() if p.name.startswith(".out")) == [".out.nj-lock"]


def test_demo_runs_and_reuses_its_data(tmp_path, spark, capsys):
    data, out = tmp_path / "data", tmp_path / "out"
    argv = ["demo", "--data-dir", str(data), "--query-rows", "30", "--target-rows", "300",
            "--dimension", "16", "--set", f"output.path={out}"]
    assert main(argv) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    summary = _summary(out)
    assert summary["input_rows"] == {"query": 30, "target": 300}
    assert summary["output_rows"] == 30 * 5 and summary["queries_without_candidates"] == 0
    assert "nearest-join: job 'demo' succeeded" in captured.out
    assert "M pairs/s" in captured.out
    assert "first 10 output rows" in captured.out
    table = pq.read_table(out).to_pandas()
    assert list(table.columns) == ["id", "name", "target_id", "target_name", "distance"]
    # The demo result is right too: query 0's neighbours, from the generated vectors.
    query = np.stack(pq.read_table(data / "query").to_pandas().sort_values("id")["vec"])
    target = np.stack(pq.read_table(data / "target").to_pandas().sort_values("id")["vec"])
    _, indices = knn(query[:1].astype(np.float64), target.astype(np.float64), 5, "l2",
                     backend="reference")
    got = table[table["id"] == 0].sort_values("distance")["target_id"].tolist()
    assert got == indices[0].tolist()

    stamp = (data / "_demo_manifest.json").stat().st_mtime_ns
    assert main(argv) == 0
    assert (data / "_demo_manifest.json").stat().st_mtime_ns == stamp  # data reused, not rebuilt


def test_usage_errors(capsys):
    assert main([]) == 2
    assert main(["run"]) == 2
    assert "usage: nearest-join" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "explain" in capsys.readouterr().out


def test_failure_line_names_the_innermost_error():
    worker = RuntimeError("An exception was thrown from the Python worker:\nTraceback (most recent "
                          "call last):\n  File \"worker.py\", line 1\nModuleNotFoundError: No "
                          "module named 'udfs'\n\tat org.apache.spark.Foo(Foo.scala:1)")
    assert _cause(worker) == "RuntimeError: ModuleNotFoundError: No module named 'udfs'"
    assert _cause(OSError("disk full")) == "OSError: disk full"


def test_column_names_with_dots_and_backticks(job, capsys):
    """Input columns named ``emb.v`` and ``la`bel`` are read, selected, prefixed and joined
    as the columns they name (not as struct fields, not as a syntax error)."""
    odd = job.base / "in" / "odd"
    _write(odd, {"id": pa.array(job.target_ids, pa.int64()),
                 "la`bel": pa.array([f"t{i}" for i in job.target_ids]),
                 "emb.v": _vectors(job.target)}, files=1)
    document = job.document()
    document["target"].update(path=str(odd), vector="emb.v", columns=["id", "la`bel"])
    document["output"]["path"] = str(job.base / "out")
    job.write_spec(document)
    assert main(["run", str(job.spec)]) == 0, capsys.readouterr().err
    table = pq.read_table(job.base / "out")
    assert {"t_la`bel", "t_id"} <= set(table.column_names)
    found = _read(job.base / "out")
    for qid, pairs in job.reference(5).items():
        assert [t for t, _ in found.get(qid, [])] == [t for t, _ in pairs], qid


def test_overwrite_partitions_of_a_path_output(job, capsys):
    """Two nights into one partitioned directory (``mode: overwrite_partitions``,
    ``partition_values: {run_date: ${run_date}}``): night 2 adds its partition and leaves night
    1's byte for byte; a re-run of night 2 with k=2 replaces only its own."""
    out = job.base / "out"
    document = job.document()
    document["output"] = {"path": str(out), "mode": "overwrite_partitions", "partition_by": ["run_date"],
                          "partition_values": {"run_date": "${run_date}"}}
    job.write_spec(document)
    for night in ("2026-12-01", "2026-12-02"):
        assert main(["run", str(job.spec), "--param", f"run_date={night}"]) == 0, capsys.readouterr().err
    first = _files(out / "run_date=2026-12-01")
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(("_", "."))) == [
        "run_date=2026-12-01", "run_date=2026-12-02"]
    assert _summary(out)["output"]["partitions"] == ["run_date=2026-12-02"]
    want = {q: pairs for q, pairs in job.reference(5).items() if pairs}
    assert {q: [t for t, _ in v] for q, v in _read(out / "run_date=2026-12-02").items()} == {
        q: [t for t, _ in v] for q, v in want.items()}
    assert main(["run", str(job.spec), "--param", "run_date=2026-12-02", "--set", "join.k=2"]) == 0, \
        capsys.readouterr().err
    assert _files(out / "run_date=2026-12-01") == first
    assert {len(v) for v in _read(out / "run_date=2026-12-02").values()} == {2}
    assert not [p for p in out.parent.iterdir() if ".nj-staging-" in p.name or ".nj-previous-" in p.name]
