"""Durable writes: what checkpoints and the report spool both need of the filesystem."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# A full file system, or this user's quota on it: another attempt would meet the same wall.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(path: Path) -> int:
    """The bytes this process may still write on the file system of `path` (which exists):
    what is left to unprivileged users, not the blocks reserved for root. One statvfs."""
    return shutil.disk_usage(path).free


def out_of_space(err: BaseException) -> OSError | None:
    """The OSError that says the disk or the quota is full, found in `err` or in what it was
    raised from; None when there is none (torch's zip writer, for one, hides the errno)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno in _NO_SPACE:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def no_space(err: OSError) -> str:
    """What a user reads of a write that ran out of space (`err`, from out_of_space): where,
    how much is free there now, and what to do."""
    where = Path(os.fsdecode(err.filename)) if err.filename is not None else None
    free = ""
    folder = where
    while folder is not None and not folder.is_dir() and folder != folder.parent:
        folder = folder.parent  # the file, or its half-written folder, may be gone already
    if folder is not None and folder.is_dir():
        free = f"; {mib(free_bytes(folder))} free in {folder}"
    return (
        f"no space left writing {where or 'a file'} ({err.strerror}){free}; free space there "
        "(older runs' checkpoints, token stores no run needs) or move it, then resume the run "
        "(trainctl runs resume)"
    )
