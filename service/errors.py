"""One error shape for every 4xx/5xx: `{"error": {"code", "message", "details"}}`.

Logic raises `ApiError` (no FastAPI needed to raise or test it); service.api.error_response maps
it, HTTPException and request validation errors onto the shape and documents the shape on every
operation of the OpenAPI schema. Also here: which database errors mean that the database cannot
be reached (`is_unavailable`), or that a request may succeed if retried (`is_retryable`).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from contracts.workflow import json_path


class ApiError(Exception):
    """An error the client can act on. `message` says what happened, where, and what to do."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: Any = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.headers = headers


def not_found(kind: str, ident: str, hint: str) -> ApiError:
    return ApiError(404, f"{kind}_not_found", f"{kind} {ident!r} does not exist; {hint}")


def error_body(code: str, message: str, details: Any = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details}}


def validation_details(errors: Any) -> list[dict[str, str]]:
    """Pydantic/FastAPI errors as `{path, message}` with JSON paths (`phases[2].steps`); a body
    field's path has no `body.` prefix, other places keep theirs (`query.limit`)."""
    details = []
    for err in errors:
        loc = list(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            # FastAPI's loc here is ("body", <character position>): no JSON path to name.
            position = loc[1] if len(loc) > 1 else "?"
            error = (err.get("ctx") or {}).get("error", "not valid JSON")
            details.append(
                {"path": "$", "message": f"is not valid JSON: {error} at character {position}"}
            )
            continue
        if loc and loc[0] == "body":
            path = json_path(loc[1:])
        elif loc:
            path = f"{loc[0]}.{json_path(loc[1:])}" if len(loc) > 1 else str(loc[0])
        else:
            path = "$"
        message = str(err.get("msg", "is invalid"))
        if err.get("type") == "missing":
            message = "is required"
        message = message.removeprefix("Value error, ")
        details.append({"path": path, "message": message})
    return details


def summarize_problems(problems: list[dict[str, Any]]) -> str:
    """The first three `{path, message}` problems as `path: message; ...`, and how many more:
    the sentence an error's message gives, its details holding them all."""
    summary = "; ".join(f"{p['path']}: {p['message']}" for p in problems[:3])
    if len(problems) > 3:
        summary += f" (and {len(problems) - 3} more)"
    return summary


def database_unavailable(err: Exception) -> ApiError:
    return ApiError(
        503,
        "database_unavailable",
        f"the database does not answer ({type(err).__name__}); retry shortly, and check "
        "TRAINCTL_DATABASE_URL and that the database is up if it persists",
        headers={"Retry-After": "5"},
    )


def is_retryable(err: Exception) -> bool:
    """The database cannot be reached, or it cut a statement short (a deadlock, a lock or
    statement timeout, SQLite's lock): a request may well succeed if retried, so an API
    answer is a 503 with Retry-After."""
    if isinstance(err, OperationalError | PoolTimeoutError):
        return True
    return isinstance(err, DBAPIError) and err.connection_invalidated


# Postgres SQLSTATEs of a connection the server refused or ended: class 08 (connection
# exception) and these. Deadlocks (40P01), statement timeouts (57014) and lock timeouts (55P03)
# are OperationalError too, but the database answered them.
_CONNECTION_STATES = frozenset(
    {
        "57P01",  # admin_shutdown
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now (starting up, shutting down)
        "53300",  # too_many_connections
    }
)
# SQLite's primary result codes for a database file that cannot be opened or read.
_SQLITE_UNREADABLE = frozenset({sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_IOERR})


def is_unavailable(err: Exception) -> bool:
    """The database cannot be reached: refused, dropped or ended by the server, no pooled
    connection in time, or (SQLite) its file cannot be opened. Not an error in a statement,
    however it is classed: the reaper grants grace for unavailability only (a deadlock taken
    for an outage would extend every lease, pass after pass, while the deadlocks last)."""
    if isinstance(err, PoolTimeoutError):
        return True
    if not isinstance(err, OperationalError):
        return isinstance(err, DBAPIError) and err.connection_invalidated
    if err.connection_invalidated:
        return True
    driver = err.orig
    if isinstance(driver, sqlite3.Error):
        return driver.sqlite_errorcode & 0xFF in _SQLITE_UNREADABLE
    state = getattr(driver, "sqlstate", None)
    if state is None:
        # psycopg raises a connection it could not open or lost without a SQLSTATE: no
        # server answered.
        return True
    return state.startswith("08") or state in _CONNECTION_STATES
