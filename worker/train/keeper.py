"""A phase's checkpoints, from save to retirement, as the loop keeps them (`CheckpointKeeper`
on rank 0, `NoCheckpoints` on every other rank), and the parts a save gathers from every rank.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from contracts.reports import CheckpointRef, Claim
from contracts.workflow import Workflow
from worker import failpoint, metrics
from worker.checkpoint.layout import (
    CheckpointState,
    checkpoints_dir,
    expired_steps,
    list_checkpoints,
    local_artifact_dir,
    published_path,
    select_expired,
    step_dir_name,
    temporary_name,
)
from worker.checkpoint.shards import ShardedSave, ShardWriter
from worker.checkpoint.writer import CheckpointWriter, publish_checkpoint
from worker.link.reporter import Reporter
from worker.model.optim import Optimizers
from worker.model.rng import PrivateRandom
from worker.remote.checkpoints import RemoteCheckpoints
from worker.train.ledger import TokenLedger
from worker.train.ranks import Ranks

log = logging.getLogger(__name__)


class StopOrdered(Exception):
    """The service said stop: leave the loop at once, writing nothing more."""


class CheckpointKeeper:
    """The phase's checkpoints, from save to retirement. Saves run in the background, one at a
    time: `save` makes the loop wait only for the copy into CPU buffers. A finished save is put
    in place and registered from the loop's thread (`collect`, `wait`, or `save` finding the
    previous one done), and only after the service confirmed that this attempt still owns the
    run (the fencing check): a "stop" met there raises StopOrdered, a "pause" sets
    `pause_ordered`. Older checkpoints are deleted only once the service holds the new one,
    never one the service says another run needs (pinned), and each only once the service
    recorded its deletion. Pinned steps include the best checkpoint of each eval set the
    workflow's `checkpoint.keep_best` names: the service picks them, retention keeps them."""

    def __init__(
        self,
        *,
        writer: CheckpointWriter,
        reporter: Reporter,
        model: PreTrainedModel,
        optimizers: Optimizers,
        claim: Claim,
        workflow: Workflow,
        latest: CheckpointRef | None,
        remote: RemoteCheckpoints | None = None,
    ) -> None:
        offsets = workflow.phase_offsets()
        self._writer = writer
        self._reporter = reporter
        self._model = model
        self._optimizers = optimizers
        self._claim = claim
        self._phase = workflow.phases[claim.phase_index]
        self._offset = offsets[claim.phase_index]
        self._directory = checkpoints_dir(local_artifact_dir(claim.artifact_dir))
        # On an object store: the run's checkpoints there, committed by manifest; the local
        # folder is then only the staging area (worker.remote.checkpoints).
        self._remote = remote
        self._keep_last = workflow.checkpoint.keep_last
        # Each phase's final checkpoint is kept: the next phase starts from it.
        self._phase_finals = [o + p.steps for o, p in zip(offsets, workflow.phases, strict=True)]
        self.latest = latest  # the newest registered checkpoint of this phase
        self.pause_ordered = False  # a fencing check was answered "pause"

    def save(self, step: int, *, ledger: TokenLedger, parts: SaveParts) -> None:
        """Start saving the model after update `step` with `parts` (gathered from every rank:
        `gather_parts`) and the token counts of `ledger` at that step, unless that save is
        already under way; the previous save is registered first if it finished meanwhile."""
        if self._writer.last_started == step:
            return
        state = CheckpointState(
            step=step,
            phase_index=self._claim.phase_index,
            phase_name=self._phase.name,
            phase_step=step - self._offset,
            tokens_seen=ledger.tokens_seen,
            signature=self._claim.signature,
            attempt_id=self._claim.attempt_id,
            groups=self._optimizers.group_names(),
            source_target_tokens=ledger.target_tokens(),
        )
        saved = self._writer.start(
            model=self._model,
            optimizers=self._optimizers,
            state=state,
            rng=parts.rng,
            sharded=parts.sharded,
        )
        self._register(saved, done=step)

    def collect(self, done: int) -> None:
        """Register the save in flight if it has finished; `done`: the last update made."""
        self._register(self._writer.poll(), done=done)

    def wait(self, done: int) -> None:
        """Block until the save in flight is on disk, then register it."""
        self._register(self._writer.wait(), done=done)

    def close(self) -> None:
        self._writer.close()

    def _register(self, saved: tuple[CheckpointState, Path] | None, *, done: int) -> None:
        if saved is None:
            return
        state, tmp = saved
        # Fencing: a worker that lost its lease (a zombie revived after the reaper gave the
        # phase to another worker) learns it here, before it renames or deletes anything in
        # the run's checkpoints. Costs one request per checkpoint. An unreachable service
        # confirms nothing, but the rename never replaces a step directory and retention waits
        # for the registration to be taken, so what is written then clobbers no one.
        action = self._reporter.check(done, now=True)
        if action == "stop":
            raise StopOrdered
        self.pause_ordered = self.pause_ordered or action == "pause"
        if self._remote is None or self._remote.commit(tmp):
            path = publish_checkpoint(tmp)
        else:  # another writer's checkpoint of this step stands: this save is dropped
            shutil.rmtree(tmp)
            path = self._directory / step_dir_name(state.step)
        self.latest = CheckpointRef(
            path=published_path(self._claim.artifact_dir, path),
            step=state.step,
            phase_index=state.phase_index,
            phase_step=state.phase_step,
        )
        # Registered only once complete on disk. Older checkpoints are deleted only once the
        # service holds this one: until then, what it would resume from must stay.
        pinned = self._reporter.checkpoint(self.latest)  # a registration taken is fenced too
        if pinned is not None:
            self._retire(newest=state.step, pinned=pinned)
        metrics.CHECKPOINTS.inc()
        failpoint.hit("after_checkpoint", state.step)
        log.info("checkpoint %s (phase %r, step %d)", path, self._phase.name, state.step)

    def _retire(self, *, newest: int, pinned: frozenset[int]) -> None:
        """Retention, now that the service holds `newest`. Ranked up to `newest` only:
        unregistered leftovers of a dead attempt at later steps must not push out what the
        service holds or what this attempt started from; `pinned` (the answer to this very
        registration) is kept.

        Each deletion is reported first and done only once the service recorded it, so the
        registry never lists a checkpoint that is gone, and a run created from one after
        `pinned` was answered keeps it: the service refuses that report (409
        `checkpoint_pinned`). A report that is spooled (the service is unreachable) deletes
        nothing now; the next registration's retention reports it again."""
        reason = f"retention: keep_last {self._keep_last}, step {newest} registered"
        keep = [*self._phase_finals, *pinned]
        if self._remote is not None:
            self._retire_remote(newest=newest, keep=keep, reason=reason)
            return
        expired = select_expired(
            self._directory, keep_last=self._keep_last, keep_steps=keep, newest=newest
        )
        for step, path in expired:
            if self._reporter.checkpoint_removed(step, "deleted", reason):
                shutil.rmtree(path)
            else:
                log.info("keeping checkpoint %s: the service has not recorded its deletion", path)

    def _retire_remote(self, *, newest: int, keep: list[int], reason: str) -> None:
        """Retention on an object store: ranked over the committed manifests, each deletion
        reported first as in a folder. The local staging copies of all but `newest` go too:
        the store holds them."""
        assert self._remote is not None
        expired = expired_steps(
            self._remote.steps(), keep_last=self._keep_last, keep_steps=keep, newest=newest
        )
        for step in expired:
            if self._reporter.checkpoint_removed(step, "deleted", reason):
                self._remote.delete(step)
            else:
                log.info("keeping checkpoint of step %d: its deletion is not recorded", step)
        for step, path in list_checkpoints(self._directory):
            if step != newest:
                shutil.rmtree(path, ignore_errors=True)


class NoCheckpoints:
    """The checkpoints of a rank other than 0: none (rank 0's hold the replicated state)."""

    latest: CheckpointRef | None = None
    pause_ordered = False

    def save(self, step: int, *, ledger: TokenLedger, parts: SaveParts) -> None:
        pass

    def collect(self, done: int) -> None:
        pass

    def wait(self, done: int) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class SaveParts:
    """What a checkpoint needs from every rank: their random streams, and (sharded) each
    rank's shards, being written (worker.checkpoint.shards); None: the live model's and
    optimizers'."""

    rng: dict[str, torch.Tensor]
    sharded: ShardedSave | None = None


def gather_parts(
    ranks: Ranks,
    rng: PrivateRandom,
    model: PreTrainedModel,
    optimizers: Optimizers,
    shards: ShardWriter | None,
    *,
    step: int,
    last: int,
    directory: Path,
) -> SaveParts:
    """Collectives: every rank calls this at the same step, before anything on rank 0 may
    stop it. Sharded, every rank starts writing its shards of `step` (and at the phase's
    `last` step, the model is gathered whole for rank 0's `model.safetensors`)."""
    sharded = None
    if shards is not None:
        sharded = shards.start(
            step,
            temporary=directory / temporary_name(step),
            model=model,
            optimizers=optimizers,
            whole=step == last,
        )
    return SaveParts(rng=ranks.gather_random(rng.state_dict()), sharded=sharded)
