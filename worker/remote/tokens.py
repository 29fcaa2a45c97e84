"""Token stores on an object store: with `s3://` as the artifact root there is no folder every
worker shares, so a worker keeps its stores in its cache (`<cache_dir>/tokens/<name>/`) and
publishes each one it builds to `<root>/tokens/<name>/`, where the next worker that needs it
downloads it instead of encoding the file again (minutes of CPU for a large corpus, seconds of
transfer).

A published store is, like a checkpoint (worker.remote.checkpoints), its files under a save id,
`<root>/tokens/<name>/<save>/<file>`, and a manifest written last with a create-only put,
`<root>/tokens/<name>/manifest.json`: `{"name", "save", "files": {file: {"sha256", "size"}}}`.
A store is published iff its manifest exists. Two workers that built the same store both
upload; the first manifest wins, the other removes its files, and readers only ever follow the
manifest to one save's files (a store's meta.json names its builder's local path, so two
builds' bytes differ and must not mix). A reader checks every file's size and SHA-256 before
the store is renamed into its cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.store import StoreError, is_store_uri, join, open_store
from worker.remote.cache import TOKENS, Cache
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def _sha256(path: Path, progress: Callable[[], None] | None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(2**20):
            digest.update(chunk)
            if progress is not None:
                progress()
    return digest.hexdigest()


class PublishedTokens:
    """The token stores published under `<root>/tokens/` (root: an `s3://` artifact root),
    downloaded into and kept in `cache`. What worker.data.store.Stores calls (its `Published`):
    `fetch` before it builds, `publish` after, `opened` whenever it opens one."""

    def __init__(self, root: str, cache: Cache) -> None:
        self.root = root
        self.uri = join(root, TOKENS)
        self.store = open_store(self.uri)
        self.cache = cache
        self._opened: set[Path] = set()

    def fetch(self, name: str, into: Path, progress: Callable[[], None] | None = None) -> bool:
        """Download published store `name` into the new directory `into`, every file checked
        against the manifest; False when none is published, or what is published does not
        match its manifest (logged: the caller builds its own)."""
        try:
            manifest = json.loads(self.store.get_bytes(f"{name}/{MANIFEST}"))
        except FileNotFoundError:
            return False
        except (StoreError, ValueError) as err:
            log.warning(
                "token store %s/%s: unreadable manifest (%s); building it", self.uri, name, err
            )
            return False
        try:
            into.mkdir(parents=True)
            for file, want in sorted(manifest["files"].items()):
                dest = into / file
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.store.get_file(f"{name}/{manifest['save']}/{file}", dest)
                size, sha = dest.stat().st_size, _sha256(dest, progress)
                if (size, sha) != (want["size"], want["sha256"]):
                    log.warning(
                        "token store %s/%s: %s has %d bytes and SHA-256 %s, its manifest says "
                        "%d and %s; building the store instead",
                        self.uri,
                        name,
                        file,
                        size,
                        sha,
                        want["size"],
                        want["sha256"],
                    )
                    return False
        except (StoreError, FileNotFoundError, KeyError, TypeError) as err:
            log.warning(
                "token store %s/%s: cannot download it (%s); building it", self.uri, name, err
            )
            return False
        log.info("downloaded token store %s/%s into %s", self.uri, name, into)
        return True

    def publish(self, name: str, directory: Path) -> bool:
        """Upload the store at `directory` as `name`, manifest last; False when another worker
        published it first (theirs is kept, what this one uploaded removed) or the upload
        failed (logged: this worker still has its store, the next one builds its own)."""
        try:
            if self.store.head(f"{name}/{MANIFEST}") is not None:
                return False
            save = uuid.uuid4().hex
            files: dict[str, Any] = {}
            for path in sorted(p for p in directory.rglob("*") if p.is_file()):
                rel = path.relative_to(directory).as_posix()
                self.store.put_file(f"{name}/{save}/{rel}", path)
                files[rel] = {"sha256": _sha256(path, None), "size": path.stat().st_size}
            manifest = {"name": name, "save": save, "files": files}
            body = json.dumps(manifest, sort_keys=True, indent=1).encode()
            if self.store.put_bytes(f"{name}/{MANIFEST}", body, create=True):
                log.info("published token store %s as %s/%s", directory, self.uri, name)
                return True
            self.store.delete(f"{name}/{save}/{rel}" for rel in files)
            return False
        except (StoreError, OSError) as err:
            log.warning(
                "could not publish token store %s to %s/%s: %s", directory, self.uri, name, err
            )
            return False

    def opened(self, directory: Path) -> None:
        """A store in the cache was opened: mark it used, and evict down to the cache's bound,
        keeping every store this process opened (its reads map them)."""
        self._opened.add(directory)
        self.cache.use(directory)
        self.cache.evict(in_use=self._opened)


def token_stores(
    artifact_root: str | Path, settings: WorkerSettings
) -> tuple[Path, PublishedTokens | None]:
    """Where this worker opens the token stores of the artifact store at `artifact_root`, and
    their publisher: `<root>/tokens` and none for a folder (shared by every worker, as
    before); `<cache_dir>/tokens` and the bucket's `tokens/` for an `s3://` root."""
    if is_store_uri(artifact_root):
        cache = Cache(settings.cache_dir, settings.cache_max_bytes)
        return cache.root / TOKENS, PublishedTokens(str(artifact_root), cache)
    return Path(os.fspath(artifact_root)) / TOKENS, None
