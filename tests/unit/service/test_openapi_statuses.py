"""Every status a route can answer is in the OpenAPI document, and every error in the one error
shape: a client generated from the document raises on a status it does not list (as
`UnexpectedStatus(200)` did for a replayed POST /runs). The statuses a route can answer are
read from the route itself, so a route added without its statuses fails here."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI, Response
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, RouteContext, iter_route_contexts
from fastapi.security.base import SecurityBase

from service.api.app import create_app
from service.settings import ServiceSettings

# A status written in code: `status_code=201`, `status.HTTP_200_OK`, `ApiError(404, ...)`.
STATUS_IN_CODE = re.compile(r"status_code\s*=\s*(\d{3})\b|HTTP_(\d{3})_|ApiError\(\s*(\d{3})\b")
ERROR_SHAPE = "#/components/schemas/ErrorResponse"


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    home = tmp_path_factory.mktemp("openapi")
    return create_app(ServiceSettings(home=home / "home", data_root=home, broker_url="memory://"))


def _dependants(dependant: Dependant) -> Iterator[Dependant]:
    yield dependant
    for sub in dependant.dependencies:
        yield from _dependants(sub)


def _statuses_in_code(call: Any) -> set[int]:
    """The statuses the source of `call` names (a function of ours, not FastAPI.s)."""
    if not inspect.isfunction(call) or call.__module__.partition(".")[0] in (
        "fastapi",
        "starlette",
    ):
        return set()
    source = inspect.getsource(call)
    return {int(next(g for g in m.groups() if g)) for m in STATUS_IN_CODE.finditer(source)}


def api_routes(app: FastAPI) -> Iterator[RouteContext]:
    """Every route of `app` in the document, as it is served (its routers' prefixes and
    dependencies included)."""
    for route in iter_route_contexts(app.routes):
        if isinstance(route.original_route, APIRoute) and route.include_in_schema:
            yield route


def answerable(route: RouteContext) -> dict[int, str]:
    """What `route` can answer and why: its success status and any status its endpoint or
    dependencies write; 404 with a path parameter (nothing by that id, or not the token's);
    401 and 403 behind a bearer token; 422 for any request (a NUL in the URL, a parameter or
    body out of bounds); 413 with a body; 503 for any (the database away)."""
    nodes = list(_dependants(route.dependant))
    why: dict[int, str] = {route.status_code or 200: "its success status", 422: "any", 503: "any"}
    for node in nodes:
        for status in _statuses_in_code(node.call):
            why.setdefault(status, f"written in {node.call.__qualname__}")  # type: ignore[union-attr]
    if any(node.path_params for node in nodes):
        why[404] = "a path parameter"
    if any(isinstance(node.call, SecurityBase) for node in nodes):
        why[401] = why[403] = "a bearer token"
    if route.body_field is not None:
        why[413] = "a body"
    return why


def undocumented(app: FastAPI) -> list[str]:
    """Each status a route of `app` can answer that its operation does not list."""
    paths = app.openapi()["paths"]
    missing = []
    for route in api_routes(app):
        for method in sorted(route.methods or ()):
            documented = {int(s) for s in paths[route.path_format][method.lower()]["responses"]}
            for status, why in sorted(answerable(route).items()):
                if status not in documented:
                    missing.append(f"{method} {route.path_format} {status} ({why})")
    return missing


def operations(app: FastAPI) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, item in app.openapi()["paths"].items():
        for method, operation in item.items():
            yield f"{method.upper()} {path}", operation


def test_every_status_a_route_can_answer_is_documented(app: FastAPI) -> None:
    routes = list(api_routes(app))
    assert len(routes) == sum(len(item) for item in app.openapi()["paths"].values())
    assert undocumented(app) == []


def test_a_route_added_without_its_statuses_is_named() -> None:
    """The check above can fail: a route that answers 202 besides its 200, and one with a path
    parameter and no bearer token (so no error statuses of an authenticated route), are
    named."""
    app = create_app(
        ServiceSettings(
            home=Path("/nonexistent/openapi-home"),
            data_root=Path("/nonexistent"),
            broker_url="memory://",
        )
    )
    extra = APIRouter()

    @extra.post("/things")
    def make_thing(response: Response) -> dict[str, int]:
        response.status_code = 202
        return {}

    @extra.get("/things/{thing_id}")
    def read_thing(thing_id: str) -> dict[str, str]:
        return {"id": thing_id}

    app.include_router(extra)
    app.openapi_schema = None
    assert undocumented(app) == [
        "POST /things 202 (written in test_a_route_added_without_its_statuses_is_named"
        ".<locals>.make_thing)",
        "GET /things/{thing_id} 404 (a path parameter)",
    ]


def test_the_replayed_submissions_answer_200_as_documented(app: FastAPI) -> None:
    paths = app.openapi()["paths"]
    for path, model in (("/runs", "RunPublic"), ("/workflows", "WorkflowPublic")):
        responses = paths[path]["post"]["responses"]
        for status in ("200", "201"):
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": f"#/components/schemas/{model}"}, (path, status)


def test_every_error_status_answers_the_error_shape(app: FastAPI) -> None:
    for name, operation in operations(app):
        for status, response in operation["responses"].items():
            if int(status) >= 400:
                content = response.get("content", {})
                assert list(content) == ["application/json"], (name, status)
                assert content["application/json"]["schema"] == {"$ref": ERROR_SHAPE}, (
                    name,
                    status,
                )
