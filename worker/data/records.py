"""Reading data files into records, whatever their format.

One record per non-blank line. A file is JSONL when its name ends in .jsonl or .json (before an
optional .zst), plain text otherwise (every line a document). Each JSON line is one of:

- `{"text": ...}`: pretraining text;
- `{"source": ..., "target": ...}`: a supervised pair;
- `{"messages": [{"role", "content"}, ...]}`: a chat, whose assistant turns are the targets;
- `{"segments": [{"text", "role", "elastic"?}, ...], "target": ...}`: a prompt in parts, whose
  elastic parts (passages, documents) may be dropped or trimmed to fit, never the others.

Other keys (ids, metadata) are ignored. Every error names the file and the line.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Iterator
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


def iter_records(path: str, digest: Hash | None = None) -> Iterator[tuple[Record, int]]:
    """Every record of a file, in order, streaming, each with the bytes read so far; the file's
    bytes to `digest` as they are read (read_lines_at)."""
    jsonl = is_jsonl(path)
    for n, line, at in read_lines_at(path, digest):
        if jsonl:
            yield parse_record(path, n, line), at
        else:
            yield Record(path=path, line=n, kind="text", raw=line, text=line), at


def parse_record(path: str, line: int, raw: str) -> Record:
    where = f"{path}:{line}"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from err
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object, one of {_SHAPES}")
    base = functools.partial(Record, path=path, line=line, raw=raw)
    if "segments" in value:
        return base(
            kind="segmented",
            segments=_segments(where, value["segments"]),
            target=_string(where, value, "target"),
        )
    if "messages" in value:
        return base(kind="chat", messages=_messages(where, value["messages"]))
    if "source" in value or "target" in value:
        return base(
            kind="pair",
            source=_string(where, value, "source"),
            target=_string(where, value, "target"),
        )
    if "text" in value:
        return base(kind="text", text=_string(where, value, "text"))
    raise DataError(f"{where}: unknown record with keys {sorted(value)[:8]}; expected {_SHAPES}")


def _string(where: str, value: dict[str, Any], field: str) -> str:
    if field not in value:
        raise DataError(f"{where}: missing field {field!r}")
    if not isinstance(value[field], str):
        raise DataError(
            f"{where}: field {field!r} must be a string, not {type(value[field]).__name__}"
        )
    return value[field]


def _messages(where: str, value: Any) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field 'messages' must be a non-empty list")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise DataError(f"{where}: messages[{i}] must be an object {{role, content}}")
        out.append(
            Message(
                role=_string(f"{where}: messages[{i}]", item, "role"),
                content=_string(f"{where}: messages[{i}]", item, "content"),
            )
        )
    return tuple(out)


def _segments(where: str, value: Any) -> tuple[Segment, ...]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field 'segments' must be a non-empty list")
    out = []
    for i, item in enumerate(value):
        at = f"{where}: segments[{i}]"
        if not isinstance(item, dict):
            raise DataError(f"{at} must be an object {{text, role, elastic?}}")
        elastic = item.get("elastic")
        if elastic is True:
            elastic = "drop"
        elif elastic is False:
            elastic = None
        if elastic is not None and elastic not in ELASTIC:
            raise DataError(
                f"{at}: elastic must be one of {', '.join(map(repr, ELASTIC))}, true or false, "
                f"not {elastic!r}"
            )
        role = item.get("role", "segment")
        if not isinstance(role, str):
            raise DataError(f"{at}: field 'role' must be a string")
        out.append(
            Segment(text=_string(at, item, "text"), role=role, elastic=cast(Elastic, elastic))
        )
    return tuple(out)
