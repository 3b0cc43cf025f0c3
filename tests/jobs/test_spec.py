"""Job spec loading and validation: no Spark, every error names its key."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from jobs.spec import (
    REDACTED,
    SUMMARY_FILE,
    SpecError,
    apply_overrides,
    check_paths,
    conf_dir,
    load_spec,
    parse_override,
    parse_spec,
    redact_settings,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def inputs(tmp_path):
    for side in ("query", "target"):
        (tmp_path / "in" / side).mkdir(parents=True)
        (tmp_path / "in" / side / "part-0.parquet").write_bytes(b"")
    return tmp_path


def _document(base: Path) -> dict:
    return {
        "query": {"path": str(base / "in" / "query"), "vector": "vec"},
        "target": {"path": str(base / "in" / "target"), "vector": "vec", "prefix": "t_"},
        "join": {"metric": "cosine", "k": 4},
        "output": {"path": str(base / "out")},
    }


def _write(path: Path, document) -> Path:
    path.write_text(yaml.safe_dump(document) if not isinstance(document, str) else document)
    return path


def test_valid_spec_gets_defaults(inputs):
    spec = load_spec(_write(inputs / "job.yaml", _document(inputs)))
    assert spec.name == "job"
    assert spec.query.paths == (str(inputs / "in" / "query"),)
    assert (spec.query.where, spec.query.columns, spec.query.prefix) == (None, None, "")
    assert spec.target.prefix == "t_"
    options = spec.join.options
    assert (spec.join.metric, options.num_results, options.mode, options.join_type) == (
        "cosine", 4, "exact", "inner")
    assert options.distance_col is None and options.backend == "auto" and options.precision == "auto"
    assert spec.output.mode == "error-if-exists"
    assert spec.output.partition_by == () and spec.output.num_files is None
    assert spec.output.include_vectors is False
    # The embedded default profile is conf/local.yaml.
    assert spec.spark_profile == "local"
    assert spec.spark_settings["master"] == "local[2]"
    assert spec.spark_settings["spark.ui.showConsoleProgress"] == "true"


def test_join_on_is_a_key_not_yaml_true(inputs):
    # YAML 1.1 reads a plain `on` as the boolean true; as a spec key it is the name "on".
    text = yaml.safe_dump(_document(inputs)).replace("join:\n", "join:\n  on: [country, [q_id, id]]\n")
    spec = load_spec(_write(inputs / "job.yaml", text))
    assert spec.join.options.on == (("country", "country"), ("q_id", "id"))


def test_relative_paths_resolve_against_the_working_directory(inputs, monkeypatch):
    monkeypatch.chdir(inputs)
    document = _document(inputs)
    document["query"]["path"] = "in/query"
    document["output"]["path"] = "out"
    spec = parse_spec(document, "job.yaml")
    assert spec.query.paths == (str(inputs / "in" / "query"),)
    assert spec.output.path == str(inputs / "out")


def _without(document, section, key):
    del document[section][key]
    return document


BAD = [
    ("missing query.path", lambda d: _without(d, "query", "path"), "query.path", "missing"),
    ("missing target.vector", lambda d: _without(d, "target", "vector"), "target.vector", "missing"),
    ("missing join.metric", lambda d: _without(d, "join", "metric"), "join.metric", "missing"),
    ("missing output", lambda d: {k: v for k, v in d.items() if k != "output"}, "output", "missing"),
    ("unknown metric", lambda d: {**d, "join": {"metric": "manhattan"}}, "join.metric",
     "unknown metric 'manhattan'"),
    ("k zero", lambda d: {**d, "join": {"metric": "l2", "k": 0}}, "join.k", "between 1 and 100000"),
    ("max_distance negative", lambda d: {**d, "join": {"metric": "l2", "max_distance": -1}},
     "join.max_distance", "expected None or a finite number >= 0, got -1.0"),
    ("max_distance nan", lambda d: {**d, "join": {"metric": "l2", "max_distance": float("nan")}},
     "join.max_distance", "expected None or a finite number >= 0, got nan"),
    ("max_distance string", lambda d: {**d, "join": {"metric": "l2", "max_distance": "1"}},
     "join.max_distance", "expected None or a finite number >= 0, got str '1'"),
    ("max_distance with cosine", lambda d: {**d, "join": {"metric": "cosine", "max_distance": 1}},
     "join.max_distance", "not the similarity 'cosine'; pass min_similarity instead"),
    ("min_similarity with l2", lambda d: {**d, "join": {"metric": "l2", "min_similarity": 0.5}},
     "join.min_similarity", "not the distance 'l2'; pass max_distance instead"),
    # a cosine similarity lies in [-1, 1]: above, every query would lose every row (exit 0,
    # nothing written); below, the cap would be no cap
    ("cosine min_similarity above 1", lambda d: {**d, "join": {"metric": "cosine", "min_similarity": 1.5}},
     "join.min_similarity", "expected a cosine similarity in [-1, 1], got 1.5"),
    ("cosine min_similarity below -1", lambda d: {**d, "join": {"metric": "cosine", "min_similarity": -2}},
     "join.min_similarity", "expected a cosine similarity in [-1, 1], got -2.0"),
    ("both caps", lambda d: {**d, "join": {"metric": "l2", "max_distance": 1, "min_similarity": 0.5}},
     "join.min_similarity", "expected None when max_distance is given"),
    ("on not a name", lambda d: {**d, "join": {"metric": "l2", "on": 3}}, "join.on",
     "expected None, a column name present on both sides, a list of them, a list of (query_column, "),
    ("on pair of three", lambda d: {**d, "join": {"metric": "l2", "on": [["a", "b", "c"]]}}, "join.on",
     "(item ['a', 'b', 'c'])"),
    ("k too big", lambda d: {**d, "join": {"metric": "l2", "k": 100_001}}, "join.k",
     "NUM_RESULTS_OUT_OF_RANGE] Invalid nearest-by join. The number of results 100001 must be"),
    ("k string", lambda d: {**d, "join": {"metric": "l2", "k": "10"}}, "join.k",
     "expected an int between 1 and 100000, got str '10'"),
    ("k bool", lambda d: {**d, "join": {"metric": "l2", "k": True}}, "join.k", "expected an int"),
    ("bad precision", lambda d: {**d, "join": {"metric": "l2", "precision": "fp16"}}, "join.precision",
     "expected one of ['auto', 'fp32', 'tf32', 'bf16'], got 'fp16'"),
    ("bad join type", lambda d: {**d, "join": {"metric": "l2", "join_type": "full"}}, "join.join_type",
     "UNSUPPORTED_JOIN_TYPE"),
    ("zero block rows", lambda d: {**d, "join": {"metric": "l2", "query_block_rows": 0}},
     "join.query_block_rows", "expected None or an int between 1 and 16777215, got 0"),
    ("typo", lambda d: {**d, "join": {"metric": "l2", "kk": 3}}, "join.kk", "did you mean join.k?"),
    ("top-level typo", lambda d: {**d, "outptu": {}}, "outptu", "did you mean output?"),
    ("write mode", lambda d: {**d, "output": {"path": "/tmp/x", "mode": "append"}}, "output.mode",
     "expected one of ['overwrite', 'error-if-exists', 'overwrite_partitions'], got 'append'"),
    ("object store output", lambda d: {**d, "output": {"path": "s3a://bucket/out"}}, "output.path",
     "not a local filesystem path"),
    ("columns not a list", lambda d: {**d, "query": {**d["query"], "columns": {"a": 1}}},
     "query.columns", "expected a list of column names"),
    ("num_files zero", lambda d: {**d, "output": {"path": "/tmp/x", "num_files": 0}},
     "output.num_files", "must be >= 1"),
    ("spark setting name", lambda d: {**d, "spark": {"executor.memory": "4g"}},
     "spark.executor.memory", "names starting with 'spark.'"),
    ("unknown profile", lambda d: {**d, "spark_profile": "cluster-tpu"}, "spark_profile",
     "profile 'cluster-tpu' not found"),
    ("not a mapping", lambda d: {**d, "join": ["l2"]}, "join", "expected a mapping, got list"),
]


@pytest.mark.parametrize("change,key,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_names_the_key(inputs, change, key, text):
    with pytest.raises(SpecError) as info:
        parse_spec(change(_document(inputs)), "job.yaml")
    assert info.value.key == key
    assert text in info.value.message
    assert str(info.value).startswith(f"{key}: ")


def test_duplicate_keys_are_refused(tmp_path):
    path = _write(tmp_path / "job.yaml", "join:\n  metric: l2\n  k: 3\n  k: 5\n")
    with pytest.raises(SpecError, match=r"^k: duplicate key at line 4 \(first at line 3\)"):
        load_spec(path)


def test_yaml_cannot_run_code(tmp_path):
    marker = tmp_path / "pwned"
    path = _write(tmp_path / "job.yaml",
                  f"query: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(SpecError, match="is not valid YAML at line 1"):
        load_spec(path)
    assert not marker.exists()


def _alias_bomb(indent: str, levels: int = 9, width: int = 9) -> list[str]:
    """Lines of a YAML list whose last item stands for width**levels strings ("billion laughs")."""
    items = [f"&l0 [{', '.join(['lol'] * width)}]"] + [
        f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return [f"{indent}- {item}" for item in items]


def _bomb_spec(tmp_path: Path) -> Path:
    lines = ["query: {path: in/query, vector: vec}", "target: {path: in/target, vector: vec}",
             "join:", "  metric: l2", "  k:", *_alias_bomb("    "), "output: {path: out}"]
    return _write(tmp_path / "job.yaml", "\n".join(lines) + "\n")


def _bomb_override() -> str:
    return "join.k=[" + ", ".join(line.strip()[2:] for line in _alias_bomb("")) + "]"


@pytest.mark.parametrize("where", ["file", "--set"])
def test_alias_bomb_is_refused_at_once_naming_the_key(tmp_path, where):
    # 9 levels of 9 aliases: 9**9 strings once expanded; the loader shares them, but a repr
    # for the error message used to expand them (88 s, 3.4 GB, then MemoryError).
    spec = _bomb_spec(tmp_path)
    overrides = [_bomb_override()] if where == "--set" else []
    if where == "--set":
        _write(spec, _document(tmp_path))
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        load_spec(spec, overrides)
    assert time.perf_counter() - start < 1.0
    assert info.value.key == "join.k"
    assert "expands to more than 10,000,000 values and characters" in info.value.message
    assert "expected a scalar or a short list" in info.value.message
    assert len(str(info.value)) < 300


def test_self_referencing_value_is_refused(tmp_path):
    path = _write(tmp_path / "job.yaml", "join:\n  metric: l2\n  k: &k [1, *k]\n")
    with pytest.raises(SpecError, match=r"^join.k: the sequence at line 3 refers to itself"):
        load_spec(path)


@pytest.mark.parametrize("text,message", [
    ("join:\n  k: " + "9" * 5000 + "\n", "is not valid YAML at line 2, column 6: integer of 5,000 digits"),
    ("join:\n  ? [1, 2]\n  : 3\n", "is not valid YAML at line 2, column 5: found unhashable key"),
])
def test_values_python_cannot_build_are_bad_yaml_not_a_crash(tmp_path, text, message):
    with pytest.raises(SpecError, match=message):
        load_spec(_write(tmp_path / "job.yaml", text))


def test_messages_describe_a_huge_value_briefly(inputs):
    # The same structure built in Python (parse_spec is public): describing it for the
    # message must not walk it.
    huge = ["lol"] * 9
    for _ in range(8):
        huge = [huge] * 9
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        parse_spec({**_document(inputs), "join": {"metric": "l2", "k": huge}})
    assert time.perf_counter() - start < 1.0
    assert info.value.key == "join.k"
    assert info.value.message.startswith("expected an int between 1 and 100000, got list of 9 items [[[...], ")
    assert len(info.value.message) < 200
    with pytest.raises(SpecError, match=r"^join.metric: unknown metric 'x+\.\.\.x+'; expected") as info:
        parse_spec({**_document(inputs), "join": {"metric": "x" * 10**6}})
    assert len(str(info.value)) < 300


@pytest.mark.parametrize("text,message", [
    ("", "the file is empty"),
    ("- a\n- b\n", "a job spec is a YAML mapping, got list"),
    ("query: [unclosed\n", "is not valid YAML"),
])
def test_unusable_files(tmp_path, text, message):
    path = _write(tmp_path / "job.yaml", text)
    with pytest.raises(SpecError, match=message) as info:
        load_spec(path)
    assert info.value.key == str(path)


def test_missing_spec_file(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text,expected", [
    ("join.k=5", (("join", "k"), 5)),
    ("join.distance_col=null", (("join", "distance_col"), None)),
    ("output.include_vectors=true", (("output", "include_vectors"), True)),
    ("output.partition_by=[a, b]", (("output", "partition_by"), ["a", "b"])),
    ("query.where=id % 2 = 0", (("query", "where"), "id % 2 = 0")),
    ("query.where=@x = 1", (("query", "where"), "@x = 1")),  # not YAML: kept as text
    ("output.path=/tmp/a=b", (("output", "path"), "/tmp/a=b")),
    ("spark.master=local[4]", (("spark", "master"), "local[4]")),
    ("spark.spark.sql.shuffle.partitions=64", (("spark", "spark.sql.shuffle.partitions"), 64)),
])
def test_parse_override(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize("text,message", [
    ("join.k", "expected KEY=VALUE"),
    ("join..k=1", "bad key 'join..k'"),
    ("join.k={a: 1}", "set one dotted key per value"),
])
def test_bad_override(text, message):
    with pytest.raises(SpecError, match=message):
        parse_override(text)


def test_overrides_apply_in_order_and_do_not_touch_the_input(inputs):
    document = _document(inputs)
    result = apply_overrides(document, ["join.k=7", "join.k=9", "output.num_files=3",
                                        "spark.spark.sql.shuffle.partitions=5"])
    assert result["join"]["k"] == 9 and document["join"]["k"] == 4
    spec = parse_spec(result)
    assert spec.join.options.num_results == 9 and spec.output.num_files == 3
    # spec settings win over the profile's; YAML ints become Spark strings
    assert spec.spark_settings["spark.sql.shuffle.partitions"] == "5"
    with pytest.raises(SpecError, match=r"^join.metric.x: cannot set it: join.metric is not a mapping"):
        apply_overrides(document, ["join.metric.x=1"])


def test_an_override_can_introduce_an_error_that_names_the_key(inputs):
    with pytest.raises(SpecError, match=r"^join.k: \[NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE\] .* 0 must be between 1 and 100000"):
        parse_spec(apply_overrides(_document(inputs), ["join.k=0"]))


def test_secret_settings_are_redacted(inputs):
    settings = {
        "spark.hadoop.fs.s3a.secret.key": "hunter2",
        "spark.ssl.keyPassword": "pw",
        "spark.authenticate.secret": "s",
        "spark.hadoop.fs.azure.sas.token": "t",
        "spark.sql.shuffle.partitions": "8",
        "master": "local[2]",
    }
    assert redact_settings(settings) == {
        "spark.hadoop.fs.s3a.secret.key": REDACTED,
        "spark.ssl.keyPassword": REDACTED,
        "spark.authenticate.secret": REDACTED,
        "spark.hadoop.fs.azure.sas.token": REDACTED,
        "spark.sql.shuffle.partitions": "8",
        "master": "local[2]",
    }
    document = {**_document(inputs), "spark": {"spark.my.api.token": "abc"}}
    spec = parse_spec(document)
    assert spec.spark_settings["spark.my.api.token"] == "abc"  # Spark still gets it
    assert spec.redacted_document()["spark"] == {"spark.my.api.token": REDACTED}
    assert document["spark"]["spark.my.api.token"] == "abc"


# -- filesystem checks ---------------------------------------------------------------------------


def _spec(base: Path, **changes):
    document = _document(base)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        document[section][key] = value
    return parse_spec(document)


def test_check_paths_accepts_a_good_spec(inputs):
    check_paths(_spec(inputs))
    assert not (inputs / "out").exists()


@pytest.mark.parametrize("changes,key,text", [
    ({"query__path": "MISSING"}, "query.path", "does not exist: "),
    ({"target__path": "in/nothing-*/x"}, "target.path", "no file or directory matches"),
    ({"output__path": "in/query"}, "output.path", "overlaps the query input"),
    ({"output__path": "in/target/sub"}, "output.path", "overlaps the target input"),
    ({"output__path": "in"}, "output.path", "overlaps the query input"),
    ({"query__path": "in/q*", "output__path": "in/quux"}, "output.path", "overlaps the query input"),
], ids=["missing input", "glob matches nothing", "output is input", "output inside input",
        "output around input", "output matched by input glob"])
def test_check_paths_errors(inputs, monkeypatch, changes, key, text):
    monkeypatch.chdir(inputs)
    with pytest.raises(SpecError, match=text) as info:
        check_paths(_spec(inputs, **changes))
    assert info.value.key == key
    assert not (inputs / "out").exists()


@pytest.mark.parametrize("changes,really", [
    ({"output__path": "qlink/out"}, "in/query/out"),
    ({"output__path": "qlink"}, "in/query"),
    ({"query__path": "qlink", "target__path": "tlink", "output__path": "in"}, None),
    ({"query__path": "qlink/*.parquet", "output__path": "in/query/more.parquet"}, None),
], ids=["output inside input via link", "output is a link to input",
        "output around a linked input", "output matched by a glob via link"])
def test_check_paths_sees_through_symlinks(inputs, monkeypatch, changes, really):
    # qlink -> in/query: `qlink/out` looks unrelated to in/query but is inside it.
    (inputs / "qlink").symlink_to(inputs / "in" / "query", target_is_directory=True)
    (inputs / "tlink").symlink_to(inputs / "in" / "target", target_is_directory=True)
    monkeypatch.chdir(inputs)
    with pytest.raises(SpecError, match="overlaps the query input") as info:
        check_paths(_spec(inputs, **changes))
    assert info.value.key == "output.path"
    assert (f"(really '{inputs / really}')" in info.value.message) if really else (
        "really" not in info.value.message)
    assert sorted(p.name for p in (inputs / "in" / "query").iterdir()) == ["part-0.parquet"]


def test_check_paths_accepts_a_link_that_leads_elsewhere(inputs, monkeypatch):
    (inputs / "elsewhere").mkdir()
    (inputs / "olink").symlink_to(inputs / "elsewhere", target_is_directory=True)
    monkeypatch.chdir(inputs)
    check_paths(_spec(inputs, output__path="olink/out"))


def test_output_under_a_file_is_refused(inputs):
    (inputs / "afile").write_text("x")
    with pytest.raises(SpecError, match=r"cannot create '.*/afile/out': '.*/afile' is not a directory"):
        check_paths(_spec(inputs, output__path=str(inputs / "afile" / "out")))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_output_in_a_read_only_directory_is_refused(inputs):
    locked = inputs / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(SpecError, match=r"cannot write '.*/locked/new/out': '.*/locked' is not "
                                             r"writable by this user") as info:
            check_paths(_spec(inputs, output__path=str(locked / "new" / "out")))
        assert info.value.key == "output.path"
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_existing_output_needs_overwrite_and_our_summary(inputs):
    out = inputs / "out"
    out.mkdir()
    (out / "part-0.parquet").write_bytes(b"x")
    with pytest.raises(SpecError, match="already exists and output.mode is 'error-if-exists'"):
        check_paths(_spec(inputs))
    with pytest.raises(SpecError, match="was not written by nearest-join"):
        check_paths(_spec(inputs, output__mode="overwrite"))
    (out / SUMMARY_FILE).write_text("{}")
    check_paths(_spec(inputs, output__mode="overwrite"))
    assert (out / "part-0.parquet").read_bytes() == b"x"


def test_output_that_is_a_file_is_refused(inputs):
    (inputs / "out").write_text("x")
    with pytest.raises(SpecError, match="exists and is not a directory"):
        check_paths(_spec(inputs, output__mode="overwrite"))


# -- shipped conf files ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["demo.yaml", "example.yaml"])
def test_shipped_specs_are_valid(name):
    spec = load_spec(ROOT / "conf" / name)
    assert spec.join.metric == "l2"
    assert spec.output.path.startswith(os.sep)


@pytest.mark.parametrize("profile", ["local", "cluster-cpu", "cluster-gpu"])
def test_profiles_load(inputs, profile):
    spec = parse_spec({**_document(inputs), "spark_profile": profile})
    assert conf_dir() == ROOT / "conf"
    assert spec.spark_settings["spark.sql.execution.arrow.pyspark.enabled"] == "true"
    # Cluster profiles leave the master to spark-submit.
    assert ("master" in spec.spark_settings) == (profile == "local")
    if profile == "cluster-gpu":
        assert spec.spark_settings["spark.executor.resource.gpu.amount"] == "1"
        assert spec.spark_settings["spark.task.resource.gpu.amount"] == "0.5"
        assert spec.spark_settings["spark.executor.resource.gpu.discoveryScript"] == \
            "conf/gpu_discovery.sh"
        assert not any(k.startswith("spark.rapids") for k in spec.spark_settings)


@pytest.mark.parametrize("visible,addresses", [
    ("2,3", '"0","1"'),            # CUDA renumbers the visible devices: ordinals 0 and 1
    ("GPU-a1b2,GPU-c3d4", '"0","1"'),
    ("", ""),                      # set but empty: no GPU for this executor
])
def test_gpu_discovery_script_prints_cuda_ordinals(visible, addresses):
    script = ROOT / "conf" / "gpu_discovery.sh"
    done = subprocess.run([str(script)], capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": visible}, check=True)
    assert done.stdout.strip() == '{"name":"gpu","addresses":[%s]}' % addresses


def test_caps_reach_the_options(inputs):
    document = _document(inputs)
    spec = load_spec(_write(inputs / "job.yaml", {**document, "join": {"metric": "cosine", "min_similarity": 0.25}}))
    assert spec.join.options.min_similarity == 0.25 and spec.join.options.cap("cosine") == 0.25
    spec = load_spec(_write(inputs / "job.yaml", {**document, "join": {"metric": "l2", "max_distance": 3}}))
    assert spec.join.options.max_distance == 3.0 and spec.join.options.cap("l2") == 3.0
