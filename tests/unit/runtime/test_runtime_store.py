"""The artifact store's one interface, on both implementations: a folder, and a bucket on the
loopback S3 server (moto, over HTTP)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from runtime.store import (
    ArtifactStore,
    LocalStore,
    StoreError,
    is_store_uri,
    join,
    normalize_root,
    object_at,
    open_store,
    relative_key,
)

if TYPE_CHECKING:
    from conftest import S3


@pytest.fixture(params=["folder", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "folder":
        return LocalStore(tmp_path / "store")
    s3: S3 = request.getfixturevalue("s3")
    return open_store(s3.root)


def test_objects_round_trip_in_parts_and_ranges(store: ArtifactStore, tmp_path: Path) -> None:
    # Over 8 MiB: a multipart upload on S3, streamed back in chunks.
    data = os.urandom(9 * 2**20 + 7)
    source = tmp_path / "source"
    source.write_bytes(data)
    store.put_file("a/b/big", source)
    copy = tmp_path / "copy"
    store.get_file("a/b/big", copy)
    assert copy.read_bytes() == data
    assert store.get_range("a/b/big", 5, 17) == data[5:17]
    info = store.head("a/b/big")
    assert info is not None and info.size == len(data) and info.etag
    assert store.head("a/b/none") is None


def test_create_writes_only_where_nothing_is(store: ArtifactStore) -> None:
    assert store.put_bytes("m/manifest.json", b"first", create=True)
    assert not store.put_bytes("m/manifest.json", b"second", create=True)
    assert store.get_bytes("m/manifest.json") == b"first"
    store.put_bytes("m/manifest.json", b"third")  # a plain put replaces
    assert store.get_bytes("m/manifest.json") == b"third"


def test_listing_and_deletion(store: ArtifactStore) -> None:
    for key in ("runs/r1/x", "runs/r1/y/z", "runs/r2/x", "tokens/t"):
        store.put_bytes(key, key.encode())
    assert sorted(i.key for i in store.list("runs/r1")) == ["runs/r1/x", "runs/r1/y/z"]
    assert len(list(store.list())) == 4
    store.delete(["runs/r1/x", "runs/r1/y/z", "runs/r1/never"])
    assert list(store.list("runs/r1")) == []
    with pytest.raises(FileNotFoundError):
        store.get_bytes("runs/r1/x")


def test_a_local_store_refuses_keys_that_leave_it(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="not a key"):
        LocalStore(tmp_path).get_bytes("../outside")


def test_uris_and_paths() -> None:
    assert is_store_uri("s3://bucket/prefix") and not is_store_uri("/srv/artifacts")
    assert normalize_root("s3://bucket/prefix/") == "s3://bucket/prefix"
    with pytest.raises(ValueError, match="names no bucket"):
        normalize_root("s3:///prefix")
    assert join("s3://b/p", "runs", "r1") == "s3://b/p/runs/r1"
    assert join("/srv/a", "runs", "r1") == "/srv/a/runs/r1"
    assert relative_key("s3://b/p", "s3://b/p/runs/r1") == "runs/r1"
    assert relative_key("s3://b/p", "s3://b/other/x") is None
    with pytest.raises(ValueError, match="names no object"):
        object_at("s3://bucket")


def test_an_object_uri_opens_its_bucket(s3: S3) -> None:
    open_store(f"s3://{s3.bucket}").put_bytes("data/corpus.jsonl", b"{}\n")
    store, key = object_at(s3.uri("data/corpus.jsonl"))
    assert store.get_bytes(key) == b"{}\n"
