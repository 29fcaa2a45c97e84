"""One error shape for every 4xx/5xx: `{"error": {"code", "message", "details"}}`.

Logic raises `ApiError` (no FastAPI needed to raise or test it); `install_error_handlers` maps
it, HTTPException and request validation errors onto the shape.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from contracts.workflow import json_path

log = logging.getLogger(__name__)


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


class PayloadTooLarge(HTTPException):
    """A request body over a route's byte limit, found while it streams in. An HTTPException
    so that FastAPI's body parsing passes it on instead of answering 400."""

    code = "payload_too_large"

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


def not_found(kind: str, ident: str, hint: str) -> ApiError:
    return ApiError(404, f"{kind}_not_found", f"{kind} {ident!r} does not exist; {hint}")


def error_body(code: str, message: str, details: Any = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details}}


class RefuseNul:
    """ASGI middleware: 422 for a request whose path or query string holds a NUL character
    (`%00`). Ids and names from the URL reach SQL; Postgres refuses NUL in text with an error
    that would otherwise surface as a 500. Bodies are validated field by field instead
    (contracts.bounds.NO_NUL)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            where = None
            if "\0" in scope["path"]:
                where = "path"
            elif b"%00" in scope.get("query_string", b"").lower():
                where = "query"
            if where is not None:
                await answer_json(
                    send,
                    422,
                    error_body(
                        "invalid_request",
                        f"the request's {where} contains a NUL character (%00), which no id "
                        "or name can hold",
                        {"field": where},
                    ),
                )
                return
        await self.app(scope, receive, send)


async def answer_json(send: Send, status: int, body: dict[str, Any]) -> None:
    """Answer from ASGI middleware, before any route: `body` as JSON with `status`."""
    content = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(content)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


def _code_for(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return "error"


def validation_details(errors: Any) -> list[dict[str, str]]:
    """Pydantic/FastAPI errors as `{path, message}` with JSON paths (`phases[2].steps`); a body
    field's path has no `body.` prefix, other places keep theirs (`query.limit`)."""
    details = []
    for err in errors:
        loc = list(err.get("loc", ()))
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


def database_unavailable(err: Exception) -> ApiError:
    return ApiError(
        503,
        "database_unavailable",
        f"the database does not answer ({type(err).__name__}); retry shortly, and check "
        "TRAINCTL_DATABASE_URL and that the database is up if it persists",
        headers={"Retry-After": "5"},
    )


def is_unavailable(err: Exception) -> bool:
    """The database cannot be reached (refused, dropped, or no pooled connection in time),
    as opposed to an error in a statement. Deadlocks and lock timeouts are OperationalError
    too; a 503 with Retry-After is the right answer to those as well."""
    if isinstance(err, OperationalError | PoolTimeoutError):
        return True
    return isinstance(err, DBAPIError) and err.connection_invalidated


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.code, exc.message, exc.details),
            status_code=exc.status,
            headers=exc.headers,
        )

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else _code_for(exc.status_code)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}; see /docs for the API"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        code = exc.code if isinstance(exc, PayloadTooLarge) else _code_for(exc.status_code)
        return JSONResponse(
            error_body(code, message),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = validation_details(exc.errors())
        summary = "; ".join(f"{d['path']}: {d['message']}" for d in details[:3])
        more = f" (and {len(details) - 3} more)" if len(details) > 3 else ""
        return JSONResponse(
            error_body(
                "invalid_request",
                f"{request.method} {request.url.path}: {summary}{more}",
                details,
            ),
            status_code=422,
        )

    @app.exception_handler(DBAPIError)
    @app.exception_handler(PoolTimeoutError)
    async def _database_error(request: Request, exc: Exception) -> JSONResponse:
        if not is_unavailable(exc):
            return await _unexpected(request, exc)
        log.warning("%s %s: database unavailable (%s)", request.method, request.url.path, exc)
        error = database_unavailable(exc)
        return JSONResponse(
            error_body(error.code, error.message),
            status_code=error.status,
            headers=error.headers,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(
                "internal_error",
                f"{request.method} {request.url.path} failed: {type(exc).__name__}; "
                "the service log has the traceback",
            ),
            status_code=500,
        )
