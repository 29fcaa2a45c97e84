"""The worker protocol (worker tokens only). Bodies and answers are contracts.reports models.

Limits on what one request may carry (a worker splits larger reports):
- points per metrics batch: contracts.reports.MAX_POINTS_PER_BATCH (5000); more is 422
  `invalid_request` naming `points`.
- bytes per request body: contracts.reports.MAX_REPORT_BYTES (1 MiB); more is 413
  `payload_too_large`, in the error shape, before the body is parsed. 5000 points with names
  of ordinary length take about 300 KiB, and a worker cuts batches of longer names to fit
  (`contracts.reports.metric_batches`), so the byte limit only stops a runaway client.
A metrics batch answers per-item errors: a point that cannot be stored (empty or over-long
name, negative step, NaN or infinite value) comes back as `{"index", "error"}` in `errors`
while the others are stored; `accepted` counts the stored ones.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from contracts.api import BatchAccepted, ItemErrorPublic
from contracts.reports import (
    MAX_REPORT_BYTES,
    Accepted,
    CheckpointRegistered,
    CheckpointRemoval,
    CheckpointReport,
    Claim,
    ClaimRequest,
    EvalBatch,
    Finish,
    Heartbeat,
    HeartbeatAnswer,
    MetricBatch,
)
from service.api.deps import PumpDep, SessionDep, SettingsDep, WorkerDep, require_worker
from service.checkpoints.registry import pinned_steps
from service.models import utcnow
from service.workers.fleet import note_attempt_worker, note_worker
from service.workers.lease import claim_attempt, heartbeat
from service.workers.report import (
    finish_attempt,
    record_evals,
    record_metrics,
    register_checkpoint,
    remove_checkpoint,
)

PREFIX = "/internal/"
MAX_BODY_BYTES = MAX_REPORT_BYTES


def too_large(size: int | None, limit: int) -> str:
    """The 413's message for a body of `size` bytes (None: chunked) over `limit` under PREFIX
    (service.api.middleware.RequestBodyLimit answers it)."""
    told = f"{size} bytes" if size is not None else "a body"
    return (
        f"{told} exceed the limit of {limit} bytes per request to {PREFIX}...; send smaller batches"
    )


router = APIRouter(
    prefix="/internal/attempts", tags=["internal"], dependencies=[Depends(require_worker)]
)


@router.post("/{attempt_id}/claim")
def claim(
    attempt_id: str,
    body: ClaimRequest,
    session: SessionDep,
    settings: SettingsDep,
    token: WorkerDep,
) -> Claim:
    """Exactly one worker wins a queued attempt; others get 409 already_claimed/superseded."""
    claimed = claim_attempt(
        session=session,
        attempt_id=attempt_id,
        request=body,
        token=token,
        lease_seconds=settings.lease_seconds,
        artifact_root=settings.artifact_root,
    )
    note_worker(
        session=session,
        hostname=body.hostname,
        pid=body.pid,
        now=utcnow(),
        token_id=token.id,
        attempt_id=attempt_id,
    )
    session.commit()
    return claimed


@router.post("/{attempt_id}/heartbeat")
def renew(
    attempt_id: str, body: Heartbeat, session: SessionDep, settings: SettingsDep, token: WorkerDep
) -> HeartbeatAnswer:
    answer = heartbeat(
        session=session,
        attempt_id=attempt_id,
        report=body,
        token=token,
        lease_seconds=settings.lease_seconds,
    )
    if answer.action != "stop":
        # Only an accepted heartbeat says its worker lives: a stale or forged secret does not.
        note_attempt_worker(
            session=session,
            attempt_id=attempt_id,
            now=utcnow(),
            token_id=token.id,
            member=body.member,
        )
        session.commit()
    return answer


def _inline_refs(schema: Any, defs: dict[str, Any]) -> Any:
    """`schema` with every `{"$ref": "#/$defs/X"}` replaced by X's schema."""
    if isinstance(schema, dict):
        ref = schema.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(v, defs) for v in schema]
    return schema


_METRIC_BATCH_SCHEMA = MetricBatch.model_json_schema()
_METRIC_BATCH_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": _inline_refs(_METRIC_BATCH_SCHEMA, _METRIC_BATCH_SCHEMA.get("$defs", {}))
            }
        },
    }
}


async def metric_batch(request: Request) -> MetricBatch:
    """The request's MetricBatch, validated by pydantic straight from the JSON bytes: FastAPI's
    own body parsing (json.loads, then validating 1,000 dicts) took ~5 ms of a batch's ~33,
    this ~1.5 ms. A body that is not a valid batch is 422 `invalid_request` as before, its
    paths under `body`."""
    try:
        return MetricBatch.model_validate_json(await request.body())
    except ValidationError as err:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in err.errors(include_url=False)]
        ) from None


@router.post("/{attempt_id}/metrics", openapi_extra=_METRIC_BATCH_BODY)
def metrics(
    attempt_id: str,
    body: Annotated[MetricBatch, Depends(metric_batch)],
    session: SessionDep,
    settings: SettingsDep,
    token: WorkerDep,
) -> BatchAccepted:
    """Store the batch's points; those that cannot be stored are answered in `errors`."""
    accepted, errors = record_metrics(
        session=session,
        attempt_id=attempt_id,
        batch=body,
        token=token,
        lease_seconds=settings.lease_seconds,
    )
    return BatchAccepted(
        accepted=accepted, errors=[ItemErrorPublic.model_validate(e) for e in errors]
    )


@router.post("/{attempt_id}/evals")
def evals(
    attempt_id: str, body: EvalBatch, session: SessionDep, settings: SettingsDep, token: WorkerDep
) -> Accepted:
    accepted = record_evals(
        session=session,
        attempt_id=attempt_id,
        batch=body,
        token=token,
        lease_seconds=settings.lease_seconds,
    )
    return Accepted(accepted=accepted)


@router.post("/{attempt_id}/checkpoints")
def checkpoints(
    attempt_id: str,
    body: CheckpointReport,
    session: SessionDep,
    settings: SettingsDep,
    token: WorkerDep,
) -> CheckpointRegistered:
    """Register a complete checkpoint; the answer lists the run's pinned steps (checkpoints a
    run still needs as its initial weights, and the best of each set `checkpoint.keep_best`
    names), which the worker's retention keeps."""
    checkpoint = register_checkpoint(
        session=session,
        attempt_id=attempt_id,
        report=body,
        token=token,
        lease_seconds=settings.lease_seconds,
        artifact_root=settings.artifact_root,
    )
    pinned = pinned_steps(session=session, run_id=checkpoint.run_id)
    return CheckpointRegistered(accepted=1, pinned_steps=pinned)


@router.post("/{attempt_id}/checkpoints/removals")
def checkpoint_removals(
    attempt_id: str,
    body: CheckpointRemoval,
    session: SessionDep,
    settings: SettingsDep,
    token: WorkerDep,
) -> Accepted:
    """A registered checkpoint the worker deleted (retention) or quarantined (failed
    verification): no longer listed by default nor resumed from. `accepted` is 0 for a step
    the registry does not hold; a deletion of a pinned checkpoint is 409 `checkpoint_pinned`."""
    removed = remove_checkpoint(
        session=session,
        attempt_id=attempt_id,
        removal=body,
        token=token,
        lease_seconds=settings.lease_seconds,
    )
    return Accepted(accepted=0 if removed is None else 1)


@router.post("/{attempt_id}/finish")
def finish(
    attempt_id: str,
    body: Finish,
    session: SessionDep,
    settings: SettingsDep,
    pump: PumpDep,
    background: BackgroundTasks,
    token: WorkerDep,
) -> Accepted:
    """End the attempt; after the commit a placement pass puts the next phase's (or a
    restart's) attempt, or the next queued one, on the worker this freed, and sends it.
    A `succeeded` finish that is not true (not the phase's last step, or its final checkpoint
    not registered) is 409 `unverified_finish`."""
    finish_attempt(
        session=session,
        attempt_id=attempt_id,
        report=body,
        token=token,
        lease_seconds=settings.lease_seconds,
    )
    # Always: the worker is free now, whatever follows for this run.
    background.add_task(pump.dispatch)
    return Accepted(accepted=1)
