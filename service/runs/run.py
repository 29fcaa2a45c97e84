"""Runs: submission (validate, hash, sign, plan, insert run + first attempt + outbox in one
transaction), a run found by its id (for a caller that may see it), and the fields its users
set (name, tags, note)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from contracts.api import InitialCheckpointIn, RunCreate, RunUpdate
from contracts.paths import DataRoots
from contracts.signature import canonical_json
from contracts.workflow import Workflow as WorkflowSpec
from contracts.workflow import plan
from service.access import can_see
from service.errors import ApiError, not_found
from service.lifecycle import RunStatus, add_attempt
from service.models import ApiToken, Run, RunTag, new_run_id, utcnow
from service.runs.digest import DigestJobs, resolve_digests
from service.runs.initial_checkpoint import (
    InitialCheckpoint,
    recheck_initial_checkpoint,
    resolve_initial_checkpoint,
    sign_run,
)
from service.runs.workflow import (
    add_workflow_owner,
    get_workflow,
    parse_workflow,
    save_workflow,
    stored_pretrained,
)


def request_sha256(request: RunCreate) -> str:
    return hashlib.sha256(canonical_json(request.model_dump(mode="json")).encode()).hexdigest()


def _replay(*, session: Session, key: str, request_sha: str, owner_id: str | None) -> Run | None:
    """The run an earlier request with this Idempotency-Key created, if any. 409
    `idempotency_conflict` for another body, and (naming no run) for another owner's run when
    the caller is limited to `owner_id`: a key must not be a way to learn a run's id."""
    run = session.scalars(select(Run).where(Run.idempotency_key == key)).one_or_none()
    if run is not None and owner_id is not None and run.owner_id != owner_id:
        raise ApiError(
            409,
            "idempotency_conflict",
            f"Idempotency-Key {key!r} was already used by another token; use a new key",
            None,
        )
    if run is not None and run.request_sha256 != request_sha:
        raise ApiError(
            409,
            "idempotency_conflict",
            f"Idempotency-Key {key!r} was already used for run {run.id} with a different "
            "request body; send the same body to get that run, or use a new key",
            {"run_id": run.id},
        )
    return run


def _run_inputs(
    *,
    session: Session,
    request: RunCreate,
    data_root: Path,
    roots: DataRoots | None,
    owner_id: str | None,
) -> tuple[WorkflowSpec, InitialCheckpoint | None]:
    """The workflow (the document given, or the stored one its id names) and the initial
    checkpoint of a new run, checked as create_run says. Reads the database; hashes nothing."""
    if request.workflow is not None:
        doc = request.workflow
    else:
        assert request.workflow_id is not None
        doc = get_workflow(session=session, workflow_id=request.workflow_id, owner_id=owner_id).spec
    return parse_inputs(
        session=session,
        doc=doc,
        given=request.initial_checkpoint,
        data_root=data_root,
        roots=roots,
        owner_id=owner_id,
    )


def parse_inputs(
    *,
    session: Session,
    doc: Any,
    given: InitialCheckpointIn | None,
    data_root: Path,
    roots: DataRoots | None,
    owner_id: str | None,
) -> tuple[WorkflowSpec, InitialCheckpoint | None]:
    """The workflow document parsed (parse_workflow) and the initial checkpoint `given`
    resolved and checked against it (resolve_initial_checkpoint; None when none is given),
    their paths inside `roots` (default: data_root alone), another run's checkpoint only of a
    run `owner_id` (the caller's scope) may see. Reads the database; hashes nothing."""
    spec = parse_workflow(doc, data_root=data_root, roots=roots, session=session, owner_id=owner_id)
    if given is None:
        return spec, None
    initial = resolve_initial_checkpoint(
        session=session,
        given=given,
        data_root=data_root,
        roots=roots,
        spec=spec,
        owner_id=owner_id,
    )
    return spec, initial


def create_run(
    *,
    session: Session,
    request: RunCreate,
    idempotency_key: str | None,
    data_root: Path,
    default_max_restarts: int,
    default_max_preemptions: int,
    roots: DataRoots | None = None,
    owner_id: str | None = None,
    digest_jobs: DigestJobs | None = None,
) -> tuple[Run, bool]:
    """Create a run (or return the one this Idempotency-Key already created) and commit.
    Returns (run, created). The first attempt's outbox row is left for the dispatcher. Every
    path must resolve inside `roots` (default: data_root alone). With `owner_id` (the caller's
    scope, service.access.owner_filter), another owner's runs are as if they did not exist.
    Object store inputs of unknown digest are hashed by workers, waited for as `digest_jobs`
    says (service.runs.digest: 409 `inputs_being_hashed` past it)."""
    request_sha = request_sha256(request)
    if idempotency_key is not None:
        existing = _replay(
            session=session, key=idempotency_key, request_sha=request_sha, owner_id=owner_id
        )
        if existing is not None:
            return existing, False

    spec, initial = _run_inputs(
        session=session, request=request, data_root=data_root, roots=roots, owner_id=owner_id
    )
    # Hashing takes seconds per GiB: end the transaction the reads began first, so that no
    # connection waits idle in transaction (nor a checkpoint row stays locked) meanwhile.
    session.commit()
    digests = resolve_digests(
        spec,
        initial_checkpoint=None if initial is None else initial.path,
        session=session,
        roots=roots,
        jobs=digest_jobs,
    )
    signature = sign_run(workflow=spec, digests=digests, initial=initial)
    run_plan = plan(spec)

    # What changed while hashing: the initial checkpoint is looked up (and locked) again here;
    # a run created meanwhile with this Idempotency-Key is caught by its unique index below.
    recheck_initial_checkpoint(
        session=session, given=request.initial_checkpoint, hashed=initial, data_root=data_root
    )
    # The same for a pretrained model from another run: its row locked until the run pins it.
    stored_pretrained(
        spec.normalized(), session=session, roots=roots or DataRoots.of([data_root]), owner_id=None
    )
    workflow, _ = save_workflow(session=session, spec=spec)
    run = Run(
        id=new_run_id(),
        workflow_id=workflow.id,
        name=request.name or spec.name,
        status=RunStatus.QUEUED.value,
        signature=signature.sha256,
        signature_components=signature.components,
        plan=run_plan.model_dump(mode="json"),
        initial_checkpoint=None if initial is None else initial.path,
        phase_index=0,
        step=0,
        total_steps=run_plan.total_steps,
        idempotency_key=idempotency_key,
        request_sha256=request_sha if idempotency_key is not None else None,
        max_restarts=(
            default_max_restarts if request.max_restarts is None else request.max_restarts
        ),
        max_preemptions=(
            default_max_preemptions if request.max_preemptions is None else request.max_preemptions
        ),
        priority=request.priority,
    )
    session.add(run)
    try:
        session.flush()  # stamps the run's owner (service.access), who now owns the workflow
        if run.owner_id is not None:
            add_workflow_owner(session=session, workflow_id=workflow.id, owner_id=run.owner_id)
        add_attempt(session=session, run=run, phase_index=0)
        session.commit()
    except IntegrityError:
        # Two requests with one Idempotency-Key raced; the other one's run is the answer.
        session.rollback()
        if idempotency_key is not None:
            existing = _replay(
                session=session, key=idempotency_key, request_sha=request_sha, owner_id=owner_id
            )
            if existing is not None:
                return existing, False
        raise
    return run, True


def get_run(*, session: Session, run_id: str) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise not_found("run", run_id, "list runs with GET /runs")
    return run


def run_for(session: Session, token: ApiToken, run_id: str) -> Run:
    """The run, or 404 `run_not_found` when it does not exist or `token` may not see it (the
    same answer in both cases)."""
    run = session.get(Run, run_id)
    if run is None or not can_see(token, run.owner_id):
        raise not_found("run", run_id, "list runs with GET /runs")
    return get_run(session=session, run_id=run_id)


def update_run(*, session: Session, run_id: str, request: RunUpdate) -> Run:
    """Set what `request` gives of the run's name, tags (the whole set) and note, and commit.
    A field left out stays; a request that changes nothing writes nothing. Two updates that
    race to add one tag: the second one's insert conflicts, and it is applied once more over
    what the first one stored."""
    try:
        return _update_run(session=session, run_id=run_id, request=request)
    except IntegrityError:
        session.rollback()
        return _update_run(session=session, run_id=run_id, request=request)


def _update_run(*, session: Session, run_id: str, request: RunUpdate) -> Run:
    run = get_run(session=session, run_id=run_id)
    given = request.model_fields_set
    if "name" in given and request.name is not None and request.name != run.name:
        run.name = request.name
    if "priority" in given and request.priority is not None and request.priority != run.priority:
        # Its queued attempts are placed in the new order from the next placement pass.
        run.priority = request.priority
        run.updated_at = utcnow()
    if "note" in given:
        note = request.note or None
        if note != run.note:
            run.note = note
    if "tags" in given:
        wanted = set(request.tags or [])
        have = {
            row.tag: row for row in session.scalars(select(RunTag).where(RunTag.run_id == run.id))
        }
        for tag in sorted(set(have) - wanted):
            session.delete(have[tag])
        for tag in sorted(wanted - set(have)):
            session.add(RunTag(run_id=run.id, tag=tag))
        if set(have) != wanted:
            # The run's view changed: its updated_at moves, and an open event stream sends it.
            run.updated_at = utcnow()
    session.commit()
    return run
