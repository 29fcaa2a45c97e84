"""The service places attempts (service/workers/placement.py) on Postgres and Redis, driven
through the API and the worker protocol in this process: priority order and preemption by
priority through the pause path (cause `priority`, no budget charged, queued again by itself),
an owner's device quota, a worker that dies after it was placed on, and GET /queue."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import select, update
from test_api import Worker, get_run, message_args, ping_worker, queued_messages, submit

from service.models import AttemptMember, utcnow
from service.models import Worker as WorkerRow
from service.workers.dispatch import redispatch_unclaimed

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    # Passes are driven by the requests (and `place`), not by the periodic threads.
    return make_api(make_settings(reaper_interval_seconds=3600, outbox_interval_seconds=3600))


def place(api: Api) -> None:
    api.client.app.state.pump.dispatch()  # type: ignore[attr-defined]


def queue(api: Api, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    response = api.client.get("/queue", headers=headers or api.admin)
    assert response.status_code == 200, response.text
    return list(response.json()["attempts"])


def placed_on(api: Api, attempt_id: str) -> list[str]:
    with api.sessions() as session:
        rows = session.scalars(
            select(AttemptMember).where(AttemptMember.attempt_id == attempt_id)
        ).all()
        return [row.worker_id for row in rows]


def test_a_higher_priority_run_preempts_a_lower_one_which_resumes_by_itself(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    ping_worker(api, key="only")
    doc = tiny_workflow(phases=1, steps=10)
    low = submit(api, {"workflow": doc, "name": "low"}).json()
    low_first = low["attempts"][0]["id"]
    assert placed_on(api, low_first) == ["only"]
    assert [message_args(m)[0] for m in queued_messages(api.settings)] == [low_first]
    runner = Worker(api, low_first)
    assert runner.claim().status_code == 200
    assert runner.heartbeat(step=3).json()["action"] == "continue"

    high = submit(api, {"workflow": doc, "name": "high", "priority": 5}).json()
    assert high["priority"] == 5
    high_first = high["attempts"][0]["id"]
    assert placed_on(api, high_first) == [], "the only worker is busy"
    (waiting,) = queue(api)
    assert waiting["attempt_id"] == high_first and waiting["position"] == 1
    assert waiting["reason"].startswith(f"preempting {low_first}")
    # The low one is told to checkpoint and yield; it finishes paused.
    assert runner.heartbeat(step=4).json()["action"] == "pause"
    assert runner.checkpoint(step=4, phase_index=0, phase_step=4).status_code == 200
    assert runner.finish("paused", step=4).status_code == 200

    yielded = get_run(api, low["id"])
    assert yielded["status"] == "recovering"
    assert [(a["status"], a["cause"]) for a in yielded["attempts"]] == [
        ("paused", "priority"),
        ("queued", None),
    ]
    assert yielded["preemptions"] == 0, "a yield to a priority is never charged"
    assert yielded["queue_position"] == 2  # behind the high one, placed, not claimed yet
    # The high one took the worker; the low one's new attempt waits behind it.
    assert placed_on(api, high_first) == ["only"]
    low_second = yielded["attempts"][1]["id"]
    assert placed_on(api, low_second) == []
    (behind,) = [q for q in queue(api) if q["attempt_id"] == low_second]
    assert behind["reason"].startswith("waiting for a worker")
    assert behind["position"] == 2  # after the placed high one

    top = Worker(api, high_first)
    assert top.claim().status_code == 200
    assert top.heartbeat(step=1).json()["action"] == "continue", "no preemption of itself"
    assert top.checkpoint(step=10, phase_index=0, phase_step=10).status_code == 200
    assert top.finish("succeeded", step=10).status_code == 200
    # The worker is free: the low run continues by itself from its checkpoint.
    assert placed_on(api, low_second) == ["only"]
    resumed = Worker(api, low_second)
    claim = resumed.claim()
    assert claim.status_code == 200, claim.text
    assert claim.json()["resume_from"]["step"] == 4


def test_equal_priority_waits_its_turn(api: Api, tiny_workflow: WorkflowFactory) -> None:
    ping_worker(api, key="only")
    doc = tiny_workflow(phases=1, steps=10)
    first = submit(api, {"workflow": doc, "name": "a"}).json()["attempts"][0]["id"]
    runner = Worker(api, first)
    assert runner.claim().status_code == 200
    second = submit(api, {"workflow": doc, "name": "b"}).json()
    assert runner.heartbeat(step=2).json()["action"] == "continue"
    assert get_run(api, second["id"])["waiting_reason"].startswith("waiting for a worker")
    # Raising its priority (PATCH) makes it preempt.
    patched = api.client.patch(f"/runs/{second['id']}", json={"priority": 3}, headers=api.admin)
    assert patched.status_code == 200 and patched.json()["priority"] == 3
    assert runner.heartbeat(step=3).json()["action"] == "pause"


def test_an_owners_quota_holds_and_its_waiting_run_says_so(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    issued = api.client.post(
        "/tokens", json={"name": "alice", "role": "user", "max_devices": 1}, headers=api.admin
    )
    assert issued.status_code == 201, issued.text
    alice = {"Authorization": f"Bearer {issued.json()['secret']}"}
    alice_id = issued.json()["token"]["id"]
    assert issued.json()["token"]["max_devices"] == 1
    ping_worker(api, key="w1", pid=1)
    ping_worker(api, key="w2", pid=2)
    doc = tiny_workflow(phases=1, steps=10)
    one = submit(api, {"workflow": doc, "name": "one"}, **alice).json()
    two = submit(api, {"workflow": doc, "name": "two"}, **alice).json()
    assert len(placed_on(api, one["attempts"][0]["id"])) == 1
    assert placed_on(api, two["attempts"][0]["id"]) == [], "a worker is free, the quota is not"
    waiting = get_run(api, two["id"])
    assert waiting["waiting_reason"] == (
        f"quota: owner {alice_id} uses 1 of 1 device and this attempt needs 1"
    )
    assert not waiting["waiting_for_worker"]
    # Alice sees her own queue.
    assert [q["attempt_id"] for q in queue(api, alice)] == [
        one["attempts"][0]["id"],
        two["attempts"][0]["id"],
    ]
    # Raising the cap places it at once.
    raised = api.client.patch(f"/tokens/{alice_id}", json={"max_devices": 2}, headers=api.admin)
    assert raised.status_code == 200 and raised.json()["max_devices"] == 2
    place(api)
    assert len(placed_on(api, two["attempts"][0]["id"])) == 1
    refused = api.client.patch("/tokens/nope", json={"max_devices": 2}, headers=api.admin)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "token_not_found"


def test_an_attempt_whose_worker_dies_before_claiming_is_placed_again(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    ping_worker(api, key="doomed", pid=1)
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    attempt_id = run["attempts"][0]["id"]
    assert placed_on(api, attempt_id) == ["doomed"]
    with api.sessions() as session:  # silent for longer than a lease
        session.execute(
            update(WorkerRow)
            .where(WorkerRow.key == "doomed")
            .values(last_seen_at=utcnow() - timedelta(seconds=api.settings.lease_seconds + 1))
        )
        session.commit()
    # The pass the fresh worker's ping runs takes the placement back from the silent worker
    # (every pass does, not only the reaper's) and places it on the fresh one.
    ping_worker(api, key="fresh", pid=2)
    assert placed_on(api, attempt_id) == ["fresh"]
    assert (
        redispatch_unclaimed(
            session_factory=api.sessions,
            now=utcnow(),
            after=300.0,
            lease_seconds=api.settings.lease_seconds,
        )
        == []
    )
    assert get_run(api, run["id"])["attempts"][0]["redispatches"] == 1
    workers = api.client.get("/workers", headers=api.admin).json()["workers"]
    (fresh,) = [w for w in workers if w["key"] == "fresh"]
    assert fresh["assignment"]["attempt_id"] == attempt_id
    assert fresh["assignment"]["claimed"] is False


def test_the_cli_shows_the_queue_priorities_and_assignments(
    api: Api, tiny_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_resource_queues import cli_on

    from cli.common import console

    trainctl = cli_on(api, monkeypatch)
    monkeypatch.setattr(console, "width", 250)  # one line per row
    ping_worker(api, key="only")
    doc = tiny_workflow(phases=1, steps=10)
    first = submit(api, {"workflow": doc, "name": "first"}).json()
    second = submit(api, {"workflow": doc, "name": "second"}).json()
    shown = trainctl("queue")
    assert "placed" in shown and "waiting for a worker with 1 device to free up" in shown
    assert "2 queued attempt(s)" in shown
    assert f"run {second['id']}: priority 4, queue position 2" in trainctl(
        "runs", "priority", second["id"], "4"
    )
    listed = trainctl("runs", "list")
    assert "prio" in listed and "#2" in listed
    workers = trainctl("workers")
    assert f"{first['id']} ({first['attempts'][0]['id']}), placed, priority 0" in workers
