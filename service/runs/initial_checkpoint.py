"""A run's initial checkpoint: a local path or another run's checkpoint, resolved and checked
before the run is created or resumed, and looked up again in the transaction that names it;
and the signature over a run's inputs, which keeps the run and step it came from beside its
content digest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from contracts.api import CheckpointOf, InitialCheckpointIn
from contracts.paths import DataRoots
from contracts.signature import Digests, Signature, compute_signature
from contracts.workflow import Workflow as WorkflowSpec
from runtime.path import resolve_path
from service.access import outside_roots
from service.checkpoints.source import refusal, source_checkpoint, stored_checkpoint
from service.checkpoints.weights import checkpoint_problem
from service.errors import ApiError


@dataclass(frozen=True)
class InitialCheckpoint:
    """Where a run's initial weights lie, and the run and step they came from, if another
    run's checkpoint. Only their content (sha256) is part of the signature."""

    path: str
    run: str | None = None
    step: int | None = None
    # Named as `{"run", "best": SET}`: the eval set whose best checkpoint `step` was.
    best: str | None = None

    @classmethod
    def from_components(cls, components: dict[str, Any]) -> InitialCheckpoint | None:
        stored = components.get("initial_checkpoint")
        if stored is None:
            return None
        return cls(
            path=stored["path"],
            run=stored.get("run"),
            step=stored.get("step"),
            best=stored.get("best"),
        )


def resolve_initial_checkpoint(
    *,
    session: Session,
    given: InitialCheckpointIn,
    data_root: Path,
    roots: DataRoots | None = None,
    spec: WorkflowSpec | None = None,
    owner_id: str | None = None,
) -> InitialCheckpoint:
    """A local path (relative to data_root), or another run's usable checkpoint at a step:
    `{"run", "step"}`, `{"run", "best": SET}` (its best checkpoint of that eval set, resolved
    to its step now and kept as that step, with the set beside it), or a path into that run's
    folder of the artifact store (`roots`), taken as that reference. Another run's is checked
    by service.checkpoints.source.source_checkpoint: 404 `run_not_found` when the run does not
    exist or, with `owner_id` (the caller's scope), is another owner's; 422
    `invalid_initial_checkpoint` naming the steps it has when it has none usable at that step,
    or the set and what it lacks for a best one. Its row stays locked until the caller
    commits: the run that names it is then a pin that a concurrent report of its deletion
    sees. With `spec`, the checkpoint is checked (check_initial_checkpoint) against `roots`
    (default: data_root alone) and the model."""
    field, code = "initial_checkpoint", "invalid_initial_checkpoint"
    if isinstance(given, str):
        # A path the OS cannot use is kept as given; reading it is refused as `missing_input`.
        path = resolve_path(given, data_root)
        confined = roots or DataRoots.of([data_root])
        chosen = stored_checkpoint(
            session=session, path=path, roots=confined, owner_id=owner_id, field=field, code=code
        )
        if chosen is None:
            local = InitialCheckpoint(path=path)
            if spec is not None:
                check_initial_checkpoint(local, spec, confined)
            return local
    else:
        chosen = source_checkpoint(
            session=session, given=given, owner_id=owner_id, field=field, code=code
        )
    best = None if isinstance(given, str) else given.best
    initial = InitialCheckpoint(path=chosen.path, run=chosen.run_id, step=chosen.step, best=best)
    if spec is not None:
        # A worker wrote it in the artifact store: confined when the roots name that store.
        check_initial_checkpoint(initial, spec, roots)
    return initial


def check_initial_checkpoint(
    initial: InitialCheckpoint, spec: WorkflowSpec, roots: DataRoots | None
) -> None:
    """422 `path_outside_data_roots` when the checkpoint resolves outside `roots` (a
    checkpoint may also lie in the artifact store's runs/); 422 `invalid_initial_checkpoint`
    when it is no safetensors file or save_pretrained directory whose tensors fit `spec`'s
    model, naming the file and what is wrong (service.checkpoints.weights.checkpoint_problem)."""
    if roots is not None and (
        refused := outside_roots(
            [("initial_checkpoint", initial.path, "checkpoint")], roots, where="initial_checkpoint"
        )
    ):
        raise refused
    if why := checkpoint_problem(initial.path, spec):
        details: dict[str, Any] = {"path": initial.path, "problem": why}
        if initial.run is not None:
            details.update(run=initial.run, step=initial.step)
        raise refusal(
            "invalid_initial_checkpoint",
            "initial_checkpoint",
            f"{why}; give a safetensors file or a save_pretrained directory (config.json and "
            "model.safetensors) of the workflow's model",
            details,
        )


def recheck_initial_checkpoint(
    *,
    session: Session,
    given: InitialCheckpointIn | None,
    hashed: InitialCheckpoint | None,
    data_root: Path,
) -> None:
    """Look another run's checkpoint up again (locking its row) in the transaction that will
    name it, after it was hashed outside any: 422 as resolve_initial_checkpoint when it was
    deleted or quarantined meanwhile, 409 `initial_checkpoint_changed` when its step now
    points at other files than those hashed. A local path needs nothing: its bytes are what
    was hashed."""
    if given is None or hashed is None or hashed.run is None or hashed.step is None:
        return
    source = CheckpointOf(run=hashed.run, step=hashed.step)
    now = resolve_initial_checkpoint(session=session, given=source, data_root=data_root)
    if now.path != hashed.path:
        raise ApiError(
            409,
            "initial_checkpoint_changed",
            f"initial_checkpoint: run {source.run!r}'s checkpoint at step {source.step} "
            f"changed while it was hashed (it was {hashed.path}, now {now.path}); send the "
            "request again",
            {"run": source.run, "step": source.step},
        )


def sign_run(
    *, workflow: WorkflowSpec, digests: Digests, initial: InitialCheckpoint | None
) -> Signature:
    """compute_signature, with the source run and step of an initial checkpoint taken from
    another run kept in the components for people (compute_signature hashes only its sha256)."""
    signature = compute_signature(
        workflow=workflow,
        digests=digests,
        initial_checkpoint=None if initial is None else initial.path,
    )
    stored = signature.components["initial_checkpoint"]
    if stored is not None and initial is not None and initial.run is not None:
        stored.update(run=initial.run, step=initial.step)
        if initial.best is not None:
            stored["best"] = initial.best
    return signature
