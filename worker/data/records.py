"""Reading data files into records, whatever their format.

One record per non-blank line. A file is JSONL when its name ends in .jsonl or .json (before an
optional .zst), plain text otherwise (every line a document). Each JSON line is one of:

- `{"text": ...}`: pretraining text;
- `{"source": ..., "target": ...}`: a supervised pair;
- `{"messages": [{"role", "content"}, ...]}`: a chat, whose assistant turns are the targets;
- `{"segments": [{"text", "role", "elastic"?}, ...], "target": ...}`: a prompt in parts, whose
  elastic parts (passages, documents) may be dropped or trimmed to fit, never the others.

Other keys (ids, metadata) are ignored. Every error names the file and the line. A line that is
not a record is a RecordError; a reader that skips such lines (a token store, which records
them for evaluation to skip and training to refuse) passes `invalid` to `iter_records`.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Literal, cast

from worker.error import DataError

if TYPE_CHECKING:
    from hashlib import _Hash as Hash

RecordKind = Literal["text", "pair", "chat", "segmented"]
# How an elastic segment may shrink: dropped whole only, or trimmed from its start or its end
# (and dropped when nothing of it is left).
Elastic = Literal["drop", "start", "end"]
ELASTIC: tuple[str, ...] = ("drop", "start", "end")

_JSON_SUFFIXES = (".jsonl", ".json")
_CHUNK = 1 << 20  # read past the last line, to hash the file to its end
_SHAPES = (
    '{"text"}, {"source", "target"}, {"messages": [{"role", "content"}]} or '
    '{"segments": [{"text", "role", "elastic"?}], "target"}'
)


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Segment:
    text: str
    role: str
    elastic: Elastic | None = None


@dataclass(frozen=True)
class Record:
    path: str
    line: int
    kind: RecordKind
    raw: str  # the line as read (decompressed), for writing length-filtered copies
    text: str = ""  # text
    source: str = ""  # pair
    target: str = ""  # pair, segmented
    messages: tuple[Message, ...] = ()  # chat
    segments: tuple[Segment, ...] = ()  # segmented

    def key(self) -> tuple[Any, ...]:
        """What makes two records the same, whatever their JSON spelling."""
        return (self.kind, self.text, self.source, self.target, self.messages, self.segments)


def is_jsonl(path: str) -> bool:
    return path.removesuffix(".zst").endswith(_JSON_SUFFIXES)


class _Hashed(io.RawIOBase):
    """A raw file that passes every byte read from it to `digest` (a hashlib object), in
    order: the bytes the lines were decoded from, hashed as they are read, not read twice."""

    def __init__(self, raw: io.FileIO, digest: Hash) -> None:
        self._raw = raw
        self._digest = digest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        n = self._raw.readinto(buffer)
        if n:
            self._digest.update(memoryview(buffer)[:n])
        return n

    def tell(self) -> int:
        return self._raw.tell()

    def close(self) -> None:
        self._raw.close()
        super().close()


def _open_text(path: str, digest: Hash | None = None) -> tuple[io.TextIOBase, io.RawIOBase]:
    """The file as text (decompressed when it ends in .zst), and the raw file under it, whose
    position says how much of the file has been read (and whose bytes go to `digest`)."""
    file = io.FileIO(path, "r")
    raw: io.RawIOBase = file if digest is None else _Hashed(file, digest)
    try:
        if path.endswith(".zst"):
            import zstandard

            source = cast(IO[bytes], raw)  # a raw file's read() is all the reader calls
            reader = zstandard.ZstdDecompressor().stream_reader(source, closefd=True)
            return io.TextIOWrapper(reader, encoding="utf-8"), raw
        return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8"), raw
    except BaseException:
        raw.close()
        raise


def read_lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of every non-blank line; `.zst` files decompressed."""
    for number, line, _ in read_lines_at(path):
        yield number, line


def read_lines_at(path: str, digest: Hash | None = None) -> Iterator[tuple[int, str, int]]:
    """`read_lines` with, for each line, the bytes of the file read so far (of the compressed
    file for .zst; read ahead in blocks, so a measure of progress, not of the line). With
    `digest`, every byte of the file goes to it as it is read, to the end of the file (past the
    end of a .zst frame too) once the last line is out."""
    try:
        stream, raw = _open_text(path, digest)
        with stream:
            for number, line in enumerate(stream, start=1):
                if line.strip():
                    yield number, line.rstrip("\n"), raw.tell()
            if digest is not None:
                while raw.read(_CHUNK):
                    pass
    except FileNotFoundError as err:
        raise DataError(f"{path}: file not found") from err
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    except OSError as err:  # unreadable, a directory: retrying will not help
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from err
    except Exception as err:  # zstandard.ZstdError: a corrupt or truncated frame
        if type(err).__name__ == "ZstdError":
            raise DataError(f"{path}: not a valid zstd file ({err})") from err
        raise


def read_records(path: str) -> list[Record]:
    """Every record of a file, in order (small files: tests, evaluation sets)."""
    return [record for record, _ in iter_records(path)]


class RecordError(DataError):
    """A line that is not a record: not JSON (`reason` "malformed_json"), or JSON of no shape
    a record has ("wrong_shape"; contracts.reports.SKIP_REASONS). The message names the file
    and the line; `detail` says what is wrong without them, as a token store keeps it (stores
    are shared by content, whatever path a reader names the file by)."""

    def __init__(self, path: str, line: int, reason: str, detail: str) -> None:
        super().__init__(f"{path}:{line}: {detail}")
        self.line = line
        self.reason = reason
        self.detail = detail


class _NotARecord(Exception):
    """What is wrong with a line's JSON, without the file and line (RecordError adds them)."""


def iter_records(
    path: str,
    digest: Hash | None = None,
    *,
    invalid: Callable[[RecordError], None] | None = None,
) -> Iterator[tuple[Record, int]]:
    """Every record of a file, in order, streaming, each with the bytes read so far; the file's
    bytes to `digest` as they are read (read_lines_at). A line that is not a record raises its
    RecordError, or, with `invalid`, goes to it and the reading goes on."""
    jsonl = is_jsonl(path)
    for n, line, at in read_lines_at(path, digest):
        if not jsonl:
            yield Record(path=path, line=n, kind="text", raw=line, text=line), at
            continue
        try:
            record = parse_record(path, n, line)
        except RecordError as err:
            if invalid is None:
                raise
            invalid(err)
            continue
        yield record, at


def parse_record(path: str, line: int, raw: str) -> Record:
    """The record of one JSONL line; RecordError naming the file and line if it is none."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        detail = f"not valid JSON ({err.msg} at column {err.colno})"
        raise RecordError(path, line, "malformed_json", detail) from err
    try:
        return _record(functools.partial(Record, path=path, line=line, raw=raw), value)
    except _NotARecord as err:
        raise RecordError(path, line, "wrong_shape", str(err)) from None


def _record(base: Callable[..., Record], value: Any) -> Record:
    if not isinstance(value, dict):
        raise _NotARecord(f"expected a JSON object, one of {_SHAPES}")
    if "segments" in value:
        return base(
            kind="segmented",
            segments=_segments(value["segments"]),
            target=_string(value, "target"),
        )
    if "messages" in value:
        return base(kind="chat", messages=_messages(value["messages"]))
    if "source" in value or "target" in value:
        return base(kind="pair", source=_string(value, "source"), target=_string(value, "target"))
    if "text" in value:
        return base(kind="text", text=_string(value, "text"))
    raise _NotARecord(f"unknown record with keys {sorted(value)[:8]}; expected {_SHAPES}")


def _string(value: dict[str, Any], field: str, at: str = "") -> str:
    """`value[field]`, a string; `at` ("messages[0]: ") says where `value` is in the line."""
    if field not in value:
        raise _NotARecord(f"{at}missing field {field!r}")
    if not isinstance(value[field], str):
        raise _NotARecord(
            f"{at}field {field!r} must be a string, not {type(value[field]).__name__}"
        )
    return value[field]


def _messages(value: Any) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise _NotARecord("field 'messages' must be a non-empty list")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _NotARecord(f"messages[{i}] must be an object {{role, content}}")
        at = f"messages[{i}]: "
        out.append(Message(role=_string(item, "role", at), content=_string(item, "content", at)))
    return tuple(out)


def _segments(value: Any) -> tuple[Segment, ...]:
    if not isinstance(value, list) or not value:
        raise _NotARecord("field 'segments' must be a non-empty list")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _NotARecord(f"segments[{i}] must be an object {{text, role, elastic?}}")
        at = f"segments[{i}]: "
        elastic = item.get("elastic")
        if elastic is True:
            elastic = "drop"
        elif elastic is False:
            elastic = None
        if elastic is not None and elastic not in ELASTIC:
            raise _NotARecord(
                f"{at}elastic must be one of {', '.join(map(repr, ELASTIC))}, true or false, "
                f"not {elastic!r}"
            )
        role = item.get("role", "segment")
        if not isinstance(role, str):
            raise _NotARecord(f"{at}field 'role' must be a string")
        out.append(
            Segment(text=_string(item, "text", at), role=role, elastic=cast(Elastic, elastic))
        )
    return tuple(out)
