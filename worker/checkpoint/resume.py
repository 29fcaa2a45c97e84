"""Loading a checkpoint, and which one an attempt starts from (`select_resume_checkpoint`:
the claim's, or an older one when it fails verification and is quarantined). Loading verifies
the manifest first; nothing is unpickled beyond plain tensors and values (`weights_only=True`,
safetensors).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contracts.reports import Claim
from worker.checkpoint.layout import (
    MODEL_WEIGHTS,
    OPTIMIZER,
    RNG,
    CheckpointState,
    list_checkpoints,
    local_path,
    quarantine_checkpoint,
    read_state,
    verify_checkpoint,
)
from worker.checkpoint.shards import has_shards
from worker.error import CheckpointError, SignatureMismatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint's small parts; the weights are loaded into a live model with
    `worker.model.model.load_weights(model, path)`, or from its shards
    (worker.checkpoint.shards)."""

    path: Path
    state: CheckpointState
    # `Optimizers.state_dict()`; of a sharded checkpoint, without the tensors in its shards.
    optimizer: dict[str, Any]
    rng: dict[str, torch.Tensor]  # `PrivateRandom.state_dict()`

    @property
    def sharded(self) -> bool:
        """Written by a sharded phase: model and optimizer tensors in `shards/`."""
        return has_shards(self.path)

    @property
    def whole_weights(self) -> bool:
        """The model is in `model.safetensors` (always, but in a sharded phase's checkpoints
        before its last step)."""
        return (self.path / MODEL_WEIGHTS).is_file()


def find_latest_complete(directory: Path) -> Path | None:
    """The newest checkpoint whose manifest verifies; a corrupt newer one is skipped."""
    for _, path in list_checkpoints(directory):
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            log.warning("skipping checkpoint: %s", err)
            continue
        return path
    return None


def load_checkpoint(
    path: str | Path, progress: Callable[[], None] | None = None, *, verify: bool = True
) -> LoadedCheckpoint:
    """Verify (`progress`: as verify_checkpoint), then read the state, optimizer and RNG parts
    of the checkpoint at `path`. `verify=False`: another process (rank 0) verified it."""
    path = Path(path)
    if verify:
        verify_checkpoint(path, progress)
    return LoadedCheckpoint(
        path=path,
        state=read_state(path),
        optimizer=torch.load(path / OPTIMIZER, weights_only=True, map_location="cpu"),
        rng=torch.load(path / RNG, weights_only=True, map_location="cpu"),
    )


@dataclass(frozen=True)
class Quarantined:
    """A checkpoint that failed verification and was renamed aside (`quarantine_checkpoint`),
    for the service to hear of: it must never be handed out as `resume_from` again."""

    step: int
    path: Path  # where it was
    reason: str


def select_resume_checkpoint(
    claim: Claim,
    offsets: list[int],
    *,
    on_quarantine: Callable[[Quarantined], object],
    verify: Callable[[Path], None] = verify_checkpoint,
) -> LoadedCheckpoint | None:
    """The claim's `resume_from`, verified (None: the phase's first step, from the initial
    weights): this run's, and either inside this phase or the previous phase's final checkpoint
    (`offsets`: each phase's first step - 1). One that fails verification (corrupt, truncated,
    no manifest) is quarantined and the newest older usable checkpoint of the same directory is
    used instead. A later phase without one cannot start. `on_quarantine` hears of each
    checkpoint renamed aside as soon as it is, so that the service learns of it even when no
    older one can stand in and this raises. `verify` raises CheckpointError for a checkpoint
    that fails verification: here every file hashed by this process (`verify_checkpoint`), on
    many ranks each rank's share by that rank."""
    phase_index = claim.phase_index
    if claim.resume_from is None:
        if phase_index > 0:
            raise CheckpointError(
                f"phase {phase_index} starts from the final checkpoint of phase "
                f"{phase_index - 1}, but the claim of attempt {claim.attempt_id} names none"
            )
        return None
    path = local_path(claim.resume_from.path)  # on an object store: fetched before (runner)
    try:
        loaded = _verified(path, verify)
    except CheckpointError as err:
        return _fall_back(path, claim.resume_from.step, err, claim, offsets, on_quarantine, verify)
    state = loaded.state
    if state.signature != claim.signature:
        raise SignatureMismatch(
            f"checkpoint {loaded.path} was written by a run with signature {state.signature}, "
            f"this run's signature is {claim.signature}"
        )
    if not starts_phase(state, phase_index, offsets):
        offset = offsets[phase_index]
        raise CheckpointError(
            f"checkpoint {loaded.path} (phase {state.phase_index}, step {state.step}) cannot "
            f"start phase {phase_index}, which covers steps {offset + 1}..; expected a "
            f"checkpoint of this phase or the final one of phase {phase_index - 1} "
            f"(step {offset})"
        )
    return loaded


def _verified(path: Path, verify: Callable[[Path], None]) -> LoadedCheckpoint:
    verify(path)
    return load_checkpoint(path, verify=False)


def starts_phase(state: CheckpointState, phase_index: int, offsets: list[int]) -> bool:
    """A checkpoint inside phase `phase_index`, or the previous phase's final one."""
    offset = offsets[phase_index]
    inside = state.phase_index == phase_index and state.step > offset
    previous_final = state.phase_index == phase_index - 1 and state.step == offset
    return inside or previous_final


def _set_aside(path: Path, step: int, err: CheckpointError) -> Quarantined:
    moved = quarantine_checkpoint(path)
    log.warning("checkpoint %s failed verification, quarantined as %s: %s", path, moved, err)
    where = f"; kept as {moved.name} for inspection" if moved is not None else ""
    return Quarantined(step=step, path=path, reason=f"failed verification: {err}{where}")


def _fall_back(
    path: Path,
    step: int,
    err: CheckpointError,
    claim: Claim,
    offsets: list[int],
    on_quarantine: Callable[[Quarantined], object],
    verify: Callable[[Path], None],
) -> LoadedCheckpoint:
    """Quarantine the failed checkpoint `path` (of `step`) and load the newest older one in
    its directory that verifies, is this run's and can start this phase."""
    on_quarantine(_set_aside(path, step, err))
    for older_step, candidate in list_checkpoints(path.parent):
        if older_step >= step:
            continue
        try:
            loaded = _verified(candidate, verify)
        except CheckpointError as older_err:
            on_quarantine(_set_aside(candidate, older_step, older_err))
            continue
        state = loaded.state
        if state.signature == claim.signature and starts_phase(state, claim.phase_index, offsets):
            log.warning(
                "resuming from the older checkpoint %s (step %d) instead of %s (step %d), "
                "which failed verification",
                candidate,
                older_step,
                path,
                step,
            )
            return loaded
    usable = "one inside it" + (
        f", or the final one of phase {claim.phase_index - 1}" if claim.phase_index else ""
    )
    raise CheckpointError(
        f"checkpoint {path} (step {step}) failed verification ({err}) and was quarantined; "
        f"no older complete checkpoint of this run in {path.parent} can start phase "
        f"{claim.phase_index} ({usable}); resume the run from an earlier phase or start a new run"
    )
