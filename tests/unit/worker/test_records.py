from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from worker.data.records import Message, Record, Segment, read_records
from worker.error import DataError


def write_lines(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_each_json_shape_reads_as_its_record_kind(tmp_path: Path) -> None:
    lines = [
        json.dumps({"text": "the cat sat", "id": 7}),
        "",
        json.dumps({"source": "reverse cat:", "target": " cat", "meta": {"x": 1}}),
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "the dog"},
                ]
            }
        ),
        "   ",
        json.dumps(
            {
                "segments": [
                    {"text": "Answer.", "role": "instruction"},
                    {"text": "p1", "role": "passage", "elastic": True},
                    {"text": "p2", "role": "passage", "elastic": "start"},
                    {"text": "p3", "role": "passage", "elastic": "end"},
                    {"text": "p4", "role": "passage", "elastic": "drop"},
                    {"text": "Why?", "role": "question", "elastic": False},
                    {"text": "no role"},
                ],
                "target": " because",
            }
        ),
    ]
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    text, pair, chat, segmented = read_records(str(path))

    # Line numbers count blank lines: they are the file's own line numbers.
    assert [r.line for r in (text, pair, chat, segmented)] == [1, 3, 4, 6]
    assert all(r.path == str(path) for r in (text, pair, chat, segmented))
    assert (text.kind, text.text, text.raw) == ("text", "the cat sat", lines[0])
    assert (pair.kind, pair.source, pair.target) == ("pair", "reverse cat:", " cat")
    assert chat.kind == "chat"
    assert chat.messages == (Message("user", "hi"), Message("assistant", "the dog"))
    assert segmented.kind == "segmented"
    assert segmented.target == " because"
    assert segmented.segments == (
        Segment("Answer.", "instruction", None),
        Segment("p1", "passage", "drop"),  # elastic true means dropped whole
        Segment("p2", "passage", "start"),
        Segment("p3", "passage", "end"),
        Segment("p4", "passage", "drop"),
        Segment("Why?", "question", None),
        Segment("no role", "segment", None),
    )


@pytest.mark.parametrize("name", ["notes.txt", "notes"])
def test_a_plain_text_file_is_one_document_per_non_blank_line(tmp_path: Path, name: str) -> None:
    path = write_lines(tmp_path / name, ["the cat sat", "", '{"text": "not json here"}', "x y"])
    records = read_records(str(path))
    assert [(r.kind, r.line, r.text) for r in records] == [
        ("text", 1, "the cat sat"),
        ("text", 3, '{"text": "not json here"}'),
        ("text", 4, "x y"),
    ]


@pytest.mark.parametrize(
    ("name", "lines"),
    [
        ("data.jsonl", [json.dumps({"source": "a", "target": "b"}), "", '{"text": "c"}']),
        ("data.json", ['{"text": "one"}', '{"text": "two"}']),
        ("data.txt", ["plain one", "", "plain two"]),
    ],
)
def test_a_zst_file_reads_like_its_plain_version(
    tmp_path: Path, make_zst: Callable[[Path], Path], name: str, lines: list[str]
) -> None:
    plain = write_lines(tmp_path / name, lines)
    compressed = make_zst(plain)
    plain_records = read_records(str(plain))
    zst_records = read_records(str(compressed))
    assert [r.path for r in zst_records] == [str(compressed)] * len(plain_records)
    assert [(r.line, r.kind, r.raw, r.key()) for r in zst_records] == [
        (r.line, r.kind, r.raw, r.key()) for r in plain_records
    ]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"source": "a", "target": "b"', "not valid JSON"),
        ('["a", "b"]', "expected a JSON object"),
        ('{"source": "a"}', "missing field 'target'"),
        ('{"target": "a"}', "missing field 'source'"),
        ('{"source": "a", "target": 3}', "field 'target' must be a string, not int"),
        ('{"text": null}', "field 'text' must be a string"),
        ('{"id": 1, "body": "x"}', "unknown record with keys \\['body', 'id'\\]"),
        ('{"messages": []}', "field 'messages' must be a non-empty list"),
        ('{"messages": ["hi"]}', "messages\\[0\\] must be an object"),
        ('{"messages": [{"role": "user"}]}', "messages\\[0\\]: missing field 'content'"),
        ('{"segments": "x", "target": "t"}', "field 'segments' must be a non-empty list"),
        ('{"segments": [{"text": "a"}]}', "missing field 'target'"),
        ('{"segments": [{"role": "q"}], "target": "t"}', "segments\\[0\\]: missing field 'text'"),
        (
            '{"segments": [{"text": "a"}, {"text": "b", "elastic": "middle"}], "target": "t"}',
            "segments\\[1\\]: elastic must be one of 'drop', 'start', 'end', true or false, "
            "not 'middle'",
        ),
        (
            '{"segments": [{"text": "a", "role": 2}], "target": "t"}',
            "segments\\[0\\]: field 'role' must be",
        ),
    ],
)
def test_a_malformed_line_names_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", ['{"source": "a", "target": "b"}', "", line])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: {problem}"):
        read_records(str(path))


def test_a_malformed_line_in_a_zst_file_names_its_line(
    tmp_path: Path, make_zst: Callable[[Path], Path]
) -> None:
    plain = write_lines(tmp_path / "bad.jsonl", ['{"text": "a"}', '{"text": "b"', '{"text": "c"}'])
    compressed = make_zst(plain)
    with pytest.raises(DataError, match=rf"^{re.escape(str(compressed))}:2: not valid JSON"):
        read_records(str(compressed))


def test_unreadable_files_are_data_errors_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DataError, match=rf"^{re.escape(str(missing))}: file not found"):
        read_records(str(missing))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"caf\xe9\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(latin1))}: not UTF-8 text"):
        read_records(str(latin1))
    corrupt = tmp_path / "corrupt.jsonl.zst"
    corrupt.write_bytes(b"this is not zstd at all")
    with pytest.raises(DataError, match=rf"^{re.escape(str(corrupt))}: not a valid zstd file"):
        read_records(str(corrupt))


def test_record_identity_ignores_json_spelling_and_extra_keys(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "same.jsonl",
        [
            '{"source": "a", "target": "b"}',
            '{"target":"b","source":"a","id":9}',
            '{"source": "a", "target": "c"}',
            '{"text": "a"}',
        ],
    )
    first, second, other, text = read_records(str(path))
    assert first.key() == second.key()
    assert first.raw != second.raw
    assert len({first.key(), other.key(), text.key()}) == 3


def test_an_empty_file_has_no_records(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    assert read_records(str(path)) == []


def test_records_are_immutable(tmp_path: Path) -> None:
    (record,) = read_records(str(write_lines(tmp_path / "a.jsonl", ['{"text": "a"}'])))
    assert isinstance(record, Record)
    with pytest.raises(AttributeError):
        record.text = "b"  # type: ignore[misc]
