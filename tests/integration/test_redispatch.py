"""No run waits forever for a message the broker lost: an attempt still queued
TRAINCTL_REDISPATCH_SECONDS after its message went out, while a live worker that could take it
runs nothing, is sent again, and the re-sends are counted on the attempt and shown. On real
Postgres and Redis; the last test with `trainctl serve` and a real worker process."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import redis
from exact import workflow
from procs import Stack, processes, run_cli, wait_until
from sqlalchemy import select
from test_api import Worker, message_args, queued_messages, submit

from contracts.dispatch import devices_queue
from service.models import OutboxMessage, utcnow
from service.workers.dispatch import redispatch_unclaimed

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration

AFTER = 300.0


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    # Each test drives the pass itself, at a `now` of its choosing.
    return make_api(make_settings(reaper_interval_seconds=3600))


def ping(api: Api, *, pid: int = 31337, devices: int = 1) -> None:
    """A live worker of the service's queue (gpu-1, `pid`: the one test_api.Worker claims as)
    that owns `devices`."""
    body = {
        "hostname": "gpu-1",
        "pid": pid,
        "version": "0.1.0",
        "queue": api.settings.queue,
        "devices": devices,
    }
    response = api.client.post("/internal/workers/ping", json=body, headers=api.worker)
    assert response.status_code == 200, response.text


def age_messages(api: Api, seconds: float) -> None:
    """As if every message sent so far had gone out `seconds` earlier."""
    with api.sessions() as session:
        sent = select(OutboxMessage).where(OutboxMessage.sent_at.is_not(None))
        for row in session.scalars(sent):
            assert row.sent_at is not None
            row.sent_at -= timedelta(seconds=seconds)
        session.commit()


def redispatch(api: Api) -> list[str]:
    """One redispatch pass now, then the outbox sent as after the reaper's pass."""
    sent = redispatch_unclaimed(
        session_factory=api.sessions,
        now=utcnow(),
        after=AFTER,
        lease_seconds=api.settings.lease_seconds,
        queue=api.settings.queue,
    )
    api.client.app.state.pump.dispatch()  # type: ignore[attr-defined]
    return sent


def outbox_rows(api: Api, attempt_id: str) -> int:
    with api.sessions() as session:
        rows = session.scalars(select(OutboxMessage).where(OutboxMessage.attempt_id == attempt_id))
        return len(rows.all())


def queued_attempt_ids(api: Api, queue: str | None = None) -> list[str]:
    if queue is None:
        return [message_args(m)[0] for m in queued_messages(api.settings)]
    client = redis.Redis.from_url(api.settings.broker_url)
    try:
        return [message_args(json.loads(raw))[0] for raw in client.lrange(queue, 0, -1)]
    finally:
        client.close()


def test_an_attempt_left_unclaimed_past_the_interval_is_sent_again_and_a_claimed_one_is_not(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow(phases=1)
    left = submit(api, {"workflow": doc, "name": "left"}).json()["attempts"][0]["id"]
    taken = submit(api, {"workflow": doc, "name": "taken"}).json()["attempts"][0]["id"]
    assert Worker(api, taken).claim(pid=4242).status_code == 200
    ping(api)  # an idle worker, heard from just now: it would have taken `left`

    assert redispatch(api) == [], "its message went out just now"
    age_messages(api, AFTER - 5)
    assert redispatch(api) == []
    age_messages(api, 10)
    assert redispatch(api) == [left]
    assert (outbox_rows(api, left), outbox_rows(api, taken)) == (2, 1)
    # The original message and the new one (the first claim wins, the other is dropped).
    assert queued_attempt_ids(api) == [left, taken, left]
    assert redispatch(api) == [], "counted once: its new message went out just now"
    runs = api.client.get("/runs", headers=api.admin).json()["runs"]
    assert {r["name"]: r["attempts"][0]["redispatches"] for r in runs} == {"left": 1, "taken": 0}

    assert Worker(api, left).claim().status_code == 200
    age_messages(api, AFTER + 1)
    assert redispatch(api) == [], "claimed: nothing to send"


def test_nothing_is_sent_again_while_no_free_worker_could_take_it(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow(phases=1)
    busy = submit(api, {"workflow": doc, "name": "busy"}).json()["attempts"][0]["id"]
    waiting = submit(api, {"workflow": doc, "name": "waiting"}).json()["attempts"][0]["id"]
    age_messages(api, AFTER + 1)
    assert redispatch(api) == [], "no worker is live: copies would only pile up"

    # The one live worker runs another attempt: the message waits its turn in the queue.
    ping(api, pid=4242)
    runner = Worker(api, busy)
    assert runner.claim(pid=4242).status_code == 200
    assert redispatch(api) == []

    # Two devices wanted, one owned by the worker that is free now.
    wide = tiny_workflow(phases=1, name="wide")
    wide["phases"][0].update(grad_accum=2, resources={"devices": 2})
    wide_attempt = submit(api, {"workflow": wide}).json()["attempts"][0]["id"]
    age_messages(api, AFTER + 1)
    assert runner.finish("failed", step=0, cause="data", message="bad file").status_code == 200
    assert redispatch(api) == [waiting]
    ping(api, pid=4343, devices=2)
    assert redispatch(api) == [wide_attempt]
    assert queued_attempt_ids(api, devices_queue(api.settings.queue, 2)) == [
        wide_attempt,
        wide_attempt,
    ]


def test_a_run_whose_message_the_broker_lost_is_claimed_after_the_redispatch_interval(
    tmp_path: Path, postgres_url: str
) -> None:
    with processes() as procs:
        stack = Stack(
            tmp_path,
            postgres_url,
            procs,
            TRAINCTL_REDISPATCH_SECONDS="3",
            TRAINCTL_REAPER_INTERVAL_SECONDS="0.5",
        )
        queue = stack.env["TRAINCTL_QUEUE"]
        broker = redis.Redis.from_url(stack.env["TRAINCTL_BROKER_URL"])
        with stack.api() as api:
            run = api.post("/runs", json={"workflow": workflow("continued_pretrain", steps=4)})
            assert run.status_code == 201, run.text
            run_id = run.json()["id"]
            # The broker loses the message (Redis restarted without persistence).
            wait_until(lambda: broker.llen(queue) == 1, timeout=30, what="the run's message")
            broker.delete(queue)
            stack.worker()

            def claimed() -> dict[str, Any] | None:
                state: dict[str, Any] = api.get(f"/runs/{run_id}").json()
                return state if state["attempts"][0]["status"] != "queued" else None

            state = wait_until(claimed, timeout=180, what="a worker to claim the run")
            attempt = state["attempts"][0]
            assert attempt["worker_hostname"] is not None
            assert attempt["redispatches"] >= 1
            shown = run_cli(
                ["runs", "show", run_id],
                env={**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin},
            )
            # Words, not lines: the console wraps at its width.
            assert f"sent again {attempt['redispatches']}x" in " ".join(shown.split())
            metrics = httpx.get(f"{stack.url}/metrics").text
            assert "trainctl_attempt_redispatches_total" in metrics
        broker.close()
