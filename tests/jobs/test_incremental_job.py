"""A spec with ``incremental:`` (issue 43): the first run is a full run that keeps its state
inside the output; the next night's run refreshes it, and its output equals the float64
oracle's join of that night's inputs; a spec the refresh cannot serve exits 2."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jobs.cli import main
from jobs.spec import STATE_DIR

from .killing import kill_when
from .test_cli import Job, _files, _read, _summary, _vectors, _write, job  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parents[2]


def _incremental(job: Job, out) -> None:
    document = job.document()
    document["output"] = {"path": str(out), "mode": "overwrite"}
    document["incremental"] = {"query_id": "id", "target_id": "id", "margin": 3}
    job.write_spec(document)


def _check(job: Job, out, k: int) -> None:
    got = _read(out)
    want = job.reference(k)
    want = {q: v for q, v in want.items() if v}
    assert got.keys() == want.keys()
    for q, pairs in want.items():
        assert [t for t, _ in got[q]] == [t for t, _ in pairs], q
        assert [d for _, d in got[q]] == [np.float32(d) for _, d in pairs] or np.allclose(
            [d for _, d in got[q]], [d for _, d in pairs], rtol=1e-6), q


def test_two_nights_refresh_equals_the_oracle(job, capsys):
    out = job.base / "out"
    _incremental(job, out)
    assert main(["run", str(job.spec)]) == 0, capsys.readouterr().err
    first = _summary(out)
    assert first["incremental"]["refreshed"] is False and (out / STATE_DIR / "meta.json").exists()
    _check(job, out, 5)
    # night 2: a tenth of the targets deleted, a tenth changed, as many inserted; queries too
    rng = np.random.default_rng(11)
    n = len(job.target_ids) // 10
    keep = np.ones(len(job.target_ids), bool)
    keep[rng.choice(len(keep), n, replace=False)] = False
    job.target_ids, job.target = job.target_ids[keep], job.target[keep]
    job.target[rng.choice(len(job.target), n, replace=False)] = rng.normal(size=(n, job.target.shape[1]))
    job.target_ids = np.concatenate([job.target_ids, 9000 + np.arange(n)])
    job.target = np.concatenate([job.target, rng.normal(size=(n, job.target.shape[1])).astype(np.float32)])
    job.query[rng.choice(len(job.query), 3, replace=False)] = rng.normal(size=(3, job.query.shape[1]))
    for side in ("query", "target"):
        shutil.rmtree(job.base / "in" / side)
    _write(job.base / "in" / "query", {"id": pa.array(job.query_ids, pa.int64()), "vec": _vectors(job.query)})
    _write(job.base / "in" / "target", {"id": pa.array(job.target_ids, pa.int64()),
                                        "label": pa.array([f"t{i}" for i in job.target_ids]),
                                        "vec": _vectors(job.target)})
    # A kill -9 in the middle of the refresh: the first night's output stays whole and
    # readable, and the next run (which tidies what the killed one left) refreshes from its state.
    before = _files(out)
    _killed_mid_refresh(job, out)
    assert _files(out) == before and len(pq.read_table(out)) == first["output_rows"]
    capsys.readouterr()
    assert main(["explain", str(job.spec)]) == 0, capsys.readouterr().err
    explained = capsys.readouterr().out
    assert main(["explain", "--json", str(job.spec)]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert _files(out) == before
    assert main(["run", str(job.spec)]) == 0, capsys.readouterr().err
    assert not list(out.parent.glob(".out.nj-staging-*"))
    printed = capsys.readouterr().out
    second = _summary(out)["incremental"]
    assert second["refreshed"] is True and "incremental  refreshed" in printed
    assert (second["targets_inserted"], second["targets_deleted"]) == (n, n)
    assert second["queries_changed"] == 3
    # explain said what the run then did
    assert "incremental refresh" in explained and f"{len(job.target_ids):,} rows today: {n:,} inserted" in explained
    assert plan["refresh"] is True and plan["queries"]["changed"] == 3 and plan["targets"]["deleted"] == n
    assert plan["queries_searched_whole"] == second["queries_searched_whole"] - second["queries_short"]
    assert second["queries_searched_whole"] < len(job.query_ids)
    assert second["recall"] is None and "recall  " not in printed   # exact mode: no recall line
    # under join.mode approx the summary gives the recall, measured or estimated
    from jobs.runner import format_summary

    summary = _summary(out)
    for recall, shown in (({"nlist": 8, "nprobe": 2, "recall_estimate": 0.97, "recall_lower": 0.955,
                            "recall_queries": 300, "recall_of": "the refreshed lists, measured on 300 sampled "
                                                                "queries against exact search"},
                           "recall       0.9700 (lower bound 0.9550: the refreshed lists, measured on 300"),
                          ({"nlist": 8, "nprobe": 2, "recall_estimate": None, "recall_lower": None,
                            "recall_queries": 0, "recall_of": "the plan's estimate, of recall@8"},
                           "recall       not estimated (nprobe given), nprobe 2 of nlist 8")):
        text = format_summary({**summary, "incremental": {**summary["incremental"], "recall": recall}})
        assert shown in text, text
    _check(job, out, 5)
    # the vectors are not written (output.include_vectors), the payload is today's
    names = pq.read_schema(next(out.glob("part-*.parquet"))).names
    assert "vec" not in names and "t_vec" not in names and "t_label" in names


def _killed_mid_refresh(job: Job, out) -> None:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    # Its own process group: the kill takes the job's Spark JVM with it, as a scheduler's kill
    # of the job does (an orphaned JVM would go on writing for a moment).
    process = subprocess.Popen([sys.executable, "-m", "jobs", "run", str(job.spec)], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    kill_when(process, lambda: bool(list(out.parent.glob(".out.nj-staging-*-state/queries"))), "its refresh",
              timeout_s=180)
    assert list(out.parent.glob(".out.nj-staging-*-state"))   # what the next run tidies


def test_a_state_of_its_own(job, capsys):
    """incremental.state: the state lives there, not in the output; it is published after the
    output; what a killed run staged beside it is removed by the next run; explain reads it."""
    out, state = job.base / "out", job.base / "states" / "nightly"
    _incremental(job, out)
    document = job.document()
    document["output"] = {"path": str(out), "mode": "overwrite"}
    document["incremental"] = {"query_id": "id", "target_id": "id", "margin": 3, "state": str(state)}
    job.write_spec(document)
    stale = state.parent / f".{state.name}.nj-state-staging-0123456789ab"
    (stale / "queries").mkdir(parents=True)
    assert main(["run", str(job.spec)]) == 0, capsys.readouterr().err
    assert (state / "meta.json").exists() and not (out / STATE_DIR).exists() and not stale.exists()
    assert [p.name for p in state.parent.iterdir()] == ["nightly"]
    assert _summary(out)["incremental"]["state"] == str(state)
    _check(job, out, 5)
    capsys.readouterr()
    assert main(["explain", str(job.spec)]) == 0, capsys.readouterr().err
    explained = capsys.readouterr().out
    assert "incremental refresh" in explained and "0 inserted, 0 deleted, 0 changed" in explained
    for inside in (out / "state", job.base / "in" / "query" / "state"):
        document["incremental"]["state"] = str(inside)
        job.write_spec(document)
        assert main(["run", str(job.spec)]) == 2
        assert "incremental.state" in capsys.readouterr().err


def test_a_spec_the_refresh_cannot_serve_exits_2(job, capsys, monkeypatch):
    out = job.base / "out"
    _incremental(job, out)
    document = job.document()
    document["output"] = {"path": str(out)}
    document["incremental"] = {"query_id": "id", "target_id": "id"}
    job.write_spec(document)
    assert main(["run", str(job.spec)]) == 2
    assert "output.mode" in capsys.readouterr().err
    document["output"]["mode"] = "overwrite"
    document["join"]["mode"] = "approx"
    document["join"]["index"] = {"path": str(job.base / "ix")}
    job.write_spec(document)
    assert main(["run", str(job.spec)]) == 2
    assert "join.index: an incremental job keeps its IVF index in its state" in capsys.readouterr().err
    del document["join"]["index"]
    document["join"]["recall"] = 0.9
    # keys, caps and approx reach the refresh (nearest_join/incremental's tests check its results)
    import nearest_join.incremental
    from nearest_join.errors import ArgumentError

    seen = {}

    def refresh(*args, **kwargs):
        seen.update(kwargs)
        raise ArgumentError("margin", "stopped by the test")

    monkeypatch.setattr(nearest_join.incremental, "incremental_nearest_join", refresh)
    document["join"]["max_distance"] = 1.0
    document["join"]["on"] = "id"
    job.write_spec(document)
    assert main(["run", str(job.spec)]) == 2
    assert "incremental.margin: stopped by the test" in capsys.readouterr().err
    assert seen["max_distance"] == 1.0 and seen["min_similarity"] is None and seen["on"] == (("id", "t_id"),)   # the join sees the prefixed names
    assert (seen["mode"], seen["recall"], seen["nlist"], seen["seed"]) == ("approx", 0.9, None, 0)
    monkeypatch.undo()
    for key in ("max_distance", "on", "mode", "recall"):
        del document["join"][key]
    document["incremental"]["query_id"] = "nope"
    job.write_spec(document)
    assert main(["run", str(job.spec)]) == 2
    assert "incremental.query_id" in capsys.readouterr().err
    assert not out.exists()
