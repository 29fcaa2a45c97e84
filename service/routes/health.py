from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from service.deps import SessionDep
from service.errors import ApiError
from service.schemas import Status

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
        raise ApiError(
            503,
            "database_unavailable",
            f"the database does not answer ({type(err).__name__}); check TRAINCTL_DATABASE_URL "
            "and that the database is up",
        ) from None
    return Status(status="ready")
