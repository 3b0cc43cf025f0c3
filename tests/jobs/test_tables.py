"""Catalog tables (issue 44): a nightly job reads tables and writes one partition of a table
per night, with the path output's promises (atomic, locked, nothing written on bad input).

The suite's Spark session has no Hive catalog (and must keep none), so the nights run in
subprocesses with the embedded catalog a spec that uses a table gets (a Derby metastore and a
warehouse under the working directory, here the test's own): the nights through the CLI
(``python -m jobs``), the rest through ``jobs.cli.main`` in one Hive-enabled process per step,
so that the whole story costs four JVM starts. Embedded Derby admits one JVM at a time, so
the steps run one after another.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.orc as orc
import pyarrow.parquet as pq
import yaml

from jobs.cli import main
from nearest_kernels import knn

from .killing import kill_when
from .test_cli import _files, _read, job  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parents[2]
NIGHT_1, NIGHT_2 = "2026-12-03", "2026-12-04"
DIM = 8

# One Hive-enabled session (the spec's settings, as the CLI builds it), then steps:
# ["sql", text], ["rows", table], ["partitions", table], ["main", argv].
_STEPS = r"""
import contextlib, io, json, sys
from jobs.cli import main
from jobs.runner import spark_session
from jobs.spec import load_spec
from jobs.tables import list_partitions
spec, steps = sys.argv[1], json.loads(sys.argv[2])
results = []
settings = load_spec(spec, [], ["run_date=2000-01-01"]).spark_settings
with spark_session(settings, app_name="nearest-join tables test", show_progress=False) as spark:
    spark.sparkContext.setLogLevel("ERROR")
    for kind, arg in steps:
        if kind == "sql":
            results.append([list(row) for row in spark.sql(arg).collect()])
        elif kind == "rows":
            results.append(sorted(([r.id, r.t_id, r.run_date] for r in spark.table(arg).collect()), key=str)
                           if spark.catalog.tableExists(arg) else None)
        elif kind == "partitions":
            results.append({"/".join(k): v for k, v in list_partitions(spark, arg, ["run_date"]).items()})
        else:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(arg)
            results.append({"code": code, "out": out.getvalue(), "err": err.getvalue()})
print("RESULTS " + json.dumps(results))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYSPARK_PYTHON": sys.executable}


def _in_catalog(base: Path, spec: Path, steps: list) -> list:
    done = subprocess.run([sys.executable, "-c", _STEPS, str(spec), json.dumps(steps)], cwd=base, env=_env(),
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(lines[-1][len("RESULTS "):])


def _vectors(values: np.ndarray) -> pa.Array:
    return pa.array([list(map(float, v)) for v in values], type=pa.list_(pa.float32()))


class Nights:
    """Input tables src.query / src.target over Parquet directories, one day's rows per file."""

    def __init__(self, base: Path):
        self.base, self.rows = base, {}
        for side in ("query", "target"):
            (base / "in" / side).mkdir(parents=True)

    def add(self, day: str, seed: int, query_ids: np.ndarray, target_ids: np.ndarray) -> None:
        rng = np.random.default_rng(seed)
        for side, ids in (("query", query_ids), ("target", target_ids)):
            vectors = rng.normal(size=(len(ids), DIM)).astype(np.float32)
            self.rows[day, side] = (ids, vectors)
            pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "day": pa.array([day] * len(ids)),
                                     "vec": _vectors(vectors)}), self.base / "in" / side / f"{day}.parquet")

    def expected(self, day: str, k: int) -> list[list]:
        """[query id, target id, day] of the float64 oracle's k nearest, sorted as _STEPS sorts."""
        (query_ids, query), (target_ids, target) = self.rows[day, "query"], self.rows[day, "target"]
        values, indices = knn(query.astype(np.float64), target.astype(np.float64), k + 1, "l2", backend="reference")
        assert (values[:, k] - values[:, k - 1] > 1e-4).all(), "near-ties would make the pairs ambiguous"
        return sorted(([int(q), int(target_ids[i]), day] for q, row in zip(query_ids, indices[:, :k]) for i in row),
                      key=str)


def _night_process(base: Path, spec: Path, day: str) -> subprocess.Popen:
    """``nearest-join run`` of one night; its output goes to files (a pipe nobody reads while
    the test waits would fill and stop it)."""
    with open(base / f"night-{day}.out", "w") as out, open(base / f"night-{day}.err", "w") as err:
        # Its own process group: a kill takes the job's Spark JVM with it, as a scheduler's does.
        return subprocess.Popen([sys.executable, "-m", "jobs", "run", str(spec), "--param", f"run_date={day}"],
                                cwd=base, env=_env(), stdout=out, stderr=err, start_new_session=True)


def _output(base: Path, day: str) -> tuple[str, str]:
    return tuple((base / f"night-{day}.{kind}").read_text() for kind in ("out", "err"))


def test_two_nights_into_a_partitioned_table(tmp_path):
    base = tmp_path
    nights = Nights(base)
    nights.add(NIGHT_1, 1, np.arange(30), np.arange(5000, 5300))
    # an input table without the vector column
    (base / "in" / "novec").mkdir()
    pq.write_table(pa.table({"id": pa.array([1], pa.int64()), "emb": _vectors(np.zeros((1, DIM)))}),
                   base / "in" / "novec" / "part-0.parquet")
    document = yaml.safe_load((ROOT / "conf" / "tables.yaml").read_text())
    document.update(name="nightly", spark={"spark.sql.shuffle.partitions": 2, "spark.ui.enabled": False})
    document["query"] = {"table": "src.query", "vector": "vec", "where": "day = '${run_date}'", "columns": ["id"]}
    document["target"] = {"table": "src.target", "vector": "vec", "where": "day = '${run_date}'", "columns": ["id"],
                          "prefix": "t_"}
    document["join"]["k"] = 3
    document["output"]["table"] = "nj.similar"
    spec = base / "nightly.yaml"
    spec.write_text(yaml.safe_dump(document))
    table_dir = base / "data" / "warehouse" / "nj.db" / "similar"
    run = ["run", str(spec), "--param", f"run_date={NIGHT_1}"]

    # Input tables; then bad input exits 2 and writes nothing (the table does not exist yet).
    bad = [(["--set", "query.table=src.nope"], "query.table: table 'src.nope' not found in the catalog"),
           (["--set", "target.table=src.novec"], "target.vector: column 'vec' not found in table src.novec"),
           (["--set", "output.partition_by=[run_date,day]"], "output.partition_by: column 'day' is not in the output"),
           (["--set", "output.table=src.novec"],
            "output.table: table 'src.novec' exists and was not created by nearest-join")]
    # Night 1, in the same session (the CLI's own session start is night 2's, killed, and the
    # re-run's): the table is created with the night's partition.
    results = _in_catalog(base, spec, [
        ["sql", "CREATE DATABASE src"],
        *[["sql", f"CREATE TABLE src.{name} USING parquet LOCATION '{base / 'in' / name}'"]
          for name in ("query", "target", "novec")],
        *[["main", run + sets] for sets, _ in bad],
        ["rows", "nj.similar"], ["main", run]])
    for result, (sets, message) in zip(results[4:], bad):
        assert result["code"] == 2 and message in result["err"], (sets, result["err"][-2000:])
        assert "nothing was written" in result["err"]
    assert results[-2] is None
    night_1 = results[-1]
    assert night_1["code"] == 0, night_1["err"][-5000:]
    out = night_1["out"]
    assert "table nj.similar (added run_date=2026-12-03)" in out and "parameters   run_date=2026-12-03" in out
    (run_1,) = table_dir.glob("nj-run-*")
    summary = json.loads((run_1 / "_nearest_join_summary.json").read_text())
    assert summary["parameters"] == {"run_date": NIGHT_1}
    assert summary["inputs"] == {"query": ["table src.query"], "target": ["table src.target"]}
    assert summary["output"]["table_created"] is True and summary["output_rows"] == 30 * 3
    partition_1 = run_1 / f"run_date={NIGHT_1}"
    assert summary["output"]["partitions"] == [
        {"partition": {"run_date": NIGHT_1}, "location": str(partition_1), "replaced": None}]
    night_1_files = _files(partition_1)
    assert any(name.endswith(".parquet") for name in night_1_files)

    # Night 2 with changed inputs (new queries, the targets' vectors changed), killed -9 while
    # it writes: night 1 stays as it was, and only the killed run's staging directory is left.
    nights.add(NIGHT_2, 2, np.arange(200, 225), np.arange(5000, 5300))
    kill_when(_night_process(base, spec, NIGHT_2),
              lambda: bool(list(table_dir.parent.glob(".similar.nj-staging-*/_temporary"))),
              "night 2's write", output=lambda: _output(base, NIGHT_2)[1][-3000:])
    assert _files(partition_1) == night_1_files
    assert len(list(table_dir.parent.glob(".similar.nj-staging-*"))) == 1

    # Night 1 is readable; explain shows the tables, partitions and parameters; the re-run
    # completes night 2 (and removes what the killed one left); a third run of night 2 (k=2)
    # replaces its partition; a result whose columns changed exits 2.
    run_2 = ["run", str(spec), "--param", f"run_date={NIGHT_2}"]
    (rows_1, explained, as_json, rerun, partitions_2, rows_2, replace, changed, partitions, rows, added,
     days, final) = _in_catalog(base, spec, [
        ["rows", "nj.similar"],
        ["main", ["explain", str(spec), "--param", f"run_date={NIGHT_2}"]],
        ["main", ["explain", str(spec), "--json", "--param", f"run_date={NIGHT_2}"]],
        ["main", run_2], ["partitions", "nj.similar"], ["rows", "nj.similar"],
        ["main", run_2 + ["--set", "join.k=2"]],
        ["main", run_2 + ["--set", "query.columns=[id,day]"]],
        ["partitions", "nj.similar"], ["rows", "nj.similar"],
        # ... unless the spec allows new columns: older partitions read them as null
        ["main", run_2 + ["--set", "query.columns=[id,day]", "--set", "output.schema_change=add_columns"]],
        ["sql", "SELECT run_date, count(day) FROM nj.similar GROUP BY run_date ORDER BY run_date"],
        ["partitions", "nj.similar"]])
    assert rows_1 == nights.expected(NIGHT_1, 3)
    assert explained["code"] == 0, explained["err"][-3000:]
    for line in ("  params  run_date=2026-12-04",
                 "  query   25 rows <- table src.query where day = '2026-12-04'",
                 "  target  300 rows <- table src.target where day = '2026-12-04'",
                 f"  output  table nj.similar at {table_dir} (exists, 1 partition(s)), partitioned by ['run_date'] "
                 "(mode overwrite_partitions; this run's partition values: run_date=2026-12-04)",
                 f"      run_date=2026-12-03 -> file:{partition_1}"):
        assert line in explained["out"].splitlines(), explained["out"]
    job = json.loads(as_json["out"])["job"]
    assert job["parameters"] == {"run_date": NIGHT_2} and job["partition_values"] == {"run_date": NIGHT_2}
    assert job["inputs"] == {"query": "table src.query", "target": "table src.target"}
    assert job["output"][1] == f"    run_date=2026-12-03 -> file:{partition_1}"
    assert rerun["code"] == 0, rerun["err"][-3000:]
    assert not list(table_dir.parent.glob(".similar.nj-staging-*"))
    assert partitions_2[NIGHT_1] == f"file:{partition_1}"
    assert rows_2 == sorted(nights.expected(NIGHT_1, 3) + nights.expected(NIGHT_2, 3), key=str)
    assert replace["code"] == 0 and "(replaced run_date=2026-12-04)" in replace["out"], replace["err"][-3000:]
    assert changed["code"] == 2 and ("output.table: the result's columns differ from table 'nj.similar''s: "
                                     "new ['day string']; set output.schema_change: add_columns") in changed["err"]
    assert rows == sorted(nights.expected(NIGHT_1, 3) + nights.expected(NIGHT_2, 2), key=str)
    assert partitions[NIGHT_1] == f"file:{partition_1}" and partitions[NIGHT_2] != partitions_2[NIGHT_2]
    assert added["code"] == 0, added["err"][-3000:]
    assert days == [[NIGHT_1, 0], [NIGHT_2, 25 * 3]]
    # Night 1's files byte for byte; the replaced partitions' files are gone, and so is every
    # directory no partition points at.
    assert final[NIGHT_1] == f"file:{partition_1}" and _files(partition_1) == night_1_files
    assert sorted(p.name for p in table_dir.iterdir()) == sorted(
        Path(location[len("file:"):]).parent.name for location in final.values())
    # beside it, only the lock file (no staging directory)
    assert [p.name for p in table_dir.parent.iterdir() if p.name.startswith(".similar")] == [".similar.nj-lock"]


def test_orc_and_json_inputs(job, capsys):
    """``format: orc`` and ``format: json`` path inputs give the join of the same rows."""
    ids, vectors = job.query_ids, job.query
    (job.base / "orc").mkdir()
    orc.write_table(pa.table({"id": pa.array(ids, pa.int64()), "vec": _vectors(vectors)}),
                    str(job.base / "orc" / "part-0.orc"))
    (job.base / "json").mkdir()
    with open(job.base / "json" / "part-0.json", "w") as lines:
        for target_id, vector in zip(job.target_ids, job.target):
            lines.write(json.dumps({"id": int(target_id), "label": f"t{target_id}",
                                    "vec": [float(x) for x in vector]}) + "\n")
    out = job.base / "out"
    sets = [f"query.path={job.base / 'orc'}", "query.format=orc", f"target.path={job.base / 'json'}",
            "target.format=json", f"output.path={out}"]
    assert main(["run", str(job.spec), *[a for s in sets for a in ("--set", s)]]) == 0, capsys.readouterr().err
    got = _read(out)
    for qid, pairs in job.reference(5).items():
        assert [t for t, _ in got.get(qid, [])] == [t for t, _ in pairs], qid


def test_a_table_spec_in_a_session_without_a_catalog_exits_2(job, capsys):
    # The suite's session has Spark's in-memory catalog: a table there would vanish with it.
    document = job.document()
    document["target"] = {"table": "src.target", "vector": "vec"}
    job.write_spec(document)
    assert main(["run", str(job.spec)]) == 2
    err = capsys.readouterr().err
    assert "spark_profile: the spec uses a table, but the running Spark session's catalog is 'in-memory'" in err
