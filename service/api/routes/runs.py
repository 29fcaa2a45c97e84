from __future__ import annotations

from typing import Annotated, Any

from fastapi import (
    APIRouter,
    BackgroundTasks,
    Body,
    Depends,
    Header,
    Query,
    Request,
    Response,
    status,
)
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from sqlalchemy.orm import Session

from contracts.api import (
    MAX_COMPARED,
    MAX_RUNS_PAGE,
    CheckpointPublic,
    CheckpointsPublic,
    EvalByPhase,
    EvalSummaryPublic,
    LedgerPublic,
    MetricSeriesPublic,
    RunComparison,
    RunCreate,
    RunPublic,
    RunResume,
    RunsPublic,
    RunUpdate,
)
from contracts.bounds import MAX_COUNT, MAX_TAG
from service import access, audit
from service.api.deps import (
    ApiTokenDep,
    LeasesHeardDep,
    MetricNamesDep,
    PumpDep,
    RunDep,
    SessionDep,
    SettingsDep,
    require_api,
)
from service.checkpoints.registry import CheckpointFilter, best_checkpoints, list_checkpoints
from service.lifecycle import RunStatus
from service.models import Run
from service.reads.compare import compare_runs
from service.reads.evaluation import eval_by_phase, eval_summary
from service.reads.export import evals_csv, metrics_csv
from service.reads.ledger import token_ledger
from service.reads.series import metric_series_json
from service.runs.control import cancel_run, pause_run
from service.runs.digest import DigestJobs
from service.runs.resume import resume_run
from service.runs.run import create_run, run_for, update_run
from service.runs.view import RunsCursor, list_runs, run_public, runs_public
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
MAX_TAG_FILTERS = 8


class CSVResponse(StreamingResponse):
    """A CSV body, streamed; the document lists its 200 as `text/csv` only, so a generated
    client reads it as text and never tries it as JSON."""

    media_type = "text/csv"
    charset = "utf-8"


CSV_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/csv": {"schema": {"type": "string"}}}, "description": "CSV rows"}
}


def _query_error(field: str, message: str) -> RequestValidationError:
    return RequestValidationError(
        [{"loc": ("query", field), "msg": message, "type": "value_error"}]
    )


def _csv(body: Any, run_id: str, what: str) -> CSVResponse:
    return CSVResponse(
        body,
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": f'attachment; filename="{run_id}-{what}.csv"'},
    )


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {
            "model": RunPublic,
            "description": "The run an earlier request with this Idempotency-Key and body created",
        }
    },
)
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
    and body again answer 200 with the same run; another body with that key, 409. Inputs at
    `s3://` URIs whose digests are not known yet are hashed by workers: the request waits
    TRAINCTL_DIGEST_WAIT_SECONDS for them, then answers 409 `inputs_being_hashed` naming each
    input (field, uri) and its digest job; send it again. A digest job that failed is 422
    `missing_input` naming the input."""
    audit.expect(session, "run.create")  # the run is owned by `token` (service.access)
    run, created = create_run(
        session=session,
        request=body,
        idempotency_key=idempotency_key,
        data_root=settings.data_root,
        roots=settings.paths,
        default_max_restarts=settings.max_restarts,
        default_max_preemptions=settings.max_preemptions,
        owner_id=access.owner_filter(token),
        digest_jobs=DigestJobs(wait=settings.digest_wait_seconds, dispatch=pump.dispatch),
    )
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
    tag: Annotated[
        list[str] | None,
        Query(description=f"runs carrying this tag; repeated (up to {MAX_TAG_FILTERS}): every one"),
    ] = None,
    name: Annotated[
        str | None,
        Query(max_length=200, description="runs whose name holds this text, whatever the case"),
    ] = None,
) -> RunsPublic:
    """Newest first, a page of `limit`; `next_cursor` asks for the next page (null on the
    last; pass the same filters with it). `count` is the number of runs matching the filters
    (`status`, `tag`, `name`), over all pages. A user token sees only its own runs
    (service.access)."""
    try:
        after = None if cursor is None else RunsCursor.parse(cursor)
    except ValueError as err:
        raise _query_error("cursor", str(err)) from err
    if tag is not None and (len(tag) > MAX_TAG_FILTERS or any(len(t) > MAX_TAG for t in tag)):
        raise _query_error(
            "tag", f"give at most {MAX_TAG_FILTERS} tags of at most {MAX_TAG} characters each"
        )
    runs, count, following = list_runs(
        session=session,
        limit=limit,
        status=status,
        after=after,
        owner_id=access.owner_filter(token),
        tags=tag,
        name=name or None,
    )
    public = runs_public(
        session=session, runs=runs, lease_seconds=settings.lease_seconds, queue=settings.queue
    )
    return RunsPublic(
        runs=public, count=count, next_cursor=None if following is None else following.encode()
    )


# What `ids` is, as the document says it: a comma-separated list (form style, not exploded:
# `ids=a,b`), 2 to MAX_COMPARED distinct ids, each without a comma or whitespace, so that a
# request the document allows is one the route takes (a generated client sends a list).
COMPARED_IDS: dict[str, Any] = {
    "name": "ids",
    "in": "query",
    "required": True,
    "style": "form",
    "explode": False,
    "description": f"2 to {MAX_COMPARED} run ids, comma-separated; the first is the reference "
    "the others' changes are measured against",
    "schema": {
        "type": "array",
        "items": {"type": "string", "minLength": 1, "maxLength": 39, "pattern": r"^[^,\s\u0000]+$"},
        "minItems": 2,
        "maxItems": MAX_COMPARED,
        "uniqueItems": True,
    },
}


# Before GET /runs/{run_id}, which would otherwise take "compare" for a run id.
@router.get("/compare", openapi_extra={"parameters": [COMPARED_IDS]})
def compare(
    session: SessionDep,
    token: ApiTokenDep,
    ids: Annotated[str, Query(max_length=MAX_COMPARED * 40, include_in_schema=False)],
) -> RunComparison:
    """The runs' eval sets side by side (baseline, final and best per set and run, and each
    run's change against the first) and every signed input that differs between them, field
    by field with each run's value, as a refused resume names them. A run the token may not
    see is 404 `run_not_found`, as everywhere."""
    wanted = [part.strip() for part in ids.split(",") if part.strip()]
    if len(wanted) < 2 or len(wanted) > MAX_COMPARED:
        raise _query_error(
            "ids", f"give 2 to {MAX_COMPARED} run ids separated by commas; got {len(wanted)}"
        )
    repeated = sorted({i for i in wanted if wanted.count(i) > 1})
    if repeated:
        raise _query_error("ids", f"names run(s) {', '.join(repeated)} more than once")
    runs = [run_for(session, token, run_id) for run_id in wanted]
    return compare_runs(session=session, runs=runs)


@router.get("/{run_id}")
def read_run(run: RunDep, session: SessionDep, settings: SettingsDep) -> RunPublic:
    return _public(session, settings, run)


@router.patch("/{run_id}")
def update(
    run: RunDep,
    body: RunUpdate,
    session: SessionDep,
    settings: SettingsDep,
    pump: PumpDep,
    background: BackgroundTasks,
) -> RunPublic:
    """Set the run's `name`, `tags` (the whole set: `[]` removes every tag), `note`
    (null or "" removes it) and `priority` (its queued attempts are placed in the new order;
    a higher one may preempt lower running ones); a field left out stays. Nothing else of a
    run changes this way: what it trains on is its signature's."""
    fields = sorted(body.model_fields_set)
    audit.expect(session, "run.update", run.id, {"fields": fields})
    updated = update_run(session=session, run_id=run.id, request=body)
    if "priority" in body.model_fields_set:
        background.add_task(pump.dispatch)
    return _public(session, settings, updated)


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
    resumed, attempt = resume_run(
        session=session,
        run_id=run.id,
        request=body or RunResume(),
        data_root=settings.data_root,
        roots=settings.paths,
        judge_leases=heard,
        owner_id=access.owner_filter(token),
        digest_jobs=DigestJobs(wait=settings.digest_wait_seconds, dispatch=pump.dispatch),
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


def _no_format(
    format: Annotated[str | None, Query(include_in_schema=False)] = None,
) -> None:
    """`?format=csv` was how the CSV forms were asked for before they had routes of their own;
    refused (422 naming it), not ignored, so that an old client never takes JSON for CSV."""
    if format is not None:
        raise _query_error(
            "format",
            "the CSV forms have routes of their own: GET /runs/{id}/metrics.csv and "
            "GET /runs/{id}/eval.csv; these routes answer JSON only",
        )


# The JSON bodies below are written without the response model (as Postgres wrote them, or
# read straight from rows); the model documents them and is what a client reads them into.
@router.get(
    "/{run_id}/metrics",
    response_model=MetricSeriesPublic,
    response_class=JSONResponse,
    dependencies=[Depends(_no_format)],
)
def read_metrics(
    run: RunDep, session: SessionDep, names: MetricNamesDep, max_points: MaxPoints = None
) -> Response:
    """`{name: {"steps": [...], "values": [...]}}`; non-finite values are null. The same
    series as CSV: `GET /runs/{id}/metrics.csv`."""
    # The body as Postgres wrote it (service.reads.series.metric_series_json): no point is parsed
    # or encoded in Python.
    return Response(
        metric_series_json(session=session, run_id=run.id, names=names, max_points=max_points),
        media_type="application/json",
    )


@router.get("/{run_id}/metrics.csv", response_class=CSVResponse, responses=CSV_RESPONSE)
def read_metrics_csv(
    run: RunDep, request: Request, names: MetricNamesDep, max_points: MaxPoints = None
) -> CSVResponse:
    """`run_id,name,step,value`, a row per point in (name, step) order, non-finite values
    empty; every point unless `max_points` thins the series (read in pages, streamed)."""
    body = metrics_csv(
        sessions=request.app.state.session_factory,
        run_id=run.id,
        names=names,
        max_points=max_points,
    )
    return _csv(body, run.id, "metrics")


@router.get(
    "/{run_id}/eval",
    response_model=EvalSummaryPublic,
    response_class=JSONResponse,
    dependencies=[Depends(_no_format)],
)
def read_eval(run: RunDep, session: SessionDep, max_points: MaxPoints = None) -> JSONResponse:
    """Per eval set: baseline (step 0), latest, best (lowest cross-entropy), history, and the
    first records it skipped (`skipped_examples`). As CSV: `GET /runs/{id}/eval.csv`."""
    return JSONResponse(eval_summary(session=session, run_id=run.id, max_points=max_points))


@router.get("/{run_id}/eval.csv", response_class=CSVResponse, responses=CSV_RESPONSE)
def read_eval_csv(run: RunDep, session: SessionDep) -> CSVResponse:
    """`run_id,name,task,step,phase,cross_entropy,perplexity,records,target_tokens,
    oversized_records,skipped_malformed_json,skipped_wrong_shape,skipped_no_target`, a row per
    eval set and step (every one)."""
    return _csv(iter([evals_csv(session=session, run_id=run.id)]), run.id, "evals")


@router.get("/{run_id}/eval/phases")
def read_eval_by_phase(run: RunDep, session: SessionDep) -> EvalByPhase:
    """Forgetting, phase by phase: a row per phase (in order) and in it a cell per eval set
    (in `sets`' order): the set's evaluation at the phase's end (`complete` false while the
    phase trains: the latest so far), at its start (the previous phase's end, or the
    baseline) and the change of perplexity between them in percent. At most two evaluations
    per phase and set are read."""
    return eval_by_phase(session=session, run=run)


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
    """The run's checkpoints, oldest first: by default only usable ones; and each eval set's
    best checkpoint (`best`: what `checkpoint.keep_best` keeps), saying when a set's best
    evaluation lies at a step without one."""
    checkpoints = list_checkpoints(session=session, run_id=run.id, status=status)
    return CheckpointsPublic(
        checkpoints=[CheckpointPublic.model_validate(c) for c in checkpoints],
        count=len(checkpoints),
        best=best_checkpoints(session=session, run_id=run.id),
    )


@router.get("/{run_id}/ledger")
def read_ledger(run: RunDep, session: SessionDep) -> LedgerPublic:
    """The token ledger: per phase and data source, the tokens planned against those trained
    so far (envelope tokens, target tokens, epochs of the source), and the realised replay
    share against the plan's. One index seek per count (service.reads.ledger)."""
    return token_ledger(session=session, run=run)
