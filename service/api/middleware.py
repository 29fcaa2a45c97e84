"""ASGI middleware that answers before any route, in the one error shape: a NUL character in
the URL (`RefuseNul`), a request body over the byte limit (`RequestBodyLimit`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import error_body


class PayloadTooLarge(HTTPException):
    """A request body over a route's byte limit, found while it streams in. An HTTPException
    so that FastAPI's body parsing passes it on instead of answering 400."""

    code = "payload_too_large"

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


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
# request, a worker's batch (routes/internal.py sets its own limit, the same today). What is
# over it is never read into memory, let alone parsed.
MAX_REQUEST_BYTES = 1 << 20


def _too_large(size: int | None, limit: int) -> str:
    told = f"{size} bytes" if size is not None else "the body"
    return (
        f"{told} exceed the limit of {limit} bytes per request; a workflow or a "
        "request this large is not one this service takes"
    )


class RequestBodyLimit:
    """ASGI middleware: 413 `payload_too_large` for a body over `max_bytes` on the paths under
    `prefix` (every route by default), by its Content-Length when it has one, else (chunked) as
    soon as the bytes read pass it. `message(size, max_bytes)` says so (size None: chunked)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int = MAX_REQUEST_BYTES,
        prefix: str = "",
        message: Callable[[int | None, int], str] = _too_large,
    ) -> None:
        self.app, self.max_bytes, self.prefix, self.message = app, max_bytes, prefix, message

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            body = error_body(PayloadTooLarge.code, self.message(int(declared), self.max_bytes))
            await answer_json(send, 413, body)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise PayloadTooLarge(self.message(None, self.max_bytes))
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
