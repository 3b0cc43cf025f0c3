"""Run parameters and the keys of catalog tables, input formats and partition values (issue 44):
checked when the spec is loaded, before Spark starts, each error naming its key. No Spark."""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import yaml

from jobs.params import today
from jobs.spec import SpecError, load_spec

ROOT = Path(__file__).resolve().parents[2]


def _spec(tmp_path, change=None, sets=(), params=None):
    for side in ("query", "target"):
        (tmp_path / "in" / side).mkdir(parents=True, exist_ok=True)
    document = {
        "query": {"path": str(tmp_path / "in" / "query"), "vector": "vec"},
        "target": {"table": "src.items", "vector": "vec", "prefix": "t_"},
        "join": {"metric": "l2", "k": 3},
        "output": {"table": "nj.similar", "partition_by": ["run_date"],
                   "partition_values": {"run_date": "${run_date}"}},
    }
    if change is not None:
        change(document)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return load_spec(path, list(sets), params)


def test_parameters_fill_every_string_and_the_summary_gets_them(tmp_path):
    def nightly(d):
        d["query"]["where"] = "day = '${run_date}' AND region = '${region}'"
        d["query"]["path"] = str(tmp_path / "in" / "${side}")
        d["target"]["table"] = "src.${side}_items"
        d["spark"] = {"spark.app.tag": "$${literal} ${region}"}

    spec = _spec(tmp_path, nightly, params=["run_date=2026-12-03", "region=eu", "side=query"])
    assert spec.query.where == "day = '2026-12-03' AND region = 'eu'"
    assert spec.query.paths == (str(tmp_path / "in" / "query"),)
    assert spec.target.table == "src.query_items"
    assert spec.output.partition_values == (("run_date", "2026-12-03"),)
    assert spec.spark_settings["spark.app.tag"] == "${literal} eu"
    assert spec.parameters == {"run_date": "2026-12-03", "region": "eu", "side": "query"}
    # --set values are filled in too; run_date defaults to today (UTC)
    spec = _spec(tmp_path, sets=["output.partition_values.run_date=night-${run_date}"])
    assert spec.output.partition_values == (("run_date", f"night-{today()}"),)
    assert today() == dt.datetime.now(dt.timezone.utc).date().isoformat()
    assert spec.parameters == {"run_date": today()}


def test_tables_get_the_embedded_catalog_unless_the_settings_name_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = _spec(tmp_path).spark_settings
    assert settings["spark.sql.catalogImplementation"] == "hive"
    assert settings["spark.sql.warehouse.dir"] == str(tmp_path / "data" / "warehouse")
    assert settings["spark.hadoop.javax.jdo.option.ConnectionURL"] == (
        f"jdbc:derby:;databaseName={tmp_path / 'data' / 'metastore_db'};create=true")
    assert settings["spark.driver.extraJavaOptions"].endswith(f"-Dderby.stream.error.file={tmp_path}/data/derby.log")
    own = _spec(tmp_path, sets=["spark.spark.sql.catalogImplementation=hive"]).spark_settings
    assert "spark.sql.warehouse.dir" not in own and "spark.hadoop.javax.jdo.option.ConnectionURL" not in own
    # a spec of paths only starts no catalog
    paths = _spec(tmp_path, lambda d: d.update(target={"path": str(tmp_path / "in" / "target"), "vector": "v"},
                                               output={"path": str(tmp_path / "out")}))
    assert "spark.sql.catalogImplementation" not in paths.spark_settings
    assert not paths.uses_tables and paths.output.mode == "error-if-exists"


def test_the_tables_spec_in_conf_parses():
    spec = load_spec(ROOT / "conf" / "tables.yaml", [], ["run_date=2026-12-03"])
    assert spec.output.table == "demo.similar_items" and spec.output.mode == "overwrite_partitions"
    assert spec.output.partition_by == ("run_date",)
    assert spec.output.partition_values == (("run_date", "2026-12-03"),)


def test_input_formats(tmp_path):
    spec = _spec(tmp_path, sets=["query.format=orc"])
    assert spec.query.format == "orc" and spec.target.format == "parquet"
    assert _spec(tmp_path, sets=["query.format=json"]).query.format == "json"


BAD = [
    ("parameter not given", dict(change=lambda d: d["query"].update(where="region = '${region}'")),
     "query.where", "uses ${region}, which the command line does not give; pass --param region=VALUE"),
    ("unclosed reference", dict(change=lambda d: d["query"].update(where="day = '${run_date'")),
     "query.where", "malformed parameter reference in \"day = '${run_date'\": expected ${name}"),
    ("bad name in a reference", dict(change=lambda d: d["target"].update(table="src.${run date}")),
     "target.table", "malformed parameter reference in 'src.${run date}'"),
    ("param without =", dict(params=["run_date"]), "--param", "expected NAME=VALUE (e.g. run_date=2026-12-03), got 'run_date'"),
    ("bad param name", dict(params=["run-date=2026-12-03"]), "--param", "'run-date' is not a parameter name"),
    ("malformed run_date", dict(params=["run_date=2026-13-03"]), "--param run_date",
     "expected a date written YYYY-MM-DD (e.g. 2026-12-03), got '2026-13-03'"),
    ("run_date not zero-padded", dict(params=["run_date=2026-1-3"]), "--param run_date", "got '2026-1-3'"),
    ("param given twice", dict(params=["a=1", "a=2"]), "--param a", "given twice ('1' and '2')"),
    ("unused param", dict(params=["run_dat=2026-12-03"]), "--param run_dat",
     "the spec does not use ${run_dat} (it uses ${run_date}); remove it or correct its name"),
    ("path and table", dict(sets=["target.path=/x"]), "target.table", "give target.path or target.table, not both"),
    ("neither path nor table", dict(change=lambda d: d["target"].pop("table")), "target.path",
     "missing (required): give target.path or target.table"),
    ("bad table name", dict(sets=["target.table=src.items-${run_date}"]), "target.table",
     "expected a table name db.name (letters, digits and _), got 'src.items-"),
    ("format of a table", dict(sets=["target.format=orc"]), "target.format", "applies to path inputs"),
    ("unknown format", dict(sets=["query.format=csv"]), "query.format",
     "expected one of ['parquet', 'orc', 'json'], got 'csv'"),
    ("table without partitions", dict(sets=["output.partition_by=[]"]), "output.partition_by",
     "a table output is partitioned: name its partition columns"),
    ("table in overwrite mode", dict(sets=["output.mode=overwrite"]), "output.mode",
     "a table output is written with overwrite_partitions"),
    ("overwrite_partitions of an unpartitioned path",
     dict(change=lambda d: d.update(output={"path": "out", "mode": "overwrite_partitions"})),
     "output.partition_by", "output.mode overwrite_partitions replaces the partitions a run writes: name the"),
    ("output table is an input", dict(sets=["output.table=SRC.items"]), "output.table",
     "'SRC.items' is also the target input"),
    ("bad partition value", dict(sets=["output.partition_values.run_date=[1]"]), "output.partition_values.run_date",
     "expected a string, a number or a date, got list"),
    ("bad schema_change", dict(sets=["output.schema_change=drop"]), "output.schema_change",
     "expected one of ['error', 'add_columns'], got 'drop'"),
    ("incremental into a table", dict(change=lambda d: d.update(incremental={"query_id": "id", "target_id": "id"})),
     "output.table", "an incremental job refreshes an output directory (output.path); it does not write tables yet"),
]


@pytest.mark.parametrize("how,key,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tables_and_parameters_name_the_key(tmp_path, how, key, text):
    with pytest.raises(SpecError) as info:
        _spec(tmp_path, how.get("change"), how.get("sets", ()), how.get("params"))
    assert info.value.key == key
    assert text in info.value.message
