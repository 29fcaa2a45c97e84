"""Saving a checkpoint. A save has three parts: `snapshot` copies the live state into CPU
buffers (the training loop waits for this part only), `write_temporary` writes files from the
copy into a temporary directory (a background thread may do it while training goes on:
`CheckpointWriter`), and `publish_checkpoint` renames it into place (the loop, once the service
confirmed it still owns the attempt).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from worker import failpoint
from worker.checkpoint.layout import (
    LEDGER,
    MANIFEST,
    MODEL_WEIGHTS,
    OPTIMIZER,
    RNG,
    STATE,
    CheckpointState,
    quarantine_checkpoint,
    read_state,
    step_dir_name,
    temporary_name,
    verify_checkpoint,
)
from worker.checkpoint.manifest import Entry, describe
from worker.checkpoint.shards import SHARDS, ShardedSave
from worker.data.tokenizer import EOS_TOKEN, PAD_TOKEN
from worker.error import CheckpointError, DiskFull
from worker.files import free_bytes, fsync_dir, fsync_file, mib, out_of_space
from worker.model.optim import Optimizers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """A copy of everything a checkpoint holds, detached from the live model and optimizers."""

    state: CheckpointState
    config: Any  # the model's transformers config (not changed by training)
    # Parameter and persistent buffer name -> CPU copy; None: only in the shards.
    weights: dict[str, torch.Tensor] | None
    optimizer: dict[str, Any]  # `Optimizers.state_dict()` with CPU copies of its tensors
    rng: dict[str, torch.Tensor]  # `PrivateRandom.state_dict()`
    # A sharded phase's: every rank writes its shards into this save's directory.
    sharded: ShardedSave | None = None


class CpuBuffers:
    """CPU tensors reused from one snapshot to the next (pinned when CUDA is available, so the
    device-to-host copies are DMA). A shape or dtype change allocates anew."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, ...], torch.Tensor] = {}
        self._pin = torch.cuda.is_available()

    def copy(self, key: tuple[str, ...], tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
            self._buffers[key] = buffer
        buffer.copy_(tensor.detach(), non_blocking=True)
        return buffer


def _copy_tree(value: Any, key: tuple[str, ...], buffers: CpuBuffers) -> Any:
    if isinstance(value, torch.Tensor):
        return buffers.copy(key, value)
    if isinstance(value, dict):
        return {k: _copy_tree(v, (*key, str(k)), buffers) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_tree(v, (*key, str(i)), buffers) for i, v in enumerate(value)]
    return value


def snapshot(
    *,
    model: PreTrainedModel,
    optimizers: Optimizers,
    state: CheckpointState,
    rng: dict[str, torch.Tensor],
    buffers: CpuBuffers,
    sharded: ShardedSave | None = None,
) -> Snapshot:
    """Copy the model's weights, the optimizer state and the RNG into `buffers`. The snapshot
    shares the buffers: take the next one only after the previous snapshot is written.
    `sharded`: this rank's sharded save in flight (worker.checkpoint.shards), whose optimizer state
    and weights (gathered whole, or None: only in the shards) are taken instead of the live ones,
    which hold this rank's shard only."""
    weights = None
    live = model.state_dict() if sharded is None else sharded.weights
    if live is not None:
        # The names `load_weights` requires: parameters (a tied weight once) and persistent
        # buffers.
        names = [n for n, _ in model.named_parameters()]
        names += [n for n, _ in model.named_buffers() if n in live and n not in names]
        weights = {n: buffers.copy(("model", n), live[n]) for n in names}
    optimizer_state = optimizers.state_dict() if sharded is None else sharded.optimizer
    optimizer = _copy_tree(optimizer_state, ("optimizer",), buffers)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # CPU-GPU sync: the non-blocking copies must have landed
    return Snapshot(
        state=state,
        config=model.config,
        weights=weights,
        optimizer=optimizer,
        rng=rng,
        sharded=sharded,
    )


def write_temporary(*, directory: Path, snapshot: Snapshot, tokenizer: Tokenizer) -> Path:
    """Write a complete checkpoint of `snapshot.state.step` into a fresh temporary directory
    under `directory` and return it: every file fsynced, the manifest last. Nothing outside that
    directory is touched, so a writer that lost its attempt meanwhile (a stop, a revived
    zombie) harms no one; `publish_checkpoint` puts it in place once the writer is still owner.
    Sharded (`snapshot.sharded`), the directory is the one every rank writes its shards into,
    and the manifest waits for them.

    A write that fails removes the temporary directory: never put in place, it only holds
    space. DiskFull when the file system has less free space than the snapshot needs
    (`needed_bytes`), found before the first byte is written, or when a write failed for lack
    of it."""
    state = snapshot.state
    directory.mkdir(parents=True, exist_ok=True)
    # One statvfs: cheap to know before a save, and it spares writing one that cannot fit.
    needed = needed_bytes(snapshot)
    free = free_bytes(directory)
    sharded = snapshot.sharded is not None
    tmp = snapshot.sharded.directory if snapshot.sharded else directory / temporary_name(state.step)
    try:
        if free < needed:
            raise DiskFull(_no_room(directory, state.step, free=free, needed=needed))
        tmp.mkdir(exist_ok=sharded)  # DCP may have made it, for the shards
        _write_parts(tmp, snapshot, tokenizer)
    except DiskFull:
        _discard(tmp, snapshot)
        raise
    except Exception as err:
        full = _ran_out_of_space(err, directory, tmp, state.step, needed)
        _discard(tmp, snapshot)
        if full is None:
            raise
        raise full from err
    return tmp


def _write_parts(tmp: Path, snapshot: Snapshot, tokenizer: Tokenizer) -> None:
    state = snapshot.state
    # The model as `save_pretrained` writes it: config.json and model.safetensors.
    snapshot.config.save_pretrained(tmp)
    if snapshot.weights is not None:
        save_file(snapshot.weights, tmp / MODEL_WEIGHTS, metadata={"format": "pt"})
    failpoint.hit("mid_checkpoint", state.step)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    ).save_pretrained(tmp)
    torch.save(snapshot.optimizer, tmp / OPTIMIZER)
    torch.save(snapshot.rng, tmp / RNG)
    saved = asdict(state)
    target_tokens = saved.pop("source_target_tokens")
    (tmp / STATE).write_text(json.dumps(saved, indent=1))
    if target_tokens is not None:
        ledger = {"source_target_tokens": target_tokens}
        (tmp / LEDGER).write_text(json.dumps(ledger, indent=1))
    manifest = {"step": state.step, "files": _manifest_entries(tmp, snapshot.sharded)}
    # The manifest is written last: a directory with a verifying manifest is complete.
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    fsync_file(tmp / MANIFEST)
    fsync_dir(tmp)


# What a checkpoint holds beyond its tensors, from above: the tokenizer files (~10 MiB for a
# vocabulary of 150k tokens), config and state JSON, the manifest, torch.save's zip records and
# safetensors' header.
_SPACE_MARGIN = 32 * 2**20


def needed_bytes(snapshot: Snapshot) -> int:
    """Roughly the bytes `snapshot` takes on disk, from above: its tensors' and a margin. Of a
    sharded phase's, what this rank writes besides the shards (DCP writes those)."""
    return _tensor_bytes([snapshot.weights, snapshot.optimizer, snapshot.rng]) + _SPACE_MARGIN


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _no_room(directory: Path, step: int, *, free: int, needed: int) -> str:
    return (
        f"no space for the checkpoint of step {step} in {directory}: {mib(free)} free, it "
        f"needs about {mib(needed)}; free space there (older runs' checkpoints, token stores "
        "no run needs) or move the artifact store, then resume the run (trainctl runs resume)"
    )


def _ran_out_of_space(
    err: Exception, directory: Path, tmp: Path, step: int, needed: int
) -> DiskFull | None:
    """DiskFull when the write that failed with `err` ran out of space: its error says so
    (ENOSPC, EDQUOT), or the file system now has less free space than what was left to write
    (torch's zip writer fails on a full disk with "unexpected pos", no errno). Measured before
    the partial directory `tmp` is removed, which frees what it held."""
    free = free_bytes(directory)
    written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) if tmp.is_dir() else 0
    if out_of_space(err) is None and free >= needed - written:
        return None
    failed = f"{type(err).__name__}: {err}"
    return DiskFull(f"{_no_room(directory, step, free=free, needed=needed)} ({failed})")


def _discard(tmp: Path, snapshot: Snapshot) -> None:
    """Remove the temporary directory of a save that failed; sharded, once every rank's DCP
    save into it has ended, well or not, so that no shard is written after."""
    if snapshot.sharded is not None:
        wait([snapshot.sharded.written])
    shutil.rmtree(tmp, ignore_errors=True)


def _manifest_entries(tmp: Path, sharded: ShardedSave | None) -> dict[str, Entry]:
    """Every file of the checkpoint in `tmp`, fsynced, by name, with its SHA-256 and size.
    Sharded, the shard files' entries are the ones their ranks made (each hashed what it wrote,
    and DCP fsynced it): this process reads none of another rank's shards."""
    entries: dict[str, Entry] = {}
    if sharded is not None:
        # Done once every rank's shards and DCP's metadata are written, fsynced and hashed.
        entries = sharded.written.result()
        # Their names too: DCP fsyncs the files, not the directory that lists them.
        fsync_dir(tmp / SHARDS)
    names = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    rest = [name for name in names if name not in entries]
    for name in rest:
        fsync_file(tmp / name)
    return dict(sorted({**entries, **describe(tmp, rest)}.items()))


def publish_checkpoint(tmp: Path) -> Path:
    """Rename the complete temporary checkpoint `tmp` into place as `step-NNNNNNNN` and return
    that path. Never over an existing step directory: rename(2) refuses a non-empty target,
    atomically, so a checkpoint another attempt put there (the attempt that replaced a revived
    zombie, or one that died before registering it) is never clobbered. An existing one that
    verifies as this run's checkpoint of the same step is kept and `tmp` discarded; one that
    does not is quarantined (renamed aside, never deleted) and `tmp` takes its place."""
    state = read_state(tmp)
    final = tmp.parent / step_dir_name(state.step)
    for _ in range(2):
        try:
            os.rename(tmp, final)
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        else:
            fsync_dir(final.parent)
            return final
        problem = _unusable_as(final, state)
        if problem is None:
            log.warning(
                "checkpoint %s already exists (written by attempt %s); keeping it, not ours",
                final,
                read_state(final).attempt_id,
            )
            shutil.rmtree(tmp)
            return final
        log.warning(
            "checkpoint %s is in the way (%s); quarantined as %s",
            final,
            problem,
            quarantine_checkpoint(final),
        )
    raise CheckpointError(f"cannot rename {tmp} to {final}: something keeps recreating {final}")


def _unusable_as(path: Path, state: CheckpointState) -> str | None:
    """Why the checkpoint at `path` cannot stand for `state` (same run, same step), or None."""
    try:
        verify_checkpoint(path)
        existing = read_state(path)
    except (CheckpointError, OSError, ValueError, TypeError) as err:
        return str(err)
    if (existing.signature, existing.step) != (state.signature, state.step):
        return (
            f"it holds step {existing.step} of signature {existing.signature}, "
            f"not step {state.step} of {state.signature}"
        )
    return None


def save_checkpoint(
    *,
    directory: Path,
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    optimizers: Optimizers,
    state: CheckpointState,
    rng: dict[str, torch.Tensor],
) -> Path:
    """Write a complete checkpoint of `state.step` under `directory`, synchronously."""
    copy = snapshot(model=model, optimizers=optimizers, state=state, rng=rng, buffers=CpuBuffers())
    return publish_checkpoint(
        write_temporary(directory=directory, snapshot=copy, tokenizer=tokenizer)
    )


class CheckpointWriter:
    """Saves in the background, one save at a time: `start` copies the state (the loop waits
    for that only) and writes a temporary directory in a thread; `poll`/`wait` hand a finished
    one back to the caller's thread, which checks it still owns the attempt and only then
    publishes (`publish_checkpoint`) and registers it. The thread never renames or deletes
    anything outside its own temporary directory, so a save in flight when the attempt is
    stopped or superseded harms nothing. A failed write raises from `poll`/`wait`."""

    def __init__(
        self, *, directory: Path, tokenizer: Tokenizer, upload: Callable[[Path], None] | None = None
    ) -> None:
        self._directory = directory
        self._tokenizer = tokenizer
        # On an object store: the save's files go up in the same background thread, after the
        # local write (worker.remote.checkpoints); the loop only commits the manifest.
        self._upload = upload
        self._buffers = CpuBuffers()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: tuple[CheckpointState, Future[Path]] | None = None
        self.last_started: int | None = None  # the step of the newest save started

    def start(
        self,
        *,
        model: PreTrainedModel,
        optimizers: Optimizers,
        state: CheckpointState,
        rng: dict[str, torch.Tensor],
        sharded: ShardedSave | None = None,
    ) -> tuple[CheckpointState, Path] | None:
        """Start saving `state.step` (`sharded`: as `snapshot`). Waits first for the save in
        flight (the buffers are reused) and returns it when it finished meanwhile."""
        previous = self.wait()
        copy = snapshot(
            model=model,
            optimizers=optimizers,
            state=state,
            rng=rng,
            buffers=self._buffers,
            sharded=sharded,
        )
        future = self._executor.submit(self._write, copy)
        self._pending = (state, future)
        self.last_started = state.step
        return previous

    def _write(self, copy: Snapshot) -> Path:
        tmp = write_temporary(directory=self._directory, snapshot=copy, tokenizer=self._tokenizer)
        if self._upload is not None:
            try:
                self._upload(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return tmp

    def poll(self) -> tuple[CheckpointState, Path] | None:
        """The save in flight, if it has finished (once), with its temporary directory; None
        otherwise."""
        if self._pending is None or not self._pending[1].done():
            return None
        return self.wait()

    def wait(self) -> tuple[CheckpointState, Path] | None:
        """Block until the save in flight is on disk and return it with its temporary
        directory; None if there is none."""
        if self._pending is None:
            return None
        state, future = self._pending
        self._pending = None
        return state, future.result()

    def close(self) -> None:
        """Let a save in flight finish writing its temporary directory (left unpublished, for
        `remove_stale_temporaries` of a later attempt) and stop the thread."""
        self._pending = None
        self._executor.shutdown(wait=True)
