"""Preparing a token store ahead of time (worker.data.store.prepare_file): it builds the store a
phase of the same objective and sequence_length maps, once, and says whether it built it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from contracts.jobs import PrepareRequest
from worker.data.store import META, Stores, prepare_file
from worker.error import DataError

SEQ = 32


def request(path: Path, objective: str = "summarization") -> PrepareRequest:
    return PrepareRequest(
        path=str(path), tokenizer="unused", objective=objective, sequence_length=SEQ
    )


def test_a_prepared_store_is_the_one_a_phase_maps_and_is_built_once(
    make_pairs_file: Callable[..., Path],
    tokenizer: Tokenizer,
    tmp_path: Path,
    builds: list[str],
) -> None:
    path = make_pairs_file(records=20)
    stores = Stores(tmp_path / "tokens", tokenizer)

    first = prepare_file(request(path), stores)
    assert first.built is True and builds == [str(path)]
    assert (first.path, first.records) == (str(path), 20)
    meta = json.loads((Path(first.store) / META).read_text())
    assert (meta["records"], meta["tokens"], meta["identity"]["fit"]) == (20, first.tokens, SEQ)
    assert first.tokens > 0 and first.seconds >= 0

    # What a supervised phase at this sequence_length opens (worker.data.batch), from a fresh
    # Stores as a later attempt has: the prepared store, not a new build.
    phase = Stores(tmp_path / "tokens", tokenizer).get(str(path), fit=SEQ)
    assert str(phase.path) == first.store and builds == [str(path)]

    again = prepare_file(request(path), Stores(tmp_path / "tokens", tokenizer))
    assert again.built is False and builds == [str(path)]
    assert (again.store, again.records, again.tokens) == (first.store, 20, first.tokens)


def test_text_is_prepared_unfitted_as_continued_pretraining_reads_it(
    make_text_file: Callable[..., Path], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    path = make_text_file(documents=10)
    prepared = prepare_file(
        request(path, "continued_pretrain"), Stores(tmp_path / "tokens", tokenizer)
    )
    assert prepared.built and prepared.store.endswith("-raw")
    assert prepared.records == 10
    phase = Stores(tmp_path / "tokens", tokenizer).get(str(path), fit=None)
    assert str(phase.path) == prepared.store


def test_a_damaged_store_is_built_again_and_says_so(
    make_pairs_file: Callable[..., Path],
    tokenizer: Tokenizer,
    tmp_path: Path,
    builds: list[str],
) -> None:
    path = make_pairs_file(records=5)
    first = prepare_file(request(path), Stores(tmp_path / "tokens", tokenizer))
    ids = Path(first.store) / "ids.bin"
    ids.write_bytes(ids.read_bytes()[:-2])

    again = prepare_file(request(path), Stores(tmp_path / "tokens", tokenizer))
    assert again.built is True and len(builds) == 2
    assert (again.store, again.records) == (first.store, 5)


def test_a_missing_file_is_named_and_nothing_is_built(
    tokenizer: Tokenizer, tmp_path: Path, builds: list[str]
) -> None:
    stores = Stores(tmp_path / "tokens", tokenizer)
    with pytest.raises(DataError, match=r"nowhere\.jsonl: file not found"):
        prepare_file(request(tmp_path / "nowhere.jsonl"), stores)
    with pytest.raises(DataError, match="not a file"):
        prepare_file(request(tmp_path), stores)
    assert builds == []


def test_a_file_with_a_line_that_is_not_a_record_is_refused_as_a_phase_refuses_it(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = tmp_path / "sft.jsonl"
    path.write_text('{"source": "a", "target": " b"}\n{"source": "a", "target": " b"\n')
    with pytest.raises(DataError) as refused:
        prepare_file(request(path), Stores(tmp_path / "tokens", tokenizer))
    assert str(refused.value).startswith(f"{path}:2: not valid JSON")
    assert "1 lines of it are not records, so a phase reading it refuses it" in str(refused.value)
