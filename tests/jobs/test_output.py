"""Atomic publication: readers see the old output or the new one, never a partial one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jobs import output
from nearest_join import publish
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
        monkeypatch.setattr(publish, "exchange", lambda a, b: False)
    elif publish.RENAMEAT2 is None:
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


def test_publish_partitions_replaces_only_the_partitions_written(tmp_path, swap):
    """overwrite_partitions: night 2 replaces its own partition, adds a new one, keeps the
    others byte for byte and replaces the summary; a night without rows empties its partition
    (``fixed``); the first night of an output publishes the whole directory."""
    final = tmp_path / "out"
    with StagedOutput(final) as staged:   # night 1: no output yet
        for day in ("2026-12-01", "2026-12-02"):
            (staged.staging / f"d={day}").mkdir(parents=True)
            _write_parts(staged.staging / f"d={day}" / "k=a", f"old-{day}")
        assert staged.publish_partitions({"run": 1}, ("d", "k")) == ["d=2026-12-01/k=a", "d=2026-12-02/k=a"]
    first = _snapshot(final / "d=2026-12-01")
    with StagedOutput(final) as staged:
        (staged.staging / "d=2026-12-02").mkdir(parents=True)
        _write_parts(staged.staging / "d=2026-12-02" / "k=b", "new", parts=1)
        (staged.staging / "d=2026-12-03").mkdir(parents=True)
        _write_parts(staged.staging / "d=2026-12-03" / "k=a", "new")
        summary = {"run": 2, "output": {"files": 3}}
        staged.publish_partitions(summary, ("d", "k"))
    assert summary["output"]["partitions"] == ["d=2026-12-02/k=b", "d=2026-12-03/k=a"]
    assert _snapshot(final / "d=2026-12-01") == first
    # a partition is a (d, k) directory: d=2026-12-02/k=a was not written, so it stays
    assert sorted(p.name for p in (final / "d=2026-12-02").iterdir()) == ["k=a", "k=b"]
    assert (final / "d=2026-12-03" / "k=a" / "part-00001.parquet").read_text() == "new-1"
    assert json.loads((final / SUMMARY_FILE).read_text())["run"] == 2 and (final / "_SUCCESS").exists()
    with StagedOutput(final) as staged:   # a night without rows, its partition known beforehand
        staged.publish_partitions({"run": 3}, ("d", "k"), {"d": "2026-12-03", "k": "a"})
    assert not list((final / "d=2026-12-03" / "k=a").iterdir()) and _snapshot(final / "d=2026-12-01") == first
    assert sorted(p.name for p in final.iterdir() if p.name.startswith(".")) == []
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


def test_a_run_that_publishes_nothing_leaves_nothing(tmp_path):
    # The lock is taken before the inputs are read, so a run that then fails on bad input
    # must take back the lock file and the directories it made for it.
    final = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(RuntimeError, match="bad input"):
        with StagedOutput(final) as staged:
            assert staged.lock_path.is_file()
            raise RuntimeError("bad input")
    assert list(tmp_path.iterdir()) == []


def test_a_lock_file_left_by_an_earlier_run_is_kept(tmp_path):
    final = tmp_path / "out"
    with StagedOutput(final) as staged:
        _write_parts(staged.staging, "new")
        staged.publish({})
    lock = tmp_path / ".out.nj-lock"
    inode = lock.stat().st_ino
    with pytest.raises(RuntimeError):
        with StagedOutput(final):
            raise RuntimeError("bad input")
    assert lock.stat().st_ino == inode and (final / "part-00000.parquet").is_file()


def test_a_busy_output_keeps_the_holders_lock_file(tmp_path):
    final = tmp_path / "new" / "out"
    with StagedOutput(final) as holder:
        with pytest.raises(OutputBusyError):
            with StagedOutput(final):
                pass
        assert holder.lock_path.is_file()
        with pytest.raises(OutputBusyError):  # still held, by the same file
            with StagedOutput(final):
                pass
    assert list(tmp_path.iterdir()) == []


def test_the_lock_holds_when_its_file_is_removed_under_a_waiting_run(tmp_path, monkeypatch):
    # Run A created the lock file and fails; run B opened that file just before A unlinked
    # it, and locks the unlinked file once A lets go. B must notice and lock the file at
    # the path instead, or a run C would lock a new file and write beside B.
    final = tmp_path / "out"
    a = StagedOutput(final).__enter__()
    real_flock = output.fcntl.flock
    calls = []

    def a_leaves_between_open_and_flock(fd, operation):
        if not calls:
            a.__exit__(RuntimeError, RuntimeError("bad input"), None)  # unlinks, then unlocks
        calls.append(fd)
        return real_flock(fd, operation)

    monkeypatch.setattr(output.fcntl, "flock", a_leaves_between_open_and_flock)
    with StagedOutput(final) as b:
        assert len(calls) == 2  # the unlinked file, then the new one
        assert os.path.samestat(os.fstat(b._lock_fd), os.stat(b.lock_path))
        with pytest.raises(OutputBusyError):
            with StagedOutput(final):
                pass


def test_an_output_under_a_file_raises_and_leaves_nothing(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError):
        with StagedOutput(tmp_path / "afile" / "new" / "out"):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


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
