"""Metric ingest on Postgres (POST /internal/attempts/{id}/metrics): the batch is parsed from
its JSON bytes and upserted as one JSON parameter that Postgres unpacks. A batch sent again
(a retry after a timeout) stores nothing twice; every name and every finite float arrives as
sent."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import text
from test_api import submit
from test_recovery_api import claimed

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration

NAMES = ["loss", "{a,b}", "NULL", 'quo"te', "back\\slash", "ünïcødé ✓", "a,b", " padded "]
VALUES = [0.1 + 0.2, 5e-324, 1.7976931348623157e308, -0.0, -2.5, 3.0, 1e-05, 123456789.125]


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    return make_api(make_settings())


def stored(api: Api, run_id: str) -> list[tuple[str, int, str, str]]:
    """(name, step, value as float.hex(), attempt) of every row of the run."""
    with api.sessions() as session:
        rows = session.execute(
            text(
                "SELECT name, step, value, attempt_id FROM metrics WHERE run_id = :run "
                "ORDER BY name, step"
            ),
            {"run": run_id},
        ).all()
    return [(name, step, float(value).hex(), attempt) for name, step, value, attempt in rows]


def post_batch(api: Api, attempt_id: str, body: Any) -> Any:
    return api.client.post(
        f"/internal/attempts/{attempt_id}/metrics",
        content=body if isinstance(body, bytes) else json.dumps(body),
        headers={**api.worker, "Content-Type": "application/json"},
    )


def test_a_batch_sent_again_stores_each_point_once_and_exactly(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    worker = claimed(api, run["id"])
    points = [
        {"name": name, "step": step, "value": VALUES[(k + step) % len(VALUES)]}
        for step in range(1, 101)
        for k, name in enumerate(NAMES)
    ]
    body = {"fencing_token": worker.token, "points": points}
    first = post_batch(api, worker.attempt_id, body)
    assert first.status_code == 200, first.text
    assert first.json() == {"accepted": len(points), "errors": []}
    rows = stored(api, run["id"])
    expected = sorted(
        (p["name"], p["step"], float(p["value"]).hex(), worker.attempt_id) for p in points
    )
    assert rows == expected
    # The same batch again (the worker's retry after its request timed out): same rows.
    again = post_batch(api, worker.attempt_id, body)
    assert again.json() == {"accepted": len(points), "errors": []}
    assert stored(api, run["id"]) == expected
    # A point twice in one batch: the later wins; a re-report of a stored step overwrites it.
    overwrite = {
        "fencing_token": worker.token,
        "points": [
            {"name": "loss", "step": 7, "value": 1.0},
            {"name": "loss", "step": 7, "value": 2.0},
            {"name": "NULL", "step": 101, "value": 0.5},
        ],
    }
    assert post_batch(api, worker.attempt_id, overwrite).json()["accepted"] == 3
    now = {(name, step): value for name, step, value, _ in stored(api, run["id"])}
    assert now[("loss", 7)] == (2.0).hex()
    assert now[("NULL", 101)] == (0.5).hex()
    assert len(now) == len(points) + 1
    run_now = api.client.get(f"/runs/{run['id']}", headers=api.admin).json()
    assert run_now["step"] == 101


def test_per_point_errors_and_a_malformed_batch_answer_as_before(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    worker = claimed(api, run["id"])
    # Python's json writes NaN and Infinity, as a worker's would.
    body = {
        "fencing_token": worker.token,
        "points": [
            {"name": "loss", "step": 1, "value": float("inf")},
            {"name": "x" * 500, "step": 1, "value": 1.0},
            {"name": "loss", "step": -1, "value": 1.0},
            {"name": "   ", "step": 2, "value": float("nan")},
            {"name": "loss", "step": 2, "value": 0.25},
        ],
    }
    answer = post_batch(api, worker.attempt_id, body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["accepted"] == 1
    errors = answer.json()["errors"]
    assert [e["index"] for e in errors] == [0, 1, 2, 3]
    assert "not finite" in errors[0]["error"]
    assert "500 characters long" in errors[1]["error"]
    assert "out of range" in errors[2]["error"]
    assert "empty" in errors[3]["error"]
    assert [(n, s) for n, s, _, _ in stored(api, run["id"])] == [("loss", 2)]

    wrong = post_batch(
        api,
        worker.attempt_id,
        {"fencing_token": worker.token, "points": [{"name": "loss", "step": "x", "value": 1}]},
    )
    assert wrong.status_code == 422, wrong.text
    error = wrong.json()["error"]
    assert error["code"] == "invalid_request"
    assert [d["path"] for d in error["details"]] == ["points[0].step"]
    broken = post_batch(api, worker.attempt_id, b'{"fencing_token": "t", "points": [')
    assert broken.status_code == 422, broken.text
    assert broken.json()["error"]["code"] == "invalid_request"
    # No token: 401 before the body is looked at.
    anonymous = api.client.post(f"/internal/attempts/{worker.attempt_id}/metrics", content=b"{")
    assert anonymous.status_code == 401, anonymous.text
