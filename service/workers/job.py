"""Jobs (contracts.jobs): dataset inspections, token store preparations and standalone
evaluations, run on workers.

A job is stored with its outbox row in one transaction, so a broker outage delays a job and
never fails the request; the message goes out after the commit (service.workers.dispatch). A worker
starts the job and posts its outcome; the first outcome is kept, a repeat of it is answered as
before, and a different one is 409. Functions take a session and plain values.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from contracts.jobs import (
    DigestResult,
    EvaluateRequest,
    InspectionReport,
    InspectRequest,
    JobKind,
    JobOutcome,
    PreparedStore,
    PrepareRequest,
)
from contracts.jobs import Job as JobPublic
from contracts.paths import DataRoots, PathUse, is_uri
from contracts.reports import EvalResult
from contracts.workflow import PathKind
from runtime.path import path_problem, resolve_path
from runtime.store import StoreError
from service.access import can_see, outside_roots
from service.checkpoints.source import check_run_folders, stored_checkpoint
from service.checkpoints.weights import checkpoint_files
from service.db import database_now, insert_for, rowcount
from service.errors import ApiError, not_found, summarize_problems, validation_details
from service.models import ApiToken, InputDigest, Job, OutboxMessage, new_job_id, utcnow

log = logging.getLogger(__name__)

_BATCH = 100

# What a succeeded job's result must parse as.
RESULT_MODELS: dict[str, type[BaseModel]] = {
    "inspection": InspectionReport,
    "evaluation": EvalResult,
    "preparation": PreparedStore,
    "digest": DigestResult,
}
# Where each kind is read back, and how a client makes one.
PUBLIC = {
    "inspection": ("/datasets/inspections", "POST /datasets/inspect starts an inspection"),
    "evaluation": ("/evaluations", "POST /evaluations starts an evaluation"),
    "preparation": ("/datasets/preparations", "POST /datasets/prepare starts a preparation"),
    # Started by POST /runs and resume for an object store input (service.runs.digest).
    "digest": ("/jobs", "POST /runs starts one for each object store input it must hash"),
}
# The file of a tokenizer saved in a checkpoint directory (worker.data.tokenizer.load_tokenizer).
TOKENIZER_FILE = "tokenizer.json"


# --- paths ---------------------------------------------------------------------------------


def _invalid_request(where: str, problems: list[dict[str, str]]) -> ApiError:
    """422 `invalid_request` from `where`, naming each problem with its JSON path."""
    return ApiError(422, "invalid_request", f"{where}: {summarize_problems(problems)}", problems)


DataRequest = TypeVar("DataRequest", InspectRequest, PrepareRequest)


def _confine(
    where: str,
    fields: list[tuple[str, str | None, PathUse]],
    roots: DataRoots,
    *,
    session: Session | None,
    owner_id: str | None,
) -> None:
    """422 `path_outside_data_roots` for a path outside `roots`; then, with `session`, 404
    `run_not_found` for one in the folder of a run `owner_id` may not see."""
    given = [(field, path, use) for field, path, use in fields if path is not None]
    if (refused := outside_roots(given, roots, where=where)) is not None:
        raise refused
    if session is not None:
        check_run_folders(session=session, fields=given, roots=roots, owner_id=owner_id)


def resolve_dataset(
    request: DataRequest,
    *,
    data_root: Path,
    route: str,
    roots: DataRoots | None = None,
    session: Session | None = None,
    owner_id: str | None = None,
) -> DataRequest:
    """An inspection's or a preparation's request with its paths resolved against
    `data_root`; 422 `path_outside_data_roots` when one resolves outside `roots` (default:
    data_root alone); with `session`, 404 `run_not_found` for a file in the folder of a run
    `owner_id` (the caller's scope) may not see; and then 422 `invalid_request` from `route`
    naming each field whose file does not exist."""
    resolved = request.model_copy(
        update={
            "path": resolve_path(request.path, data_root),
            "tokenizer": resolve_path(request.tokenizer, data_root),
        }
    )
    fields: list[tuple[str, str | None, PathUse]] = [
        ("path", resolved.path, "data"),
        ("tokenizer", resolved.tokenizer, "data"),
    ]
    confined = roots or DataRoots.of([data_root])
    _confine(route, fields, confined, session=session, owner_id=owner_id)
    checks: list[tuple[str, str, PathKind]] = [
        ("path", resolved.path, "file"),
        ("tokenizer", resolved.tokenizer, "path"),
    ]
    problems = [
        {"path": field, "message": why}
        for field, path, kind in checks
        if (why := path_problem(path, kind))
    ]
    if problems:
        raise _invalid_request(route, problems)
    return resolved


def resolve_evaluate(
    request: EvaluateRequest,
    *,
    data_root: Path,
    roots: DataRoots | None = None,
    session: Session | None = None,
    owner_id: str | None = None,
) -> EvaluateRequest:
    """The request with its paths resolved against `data_root`; 422 `path_outside_data_roots`
    when one resolves outside `roots` (default: data_root alone; a checkpoint may also lie in
    the artifact store's runs/), then 422 `invalid_request` naming each field whose file does
    not exist, and `tokenizer` when it is omitted and the checkpoint directory holds none.
    With `session`, every file in a run's folder of the artifact store must be of a run
    `owner_id` (the caller's scope) may see (404 `run_not_found` otherwise), and a checkpoint
    there that run's registered checkpoint directory
    (service.checkpoints.source.stored_checkpoint)."""
    tokenizer = request.tokenizer
    resolved = request.model_copy(
        update={
            "checkpoint": resolve_path(request.checkpoint, data_root),
            "data": resolve_path(request.data, data_root),
            "tokenizer": None if tokenizer is None else resolve_path(tokenizer, data_root),
        }
    )
    fields: list[tuple[str, str | None, PathUse]] = [
        ("checkpoint", resolved.checkpoint, "checkpoint"),
        ("data", resolved.data, "data"),
        ("tokenizer", resolved.tokenizer, "data"),
    ]
    roots = roots or DataRoots.of([data_root])
    _confine("POST /evaluations", fields, roots, session=session, owner_id=owner_id)
    if session is not None and (
        stored := stored_checkpoint(
            session=session,
            path=resolved.checkpoint,
            roots=roots,
            owner_id=owner_id,
            field="checkpoint",
            code="invalid_request",
        )
    ):
        resolved = resolved.model_copy(update={"checkpoint": stored.path})
    checks: list[tuple[str, str, PathKind]] = [
        ("checkpoint", resolved.checkpoint, "directory"),
        ("data", resolved.data, "file"),
    ]
    if resolved.tokenizer is not None:
        checks.append(("tokenizer", resolved.tokenizer, "path"))
    problems = [
        {"path": field, "message": why}
        for field, path, kind in checks
        if (why := path_problem(path, kind))
    ]
    if resolved.tokenizer is None and not problems and not _holds_tokenizer(resolved.checkpoint):
        problems.append(
            {
                "path": "tokenizer",
                "message": f"checkpoint {resolved.checkpoint} holds no {TOKENIZER_FILE}; give "
                "`tokenizer`",
            }
        )
    if problems:
        raise _invalid_request("POST /evaluations", problems)
    return resolved


def _holds_tokenizer(checkpoint: str) -> bool:
    """Whether the checkpoint directory (a path, or an `s3://` prefix or remote-layout
    checkpoint, listed or read from its manifest) holds a tokenizer."""
    if not is_uri(checkpoint):
        return (Path(checkpoint) / TOKENIZER_FILE).is_file()
    try:
        return checkpoint_files(checkpoint).size(TOKENIZER_FILE) is not None
    except (StoreError, ValueError, OSError):
        return False


# --- jobs ----------------------------------------------------------------------------------


def create_job(*, session: Session, kind: JobKind, request: BaseModel) -> Job:
    """Insert a queued job and its outbox row, and commit: the dispatcher sends it after."""
    job = Job(id=new_job_id(), kind=kind, status="queued", request=request.model_dump(mode="json"))
    session.add(job)
    session.flush()
    session.add(OutboxMessage(job_id=job.id))
    session.commit()
    return job


def get_job(*, session: Session, job_id: str, kind: JobKind | None = None) -> Job:
    """The job (of `kind`, when given); 404 `<kind>_not_found` otherwise."""
    job = session.get(Job, job_id, populate_existing=True)
    if kind is not None and (job is None or job.kind != kind):
        raise not_found(kind, job_id, PUBLIC[kind][1])
    if job is None:
        raise not_found("job", job_id, "drop this message: no such job exists")
    return job


def job_for(session: Session, token: ApiToken, job_id: str, kind: str) -> Job:
    """The job of `kind`, or its 404 when it does not exist or `token` may not see it."""
    job = get_job(session=session, job_id=job_id, kind=kind)  # type: ignore[arg-type]
    if not can_see(token, job.owner_id):
        raise not_found(kind, job_id, PUBLIC[kind][1])
    return job


def _finished(job: Job) -> ApiError:
    return ApiError(
        409,
        "job_finished",
        f"job {job.id} ({job.kind}) already {job.status} at {_iso(job.finished_at)}; drop this "
        "message: messages may be delivered twice, a job's first outcome is the one kept",
        {"job_id": job.id, "status": job.status},
    )


def _foreign_job(job: Job) -> ApiError:
    return ApiError(
        403,
        "forbidden",
        f"job {job.id} was started with another worker token; only its outcome is taken: "
        "drop this message",
        {"job_id": job.id},
    )


def start_job(*, session: Session, job_id: str, token_id: str | None = None) -> Job:
    """Mark the job running (again, when a message is delivered twice or a worker died on it),
    claimed by the worker token `token_id`: its outcome must come from that token;
    404 when unknown, 409 `job_finished` once it has an outcome."""
    claim = {} if token_id is None else {"claim_token_id": token_id}
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(("queued", "running")))
        .values(status="running", started_at=database_now(session), **claim)
        .execution_options(synchronize_session=False)
    )
    if rowcount(result) != 1:
        session.rollback()
        raise _finished(get_job(session=session, job_id=job_id))
    session.commit()
    return get_job(session=session, job_id=job_id)


def checked_outcome(kind: str, outcome: JobOutcome) -> tuple[dict[str, Any] | None, str | None]:
    """(result, error) to store: a succeeded job's result parsed as its kind's model
    (InspectionReport, contracts.reports.EvalResult), a failed job's message. 422 otherwise."""
    if outcome.status == "failed":
        if not (outcome.error or "").strip():
            raise _invalid_request(
                "a failed job's outcome", [{"path": "error", "message": "say why the job failed"}]
            )
        return None, outcome.error
    model = RESULT_MODELS[kind]
    if outcome.result is None:
        message = f"is required: a succeeded {kind} carries its {model.__name__}"
        raise _invalid_request(
            "a succeeded job's outcome", [{"path": "result", "message": message}]
        )
    try:
        result = model.model_validate(outcome.result).model_dump(mode="json")
    except ValidationError as err:
        errors = [{**e, "loc": ("body", "result", *e["loc"])} for e in err.errors()]
        where = f"a succeeded {kind}'s result is not an {model.__name__}"
        raise _invalid_request(where, validation_details(errors)) from None
    try:
        json.dumps(result, allow_nan=False)
    except ValueError:
        message = "holds a non-finite number (NaN or infinity), which JSON cannot carry"
        raise _invalid_request(
            "a succeeded job's outcome", [{"path": "result", "message": message}]
        ) from None
    return result, None


def finish_job(
    *, session: Session, job_id: str, outcome: JobOutcome, token_id: str | None = None
) -> Job:
    """Store a started job's outcome, once (a conditional UPDATE: the first outcome wins). A
    job queued again after its timeout still takes the outcome of the worker that was only
    slow. The same outcome again answers the job as stored; another one is 409
    `job_finished`, and an outcome for a job never started 409 `job_not_started`. With
    `token_id`, an outcome from another worker token than the one that last started the job
    is 403 `forbidden`."""
    job = get_job(session=session, job_id=job_id)
    if token_id is not None and job.claim_token_id not in (None, token_id):
        raise _foreign_job(job)
    result, error = checked_outcome(job.kind, outcome)
    values: dict[str, Any] = {"status": outcome.status, "error": error, "finished_at": utcnow()}
    if result is not None:
        values["result"] = result
    won = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.started_at.is_not(None),
            Job.status.in_(("queued", "running")),
            *([] if token_id is None else [Job.claim_token_id == token_id]),
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if rowcount(won) == 1:
        if job.kind == "digest" and result is not None:
            record_digest(session=session, job_id=job_id, result=DigestResult(**result))
        session.commit()
        return get_job(session=session, job_id=job_id)
    session.rollback()
    job = get_job(session=session, job_id=job_id)
    if (job.status, job.result, job.error) == (outcome.status, result, error):
        return job
    if token_id is not None and job.claim_token_id not in (None, token_id):
        raise _foreign_job(job)
    if job.status == "queued":
        raise ApiError(
            409,
            "job_not_started",
            f"job {job.id} is queued; POST /internal/jobs/{job.id}/start before its result",
            {"job_id": job.id, "status": job.status},
        )
    raise _finished(job)


def record_digest(*, session: Session, job_id: str, result: DigestResult) -> None:
    """Keep what a digest job hashed under the URI and fingerprint of the objects it read (in
    the transaction that stores its outcome). Those are the ones asked for unless the objects
    changed meanwhile; then the digest is kept for the new fingerprint, and the row that asked
    stays without one, which the next lookup takes as a reason to ask again. Does not commit."""
    session.execute(
        insert_for(session, InputDigest)
        .values(uri=result.uri, fingerprint=result.fingerprint, job_id=job_id, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["uri", "fingerprint"])
    )
    session.execute(
        update(InputDigest)
        .where(InputDigest.uri == result.uri, InputDigest.fingerprint == result.fingerprint)
        .values(sha256=result.sha256, size=result.size, hashed_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def _never_finished(job_id: str, kind: str, deliveries: int, budget: int, timeout: float) -> str:
    return (
        f"{kind} job {job_id} was delivered {deliveries} times (TRAINCTL_JOB_MAX_DELIVERIES="
        f"{budget}) and its worker never finished it: each time the worker went silent on it "
        f"for over {timeout:g} s (TRAINCTL_JOB_TIMEOUT_SECONDS), so it probably died on it (out "
        "of memory, SIGKILL); look for the kill in the workers' logs or the kernel's (dmesg) "
        "and submit the job again on a worker with more memory, or raise "
        "TRAINCTL_JOB_TIMEOUT_SECONDS if the job only takes longer"
    )


def fail_exhausted_jobs(
    *,
    session_factory: sessionmaker[Session],
    now: datetime,
    timeout: float,
    max_deliveries: int,
) -> list[str]:
    """Fail every job running since before `now - timeout` whose message went out
    `max_deliveries` times already: a job that kills its worker (an out-of-memory kill) would
    otherwise be sent again after every timeout, for ever (service.workers.reaper.requeue_stale_jobs
    sends the others again; this runs first). A conditional UPDATE per job: an outcome posted
    meanwhile wins. Returns the ids failed."""
    cutoff = now - timedelta(seconds=timeout)
    exhausted = (
        Job.status == "running",
        Job.started_at <= cutoff,
        Job.deliveries >= max_deliveries,
    )
    with session_factory() as session:
        found = session.execute(
            select(Job.id, Job.kind, Job.deliveries).where(*exhausted).limit(_BATCH)
        ).all()
    failed = []
    for job_id, kind, deliveries in found:
        error = _never_finished(job_id, kind, deliveries, max_deliveries, timeout)
        with session_factory() as session:
            won = session.execute(
                update(Job)
                .where(Job.id == job_id, *exhausted)
                .values(status="failed", error=error, finished_at=now)
                .execution_options(synchronize_session=False)
            )
            if rowcount(won) != 1:
                session.rollback()
                continue
            session.commit()
        log.error("%s", error)
        failed.append(job_id)
    return failed


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def job_public(job: Job) -> JobPublic:
    return JobPublic.model_validate(
        {
            "id": job.id,
            "kind": job.kind,
            "status": job.status,
            "request": job.request,
            "result": job.result,
            "error": job.error,
            "created_at": job.created_at,
            "finished_at": job.finished_at,
            "deliveries": job.deliveries,
        }
    )
