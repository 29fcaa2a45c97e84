"""The worker protocol (worker tokens only). Bodies and answers are contracts.reports models."""

from __future__ import annotations

from fastapi import APIRouter, BackgroundTasks, Depends

from contracts.reports import (
    Accepted,
    CheckpointReport,
    Claim,
    ClaimRequest,
    EvalBatch,
    Finish,
    Heartbeat,
    HeartbeatAnswer,
    MetricBatch,
)
from service.attempt import (
    claim_attempt,
    finish_attempt,
    heartbeat,
    record_evals,
    record_metrics,
    register_checkpoint,
)
from service.deps import PumpDep, SessionDep, SettingsDep, require_worker

router = APIRouter(
    prefix="/internal/attempts", tags=["internal"], dependencies=[Depends(require_worker)]
)


@router.post("/{attempt_id}/claim")
def claim(attempt_id: str, body: ClaimRequest, session: SessionDep, settings: SettingsDep) -> Claim:
    """Exactly one worker wins a queued attempt; others get 409 already_claimed/superseded."""
    return claim_attempt(
        session=session,
        attempt_id=attempt_id,
        request=body,
        lease_seconds=settings.lease_seconds,
        artifact_root=settings.artifact_root,
    )


@router.post("/{attempt_id}/heartbeat")
def renew(
    attempt_id: str, body: Heartbeat, session: SessionDep, settings: SettingsDep
) -> HeartbeatAnswer:
    return heartbeat(
        session=session, attempt_id=attempt_id, report=body, lease_seconds=settings.lease_seconds
    )


@router.post("/{attempt_id}/metrics")
def metrics(
    attempt_id: str, body: MetricBatch, session: SessionDep, settings: SettingsDep
) -> Accepted:
    accepted = record_metrics(
        session=session, attempt_id=attempt_id, batch=body, lease_seconds=settings.lease_seconds
    )
    return Accepted(accepted=accepted)


@router.post("/{attempt_id}/evals")
def evals(attempt_id: str, body: EvalBatch, session: SessionDep, settings: SettingsDep) -> Accepted:
    accepted = record_evals(
        session=session, attempt_id=attempt_id, batch=body, lease_seconds=settings.lease_seconds
    )
    return Accepted(accepted=accepted)


@router.post("/{attempt_id}/checkpoints")
def checkpoints(
    attempt_id: str, body: CheckpointReport, session: SessionDep, settings: SettingsDep
) -> Accepted:
    register_checkpoint(
        session=session, attempt_id=attempt_id, report=body, lease_seconds=settings.lease_seconds
    )
    return Accepted(accepted=1)


@router.post("/{attempt_id}/finish")
def finish(
    attempt_id: str,
    body: Finish,
    session: SessionDep,
    settings: SettingsDep,
    pump: PumpDep,
    background: BackgroundTasks,
) -> Accepted:
    """End the attempt; the next phase's (or a restart's) attempt is dispatched after commit."""
    next_attempt = finish_attempt(
        session=session, attempt_id=attempt_id, report=body, lease_seconds=settings.lease_seconds
    )
    if next_attempt is not None:
        background.add_task(pump.dispatch)
    return Accepted(accepted=1)
