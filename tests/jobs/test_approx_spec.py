"""join.mode: approx in the job spec (issue 23): join.recall / nlist / nprobe / seed reach
JoinOptions, join.index {path, rebuild} is parsed and checked, and a job trains its index
once, then reuses it."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jobs.spec import IndexSpec, SpecError, parse_spec


def _document(tmp_path, **join):
    return {"name": "approx", "query": {"path": str(tmp_path / "q"), "vector": "v"},
            "target": {"path": str(tmp_path / "t"), "vector": "v", "prefix": "t_"},
            "join": {"metric": "l2", "k": 3, **join}, "output": {"path": str(tmp_path / "out")}}


def test_approx_keys_reach_the_options(tmp_path):
    spec = parse_spec(_document(tmp_path, mode="approx", recall=0.9, nlist=8, nprobe=2, seed=5,
                                index={"path": "ix", "rebuild": True}))
    o = spec.join.options
    assert (o.mode, o.recall, o.nlist, o.nprobe, o.seed, o.index) == ("approx", 0.9, 8, 2, 5, None)
    assert spec.join.index == IndexSpec(path=os.path.abspath("ix"), rebuild=True)
    assert parse_spec(_document(tmp_path)).join.index is None
    defaults = parse_spec(_document(tmp_path, mode="approx")).join.options
    assert (defaults.recall, defaults.seed) == (0.95, 0)
    exact = parse_spec(_document(tmp_path)).join.options
    assert (exact.recall, exact.nlist, exact.nprobe, exact.seed, exact.index) == (None,) * 5


@pytest.mark.parametrize("join, key, message", [
    ({"mode": "approx", "recall": 2}, "join.recall", r"expected a number in \(0, 1\]"),
    ({"mode": "approx", "nlist": 4, "nprobe": 9}, "join.nprobe", "expected at most nlist = 4"),
    ({"nprobe": 2}, "join.nprobe", "applies to mode='approx'"),
    # recall and seed shape the IVF plan only, like nlist and index: the exact mode refuses
    # them instead of ignoring a forgotten mode: approx
    ({"recall": 0.9}, "join.recall", "applies to mode='approx'"),
    ({"seed": 3}, "join.seed", "applies to mode='approx'"),
    ({"nlist": 8}, "join.nlist", "applies to mode='approx'"),
    ({"mode": "approx", "seed": -1}, "join.seed", "expected an int >= 0"),
    ({"index": {"path": "ix"}}, "join.index", "applies to join.mode: approx"),
    ({"mode": "approx", "index": "ix"}, "join.index", "expected a mapping"),
    ({"mode": "approx", "index": {"rebuild": True}}, "join.index.path", "missing"),
    ({"mode": "approx", "index": {"path": "ix", "rebuild": "yes"}}, "join.index.rebuild", "expected true or false"),
    ({"mode": "approx", "index": {"path": "ix", "rebuilt": True}}, "join.index.rebuilt", "did you mean join.index.rebuild"),
    ({"mode": "approx", "index": {"path": "s3a://b/ix"}}, "join.index.path", "local filesystem path"),
])
def test_bad_approx_keys(tmp_path, join, key, message):
    with pytest.raises(SpecError, match=message) as caught:
        parse_spec(_document(tmp_path, **join))
    assert caught.value.key == key


def test_a_job_trains_its_index_once_then_reuses_it(spark, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.runner import prepare
    from nearest_join import ivf_index

    rng = np.random.default_rng(0)
    for side, n in (("q", 50), ("t", 600)):
        os.makedirs(tmp_path / side)
        pq.write_table(pa.table({"id": np.arange(n), "v": [r.tolist() for r in rng.standard_normal((n, 4))]}),
                       tmp_path / side / "part.parquet")
    document = _document(tmp_path, mode="approx", nlist=6, nprobe=2, index={"path": str(tmp_path / "ix")})
    built = []
    original = ivf_index.build_ivf_index
    monkeypatch.setattr(ivf_index, "build_ivf_index", lambda *a, **k: built.append(k) or original(*a, **k))
    first = prepare(parse_spec(document), spark).planned
    assert len(built) == 1 and built[0]["nlist"] == 6 and built[0]["column"] == "t_v"
    meta = json.loads((tmp_path / "ix" / "ivf_index.json").read_text())
    assert (meta["nlist"], meta["dimension"], meta["metric"]) == (6, 4, "l2")
    second = prepare(parse_spec(document), spark).planned
    assert len(built) == 1, "a saved index is reused"
    np.testing.assert_array_equal(second.ivf.index.centroids, first.ivf.index.centroids)
    assert second.plan.ivf["runs"] == "ivf" and second.plan.ivf["nprobe"] == 2
    document["join"]["index"]["rebuild"] = True
    prepare(parse_spec(document), spark)
    assert len(built) == 2, "rebuild: true trains again"


def test_a_saved_index_that_cannot_serve_is_a_join_index_error(spark, tmp_path):
    """A saved index with a NaN centroid (which would drop rows silently), or one of the other
    metric family, fails the job under join.index, naming the file, before the search."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.runner import prepare
    from nearest_join.ivf_index import IVFIndex

    rng = np.random.default_rng(0)
    for side, n in (("q", 20), ("t", 100)):
        os.makedirs(tmp_path / side)
        pq.write_table(pa.table({"id": np.arange(n), "v": [r.tolist() for r in rng.standard_normal((n, 4))]}),
                       tmp_path / side / "part.parquet")
    IVFIndex.train(rng.standard_normal((100, 4)).astype(np.float32), "l2", 4).save(tmp_path / "ix")
    centroids = np.load(tmp_path / "ix" / "centroids.npy")
    centroids[1, 0] = np.nan
    np.save(tmp_path / "ix" / "centroids.npy", centroids)
    document = _document(tmp_path, mode="approx", nprobe=4, index={"path": str(tmp_path / "ix")})
    with pytest.raises(SpecError, match=f"'{tmp_path / 'ix' / 'centroids.npy'}': expected finite numbers") as caught:
        prepare(parse_spec(document), spark)
    assert caught.value.key == "join.index"
    IVFIndex.train(rng.standard_normal((100, 4)).astype(np.float32), "cosine", 4).save(tmp_path / "ix")
    with pytest.raises(SpecError, match="expected an index built for l2 and sqeuclidean") as caught:
        prepare(parse_spec(document), spark)
    assert caught.value.key == "join.index"
