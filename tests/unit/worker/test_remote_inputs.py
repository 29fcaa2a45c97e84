"""Inputs and token stores on an object store (worker.remote.objects, worker.remote.tokens),
on the loopback S3 server: an input named by URI is fetched into the worker's cache once per
version of its objects and checked against the run's digest; jobs read s3 data and tokenizers;
a token store built by one worker is published, and another worker downloads it instead of
building it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from contracts.reports import Claim
from contracts.signature import sha256_path
from contracts.workflow import Workflow, replace_paths
from runtime.store import open_store
from worker.error import ConfigError, SignatureMismatch
from worker.process.claim import verified_workflow
from worker.process.jobs import digest_of_object, job_outcome
from worker.remote.cache import Cache
from worker.remote.objects import fetch_input
from worker.settings import WorkerSettings


def put(uri_root: str, key: str, path_or_bytes: Path | bytes) -> str:
    store = open_store(uri_root)
    if isinstance(path_or_bytes, Path):
        store.put_file(key, path_or_bytes)
    else:
        store.put_bytes(key, path_or_bytes)
    return f"{uri_root}/{key}"


def test_an_object_is_fetched_once_per_version_and_checked(s3: Any, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache", max_bytes=2**30)
    uri = put(s3.uri("data"), "corpus.jsonl", b'{"text": "one"}\n')
    first = fetch_input(uri, cache=cache, expected_sha256=sha256_path_of(b'{"text": "one"}\n'))
    assert first.read_bytes() == b'{"text": "one"}\n' and first.name == "corpus.jsonl"
    assert first.is_relative_to(tmp_path / "cache" / "objects")
    inode = first.stat().st_ino
    again = fetch_input(uri, cache=cache)
    assert again == first and again.stat().st_ino == inode  # unchanged: not fetched again

    put(s3.uri("data"), "corpus.jsonl", b'{"text": "two"}\n')  # a new ETag
    changed = fetch_input(uri, cache=cache)
    assert changed != first and changed.read_bytes() == b'{"text": "two"}\n'

    wrong = "0" * 64
    with pytest.raises(SignatureMismatch) as refused:
        fetch_input(uri, cache=cache, expected_sha256=wrong)
    message = str(refused.value)
    assert uri in message and wrong in message
    assert sha256_path_of(b'{"text": "two"}\n') in message
    assert not changed.exists()  # the refused copy is not kept


def sha256_path_of(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_a_prefix_is_a_directory_with_the_digest_of_its_local_copy(s3: Any, tmp_path: Path) -> None:
    root = s3.uri("models/tiny")
    # "a/x" sorts before "a-b/x" part by part (as sha256_path sorts), after it as text.
    for key, body in {"a/x": b"1", "a-b/x": b"22", "config.json": b"{}", "a/y/z": b"3"}.items():
        put(root, key, body)
    cache = Cache(tmp_path / "cache", max_bytes=2**30)
    local = fetch_input(root, cache=cache)
    assert local.name == "tiny" and local.is_dir()
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    assert names == ["a-b/x", "a/x", "a/y/z", "config.json"]
    assert (local / "a-b" / "x").read_bytes() == b"22"
    assert digest_of_object(root).sha256 == sha256_path(local)
    assert digest_of_object(f"{root}/a-b/x").sha256 == sha256_path(local / "a-b" / "x")


def settings_for(s3: Any, tmp_path: Path, worker: str) -> WorkerSettings:
    return WorkerSettings(
        home=tmp_path / worker,
        artifact_root=s3.root,
        data_roots=(s3.uri("data"),),
        cache_dir=tmp_path / worker / "cache",
    )


def test_jobs_read_s3_data_and_a_second_worker_downloads_the_prepared_store(
    s3: Any,
    tmp_path: Path,
    tokenizer_path: Path,
    make_pairs_file: Callable[..., Path],
    builds: list[str],
) -> None:
    data = put(s3.uri("data"), "sft/train.jsonl", make_pairs_file(records=30))
    tokenizer = put(s3.uri("data"), "tok/tokenizer.json", tokenizer_path)
    request = {
        "path": data,
        "tokenizer": tokenizer,
        "objective": "summarization",
        "sequence_length": 64,
    }
    first = settings_for(s3, tmp_path, "w1")
    inspected = job_outcome("inspection", request, settings=first)
    assert inspected.status == "succeeded", inspected.error
    assert inspected.result is not None
    assert inspected.result["path"] == data and inspected.result["records"] == 30
    assert len(builds) == 1 and builds[0].startswith(str(first.cache_dir / "objects"))

    prepared = job_outcome("preparation", request, settings=first)
    assert prepared.status == "succeeded", prepared.error
    assert prepared.result is not None
    # The store the inspection built (fitted, as a supervised phase maps it) is the one prepared.
    assert prepared.result["path"] == data and prepared.result["built"] is False
    store = Path(prepared.result["store"])
    assert store.parent == first.cache_dir / "tokens"
    manifest = json.loads(open_store(s3.root).get_bytes(f"tokens/{store.name}/manifest.json"))
    assert manifest["files"]["meta.json"]["sha256"] == sha256_path(store / "meta.json")
    assert len(builds) == 1

    second = settings_for(s3, tmp_path, "w2")
    again = job_outcome("preparation", request, settings=second)
    assert again.status == "succeeded", again.error
    assert again.result is not None
    assert again.result["built"] is False and len(builds) == 1  # downloaded, not encoded
    downloaded = Path(again.result["store"])
    assert downloaded.parent == second.cache_dir / "tokens"
    assert downloaded.name == store.name
    assert (again.result["records"], again.result["tokens"]) == (
        prepared.result["records"],
        prepared.result["tokens"],
    )
    for name in ("ids.bin", "offsets.bin", "records.bin"):
        assert sha256_path(downloaded / name) == sha256_path(store / name)


def test_an_attempt_trains_on_verified_local_copies_of_its_s3_inputs(
    s3: Any,
    tmp_path: Path,
    tokenizer_path: Path,
    make_pairs_file: Callable[..., Path],
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
) -> None:
    local_data = make_pairs_file(records=10)
    data = put(s3.uri("data"), "sft.jsonl", local_data)
    tokenizer = put(s3.uri("data"), "tokenizer.json", tokenizer_path)
    phase = {"name": "sft", "objective": "summarization", "steps": 2, "data": [local_data]}
    local = make_claim(make_workflow([phase]))  # digests of the local files
    uris = {str(local_data): data, str(tokenizer_path): tokenizer}
    doc = replace_paths(local.workflow, lambda value: uris.get(value, value))
    digests = local.digests.model_copy(update={"data": {data: sha256_path(local_data)}})
    artifact_dir = f"{s3.root}/runs/{local.run_id}"
    claim = local.model_copy(
        update={"workflow": doc, "digests": digests, "artifact_dir": artifact_dir}
    )
    assert Workflow.model_validate(doc).tokenizer == tokenizer
    settings = settings_for(s3, tmp_path, "w1")
    verified = verified_workflow(claim, settings, lambda: None)
    copy = Path(verified.phases[0].data[0].path)
    assert copy.is_relative_to(settings.cache_dir / "objects")
    assert copy.read_bytes() == local_data.read_bytes()
    assert Path(verified.tokenizer).read_bytes() == tokenizer_path.read_bytes()
    # The copies' digests are kept where the token stores look a file's digest up.
    assert any((settings.cache_dir / "tokens" / "digests").rglob("*"))

    put(s3.uri("data"), "sft.jsonl", local_data.read_bytes() + b'{"source": "x", "target": "y"}\n')
    with pytest.raises(SignatureMismatch) as refused:
        verified_workflow(claim, settings, lambda: None)
    assert f"data file {data} has SHA-256" in str(refused.value)
    assert sha256_path(local_data) in str(refused.value)


def test_an_s3_input_outside_the_data_roots_is_refused_unread(
    s3: Any,
    tmp_path: Path,
    tokenizer_path: Path,
    make_pairs_file: Callable[..., Path],
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
) -> None:
    local_data = make_pairs_file(records=5)
    data = put(s3.uri("elsewhere"), "sft.jsonl", local_data)
    phase = {"name": "sft", "objective": "summarization", "steps": 2, "data": [local_data]}
    local = make_claim(make_workflow([phase]))
    doc = replace_paths(local.workflow, lambda value: data if value == str(local_data) else value)
    digests = local.digests.model_copy(update={"data": {data: sha256_path(local_data)}})
    claim = local.model_copy(update={"workflow": doc, "digests": digests})
    settings = settings_for(s3, tmp_path, "w1")
    settings = settings.model_copy(
        update={"data_roots": (s3.uri("data"), str(tokenizer_path.parent))}
    )
    with pytest.raises(ConfigError, match=f"data file: {data} is outside the data roots"):
        verified_workflow(claim, settings, lambda: None)
    assert not (settings.cache_dir / "objects").exists()  # nothing was fetched


def test_fetching_evicts_down_to_the_bound_but_not_what_the_caller_keeps(
    s3: Any, tmp_path: Path
) -> None:
    cache = Cache(tmp_path / "cache", max_bytes=150)
    uris = [put(s3.uri("data"), f"f{i}.bin", bytes([i]) * 100) for i in range(3)]
    first = fetch_input(uris[0], cache=cache)
    second = fetch_input(uris[1], cache=cache, keep=[first])
    assert first.exists() and second.exists()  # 200 bytes: over the bound, both kept
    third = fetch_input(uris[2], cache=cache, keep=[second])
    assert not first.exists() and second.exists() and third.exists()
