"""Pause and cancel racing a phase's finish on real Postgres, in the order that lost the next
phase's attempt: the request reads the run's newest attempt (the finishing one) and waits for
its row lock while the finish holds it; the finish commits the next phase's queued attempt;
then the request goes on. It must act on the attempt the finish added, not on the one it read."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import select, text
from test_api import Worker, get_run, submit

from contracts.reports import Finish
from service.auth import find_token
from service.models import Attempt
from service.workers.report import finish_attempt

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    return make_api(make_settings(reaper_interval_seconds=3600))


def waiting_for_a_lock(api: Api) -> int:
    """How many of this database's connections wait for a lock now."""
    with api.sessions() as session:
        query = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return int(session.scalar(text(query)) or 0)


def until(predicate: Any, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@pytest.mark.parametrize(("action", "ends"), [("pause", "paused"), ("cancel", "cancelled")])
def test_pause_or_cancel_racing_a_phase_s_finish_supersedes_the_next_phase_s_attempt(
    api: Api, tiny_workflow: WorkflowFactory, action: str, ends: str
) -> None:
    run_id = submit(api, {"workflow": tiny_workflow(phases=2, steps=10)}).json()["id"]
    worker = Worker(api, get_run(api, run_id)["attempts"][0]["id"])
    assert worker.claim().status_code == 200
    assert worker.checkpoint(step=10, phase_index=0, phase_step=10).status_code == 200
    assert worker.token is not None

    answer: dict[str, Any] = {}

    def request() -> None:
        answer["response"] = api.client.post(f"/runs/{run_id}/{action}", headers=api.admin)

    with api.sessions() as finishing:
        # The finish has begun: its fence holds attempt 1's row until it commits.
        finishing.execute(
            select(Attempt).where(Attempt.id == worker.attempt_id).with_for_update()
        ).one()
        racing = threading.Thread(target=request)
        racing.start()
        until(lambda: waiting_for_a_lock(api) == 1, timeout=30, what=f"the {action} to wait")
        token = find_token(
            session=finishing, token=api.worker["Authorization"].removeprefix("Bearer ")
        )
        assert token is not None
        finish = Finish(fencing_token=worker.token, status="succeeded", step=10)
        second = finish_attempt(
            session=finishing,
            attempt_id=worker.attempt_id,
            report=finish,
            token=token,
            lease_seconds=api.settings.lease_seconds,
        )
        assert second is not None and second.number == 2  # committed: the lock is let go
    racing.join(timeout=30)
    assert not racing.is_alive()

    response = answer["response"]
    assert response.status_code == 200, response.text
    run = get_run(api, run_id)
    assert run["status"] == ends
    assert [(a["number"], a["status"]) for a in run["attempts"]] == [
        (1, "succeeded"),
        (2, "superseded"),
    ]
    # Nothing of the run is left active: resume takes it up again with a new attempt.
    resumed = api.client.post(f"/runs/{run_id}/resume", headers=api.admin)
    assert resumed.status_code == 200, resumed.text
    assert [a["status"] for a in resumed.json()["attempts"]] == [
        "succeeded",
        "superseded",
        "queued",
    ]
