"""One error shape for every 4xx/5xx: `{"error": {"code", "message", "details"}}`.

Logic raises `ApiError` (no FastAPI needed to raise or test it); `install_error_handlers` maps
it, HTTPException and request validation errors onto the shape, and documents the shape, with
the statuses it comes with, on every operation of the OpenAPI schema (`document_errors`).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


class ErrorInfo(BaseModel):
    """What went wrong: a stable `code`, a `message` for people, and `details` (null, or the
    problems found: `[{"path", "message"}]` for an invalid request, with JSON paths)."""

    model_config = ConfigDict(extra="forbid")

    code: str
    message: str
    details: Any


class ErrorResponse(BaseModel):
    """The body of every 4xx and 5xx answer."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorInfo


# What each error status means, as documented on the operations that may answer it.
ERROR_STATUSES: dict[int, str] = {
    401: "No bearer token, or one that is unknown or revoked",
    403: "The token's role may not do this",
    404: "What the request names does not exist, or the token may not see it",
    409: "The request conflicts with the current state (a finished run or job, a superseded "
    "claim, another body under the same Idempotency-Key)",
    413: "The body is over the route's byte limit",
    422: "The request is invalid; `details` names each problem by its JSON path",
    503: "The database does not answer; retry after Retry-After seconds",
}
_REF = "#/components/schemas/"


def _error_statuses(operation: dict[str, Any]) -> list[int]:
    """The error statuses an operation may answer: 422 and 503 for any (a NUL in the URL, the
    database away); with a bearer token, 401, 403, 404 and 409; with a body, 413."""
    statuses = [422, 503]
    if operation.get("security"):
        statuses += [401, 403, 404, 409]
    if "requestBody" in operation:
        statuses.append(413)
    return sorted(statuses)


def add_error_responses(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (an OpenAPI document, changed in place) with the error shape declared for each
    operation's error statuses, FastAPI's own 422 schema (`{"detail": [...]}`, which this
    service never sends) replaced, and the components only that one used removed."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template=_REF + "{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            responses = operation["responses"]
            for status in _error_statuses(operation):
                declared = responses.get(str(status))
                fastapi_default = declared is not None and "HTTPValidationError" in json.dumps(
                    declared
                )
                if declared is None or fastapi_default:
                    responses[str(status)] = {
                        "description": ERROR_STATUSES[status],
                        "content": {
                            "application/json": {"schema": {"$ref": _REF + "ErrorResponse"}}
                        },
                    }
    text = json.dumps(schema.get("paths", {}))
    if "HTTPValidationError" not in text:
        components.pop("HTTPValidationError", None)
        if '"ValidationError"' not in text:
            components.pop("ValidationError", None)
    return schema


def document_errors(app: FastAPI) -> None:
    """The app's OpenAPI schema, built on first request as FastAPI does, through
    `add_error_responses`: clients and fuzzers (schemathesis) read which errors each operation
    answers and in what shape."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = add_error_responses(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


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


# The most bytes one request body may hold, on every route: a workflow document, a job
# request, a worker's batch (routes/internal.py keeps its own limit, the same today). What is
# over it is never read into memory, let alone parsed.
MAX_REQUEST_BYTES = 1 << 20


class RequestBodyLimit:
    """ASGI middleware: 413 `payload_too_large` for a body over `max_bytes` on any route, by
    its Content-Length when it has one, else (chunked) as soon as the bytes read pass it."""

    def __init__(self, app: ASGIApp, *, max_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _message(self, told: int | None) -> str:
        size = f"{told} bytes" if told is not None else "the body"
        return (
            f"{size} exceed the limit of {self.max_bytes} bytes per request; a workflow or a "
            "request this large is not one this service takes"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            body = error_body(PayloadTooLarge.code, self._message(int(declared)))
            await answer_json(send, 413, body)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise PayloadTooLarge(self._message(None))
            return message

        await self.app(scope, limited, send)


async def answer_json(send: Send, status: int, body: dict[str, Any]) -> None:
    """Answer from ASGI middleware, before any route: `body` as JSON with `status`."""
    content = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(content)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


class ErrorJSON(JSONResponse):
    """An error body as JSON. A message or details may echo what the client sent, lone
    surrogates included (`"\\ud800"` in JSON is valid, UTF-8 cannot encode it): such a body is
    written with every non-ASCII character escaped instead of failing as a 500."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


# FastAPI's answer (400) to a body it could not parse for another reason than a JSON syntax
# error (which is a 422 `json_invalid`): bytes that are not UTF-8, JSON nested past Python's
# recursion limit.
_UNPARSED_BODY = "There was an error parsing the body"


def _unreadable_body(request: Request, exc: HTTPException) -> ErrorJSON:
    """A body FastAPI could not parse, as the 422 of any other unusable body, naming `$`."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        why = "it is nested too deeply"
    elif isinstance(cause, UnicodeDecodeError):
        why = f"it is not UTF-8 (byte {cause.start}: {cause.reason})"
    else:
        why = type(cause).__name__ if cause is not None else "it could not be parsed"
    message = f"the body is not a JSON document this service can read: {why}"
    return ErrorJSON(
        error_body(
            "invalid_request",
            f"{request.method} {request.url.path}: {message}",
            [{"path": "$", "message": message}],
        ),
        status_code=422,
    )


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def _paths_of(doc: Any, bad: Any, here: tuple[int | str, ...] = ()) -> list[str]:
    """The JSON path of every string in `doc` (a key or a value) for which `bad` holds."""
    if isinstance(doc, str):
        return [json_path(here)] if bad(doc) else []
    found = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if isinstance(key, str) and bad(key):
                found.append(json_path((*here, key)))
            found += _paths_of(value, bad, (*here, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found += _paths_of(value, bad, (*here, i))
    return found


async def _unstorable(request: Request, code: str, message: str, bad: Any) -> ErrorJSON:
    """422 for text no route refused but nothing can store or send: each string of the JSON
    body for which `bad` holds, named by its path (`$` when none can be found)."""
    try:
        body = await request.json()  # as FastAPI parsed it (cached on the request)
    except Exception:
        body = None
    paths = _paths_of(body, bad) or ["$"]
    return ErrorJSON(
        error_body(
            code,
            f"{request.method} {request.url.path}: {', '.join(paths[:3])}: {message}",
            [{"path": path, "message": message} for path in paths],
        ),
        status_code=422,
    )


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


def install_error_handlers(app: FastAPI) -> None:
    document_errors(app)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return ErrorJSON(
            error_body(exc.code, exc.message, exc.details),
            status_code=exc.status,
            headers=exc.headers,
        )

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _UNPARSED_BODY:
            return _unreadable_body(request, exc)
        message = exc.detail if isinstance(exc.detail, str) else _code_for(exc.status_code)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}; see /docs for the API"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        code = exc.code if isinstance(exc, PayloadTooLarge) else _code_for(exc.status_code)
        return ErrorJSON(
            error_body(code, message),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = validation_details(exc.errors())
        summary = "; ".join(f"{d['path']}: {d['message']}" for d in details[:3])
        more = f" (and {len(details) - 3} more)" if len(details) > 3 else ""
        return ErrorJSON(
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
        if isinstance(exc, DataError):
            # A value the database refuses (a NUL in text, a number past its column) that no
            # field's bounds caught: the client's to fix, not the service's failure.
            log.warning("%s %s: %s", request.method, request.url.path, exc.orig)
            first = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else ""
            nul = "NUL" in first or "0x00" in first
            return await _unstorable(
                request,
                "invalid_value",
                f"a value cannot be stored ({first})",
                (lambda text: "\0" in text) if nul else (lambda _text: False),
            )
        if not is_retryable(exc):
            return await _unexpected(request, exc)
        log.warning("%s %s: database unavailable (%s)", request.method, request.url.path, exc)
        error = database_unavailable(exc)
        return ErrorJSON(
            error_body(error.code, error.message),
            status_code=error.status,
            headers=error.headers,
        )

    @app.exception_handler(UnicodeEncodeError)
    async def _lone_surrogate(request: Request, exc: UnicodeEncodeError) -> JSONResponse:
        # JSON carries a lone surrogate escaped (\\ud800); UTF-8, and so the database and
        # every answer, cannot. Nothing the service makes holds one: it came in the request.
        char = exc.object[exc.start : exc.start + 1] if isinstance(exc.object, str) else ""
        code_point = f"U+{ord(char):04X}" if char else "a lone surrogate"
        return await _unstorable(
            request,
            "invalid_text",
            f"holds a lone surrogate ({code_point}), which UTF-8 cannot encode; send the "
            "character whole (both halves of the pair) or not at all",
            _has_lone_surrogate,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return ErrorJSON(
            error_body(
                "internal_error",
                f"{request.method} {request.url.path} failed: {type(exc).__name__}; "
                "the service log has the traceback",
            ),
            status_code=500,
        )
