"""A job whose worker keeps dying on it (an out-of-memory kill, SIGKILL) is sent again after
each TRAINCTL_JOB_TIMEOUT_SECONDS only while its delivery budget lasts, then fails saying so.
On real Postgres and Redis, the worker's side driven over HTTP as a worker drives it: a worker
that dies has started the job and never posts its outcome."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from test_api import assert_error, message_args, queued_messages

from service.models import utcnow
from service.workers.reaper import Reaper

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory

pytestmark = pytest.mark.integration

TIMEOUT = 600.0


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory, tmp_path: Path) -> Api:
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokenizer.json").write_text("{}")
    (data / "train.jsonl").write_text('{"source": "a b", "target": "c"}\n')
    # The background reaper passes once at startup (granting grace), then not again: the test
    # drives its passes at a `now` past the job timeout.
    settings = make_settings(
        reaper_interval_seconds=3600, job_timeout_seconds=TIMEOUT, job_max_deliveries=2
    )
    return make_api(settings)


def reaper_past_the_timeout(api: Api) -> list[str]:
    """One pass of the app's reaper (which then sends what it queued) after every job started
    so far has run past the timeout."""
    reaper: Reaper = api.client.app.state.reaper  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while reaper.graces == 0:  # the startup pass grants grace and judges nothing
        assert time.monotonic() < deadline, "the reaper's startup pass never ran"
        time.sleep(0.02)
    return reaper.reap(utcnow() + timedelta(seconds=TIMEOUT + 1))


def job(api: Api, job_id: str) -> dict[str, Any]:
    answer = api.client.get(f"/datasets/inspections/{job_id}", headers=api.admin)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def worker_starts(api: Api, job_id: str) -> Any:
    return api.client.post(f"/internal/jobs/{job_id}/start", headers=api.worker)


def messages_of(api: Api, job_id: str) -> int:
    return sum(message_args(m)[0] == job_id for m in queued_messages(api.settings))


def test_a_job_whose_worker_dies_past_its_delivery_budget_fails_saying_so(api: Api) -> None:
    body = {
        "path": "train.jsonl",
        "tokenizer": "tokenizer.json",
        "objective": "summarization",
        "sequence_length": 64,
    }
    accepted = api.client.post("/datasets/inspect", json=body, headers=api.admin)
    assert accepted.status_code == 202, accepted.text
    job_id = accepted.json()["id"]
    assert (job(api, job_id)["deliveries"], messages_of(api, job_id)) == (1, 1)

    # Its worker starts it and is killed: the job is sent again once the timeout has passed.
    assert worker_starts(api, job_id).status_code == 200
    reaper_past_the_timeout(api)
    again = job(api, job_id)
    assert (again["status"], again["deliveries"], messages_of(api, job_id)) == ("queued", 2, 2)

    # The next worker dies on it too: the budget of two deliveries is spent.
    assert worker_starts(api, job_id).status_code == 200
    reaper_past_the_timeout(api)
    failed = job(api, job_id)
    assert (failed["status"], failed["deliveries"], failed["result"]) == ("failed", 2, None)
    assert failed["finished_at"] is not None
    assert f"inspection job {job_id} was delivered 2 times" in failed["error"]
    assert "its worker never finished it" in failed["error"]
    assert "out of memory" in failed["error"]
    assert "TRAINCTL_JOB_MAX_DELIVERIES=2" in failed["error"]
    assert messages_of(api, job_id) == 2, "not sent a third time"
    # A message still in the broker finds the job finished and is dropped.
    assert_error(worker_starts(api, job_id), 409, "job_finished")
    reaper_past_the_timeout(api)
    assert job(api, job_id)["status"] == "failed"


def test_a_job_started_through_a_replica_whose_clock_runs_behind_is_not_sent_again_at_once(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's start is written by the database's clock, by which the reaper judges it: a
    replica whose clock runs a timeout behind would write a start that every pass finds
    already timed out, and send the job to a second worker while the first still runs it."""
    from test_leases import clock_off_by

    from service import models

    body = {
        "path": "train.jsonl",
        "tokenizer": "tokenizer.json",
        "objective": "summarization",
        "sequence_length": 64,
    }
    accepted = api.client.post("/datasets/inspect", json=body, headers=api.admin)
    assert accepted.status_code == 202, accepted.text
    job_id = accepted.json()["id"]
    with monkeypatch.context() as replica:
        replica.setattr(models, "datetime", clock_off_by(-2 * TIMEOUT))
        assert worker_starts(api, job_id).status_code == 200
    reaper: Reaper = api.client.app.state.reaper  # type: ignore[attr-defined]
    reaper.reap()  # now, by the database's clock
    started = job(api, job_id)
    assert (started["status"], started["deliveries"], messages_of(api, job_id)) == ("running", 1, 1)
