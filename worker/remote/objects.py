"""Inputs named by URI (`s3://bucket/key`): a tokenizer, a data file or a pretrained model
that lives in an object store, fetched into the worker's cache (worker.remote.cache) so that
training and jobs read a local file, as they do any other.

A URI names an object (a file) or, when no object has that key, every object under `key/` (a
"directory", relative names kept). Its cache entry, `<cache>/objects/<id>/<basename>`, is named
by the URI and each object's ETag and size, which a head or a listing gives without reading
the bytes: an object that changed is fetched again, and one that did not never is.

The digest of an object is the one `contracts.signature.sha256_path` gives for its local copy
(file: sha256 of the bytes; directory: sha256 over sorted `relpath NUL filesha LF` lines), so a
run signed over an object is checked with the digest a `digest` job computed for the service
(worker.process.jobs.digest_of_object, which streams the bytes and keeps none).
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
import shutil
import uuid
from collections.abc import Callable, Collection
from pathlib import Path

from runtime.digest import digest_path
from runtime.store import ArtifactStore, ObjectInfo, StoreError, object_at
from worker.error import SignatureMismatch, TrainingError
from worker.remote.cache import OBJECTS, TMP_PREFIX, Cache

log = logging.getLogger(__name__)

# Bytes read per request when streaming an object (hashing, or a large download), and the
# size above which a download is streamed in ranges (so `progress` hears of it as it goes).
CHUNK = 16 * 2**20

# A download whose objects change under it is started again, this many times in all.
FETCH_TRIES = 3

Progress = Callable[[], None] | None


def _listing(uri: str) -> tuple[ArtifactStore, str, list[ObjectInfo], bool]:
    """The store and key of `uri`, its objects (relative names in `key`), and whether it is
    one object (a file). TrainingError naming the URI when nothing is there."""
    try:
        store, key = object_at(uri.rstrip("/"))
    except ValueError as err:
        raise TrainingError(str(err)) from err
    try:
        info = store.head(key)
        if info is not None:
            return store, key, [info], True
        objects = [o for o in store.list(key) if not o.key.endswith("/")]  # no folder markers
    except StoreError as err:
        raise TrainingError(f"cannot read {uri}: {err}") from err
    if not objects:
        raise TrainingError(
            f"{uri} not found: no object has that key and none lies under {key}/ "
            "(check the URI, and that this worker's AWS credentials can read the bucket)"
        )
    return store, key, sorted(objects, key=lambda o: o.key), False


def _relative(key: str, info: ObjectInfo) -> str:
    return info.key[len(key) + 1 :]


def object_id(uri: str, objects: list[ObjectInfo]) -> str:
    """The cache entry's name for `uri` as it is now: its URI and every object's key, ETag and
    size."""
    digest = hashlib.sha256(uri.rstrip("/").encode())
    for o in sorted(objects, key=lambda o: o.key):
        digest.update(f"\0{o.key}\0{o.etag}\0{o.size}".encode())
    return digest.hexdigest()[:32]


def _download(store: ArtifactStore, info: ObjectInfo, dest: Path, progress: Progress) -> None:
    """Object `info` into the new file `dest`, in ranges when large (progress per range)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if info.size <= CHUNK:
        store.get_file(info.key, dest)
        if progress is not None:
            progress()
        return
    with dest.open("wb") as f:
        for start in range(0, info.size, CHUNK):
            f.write(store.get_range(info.key, start, min(start + CHUNK, info.size)))
            if progress is not None:
                progress()


def _fetch(
    uri: str,
    store: ArtifactStore,
    key: str,
    objects: list[ObjectInfo],
    is_file: bool,
    entry: Path,
    local: Path,
    progress: Progress,
) -> bool:
    """Download `objects` and rename them into place as `entry`; False (nothing kept) when
    they changed meanwhile: the entry's name would claim ETags its bytes do not have."""
    tmp = entry.with_name(f"{TMP_PREFIX}{entry.name}-{uuid.uuid4().hex[:12]}")
    try:
        for info in objects:
            dest = tmp / local.name if is_file else tmp / local.name / _relative(key, info)
            _download(store, info, dest, progress)
        if object_id(uri, _listing(uri)[2]) != entry.name:
            log.warning("%s changed while it was downloaded; fetching it again", uri)
            return False
        try:
            tmp.rename(entry)
        except OSError:
            if not local.exists():
                raise
            # Another process of this host fetched the same objects first: use theirs.
    except (StoreError, FileNotFoundError) as err:
        raise TrainingError(f"cannot download {uri}: {err}") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("fetched %s into %s (%d objects)", uri, local, len(objects))
    return True


def fetch_input(
    uri: str,
    *,
    cache: Cache,
    expected_sha256: str | None = None,
    progress: Progress = None,
    digests: Path | None = None,
    keep: Collection[Path] = (),
) -> Path:
    """The local copy of the object or prefix at `uri`, in `cache`: found there when its
    objects have not changed (a head or a listing), downloaded otherwise (to a temporary
    directory, renamed into place). With `expected_sha256`, its digest must be that one
    (hashed once per copy, then cached by the file's stat): SignatureMismatch naming the URI
    and both digests otherwise, and the copy is removed. The entry is marked used and the
    cache evicted down to its bound, this entry kept. `digests`: runtime.digest's folder for the
    copy's digest (default the cache's; the token stores' folder lets a store's key reuse it).
    `keep`: other entries (or paths in them) the caller still needs, never evicted here."""
    for _ in range(FETCH_TRIES):
        store, key, objects, is_file = _listing(uri)
        name = posixpath.basename(key.rstrip("/")) or "object"
        entry = cache.folder(OBJECTS) / object_id(uri, objects)
        local = entry / name
        if local.exists() or _fetch(uri, store, key, objects, is_file, entry, local, progress):
            break
    else:
        raise TrainingError(
            f"{uri} changed while it was downloaded, {FETCH_TRIES} times in a row; stop "
            "what rewrites it, or point the run at a copy that stays put"
        )
    if expected_sha256 is not None:
        actual = digest_path(local, progress, cache_dir=digests or cache.digests)
        if actual != expected_sha256:
            shutil.rmtree(entry, ignore_errors=True)
            raise SignatureMismatch(
                f"{uri} has SHA-256 {actual}, but the run's signature was computed with "
                f"{expected_sha256}; the object changed since the run was created (restore "
                "it, or start a new run)"
            )
    cache.use(entry)
    cache.evict(in_use=[entry, *keep])
    return local
