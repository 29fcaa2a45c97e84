"""`assemble_batch`, the store's columnar encoder, against the record-by-record encoder it
replaces for text and pairs: the same ids, masks and reports, field by field."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from worker.data.encode import EncodedBatch, assemble, assemble_batch
from worker.data.records import Record, parse_record

EOS = 3


def record(value: dict[str, Any], line: int) -> Record:
    return parse_record("data.jsonl", line, json.dumps(value))


def random_ids(rng: random.Random) -> list[int]:
    """Ids of a piece: often empty or one id, sometimes holding the EOS id itself (a tokenizer
    whose vocabulary can spell it), otherwise up to 40 ids."""
    n = rng.choice([0, 1, 1, 2, rng.randint(3, 40)])
    return [
        rng.choice([EOS, *range(4, 300)]) if rng.random() < 0.05 else rng.randint(4, 300)
        for _ in range(n)
    ]


def random_batch(
    rng: random.Random, size: int, kinds: tuple[str, ...]
) -> tuple[list[Record], list[list[list[int]]]]:
    records, pieces = [], []
    for line in range(1, size + 1):
        kind = rng.choice(kinds)
        if kind == "text":
            records.append(record({"text": "t"}, line))
            pieces.append([random_ids(rng)])
        else:
            records.append(record({"source": "s", "target": "t"}, line))
            pieces.append([random_ids(rng), random_ids(rng)])
    return records, pieces


def assert_same(got: EncodedBatch, expected: EncodedBatch) -> None:
    for field in (
        "ids",
        "loss_mask",
        "lengths",
        "fits",
        "zero_target",
        "source_tokens",
        "target_tokens",
        "total_tokens",
        "tokens_trimmed",
    ):
        a, b = getattr(got, field), getattr(expected, field)
        assert a.dtype.kind == b.dtype.kind, field
        np.testing.assert_array_equal(a, b, err_msg=field)
    assert list(got.dropped_segments) == list(expected.dropped_segments)
    assert list(got.trimmed_segments) == list(expected.trimmed_segments)


@pytest.mark.parametrize("kinds", [("pair",), ("text",), ("text", "pair")])
@pytest.mark.parametrize("sequence_length", [None, 1, 8, 30])
def test_columns_equal_the_record_by_record_encoder(
    kinds: tuple[str, ...], sequence_length: int | None
) -> None:
    rng = random.Random(f"{kinds}-{sequence_length}")
    for size in (1, 2, 7, 300):
        records, pieces = random_batch(rng, size, kinds)
        got = assemble_batch(records, pieces, EOS, sequence_length)
        expected = EncodedBatch.of(assemble(records, pieces, EOS, sequence_length))
        assert_same(got, expected)


def test_the_cases_that_differ_by_one_are_covered() -> None:
    """The random batches above meet each edge at least once; here they are by name."""
    records, pieces = zip(
        *[
            (record({"source": "", "target": "t"}, 1), [[], [5]]),  # first target id untrained
            (record({"source": "s", "target": ""}, 2), [[5], []]),  # nothing but the EOS
            (record({"source": "s", "target": "t"}, 3), [[5], [EOS]]),  # an EOS in the target
            (record({"text": ""}, 4), [[]]),  # an empty text: the EOS alone
            (record({"source": "s", "target": "t"}, 5), [[5] * 6, [6] * 3]),  # 10 ids: limit 9
        ],
        strict=True,
    )
    got = assemble_batch(records, pieces, EOS, 8)
    assert_same(got, EncodedBatch.of(assemble(records, pieces, EOS, 8)))
    assert got.target_tokens.tolist() == [0, 0, 0, 0, 3]
    assert got.zero_target.tolist() == [True, True, True, True, False]
    assert got.fits.tolist() == [True, True, True, True, False]


def test_chats_and_segments_are_assembled_one_by_one() -> None:
    records = [
        record(
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            1,
        ),
        record({"source": "s", "target": "t"}, 2),
        record(
            {
                "segments": [
                    {"text": "x", "role": "doc", "elastic": "drop"},
                    {"text": "y", "role": "q"},
                ],
                "target": "t",
            },
            3,
        ),
    ]
    pieces = [[[7, 8], [], [9], [10]], [[5], [6]], [[11] * 10, [12], [13]]]
    got = assemble_batch(records, pieces, EOS, 8)
    assert_same(got, EncodedBatch.of(assemble(records, pieces, EOS, 8)))
    assert got.dropped_segments[2] == (0,)  # the elastic passage made room
