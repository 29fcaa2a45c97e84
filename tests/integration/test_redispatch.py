"""No run waits forever for a message the broker lost or a worker that died after the service
placed an attempt on it: an attempt placed but still unclaimed TRAINCTL_REDISPATCH_SECONDS
later, or whose worker is no longer live, is taken back and placed again (with a new message),
and the re-sends are counted on the attempt and shown. On real Postgres and Redis; the last
test with `trainctl serve` and a real worker process."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from exact import workflow
from procs import Stack, processes, run_cli, wait_until
from sqlalchemy import select
from test_api import Worker, message_args, ping_worker, queued_messages, submit

from service.models import AttemptMember, utcnow
from service.workers.dispatch import redispatch_unclaimed

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration

AFTER = 300.0


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    # Each test drives the pass itself, at a `now` of its choosing.
    return make_api(make_settings(reaper_interval_seconds=3600, outbox_interval_seconds=3600))


def age_placements(api: Api, seconds: float) -> None:
    """As if every attempt placed so far had been placed `seconds` earlier."""
    with api.sessions() as session:
        for row in session.scalars(select(AttemptMember)):
            row.placed_at -= timedelta(seconds=seconds)
        session.commit()


def redispatch(api: Api) -> list[str]:
    """One redispatch pass now, then a placement pass and the outbox, as after the reaper's."""
    sent = redispatch_unclaimed(
        session_factory=api.sessions,
        now=utcnow(),
        after=AFTER,
        lease_seconds=api.settings.lease_seconds,
    )
    api.client.app.state.pump.dispatch()  # type: ignore[attr-defined]
    return sent


def placed(api: Api, attempt_id: str) -> list[str]:
    with api.sessions() as session:
        rows = session.scalars(select(AttemptMember).where(AttemptMember.attempt_id == attempt_id))
        return [row.worker_id for row in rows]


def test_an_attempt_left_unclaimed_past_the_interval_is_placed_again_and_a_claimed_one_is_not(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    ping_worker(api, key="a", pid=1)
    ping_worker(api, key="b", pid=2)
    doc = tiny_workflow(phases=1)
    left = submit(api, {"workflow": doc, "name": "left"}).json()["attempts"][0]["id"]
    taken = submit(api, {"workflow": doc, "name": "taken"}).json()["attempts"][0]["id"]
    assert (placed(api, left), placed(api, taken)) == (["a"], ["b"])
    assert Worker(api, taken).claim(pid=2).status_code == 200

    assert redispatch(api) == [], "placed just now"
    age_placements(api, AFTER - 5)
    assert redispatch(api) == []
    age_placements(api, 10)
    assert redispatch(api) == [left], "claimed: `taken` stays"
    assert placed(api, left) == ["a"], "placed again on the free worker"
    # The original message and the new one (the first claim wins, the other is dropped).
    assert sorted(message_args(m)[0] for m in queued_messages(api.settings)) == sorted(
        [left, left, taken]
    )
    assert redispatch(api) == [], "counted once: placed again just now"
    runs = api.client.get("/runs", headers=api.admin).json()["runs"]
    assert {r["name"]: r["attempts"][0]["redispatches"] for r in runs} == {"left": 1, "taken": 0}

    assert Worker(api, left).claim(pid=1).status_code == 200
    age_placements(api, AFTER + 1)
    assert redispatch(api) == [], "claimed: nothing to send"


def test_nothing_is_placed_while_no_live_worker_could_take_it(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow(phases=1)
    waiting = submit(api, {"workflow": doc, "name": "waiting"}).json()["attempts"][0]["id"]
    assert redispatch(api) == []
    assert placed(api, waiting) == [] and queued_messages(api.settings) == []
    # Two devices wanted, one owned by the only worker: it stays unplaced.
    wide = tiny_workflow(phases=1, name="wide")
    wide["phases"][0].update(grad_accum=2, resources={"devices": 2})
    wide_attempt = submit(api, {"workflow": wide}).json()["attempts"][0]["id"]
    ping_worker(api, key="one", pid=1)
    assert placed(api, waiting) == ["one"]
    assert placed(api, wide_attempt) == []
    ping_worker(api, key="two", pid=2, devices=2)
    assert placed(api, wide_attempt) == ["two"]


def test_a_run_whose_worker_never_claims_is_claimed_by_another_after_the_redispatch_interval(
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
        with stack.api() as api:
            # A worker that pings once and never takes its message (its message lost, or the
            # worker wedged), owning 2 devices: the only one live, the run is placed on it.
            ghost = {
                "hostname": "ghost",
                "pid": 1,
                "version": "0.1.0",
                "queue": stack.env["TRAINCTL_QUEUE"],
                "devices": 2,
                "worker": "ghost",
            }
            headers = {"Authorization": f"Bearer {stack.worker_token}"}
            pinged = httpx.post(f"{stack.url}/internal/workers/ping", json=ghost, headers=headers)
            assert pinged.status_code == 200, pinged.text
            run = api.post("/runs", json={"workflow": workflow("continued_pretrain", steps=4)})
            assert run.status_code == 201, run.text
            run_id = run.json()["id"]
            # A real worker (one device: the smallest free one when it is placed again).
            stack.worker()

            def claimed() -> dict[str, Any] | None:
                state: dict[str, Any] = api.get(f"/runs/{run_id}").json()
                return state if state["attempts"][0]["status"] != "queued" else None

            state = wait_until(claimed, timeout=180, what="a worker to claim the run")
            attempt = state["attempts"][0]
            assert attempt["worker_hostname"] not in (None, "ghost")
            assert attempt["redispatches"] >= 1
            shown = run_cli(
                ["runs", "show", run_id],
                env={**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin},
            )
            # Words, not lines: the console wraps at its width.
            assert f"sent again {attempt['redispatches']}x" in " ".join(shown.split())
            metrics = httpx.get(f"{stack.url}/metrics").text
            assert "trainctl_attempt_redispatches_total" in metrics
