"""The one cache of input digests, for both sides: the service hashes a run's inputs to sign it;
a worker hashes those an attempt reads, to check them against the signature and to name their
token stores.

Hashing a corpus takes seconds per GiB, so a digest is reused while a stat says the bytes are
those that were hashed: the resolved path, size, mtime_ns, ctime_ns, inode and device of the
file (of every file, for a directory). Size and mtime alone do not say it: `cp -p`,
`rsync -a` and `tar x` rewrite a file in place with its old size and put its mtime back. A
user cannot put ctime back (the kernel stamps it at every write and every utime), so such a
file is hashed again. What this still misses: a rewrite within one tick of the kernel's coarse
clock (a few ms) of the change that was hashed; the token store's build checks the bytes it
reads against its digest (worker/data/store.py).

Entries live in the process (LRU) and, where the caller names a directory, one small JSON file
per path under it: a restarted worker does not read a 100 GB corpus again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from contracts.signature import sha256_path

_CACHE_SIZE = 4096
_memory: OrderedDict[str, str] = OrderedDict()  # fingerprint -> SHA-256
_lock = threading.Lock()


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def fingerprint(resolved: Path) -> str:
    """What the bytes of the file or directory at the resolved path `resolved` are known by
    short of reading them, as JSON; FileNotFoundError when it is neither."""
    if resolved.is_file():
        return json.dumps([str(resolved), _stat(resolved)])
    if not resolved.is_dir():
        raise FileNotFoundError(f"{resolved} does not exist")
    files = sorted(p for p in resolved.rglob("*") if p.is_file())
    return json.dumps(
        [str(resolved), [[p.relative_to(resolved).as_posix(), *_stat(p)] for p in files]]
    )


def digest_path(
    path: Path | str,
    progress: Callable[[], None] | None = None,
    *,
    cache_dir: Path | None = None,
) -> str:
    """contracts.signature.sha256_path of `path`, from the cache while its fingerprint holds;
    hashed (calling `progress` per MiB) and cached otherwise, under `cache_dir` too if given."""
    resolved = Path(path).resolve()
    key = fingerprint(resolved)
    with _lock:
        if (digest := _memory.get(key)) is not None:
            _memory.move_to_end(key)
            return digest
    entry = None if cache_dir is None else _entry(cache_dir, resolved)
    digest = None if entry is None else _read(entry, key)
    if digest is None:
        digest = sha256_path(resolved, progress)
        if entry is not None:
            _write(entry, key, digest)
    with _lock:
        _memory[key] = digest
        while len(_memory) > _CACHE_SIZE:
            _memory.popitem(last=False)
    return digest


def clear_digest_cache() -> None:
    """Forget the process's entries (those under a cache_dir stay)."""
    with _lock:
        _memory.clear()


def _entry(cache_dir: Path, resolved: Path) -> Path:
    return cache_dir / (hashlib.sha256(str(resolved).encode()).hexdigest() + ".json")


def _read(entry: Path, key: str) -> str | None:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(entry.read_text())
        if cached["key"] == key:
            return str(cached["sha256"])
    return None  # none, another format, or the path's bytes of before


def _write(entry: Path, key: str, digest: str) -> None:
    """Replace `entry` whole: a reader on another process or host never sees half of it."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps({"key": key, "sha256": digest}))
    os.replace(tmp, entry)
