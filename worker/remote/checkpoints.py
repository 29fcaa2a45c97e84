"""A run's checkpoints on an object store, where nothing can be renamed: a checkpoint commits
when its manifest is written, last, with a create-only put.

Layout under the store's root (runtime.store), for the checkpoint of step N:

    runs/<run>/checkpoints/step-NNNNNNNN/manifest.json    the commit
    runs/<run>/checkpoints/step-NNNNNNNN/<save>/<file>    the files of one save

The manifest is the local one (worker.checkpoint.manifest: every file with its SHA-256 and
size) plus `save`, the folder its files lie in. Every save uploads into a folder of its own, so
two writers of one step (a revived zombie and the attempt that replaced it) never mix their
files, and the first manifest put wins, as the first rename does on a folder. A crash mid-upload
leaves files under a save no manifest names: never listed, never resumed from, collected at the
next attempt's start (`collect_leftovers`).

The worker keeps the local layout as its staging area and cache
(`<cache_dir>/runs/<run>/checkpoints/step-N`, worker.checkpoint.writer writes it as ever): the
loop waits for the copy into CPU buffers only, the writer thread writes the files and uploads
them (`upload_files`), and the loop commits the manifest (`commit`) once the service confirmed
it still owns the attempt, before it registers the checkpoint by its URI. A resume downloads
the one checkpoint it starts from (`fetch`), verifies it against its manifest, and loads it
from local disk like any other; the local copy's manifest is byte for byte the remote one, so
the checkpoint's content digest is the same on both sides (service: from the manifest alone).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from contracts.paths import RUNS_FOLDER
from contracts.reports import Claim
from runtime.store import ArtifactStore, is_store_uri, join, open_store
from worker import failpoint
from worker.checkpoint.layout import (
    CHECKPOINTS_DIR,
    MANIFEST,
    STATE,
    local_path,
    read_state,
    step_dir_name,
    step_of,
    verify_checkpoint,
)
from worker.error import CheckpointError
from worker.files import fsync_dir
from worker.remote.cache import Cache
from worker.settings import get_settings

log = logging.getLogger(__name__)

# Files uploaded at once: a checkpoint is a few large files (weights, optimizer state, shards)
# and a dozen small ones; the large ones go up in parts, concurrently, by themselves.
_UPLOADS = 4
_DOWNLOAD_PREFIX = ".tmp-download-"


def save_id(tmp: Path) -> str:
    """The folder a save's files go up into, from its temporary directory's name (unique per
    save: worker.checkpoint.layout.temporary_name)."""
    return hashlib.sha256(tmp.name.encode()).hexdigest()[:16]


class RemoteCheckpoints:
    """The checkpoints of the run whose artifacts lie at `artifact_dir`
    (`<store root>/runs/<run>`, an object store URI)."""

    def __init__(self, artifact_dir: str, store: ArtifactStore | None = None) -> None:
        root, sep, run = artifact_dir.rstrip("/").rpartition(f"/{RUNS_FOLDER}/")
        if not sep or not run or "/" in run:
            raise CheckpointError(f"{artifact_dir} is not a run's folder (<root>/runs/<run>)")
        self.artifact_dir = artifact_dir.rstrip("/")
        self.store = store if store is not None else open_store(root)
        self.prefix = f"{RUNS_FOLDER}/{run}/{CHECKPOINTS_DIR}"

    @classmethod
    def of(cls, artifact_dir: str) -> RemoteCheckpoints | None:
        """The run's remote checkpoints; None for a run in a folder."""
        return cls(artifact_dir) if is_store_uri(artifact_dir) else None

    def uri(self, step: int) -> str:
        return join(self.artifact_dir, CHECKPOINTS_DIR, step_dir_name(step))

    def _step_key(self, step: int) -> str:
        return f"{self.prefix}/{step_dir_name(step)}"

    # --- writing ------------------------------------------------------------------------

    def upload_files(self, tmp: Path) -> None:
        """Upload every file of the complete temporary checkpoint `tmp` but its manifest into
        the save's own folder. Committed by `commit`; until then invisible."""
        state = read_state(tmp)
        base = f"{self._step_key(state.step)}/{save_id(tmp)}"
        names = sorted(
            p.relative_to(tmp).as_posix()
            for p in tmp.rglob("*")
            if p.is_file() and p.name != MANIFEST
        )
        with ThreadPoolExecutor(max_workers=_UPLOADS, thread_name_prefix="upload") as pool:
            for done in [pool.submit(self.store.put_file, f"{base}/{n}", tmp / n) for n in names]:
                done.result()
        failpoint.hit("mid_upload", state.step)

    def commit(self, tmp: Path) -> bool:
        """Put the manifest of the uploaded save `tmp`, with its save folder, unless a manifest
        of that step exists: the checkpoint now exists. `tmp`'s own manifest is rewritten to
        the same bytes, so that the local copy is the remote one. Returns False when another
        writer's manifest was there and stands for this run's step (this save is then dropped:
        the caller discards `tmp`); one that does not is moved aside
        (`step-N.corrupt-<time>/manifest.json`) and this one put in its place."""
        state = read_state(tmp)
        local = json.loads((tmp / MANIFEST).read_text())
        data = json.dumps({**local, "save": save_id(tmp)}, indent=1).encode()
        key = f"{self._step_key(state.step)}/{MANIFEST}"
        for _ in range(2):
            if self.store.put_bytes(key, data, create=True):
                (tmp / MANIFEST).write_bytes(data)
                return True
            problem = self._unusable(state.step, state.signature)
            if problem is None:
                log.warning(
                    "checkpoint %s already exists; keeping it, not ours", self.uri(state.step)
                )
                self.store.delete(self._save_keys(state.step, save_id(tmp)))
                return False
            aside = f"{self._step_key(state.step)}.corrupt-{int(time.time())}/{MANIFEST}"
            self.store.put_bytes(aside, self.store.get_bytes(key))
            self.store.delete([key])
            log.warning("checkpoint %s is in the way (%s); its manifest is kept as %s",
                        self.uri(state.step), problem, aside)  # fmt: skip
        raise CheckpointError(f"cannot commit {key}: something keeps writing it")

    def _unusable(self, step: int, signature: str) -> str | None:
        try:
            manifest = self.manifest(step)
            state = json.loads(
                self.store.get_bytes(f"{self._step_key(step)}/{manifest['save']}/{STATE}")
            )
        except (FileNotFoundError, ValueError, KeyError, TypeError) as err:
            return f"unreadable: {err}"
        if (state.get("signature"), state.get("step")) != (signature, step):
            return f"it holds step {state.get('step')} of signature {state.get('signature')}"
        return None

    def _save_keys(self, step: int, save: str) -> list[str]:
        return [i.key for i in self.store.list(f"{self._step_key(step)}/{save}")]

    # --- reading ------------------------------------------------------------------------

    def manifest(self, step: int) -> dict[str, object]:
        """The committed manifest of `step`; FileNotFoundError when there is none."""
        value = json.loads(self.store.get_bytes(f"{self._step_key(step)}/{MANIFEST}"))
        if not isinstance(value, dict) or not isinstance(value.get("save"), str):
            raise CheckpointError(f"{self.uri(step)}/{MANIFEST} names no save folder")
        return value

    def steps(self) -> list[int]:
        """The steps with a committed checkpoint, newest first."""
        found = set()
        for info in self.store.list(self.prefix):
            parts = info.key.removeprefix(f"{self.prefix}/").split("/")
            if (
                len(parts) == 2
                and parts[1] == MANIFEST
                and (step := step_of(Path(parts[0]))) is not None
            ):
                found.add(step)
        return sorted(found, reverse=True)

    def fetch(self, step: int, into: Path) -> Path:
        """The committed checkpoint of `step` as the local step directory under `into` (a
        run's local checkpoints folder), downloaded unless a copy with the same manifest is
        there already, and verified. A download that fails verification is still put in place,
        so that the loader's own verification quarantines it and reports it like any other
        corrupt checkpoint. FileNotFoundError when no manifest of `step` exists."""
        key = f"{self._step_key(step)}/{MANIFEST}"
        data = self.store.get_bytes(key)
        final = into / step_dir_name(step)
        if (final / MANIFEST).is_file() and (final / MANIFEST).read_bytes() == data:
            return final
        manifest = json.loads(data)
        save, files = manifest.get("save"), manifest.get("files")
        if not isinstance(save, str) or not isinstance(files, dict):
            raise CheckpointError(f"{self.uri(step)}/{MANIFEST} lists no files and save folder")
        into.mkdir(parents=True, exist_ok=True)
        tmp = into / f"{_DOWNLOAD_PREFIX}{step_dir_name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with ThreadPoolExecutor(max_workers=_UPLOADS, thread_name_prefix="download") as pool:
                jobs = []
                for name in sorted(files):
                    target = tmp / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    remote = f"{self._step_key(step)}/{save}/{name}"
                    jobs.append(pool.submit(self.store.get_file, remote, target))
                for job in jobs:
                    job.result()
            (tmp / MANIFEST).write_bytes(data)
            try:
                verify_checkpoint(tmp)
            except CheckpointError as err:
                log.warning("downloaded checkpoint %s fails verification: %s", self.uri(step), err)
            if final.exists():
                shutil.rmtree(final)  # a stale local copy of another save of this step
            os.rename(tmp, final)
            fsync_dir(into)
            log.info("downloaded checkpoint %s (%d files) to %s", self.uri(step), len(files), final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    # --- retiring -----------------------------------------------------------------------

    def delete(self, step: int) -> None:
        """Delete the checkpoint of `step`: its manifest first (it stops existing), then every
        file under the step, of any save."""
        key = self._step_key(step)
        self.store.delete([f"{key}/{MANIFEST}"])
        self.store.delete([i.key for i in self.store.list(key)])

    def collect_leftovers(self) -> list[str]:
        """Delete what no manifest names: the files of saves that never committed (a writer
        killed mid-upload, or one that lost the race to commit). Call it when no save of this
        run is in flight (an attempt's start, before its first save); returns the keys
        deleted. A zombie writer still uploading leaves what it writes after this for the next
        attempt's start."""
        committed: dict[str, str | None] = {}
        leftovers: list[str] = []
        objects = list(self.store.list(self.prefix))
        for info in objects:
            parts = info.key.removeprefix(f"{self.prefix}/").split("/")
            if len(parts) == 2 and parts[1] == MANIFEST:
                try:
                    committed[parts[0]] = str(json.loads(self.store.get_bytes(info.key))["save"])
                except (FileNotFoundError, ValueError, KeyError, TypeError):
                    committed[parts[0]] = None  # unreadable: left alone for a human
        for info in objects:
            parts = info.key.removeprefix(f"{self.prefix}/").split("/")
            if len(parts) < 3 or step_of(Path(parts[0])) is None:
                continue  # a manifest, or a quarantined step's folder
            if parts[0] in committed and committed[parts[0]] in (parts[1], None):
                continue
            leftovers.append(info.key)
        self.store.delete(leftovers)
        return leftovers


def run_checkpoint(location: str) -> tuple[str, int] | None:
    """(the run's folder, the step) of a run's checkpoint in an object store
    (`<root>/runs/<run>/checkpoints/step-N`); None for anything else."""
    if not is_store_uri(location):
        return None
    run_dir, _, name = location.rstrip("/").rpartition(f"/{CHECKPOINTS_DIR}/")
    step = step_of(Path(name))
    parent = run_dir.rpartition("/")[0]
    if step is None or not parent.endswith(f"/{RUNS_FOLDER}"):
        return None
    return run_dir, step


def fetch_claimed(claim: Claim) -> None:
    """Before an attempt on an object store starts: download the checkpoint it starts from (its
    `resume_from`, or else an initial checkpoint that is another run's checkpoint in the
    store) into this worker's cache, where `local_path` finds it. Nothing else is downloaded.
    CheckpointError when the store has no such checkpoint."""
    wanted = claim.resume_from.path if claim.resume_from is not None else claim.initial_checkpoint
    found = None if wanted is None else run_checkpoint(wanted)
    if wanted is None or found is None:
        return  # a local checkpoint, or an input object (fetched with the inputs)
    run_dir, step = found
    try:
        copy = RemoteCheckpoints(run_dir).fetch(step, local_path(wanted).parent)
    except FileNotFoundError as err:
        raise CheckpointError(
            f"checkpoint {wanted} is not in the object store (no {MANIFEST}): {err}"
        ) from err
    settings = get_settings()
    Cache(settings.cache_dir, settings.cache_max_bytes).evict(in_use=[copy])
