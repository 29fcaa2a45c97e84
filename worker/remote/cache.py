"""The worker's local cache of an object store (`TRAINCTL_CACHE_DIR`): what it downloaded or
built and keeps for the next attempt, bounded by `TRAINCTL_CACHE_MAX_BYTES`.

An entry is a directory that is complete or absent: `tokens/<name>` (a token store),
`objects/<id>` (a downloaded input object), `runs/<run>/checkpoints/step-*` (a checkpoint
downloaded or staged for upload). Each is written under a hidden temporary name (`.tmp-*`) and
renamed into place, so what has a plain name is whole. Least recently used entries go first;
"used" is the entry directory's mtime, moved by `use` (a marker inside would change the bytes
a directory's digest covers). Eviction is by this process's judgement only: a second worker
process sharing the folder should list what it maps in `in_use` too, or use a folder of its
own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TOKENS = "tokens"
OBJECTS = "objects"
RUNS = "runs"
# Not entries: runtime.digest's entries (small, and what saves re-hashing an entry).
DIGESTS = "digests"
TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Entry:
    path: Path
    size: int
    used: float  # the directory's mtime


def _partial(name: str) -> bool:
    """A temporary, a lock, a quarantined or half-written directory: never an entry."""
    return name.startswith(".") or ".tmp-" in name or name.endswith(".part")


def tree_size(path: Path) -> int:
    """Bytes of the files under `path` (links not followed); 0 when it is gone."""
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except FileNotFoundError:
                continue
    return total


class Cache:
    """A folder of entries bounded by `max_bytes` (0 keeps only what is in use). Costs a
    walk of every entry's files per `evict`: thousands of files, not millions (a store is 6
    files, a checkpoint a few dozen)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes

    @property
    def digests(self) -> Path:
        """runtime.digest's folder for the entries' digests."""
        return self.root / DIGESTS

    def folder(self, kind: str) -> Path:
        """`<root>/<kind>`, made if missing."""
        path = self.root / kind
        path.mkdir(parents=True, exist_ok=True)
        return path

    def temporary(self, kind: str, name: str) -> Path:
        """A fresh name for building entry `name` of `kind` (hidden until renamed)."""
        return self.folder(kind) / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:12]}"

    def use(self, path: Path) -> None:
        """Mark the entry at `path` just used (its mtime now)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)

    def entries(self) -> list[Entry]:
        """Every complete entry, least recently used first."""
        candidates: list[Path] = []
        for kind in (TOKENS, OBJECTS):
            folder = self.root / kind
            if folder.is_dir():
                candidates += [p for p in folder.iterdir() if p.name != DIGESTS]
        runs = self.root / RUNS
        if runs.is_dir():
            candidates += list(runs.glob("*/checkpoints/step-*"))
        found = []
        for path in candidates:
            if _partial(path.name) or path.is_symlink() or not path.is_dir():
                continue
            try:
                used = path.stat().st_mtime
            except FileNotFoundError:
                continue
            found.append(Entry(path=path, size=tree_size(path), used=used))
        return sorted(found, key=lambda e: (e.used, str(e.path)))

    def evict(self, in_use: Collection[Path] = ()) -> list[Path]:
        """Remove least recently used entries until the entries' total is at most max_bytes;
        never one in (or holding a path of) `in_use`, never a partial one. What was removed,
        oldest first. Each is renamed aside before it is deleted, so no reader finds half of
        one under its name."""
        entries = self.entries()
        total = sum(e.size for e in entries)
        kept = [Path(os.path.abspath(p)) for p in in_use]
        removed: list[Path] = []
        for entry in entries:
            if total <= self.max_bytes:
                break
            here = Path(os.path.abspath(entry.path))
            if any(p == here or p.is_relative_to(here) for p in kept):
                continue
            aside = entry.path.with_name(f"{TMP_PREFIX}evicted-{uuid.uuid4().hex[:12]}")
            try:
                entry.path.rename(aside)
            except FileNotFoundError:  # another process evicted it first
                continue
            shutil.rmtree(aside, ignore_errors=True)
            total -= entry.size
            removed.append(entry.path)
            log.info("evicted %s (%d bytes) from the cache", entry.path, entry.size)
        if total > self.max_bytes:
            log.warning(
                "the cache at %s holds %d bytes in use, over its bound of %d "
                "(TRAINCTL_CACHE_MAX_BYTES): raise it, or give this worker more disk",
                self.root,
                total,
                self.max_bytes,
            )
        return removed
