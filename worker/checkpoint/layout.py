"""What a checkpoint is on disk: `<artifact_dir>/checkpoints/step-<NNNNNNNN>/`, one explicit set
of named parts.

A checkpoint counts only when complete: every part is written into a temporary directory and
fsynced, the manifest (SHA-256 and size of every other file) is written last, and the directory
is renamed into place (worker.checkpoint.writer). Here: the names of its parts and directories,
its state, the check that it is complete (`verify_checkpoint`), a corrupt one set aside
(`quarantine_checkpoint`), which ones retention deletes (`select_expired`) and what dead
writers left behind (`remove_stale_temporaries`). The worker reports every quarantine and
deletion to the service, whose registry follows the disk.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from contracts.paths import RUNS_FOLDER
from runtime.store import is_store_uri, join
from worker.checkpoint.manifest import MANIFEST, check
from worker.checkpoint.shards import SHARDS_METADATA
from worker.error import CheckpointError
from worker.files import fsync_dir
from worker.model.model import WEIGHTS_FILE
from worker.settings import get_settings

CHECKPOINTS_DIR = "checkpoints"
# Parts. The model (config.json, WEIGHTS_FILE) and the tokenizer files are written by
# transformers' `save_pretrained`, so a step directory loads with plain transformers.
MODEL_CONFIG = "config.json"
MODEL_WEIGHTS = WEIGHTS_FILE
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
STATE = "state.json"
# The token ledger's counts that depend on what the batches held (worker.train.ledger), in a
# part of their own: a worker from before them reads state.json's keys strictly, and so still
# resumes the checkpoint (the manifest lists this file, which it checks and leaves unread).
LEDGER = "ledger.json"

_STEP_PREFIX = "step-"
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class CheckpointState:
    step: int  # global step: updates done over the whole run
    phase_index: int
    phase_name: str
    phase_step: int
    tokens_seen: int  # tokens processed over the whole run (the microbatch envelope)
    signature: str
    attempt_id: str
    groups: dict[str, list[str]]  # optimizer -> parameter names, in group order
    # Target tokens trained per source of the phase, phase steps 1 .. phase_step (the token
    # ledger, worker.train.ledger), kept in LEDGER; None in checkpoints written before it was
    # counted.
    source_target_tokens: dict[str, int] | None = None


def step_dir_name(step: int) -> str:
    return f"{_STEP_PREFIX}{step:08d}"


def checkpoints_dir(artifact_dir: str | Path) -> Path:
    return Path(artifact_dir) / CHECKPOINTS_DIR


def local_artifact_dir(artifact_dir: str) -> Path:
    """Where this process keeps a run's artifacts: the folder `artifact_dir` itself, or for a
    run on an object store, its place in this worker's cache (`<cache_dir>/runs/<run>`)."""
    if not is_store_uri(artifact_dir):
        return Path(artifact_dir)
    return get_settings().cache_dir / RUNS_FOLDER / artifact_dir.rstrip("/").rsplit("/", 1)[-1]


def local_path(location: str) -> Path:
    """Where this process reads the checkpoint the service names `location` by: the path
    itself, or for a checkpoint on an object store (`<root>/runs/<run>/checkpoints/step-N`),
    its copy in this worker's cache (`<cache_dir>/runs/<run>/checkpoints/step-N`), which
    `fetch` fills."""
    if not is_store_uri(location):
        return Path(location)
    run_dir, _, step = location.rstrip("/").rpartition(f"/{CHECKPOINTS_DIR}/")
    return local_artifact_dir(run_dir) / CHECKPOINTS_DIR / step


def published_path(artifact_dir: str, local: Path) -> str:
    """The name the service knows the checkpoint at `local` by: its URI on an object store,
    its path otherwise."""
    if not is_store_uri(artifact_dir):
        return str(local)
    return join(artifact_dir, CHECKPOINTS_DIR, local.name)


def step_of(path: Path) -> int | None:
    """The step of a `step-NNNNNNNN` directory; None for any other name."""
    name = path.name
    if not name.startswith(_STEP_PREFIX):
        return None
    digits = name.removeprefix(_STEP_PREFIX)
    return int(digits) if digits.isdigit() else None


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step directory, newest first; complete or not."""
    if not directory.is_dir():
        return []
    found = [(step, p) for p in directory.iterdir() if (step := step_of(p)) is not None]
    return sorted(found, reverse=True)


def temporary_name(step: int) -> str:
    """A temporary step directory's name, unique per save: two processes may share a pid
    (containers) and a directory (a zombie and the attempt that replaced it)."""
    return f"{_TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def read_state(path: Path) -> CheckpointState:
    """The checkpoint's state.json, with the token ledger's counts (LEDGER) where it has them."""
    saved = json.loads((path / STATE).read_text())
    if (path / LEDGER).is_file():
        saved.update(json.loads((path / LEDGER).read_text()))
    return CheckpointState(**saved)


def verify_checkpoint(
    path: Path,
    progress: Callable[[], None] | None = None,
    *,
    share: Callable[[str], bool] | None = None,
) -> None:
    """Raise CheckpointError unless every file the manifest lists is present and intact.
    `progress` is called after each MiB hashed: a large checkpoint takes minutes. `share`:
    only the files whose names it accepts are checked (one rank's share of the checkpoint; the
    manifest itself is checked all the same)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST}")
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST}: {err}") from err
    # The model is whole in MODEL_WEIGHTS, or in the shards of a sharded phase, or both.
    weights = MODEL_WEIGHTS if SHARDS_METADATA not in files else SHARDS_METADATA
    for name in (MODEL_CONFIG, weights, OPTIMIZER, RNG, STATE):
        if name not in files:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} does not list {name}")
    check(path, {n: e for n, e in files.items() if share is None or share(n)}, progress)


def quarantine_checkpoint(path: Path) -> Path | None:
    """Rename a checkpoint that failed verification to `step-NNNNNNNN.corrupt-<unix time>`:
    out of every listing (never resumed from, never deleted by retention), kept for a human to
    inspect. Returns the new path, or None when there is nothing at `path`."""
    if not path.exists():
        return None
    target = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


def select_expired(
    directory: Path,
    *,
    keep_last: int,
    keep_steps: Iterable[int] = (),
    newest: int | None = None,
) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint retention deletes, newest first: all but the
    `keep_last` newest and those at `keep_steps` (each phase's final one, which the next phase
    starts from; the run's pinned steps, which other runs start from). With `newest` (the step
    just registered), only checkpoints up to it are ranked or deleted: newer ones are leftovers
    of an attempt that died before registering them, which this attempt will overwrite, and
    must not push the ones the service holds out of `keep_last`. Deletes nothing: the caller
    deletes each once the service recorded its deletion."""
    paths = dict(list_checkpoints(directory))
    steps = expired_steps(list(paths), keep_last=keep_last, keep_steps=keep_steps, newest=newest)
    return [(step, paths[step]) for step in steps]


def expired_steps(
    steps: Iterable[int],
    *,
    keep_last: int,
    keep_steps: Iterable[int] = (),
    newest: int | None = None,
) -> list[int]:
    """The rule of `select_expired` over bare steps (of a folder, or of an object store)."""
    kept = set(keep_steps)
    ranked = sorted((s for s in steps if newest is None or s <= newest), reverse=True)
    return [s for rank, s in enumerate(ranked) if rank >= keep_last and s not in kept]


def remove_stale_temporaries(directory: Path) -> None:
    """Remove temporary directories left by writers that died mid-checkpoint (SIGKILL)."""
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if path.name.startswith(_TMP_PREFIX) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
