"""Every error answered in the one shape (service.errors): the handlers that map `ApiError`,
HTTPException, request validation errors and database errors onto it, and the OpenAPI schema
that documents it, with the statuses it comes with, on every operation (`document_errors`).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import DataError, DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException
from starlette.routing import Match, Mount

from contracts.workflow import json_path
from service.api.middleware import PayloadTooLarge
from service.errors import (
    ApiError,
    database_unavailable,
    error_body,
    is_retryable,
    summarize_problems,
    validation_details,
)

log = logging.getLogger(__name__)


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


# What a 405's Allow may name; HEAD only where a route declares it (FastAPI's do not).
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route of `path` accepts. Starlette's 405 names only the first route
    whose path matched, but one path may have several (`GET /runs` and `POST /runs` in one
    router, `/tokens` in two): a client told `Allow: POST` would never try GET. Asked of the
    routes themselves (`matches`), as a request would be routed; a mount is left out (its app
    answers its own 405)."""
    routes = [r for r in app.router.routes if not isinstance(r, Mount)]
    allowed = []
    for method in _METHODS:
        scope = {"type": "http", "path": path, "root_path": "", "method": method, "app": app}
        if any(route.matches(scope)[0] == Match.FULL for route in routes):
            allowed.append(method)
    return allowed


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
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            # A mount's own 405 (the dashboard's static files) keeps the Allow it gave.
            allow = ", ".join(allowed_methods(app, request.url.path)) or (headers or {}).get(
                "Allow", ""
            )
            message = f"{request.method} is not allowed on {request.url.path}; it takes {allow}"
            headers = {**(headers or {}), "Allow": allow}
        code = exc.code if isinstance(exc, PayloadTooLarge) else _code_for(exc.status_code)
        return ErrorJSON(error_body(code, message), status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = validation_details(exc.errors())
        return ErrorJSON(
            error_body(
                "invalid_request",
                f"{request.method} {request.url.path}: {summarize_problems(details)}",
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
