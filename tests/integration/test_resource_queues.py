"""Resource queues, the service's side, on real Postgres and Redis: every attempt records the
devices it runs on (the workflow's for its phase, or the count the run was resumed with), its
claim says so, it is placed on a worker that owns as many (its own queue), a resume may change
the count for the rest of the run (checked against the phases' grad_accum, never a signature
mismatch), workers' pings say what they own, and a run whose attempt no live worker can take
says why."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import redis
from sqlalchemy import select
from test_api import Worker, assert_error, current_attempt, get_run, message_args, submit

from cli.runs import waiting_text
from cli.watch import _fields, waiting_reason
from cli.workers import devices_text
from contracts.dispatch import worker_queue
from service.models import Attempt

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

    from service.settings import ServiceSettings

pytestmark = pytest.mark.integration


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory, redis_url: str) -> Iterator[Api]:
    made = make_api(make_settings())
    yield made
    # make_settings deletes the base queue's keys; the device queues' are this test's.
    client = redis.Redis.from_url(redis_url)
    try:
        queue = made.settings.queue
        keys = [*client.scan_iter(match=f"{queue}.devices-*")]
        keys += [*client.scan_iter(match=f"_kombu.binding*.{queue}.devices-*")]
        keys += [*client.scan_iter(match=f"{queue}.worker.*")]
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def two_device_workflow(tiny_workflow: WorkflowFactory) -> dict[str, Any]:
    """Phase 0 on 2 devices (grad_accum 4), phase 1 on the workflow's default of 1
    (grad_accum 2)."""
    doc = tiny_workflow(phases=2, steps=10)
    doc["phases"][0].update(grad_accum=4, resources={"devices": 2})
    doc["phases"][1].update(grad_accum=2)
    return doc


def messages(settings: ServiceSettings, devices: int) -> list[str]:
    """The attempt ids of the run_phase messages waiting in Redis on the own queue of the
    worker `fleet` made with `devices` devices (kombu keeps a queue as a Redis list of its
    name, pushing on the left), oldest first. The service places an attempt on the smallest
    free worker big enough for it (service.workers.scheduler)."""
    return messages_on(settings, f"d{devices}")


def messages_on(settings: ServiceSettings, key: str) -> list[str]:
    """The attempt ids of the run_phase messages waiting on worker `key`'s own queue."""
    client = redis.Redis.from_url(settings.broker_url)
    try:
        raw = client.lrange(worker_queue(settings.queue, key), 0, -1)
    finally:
        client.close()
    return [message_args(json.loads(m))[0] for m in reversed(raw)]


def fleet(api: Api) -> None:
    """Live workers `d1`, `d2` and `d4` owning 1, 2 and 4 devices."""
    for n in (1, 2, 4):
        ping(api, hostname="gpu-d", pid=n, devices=n, worker=f"d{n}")


def resume(api: Api, run_id: str, body: dict[str, Any] | None = None) -> Any:
    return api.client.post(f"/runs/{run_id}/resume", json=body or {}, headers=api.admin)


def ping(api: Api, **fields: Any) -> Any:
    body = {
        "hostname": "gpu-9",
        "pid": 4711,
        "version": "0.1.0",
        "queue": api.settings.queue,
        **fields,
    }
    response = api.client.post("/internal/workers/ping", json=body, headers=api.worker)
    assert response.status_code == 200, response.text
    return response


def fail(worker: Worker, step: int) -> None:
    finished = worker.finish("failed", step=step, cause="oom", message="out of memory")
    assert finished.status_code == 200, finished.text


def finish_phase(worker: Worker, *, phase: int, end: int) -> None:
    assert worker.checkpoint(step=end, phase_index=phase, phase_step=10).status_code == 200
    assert worker.finish("succeeded", step=end).status_code == 200


# --- 2 and 3: attempts record their devices; messages go to their queue -------------------


def test_each_attempt_runs_on_its_phases_devices_and_is_sent_to_that_queue(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    fleet(api)
    run = submit(api, {"workflow": two_device_workflow(tiny_workflow)}).json()
    first = run["attempts"][0]
    assert first["devices"] == 2
    assert run["devices"] is None, "not resumed: as the workflow asks"
    assert messages(api.settings, 2) == [first["id"]]
    assert messages(api.settings, 1) == [], "nothing on the base queue"

    worker = Worker(api, first["id"])
    claimed = worker.claim()
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["devices"] == 2
    finish_phase(worker, phase=0, end=10)

    second = current_attempt(get_run(api, run["id"]))
    assert (second["phase_index"], second["devices"]) == (1, 1)
    assert messages(api.settings, 1) == [second["id"]]
    assert messages(api.settings, 2) == [first["id"]]
    claimed = Worker(api, second["id"]).claim()
    assert claimed.json()["devices"] == 1
    with api.sessions() as session:
        stored = [a.devices for a in session.scalars(select(Attempt).order_by(Attempt.number))]
    assert stored == [2, 1]


def test_a_resume_with_devices_overrides_the_workflow_for_the_rest_of_the_run(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = two_device_workflow(tiny_workflow)
    doc["phases"][1].update(grad_accum=4)  # asks for 1 device, may run on 1, 2 or 4
    fleet(api)
    run = submit(api, {"workflow": doc}).json()
    worker = Worker(api, run["attempts"][0]["id"])
    assert worker.claim().status_code == 200
    assert worker.checkpoint(step=6, phase_index=0, phase_step=6).status_code == 200
    fail(worker, step=7)

    # Phase 0 asks for 2; resumed on 4.
    resumed = resume(api, run["id"], {"devices": 4})
    assert resumed.status_code == 200, resumed.text
    state = resumed.json()
    assert state["devices"] == 4 and state["status"] == "recovering"
    assert state["signature"] == run["signature"]
    attempt = current_attempt(state)
    assert (attempt["number"], attempt["devices"]) == (2, 4)
    assert messages(api.settings, 4) == [attempt["id"]]

    again = Worker(api, attempt["id"])
    claim = again.claim().json()
    assert claim["devices"] == 4 and claim["resume_from"]["step"] == 6
    # A preemption's new attempt (settled as the reaper settles a lost one) keeps the count.
    # The worker that handed it back on a notice is going away: it goes to another of 4.
    ping(api, hostname="gpu-e", pid=4, devices=4, worker="d4b")
    assert again.finish("preempted", step=6).status_code == 200
    recovery = current_attempt(get_run(api, run["id"]))
    assert (recovery["number"], recovery["devices"]) == (3, 4)
    assert messages(api.settings, 4) == [attempt["id"]]
    assert messages_on(api.settings, "d4b") == [recovery["id"]]

    # So does the next phase's, which the workflow puts on 1.
    third = Worker(api, recovery["id"])
    assert third.claim().json()["devices"] == 4
    finish_phase(third, phase=0, end=10)
    next_phase = current_attempt(get_run(api, run["id"]))
    assert (next_phase["number"], next_phase["phase_index"]) == (4, 1)
    assert next_phase["devices"] == 4
    assert messages_on(api.settings, "d4b")[-1] == next_phase["id"]
    assert messages(api.settings, 1) == []

    # A resume without devices keeps the run's count; one with devices 1 goes back to the
    # base queue.
    fourth = Worker(api, next_phase["id"])
    assert fourth.claim().json()["devices"] == 4
    fail(fourth, step=12)
    kept = resume(api, run["id"])
    assert kept.status_code == 200, kept.text
    assert kept.json()["devices"] == 4
    assert current_attempt(kept.json())["devices"] == 4
    fifth = Worker(api, current_attempt(kept.json())["id"])
    assert fifth.claim().status_code == 200
    fail(fifth, step=12)
    single = resume(api, run["id"], {"devices": 1})
    assert single.status_code == 200, single.text
    last = current_attempt(single.json())
    assert last["devices"] == 1 and messages(api.settings, 1) == [last["id"]]
    assert Worker(api, last["id"]).claim().json()["devices"] == 1

    with api.sessions() as session:
        stored = [a.devices for a in session.scalars(select(Attempt).order_by(Attempt.number))]
    assert stored == [2, 4, 4, 4, 4, 1]
    audit = api.client.get(
        "/audit", params={"action": "run.resume", "target_id": run["id"]}, headers=api.admin
    ).json()["events"]
    assert [e["details"] for e in audit] == [{"devices": 1}, None, {"devices": 4}]


# --- 4: the count is checked against the phases still to run -------------------------------


def test_a_device_count_that_does_not_divide_a_remaining_phase_is_refused_naming_it(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": two_device_workflow(tiny_workflow)}).json()
    worker = Worker(api, run["attempts"][0]["id"])
    assert worker.claim().status_code == 200
    fail(worker, step=3)

    error = assert_error(resume(api, run["id"], {"devices": 3}), 422, "invalid_devices")
    assert [p["path"] for p in error["details"]] == ["phases[0].grad_accum", "phases[1].grad_accum"]
    assert "multiple of 3" in error["details"][0]["message"]
    assert "phases[0].grad_accum" in error["message"]
    # Phase 0 (grad_accum 4) could go on on 4; phase 1 (grad_accum 2) could not.
    error = assert_error(resume(api, run["id"], {"devices": 4}), 422, "invalid_devices")
    assert [p["path"] for p in error["details"]] == ["phases[1].grad_accum"]
    assert error["details"][0]["grad_accum"] == 2 and error["details"][0]["devices"] == 4
    for bad in (0, 65, "two"):
        assert_error(resume(api, run["id"], {"devices": bad}), 422, "invalid_request")

    state = get_run(api, run["id"])
    assert state["status"] == "failed" and state["devices"] is None
    assert len(state["attempts"]) == 1, "a refused resume queues nothing"


def test_only_the_phases_still_to_run_are_checked(api: Api, tiny_workflow: WorkflowFactory) -> None:
    doc = tiny_workflow(phases=2, steps=10)
    doc["phases"][0].update(grad_accum=3)  # runs on 1 or 3, not 2
    doc["phases"][1].update(grad_accum=2)
    run = submit(api, {"workflow": doc}).json()
    worker = Worker(api, run["attempts"][0]["id"])
    assert worker.claim().status_code == 200
    finish_phase(worker, phase=0, end=10)
    second = Worker(api, current_attempt(get_run(api, run["id"]))["id"])
    assert second.claim().status_code == 200
    fail(second, step=12)
    resumed = resume(api, run["id"], {"devices": 2})
    assert resumed.status_code == 200, resumed.text
    assert current_attempt(resumed.json())["devices"] == 2


def test_resources_are_not_signed_so_a_resume_on_other_devices_is_no_mismatch(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = two_device_workflow(tiny_workflow)
    run = submit(api, {"workflow": doc}).json()
    worker = Worker(api, run["attempts"][0]["id"])
    assert worker.claim().status_code == 200
    fail(worker, step=2)
    # The same workflow asking for other devices: the same run, never 409 signature_mismatch.
    moved = copy.deepcopy(doc)
    moved["resources"] = {"devices": 2}
    del moved["phases"][0]["resources"]
    resumed = resume(api, run["id"], {"workflow": moved, "devices": 2})
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["signature"] == run["signature"]
    # A signed field still is one.
    changed = copy.deepcopy(doc)
    changed["phases"][0]["steps"] = 11
    attempt = Worker(api, current_attempt(resumed.json())["id"])
    assert attempt.claim().status_code == 200
    fail(attempt, step=2)
    assert_error(resume(api, run["id"], {"workflow": changed}), 409, "signature_mismatch")


# --- 5: what workers own -------------------------------------------------------------------


def test_a_workers_ping_says_what_it_owns_and_a_claim_keeps_it(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    # Heard from by its claim first: no devices said yet.
    worker = Worker(api, run["attempts"][0]["id"])
    assert worker.claim(pid=4711).status_code == 200
    (listed,) = api.client.get("/workers", headers=api.admin).json()["workers"]
    assert (listed["devices"], listed["device_kind"]) == (None, None)
    assert devices_text(listed) == "-"

    ping(api, hostname="gpu-1", devices=8, device_kind="cuda")
    assert worker.heartbeat(step=1).status_code == 200  # a heartbeat says nothing of devices
    (listed,) = api.client.get("/workers", headers=api.admin).json()["workers"]
    assert (listed["devices"], listed["device_kind"]) == (8, "cuda")
    assert listed["attempt_id"] == worker.attempt_id
    assert devices_text(listed) == "8 cuda"

    # A ping without them (an older worker) says one CPU device: the contract's defaults.
    ping(api, hostname="gpu-1")
    (listed,) = api.client.get("/workers", headers=api.admin).json()["workers"]
    assert (listed["devices"], listed["device_kind"]) == (1, "cpu")
    for field, value in (("devices", 0), ("devices", 65), ("device_kind", "tpu")):
        body = {"hostname": "h", "pid": 1, "version": "v", "queue": "q", field: value}
        refused = api.client.post("/internal/workers/ping", json=body, headers=api.worker)
        assert_error(refused, 422, "invalid_request")


# --- 6: a run says why it waits --------------------------------------------------------------


def test_a_run_waits_while_no_live_worker_owns_the_devices_its_attempt_needs(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": two_device_workflow(tiny_workflow)}).json()
    assert run["waiting_for_worker"] is True
    assert run["waiting_reason"].startswith("no live worker has been seen")
    assert api.settings.queue in run["waiting_reason"]

    ping(api, devices=1, device_kind="cuda", worker="gpu-9-one")
    state = get_run(api, run["id"])
    assert state["waiting_for_worker"] is True
    assert state["waiting_reason"] == (
        "attempt 1 needs 2 devices; the most a live worker has is 1 (cuda)"
    )
    listed = api.client.get("/runs", headers=api.admin).json()["runs"][0]
    assert listed["waiting_reason"] == state["waiting_reason"]
    assert waiting_text(state).startswith(f"waiting for a worker: {state['waiting_reason']}; ")
    assert (
        _fields({**state, "tokens_per_s": None, "waiting_reason": waiting_reason(state)})["status"]
        == f"queued (waiting for a worker: {state['waiting_reason']})"
    )

    # A worker heard from only by its claims counts as one device.
    other = submit(api, {"workflow": tiny_workflow(phases=1, name="one")}).json()
    assert Worker(api, other["attempts"][0]["id"]).claim(pid=99).status_code == 200
    assert get_run(api, run["id"])["waiting_for_worker"] is True

    # A free worker that owns two: the run is placed on it.
    ping(api, pid=4712, devices=2, device_kind="cuda", worker="gpu-9-two")
    state = get_run(api, run["id"])
    assert (state["waiting_for_worker"], state["waiting_reason"]) == (False, None)
    assert waiting_reason(state) is None
    assert get_run(api, other["id"])["waiting_reason"] is None, "it is running"


# --- 5, 6 and 7 in the CLI --------------------------------------------------------------------


def cli_on(api: Api, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`trainctl` (typer's runner) whose API calls go to `api` with its admin token."""
    from typer.testing import CliRunner

    from cli import main, runs, workers
    from client import Client

    def call(action: Any) -> Any:
        client = Client("http://testserver", "")
        client.http._http = api.client  # the app in this process
        api.client.headers.update(api.admin)
        return action(client)

    monkeypatch.setattr(runs, "call", call)
    monkeypatch.setattr(workers, "call", call)
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(main.app, list(args))
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split())  # unwrapped

    return run


def test_the_cli_resumes_on_devices_and_shows_why_a_run_waits_and_what_workers_own(
    api: Api, tiny_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainctl = cli_on(api, monkeypatch)
    run = submit(api, {"workflow": two_device_workflow(tiny_workflow)}).json()
    shown = trainctl("runs", "show", run["id"])
    assert "waiting for a worker: no live worker has been seen" in shown

    ping(api, devices=1, device_kind="cpu")
    shown = trainctl("runs", "show", run["id"])
    assert (
        "waiting for a worker: attempt 1 needs 2 devices; the most a live worker has is 1 (cpu)"
        in shown
    )
    assert "(2 dev)" in shown
    assert "1 cpu" in trainctl("workers")

    worker = Worker(api, run["attempts"][0]["id"])
    assert worker.claim().status_code == 200
    fail(worker, step=2)
    resumed = trainctl("runs", "resume", run["id"], "--devices", "1")
    assert "attempt 2 continues phase phase0 from the start on 1 device" in resumed
    state = get_run(api, run["id"])
    assert state["devices"] == 1 and current_attempt(state)["devices"] == 1
    assert "waiting for a worker" not in trainctl("runs", "show", run["id"])
