"""Routes of jobs (service.workers.job): `POST /datasets/inspect`, `POST /datasets/prepare`,
`POST /evaluations`, their reads, and the worker's `/internal/jobs/{id}/start|result`."""

from __future__ import annotations

from fastapi import APIRouter, BackgroundTasks, Depends, Response, status
from pydantic import BaseModel
from sqlalchemy.orm import Session

from contracts.jobs import EvaluateRequest, InspectRequest, JobKind, JobOutcome, PrepareRequest
from contracts.jobs import Job as JobPublic
from service import access, audit
from service.api.deps import (
    ApiTokenDep,
    PumpDep,
    SessionDep,
    SettingsDep,
    WorkerDep,
    require_api,
    require_worker,
)
from service.workers.dispatch import OutboxPump
from service.workers.job import (
    PUBLIC,
    create_job,
    finish_job,
    job_for,
    job_public,
    resolve_dataset,
    resolve_evaluate,
    start_job,
)

# --- routes --------------------------------------------------------------------------------

public = APIRouter(tags=["jobs"], dependencies=[Depends(require_api)])
internal = APIRouter(
    prefix="/internal/jobs", tags=["internal"], dependencies=[Depends(require_worker)]
)


def _queue(
    session: Session,
    kind: JobKind,
    request: BaseModel,
    response: Response,
    background: BackgroundTasks,
    pump: OutboxPump,
) -> JobPublic:
    """Store the job with its audit event and outbox row, and answer it with its Location."""
    audit.expect(session, "job.create", details={"kind": kind})
    job = create_job(session=session, kind=kind, request=request)
    response.headers["Location"] = f"{PUBLIC[job.kind][0]}/{job.id}"
    # After the response: a slow or dead broker never delays or fails the submission.
    background.add_task(pump.dispatch)
    return job_public(job)


@public.post("/datasets/inspect", status_code=status.HTTP_202_ACCEPTED)
def inspect_dataset(
    body: InspectRequest,
    session: SessionDep,
    settings: SettingsDep,
    pump: PumpDep,
    response: Response,
    background: BackgroundTasks,
    token: ApiTokenDep,
) -> JobPublic:
    """Token statistics of one data file with the exact tokenizer and encoder of training,
    computed on a worker: 202 with the queued job; poll its Location until it has finished.
    Relative paths resolve against the service's data root; a missing file is 422, and so is
    one outside TRAINCTL_DATA_ROOTS (`path_outside_data_roots`)."""
    request = resolve_dataset(
        body,
        data_root=settings.data_root,
        roots=settings.paths,
        route="POST /datasets/inspect",
        session=session,
        owner_id=access.owner_filter(token),
    )
    return _queue(session, "inspection", request, response, background, pump)


@public.get("/datasets/inspections/{job_id}")
def read_inspection(job_id: str, session: SessionDep, token: ApiTokenDep) -> JobPublic:
    return job_public(job_for(session, token, job_id, "inspection"))


@public.post("/datasets/prepare", status_code=status.HTTP_202_ACCEPTED)
def prepare_dataset(
    body: PrepareRequest,
    session: SessionDep,
    settings: SettingsDep,
    pump: PumpDep,
    response: Response,
    background: BackgroundTasks,
    token: ApiTokenDep,
) -> JobPublic:
    """Build one data file's token store on a worker ahead of time, the store a phase with the
    same tokenizer, objective and sequence_length would build before its first step: 202 with
    the queued job; its result is a contracts.jobs.PreparedStore. Paths as for inspect."""
    request = resolve_dataset(
        body,
        data_root=settings.data_root,
        roots=settings.paths,
        route="POST /datasets/prepare",
        session=session,
        owner_id=access.owner_filter(token),
    )
    return _queue(session, "preparation", request, response, background, pump)


@public.get("/datasets/preparations/{job_id}")
def read_preparation(job_id: str, session: SessionDep, token: ApiTokenDep) -> JobPublic:
    return job_public(job_for(session, token, job_id, "preparation"))


@public.post("/evaluations", status_code=status.HTTP_202_ACCEPTED)
def evaluate_checkpoint(
    body: EvaluateRequest,
    session: SessionDep,
    settings: SettingsDep,
    pump: PumpDep,
    response: Response,
    background: BackgroundTasks,
    token: ApiTokenDep,
) -> JobPublic:
    """Evaluate any `save_pretrained` directory on one task's data, outside any run, on a
    worker: 202 with the queued job; its result is a contracts.reports.EvalResult. A run's
    checkpoint (by its path in the artifact store) only of a run the token may see."""
    request = resolve_evaluate(
        body,
        data_root=settings.data_root,
        roots=settings.paths,
        session=session,
        owner_id=access.owner_filter(token),
    )
    return _queue(session, "evaluation", request, response, background, pump)


@public.get("/evaluations/{job_id}")
def read_evaluation(job_id: str, session: SessionDep, token: ApiTokenDep) -> JobPublic:
    return job_public(job_for(session, token, job_id, "evaluation"))


@internal.post("/{job_id}/start")
def start(job_id: str, session: SessionDep, token: WorkerDep) -> JobPublic:
    """Mark the job running; the answer carries its request. 409 `job_finished` once it has an
    outcome: drop the message."""
    return job_public(start_job(session=session, job_id=job_id, token_id=token.id))


@internal.post("/{job_id}/result")
def result(job_id: str, body: JobOutcome, session: SessionDep, token: WorkerDep) -> JobPublic:
    """The job's outcome, from the worker token that started it (else 403)."""
    return job_public(finish_job(session=session, job_id=job_id, outcome=body, token_id=token.id))


router = APIRouter()
router.include_router(public)
router.include_router(internal)
