"""The one digest cache (runtime/digest.py): a digest is reused while its file's stat holds, and
a file rewritten in place with its size and mtime put back is hashed again, in the process and
in the entries a worker keeps under its artifact store."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from contracts.signature import sha256_path
from runtime.digest import clear_digest_cache, digest_path

Rewrite = Callable[[Path, bytes], None]


class Reads:
    """A progress callback that counts the MiB chunks hashed."""

    def __init__(self) -> None:
        self.chunks = 0

    def __call__(self) -> None:
        self.chunks += 1


@pytest.fixture(autouse=True)
def empty_cache() -> None:
    clear_digest_cache()


@pytest.mark.parametrize("kept", ["in the process", "under a cache directory"])
def test_a_file_rewritten_in_place_with_its_size_and_mtime_put_back_is_hashed_again(
    kept: str, tmp_path: Path, rewrite_in_place: Rewrite
) -> None:
    cache_dir = tmp_path / "digests" if kept == "under a cache directory" else None
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"text": "old"}\n')
    old = digest_path(path, cache_dir=cache_dir)
    if cache_dir is not None:
        clear_digest_cache()  # a restarted worker: only the entry under cache_dir is left
    rewrite_in_place(path, b'{"text": "new"}\n')
    assert digest_path(path, cache_dir=cache_dir) == sha256_path(path) != old


def test_a_digest_kept_under_a_cache_directory_outlives_the_process(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("one\n")
    reads = Reads()
    digest = digest_path(path, reads, cache_dir=tmp_path / "digests")
    assert digest == sha256_path(path) and reads.chunks == 1
    assert digest_path(path, reads) == digest and reads.chunks == 1, "the process remembers"
    clear_digest_cache()
    assert digest_path(path, reads, cache_dir=tmp_path / "digests") == digest
    assert reads.chunks == 1, "the entry under the directory answered, nothing was read"


def test_a_file_replaced_by_another_of_the_same_size_and_mtime_is_hashed_again(
    tmp_path: Path,
) -> None:
    path, edited = tmp_path / "data.jsonl", tmp_path / "edited.jsonl"
    path.write_text("one\n")
    old = digest_path(path)
    edited.write_text("two\n")
    stat = path.stat()
    os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    edited.replace(path)  # as `tar x` or `rsync -a` put a file in place: a new inode
    assert digest_path(path) == sha256_path(path) != old


def test_a_directory_digest_matches_the_contract_and_sees_new_and_rewritten_files(
    tmp_path: Path, rewrite_in_place: Rewrite
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    before = digest_path(model)
    assert before == sha256_path(model)
    (model / "weights.safetensors").write_bytes(b"w")
    grown = digest_path(model)
    assert grown == sha256_path(model) != before
    rewrite_in_place(model / "weights.safetensors", b"v")
    assert digest_path(model) == sha256_path(model) != grown
    with pytest.raises(FileNotFoundError):
        digest_path(tmp_path / "missing")
