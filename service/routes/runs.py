from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Body, Depends, Header, Query, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from contracts.bounds import MAX_COUNT
from service import access, audit
from service.checkpoint import CheckpointFilter, list_checkpoints
from service.control import cancel_run, pause_run
from service.deps import (
    ApiTokenDep,
    LeasesHeardDep,
    PumpDep,
    RunDep,
    SessionDep,
    SettingsDep,
    require_api,
)
from service.lifecycle import RunStatus
from service.models import Run
from service.resume import resume_run
from service.run import RunsCursor, create_run, list_runs, run_public, runs_public
from service.schemas import (
    MAX_RUNS_PAGE,
    CheckpointPublic,
    CheckpointsPublic,
    RunCreate,
    RunPublic,
    RunResume,
    RunsPublic,
)
from service.series import eval_summary, metric_series_json
from service.settings import ServiceSettings

router = APIRouter(prefix="/runs", tags=["runs"], dependencies=[Depends(require_api)])


def _public(session: Session, settings: ServiceSettings, run: Run) -> RunPublic:
    return run_public(
        session=session, run=run, lease_seconds=settings.lease_seconds, queue=settings.queue
    )


MaxPoints = Annotated[
    int | None,
    Query(ge=1, le=MAX_COUNT, description="keep at most this many points per series"),
]


@router.post("", status_code=status.HTTP_201_CREATED)
def submit_run(
    body: RunCreate,
    session: SessionDep,
    settings: SettingsDep,
    pump: PumpDep,
    response: Response,
    background: BackgroundTasks,
    token: ApiTokenDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> RunPublic:
    """Validate, sign and store a run with its first attempt; 201. The same Idempotency-Key
    and body again answer 200 with the same run; another body with that key, 409."""
    audit.expect(session, "run.create")  # the run is owned by `token` (service.access)
    access.check_checkpoint_source(session, token, body.initial_checkpoint)
    run, created = create_run(
        session=session,
        request=body,
        idempotency_key=idempotency_key,
        data_root=settings.data_root,
        roots=settings.paths,
        default_max_restarts=settings.max_restarts,
        default_max_preemptions=settings.max_preemptions,
    )
    if not created and idempotency_key is not None:
        access.check_replay(token, run, idempotency_key)
    if created:
        # After the response: a slow or dead broker never delays or fails the submission.
        background.add_task(pump.dispatch)
    else:
        response.status_code = status.HTTP_200_OK
    return _public(session, settings, run)


@router.get("")
def read_runs(
    session: SessionDep,
    settings: SettingsDep,
    token: ApiTokenDep,
    limit: Annotated[int, Query(ge=1, le=MAX_RUNS_PAGE)] = 50,
    status: RunStatus | None = None,
    cursor: Annotated[
        str | None,
        Query(max_length=200, description="the `next_cursor` of the previous page"),
    ] = None,
) -> RunsPublic:
    """Newest first, a page of `limit`; `next_cursor` asks for the next page (null on the
    last). `count` is the number of runs matching `status`, over all pages. A user token
    sees only its own runs (service.access)."""
    try:
        after = None if cursor is None else RunsCursor.parse(cursor)
    except ValueError as err:
        raise RequestValidationError(
            [{"loc": ("query", "cursor"), "msg": str(err), "type": "value_error"}]
        ) from err
    runs, count, following = list_runs(
        session=session,
        limit=limit,
        status=status,
        after=after,
        owner_id=access.owner_filter(token),
    )
    public = runs_public(
        session=session, runs=runs, lease_seconds=settings.lease_seconds, queue=settings.queue
    )
    return RunsPublic(
        runs=public, count=count, next_cursor=None if following is None else following.encode()
    )


@router.get("/{run_id}")
def read_run(run: RunDep, session: SessionDep, settings: SettingsDep) -> RunPublic:
    return _public(session, settings, run)


@router.post("/{run_id}/resume")
def resume(
    run: RunDep,
    token: ApiTokenDep,
    session: SessionDep,
    settings: SettingsDep,
    heard: LeasesHeardDep,
    pump: PumpDep,
    background: BackgroundTasks,
    body: Annotated[RunResume | None, Body()] = None,
) -> RunPublic:
    """Continue the run under its id with a new attempt, from its latest checkpoint. What the
    body gives (all optional: omitted means as stored) must reproduce the stored signature,
    else 409 `signature_mismatch` naming each differing field. A succeeded run answers as a
    no-op; an active one (queued, or running with a live lease), 409 `run_active`. `devices`
    (unsigned) sets the ranks the run goes on on, from this attempt on; 422 `invalid_devices`
    names each remaining phase whose grad_accum it does not divide (`phases[i].grad_accum`)."""
    devices = body.devices if body is not None else None
    audit.expect(session, "run.resume", run.id, None if devices is None else {"devices": devices})
    access.check_checkpoint_source(session, token, body and body.initial_checkpoint)
    resumed, attempt = resume_run(
        session=session,
        run_id=run.id,
        request=body or RunResume(),
        data_root=settings.data_root,
        roots=settings.paths,
        judge_leases=heard,
    )
    if attempt is not None:
        background.add_task(pump.dispatch)
    return _public(session, settings, resumed)


@router.post("/{run_id}/pause")
def pause(
    run: RunDep, session: SessionDep, settings: SettingsDep, heard: LeasesHeardDep
) -> RunPublic:
    """Pause the run. A queued attempt is superseded and the run is `paused` at once; a running
    worker is told by its next heartbeat (`pause`) to checkpoint and finish `paused`, and until
    then the run shows `pause_requested_at`. Resume continues it. Repeating is a no-op (200);
    a finished run is 409 `run_finished`."""
    audit.expect(session, "run.pause", run.id)
    return _public(session, settings, pause_run(session=session, run_id=run.id, judge_leases=heard))


@router.post("/{run_id}/cancel")
def cancel(run: RunDep, session: SessionDep, settings: SettingsDep) -> RunPublic:
    """Cancel the run at once, without a new checkpoint: its attempt is superseded, so its
    worker's next heartbeat answers `stop` and its reports are refused (409 `superseded`).
    Repeating is a no-op (200); a succeeded or failed run is 409 `run_finished`."""
    audit.expect(session, "run.cancel", run.id)
    return _public(session, settings, cancel_run(session=session, run_id=run.id))


@router.get("/{run_id}/metrics", response_class=JSONResponse)
def read_metrics(
    run: RunDep,
    session: SessionDep,
    names: Annotated[str | None, Query(description="comma-separated metric names")] = None,
    max_points: MaxPoints = None,
) -> Response:
    """`{name: {"steps": [...], "values": [...]}}`; non-finite values are null."""
    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else None
    # The body as Postgres wrote it (service.series.metric_series_json): no point is parsed
    # or encoded in Python.
    return Response(
        metric_series_json(session=session, run_id=run.id, names=wanted, max_points=max_points),
        media_type="application/json",
    )


@router.get("/{run_id}/eval", response_class=JSONResponse)
def read_eval(run: RunDep, session: SessionDep, max_points: MaxPoints = None) -> JSONResponse:
    """Per task: baseline (step 0), latest, best (lowest cross-entropy) and history."""
    return JSONResponse(eval_summary(session=session, run_id=run.id, max_points=max_points))


@router.get("/{run_id}/checkpoints")
def read_checkpoints(
    run: RunDep,
    session: SessionDep,
    status: Annotated[
        CheckpointFilter,
        Query(
            description="`usable` (what a resume or another run may start from), `deleted`, "
            "`quarantined`, or `all` with each one's status and reason"
        ),
    ] = "usable",
) -> CheckpointsPublic:
    """The run's checkpoints, oldest first: by default only usable ones."""
    checkpoints = list_checkpoints(session=session, run_id=run.id, status=status)
    return CheckpointsPublic(
        checkpoints=[CheckpointPublic.model_validate(c) for c in checkpoints],
        count=len(checkpoints),
    )
