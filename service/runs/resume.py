"""Resuming a run: what is given (or, when omitted, what was stored) must reproduce the stored
signature; then the run continues under its own id with a new numbered attempt, whose claim
starts from the run's latest registered checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from contracts.api import RunResume
from contracts.paths import DataRoots
from contracts.signature import Digests, FieldDiff, Signature, diff_components
from contracts.workflow import Workflow as WorkflowSpec
from contracts.workflow import devices_refusal
from service.db import database_now
from service.errors import ApiError, summarize_problems
from service.lifecycle import (
    AttemptStatus,
    RunStatus,
    add_attempt,
    lock_current_attempt,
    move_run,
    newest_attempt,
)
from service.models import Attempt, Run
from service.runs.digest import DigestJobs, resolve_digests
from service.runs.initial_checkpoint import InitialCheckpoint, recheck_initial_checkpoint, sign_run
from service.runs.run import get_run, parse_inputs
from service.runs.workflow import get_workflow
from service.workers.lease import digests_of, expire_attempt, is_active


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def signature_mismatch(*, run_id: str, differences: list[FieldDiff]) -> ApiError:
    """409 `signature_mismatch` naming every differing field with both values."""
    named = "; ".join(
        f"{d.field} stored {_show(d.stored)} given {_show(d.given)}" for d in differences
    )
    # No named difference: the stored components themselves no longer sign to the signature.
    return ApiError(
        409,
        "signature_mismatch",
        f"signature mismatch: {named or 'the stored signature components differ from it'}; "
        f"resume run {run_id} with the inputs it was started with (omit a field to use the "
        "stored one), or submit a new run with POST /runs",
        {"differences": [d.model_dump(mode="json") for d in differences]},
    )


def resume_inputs(
    *,
    session: Session,
    run: Run,
    request: RunResume,
    data_root: Path,
    roots: DataRoots | None = None,
    owner_id: str | None = None,
) -> tuple[WorkflowSpec, InitialCheckpoint | None]:
    """The workflow and initial checkpoint the request gives, or those stored where it gives
    nothing, their paths inside `roots` (default: data_root alone) and a given initial checkpoint
    checked for what it is (service.runs.initial_checkpoint.check_initial_checkpoint); another run's
    checkpoint only of a run `owner_id` (the caller's scope) may see. Reads the database; hashes
    nothing."""
    if request.workflow is not None:
        doc = request.workflow
    else:
        doc = get_workflow(session=session, workflow_id=run.workflow_id).spec
    spec, initial = parse_inputs(
        session=session,
        doc=doc,
        given=request.initial_checkpoint,
        data_root=data_root,
        roots=roots,
        owner_id=owner_id,
    )
    if request.initial_checkpoint is None:
        return spec, InitialCheckpoint.from_components(run.signature_components)
    return spec, initial


def resign(
    *,
    run: Run,
    request: RunResume,
    spec: WorkflowSpec,
    initial: InitialCheckpoint | None,
    session: Session | None = None,
    roots: DataRoots | None = None,
    digest_jobs: DigestJobs | None = None,
) -> Signature:
    """The run's signature over the resume's inputs (resume_inputs). Tokenizer and data files
    are hashed now (cached by path, size and mtime), so a changed file is a difference; an
    omitted initial checkpoint keeps its stored digest. Object store inputs are looked up, or
    hashed by workers, as service.runs.digest says (with `session`)."""

    def digests_with(checkpoint: str | None) -> Digests:
        return resolve_digests(
            spec, initial_checkpoint=checkpoint, session=session, roots=roots, jobs=digest_jobs
        )

    if request.initial_checkpoint is not None:
        assert initial is not None
        digests = digests_with(initial.path)
    else:
        digests = digests_with(None).model_copy(
            update={"initial_checkpoint": digests_of(run.signature_components).initial_checkpoint}
        )
    return sign_run(workflow=spec, digests=digests, initial=initial)


def check_devices(*, run: Run, spec: WorkflowSpec, devices: int | None) -> None:
    """422 `invalid_devices` when the run's current phase or a later one cannot run on
    `devices` ranks (its grad_accum is no multiple of it), naming each as
    `phases[i].grad_accum` with why (contracts.workflow.devices_refusal). Nothing when
    `devices` is None (the run keeps its count)."""
    if devices is None:
        return
    problems = [
        {
            "path": f"phases[{i}].grad_accum",
            "message": why,
            "grad_accum": phase.grad_accum,
            "devices": devices,
        }
        for i, phase in enumerate(spec.phases)
        if i >= run.phase_index and (why := devices_refusal(phase.grad_accum, devices))
    ]
    if not problems:
        return
    named = summarize_problems(problems)
    raise ApiError(
        422,
        "invalid_devices",
        f"devices: run {run.id} cannot go on on {devices} devices: {named}; resume it on a "
        "device count that divides the grad_accum of every phase still to run",
        problems,
    )


def _run_active(run: Run, attempt: Attempt) -> ApiError:
    if attempt.status == AttemptStatus.QUEUED:
        why = "is queued, waiting for a worker"
    else:
        why = (
            f"is running on {attempt.worker_hostname} (pid {attempt.worker_pid}) with a lease "
            f"until {attempt.lease_expires_at:%Y-%m-%d %H:%M:%S} UTC"
        )
    return ApiError(
        409,
        "run_active",
        f"run {run.id} is {run.status}: its attempt {attempt.number} {why}; wait for it to "
        "end (or for its lease to expire), then resume",
        {
            "run_id": run.id,
            "attempt_id": attempt.id,
            "attempt_number": attempt.number,
            "attempt_status": attempt.status,
        },
    )


def _roll_back_and_raise(session: Session, error: ApiError) -> NoReturn:
    """Roll back (releasing the locks) and raise `error`, built while its rows were loaded."""
    session.rollback()
    raise error


def resume_run(
    *,
    session: Session,
    run_id: str,
    request: RunResume,
    data_root: Path,
    judge_leases: bool = True,
    roots: DataRoots | None = None,
    owner_id: str | None = None,
    digest_jobs: DigestJobs | None = None,
) -> tuple[Run, Attempt | None]:
    """Check the signature, then: a succeeded run is a no-op (no attempt); an active one (a
    paused one whose worker is still writing its checkpoint, too) is 409 `run_active`;
    otherwise (failed, paused, cancelled, or lost) a running attempt whose lease expired is
    marked lost, and a new attempt continues the run's current phase. Commits. Returns (run,
    new attempt or None); the caller dispatches the new attempt's outbox row. Paths must
    resolve inside `roots` (default: data_root alone). `request.devices`, checked against
    the grad_accum of the phases still to run (422 `invalid_devices`), becomes the run's
    device count: the new attempt and every later one run on it. It is not signed, so a
    different count is never a signature mismatch. With `owner_id` (the caller's scope),
    another owner's run is never a source of weights (service.checkpoints.source.source_run).
    Object store inputs are hashed by workers, waited for as `digest_jobs` says."""
    run = get_run(session=session, run_id=run_id)
    spec, initial = resume_inputs(
        session=session,
        run=run,
        request=request,
        data_root=data_root,
        roots=roots,
        owner_id=owner_id,
    )
    if run.status != RunStatus.SUCCEEDED:
        # Before hashing, so that a refused count costs no reads; checked again under the
        # locks, where the phase the run is in cannot move any more.
        check_devices(run=run, spec=spec, devices=request.devices)
    # Hashing takes seconds per GiB: end the transaction the reads began first, so that no
    # connection waits idle in transaction (nor a row stays locked) meanwhile.
    session.commit()
    signature = resign(
        run=run,
        request=request,
        spec=spec,
        initial=initial,
        session=session,
        roots=roots,
        digest_jobs=digest_jobs,
    )
    if signature.sha256 != run.signature:
        differences = diff_components(run.signature_components, signature.components)
        _roll_back_and_raise(session, signature_mismatch(run_id=run.id, differences=differences))
    # What changed while hashing: a given initial checkpoint is looked up (and locked) again.
    recheck_initial_checkpoint(
        session=session, given=request.initial_checkpoint, hashed=initial, data_root=data_root
    )

    # Concurrent resumes (and finishes) of this run serialise on these locks; the loser sees
    # the winner's queued attempt and answers run_active.
    current = lock_current_attempt(session, run_id)
    locked = session.get(Run, run_id, with_for_update=True, populate_existing=True)
    assert locked is not None
    run = locked
    if run.status == RunStatus.SUCCEEDED:
        session.rollback()
        return run, None
    try:
        check_devices(run=run, spec=spec, devices=request.devices)
    except ApiError as err:
        _roll_back_and_raise(session, err)
    if current is not None:
        now = database_now(session)  # leases are judged by the database's clock
        # Read, not locked: with the run locked no attempt can be added, and locking it would
        # deadlock with a resume that locked it first and now waits for the run.
        newest = newest_attempt(session, run_id)
        if newest is not None and newest.id != current.id:
            # Another attempt was added while this request waited for the locks.
            _roll_back_and_raise(session, _run_active(run, newest))
        if is_active(current, now):
            _roll_back_and_raise(session, _run_active(run, current))
        if current.status == AttemptStatus.RUNNING and not judge_leases:
            # The service could not hear its workers lately: a lapsed lease proves nothing
            # until the reaper's grace has run (service.workers.reaper.Reaper.hearing).
            _roll_back_and_raise(session, _run_active(run, current))
        if current.status == AttemptStatus.RUNNING and not expire_attempt(
            session=session, attempt=current, now=now
        ):
            _roll_back_and_raise(session, _run_active(run, current))

    if request.devices is not None:
        run.devices = request.devices
    attempt = add_attempt(session=session, run=run, phase_index=run.phase_index)
    move_run(run, RunStatus.RECOVERING, message=None)
    run.pause_requested_at = None
    if initial is not None:
        # The same content may now lie elsewhere: workers read it where it is now.
        run.initial_checkpoint = initial.path
    run.signature_components = signature.components
    try:
        session.commit()
    except IntegrityError:
        # Two resumes raced past the checks (SQLite has no row locks): the other one added
        # this attempt number first and owns the run now.
        session.rollback()
        newest = lock_current_attempt(session, run.id)
        assert newest is not None  # the one that won
        raise _run_active(get_run(session=session, run_id=run.id), newest) from None
    return run, attempt
