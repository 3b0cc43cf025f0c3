"""Spark's class archive (jobs/jvm.py): only an archive a JVM maps is ever in place, and the
driver's options name it only where it is.

Recording Spark's own archive takes a JVM's whole life (make run does it, and
benchmarks/fixed_costs.py measures what it saves); here the recorder is a bare ``java
-version``, whose JVM dumps a small archive of the same kind as it exits.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from jobs import jvm

pytestmark = pytest.mark.skipif(jvm._java() is None, reason="needs java")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "nearest_join" / "jvm"


def _java_recorder(recording):
    return [jvm._java(), f"-XX:ArchiveClassesAtExit={recording}", *jvm._QUIET.split(), "-version"]


def test_a_recorded_archive_is_in_place_and_named_by_the_options(cache, monkeypatch):
    assert jvm.java_options() == ""                 # none yet: the JVM starts as it always did
    assert jvm.with_archive("-Xmx1g") == "-Xmx1g"
    monkeypatch.setattr(jvm, "_recorder", _java_recorder)
    path = jvm.build_archive()
    assert path == jvm.archive_path() and path.parent == cache and path.is_file()
    assert [p.name for p in cache.iterdir() if ".recording" in p.name] == []
    assert jvm.java_options().startswith(f"-XX:SharedArchiveFile={path} ")
    assert jvm.with_archive("-Xmx1g") == f"-Xmx1g {jvm.java_options()}"
    assert jvm.with_archive(f"-XX:SharedArchiveFile=/mine.jsa") == "-XX:SharedArchiveFile=/mine.jsa"
    # a JVM started with the options maps it
    result = subprocess.run([jvm._java(), *jvm.java_options().split(), "-Xshare:on", "-version"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    monkeypatch.setattr(jvm, "_recorder", lambda recording: pytest.fail("recorded again"))
    assert jvm.build_archive() == path             # recorded once


def test_an_archive_no_jvm_maps_is_never_in_place(cache, monkeypatch, tmp_path):
    # A truncated archive kills the JVM that maps it (SIGBUS): it must not be found.
    good = tmp_path / "good.jsa"
    subprocess.run(_java_recorder(good), check=True, capture_output=True)
    assert jvm._maps(jvm._java(), good)
    truncated = tmp_path / "truncated.jsa"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 3])

    def recorder(recording):
        return ["cp", str(truncated), str(recording)]

    monkeypatch.setattr(jvm, "_recorder", recorder)
    with pytest.raises(RuntimeError, match="no class archive it can map"):
        jvm.build_archive()
    assert jvm.java_options() == ""
    assert [p.name for p in cache.iterdir()] == []
    assert not list(jvm.Path.cwd().glob("hs_err_pid*.log"))   # the crashed JVM's report went nowhere

    monkeypatch.setattr(jvm, "_recorder", lambda recording: ["python3", "-c", "raise SystemExit('no JVM here')"])
    with pytest.raises(RuntimeError, match="no JVM here"):
        jvm.build_archive()
    assert jvm.java_options() == ""


def test_archives_of_removed_installs_are_deleted(cache, monkeypatch, tmp_path):
    cache.mkdir(parents=True)
    gone = cache / "spark-0-old.jsa"
    gone.write_bytes(b"x")
    gone.with_suffix(".json").write_text(f'{{"java": "{jvm._java()}", "jars": "{tmp_path / "removed"}"}}')
    kept = cache / "spark-0-other.jsa"
    kept.write_bytes(b"x")
    kept.with_suffix(".json").write_text(f'{{"java": "{jvm._java()}", "jars": "{tmp_path}"}}')
    monkeypatch.setattr(jvm, "_recorder", _java_recorder)
    path = jvm.build_archive()
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [path.name, path.with_suffix(".json").name, kept.name, kept.with_suffix(".json").name])
    assert os.path.isdir(__import__("json").loads(path.with_suffix(".json").read_text())["jars"])


def test_a_failed_recording_leaves_make_run_going(cache, monkeypatch, capsys):
    monkeypatch.setattr(jvm, "_recorder", lambda recording: ["python3", "-c", "raise SystemExit('no JVM here')"])
    assert jvm.main([]) == 0
    assert "local jobs start without one" in capsys.readouterr().err
    assert jvm.java_options() == ""
