"""Recovery on real Postgres and Redis, with the worker protocol driven over HTTP as a worker
drives it: the reaper, restart budgets by cause, reports after a resume, pause and cancel,
what a run shows of its recoveries, and the API while the database is unreachable."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.engine import make_url
from test_api import (
    Worker,
    assert_error,
    current_attempt,
    eval_point,
    get_run,
    message_args,
    ping_worker,
    queued_messages,
    submit,
)

from contracts.reports import MAX_POINTS_PER_BATCH
from service.api.app import create_app
from service.models import Attempt, utcnow
from service.workers.reaper import Reaper, reap_expired

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    # The background reaper passes once at startup, then not again during a test: tests reap
    # by calling reap_expired with a `now` past the lease.
    return make_api(make_settings(reaper_interval_seconds=3600))


def later(api: Api) -> Any:
    """A moment after every lease granted so far has expired."""
    return utcnow() + timedelta(seconds=api.settings.lease_seconds + 1)


def reap(api: Api) -> list[str]:
    """One pass of the app's reaper (which dispatches what it queued) after the leases end."""
    reaper: Reaper = api.client.app.state.reaper  # type: ignore[attr-defined]
    return reaper.reap(later(api))


def claimed(api: Api, run_id: str, pid: int = 4242) -> Worker:
    """A worker that claimed the run's current attempt."""
    worker = Worker(api, current_attempt(get_run(api, run_id))["id"])
    response = worker.claim(pid=pid)
    assert response.status_code == 200, response.text
    return worker


def post(api: Api, run_id: str, action: str) -> Any:
    return api.client.post(f"/runs/{run_id}/{action}", headers=api.admin)


# --- the reaper ---------------------------------------------------------------------------


def test_reaper_recovers_a_lost_attempt_within_budget_then_fails_the_run_beyond_it(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    ping_worker(api)  # attempts are placed on it: their messages go to its own queue
    run = submit(api, {"workflow": tiny_workflow(phases=1), "max_preemptions": 1}).json()
    first = claimed(api, run["id"])
    first.checkpoint(step=4, phase_index=0, phase_step=4)
    first.heartbeat(step=5)

    assert reap(api) == [first.attempt_id]
    state = get_run(api, run["id"])
    assert state["status"] == "recovering"
    assert (state["preemptions"], state["restarts"]) == (1, 0)
    lost, retry = state["attempts"]
    assert (lost["status"], lost["cause"]) == ("lost", "infrastructure")
    assert "lease expired" in lost["message"]
    assert (retry["number"], retry["status"]) == (2, "queued")
    assert "lost its worker" in state["message"]
    # Committed, then sent.
    assert retry["id"] in [message_args(m)[0] for m in queued_messages(api.settings)]
    # The lost worker, should it come back, is fenced.
    assert first.heartbeat(step=6).json()["action"] == "stop"
    assert_error(first.metrics([("loss", 6, 1.0)]), 409, "superseded")

    second = claimed(api, run["id"], pid=5151)
    # The attempt's message delivered again: already claimed, the claim above won.
    assert Worker(api, second.attempt_id).claim().status_code == 409
    assert reap(api) == [second.attempt_id]
    final = get_run(api, run["id"])
    assert (final["status"], final["cause"]) == ("failed", "restarts_exhausted")
    assert "max_preemptions" in final["message"]
    assert final["preemptions"] == 2
    assert len(final["attempts"]) == 2
    # Nothing left to reap.
    assert reap(api) == []


def test_a_live_lease_is_not_reaped(api: Api, tiny_workflow: WorkflowFactory) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    worker = claimed(api, run["id"])
    assert reap_expired(session_factory=api.sessions, now=utcnow()) == []
    assert worker.heartbeat(step=1).json()["action"] == "continue"


def test_racing_reapers_create_exactly_one_new_attempt(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    claimed(api, run["id"])
    now = later(api)
    results: list[list[str]] = []
    barrier = threading.Barrier(6)

    def race() -> None:
        barrier.wait()
        results.append(reap_expired(session_factory=api.sessions, now=now))

    threads = [threading.Thread(target=race) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(len(r) for r in results) == [0] * 5 + [1]
    with api.sessions() as session:
        attempts = session.scalars(
            select(Attempt).where(Attempt.run_id == run["id"]).order_by(Attempt.number)
        ).all()
        assert [(a.number, a.status) for a in attempts] == [(1, "lost"), (2, "queued")]


def test_the_background_reaper_recovers_a_killed_worker(
    make_settings: SettingsFactory, make_api: ApiFactory, tiny_workflow: WorkflowFactory
) -> None:
    api = make_api(make_settings(lease_seconds=0.5, reaper_interval_seconds=0.2))
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    claimed(api, run["id"])
    # SIGKILLed: no report renews its lease.
    deadline = time.monotonic() + 15
    while len(get_run(api, run["id"])["attempts"]) < 2:
        assert time.monotonic() < deadline, "the reaper did not recover the lost attempt"
        time.sleep(0.1)
    state = get_run(api, run["id"])
    assert [a["status"] for a in state["attempts"]] == ["lost", "queued"]
    assert state["status"] == "recovering"


# --- budgets and causes -------------------------------------------------------------------


def test_infrastructure_errors_are_retried_while_max_restarts_lasts(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1), "max_restarts": 1}).json()
    first = claimed(api, run["id"])
    first.checkpoint(step=3, phase_index=0, phase_step=3)
    first.finish("failed", step=4, cause="infrastructure", message="NCCL timeout")
    state = get_run(api, run["id"])
    assert state["status"] == "recovering"
    assert (state["restarts"], state["preemptions"]) == (1, 0)
    assert "NCCL timeout" in state["message"]
    second = claimed(api, run["id"])
    assert Worker(api, second.attempt_id).claim().status_code == 409
    # A failure without a cause is an infrastructure failure.
    second.finish("failed", step=4)
    final = get_run(api, run["id"])
    assert (final["status"], final["cause"]) == ("failed", "restarts_exhausted")
    assert "max_restarts" in final["message"]
    assert final["restarts"] == 2
    assert len(final["attempts"]) == 2


@pytest.mark.parametrize(
    "cause", ["data", "nan", "oom", "config", "signature_mismatch", "disk_full"]
)
def test_errors_that_would_repeat_fail_the_run_at_once(
    api: Api, tiny_workflow: WorkflowFactory, cause: str
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1), "max_restarts": 5}).json()
    worker = claimed(api, run["id"])
    worker.finish("failed", step=2, cause=cause, message=f"{cause} problem")
    final = get_run(api, run["id"])
    assert (final["status"], final["cause"]) == ("failed", cause)
    assert f"{cause} problem" in final["message"]
    assert final["restarts"] == 0
    assert len(final["attempts"]) == 1


def test_a_full_disk_fails_the_run_without_a_restart_and_resume_continues_from_its_checkpoint(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """A new attempt would meet the same full disk: the run fails at once, keeping its whole
    restart budget, and continues from its latest checkpoint once resumed (space freed)."""
    ping_worker(api)  # attempts are placed on it: their messages go to its own queue
    run = submit(api, {"workflow": tiny_workflow(phases=1, steps=10), "max_restarts": 3}).json()
    first = claimed(api, run["id"])
    assert first.checkpoint(step=4, phase_index=0, phase_step=4).status_code == 200
    message = "no space left in /artifacts/runs/r/checkpoints: 0.0 MiB free, needs about 40.0 MiB"
    finished = first.finish("failed", step=6, cause="disk_full", message=message)
    assert finished.status_code == 200, finished.text

    failed = get_run(api, run["id"])
    assert (failed["status"], failed["cause"]) == ("failed", "disk_full")
    assert message in failed["message"]
    assert (failed["restarts"], failed["preemptions"]) == (0, 0)
    assert [(a["status"], a["cause"]) for a in failed["attempts"]] == [("failed", "disk_full")]
    # None queued for it: the only message is the first attempt's.
    assert [message_args(m)[0] for m in queued_messages(api.settings)] == [first.attempt_id]

    resumed = post(api, run["id"], "resume")
    assert resumed.status_code == 200, resumed.text
    assert (resumed.json()["status"], resumed.json()["cause"]) == ("recovering", None)
    second = Worker(api, current_attempt(get_run(api, run["id"]))["id"])
    answer = second.claim()
    assert answer.status_code == 200, answer.text
    claim = answer.json()
    assert claim["attempt_number"] == 2
    assert claim["resume_from"]["step"] == 4
    assert second.checkpoint(step=10, phase_index=0, phase_step=10).status_code == 200
    assert second.finish("succeeded", step=10).status_code == 200
    final = get_run(api, run["id"])
    assert (final["status"], final["restarts"]) == ("succeeded", 0)


def test_budgets_default_from_settings_and_are_shown(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    assert run["max_restarts"] == api.settings.max_restarts
    assert run["max_preemptions"] == api.settings.max_preemptions
    custom = submit(
        api, {"workflow": tiny_workflow(phases=1), "max_restarts": 0, "max_preemptions": 7}
    ).json()
    assert (custom["max_restarts"], custom["max_preemptions"]) == (0, 7)


# --- reports after a resume ---------------------------------------------------------------


def test_reports_beyond_the_resumed_step_are_removed_on_claim(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1, steps=10)}).json()
    first = claimed(api, run["id"])
    first.metrics([("loss", s, 10.0 - s) for s in range(1, 9)])
    first.evals([eval_point(0, 5.0), eval_point(5, 4.0)])
    first.checkpoint(step=4, phase_index=0, phase_step=4)
    first.finish("preempted", step=8)

    second = claimed(api, run["id"])
    assert Worker(api, second.attempt_id).claim().status_code == 409
    metrics = api.client.get(f"/runs/{run['id']}/metrics", headers=api.admin).json()
    assert metrics["loss"]["steps"] == [1, 2, 3, 4]
    history = api.client.get(f"/runs/{run['id']}/eval", headers=api.admin).json()
    assert [p["step"] for p in history["tasks"]["summarization"]["history"]] == [0]

    second.metrics([("loss", s, 1.0 / s) for s in range(5, 11)])
    second.evals([eval_point(5, 3.0), eval_point(10, 2.0)])
    assert second.checkpoint(step=10, phase_index=0, phase_step=10).status_code == 200
    assert second.finish("succeeded", step=10).status_code == 200
    metrics = api.client.get(f"/runs/{run['id']}/metrics", headers=api.admin).json()
    # Each step once: the first attempt's up to the checkpoint, the second's after it.
    assert metrics["loss"]["steps"] == list(range(1, 11))
    assert metrics["loss"]["values"][3] == 6.0
    assert metrics["loss"]["values"][4] == 0.2
    history = api.client.get(f"/runs/{run['id']}/eval", headers=api.admin).json()
    summary = history["tasks"]["summarization"]
    assert [(p["step"], p["cross_entropy"]) for p in summary["history"]] == [
        (0, 5.0),
        (5, 3.0),
        (10, 2.0),
    ]


def test_a_metrics_batch_answers_per_point_errors_and_stores_the_rest(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    worker = claimed(api, run["id"])
    points = [("loss", 1, 2.0), ("loss", 2, float("nan")), ("", 3, 1.0), ("loss", 3, 1.5)]
    # Python's json writes NaN (as a worker's would); httpx refuses to, so the body is sent as
    # bytes.
    body = {
        "fencing_token": worker.token,
        "points": [{"name": n, "step": s, "value": v} for n, s, v in points],
    }
    response = api.client.post(
        f"/internal/attempts/{worker.attempt_id}/metrics",
        content=json.dumps(body),
        headers={**api.worker, "Content-Type": "application/json"},
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["accepted"] == 2
    assert [e["index"] for e in answer["errors"]] == [1, 2]
    assert "not finite" in answer["errors"][0]["error"]
    assert "empty" in answer["errors"][1]["error"]
    metrics = api.client.get(f"/runs/{run['id']}/metrics", headers=api.admin).json()
    assert metrics == {"loss": {"steps": [1, 3], "values": [2.0, 1.5]}}


def test_batch_limits_answer_in_the_error_shape(api: Api, tiny_workflow: WorkflowFactory) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    worker = claimed(api, run["id"])
    too_many = worker.metrics([("loss", s, 1.0) for s in range(MAX_POINTS_PER_BATCH + 1)])
    error = assert_error(too_many, 422, "invalid_request")
    assert error["details"][0]["path"] == "points"
    huge = worker.metrics([("x" * 2000, s, 1.0) for s in range(600)])
    assert "1048576 bytes" in assert_error(huge, 413, "payload_too_large")["message"]
    # Without a Content-Length (chunked), the body is cut off once it passes the limit.
    chunked = api.client.post(
        f"/internal/attempts/{worker.attempt_id}/metrics",
        content=iter([b'{"fencing_token": "t", "points": [' + b" " * (1 << 20), b"]}"]),
        headers={**api.worker, "Content-Type": "application/json"},
    )
    assert_error(chunked, 413, "payload_too_large")
    # Nothing of either was stored; the worker still owns its attempt.
    assert api.client.get(f"/runs/{run['id']}/metrics", headers=api.admin).json() == {}
    assert worker.heartbeat(step=1).json()["action"] == "continue"


# --- pause and cancel ---------------------------------------------------------------------


def test_pause_reaches_the_worker_by_heartbeat_and_resume_continues(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    worker = claimed(api, run["id"])
    worker.checkpoint(step=3, phase_index=0, phase_step=3)

    response = post(api, run["id"], "pause")
    assert response.status_code == 200, response.text
    pausing = response.json()
    assert pausing["status"] == "running"
    assert pausing["pause_requested_at"] is not None
    assert post(api, run["id"], "pause").status_code == 200
    assert worker.heartbeat(step=4).json()["action"] == "pause"
    worker.checkpoint(step=4, phase_index=0, phase_step=4)
    assert worker.finish("paused", step=4).status_code == 200

    paused = get_run(api, run["id"])
    assert paused["status"] == "paused"
    assert paused["attempts"][0]["status"] == "paused"
    assert (paused["restarts"], paused["preemptions"]) == (0, 0)
    assert len(paused["attempts"]) == 1
    assert worker.heartbeat(step=4).json()["action"] == "stop"
    assert post(api, run["id"], "pause").json()["status"] == "paused"

    resumed = api.client.post(f"/runs/{run['id']}/resume", headers=api.admin)
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["status"] == "recovering"
    assert resumed.json()["pause_requested_at"] is None
    again = Worker(api, current_attempt(resumed.json())["id"])
    claim = again.claim().json()
    assert claim["resume_from"]["step"] == 4
    assert again.heartbeat(step=5).json()["action"] == "continue"
    assert again.checkpoint(step=10, phase_index=0, phase_step=10).status_code == 200
    assert again.finish("succeeded", step=10).status_code == 200
    assert get_run(api, run["id"])["status"] == "succeeded"


def test_pausing_a_queued_run_supersedes_its_attempt_at_once(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    paused = post(api, run["id"], "pause").json()
    assert paused["status"] == "paused"
    assert paused["attempts"][0]["status"] == "superseded"
    # The message already on the queue is dropped by the worker that gets it.
    assert_error(Worker(api, run["attempts"][0]["id"]).claim(), 409, "superseded")
    resumed = api.client.post(f"/runs/{run['id']}/resume", headers=api.admin).json()
    assert [a["status"] for a in resumed["attempts"]] == ["superseded", "queued"]


def test_cancel_stops_the_worker_and_refuses_its_reports(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    worker = claimed(api, run["id"])
    response = post(api, run["id"], "cancel")
    assert response.status_code == 200, response.text
    cancelled = response.json()
    assert cancelled["status"] == "cancelled"
    assert cancelled["finished_at"] is not None
    assert cancelled["attempts"][0]["status"] == "superseded"
    assert worker.heartbeat(step=2).json()["action"] == "stop"
    assert_error(worker.metrics([("loss", 2, 1.0)]), 409, "superseded")
    assert_error(worker.checkpoint(step=2, phase_index=0, phase_step=2), 409, "superseded")
    assert_error(worker.finish("succeeded", step=10), 409, "superseded")
    assert post(api, run["id"], "cancel").json()["status"] == "cancelled"
    assert_error(post(api, run["id"], "pause"), 409, "run_finished")
    assert reap(api) == []
    assert get_run(api, run["id"])["status"] == "cancelled"


def test_pause_and_cancel_of_a_finished_run_are_refused(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    worker = claimed(api, run["id"])
    assert worker.checkpoint(step=10, phase_index=0, phase_step=10).status_code == 200
    assert worker.finish("succeeded", step=10).status_code == 200
    for action in ("pause", "cancel"):
        error = assert_error(post(api, run["id"], action), 409, "run_finished")
        assert error["details"] == {"run_id": run["id"], "status": "succeeded"}
    assert_error(post(api, "run_missing", "cancel"), 404, "run_not_found")


# --- visibility ---------------------------------------------------------------------------


def test_a_run_shows_its_attempts_budgets_and_time_lost_to_recovery(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    first = claimed(api, run["id"], pid=111)
    first.finish("preempted", step=2)
    time.sleep(0.2)
    second = claimed(api, run["id"], pid=222)
    second.finish("failed", step=3, cause="infrastructure", message="disk full")
    claimed(api, run["id"], pid=333)

    state = get_run(api, run["id"])
    assert (state["preemptions"], state["restarts"]) == (1, 1)
    assert 0.2 <= state["recovery_seconds"] < 30
    one, two, three = state["attempts"]
    assert (one["number"], one["status"], one["worker_hostname"], one["worker_pid"]) == (
        1,
        "preempted",
        "gpu-1",
        111,
    )
    assert one["started_at"] == one["claimed_at"] is not None
    assert one["finished_at"] is not None
    assert (two["status"], two["cause"], two["message"]) == (
        "failed",
        "infrastructure",
        "disk full",
    )
    assert (three["status"], three["finished_at"], three["worker_pid"]) == ("running", None, 333)


# --- the database unreachable -------------------------------------------------------------


def test_requests_answer_503_while_the_database_is_unreachable(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(database_url="postgresql+psycopg://postgres@127.0.0.1:1/none")
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200
        assert_error(client.get("/readyz"), 503, "database_unavailable")
        headers = {"Authorization": "Bearer whatever"}
        error = assert_error(client.get("/runs", headers=headers), 503, "database_unavailable")
        assert "TRAINCTL_DATABASE_URL" in error["message"]
        report = client.post(
            "/internal/attempts/att_x/heartbeat",
            json={"fencing_token": "secret", "step": 1},
            headers=headers,
        )
        assert_error(report, 503, "database_unavailable")


def test_requests_succeed_again_after_the_database_dropped_every_connection(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    assert get_run(api, run["id"])["status"] == "queued"
    # What a database restart does to the pool: every server-side connection ends.
    url = make_url(api.settings.database_url)
    admin = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        ended = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (url.database,),
        ).fetchall()
    assert ended
    assert get_run(api, run["id"])["status"] == "queued"
    assert api.client.get("/readyz").json() == {"status": "ready"}
