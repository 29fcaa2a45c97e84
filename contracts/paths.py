"""Confined paths: the one rule for every path the API accepts, applied by the service when a
request names a file and again by the worker before it reads one (defence in depth).

A path may be read when it *resolves* (symlinks and `..` followed, `os.path.realpath`) inside
one of the data roots (`TRAINCTL_DATA_ROOTS`, folders separated by `os.pathsep`, ":" on POSIX;
default: the service's `TRAINCTL_DATA_ROOT`). A checkpoint (an initial checkpoint, a pretrained
model directory, the checkpoint of an evaluation) may also lie in the artifact store's `runs/`
folder, where trainctl writes the checkpoints of runs. For a directory, every file in it that a
reader could open (what `contracts.signature.sha256_path` hashes) must resolve inside too: a
link in a root that points out of it is refused like the path of its target.

A path in a run's folder of the artifact store is of that run: the service maps it to the run
(`DataRoots.in_runs`), refuses it as a run that does not exist when its caller may not see the
run (whatever the path names: a checkpoint, or a tokenizer or data file in the run's folder),
and checks a checkpoint there as it checks `{"run", "step"}`, so that it pins what it names.

The rule is applied to absolute paths; the reading side first resolves a relative one against
its base folder (runtime.path.resolve_path). Nothing here is read but directory entries and
links.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from contracts.bounds import EMPTY_PATH

# The environment variable both sides read, and what separates its folders.
ROOTS_VARIABLE = "TRAINCTL_DATA_ROOTS"
SEPARATOR = os.pathsep
# Under the artifact root: the folder of runs' checkpoints (service.workers.lease:
# <root>/runs/<run>).
RUNS_FOLDER = "runs"
# The URI schemes of an object store as artifact root (runtime.store), whose runs/ is no folder.
STORE_SCHEMES = ("s3://",)

# What a path names: data (a data file, a tokenizer) or a checkpoint (weights and config).
PathUse = Literal["data", "checkpoint"]


def split_roots(value: str) -> list[str]:
    """The folders of a `TRAINCTL_DATA_ROOTS` value: `os.pathsep`-separated, blanks ignored.
    An object store prefix (`s3://bucket/data`) is one root, its `://` no separator."""
    parts = [part.strip() for part in value.split(SEPARATOR)]
    joined: list[str] = []
    for part in parts:
        if joined and part.startswith("//") and f"{joined[-1]}://" in STORE_SCHEMES:
            joined[-1] = f"{joined[-1]}:{part}"
        elif part:
            joined.append(part)
    return joined


def is_uri(value: str | Path) -> bool:
    """An object in an object store (`s3://...`), not a local path."""
    return isinstance(value, str) and value.startswith(STORE_SCHEMES)


def _uri_prefix(value: str) -> str:
    """A URI root as a prefix that matches only what lies below it."""
    return value.rstrip("/") + "/"


def _real(path: str | Path) -> Path:
    """`path` with `~` expanded and every symlink and `..` resolved (what exists of it)."""
    return Path(os.path.realpath(Path(path).expanduser()))


def _normalized_uri(uri: str) -> str:
    """`s3://bucket/a/../b` as `s3://bucket/b`: `..` and `.` resolved in the text, so that a
    URI cannot climb out of a prefix."""
    scheme, rest = uri.split("://", 1)
    normal = posixpath.normpath(rest) if rest else rest
    return f"{scheme}://{normal}"


def _inside(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


@dataclass(frozen=True)
class DataRoots:
    """The folders paths given to the API must resolve inside: `roots` for everything, and
    `checkpoint_roots` besides for checkpoints. All are real paths (resolved when made)."""

    roots: tuple[Path, ...]
    checkpoint_roots: tuple[Path, ...] = ()
    # Object store prefixes (`s3://bucket/data/`), each ending in `/`: the URI roots of data
    # and of checkpoints (an object store artifact root's `runs/`).
    uri_roots: tuple[str, ...] = ()
    checkpoint_uri_roots: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, roots: Iterable[str | Path], *, artifact_root: str | Path | None = None
    ) -> DataRoots:
        """The rule over `roots` (each resolved now), with `<artifact_root>/runs` for
        checkpoints when an artifact root is given."""
        given = [str(root) if is_uri(str(root)) else root for root in roots]
        uris = tuple(
            dict.fromkeys(_uri_prefix(r) for r in given if isinstance(r, str) and is_uri(r))
        )
        local = [r for r in given if not (isinstance(r, str) and is_uri(r))]
        resolved = tuple(dict.fromkeys(_real(root) for root in local))
        if not resolved and not uris:
            raise ValueError(f"{ROOTS_VARIABLE} names no folder")
        store = artifact_root is not None and is_uri(str(artifact_root))
        extra = (_real(Path(artifact_root) / RUNS_FOLDER),) if artifact_root and not store else ()
        extra_uris = (
            (_uri_prefix(f"{str(artifact_root).rstrip('/')}/{RUNS_FOLDER}"),) if store else ()
        )
        return cls(
            roots=resolved,
            checkpoint_roots=extra,
            uri_roots=uris,
            checkpoint_uri_roots=extra_uris,
        )

    def allowed_uris(self, use: PathUse) -> tuple[str, ...]:
        return self.uri_roots + (self.checkpoint_uri_roots if use == "checkpoint" else ())

    def allowed(self, use: PathUse) -> tuple[Path, ...]:
        return self.roots + (self.checkpoint_roots if use == "checkpoint" else ())

    def in_runs(self, path: str) -> tuple[str, tuple[str, ...]] | None:
        """Where `path` (absolute) resolves in the artifact store's runs/ folder: the name of
        the run folder it lies in (the run's id) and the parts below that folder; None when it
        resolves elsewhere, or names runs/ itself. Symlinks and `..` are followed first, so a
        link in a data root into another run's folder is found too."""
        if is_uri(path):
            normal = _normalized_uri(path)
            for prefix in self.checkpoint_uri_roots:
                if normal.startswith(prefix) and normal != prefix:
                    run, *parts = normal.removeprefix(prefix).split("/")
                    return run, tuple(parts)
            return None
        try:
            real = _real(path)
        except (OSError, ValueError, RuntimeError):  # as `refusal`: a path the OS cannot use
            return None
        for root in self.checkpoint_roots:
            if real != root and real.is_relative_to(root):
                run, *below = real.relative_to(root).parts
                return run, tuple(below)
        return None

    def describe(self, use: PathUse = "data") -> str:
        """The folders of `use`, for messages: "/srv/data, /srv/shared"."""
        return ", ".join([*(str(root) for root in self.allowed(use)), *self.allowed_uris(use)])

    def refusal(self, path: str, use: PathUse = "data") -> str | None:
        """Why `path` (absolute) may not be read, or None. A path outside every root is named
        with the roots; one that lies in a root but resolves out of it (through a link) is named
        with its target too. A directory's files are checked as well (`tree_refusal`)."""
        if not path:
            return EMPTY_PATH
        if "\0" in path:
            return f"{path[:200]!r} is not a usable path (it contains a NUL byte)"
        if is_uri(path):
            normal = _normalized_uri(path)
            if not any(normal.startswith(prefix) for prefix in self.allowed_uris(use)):
                return (
                    f"{path} is outside the {self._folders(use)} ({self.describe(use)}); "
                    f"trainctl reads objects only under the prefixes of {ROOTS_VARIABLE}"
                )
            return None
        try:
            given = Path(path).expanduser()
            if not given.is_absolute():
                # Callers resolve relative paths against the data root first (resolve_path).
                return f"{path} is relative, and was not resolved against a folder"
            real = _real(given)
            if not _inside(real, self.allowed(use)):
                # The target is named only when the path itself lies in a root: then the link
                # is the operator's own; of a path outside, nothing beyond its name is told.
                lexical = Path(os.path.normpath(given))
                through = (
                    f" (it resolves to {real})"
                    if real != lexical and _inside(lexical, self.allowed(use))
                    else ""
                )
                return (
                    f"{path}{through} is outside the {self._folders(use)} "
                    f"({self.describe(use)}); trainctl reads files only under "
                    f"{ROOTS_VARIABLE}"
                )
            return self.tree_refusal(real, use, shown=path)
        # A name too long, a path the OS refuses; RuntimeError: `~user` with no such user.
        except (OSError, ValueError, RuntimeError) as err:
            return f"{path[:200]!r} is not a usable path ({err})"

    def tree_refusal(self, directory: Path, use: PathUse, *, shown: str) -> str | None:
        """Why a file in `directory` (real) may not be read: the first one, in sorted order,
        that resolves outside the roots of `use`; None when none does (or it is no directory).
        Walks what `contracts.signature.sha256_path` hashes: files, links to files included."""
        if not directory.is_dir():
            return None
        allowed = self.allowed(use)
        for child in sorted(directory.rglob("*")):
            if not child.is_symlink():
                continue  # a plain entry of a real directory inside a root stays inside
            target = _real(child)
            if not _inside(target, allowed):
                rel = child.relative_to(directory).as_posix()
                return (
                    f"{shown} holds {rel}, a link to {target}, "
                    f"outside the {self._folders(use)} ({self.describe(use)})"
                )
        return None

    def _folders(self, use: PathUse) -> str:
        return "data roots" if use == "data" else "data roots and the artifact store's runs"
