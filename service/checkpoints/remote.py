"""Checkpoints and inputs in an object store, read without downloading them.

The service never downloads an object: of an `s3://` input it reads what a HEAD or a listing
says (object_entries, fingerprinted for the digest table, service.runs.digest), and of a
checkpoint in the remote layout (worker.remote.checkpoints) its manifest alone, one small GET:

    <root>/runs/<run>/checkpoints/step-NNNNNNNN/manifest.json   the commit, written last
    <root>/runs/<run>/checkpoints/step-NNNNNNNN/<save>/<name>   the files of that save

from which its content digest follows (remote_checkpoint_digest) and its files' keys
(RemoteManifest.key_of), which the weights check reads by byte ranges
(service.checkpoints.weights).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from contracts.jobs import object_fingerprint
from contracts.signature import sha256_listing
from runtime.store import object_at

# The file a checkpoint's commit is (worker.remote.checkpoints): it names every file's digest.
MANIFEST = "manifest.json"
# A manifest names a few dozen files; one this large is no checkpoint's.
MAX_MANIFEST_BYTES = 16 * 2**20


def object_entries(uri: str) -> list[tuple[str, str, int]]:
    """What `uri` names in its bucket as (path relative to it, ETag, size): the object itself
    (path "") or, when there is none, every object under `uri/`. One HEAD, and a listing when
    it is a prefix. FileNotFoundError when neither exists; StoreError when the store refuses."""
    store, key = object_at(uri)
    key = key.rstrip("/")
    info = store.head(key) if key else None
    if info is not None:
        return [("", info.etag, info.size)]
    prefix = f"{key}/" if key else ""
    entries = [(o.key[len(prefix) :], o.etag, o.size) for o in store.list(key)]
    if not entries:
        raise FileNotFoundError(f"no object is at {uri} nor under {uri.rstrip('/')}/")
    return entries


def fingerprint_of(uri: str) -> str:
    """contracts.jobs.object_fingerprint of what `uri` names now (object_entries)."""
    return object_fingerprint(object_entries(uri))


def remote_checkpoint_digest(uri: str) -> str:
    """The content digest of a checkpoint in the object store's remote layout
    (`<uri>/manifest.json` naming its files' SHA-256s), from its manifest alone: what
    contracts.signature.sha256_path gives for its downloaded directory: sha256_listing of
    every file the manifest lists and of manifest.json itself.
    FileNotFoundError when it has no manifest (no committed checkpoint is there); ValueError
    when the manifest is not one."""
    manifest = read_manifest(uri)
    files = [(name, str(entry["sha256"])) for name, entry in manifest.files.items()]
    return sha256_listing([*files, (MANIFEST, hashlib.sha256(manifest.raw).hexdigest())])


@dataclass(frozen=True)
class RemoteManifest:
    """A remote checkpoint's manifest: its step, the save whose files it commits, and those
    files (name -> {"sha256", "size"}); `raw` its bytes as stored."""

    uri: str
    step: int
    save: str
    files: dict[str, dict[str, Any]]
    raw: bytes

    def key_of(self, name: str) -> str:
        """The URI of file `name` of the checkpoint: `<uri>/<save>/<name>`."""
        return f"{self.uri.rstrip('/')}/{self.save}/{name}"


def read_manifest(uri: str) -> RemoteManifest:
    """`<uri>/manifest.json`, checked for what the digest and the weights check read of it."""
    store, key = object_at(f"{uri.rstrip('/')}/{MANIFEST}")
    info = store.head(key)
    if info is None:
        raise FileNotFoundError(
            f"{uri} holds no {MANIFEST}: no checkpoint was committed there (a checkpoint exists "
            "once its manifest does)"
        )
    if info.size > MAX_MANIFEST_BYTES:
        raise ValueError(f"{uri}/{MANIFEST} is {info.size} bytes, no checkpoint manifest")
    raw = store.get_bytes(key)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{uri}/{MANIFEST} is not JSON ({err})") from err
    files = doc.get("files") if isinstance(doc, dict) else None
    save, step = (doc.get("save"), doc.get("step")) if isinstance(doc, dict) else (None, None)
    if (
        not isinstance(files, dict)
        or not isinstance(save, str)
        or not save
        or "/" in save
        or not isinstance(step, int)
        or not all(
            isinstance(name, str)
            and isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("size"), int)
            for name, entry in files.items()
        )
    ):
        raise ValueError(
            f'{uri}/{MANIFEST} is not a checkpoint manifest ({{"step", "save", "files": '
            '{name: {"sha256", "size"}}})'
        )
    return RemoteManifest(uri=uri, step=step, save=save, files=files, raw=raw)


def remote_manifest(uri: str) -> RemoteManifest | None:
    """The remote-layout manifest at `<uri>/manifest.json`, or None when there is none or it is
    no remote one (a directory copied there whole has a manifest without a save: its files lie
    beside it)."""
    try:
        return read_manifest(uri)
    except FileNotFoundError:
        return None
    except ValueError:
        return None
