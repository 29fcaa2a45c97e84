"""A checkpoint manifest's entries: each file's SHA-256 and size, by its path relative to the
step directory. Made and checked by whichever process holds the file, so that no process
reads what another wrote: rank 0 for most of a checkpoint, each rank for the shards it wrote
(worker.checkpoint.shards) or reads. One process alone makes and checks them all
(worker.checkpoint.writer, worker.checkpoint.layout)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypedDict

from contracts.signature import sha256_file
from worker.error import CheckpointError

# A step directory's list of its files with their digests, written last: the checkpoint exists
# only once this does (worker.checkpoint.writer).
MANIFEST = "manifest.json"


class Entry(TypedDict):
    sha256: str
    size: int


def describe(
    root: Path, names: Iterable[str], progress: Callable[[], None] | None = None
) -> dict[str, Entry]:
    """The entries of the files `names` under `root`; `progress` is called after each MiB
    hashed."""
    return {
        name: {"sha256": sha256_file(root / name, progress), "size": (root / name).stat().st_size}
        for name in names
    }


def entry_of(root: Path, name: str) -> Entry:
    """The manifest's entry of the file `name` of the step directory `root`; CheckpointError
    when the manifest is unreadable or does not list it."""
    try:
        files = json.loads((root / MANIFEST).read_text())["files"]
        return Entry(sha256=str(files[name]["sha256"]), size=int(files[name]["size"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint {root}: its {MANIFEST} gives no digest of {name} ({err!r})"
        ) from err


def check(
    root: Path, entries: Mapping[str, Entry], progress: Callable[[], None] | None = None
) -> None:
    """Raise CheckpointError, naming the checkpoint and the file, unless every file of
    `entries` is present under `root` with that size and SHA-256."""
    for name, expected in entries.items():
        file = root / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {root}: {name} is missing")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(
                f"checkpoint {root}: {name} has {size} bytes, the manifest says {expected['size']}"
            )
        digest = sha256_file(file, progress)
        if digest != expected["sha256"]:
            raise CheckpointError(
                f"checkpoint {root}: {name} has SHA-256 {digest}, "
                f"the manifest says {expected['sha256']}"
            )
