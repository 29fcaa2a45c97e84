"""GET /workers and the worker ping on real Postgres, and `waiting_for_worker` on a run."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import update

from service.models import Worker, utcnow

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    return make_api(make_settings())


def assert_error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"code", "message", "details"} and error["code"] == code, error
    return dict(error)


def submit(api: Api, workflow: dict[str, Any]) -> dict[str, Any]:
    response = api.client.post("/runs", json={"workflow": workflow}, headers=api.admin)
    assert response.status_code == 201, response.text
    return dict(response.json())


def get_run(api: Api, run_id: str) -> dict[str, Any]:
    response = api.client.get(f"/runs/{run_id}", headers=api.admin)
    assert response.status_code == 200, response.text
    return dict(response.json())


def claim(api: Api, attempt_id: str, *, pid: int) -> None:
    body = {"hostname": "gpu-7", "pid": pid, "nonce": uuid.uuid4().hex}
    response = api.client.post(
        f"/internal/attempts/{attempt_id}/claim", json=body, headers=api.worker
    )
    assert response.status_code == 200, response.text


def ping(api: Api, **fields: Any) -> Any:
    body = {
        "hostname": "gpu-7",
        "pid": 31337,
        "version": "0.1.0",
        "queue": api.settings.queue,
        **fields,
    }
    return api.client.post("/internal/workers/ping", json=body, headers=api.worker)


def workers(api: Api) -> dict[str, Any]:
    response = api.client.get("/workers", headers=api.admin)
    assert response.status_code == 200, response.text
    return dict(response.json())


def silence_workers(api: Api, seconds: float) -> None:
    """As if every worker was last heard from `seconds` ago."""
    with api.sessions() as session:
        session.execute(update(Worker).values(last_seen_at=utcnow() - timedelta(seconds=seconds)))
        session.commit()


def test_a_queued_run_waits_for_a_worker_until_one_pings_and_after_it_falls_silent(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, tiny_workflow(phases=1))
    assert run["waiting_for_worker"] is True, "no worker was ever heard from"
    assert api.client.get("/runs", headers=api.admin).json()["runs"][0]["waiting_for_worker"]

    assert ping(api, queue="another-queue").status_code == 200
    assert get_run(api, run["id"])["waiting_for_worker"] is True, "it serves another queue"
    assert ping(api).status_code == 200
    assert get_run(api, run["id"])["waiting_for_worker"] is False

    silence_workers(api, api.settings.lease_seconds + 1)
    assert get_run(api, run["id"])["waiting_for_worker"] is True


def test_workers_lists_who_pinged_and_what_each_runs(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    assert workers(api) == {"workers": [], "count": 0, "live": 0}
    assert ping(api).status_code == 200
    assert ping(api).status_code == 200, "a worker pings again: still one row"
    (listed,) = workers(api)["workers"]
    assert listed["hostname"] == "gpu-7" and listed["pid"] == 31337
    assert listed["version"] == "0.1.0" and listed["queue"] == api.settings.queue
    assert listed["live"] is True and listed["attempt_id"] is None

    # A claim (its hostname and pid: the pinging process) says what the worker runs; a
    # worker first heard from by its claim is listed at once.
    run = submit(api, tiny_workflow(phases=1))
    attempt_id = run["attempts"][0]["id"]
    claim(api, attempt_id, pid=31337)
    answer = workers(api)
    assert answer["count"] == 1
    (listed,) = answer["workers"]
    assert (listed["attempt_id"], listed["run_id"]) == (attempt_id, run["id"])

    silence_workers(api, api.settings.lease_seconds + 1)
    assert workers(api)["live"] == 0
    other = submit(api, tiny_workflow(phases=1, name="second"))
    claim(api, other["attempts"][0]["id"], pid=555)
    answer = workers(api)
    assert (answer["count"], answer["live"]) == (2, 1)
    newest, older = answer["workers"]
    assert (newest["pid"], newest["version"], newest["live"]) == (555, "unknown", True)
    assert (older["pid"], older["live"]) == (31337, False)


def test_ping_takes_worker_tokens_only_and_bounds_its_fields(api: Api) -> None:
    assert_error(
        api.client.post("/internal/workers/ping", json={}, headers=api.admin), 403, "forbidden"
    )
    assert_error(api.client.get("/workers", headers=api.worker), 403, "forbidden")
    assert_error(api.client.get("/workers"), 401, "unauthorized")
    for field, value in (("hostname", "h" * 256), ("version", "v" * 65), ("pid", 2**31)):
        error = assert_error(ping(api, **{field: value}), 422, "invalid_request")
        assert field in str(error), error
    assert workers(api)["count"] == 0
