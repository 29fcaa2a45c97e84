from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from contracts.api import Status
from service.api.deps import SessionDep
from service.errors import database_unavailable

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> Status:
    """The process is up (no dependencies checked)."""
    return Status(status="ok")


@router.get("/readyz")
def readyz(session: SessionDep) -> Status:
    """Ready to serve: the database answers."""
    try:
        session.execute(text("SELECT 1"))
    except SQLAlchemyError as err:
        raise database_unavailable(err) from None
    return Status(status="ready")
