"""The token store: every data file is tokenized once, then memory-mapped by whoever reads it.

A store holds one file's records as the one encoder (worker.data.encode) makes them, for one
tokenizer, one version of the encoding rules and one fit: the sequence length supervised
records are fitted to (elastic segments dropped or trimmed), or none for text and for
measuring. Its name says all four (`StoreKey.name`), so every attempt, phase, run, inspection
and evaluation on the same artifact store shares it. Under `<artifact_root>/tokens/<name>/`:

- `ids.bin`: every record's token ids after fitting, back to back, in the smallest unsigned
  dtype that holds the vocabulary (a text record is its text + EOS, so text files are one
  EOS-joined stream, ready to cut into windows);
- `offsets.bin`: int64, record i is ids[offsets[i]:offsets[i + 1]];
- `mask.bin`: the loss mask of every id, one bit each (little bit order);
- `records.bin`: per record, its line, kind, fit and the lengths of its encode report
  (`RECORD_DTYPE`), and a 64-bit hash of its content for counting duplicates;
- `segments.bin`: per segment of a segmented record, its role, elasticity and fate;
- `meta.json`, written last: the key, counts, dtype, roles and every file's size, and the
  lines that are not records (`invalid`: not JSON, or JSON of no record's shape): counted by
  reason, the first MAX_INVALID_LINES with their line and what is wrong. A store holds every
  line of its file, records or not, and its readers decide: training refuses a file with such
  lines, naming the first; evaluation skips and counts them; inspection lists them.

It is built streaming (ENCODE_BATCH records in memory at a time) into a temporary directory,
hashing the file's bytes as they are read (published only when they have the digest the name
says), fsynced and renamed into place, like a checkpoint: a directory without `meta.json` is
never opened, and a crash mid-build leaves only a temporary directory, which a later build
removes once it can prove its builder gone (`_remove_temporaries`), never a live one.
A lock file serialises builders of one store on a host (two workers wanting it do not both
build it); across hosts the rename decides, and the loser opens the winner's store. Opening
checks `meta.json` against the key and every file's size: cheap, whatever the store's size.

With an object store as the artifact root (`s3://`) no folder is shared: a worker keeps its
stores in its cache and publishes each it builds, and one that misses a store downloads the
published one before it would build it (`Published`, worker.remote.tokens).

One module of over 450 lines because the format, its reader and its builder change together: a
field of `RECORD_DTYPE` is written by `_build`, checked by `open_store` and read by `TokenFile`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import numpy as np
from tokenizers import Tokenizer

from contracts.jobs import PreparedStore, PrepareRequest
from contracts.reports import Claim
from contracts.workflow import ENCODER_VERSION
from runtime.digest import digest_path
from runtime.store import is_store_uri
from worker.data.encode import ZERO_TARGET, EncodedBatch, assemble_batch, tokenize, too_long
from worker.data.records import ELASTIC, Record, RecordError, iter_records
from worker.data.tokenizer import special_token_ids
from worker.error import DataError
from worker.files import fsync_dir, fsync_file
from worker.settings import get_settings

if TYPE_CHECKING:
    from hashlib import _Hash as Hash

log = logging.getLogger(__name__)

STORE_DIR = "tokens"
# Of the files below; a store of another format is rebuilt, never misread. Format 2 is format 1
# with `invalid` in meta.json. A store whose file has no invalid line is written as format 1,
# which workers from before format 2 share; one with invalid lines as format 2, which they
# refuse and rebuild (refusing the file, as they always did) instead of training on a file
# whose bad lines they cannot see. A format-1 store has none: its builder refused them.
FORMAT = 1
FORMAT_WITH_INVALID = 2
# Invalid lines a store names (their line and what is wrong); all are counted.
MAX_INVALID_LINES = 50
META = "meta.json"
DIGESTS = "digests"  # under a store root: runtime.digest's entries, which outlive a worker
_TMP_PREFIX = ".tmp-"
# A half-built store that nothing has written to for this long is taken for abandoned,
# whoever built it: a live build writes to it at every batch (about every second); a builder on
# another host cannot be asked whether it is alive (docs/data.md).
ABANDONED_AFTER_SECONDS = 24 * 3600
# Records encoded per tokenizer call, at most, and bytes of lines: the build's memory bound
# (the tokenizer's encodings take ~100 bytes per token), and one unit of progress.
ENCODE_BATCH = 4096
ENCODE_BYTES = 2**20

KINDS: tuple[str, ...] = ("text", "pair", "chat", "segmented")
_KIND_INDEX = {kind: i for i, kind in enumerate(KINDS)}
RECORD_DTYPE = np.dtype(
    [
        ("line", "<i8"),
        ("kind", "u1"),  # index into KINDS
        ("fits", "?"),
        ("zero_target", "?"),
        ("source_tokens", "<i4"),
        ("target_tokens", "<i4"),
        ("total_tokens", "<i4"),  # as encoded, before fitting
        ("tokens_trimmed", "<i4"),
        ("segments_dropped", "<i4"),
        ("segments_trimmed", "<i4"),
        ("key", "<u8"),  # hash of the record's content: equal records, equal keys
    ]
)
# A segment's fate when its record was fitted.
KEPT, TRIMMED, DROPPED = 0, 1, 2
SEGMENT_DTYPE = np.dtype(
    [
        ("record", "<i8"),
        ("role", "<i4"),  # index into the store's roles
        ("elastic", "i1"),  # 0: not elastic, else 1 + index into records.ELASTIC
        ("fate", "i1"),
    ]
)
_FILES = {
    "ids.bin": None,  # dtype in meta
    "offsets.bin": np.dtype("<i8"),
    "mask.bin": np.dtype("u1"),
    "records.bin": RECORD_DTYPE,
    "segments.bin": SEGMENT_DTYPE,
}


@dataclass(frozen=True)
class StoreKey:
    """What a store's content is a function of."""

    file_sha256: str
    tokenizer_sha256: str
    fit: int | None  # the sequence length records are fitted to; None: never fitted
    encoder_version: int = ENCODER_VERSION

    @property
    def name(self) -> str:
        fit = "raw" if self.fit is None else f"fit{self.fit}"
        return f"{self.file_sha256[:32]}-{self.tokenizer_sha256[:16]}-e{self.encoder_version}-{fit}"

    def identity(self, format: int = FORMAT) -> dict[str, Any]:
        return {
            "format": format,
            "file_sha256": self.file_sha256,
            "tokenizer_sha256": self.tokenizer_sha256,
            "encoder_version": self.encoder_version,
            "fit": self.fit,
        }


@dataclass(frozen=True)
class InvalidLine:
    """A line of a store's file that is not a record: its number, why (RecordError.reason)
    and what is wrong, without the file's path (RecordError.detail)."""

    line: int
    reason: str
    detail: str

    def message(self, path: str) -> str:
        """`file:line: detail`, with the path the reader names the file by."""
        return f"{path}:{self.line}: {self.detail}"


def store_root(root: str | Path) -> Path:
    """Where the token stores of the artifact store at `root` live: under it, or for an object
    store, in this worker's cache."""
    if is_store_uri(root):
        return get_settings().cache_dir / STORE_DIR
    return Path(root) / STORE_DIR


def artifact_root(claim: Claim) -> str:
    """The artifact store a claim's run lives in (a folder or an object store URI): its
    `artifact_dir` is `<root>/runs/<run>`."""
    return claim.artifact_dir.rstrip("/").rsplit("/", 2)[0]


# --- reading --------------------------------------------------------------------------------


def _map(path: Path, dtype: np.dtype[Any]) -> np.ndarray:
    """A read-only memory map of `path` (an empty array for an empty file: mmap refuses
    those)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class TokenFile:
    """An opened store: arrays mapped from disk, read only where a caller indexes them."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        self.source = str(meta["path"])  # the data file it was built from, for messages
        self.ids = _map(path / "ids.bin", np.dtype(meta["dtype"]))
        self.offsets = _map(path / "offsets.bin", np.dtype("<i8"))
        self._mask = _map(path / "mask.bin", np.dtype("u1"))
        self.records = _map(path / "records.bin", RECORD_DTYPE)
        self.segments = _map(path / "segments.bin", SEGMENT_DTYPE)
        self.roles: list[str] = list(meta["roles"])
        invalid = meta.get("invalid") or {}  # none in a format-1 store
        # Lines that are not records, by reason, and the first MAX_INVALID_LINES of them.
        self.invalid: dict[str, int] = dict(invalid.get("counts", {}))
        self.invalid_lines = [InvalidLine(*row) for row in invalid.get("lines", [])]

    def __len__(self) -> int:
        return len(self.records)

    @property
    def tokens(self) -> int:
        return int(self.meta["tokens"])

    def lengths(self) -> np.ndarray:
        """Ids per record (after fitting), int64."""
        return np.diff(self.offsets)

    def record(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids as int64, loss mask as bool) of record i, read from the maps."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return np.asarray(self.ids[start:end], dtype=np.int64), self.mask(start, end)

    def mask(self, start: int, end: int) -> np.ndarray:
        """The loss mask of ids[start:end]."""
        if end <= start:
            return np.zeros(0, bool)
        bits = np.unpackbits(self._mask[start // 8 : (end + 7) // 8], bitorder="little")
        offset = start % 8
        return bits[offset : offset + end - start].astype(bool)

    def kinds(self) -> np.ndarray:
        return np.asarray(self.records["kind"])

    def is_text(self) -> np.ndarray:
        """True for each text record (bool per record)."""
        return self.kinds() == KINDS.index("text")

    def first_of_other_kind(self, text: bool) -> int | None:
        """The first record that is not text (`text`) or is text (not `text`), if any."""
        other = np.flatnonzero(self.is_text() != text)
        return int(other[0]) if other.size else None

    def usable(self) -> np.ndarray:
        """True for each supervised record that training takes: it fits and has targets."""
        records = self.records
        return ~self.is_text() & records["fits"] & ~records["zero_target"]

    def unusable_reason(self, i: int, limit: int | None) -> str:
        """Why record i cannot be trained on, in the words of the encoder."""
        if self.records["zero_target"][i]:
            return ZERO_TARGET
        ids, mask = self.record(i)
        return too_long(len(ids), int(mask.sum()), limit if limit is not None else len(ids) - 1)


def open_store(directory: Path, key: StoreKey) -> TokenFile:
    """The store at `directory` if it is complete and built for `key`; DataError otherwise."""
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"token store {directory}: no readable {META} ({err})") from err
    identity = meta.get("identity")
    format = identity.get("format") if isinstance(identity, dict) else None
    if format not in (FORMAT, FORMAT_WITH_INVALID) or identity != key.identity(format):
        raise DataError(f"token store {directory} was built for {identity}, not {key.identity()}")
    for name, size in meta["files"].items():
        actual = (directory / name).stat().st_size if (directory / name).exists() else None
        if actual != size:
            raise DataError(f"token store {directory}: {name} has {actual} bytes, not {size}")
    return TokenFile(directory, meta)


def ensure_store(
    path: str,
    tokenizer: Tokenizer,
    key: StoreKey,
    root: Path,
    *,
    progress: Callable[[], None] | None = None,
    fraction: Callable[[float], None] | None = None,
    published: Published | None = None,
) -> tuple[TokenFile, bool]:
    """The store of `path` under `root`, built first if it is missing, and whether this call
    built it. `progress` is called as the build (or the wait for another builder) goes on;
    `fraction` with the share of the file read so far. With `published`, a missing store is
    downloaded from there when it is published, and one built here is published."""
    final = root / key.name
    if (final / META).exists():
        with contextlib.suppress(DataError):
            return _opened(open_store(final, key), published), False
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{key.name}.lock", progress):
        if final.exists():  # another builder finished while this one waited, or it is damaged
            try:
                return _opened(open_store(final, key), published), False
            except DataError as err:
                log.warning("%s; moving it aside and building it again", err)
                final.rename(root / f".broken-{key.name}-{uuid.uuid4().hex[:8]}")
        _remove_temporaries(root, key)
        if published is not None and (store := _download(key, root, published, progress)):
            return _opened(store, published), False
        started = time.perf_counter()
        tmp = Builder.this().temporary(root, key)
        try:
            _build(path, tokenizer, key, tmp, progress=progress, fraction=fraction)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a bad record, say; a SIGKILL leaves it
            raise
        try:
            os.rename(tmp, final)
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(tmp)  # another host published it first: use theirs
        fsync_dir(root)
        store = open_store(final, key)
        log.info(
            "built token store %s for %s: %d records, %d tokens in %.1f s",
            final,
            path,
            len(store),
            store.tokens,
            time.perf_counter() - started,
        )
        if published is not None:
            published.publish(key.name, final)
        return _opened(store, published), True


def _opened(store: TokenFile, published: Published | None) -> TokenFile:
    if published is not None:
        published.opened(store.path)
    return store


def _download(
    key: StoreKey, root: Path, published: Published, progress: Callable[[], None] | None
) -> TokenFile | None:
    """`key`'s store downloaded from `published` and renamed into `root`, checked as any store
    is opened; None when none is published or what was is unusable (then it is built)."""
    tmp = Builder.this().temporary(root, key)
    try:
        if not published.fetch(key.name, tmp, progress):
            return None
        try:
            open_store(tmp, key)
        except DataError as err:
            log.warning("the published token store %s is unusable (%s); building it", key.name, err)
            return None
        fsync_dir(tmp)
        os.rename(tmp, root / key.name)
        fsync_dir(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return open_store(root / key.name, key)


@contextlib.contextmanager
def _locked(lock: Path, progress: Callable[[], None] | None) -> Iterator[None]:
    """Hold an exclusive lock on `lock`, calling `progress` while waiting for it."""
    with open(lock, "a") as f:
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if progress is not None:
                    progress()  # waiting on a builder that makes progress of its own
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@dataclass(frozen=True)
class Builder:
    """Who builds a temporary store, as its name says
    (`.tmp-<store>-<random>-<boot>-<pid>-<host>`): enough for a builder on the same host to
    prove it dead."""

    host: str
    boot: str  # the first 8 characters of the host's boot id: pids start again at a reboot
    pid: int

    @classmethod
    def this(cls) -> Builder:
        return cls(host=socket.gethostname(), boot=_boot_id(), pid=os.getpid())

    def temporary(self, root: Path, key: StoreKey) -> Path:
        """A fresh temporary directory name for `key`'s store under `root`."""
        nonce = uuid.uuid4().hex[:8]
        return root / f"{_TMP_PREFIX}{key.name}-{nonce}-{self.boot}-{self.pid}-{self.host}"

    @classmethod
    def of(cls, temporary: Path, key: StoreKey) -> Builder | None:
        """The builder a temporary of `key` names; None for a name of an older format."""
        parts = temporary.name.removeprefix(f"{_TMP_PREFIX}{key.name}-").split("-", 3)
        if len(parts) != 4 or not parts[2].isdigit():
            return None
        return cls(host=parts[3], boot=parts[1], pid=int(parts[2]))

    def dead(self) -> bool:
        """Provably dead, as this process sees it: a builder of this host, of an earlier boot
        or with a pid no process has. Another host's cannot be proven dead from here."""
        here = Builder.this()
        return self.host == here.host and (self.boot != here.boot or not _alive(self.pid))


@functools.cache
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text()[:8]
    except OSError:  # not Linux: the pid alone speaks for a builder of this host
        return "0" * 8


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _idle_seconds(path: Path) -> float:
    """Seconds since anything was written to the temporary store `path`: the newest mtime of
    the directory and its files (a build appends to its files at every batch)."""
    try:
        newest = max([path.stat().st_mtime, *(p.stat().st_mtime for p in path.iterdir())])
    except OSError:  # gone meanwhile: its builder published it, or another removed it
        return 0.0
    return time.time() - newest


def _remove_temporaries(root: Path, key: StoreKey) -> None:
    """Half-built stores of `key` whose builder is gone. The lock, ours now, is not taken by
    builders on other hosts (nor honoured by every shared filesystem), so a temporary is
    removed when its name proves its builder dead (Builder.dead), or, where it cannot (another
    host's, a name of an older format), once nothing has written to it for
    ABANDONED_AFTER_SECONDS. A live build on another host is never removed."""
    for leftover in root.glob(f"{_TMP_PREFIX}{key.name}-*"):
        builder = Builder.of(leftover, key)
        dead = builder is not None and builder.dead()
        if dead or _idle_seconds(leftover) > ABANDONED_AFTER_SECONDS:
            log.info("removing %s, left by a builder that is gone", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


# --- building -------------------------------------------------------------------------------


def id_dtype(tokenizer: Tokenizer) -> np.dtype[Any]:
    """The smallest unsigned dtype that holds every id of the tokenizer."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    return np.dtype("<u2") if size <= 2**16 else np.dtype("<u4")


def record_key(record: Record) -> int:
    digest = hashlib.blake2b(repr(record.key()).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Columns:
    """The per-record and per-segment rows of encoded records, as the store keeps them."""

    def __init__(self) -> None:
        self.roles: dict[str, int] = {}

    def rows(
        self, records: Sequence[Record], batch: EncodedBatch, first: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The rows of `records` (encoded as `batch`), the first of which is record `first`."""
        n = len(records)
        rows = np.empty(n, RECORD_DTYPE)
        rows["line"] = np.fromiter((r.line for r in records), np.int64, n)
        rows["kind"] = np.fromiter((_KIND_INDEX[r.kind] for r in records), np.uint8, n)
        rows["fits"] = batch.fits
        rows["zero_target"] = batch.zero_target
        rows["source_tokens"] = batch.source_tokens
        rows["target_tokens"] = batch.target_tokens
        rows["total_tokens"] = batch.total_tokens
        rows["tokens_trimmed"] = batch.tokens_trimmed
        rows["segments_dropped"] = np.fromiter(map(len, batch.dropped_segments), np.int32, n)
        rows["segments_trimmed"] = np.fromiter(map(len, batch.trimmed_segments), np.int32, n)
        rows["key"] = np.fromiter(map(record_key, records), np.uint64, n)
        segments = []
        for i, record in enumerate(records):
            dropped, trimmed = batch.dropped_segments[i], batch.trimmed_segments[i]
            for s, segment in enumerate(record.segments):
                role = self.roles.setdefault(segment.role, len(self.roles))
                elastic = 0 if segment.elastic is None else 1 + ELASTIC.index(segment.elastic)
                fate = DROPPED if s in dropped else TRIMMED if s in trimmed else KEPT
                segments.append((first + i, role, elastic, fate))
        return rows, np.array(segments, SEGMENT_DTYPE)


def _build(
    path: str,
    tokenizer: Tokenizer,
    key: StoreKey,
    tmp: Path,
    *,
    progress: Callable[[], None] | None,
    fraction: Callable[[float], None] | None,
) -> None:
    """Write the complete store of `path` into the fresh directory `tmp`."""
    tmp.mkdir()
    dtype = id_dtype(tokenizer)
    size = max(os.path.getsize(path), 1)
    columns = Columns()
    count = tokens = 0
    pending = np.zeros(0, bool)  # mask bits not yet a whole byte
    files: dict[str, IO[bytes]] = {name: open(tmp / name, "wb") for name in _FILES}  # noqa: SIM115
    invalid = _InvalidLines()
    # The bytes tokenized, hashed as they are read: the store's name says the file's digest,
    # taken before, which they must match. SHA-256 runs at ~1.5 GB/s here against the build's
    # ~4 MB/s of text (bench/RESULTS.md): 0.3% of a build.
    read = hashlib.sha256()

    def write(batch: list[Record], encoded: EncodedBatch) -> None:
        nonlocal count, tokens, pending
        files["ids.bin"].write(encoded.ids.astype(dtype).tobytes())
        files["offsets.bin"].write((tokens + np.cumsum(encoded.lengths)).astype("<i8").tobytes())
        masks = np.concatenate([pending, encoded.loss_mask])
        whole = len(masks) // 8 * 8
        files["mask.bin"].write(np.packbits(masks[:whole], bitorder="little").tobytes())
        pending = masks[whole:]
        rows, segments = columns.rows(batch, encoded, count)
        files["records.bin"].write(rows.tobytes())
        files["segments.bin"].write(segments.tobytes())
        count += len(batch)
        tokens += int(encoded.lengths.sum())

    # A pipeline of two: while the tokenizer (native code, off the GIL, on every core) encodes
    # one batch, this thread reads and parses the next, and assembles and writes the one
    # before (the Python half of the encoder: on the encoding thread it left the tokenizer
    # waiting, a third of the time of short supervised records).
    eos_id, _ = special_token_ids(tokenizer)

    def finish(batch: list[Record], pieces: Future[list[list[list[int]]]]) -> None:
        write(batch, assemble_batch(batch, pieces.result(), eos_id, key.fit))

    try:
        files["offsets.bin"].write(np.zeros(1, "<i8").tobytes())
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as encoder:
            previous: tuple[list[Record], Future[list[list[list[int]]]]] | None = None
            for batch, at in _batches(path, read, invalid.add):
                future = encoder.submit(tokenize, tokenizer, batch)
                if previous is not None:
                    finish(*previous)
                previous = (batch, future)
                if progress is not None:
                    progress()
                if fraction is not None:
                    fraction(min(at / size, 0.999))
            if previous is not None:
                finish(*previous)
        files["mask.bin"].write(np.packbits(pending, bitorder="little").tobytes())
        if fraction is not None:
            fraction(1.0)
    finally:
        for f in files.values():
            f.close()
    _check_read(path, read.hexdigest(), key)
    for name in _FILES:
        fsync_file(tmp / name)
    meta: dict[str, Any] = {
        "identity": key.identity(FORMAT_WITH_INVALID if invalid.counts else FORMAT),
        "path": path,
        "dtype": dtype.str,
        "records": count,
        "tokens": tokens,
        "roles": list(columns.roles),
        "files": {name: (tmp / name).stat().st_size for name in _FILES},
    }
    if invalid.counts:
        meta["invalid"] = {"counts": invalid.counts, "lines": invalid.lines}
    # Written last: a directory with a meta.json is complete.
    (tmp / META).write_text(json.dumps(meta, indent=1))
    fsync_file(tmp / META)
    fsync_dir(tmp)


def _check_read(path: str, read: str, key: StoreKey) -> None:
    """The bytes a build read must be those its store is named for: a file rewritten since its
    digest was taken (or while it was read) would publish other records under that name, for
    every run that names the old content."""
    if read != key.file_sha256:
        raise DataError(
            f"{path} changed while it was read: the bytes read have SHA-256 {read}, but the "
            f"token store is named for {key.file_sha256}, the digest taken before; nothing was "
            "published. Leave the file unchanged while runs read it, or start a new run over "
            "its new content"
        )


class _InvalidLines:
    """The lines of a file being built that are not records: counted by reason, the first
    MAX_INVALID_LINES kept as (line, reason, detail)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lines: list[tuple[int, str, str]] = []

    def add(self, err: RecordError) -> None:
        self.counts[err.reason] = self.counts.get(err.reason, 0) + 1
        if len(self.lines) < MAX_INVALID_LINES:
            self.lines.append((err.line, err.reason, err.detail))


def _batches(
    path: str, digest: Hash, invalid: Callable[[RecordError], None]
) -> Iterator[tuple[list[Record], int]]:
    """ENCODE_BATCH records or ENCODE_BYTES of lines at a time, whichever comes first, each
    batch with the bytes of the file read so far; every byte read goes to `digest`, every line
    that is not a record to `invalid`."""
    batch: list[Record] = []
    position = held = 0
    for record, position in iter_records(path, digest, invalid=invalid):
        batch.append(record)
        held += len(record.raw)
        if len(batch) == ENCODE_BATCH or held >= ENCODE_BYTES:
            yield batch, position
            batch, held = [], 0
    if batch:
        yield batch, position


# --- access ---------------------------------------------------------------------------------


class Published(Protocol):
    """Where stores built elsewhere are found, and this worker's builds are published: an
    object store artifact root (worker.remote.tokens). A folder root needs none: every worker
    opens the same `<root>/tokens/`."""

    def fetch(self, name: str, into: Path, progress: Callable[[], None] | None = None) -> bool:
        """Download the published store `name` into the new directory `into`; False when none
        is published (or it is unusable)."""
        ...

    def publish(self, name: str, directory: Path) -> bool:
        """Publish the complete store at `directory` as `name`."""
        ...

    def opened(self, directory: Path) -> None:
        """The store at `directory` was opened (a cache keeps it as recently used)."""
        ...


class Stores:
    """The token stores under `root` for one tokenizer: `get(path, fit)` opens a file's store,
    building it first where it is missing. A file's SHA-256 comes from `digests` when the
    caller knows it (a claim's, verified before training) and from runtime.digest's cache
    otherwise. `fraction(path, share)` hears how far a build has read its file. `published`:
    where stores are downloaded from before one is built, and published to after (an object
    store artifact root: worker.remote.tokens.token_stores gives root and publisher)."""

    def __init__(
        self,
        root: Path,
        tokenizer: Tokenizer,
        *,
        digests: Mapping[str, str] | None = None,
        progress: Callable[[], None] | None = None,
        fraction: Callable[[str, float], None] | None = None,
        published: Published | None = None,
    ) -> None:
        self.root = root
        self.published = published
        self.tokenizer = tokenizer
        # The tokenizer as loaded, whatever file or directory it came from: training and a
        # job that reads the tokenizer a checkpoint saved share stores.
        self.tokenizer_sha256 = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
        self._digests = dict(digests or {})
        self._progress = progress
        self._fraction = fraction

    @classmethod
    @contextlib.contextmanager
    def temporary(
        cls, tokenizer: Tokenizer, *, progress: Callable[[], None] | None = None
    ) -> Iterator[Stores]:
        """Stores in a private directory removed when the block ends. What was opened stays
        readable after that: a memory map outlives its file's name."""
        with tempfile.TemporaryDirectory(prefix="trainctl-tokens-") as root:
            yield cls(Path(root), tokenizer, progress=progress)

    def key(self, path: str, fit: int | None) -> StoreKey:
        """The key of `path`'s store at `fit`; a missing file is named here, before the digest
        would stat nothing."""
        if not Path(path).is_file():
            raise DataError(
                f"{path}: file not found" if not Path(path).exists() else f"{path}: not a file"
            )
        sha = self._digests.get(path)
        if sha is None:
            sha = digest_path(path, self._progress, cache_dir=self.root / DIGESTS)
            self._digests[path] = sha
        return StoreKey(file_sha256=sha, tokenizer_sha256=self.tokenizer_sha256, fit=fit)

    def get(self, path: str, fit: int | None) -> TokenFile:
        return self.open(path, fit)[0]

    def open(self, path: str, fit: int | None) -> tuple[TokenFile, bool]:
        """`get`, and whether this call built the store."""
        key = self.key(path, fit)
        fraction = self._fraction
        return ensure_store(
            path,
            self.tokenizer,
            key,
            self.root,
            progress=self._progress,
            fraction=None if fraction is None else (lambda share: fraction(path, share)),
            published=self.published,
        )


# --- preparing ahead of time ----------------------------------------------------------------


def prepare_file(request: PrepareRequest, stores: Stores) -> PreparedStore:
    """The store of `request.path` that a phase with the request's objective and
    sequence_length would build before its first step (same key: the phase maps it), built now
    unless a complete one is there already. Memory is the build's: ENCODE_BATCH records. A file
    with lines that are not records is refused, as that phase would refuse it."""
    started = time.perf_counter()
    store, built = stores.open(request.path, request.fit)
    if store.invalid:
        # Built all the same (an eval set reading the file maps it), but a phase refuses it.
        count = sum(store.invalid.values())
        raise DataError(
            f"{store.invalid_lines[0].message(request.path)}: {count} lines of it are not "
            "records, so a phase reading it refuses it; fix them and prepare it again"
        )
    return PreparedStore(
        path=request.path,
        store=str(store.path),
        records=len(store),
        tokens=store.tokens,
        built=built,
        seconds=round(time.perf_counter() - started, 3),
    )
