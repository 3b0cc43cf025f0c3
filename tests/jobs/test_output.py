"""Atomic publication: readers see the old output or the new one, never a partial one."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jobs import output
from jobs.output import OutputBusyError, StagedOutput, replace_directory
from jobs.spec import SUMMARY_FILE

ROOT = Path(__file__).resolve().parents[2]


def _write_parts(directory: Path, text: str, parts: int = 2) -> None:
    directory.mkdir()
    for i in range(parts):
        (directory / f"part-{i:05d}.parquet").write_text(f"{text}-{i}")


def _snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): p.read_text()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _siblings(final: Path) -> list[str]:
    """Everything beside the final path except the final path and its lock file."""
    return sorted(p.name for p in final.parent.iterdir()
                  if p.name not in (final.name, f".{final.name}.nj-lock"))


@pytest.fixture(params=[True, False], ids=["exchange", "two-renames"])
def swap(request, monkeypatch):
    """Run each test with the one-step exchange and with the two-rename fallback."""
    if not request.param:
        monkeypatch.setattr(output, "_exchange", lambda a, b: False)
    elif output._RENAMEAT2 is None:
        pytest.skip("renameat2 unavailable on this platform")
    return request.param


def test_first_publish(tmp_path, swap):
    final = tmp_path / "out"
    with StagedOutput(final) as staged:
        assert staged.staging.parent == final.parent and staged.staging.name.startswith(".out.")
        _write_parts(staged.staging, "new")
        assert not final.exists()  # nothing visible before publish
        staged.publish({"output_rows": 2})
    assert _snapshot(final) == {
        "_SUCCESS": "",
        SUMMARY_FILE: json.dumps({"output_rows": 2}, indent=2) + "\n",
        "part-00000.parquet": "new-0",
        "part-00001.parquet": "new-1",
    }
    assert _siblings(final) == []


def test_publish_replaces_the_previous_output_whole(tmp_path, swap):
    final = tmp_path / "out"
    _write_parts(final, "old", parts=3)
    with StagedOutput(final) as staged:
        _write_parts(staged.staging, "new", parts=1)
        staged.publish({"run": 2})
    assert sorted(_snapshot(final)) == ["_SUCCESS", SUMMARY_FILE, "part-00000.parquet"]
    assert (final / "part-00000.parquet").read_text() == "new-0"
    assert _siblings(final) == []


def test_failure_before_publish_leaves_the_old_output(tmp_path, swap):
    final = tmp_path / "out"
    _write_parts(final, "old")
    before = _snapshot(final)
    with pytest.raises(RuntimeError, match="disk full"):
        with StagedOutput(final) as staged:
            _write_parts(staged.staging, "new", parts=1)
            raise RuntimeError("disk full")
    assert _snapshot(final) == before
    assert _siblings(final) == []  # the staging directory is gone


def test_publish_without_replace_refuses_an_output_that_appeared(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(FileExistsError, match="appeared while this run was writing"):
        with StagedOutput(final, replace=False) as staged:
            _write_parts(staged.staging, "new")
            _write_parts(final, "other")
            staged.publish({})
    assert (final / "part-00000.parquet").read_text() == "other-0"
    assert _siblings(final) == []


def test_one_run_per_output(tmp_path):
    final = tmp_path / "out"
    with StagedOutput(final):
        with pytest.raises(OutputBusyError, match="another nearest-join run is writing"):
            with StagedOutput(final):
                pass
    with StagedOutput(final):  # the lock was released
        pass


def test_recovery_after_a_kill_between_the_two_renames(tmp_path):
    final = tmp_path / "out"
    parked = tmp_path / ".out.nj-previous-abc"
    stale = tmp_path / ".out.nj-staging-def"
    _write_parts(parked, "old")
    _write_parts(stale, "half")
    with StagedOutput(final):
        assert (final / "part-00000.parquet").read_text() == "old-0"
        assert not parked.exists() and not stale.exists()


def test_recovery_drops_a_parked_copy_when_the_new_output_is_in_place(tmp_path):
    final = tmp_path / "out"
    _write_parts(final, "new")
    _write_parts(tmp_path / ".out.nj-previous-abc", "old")
    with StagedOutput(final):
        pass
    assert (final / "part-00000.parquet").read_text() == "new-0"
    assert _siblings(final) == []


def test_replace_directory_into_a_fresh_path(tmp_path):
    staging = tmp_path / "stage"
    _write_parts(staging, "x")
    replace_directory(staging, tmp_path / "final")
    assert _snapshot(tmp_path / "final") == {"part-00000.parquet": "x-0", "part-00001.parquet": "x-1"}
    assert not staging.exists()


def test_a_killed_writer_leaves_the_old_output_and_the_next_run_tidies_up(tmp_path):
    final = tmp_path / "out"
    _write_parts(final, "old")
    before = _snapshot(final)
    # A real SIGKILL in the middle of writing: no Python cleanup runs.
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from jobs.output import StagedOutput
        staged = StagedOutput({str(final)!r}).__enter__()
        staged.staging.mkdir()
        (staged.staging / "part-00000.parquet").write_text("partial")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script])
    assert done.returncode == -signal.SIGKILL
    assert _snapshot(final) == before
    leftovers = _siblings(final)
    assert len(leftovers) == 1 and leftovers[0].startswith(".out.nj-staging-")
    with StagedOutput(final) as staged:  # the kernel released the dead run's lock
        assert _siblings(final) == []
        _write_parts(staged.staging, "new")
        staged.publish({})
    assert (final / "part-00000.parquet").read_text() == "new-0"


def test_data_files_skip_markers_and_checksums(tmp_path):
    _write_parts(tmp_path / "d", "x")
    (tmp_path / "d" / "_SUCCESS").touch()
    (tmp_path / "d" / ".part-00000.parquet.crc").touch()
    (tmp_path / "d" / "day=1").mkdir()
    (tmp_path / "d" / "day=1" / "part-9.parquet").touch()
    names = [p.name for p in output.data_files(tmp_path / "d")]
    assert names == ["part-9.parquet", "part-00000.parquet", "part-00001.parquet"]
