"""Durable writes: what checkpoints and the report spool both need of the filesystem."""

from __future__ import annotations

import os
from pathlib import Path


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
