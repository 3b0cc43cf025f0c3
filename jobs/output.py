"""Atomic publication of a job's output directory on a local (or shared POSIX) filesystem.

Spark writes the Parquet files into a hidden staging directory beside the final path
(``.NAME.nj-staging-<run>``, same parent, so the same filesystem and renames are atomic).
The run summary ``_nearest_join_summary.json`` and ``_SUCCESS`` are added inside it, the files
are flushed to disk, and only then does the staging directory take the final name:

* no previous output: one ``rename(staging, final)``;
* a previous output: ``renameat2(RENAME_EXCHANGE)`` swaps the two directories in one step
  (Linux >= 3.15), then the old one, now under the staging name, is deleted. Where the
  exchange is unsupported, two renames are used: final -> ``.NAME.nj-previous-<run>``, then
  staging -> final; a run killed between them leaves the previous output under that name and
  the next run puts it back (see :func:`_recover`).

So readers of the final path see the old table or the new one, never a mix, and a run that
fails or is killed leaves the old table as it was.

``output.mode: overwrite_partitions`` (a partitioned output that exists) replaces only the
partition directories the run wrote (:meth:`StagedOutput.publish_partitions`): each one in one
step as above, the others untouched; a reader of the whole directory may see some of the run's
partitions new and others still old while they are swapped one after another, and a run killed
among the swaps leaves each partition whole (the next run of the same night completes it). Hidden names (leading dot) keep staging
directories out of Spark's and Hive's directory listings.

One run at a time may write a given output: an exclusive ``flock`` on ``.NAME.nj-lock``
(released by the kernel even when the process is killed) makes a second run fail fast. A run
takes it before reading its inputs, so a busy or unwritable output is found in seconds; a run
that then publishes nothing removes the lock file and the directories it created for it.

Object stores (S3, GCS, ABFS) have no atomic directory rename: this module refuses them (the
spec check does). There, publish through a table format (Delta Lake, Iceberg) or an S3A
committer and a pointer that readers follow, swapped once the write is complete.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from nearest_join.publish import PREVIOUS, fsync_path, replace_directory, sibling

from .spec import SUMMARY_FILE

logger = logging.getLogger(__name__)

SUCCESS_FILE = "_SUCCESS"
_STAGING = ".nj-staging-"


class OutputBusyError(RuntimeError):
    """Another run holds the lock of this output path."""


def _recover(final: Path) -> None:
    """Tidy what killed runs left beside ``final``; called with the lock held.

    Staging directories of killed runs are deleted (they were never visible). A previous
    output parked by a two-rename swap is put back when the final path is missing (the run
    died between the two renames), else deleted.
    """
    for leftover in sorted(final.parent.glob(f".{final.name}{_STAGING}*")):
        logger.warning("removing %s, left by an interrupted run", leftover)
        shutil.rmtree(leftover, ignore_errors=True)
    parked = sorted(final.parent.glob(f".{final.name}{PREVIOUS}*"), key=os.path.getmtime)
    for leftover in parked:
        if not os.path.lexists(final):
            logger.warning("restoring %s to %s, left by an interrupted run", leftover, final)
            os.rename(leftover, final)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


class StagedOutput:
    """Context manager: lock the output, hand out a staging path, publish or discard.

    Examples
    --------
    >>> with StagedOutput("/data/similar_items") as staged:  # doctest: +SKIP
    ...     df.write.parquet(str(staged.staging))
    ...     staged.publish({"output_rows": 42})

    Leaving the block without :meth:`publish` (an exception) deletes the staging directory,
    and the lock file and parent directories if this run created them; the final path is
    untouched.
    """

    def __init__(self, final: str | os.PathLike, *, replace: bool = True):
        self.final = Path(final)
        self.replace = replace
        self.run_id = uuid.uuid4().hex[:12]
        self.staging = sibling(self.final, _STAGING, self.run_id)
        self.lock_path = sibling(self.final, ".nj-lock")
        self._lock_fd: int | None = None
        self._lock_created = False
        self._created_dirs: list[Path] = []  # parents of the output this run made, outermost first
        self.published = False

    def __enter__(self) -> "StagedOutput":
        """Take the output's lock (creating its parent directories), then tidy up after killed runs.

        Raises
        ------
        OutputBusyError
            Another run holds the lock.
        OSError
            The output's directory cannot be created or written (``PermissionError``,
            ``EROFS``, ``ENOTDIR``); nothing is left behind.
        """
        try:
            self._lock()
            _recover(self.final)
        except BaseException:
            self._release()
            raise
        return self

    def _make_parents(self) -> None:
        missing = []
        directory = self.final.parent
        while not os.path.lexists(directory):
            missing.append(directory)
            directory = directory.parent
        for directory in reversed(missing):
            try:
                directory.mkdir()
            except FileExistsError:  # another run made it meanwhile: it is not ours to remove
                continue
            self._created_dirs.append(directory)

    def _lock(self) -> None:
        # A run that gives up a lock file it created unlinks it while holding the lock; a run
        # that opened the file just before may then lock the unlinked inode. So after locking,
        # check that the path still names the file we hold, and otherwise start again.
        for _ in range(100):
            self._make_parents()
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                created = True
            except FileExistsError:
                try:
                    fd = os.open(self.lock_path, os.O_RDWR)
                except FileNotFoundError:  # removed by the run that just released it
                    continue
                created = False
            except FileNotFoundError:  # a failed run removed the parent it had created
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputBusyError(
                    f"another nearest-join run is writing {self.final} (it holds "
                    f"{self.lock_path}); wait for it to finish, then re-run"
                ) from None
            try:
                current = os.stat(self.lock_path)
            except FileNotFoundError:
                current = None
            if current is not None and os.path.samestat(os.fstat(fd), current):
                self._lock_fd, self._lock_created = fd, created
                return
            os.close(fd)
        raise OSError(errno.EAGAIN, f"could not take the lock {self.lock_path}: it keeps changing")

    def _release(self) -> None:
        """Drop the lock; without a publish, also what this run created for it."""
        if self._lock_fd is not None:
            if not self.published and self._lock_created:
                # Unlinked while still locked: see _lock for why that is safe.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.lock_path)
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        if not self.published:
            for directory in reversed(self._created_dirs):
                try:
                    directory.rmdir()
                except OSError:  # not empty: another run is using it now
                    break
        self._created_dirs = []

    def publish(self, summary: dict[str, Any]) -> Path:
        """Add the summary and ``_SUCCESS`` to the staging directory and move it into place."""
        if os.path.lexists(self.final) and not self.replace:
            raise FileExistsError(f"{self.final} appeared while this run was writing it")
        self.staging.mkdir(exist_ok=True)  # an empty result may not create it
        summary_path = self.staging / SUMMARY_FILE
        summary_path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        (self.staging / SUCCESS_FILE).touch()
        for path in (summary_path, self.staging / SUCCESS_FILE, self.staging):
            fsync_path(path)
        replace_directory(self.staging, self.final)
        self.published = True
        return self.final

    def publish_partitions(self, summary: dict[str, Any], partition_by: tuple[str, ...],
                           fixed: dict[str, str] | None = None) -> list[str]:
        """Replace, inside the existing output, only the partition directories the staging
        directory holds (``col=value/...``, ``len(partition_by)`` deep), each in one step; then
        the summary and ``_SUCCESS``. Without an output yet, :meth:`publish`. ``fixed``: partition
        values every row of the run has (``output.partition_values``): a run without rows
        empties that partition. Returns the partitions written (``col=value/...``)."""
        self.staging.mkdir(exist_ok=True)  # an empty result may not create it
        leaves = partition_dirs(self.staging, len(partition_by))
        if not leaves and fixed and all(c in fixed for c in partition_by):
            leaf = "/".join(f"{c}={escape_partition_value(fixed[c])}" for c in partition_by)
            (self.staging / leaf).mkdir(parents=True)
            leaves = [leaf]
        summary.setdefault("output", {})["partitions"] = leaves
        if not os.path.lexists(self.final):
            self.publish(summary)
            return leaves
        for leaf in leaves:
            fsync_path(self.staging / leaf)
        for leaf in leaves:
            target = self.final / leaf
            target.parent.mkdir(parents=True, exist_ok=True)
            replace_directory(self.staging / leaf, target)
        for name, text in ((SUMMARY_FILE, json.dumps(summary, indent=2, sort_keys=True) + "\n"), (SUCCESS_FILE, "")):
            written = self.final / f".{name}.{self.run_id}"
            written.write_text(text)
            fsync_path(written)
            os.replace(written, self.final / name)
        fsync_path(self.final)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.published = True
        return leaves

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if not self.published and os.path.lexists(self.staging):
                shutil.rmtree(self.staging, ignore_errors=True)
        finally:
            self._release()


def partition_dirs(directory: Path, depth: int) -> list[str]:
    """The ``col=value/...`` directories ``depth`` deep under ``directory`` (as Spark's
    partitioned write lays them out), relative, sorted."""
    pattern = "/".join(["*=*"] * depth)
    return sorted(str(p.relative_to(directory)) for p in Path(directory).glob(pattern)
                  if p.is_dir() and not any(part.startswith((".", "_")) for part in p.relative_to(directory).parts))


# What Spark escapes in a partition directory's name (ExternalCatalogUtils.escapePathName).
_ESCAPED = set('"#%\'*/:=?\\\x7f{[]^') | {chr(c) for c in range(0x20)}


def escape_partition_value(value: str) -> str:
    """``value`` as Spark names a partition directory after it (``%XX`` escapes)."""
    return "".join(f"%{ord(c):02X}" if c in _ESCAPED else c for c in value)


def data_files(directory: Path) -> list[Path]:
    """The data files under ``directory`` (not ``_``/``.`` files, not checksums)."""
    return sorted(
        p for p in Path(directory).rglob("*")
        if p.is_file() and not p.name.startswith(("_", "."))
    )
