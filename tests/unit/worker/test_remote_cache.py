"""The worker's local cache (worker.remote.cache): least recently used entries go first, down
to the bound, never one in use and never a half-written one."""

from __future__ import annotations

import os
from pathlib import Path

from worker.remote.cache import Cache


def entry(path: Path, size: int, used: float) -> Path:
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(b"x" * size)
    os.utime(path, (used, used))
    return path


def test_least_recently_used_entries_go_first_down_to_the_bound(tmp_path: Path) -> None:
    cache = Cache(tmp_path, max_bytes=250)
    old = entry(tmp_path / "tokens" / "old", 100, 1_000)
    middle = entry(tmp_path / "objects" / "middle", 100, 2_000)
    step = entry(tmp_path / "runs" / "r1" / "checkpoints" / "step-00000005", 100, 3_000)
    assert [e.path for e in cache.entries()] == [old, middle, step]
    assert cache.evict() == [old]  # 300 bytes, bound 250: the oldest alone brings it under
    assert not old.exists() and middle.exists() and step.exists()
    assert cache.evict() == []  # under the bound: nothing more

    cache.use(middle)  # now the most recent: the checkpoint is the oldest
    small = Cache(tmp_path, max_bytes=100)
    assert small.evict() == [step]
    assert middle.exists()


def test_entries_in_use_and_partial_ones_are_kept(tmp_path: Path) -> None:
    cache = Cache(tmp_path, max_bytes=0)
    used = entry(tmp_path / "objects" / "used", 10, 1_000)
    kept_by_file = entry(tmp_path / "tokens" / "mapped", 10, 1_100)
    free = entry(tmp_path / "tokens" / "free", 10, 2_000)
    partial = entry(tmp_path / "tokens" / ".tmp-building-123", 10, 500)
    staging = entry(tmp_path / "runs" / "r" / "checkpoints" / ".tmp-step-1", 10, 500)
    digests = entry(tmp_path / "tokens" / "digests", 10, 500)
    removed = cache.evict(in_use=[used, kept_by_file / "data.bin"])
    assert removed == [free]
    assert used.exists() and kept_by_file.exists()
    assert partial.exists() and staging.exists() and digests.exists()
    assert not any(p.name.startswith(".tmp-evicted") for p in (tmp_path / "tokens").iterdir())
