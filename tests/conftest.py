"""Fixtures for every test directory (values reach tests only as fixtures: see
tests/unit/test_test_layout.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

Rewrite = Callable[[Path, bytes], None]


@pytest.fixture
def rewrite_in_place() -> Rewrite:
    """`rewrite_in_place(path, content)`: `content` written over the bytes of `path` (same size,
    same inode) and its access and modification times put back to the nanosecond, as `cp -p`,
    `rsync -a` and `tar x` leave a file they overwrite. Returns once the file's ctime differs
    from before: the kernel stamps ctime from a coarse clock (a tick of a few ms), so a rewrite
    within the tick of the file's last change would keep it, which a copy made later never
    does."""

    def rewrite(path: Path, content: bytes) -> None:
        before = path.stat()
        assert len(content) == before.st_size, "a rewrite in place keeps the size"
        with open(path, "r+b") as f:
            f.write(content)
        deadline = time.monotonic() + 5
        while True:
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
            after = path.stat()
            if after.st_ctime_ns != before.st_ctime_ns:
                break
            assert time.monotonic() < deadline, f"{path}: ctime did not move in 5 s"
        same = (after.st_size, after.st_mtime_ns, after.st_ino)
        assert same == (before.st_size, before.st_mtime_ns, before.st_ino)

    return rewrite
