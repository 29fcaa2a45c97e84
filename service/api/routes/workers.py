"""`GET /workers` (the workers the service has heard from) and the ping by which a worker
process says it is there (`POST /internal/workers/ping`, worker tokens only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Depends, Query

from contracts.api import QueuePublic, WorkersPublic
from contracts.reports import Accepted, WorkerPing
from service import access
from service.api.deps import (
    ApiTokenDep,
    PumpDep,
    SessionDep,
    SettingsDep,
    WorkerDep,
    require_api,
)
from service.models import utcnow
from service.workers.fleet import list_workers, note_worker
from service.workers.placement import holds_placement, queue_view

MAX_WORKERS_PAGE = 500

router = APIRouter(prefix="/workers", tags=["workers"], dependencies=[Depends(require_api)])
internal_router = APIRouter(prefix="/internal/workers", tags=["internal"])
queue_router = APIRouter(prefix="/queue", tags=["workers"], dependencies=[Depends(require_api)])


@router.get("")
def read_workers(
    session: SessionDep,
    settings: SettingsDep,
    token: ApiTokenDep,
    limit: Annotated[int, Query(ge=1, le=MAX_WORKERS_PAGE)] = 100,
) -> WorkersPublic:
    """Workers heard from most recently first, each `live` when heard from within the lease
    period, `busy` when it runs an attempt, with that attempt and its run (to a user token,
    only when the run is its own) and the devices its ping says it owns. `count` and `live`
    are over all pages."""
    return list_workers(
        session=session,
        now=utcnow(),
        lease_seconds=settings.lease_seconds,
        limit=limit,
        owner_id=access.owner_filter(token),
    )


@queue_router.get("")
def read_queue(
    session: SessionDep,
    settings: SettingsDep,
    token: ApiTokenDep,
    limit: Annotated[int, Query(ge=1, le=MAX_WORKERS_PAGE)] = 100,
) -> QueuePublic:
    """Queued attempts in placement order (placed ones not claimed yet first), each with its
    position, priority, owner, devices, nodes and why it waits as a placement pass would
    decide now: no worker big enough, the owner's quota, behind higher priorities, a gang
    waiting for free workers, preempting lower ones. A user token sees its own attempts only
    (with their global positions)."""
    return queue_view(
        session=session,
        lease_seconds=settings.lease_seconds,
        queue=settings.queue,
        owner_id=access.owner_filter(token),
        limit=limit,
    )


@internal_router.post("/ping")
def ping(
    body: WorkerPing,
    session: SessionDep,
    token: WorkerDep,
    pump: PumpDep,
    background: BackgroundTasks,
) -> Accepted:
    """The worker is there. A worker with its own queue (`worker`) that holds no placed
    attempt runs a placement pass after the answer: a new or freed worker takes the next
    queued attempt at once, not at the next periodic pass."""
    note_worker(
        session=session,
        hostname=body.hostname,
        pid=body.pid,
        now=utcnow(),
        version=body.version,
        queue=body.queue,
        token_id=token.id,
        devices=body.devices,
        device_kind=body.device_kind,
        key=body.worker,
        address=body.address,
    )
    session.commit()
    if body.worker is not None and not holds_placement(session=session, key=body.worker):
        background.add_task(pump.dispatch)
    return Accepted(accepted=1)
