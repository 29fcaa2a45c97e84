"""Runs: submission (validate, hash, sign, plan, insert run + first attempt + outbox in one
transaction) and the public views of a run."""

from __future__ import annotations

import base64
import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import and_, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from contracts.paths import DataRoots
from contracts.reports import Preparing
from contracts.signature import Digests, Signature, canonical_json, compute_signature
from contracts.workflow import Plan, plan
from contracts.workflow import Workflow as WorkflowSpec
from runtime.path import resolve_path
from service.access import can_see, outside_roots
from service.checkpoints.registry import USABLE
from service.checkpoints.source import refusal, source_checkpoint, stored_checkpoint
from service.checkpoints.weights import checkpoint_problem
from service.errors import ApiError, not_found
from service.lifecycle import AttemptStatus, RunStatus, add_attempt, budget_use, recovery_seconds
from service.models import ApiToken, Attempt, Checkpoint, Run, RunTag, new_run_id, utcnow
from service.runs.digest import resolve_digests
from service.runs.workflow import (
    add_workflow_owner,
    get_workflow,
    parse_workflow,
    save_workflow,
    stored_pretrained,
)
from service.schemas import (
    AttemptPublic,
    CheckpointOf,
    CheckpointSummary,
    InitialCheckpointIn,
    RunCreate,
    RunPublic,
    RunUpdate,
)
from service.workers.fleet import LiveCapacity, largest_live_worker


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


@dataclass(frozen=True)
class InitialCheckpoint:
    """Where a run's initial weights lie, and the run and step they came from, if another
    run's checkpoint. Only their content (sha256) is part of the signature."""

    path: str
    run: str | None = None
    step: int | None = None

    @classmethod
    def from_components(cls, components: dict[str, Any]) -> InitialCheckpoint | None:
        stored = components.get("initial_checkpoint")
        if stored is None:
            return None
        return cls(path=stored["path"], run=stored.get("run"), step=stored.get("step"))


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
    `{"run", "step"}`, or a path into that run's folder of the artifact store (`roots`), taken
    as that reference. Another run's is checked by service.checkpoints.source.source_checkpoint: 404
    `run_not_found` when the run does not exist or, with `owner_id` (the caller's scope), is
    another owner's; 422 `invalid_initial_checkpoint` naming the steps it has when it has none
    usable at that step. Its row stays locked until the caller commits: the run that names it
    is then a pin that a concurrent report of its deletion sees. With `spec`, the checkpoint is
    checked (check_initial_checkpoint) against `roots` (default: data_root alone) and the
    model."""
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
    initial = InitialCheckpoint(path=chosen.path, run=chosen.run_id, step=chosen.step)
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
    if now != hashed:
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
    return signature


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
    spec = parse_workflow(doc, data_root=data_root, roots=roots, session=session, owner_id=owner_id)
    if request.initial_checkpoint is None:
        return spec, None
    initial = resolve_initial_checkpoint(
        session=session,
        given=request.initial_checkpoint,
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
) -> tuple[Run, bool]:
    """Create a run (or return the one this Idempotency-Key already created) and commit.
    Returns (run, created). The first attempt's outbox row is left for the dispatcher. Every
    path must resolve inside `roots` (default: data_root alone). With `owner_id` (the caller's
    scope, service.access.owner_filter), another owner's runs are as if they did not exist."""
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
    digests = resolve_digests(spec, initial_checkpoint=None if initial is None else initial.path)
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


class RunsCursor(NamedTuple):
    """Where a page of `GET /runs` ended: its last run's (created_at, id)."""

    created_at: datetime
    id: str

    def encode(self) -> str:
        """Opaque to clients: base64url of `[created_at, id]`."""
        text = json.dumps([self.created_at.isoformat(), self.id], separators=(",", ":"))
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    @classmethod
    def parse(cls, cursor: str) -> RunsCursor:
        """The cursor `encode` gave out, or ValueError saying what to do instead."""
        try:
            created_at, run_id = json.loads(
                base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
            )
            parsed = cls(datetime.fromisoformat(created_at), run_id)
            if parsed.created_at.tzinfo is None or not isinstance(run_id, str):
                raise ValueError(cursor)
        except (ValueError, TypeError) as err:
            raise ValueError(
                "is not a cursor this API gave out; pass the `next_cursor` of the previous "
                "page as it came, or leave it out to start from the newest run"
            ) from err
        return parsed


def _like_pattern(text: str) -> str:
    """`text` as a LIKE pattern matching it anywhere, its own % and _ taken literally."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def list_runs(
    *,
    session: Session,
    limit: int,
    status: RunStatus | None,
    after: RunsCursor | None = None,
    owner_id: str | None = None,
    tags: list[str] | None = None,
    name: str | None = None,
) -> tuple[list[Run], int, RunsCursor | None]:
    """A page of runs, newest first (created_at descending, then id), starting after `after`;
    the number of runs matching the filters (all pages); and the cursor of the next page, None
    after the last. Paging is by key, so runs created meanwhile (newer than any page read)
    neither repeat nor shift a run into the next page. With `owner_id`, only that owner's runs
    (pages and count); with `status`, runs in it; with `tags`, runs carrying every one of
    them; with `name`, runs whose name holds it, whatever the case."""
    query = select(Run)
    count = select(func.count()).select_from(Run)
    conditions: list[Any] = []
    if owner_id is not None:
        conditions.append(Run.owner_id == owner_id)
    if status is not None:
        conditions.append(Run.status == status)
    for tag in sorted(set(tags or [])):
        conditions.append(Run.id.in_(select(RunTag.run_id).where(RunTag.tag == tag)))
    if name:
        conditions.append(Run.name.ilike(_like_pattern(name), escape="\\"))
    if conditions:
        query = query.where(*conditions)
        count = count.where(*conditions)
    if after is not None:
        # The first condition alone is what an index range on created_at can start from.
        query = query.where(
            Run.created_at <= after.created_at,
            or_(
                Run.created_at < after.created_at,
                and_(Run.created_at == after.created_at, Run.id > after.id),
            ),
        )
    runs = list(session.scalars(query.order_by(Run.created_at.desc(), Run.id).limit(limit + 1)))
    following = None
    if len(runs) > limit:
        runs = runs[:limit]
        following = RunsCursor(runs[-1].created_at, runs[-1].id)
    return runs, session.scalar(count) or 0, following


def runs_public(
    *, session: Session, runs: list[Run], lease_seconds: float, queue: str
) -> list[RunPublic]:
    """Public views of runs, with attempts and latest checkpoints loaded in two queries (and
    a third, when one waits in the queue, for the largest worker of `queue` heard from within
    `lease_seconds`: a queued attempt waits for a worker while none is live or none owns the
    devices it needs)."""
    ids = [run.id for run in runs]
    attempts: dict[str, list[Attempt]] = defaultdict(list)
    latest: dict[str, Checkpoint] = {}
    tags = run_tags(session=session, run_ids=ids)
    if ids:
        for attempt in session.scalars(
            select(Attempt).where(Attempt.run_id.in_(ids)).order_by(Attempt.number)
        ):
            attempts[attempt.run_id].append(attempt)
        newest = (
            select(Checkpoint.run_id, func.max(Checkpoint.step).label("step"))
            .where(Checkpoint.run_id.in_(ids), Checkpoint.status == USABLE)
            .group_by(Checkpoint.run_id)
            .subquery()
        )
        for checkpoint in session.scalars(
            select(Checkpoint).join(
                newest,
                (Checkpoint.run_id == newest.c.run_id) & (Checkpoint.step == newest.c.step),
            )
        ):
            latest[checkpoint.run_id] = checkpoint
    now = utcnow()
    queued = {
        run.id: attempts[run.id][-1]
        for run in runs
        if attempts[run.id] and attempts[run.id][-1].status == AttemptStatus.QUEUED
    }
    capacity = (
        largest_live_worker(session=session, now=now, lease_seconds=lease_seconds, queue=queue)
        if queued
        else None
    )
    waiting = {
        run_id: reason
        for run_id, attempt in queued.items()
        if (reason := waiting_reason(attempt, capacity, queue=queue)) is not None
    }
    return [
        _run_public(
            run, attempts[run.id], latest.get(run.id), now, waiting.get(run.id), tags[run.id]
        )
        for run in runs
    ]


def run_tags(*, session: Session, run_ids: list[str]) -> dict[str, list[str]]:
    """Each run's tags, sorted, in one query (an empty list for a run without any)."""
    found: dict[str, list[str]] = {run_id: [] for run_id in run_ids}
    if run_ids:
        rows = session.execute(
            select(RunTag.run_id, RunTag.tag)
            .where(RunTag.run_id.in_(run_ids))
            .order_by(RunTag.run_id, RunTag.tag)
        )
        for run_id, tag in rows:
            found[run_id].append(tag)
    return found


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


def _devices(count: int) -> str:
    return f"{count} device{'s' if count != 1 else ''}"


def waiting_reason(attempt: Attempt, capacity: LiveCapacity | None, *, queue: str) -> str | None:
    """Why no live worker can take a queued attempt, in a sentence; None when one can.
    `capacity`: the largest live worker of `queue` (service.workers.fleet.largest_live_worker)."""
    if capacity is None:
        return (
            f"no live worker has been seen: none of queue {queue!r} was heard from within the "
            "lease period"
        )
    if capacity.devices >= attempt.devices:
        return None
    kind = f" ({capacity.device_kind})" if capacity.device_kind else ""
    return (
        f"attempt {attempt.number} needs {_devices(attempt.devices)}; the most a live worker "
        f"has is {capacity.devices}{kind}"
    )


def run_public(*, session: Session, run: Run, lease_seconds: float, queue: str) -> RunPublic:
    return runs_public(session=session, runs=[run], lease_seconds=lease_seconds, queue=queue)[0]


def _preparing(attempts: list[Attempt]) -> Preparing | None:
    newest = attempts[-1] if attempts else None
    if newest is None or newest.status != AttemptStatus.RUNNING or newest.preparing_file is None:
        return None
    return Preparing(file=newest.preparing_file, fraction=newest.preparing_fraction or 0.0)


def _run_public(
    run: Run,
    attempts: list[Attempt],
    latest: Checkpoint | None,
    now: datetime,
    waiting: str | None,
    tags: list[str],
) -> RunPublic:
    run_plan = Plan.model_validate(run.plan)
    phase = (
        run_plan.phases[run.phase_index].name
        if 0 <= run.phase_index < len(run_plan.phases)
        else None
    )
    use = budget_use(attempts)
    return RunPublic(
        id=run.id,
        name=run.name,
        tags=tags,
        note=run.note,
        workflow_id=run.workflow_id,
        status=RunStatus(run.status),
        cause=run.cause,
        message=run.message,
        phase=phase,
        phase_index=run.phase_index,
        step=run.step,
        total_steps=run.total_steps,
        signature=run.signature,
        plan=run_plan,
        initial_checkpoint=run.initial_checkpoint,
        latest_checkpoint=None if latest is None else CheckpointSummary.model_validate(latest),
        attempts=[AttemptPublic.model_validate(a) for a in attempts],
        restarts=use.restarts,
        max_restarts=run.max_restarts,
        preemptions=use.preemptions,
        max_preemptions=run.max_preemptions,
        recovery_seconds=recovery_seconds(attempts, now),
        pause_requested_at=run.pause_requested_at,
        devices=run.devices,
        waiting_for_worker=waiting is not None,
        waiting_reason=waiting,
        preparing=_preparing(attempts),
        created_at=run.created_at,
        updated_at=run.updated_at,
        finished_at=run.finished_at,
    )
