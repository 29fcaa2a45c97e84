"""The artifact store's one interface, for both sides: a folder (`LocalStore`) or an
S3-compatible bucket (`ObjectStore`, through obstore), named by a URI.

`TRAINCTL_ARTIFACT_ROOT` is a path (the store is a folder every process reads at the same path)
or `s3://BUCKET/PREFIX` (the store is a bucket; nothing is shared on disk). The endpoint and
credentials of a bucket come from the standard AWS variables (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`), so any S3-compatible store
works.

What the code needs of a store is small: whole objects put and got (or streamed to a file), a
byte range, a head (size and ETag), a listing under a prefix, deletion, and one conditional
write: `put_bytes(..., create=True)` writes only when nothing is at the key (S3's
`If-None-Match: *`; a hard link on a folder), which is how a checkpoint commits without a
rename (worker.remote.checkpoints). A store must give read-after-write consistency (S3 has since
2020; so do MinIO, Ceph and R2).

Keys are `/`-separated, relative to the store's root; `join` builds the URI of one.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from contracts.paths import STORE_SCHEMES

if TYPE_CHECKING:  # typing names only: obstore is imported where a bucket is opened
    from obstore.store import ClientConfig, RetryConfig

# Streamed reads and uploads move this much at a time.
_CHUNK = 8 * 2**20


class StoreError(Exception):
    """The store refused or failed a request (not a missing object: FileNotFoundError)."""


def is_store_uri(value: str | Path) -> bool:
    """True for `s3://...`; False for a local path."""
    return isinstance(value, str) and value.startswith(STORE_SCHEMES)


def normalize_root(value: str | Path) -> str:
    """An artifact root as settings keep it: a store URI without a trailing `/`, or an
    absolute local path (`~` expanded)."""
    if is_store_uri(value):
        text = str(value).rstrip("/")
        bucket = text.split("://", 1)[1].split("/", 1)[0]
        if not bucket:
            raise ValueError(f"{value!r} names no bucket; write s3://BUCKET or s3://BUCKET/PREFIX")
        return text
    return str(Path(value).expanduser().resolve())


def join(root: str | Path, *parts: str) -> str:
    """`root` with `parts` appended: `/`-joined for a URI, as a path otherwise."""
    if is_store_uri(root):
        return posixpath.join(str(root).rstrip("/"), *parts)
    return str(Path(root).joinpath(*parts))


def relative_key(root: str, uri: str) -> str | None:
    """The key of `uri` under the store root `root`, or None when it lies elsewhere."""
    prefix = root.rstrip("/") + "/"
    if not uri.startswith(prefix):
        return None
    return uri[len(prefix) :]


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's root
    size: int
    etag: str  # the store's version tag of the object's bytes (a local file: size and mtime)
    modified: datetime


class ArtifactStore(Protocol):
    """A folder or a bucket, by `/`-separated keys relative to `uri`."""

    uri: str

    def put_file(self, key: str, path: Path) -> None:
        """Upload the file at `path` as `key` (replacing what is there)."""

    def put_bytes(self, key: str, data: bytes, *, create: bool = False) -> bool:
        """Write `data` as `key`. `create`: only when nothing is at `key` (atomically); False
        when something was, and nothing was written."""

    def get_bytes(self, key: str) -> bytes:
        """The whole object; FileNotFoundError when there is none."""

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes `start` to `end` (exclusive) of the object; FileNotFoundError when none."""

    def get_file(self, key: str, path: Path) -> None:
        """Stream the object into a new file at `path`; FileNotFoundError when there is none."""

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and ETag, or None when there is none."""

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix` + `/` (all of them for ""), in no
        promised order."""

    def delete(self, keys: Iterable[str]) -> None:
        """Delete the objects at `keys`; a missing one is no error."""


class LocalStore:
    """A folder as an artifact store: keys are relative paths. Writes go to a temporary file
    and are renamed into place, so a reader never sees half an object."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise StoreError(f"{key!r} is not a key of the store at {self.root}")
        return self.root / key

    def _temporary(self, target: Path) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        return target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.part")

    def put_file(self, key: str, path: Path) -> None:
        target = self._path(key)
        tmp = self._temporary(target)
        try:
            shutil.copyfile(path, tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes, *, create: bool = False) -> bool:
        target = self._path(key)
        tmp = self._temporary(target)
        try:
            tmp.write_bytes(data)
            if not create:
                os.replace(tmp, target)
                return True
            try:
                os.link(tmp, target)  # fails when the target exists: atomic create
            except FileExistsError:
                return False
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with self._path(key).open("rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def get_file(self, key: str, path: Path) -> None:
        shutil.copyfile(self._path(key), path)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(
            key=key,
            size=st.st_size,
            etag=f"{st.st_size}-{st.st_mtime_ns}-{st.st_ino}",
            modified=datetime.fromtimestamp(st.st_mtime, UTC),
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return
        for path in base.rglob("*"):
            if path.is_file() and not path.name.endswith(".part"):
                info = self.head(path.relative_to(self.root).as_posix())
                if info is not None:
                    yield info

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)


class ObjectStore:
    """An S3-compatible bucket (through obstore), at `s3://BUCKET/PREFIX`; endpoint and
    credentials from the AWS variables. Errors other than a missing object are StoreError,
    naming the URI."""

    def __init__(self, uri: str) -> None:
        from obstore.store import S3Store

        self.uri = uri.rstrip("/")
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        options: ClientConfig = {"timeout": "300s", "connect_timeout": "10s"}
        if endpoint is not None and endpoint.startswith("http://"):
            options["allow_http"] = True
        retry: RetryConfig = {
            "max_retries": 5,
            "retry_timeout": timedelta(minutes=3),
            "backoff": {
                "init_backoff": timedelta(seconds=0.1),
                "max_backoff": timedelta(seconds=5),
                "base": 2,
            },
        }
        try:
            self._store = S3Store.from_url(self.uri, client_options=options, retry_config=retry)
        except Exception as err:
            raise StoreError(f"cannot open the object store {self.uri}: {err}") from err

    def _uri(self, key: str) -> str:
        return f"{self.uri}/{key}"

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        from obstore.exceptions import BaseError, NotFoundError

        try:
            yield
        except NotFoundError as err:
            raise FileNotFoundError(f"{self._uri(key)} does not exist") from err
        except BaseError as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise StoreError(f"{self._uri(key)}: {first}") from err

    def put_file(self, key: str, path: Path) -> None:
        import obstore

        with self._errors(key):
            # obstore uploads a file in parts (multipart above its chunk size), streaming it.
            obstore.put(self._store, key, path, chunk_size=_CHUNK)

    def put_bytes(self, key: str, data: bytes, *, create: bool = False) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        with self._errors(key):
            try:
                obstore.put(self._store, key, data, mode="create" if create else "overwrite")
            except (AlreadyExistsError, PreconditionError):
                if not create:
                    raise
                return False
        return True

    def get_bytes(self, key: str) -> bytes:
        import obstore

        with self._errors(key):
            return bytes(obstore.get(self._store, key).bytes())

    def get_range(self, key: str, start: int, end: int) -> bytes:
        import obstore

        if end <= start:
            return b""
        with self._errors(key):
            return bytes(obstore.get_range(self._store, key, start=start, end=end))

    def get_file(self, key: str, path: Path) -> None:
        import obstore

        with self._errors(key), path.open("wb") as f:
            for chunk in obstore.get(self._store, key).stream(min_chunk_size=_CHUNK):
                f.write(chunk)

    def head(self, key: str) -> ObjectInfo | None:
        import obstore

        try:
            with self._errors(key):
                meta = obstore.head(self._store, key)
        except FileNotFoundError:
            return None
        return _info(meta)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        import obstore

        with self._errors(prefix):
            for batch in obstore.list(self._store, prefix or None):
                for meta in batch:
                    yield _info(meta)

    def delete(self, keys: Iterable[str]) -> None:
        import obstore

        keys = list(keys)
        for i in range(0, len(keys), 1000):  # S3's DeleteObjects takes 1,000 keys at most
            with self._errors(keys[i]):
                obstore.delete(self._store, keys[i : i + 1000])


def _info(meta: Any) -> ObjectInfo:
    return ObjectInfo(
        key=str(meta["path"]),
        size=int(meta["size"]),
        etag=str(meta.get("e_tag") or ""),
        modified=meta["last_modified"],
    )


def open_store(root: str | Path) -> ArtifactStore:
    """The store at `root`: an `s3://` URI, or a folder."""
    if is_store_uri(root):
        return ObjectStore(str(root))
    return LocalStore(root)


def object_at(uri: str) -> tuple[ArtifactStore, str]:
    """The store of the bucket an `s3://BUCKET/KEY` URI names, and the key."""
    if not is_store_uri(uri):
        raise ValueError(f"{uri!r} is not an object URI (s3://BUCKET/KEY)")
    scheme, rest = uri.split("://", 1)
    bucket, _, key = rest.partition("/")
    if not bucket or not key:
        raise ValueError(f"{uri!r} names no object; write s3://BUCKET/KEY")
    return ObjectStore(f"{scheme}://{bucket}"), key
