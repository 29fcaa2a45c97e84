"""The token store: built once per (file, tokenizer, encoder, fit), published atomically,
verified on open, shared by every reader, and holding exactly what the encoder makes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_inspect import MIXED, SEQ
from tokenizers import Tokenizer

from contracts.signature import sha256_file
from worker.data import store as store_module
from worker.data.encode import encode_records
from worker.data.inspect import summarize, summarize_store
from worker.data.records import read_records
from worker.data.store import (
    ABANDONED_AFTER_SECONDS,
    KINDS,
    META,
    Builder,
    StoreKey,
    Stores,
    TokenFile,
    ensure_store,
    id_dtype,
    open_store,
)
from worker.data.tokenizer import EOS_TOKEN
from worker.error import DataError

Rewrite = Callable[[Path, bytes], None]


def key_for(path: Path, tokenizer: Tokenizer, fit: int | None) -> StoreKey:
    return StoreKey(
        file_sha256=sha256_file(path),
        tokenizer_sha256=Stores(Path(), tokenizer).tokenizer_sha256,
        fit=fit,
    )


def build(
    path: Path, tokenizer: Tokenizer, root: Path, fit: int | None = SEQ, **kw: Any
) -> TokenFile:
    return ensure_store(str(path), tokenizer, key_for(path, tokenizer, fit), root, **kw)[0]


@pytest.fixture
def mixed(tmp_path: Path, make_jsonl: Callable[..., Path]) -> Path:
    return make_jsonl(tmp_path / "mixed.jsonl", MIXED)


def test_a_store_holds_every_record_as_the_encoder_makes_it(
    mixed: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    store = build(mixed, tokenizer, tmp_path / "tokens")
    expected = encode_records(tokenizer, read_records(str(mixed)), sequence_length=SEQ)

    assert len(store) == len(expected) == len(MIXED)
    assert store.ids.dtype == np.dtype("<u2") == id_dtype(tokenizer)  # a 300-token vocabulary
    for i, enc in enumerate(expected):
        ids, mask = store.record(i)
        assert ids.tolist() == enc.ids.tolist(), i
        assert mask.tolist() == enc.loss_mask.tolist(), i
        row = store.records[i]
        report = enc.report
        assert (int(row["line"]), KINDS[row["kind"]]) == (i + 1, read_records(str(mixed))[i].kind)
        assert (bool(row["fits"]), bool(row["zero_target"])) == (report.fits, report.zero_target)
        assert (int(row["source_tokens"]), int(row["target_tokens"]), int(row["total_tokens"])) == (
            report.source_tokens,
            report.target_tokens,
            report.total_tokens,
        )
        assert int(row["segments_dropped"]) == len(report.dropped_segments)
    # Lines 1 and 2 are the same record spelled differently: equal content keys.
    assert store.records["key"][0] == store.records["key"][1] != store.records["key"][2]
    # What inspection makes of the store is what it makes of the encoded records.
    in_memory = summarize(
        read_records(str(mixed)), expected, objective="qa_reasoning", sequence_length=SEQ
    )
    from_store = summarize_store(store, objective="qa_reasoning", sequence_length=SEQ)
    assert from_store == in_memory


def test_a_text_store_is_the_eos_joined_stream(
    make_text_file: Callable[..., Path], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    path = make_text_file(documents=30)
    store = build(path, tokenizer, tmp_path / "tokens", fit=None)
    encoded = encode_records(tokenizer, read_records(str(path)), sequence_length=None)
    assert store.ids.tolist() == np.concatenate([e.ids for e in encoded]).tolist()
    assert store.tokens == len(store.ids)
    assert int(store.ids[store.offsets[1] - 1]) == tokenizer.token_to_id(EOS_TOKEN)


def test_a_store_is_built_once_and_shared_by_fit_and_content(
    mixed: Path, tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[str] = []
    real = store_module._build
    monkeypatch.setattr(
        store_module, "_build", lambda path, *a, **kw: (builds.append(path), real(path, *a, **kw))
    )
    root = tmp_path / "tokens"
    first = build(mixed, tokenizer, root)
    again = build(mixed, tokenizer, root)
    assert builds == [str(mixed)] and again.path == first.path

    # Another fit is another store; a copy of the file (same content) shares the first.
    other_fit = build(mixed, tokenizer, root, fit=SEQ * 2)
    copy = tmp_path / "elsewhere" / "copy.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(mixed.read_bytes())
    assert build(copy, tokenizer, root).path == first.path
    assert other_fit.path != first.path and len(builds) == 2


def test_two_builders_of_one_store_build_it_once(
    mixed: Path, tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[int] = []
    real = store_module._build

    def slow(*a: Any, **kw: Any) -> None:
        builds.append(1)
        time.sleep(0.5)  # the other builder arrives meanwhile and waits on the lock
        real(*a, **kw)

    monkeypatch.setattr(store_module, "_build", slow)
    root = tmp_path / "tokens"
    key = key_for(mixed, tokenizer, SEQ)
    opened: list[tuple[TokenFile, bool]] = []
    waited: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: opened.append(
                ensure_store(str(mixed), tokenizer, key, root, progress=lambda: waited.append(1))
            )
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1
    assert len(opened) == 2 and opened[0][0].path == opened[1][0].path
    assert sorted(built for _, built in opened) == [False, True], "one built, one opened"
    assert waited, "the builder that waited said it was not hung"


def test_a_failed_build_leaves_nothing_that_looks_complete(
    tmp_path: Path, tokenizer: Tokenizer, make_jsonl: Callable[..., Path]
) -> None:
    rows = [{"source": "a", "target": " b"}] * 5000  # more than one batch before the bad line
    path = make_jsonl(tmp_path / "bad.jsonl", rows)
    with path.open("ab") as f:
        f.write(b'{"source": "caf\xe9", "target": " b"}\n')  # Latin-1: the file is not UTF-8
    root = tmp_path / "tokens"
    with pytest.raises(DataError, match=r"bad\.jsonl: not UTF-8 text"):
        build(path, tokenizer, root)
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []


def test_a_store_keeps_the_lines_that_are_not_records_and_only_then_is_format_2(
    tmp_path: Path, tokenizer: Tokenizer, make_jsonl: Callable[..., Path]
) -> None:
    rows = [{"source": "a", "target": " b"}] * 5000  # the bad lines in the second batch
    clean = make_jsonl(tmp_path / "clean.jsonl", rows)
    path = make_jsonl(tmp_path / "bad.jsonl", rows)
    with path.open("a") as f:
        f.write("{not json\n" + '{"source": "a"}\n' * (store_module.MAX_INVALID_LINES + 1))
    root = tmp_path / "tokens"
    store = build(path, tokenizer, root)
    assert len(store) == 5000  # the records; the other lines are not rows
    assert store.invalid == {"malformed_json": 1, "wrong_shape": store_module.MAX_INVALID_LINES + 1}
    assert len(store.invalid_lines) == store_module.MAX_INVALID_LINES
    first, second = store.invalid_lines[:2]
    assert first.message("any/path.jsonl") == (
        "any/path.jsonl:5001: not valid JSON (Expecting property name enclosed in double quotes "
        "at column 2)"
    )
    assert (second.line, second.reason, second.detail) == (
        5002,
        "wrong_shape",
        "missing field 'target'",
    )
    # Workers from before format 2 refuse a store they could not read the bad lines of, and
    # share every other: a clean file's store is format 1, as they write it.
    assert json.loads((store.path / META).read_text())["identity"]["format"] == 2
    clean_store = build(clean, tokenizer, root)
    assert json.loads((clean_store.path / META).read_text())["identity"]["format"] == 1
    assert clean_store.invalid == {} and clean_store.invalid_lines == []
    # Both open again as they are, without a rebuild.
    assert build(path, tokenizer, root).invalid == store.invalid


def test_a_file_changed_since_its_digest_is_refused_and_no_store_is_published(
    mixed: Path, tokenizer: Tokenizer, tmp_path: Path, rewrite_in_place: Rewrite
) -> None:
    root = tmp_path / "tokens"
    key = key_for(mixed, tokenizer, SEQ)  # the digest a claim carries, taken before the build
    rewrite_in_place(mixed, mixed.read_bytes().replace(b"cat", b"dog"))
    with pytest.raises(DataError, match=re.escape(f"{mixed} changed while it was read")) as refused:
        ensure_store(str(mixed), tokenizer, key, root)
    assert refused.value.cause == "data"
    assert key.file_sha256 in str(refused.value) and sha256_file(mixed) in str(refused.value)
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []


def dead_pid() -> int:
    """The pid of a process of this host that has ended (and been waited for)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def temporary(root: Path, name: str, *, idle_hours: float, written_hours: float | None) -> Path:
    """A half-built store `name` as a builder leaves it: its directory last changed
    `idle_hours` ago, its ids last written `written_hours` ago (default: as long)."""
    path = root / name
    path.mkdir(parents=True)
    (path / "ids.bin").write_bytes(b"\0" * 10)
    now = time.time()
    for part, hours in ((path / "ids.bin", written_hours), (path, idle_hours)):
        then = now - 3600 * (idle_hours if hours is None else hours)
        os.utime(part, (then, then))
    return path


def test_a_builder_removes_only_the_temporaries_whose_builder_it_can_prove_dead(
    mixed: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    root = tmp_path / "tokens"
    key = key_for(mixed, tokenizer, SEQ)
    here = Builder.this()
    dead = replace(here, pid=dead_pid())
    elsewhere = replace(here, host="gpu-7.elsewhere")
    old_hours = ABANDONED_AFTER_SECONDS / 3600 + 1
    # (builder or a name of the format before builders were named, hours idle, hours since
    # its files were last written)
    kept = {
        "a live builder here": (here, 0, None),
        "a recent one of a dead pid on another host": (replace(elsewhere, pid=dead.pid), 1, None),
        "another host's, its files written a minute ago": (elsewhere, old_hours, 1 / 60),
        "one of an older name, recent": (f".tmp-{key.name}-{dead.pid}-deadbeef", 1, None),
    }
    removed = {
        "a dead builder here, recent": (dead, 0, None),
        "one here from before a reboot": (replace(here, boot="rebooted"), 0, None),
        "an old one from another host": (elsewhere, old_hours, None),
        "a live pid's here, untouched for a day (the pid reused)": (here, old_hours, None),
        "one of an older name, old": (f".tmp-{key.name}-{here.pid}-deadbeef", old_hours, None),
    }
    paths = {
        what: temporary(
            root,
            owner if isinstance(owner, str) else owner.temporary(root, key).name,
            idle_hours=idle,
            written_hours=written,
        )
        for what, (owner, idle, written) in (kept | removed).items()
    }
    store = build(mixed, tokenizer, root)
    assert store.path == root / key.name and len(store) == len(MIXED)
    assert {what for what in kept if not paths[what].exists()} == set(), "removed, not dead"
    assert {what for what in removed if paths[what].exists()} == set(), "dead, but kept"


def test_a_damaged_store_is_refused_on_open_and_rebuilt(
    mixed: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    root = tmp_path / "tokens"
    store = build(mixed, tokenizer, root)
    key = key_for(mixed, tokenizer, SEQ)
    ids = store.path / "ids.bin"
    ids.write_bytes(ids.read_bytes()[:-2])  # truncated
    with pytest.raises(DataError, match=r"ids\.bin has"):
        open_store(store.path, key)
    with pytest.raises(DataError, match="was built for"):
        open_store(store.path, StoreKey(key.file_sha256, key.tokenizer_sha256, fit=SEQ + 1))

    rebuilt = build(mixed, tokenizer, root)
    assert len(rebuilt) == len(MIXED)
    assert [p.name.startswith(".broken-") for p in root.iterdir()].count(True) == 1
    meta = json.loads((rebuilt.path / META).read_text())
    assert meta["files"]["ids.bin"] == (rebuilt.path / "ids.bin").stat().st_size


def test_a_missing_file_is_named(tokenizer: Tokenizer, tmp_path: Path) -> None:
    stores = Stores(tmp_path / "tokens", tokenizer)
    with pytest.raises(DataError, match=r"nowhere\.jsonl: file not found"):
        stores.get(str(tmp_path / "nowhere.jsonl"), fit=None)
    with pytest.raises(DataError, match="not a file"):
        stores.get(str(tmp_path), fit=None)


def test_a_build_says_how_much_of_its_file_it_has_read(
    make_text_file: Callable[..., Path], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    path = make_text_file(documents=3000)
    heard: list[tuple[str, float]] = []
    stores = Stores(tmp_path / "tokens", tokenizer, fraction=lambda f, s: heard.append((f, s)))
    stores.get(str(path), fit=None)
    shares = [share for _, share in heard]
    assert {file for file, _ in heard} == {str(path)}
    assert shares == sorted(shares) and shares[-1] == 1.0 and 0.0 < shares[0] <= 1.0
    heard.clear()
    stores.get(str(path), fit=None)
    assert heard == [], "opening a built store prepares nothing"
