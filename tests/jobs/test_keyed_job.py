"""``nearest-join run`` with ``join.on`` (issue 22), end to end on Parquet inputs: the keyed
blocked plan (forced by a zero broadcast limit and small blocks, so the largest key is split),
a cap, and a key column kept in the output under its prefix; rows against the float64 oracle
per key group."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from jobs.cli import main
from jobs.spec import SUMMARY_FILE
from tests.oracle import key_values, oracle_keys

K, DIM = 3, 4


def _write(directory, table: pa.Table) -> None:
    directory.mkdir(parents=True)
    pq.write_table(table.slice(0, table.num_rows // 2), directory / "part-0.parquet")
    pq.write_table(table.slice(table.num_rows // 2), directory / "part-1.parquet")


def test_job_with_keys_and_a_cap_matches_the_oracle(tmp_path, spark, capsys):
    rng = np.random.default_rng(22)
    nq, nt = 50, 300
    countries = np.array(["fr", "de", "it", "es"])
    q_country = countries[rng.choice(4, nq, p=[0.6, 0.2, 0.1, 0.1])].astype(object)
    t_country = countries[rng.choice(3, nt, p=[0.7, 0.2, 0.1])].astype(object)   # no "es" target
    q_country[:3] = None
    queries = rng.normal(size=(nq, DIM)).astype(np.float32)
    targets = rng.normal(size=(nt, DIM)).astype(np.float32)
    vec = pa.list_(pa.float32())
    _write(tmp_path / "query", pa.table({"id": pa.array(np.arange(nq), pa.int64()),
                                         "country": pa.array(list(q_country), pa.string()),
                                         "vec": pa.array(list(queries), vec)}))
    _write(tmp_path / "target", pa.table({"id": pa.array(np.arange(nt), pa.int64()),
                                          "country": pa.array(list(t_country), pa.string()),
                                          "vec": pa.array(list(targets), vec)}))
    # A cap near the 3rd nearest of the whole target: within a key group some queries keep
    # fewer than k, some none.
    cap = float(np.median(np.sort(key_values(oracle_keys(queries, targets, "l2"), "l2"), axis=1)[:, 2]) * 1.5)
    spec = tmp_path / "job.yaml"
    out = tmp_path / "out"
    spec.write_text(yaml.safe_dump({
        "name": "keyed-job",
        "query": {"path": str(tmp_path / "query"), "vector": "vec"},
        "target": {"path": str(tmp_path / "target"), "vector": "vec", "columns": ["id", "country"],
                   "prefix": "t_"},
        "join": {"metric": "l2", "k": K, "distance_col": "distance", "on": "country",
                 "join_type": "left_outer", "max_distance": cap, "broadcast_limit_bytes": 0,
                 "target_block_rows": 40, "query_block_rows": 8},
        "output": {"path": str(out)},
    }))
    assert main(["run", str(spec)]) == 0, capsys.readouterr().err

    rows = pq.read_table(out).to_pylist()
    got: dict[int, list] = {}
    for row in rows:
        got.setdefault(row["id"], []).append(row)
    assert set(got) == set(range(nq))                       # left outer: every query once at least
    values = key_values(oracle_keys(queries, targets, "l2"), "l2")
    fewer = none = 0
    for i in range(nq):
        allowed = [j for j in range(nt) if q_country[i] is not None and t_country[j] == q_country[i]
                   and values[i, j] <= cap]
        allowed.sort(key=lambda j: values[i, j])
        expected = allowed[:K]
        mine = [r for r in got[i] if r["t_id"] is not None]
        if not expected:
            assert [r["t_id"] for r in got[i]] == [None], f"query {i}"
            none += 1
            continue
        assert sorted(r["t_id"] for r in mine) == sorted(expected), f"query {i} ({q_country[i]})"
        assert all(r["t_country"] == q_country[i] for r in mine)
        np.testing.assert_allclose(sorted(r["distance"] ** 2 for r in mine),
                                   sorted(values[i, j] ** 2 for j in expected), rtol=1e-4, atol=1e-6)
        fewer += len(expected) < K
    assert fewer > 0 and none > 3 + (q_country == "es").sum()   # the cap cut some short, some to none
    summary = (out / SUMMARY_FILE).read_text()
    plan = yaml.safe_load(summary)["plan"]
    assert plan["plan"] == "blocked" and plan["keys"] == [["country", "t_country", "string"]]
    assert plan["key_cells"]["split_groups"] >= 1            # "fr" is split over target parts
