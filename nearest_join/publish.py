"""One directory made to appear at its final path in one step, on a local (or shared POSIX)
filesystem: what the batch jobs publish their output with (``jobs.output``) and the
incremental join its state with (:mod:`nearest_join.incremental`).

A reader of the final path sees the old directory or the new one, never a mix:
``renameat2(RENAME_EXCHANGE)`` swaps the two in one step (Linux >= 3.15); where the kernel or
the filesystem cannot, two renames are used (final -> ``.NAME.nj-previous-<id>``, then
staging -> final), and a process killed between them leaves the old directory under that
name, which the next publication of that path puts back (``jobs.output`` does so under its
lock).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import uuid
from pathlib import Path

PREVIOUS = ".nj-previous-"


def sibling(final: Path, kind: str, run_id: str = "") -> Path:
    """A hidden path beside ``final``: ``.NAME<kind><run_id>`` (same parent, same filesystem)."""
    return final.parent / f".{final.name}{kind}{run_id}"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _libc_renameat2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28, or not Linux
        return None


RENAMEAT2 = _libc_renameat2()
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the kernel or filesystem cannot."""
    if RENAMEAT2 is None:
        return False
    rc = RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def replace_directory(staging: Path, final: Path) -> None:
    """Make the complete directory ``staging`` appear at ``final`` in one step.

    An existing ``final`` is replaced (and deleted afterwards); see the module notes for what
    a reader or a killed process can observe.
    """
    staging, final = Path(staging), Path(final)
    if not os.path.lexists(final):
        os.rename(staging, final)
    elif exchange(staging, final):
        shutil.rmtree(staging)  # now holds the previous output
    else:
        previous = sibling(final, PREVIOUS, uuid.uuid4().hex[:12])
        os.rename(final, previous)
        os.rename(staging, final)
        shutil.rmtree(previous)
    fsync_path(final.parent)
