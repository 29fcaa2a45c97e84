"""A 405's `Allow` names every method the path takes, whichever router or route declares it:
walked over every path of the app's own OpenAPI document."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from service.api.app import create_app
from service.settings import ServiceSettings

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def test_every_405_allows_what_the_document_lists_for_the_path(tmp_path: Path) -> None:
    settings = ServiceSettings(home=tmp_path, broker_url="memory://")
    app = create_app(settings)
    paths = app.openapi()["paths"]
    # No `with`: no lifespan, no database; a 405 is answered before any dependency runs.
    client = TestClient(app)
    templates = {p: re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", p) + "$") for p in paths}
    walked = 0
    for path in paths:
        concrete = re.sub(r"\{[^}]+\}", "x1", path)
        # Every documented path the concrete one matches: /runs/compare is also /runs/{run_id}.
        listed = {
            m.upper() for p, ops in paths.items() if templates[p].match(concrete) for m in ops
        }
        for method in set(METHODS) - listed:
            answer = client.request(method, concrete)
            assert answer.status_code == 405, (method, concrete, answer.status_code)
            allow = {m.strip() for m in answer.headers["allow"].split(",")}
            assert allow == listed, (method, concrete)
            assert answer.json()["error"]["code"] == "method_not_allowed"
            walked += 1
    assert walked > 100


def test_options_runs_allows_get_and_post(tmp_path: Path) -> None:
    client = TestClient(create_app(ServiceSettings(home=tmp_path, broker_url="memory://")))
    for path, methods in (
        ("/runs", {"GET", "POST"}),
        ("/runs/run_1", {"GET", "PATCH"}),
        ("/tokens", {"GET", "POST"}),
    ):
        answer = client.options(path)
        assert answer.status_code == 405
        assert methods <= {m.strip() for m in answer.headers["allow"].split(",")}, path


def test_every_answer_declares_one_media_type_and_csv_and_events_their_own(
    tmp_path: Path,
) -> None:
    """A generated client picks its parser by the declared media type: one per success, CSV
    as `text/csv` (its own route), events as `text/event-stream`, the rest JSON."""
    paths = create_app(ServiceSettings(home=tmp_path, broker_url="memory://")).openapi()["paths"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            for status, answer in operation["responses"].items():
                if not status.startswith("2") or "content" not in answer:
                    continue
                if path.endswith(".csv"):
                    expected = "text/csv"
                elif path.endswith("/events"):
                    expected = "text/event-stream"
                elif path == "/":
                    expected = "text/html"
                else:
                    expected = "application/json"
                assert list(answer["content"]) == [expected], (method, path, status)
    for path in ("/runs/{run_id}/metrics", "/runs/{run_id}/eval"):
        assert "format" not in {p["name"] for p in paths[path]["get"]["parameters"]}
    names = {p["name"] for p in paths["/runs/{run_id}/metrics.csv"]["get"]["parameters"]}
    assert names == {"run_id", "names", "max_points"}


def test_the_document_says_what_a_request_needs(tmp_path: Path) -> None:
    """What the server refuses, the schema says (so a request it allows is never refused):
    one of workflow or workflow_id, two ids or more to compare."""
    doc = create_app(ServiceSettings(home=tmp_path, broker_url="memory://")).openapi()
    run_create = doc["components"]["schemas"]["RunCreate"]
    both, neither = run_create["not"]["anyOf"]
    assert [branch["required"] for branch in both["allOf"]] == [["workflow"], ["workflow_id"]]
    assert [branch["required"] for branch in neither["not"]["anyOf"]] == [
        ["workflow"],
        ["workflow_id"],
    ]
    assert "oneOf" not in run_create  # a generated client would lose the RunCreate model
    (ids,) = doc["paths"]["/runs/compare"]["get"]["parameters"]
    assert (ids["style"], ids["explode"]) == ("form", False)  # ids=a,b
    assert ids["schema"]["minItems"] == 2 and ids["schema"]["uniqueItems"] is True
    initial = run_create["properties"]["initial_checkpoint"]["anyOf"]
    assert {"type": "string", "minLength": 1} in initial
