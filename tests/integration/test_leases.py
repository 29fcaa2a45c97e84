"""Leases, claims and fences on real Postgres, driven over HTTP as a worker drives them:
an idempotent claim, a per-claim secret that only its claimant may present, checkpoint paths
confined to the run, a `succeeded` finish that must be true, stalls, and the grace the reaper
gives leases it could not hear."""

from __future__ import annotations

import os
from datetime import datetime, timedelta, tzinfo
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from sqlalchemy import create_engine, select, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from contracts.reports import ClaimRequest
from service import models
from service.auth import create_token
from service.db import make_session_factory, normalize_url
from service.models import Attempt, Checkpoint, ReaperState, Run, utcnow
from service.workers.lease import lease_end
from service.workers.reaper import Reaper, reap_expired
from worker.link.client import ServiceClient, ServiceUnavailable
from worker.process.claim import claim_request

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration

LEASE = 30.0


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    # The app's own reaper sleeps through these tests: each one drives the reaper itself.
    settings = make_settings(lease_seconds=LEASE, reaper_interval_seconds=3600)
    return make_api(settings)


class Claimant:
    """One worker's side of /internal/attempts/{id}/..., over HTTP, with its own token."""

    def __init__(self, api: Api, attempt_id: str, headers: dict[str, str], nonce: str) -> None:
        self.api, self.attempt_id, self.headers, self.nonce = api, attempt_id, headers, nonce
        self.secret: str | None = None
        self.claimed: dict[str, Any] = {}

    def post(self, action: str, body: dict[str, Any]) -> Any:
        return self.api.client.post(
            f"/internal/attempts/{self.attempt_id}/{action}", json=body, headers=self.headers
        )

    def claim(self) -> Any:
        answer = self.post("claim", {"hostname": "gpu-1", "pid": 7, "nonce": self.nonce})
        if answer.status_code == 200:
            self.claimed = answer.json()
            self.secret = self.claimed["fencing_token"]
        return answer

    def heartbeat(self, step: int, progress: int = 0, secret: str | None = None) -> Any:
        body = {"fencing_token": secret or self.secret, "step": step, "progress": progress}
        return self.post("heartbeat", body)

    def metrics(self, step: int) -> Any:
        point = {"name": "loss", "step": step, "value": 1.0}
        return self.post("metrics", {"fencing_token": self.secret, "points": [point]})

    def checkpoint(self, step: int, path: str | None = None) -> Any:
        path = path or f"{self.claimed['artifact_dir']}/checkpoints/step-{step:08d}"
        ref = {"path": path, "step": step, "phase_index": 0, "phase_step": step}
        return self.post("checkpoints", {"fencing_token": self.secret, "checkpoint": ref})

    def finish(self, status: str, step: int, **extra: Any) -> Any:
        body = {"fencing_token": self.secret, "status": status, "step": step, **extra}
        return self.post("finish", body)


def start_run(api: Api, workflow: dict[str, Any]) -> tuple[str, str]:
    created = api.client.post("/runs", json={"workflow": workflow}, headers=api.admin)
    assert created.status_code == 201, created.text
    run = created.json()
    return run["id"], run["attempts"][0]["id"]


def second_worker_headers(api: Api) -> dict[str, str]:
    with api.sessions() as session:
        token = create_token(session=session, name="another worker", role="worker")
    return {"Authorization": f"Bearer {token}"}


def attempt_row(api: Api, attempt_id: str) -> Attempt:
    with api.sessions() as session:
        attempt = session.get(Attempt, attempt_id)
        assert attempt is not None
        session.expunge(attempt)
        return attempt


def run_row(api: Api, run_id: str) -> Run:
    with api.sessions() as session:
        run = session.get(Run, run_id)
        assert run is not None
        session.expunge(run)
        return run


def error_code(answer: Any, status: int) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"code", "message", "details"} and error["message"]
    return str(error["code"])


# --- claims ------------------------------------------------------------------------------


class DropFirstClaimAnswer(httpx.BaseTransport):
    """Delivers the first claim to the service, then loses its answer on the way back (a
    connection reset after the service committed): the client sees a transport error."""

    def __init__(self, inner: httpx.BaseTransport, drops: int = 1) -> None:
        self.inner, self.dropped, self.drops = inner, 0, drops

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        content = response.read()
        if request.url.path.endswith("/claim") and self.dropped < self.drops:
            self.dropped += 1
            raise httpx.ReadError("connection reset by peer", request=request)
        return httpx.Response(response.status_code, headers=response.headers, content=content)


def test_a_claim_whose_answer_was_lost_is_retried_and_gets_the_same_claim(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    _, attempt_id = start_run(api, tiny_workflow(phases=1))
    transport = DropFirstClaimAnswer(api.client._transport)
    token = api.worker["Authorization"].removeprefix("Bearer ")
    client = ServiceClient(
        "http://testserver", token, transport=transport, retries=2, backoff_seconds=0
    )
    request = ClaimRequest(hostname="gpu-1", pid=7, nonce="n-1")
    claim = client.claim(attempt_id, request)
    assert transport.dropped == 1
    assert claim is not None, "the retry of a winning claim must get the claim, not a refusal"
    row = attempt_row(api, attempt_id)
    assert (row.status, row.fencing_token, row.claim_nonce) == (
        "running",
        claim.fencing_token,
        "n-1",
    )
    # The same claimant asking once more still gets the same claim; nobody else does.
    assert client.claim(attempt_id, request) == claim
    other = Claimant(api, attempt_id, api.worker, nonce="n-2")
    assert error_code(other.claim(), 409) == "already_claimed"


def test_a_message_retried_after_every_claim_answer_was_lost_gets_the_same_claim(
    api: Api, tiny_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client gave up (every answer lost): Celery retries the task, in the same process,
    with the same task id, so the new claim carries the same nonce and gets the claim. A
    redelivery of the message to another process does not."""
    _, attempt_id = start_run(api, tiny_workflow(phases=1))
    transport = DropFirstClaimAnswer(api.client._transport, drops=2)
    token = api.worker["Authorization"].removeprefix("Bearer ")
    client = ServiceClient(
        "http://testserver", token, transport=transport, retries=1, backoff_seconds=0
    )
    with pytest.raises(ServiceUnavailable):
        client.claim(attempt_id, claim_request("celery-task-1"))
    claim_request_nonce = claim_request("celery-task-1").nonce
    claim = client.claim(attempt_id, claim_request("celery-task-1"))  # Celery's retry
    assert claim is not None and claim.fencing_token == attempt_row(api, attempt_id).fencing_token
    monkeypatch.setattr(os, "getpid", lambda: 99999)  # the message redelivered elsewhere
    elsewhere = claim_request("celery-task-1")
    assert elsewhere.nonce != claim_request_nonce
    other = Claimant(api, attempt_id, api.worker, nonce=elsewhere.nonce)
    assert error_code(other.claim(), 409) == "already_claimed"


def test_each_claim_gets_its_own_random_secret(api: Api, tiny_workflow: WorkflowFactory) -> None:
    secrets = set()
    for _ in range(3):
        _, attempt_id = start_run(api, tiny_workflow(phases=1))
        worker = Claimant(api, attempt_id, api.worker, nonce="n")
        assert worker.claim().status_code == 200
        assert worker.secret is not None and len(worker.secret) >= 32
        secrets.add(worker.secret)
    assert len(secrets) == 3


# --- fences ------------------------------------------------------------------------------


def test_another_worker_token_cannot_write_to_an_attempt_it_did_not_claim(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    owner = Claimant(api, attempt_id, api.worker, nonce="owner")
    assert owner.claim().status_code == 200
    # Even holding the secret (leaked, guessed), another worker token is refused.
    thief = Claimant(api, attempt_id, second_worker_headers(api), nonce="thief")
    thief.secret, thief.claimed = owner.secret, owner.claimed
    assert error_code(thief.heartbeat(1, progress=1), 403) == "forbidden"
    assert error_code(thief.metrics(1), 403) == "forbidden"
    assert error_code(thief.checkpoint(4), 403) == "forbidden"
    assert error_code(thief.finish("failed", 1, cause="data"), 403) == "forbidden"
    row = attempt_row(api, attempt_id)
    assert (row.status, row.progress) == ("running", 0)
    assert api.client.get(f"/runs/{run_id}/metrics", headers=api.admin).json() == {}
    assert owner.metrics(1).status_code == 200


def test_a_stale_secret_is_refused_after_the_attempt_was_given_away(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    zombie = Claimant(api, attempt_id, api.worker, nonce="z")
    assert zombie.claim().status_code == 200
    later = utcnow() + timedelta(seconds=LEASE + 1)
    assert reap_expired(session_factory=api.sessions, now=later) == [attempt_id]
    assert zombie.heartbeat(2, progress=2).json()["action"] == "stop"
    assert error_code(zombie.metrics(2), 409) == "superseded"
    new_attempt = max(
        api.client.get(f"/runs/{run_id}", headers=api.admin).json()["attempts"],
        key=lambda a: a["number"],
    )
    heir = Claimant(api, new_attempt["id"], api.worker, nonce="h")
    assert heir.claim().status_code == 200
    # The zombie presents its old secret to the new attempt: no.
    zombie.attempt_id = heir.attempt_id
    assert error_code(zombie.metrics(2), 409) == "superseded"
    assert heir.metrics(2).status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "{artifacts}/runs/run_other/checkpoints/step-00000004",
        "{artifacts}/runs/{run}/checkpoints/../../run_other/checkpoints/step-00000004",
        "{artifacts}/runs/{run}/checkpoints",
        "{artifacts}/runs/{run}/step-00000004",
        "runs/{run}/checkpoints/step-00000004",
        "{artifacts}/runs/{run}/checkpoints/step-00000004/model.safetensors",
        "{artifacts}/runs/{run}/checkpoints/.tmp-step-00000004-1234",
        "{artifacts}/runs/{run}/checkpoints/step-00000003",
    ],
)
def test_a_checkpoint_path_outside_the_runs_checkpoint_directory_is_refused(
    api: Api, tiny_workflow: WorkflowFactory, path: str
) -> None:
    run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    assert worker.claim().status_code == 200
    given = path.format(artifacts=api.settings.artifact_root, run=run_id)
    answer = worker.checkpoint(4, path=given)
    assert error_code(answer, 422) == "invalid_checkpoint_path"
    assert answer.json()["error"]["details"]["field"] == "checkpoint.path"
    listed = api.client.get(f"/runs/{run_id}/checkpoints", headers=api.admin).json()
    assert listed["checkpoints"] == []
    assert worker.checkpoint(4).status_code == 200  # its own directory is fine


# --- finishes ----------------------------------------------------------------------------


def test_a_succeeded_finish_is_believed_only_at_the_phase_end_with_its_checkpoint(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    assert worker.claim().status_code == 200
    assert error_code(worker.finish("succeeded", 3), 409) == "unverified_finish"
    assert error_code(worker.finish("succeeded", 4), 409) == "unverified_finish"
    assert attempt_row(api, attempt_id).status == "running"
    assert run_row(api, run_id).status == "running"
    assert worker.checkpoint(4).status_code == 200
    assert worker.finish("succeeded", 4).status_code == 200
    assert run_row(api, run_id).status == "succeeded"


def test_a_checkpoint_that_cannot_be_read_fails_the_run_without_a_retry(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    assert worker.claim().status_code == 200
    message = "checkpoint step-00000004 failed verification and has no fallback"
    answer = worker.finish("failed", 0, cause="checkpoint", message=message)
    assert answer.status_code == 200, answer.text
    run = api.client.get(f"/runs/{run_id}", headers=api.admin).json()
    assert (run["status"], run["cause"]) == ("failed", "checkpoint")
    assert [a["status"] for a in run["attempts"]] == ["failed"]


# --- stalls ------------------------------------------------------------------------------


def test_an_attempt_whose_progress_stalls_is_lost_as_stalled_and_recovered(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """Heartbeats alone (a keeper thread beating for a hung loop) keep the lease but not the
    attempt: once its progress has not moved for stall_seconds it is lost, cause `stalled`."""
    stall = 10.0
    run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    assert worker.claim().status_code == 200
    assert worker.heartbeat(1, progress=3).status_code == 200
    moved_at = attempt_row(api, attempt_id).progress_at
    assert worker.heartbeat(1, progress=3).json()["action"] == "continue"
    assert attempt_row(api, attempt_id).progress_at == moved_at  # beats do not count

    assert moved_at is not None
    almost = moved_at + timedelta(seconds=stall - 1)
    assert reap_expired(session_factory=api.sessions, now=almost, stall_seconds=stall) == []
    later = moved_at + timedelta(seconds=stall + 1)  # the lease (30 s) still holds
    assert reap_expired(session_factory=api.sessions, now=later, stall_seconds=stall) == [
        attempt_id
    ]
    row = attempt_row(api, attempt_id)
    assert (row.status, row.cause) == ("lost", "stalled")
    assert "no progress" in (row.message or "")
    run = api.client.get(f"/runs/{run_id}", headers=api.admin).json()
    assert run["status"] == "recovering" and "stalled" in run["message"]
    assert [a["status"] for a in run["attempts"]] == ["lost", "queued"]
    assert worker.heartbeat(1, progress=4).json()["action"] == "stop"


def test_moving_progress_keeps_a_slow_attempt(api: Api, tiny_workflow: WorkflowFactory) -> None:
    _, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    assert worker.claim().status_code == 200
    for progress in range(1, 4):
        assert worker.heartbeat(1, progress=progress).status_code == 200
    moved_at = attempt_row(api, attempt_id).progress_at
    assert moved_at is not None
    soon = moved_at + timedelta(seconds=5)
    assert reap_expired(session_factory=api.sessions, now=soon, stall_seconds=10) == []
    assert attempt_row(api, attempt_id).status == "running"


def test_a_run_shows_the_file_its_attempt_is_preparing_until_the_first_step(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    assert worker.claim().status_code == 200

    def shown() -> Any:
        return api.client.get(f"/runs/{run_id}", headers=api.admin).json()["preparing"]

    assert shown() is None
    preparing = {"file": "/data/pretrain.jsonl", "fraction": 0.41}
    body = {"fencing_token": worker.secret, "step": 0, "progress": 5, "preparing": preparing}
    assert worker.post("heartbeat", body).status_code == 200
    assert shown() == preparing
    listed = api.client.get("/runs", headers=api.admin).json()["runs"]
    assert [r["preparing"] for r in listed if r["id"] == run_id] == [preparing]

    out_of_range = {**body, "preparing": {**preparing, "fraction": 1.5}}
    assert worker.post("heartbeat", out_of_range).status_code == 422
    assert worker.heartbeat(1, progress=6).status_code == 200  # the first step: prepared
    assert shown() is None


# --- grace -------------------------------------------------------------------------------


def expire_now(api: Api, attempt_id: str, seconds_ago: float) -> None:
    """The lease ran out `seconds_ago` (the service was down meanwhile)."""
    with api.sessions() as session:
        past = utcnow() - timedelta(seconds=seconds_ago)
        session.execute(
            update(Attempt)
            .where(Attempt.id == attempt_id)
            .values(lease_expires_at=past, progress_at=past - timedelta(seconds=LEASE))
        )
        session.commit()


def reaper_over(sessions: Any, **overrides: Any) -> Reaper:
    """A reaper of this test's own (the app's sleeps), one-second passes, stall at 2 leases."""
    values: dict[str, Any] = {
        "dispatch": lambda: None,
        "interval": 1,
        "lease_seconds": LEASE,
        "stall_seconds": 2 * LEASE,
        **overrides,
    }
    return Reaper(session_factory=sessions, **values)


def test_with_no_pass_on_record_the_reaper_gives_leases_a_lease_of_grace_when_it_starts(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """With no reaper pass on record (the first start after migration 0014), how long the
    service could not hear is unknown: the first pass extends every running lease to one
    lease from now; only a worker silent through that period is lost."""
    _, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    assert worker.claim().status_code == 200
    expire_now(api, attempt_id, seconds_ago=3 * LEASE)
    with api.sessions() as session:  # forget the app's own first pass
        session.execute(update(ReaperState).values(heard_at=None))
        session.commit()

    reaper = reaper_over(api.sessions)
    started = utcnow()
    assert reaper.reap(started) == []  # the first pass: grace
    row = attempt_row(api, attempt_id)
    assert row.status == "running"
    assert row.lease_expires_at is not None and row.lease_expires_at >= lease_end(started, LEASE)
    assert reaper.reap(started + timedelta(seconds=LEASE / 2)) == []
    # The worker, alive, renews within the grace: it keeps its attempt.
    assert worker.heartbeat(2, progress=1).json()["action"] == "continue"
    assert reaper.reap(utcnow() + timedelta(seconds=LEASE / 2)) == []
    # A worker that stays silent through the grace is lost one lease later.
    assert reaper.reap(utcnow() + timedelta(seconds=LEASE + 1)) == [attempt_id]
    assert reaper.graces == 1


def clock_off_by(seconds: float) -> type[datetime]:
    """A `datetime` whose `now` is `seconds` off: set as service.models' own, it is the wall
    clock of this process (this replica) wherever the service asks it (`utcnow`)."""
    skew = timedelta(seconds=seconds)

    class Skewed(datetime):
        @classmethod
        def now(cls, tz: tzinfo | None = None) -> datetime:  # type: ignore[override]
            return datetime.now(tz) + skew

    return Skewed


def test_a_replica_whose_clock_runs_ahead_does_not_reap_a_live_lease(
    api: Api, tiny_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leases are judged by the database's clock, not by each replica's own: a replica whose
    clock runs a lease ahead of the one that wrote the lease would take every live worker for
    dead."""
    _, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    assert worker.claim().status_code == 200
    reaper = reaper_over(api.sessions)
    assert reaper.reap() == [] and reaper.graces == 1
    with monkeypatch.context() as replica:
        replica.setattr(models, "datetime", clock_off_by(2 * LEASE))
        assert reaper.reap() == []
    assert attempt_row(api, attempt_id).status == "running"
    assert worker.heartbeat(1, progress=1).json()["action"] == "continue"


def test_a_lease_written_by_a_replica_whose_clock_runs_behind_lasts_a_lease(
    api: Api, tiny_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica that takes a claim or a heartbeat writes the lease's end (and the stall
    clock) by the database's clock too: one whose clock runs behind would write leases that
    the other replicas find already run out."""
    reaper = reaper_over(api.sessions)
    assert reaper.reap() == [] and reaper.graces == 1  # its grace is spent before the claim
    _, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    with monkeypatch.context() as replica:
        replica.setattr(models, "datetime", clock_off_by(-2 * LEASE))
        assert worker.claim().status_code == 200
    assert reaper.reap() == []
    with monkeypatch.context() as replica:
        replica.setattr(models, "datetime", clock_off_by(-2 * LEASE))
        assert worker.heartbeat(1, progress=1).json()["action"] == "continue"
    assert reaper.reap() == []
    assert attempt_row(api, attempt_id).status == "running"


class FailingOnce:
    """A session factory whose next session fails with `error` (by default like a database
    that went away)."""

    def __init__(self, sessions: Any) -> None:
        self.sessions, self.fail = sessions, False
        self.error: Exception = OperationalError("SELECT 1", {}, Exception("connection refused"))

    def __call__(self) -> Session:
        if self.fail:
            self.fail = False
            raise self.error
        session: Session = self.sessions()
        return session


def claimed_at(api: Api, attempt_id: str) -> datetime:
    """When the claim was taken, by the database's clock (its lease ends one lease later)."""
    claimed = attempt_row(api, attempt_id).heartbeat_at
    assert claimed is not None
    return claimed


def seconds(value: float) -> timedelta:
    return timedelta(seconds=value)


def test_a_restart_gives_running_leases_back_the_time_no_replica_heard_them(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """The service down for three leases: the restarted replica's first pass moves every
    running lease on by the time no pass of any replica heard its worker (from one reaper
    interval after the last pass on record in the database until now), so a lease has again
    what it had left when the service went deaf. A dead worker is lost a lease of hearing
    after its last report."""
    _, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    assert Claimant(api, attempt_id, api.worker, nonce="n").claim().status_code == 200
    claimed = claimed_at(api, attempt_id)
    before = reaper_over(api.sessions)
    assert before.reap(claimed) == [] and before.reap(claimed + seconds(1)) == []
    back = claimed + seconds(1 + 3 * LEASE)  # the last pass heard until claimed + 2 s
    after = reaper_over(api.sessions)
    assert after.reap(back) == [] and after.graces == 1
    assert attempt_row(api, attempt_id).lease_expires_at == back + seconds(LEASE - 2)
    assert after.reap(back + seconds(LEASE - 3)) == []
    assert after.reap(back + seconds(LEASE - 2)) == [attempt_id]


def test_a_replica_restarting_in_a_loop_does_not_keep_a_dead_workers_lease_alive(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """A replica that crashes right after each start's first pass, restarted every two reaper
    intervals: each start gives leases back only the time no pass heard them, so a dead
    worker's lease runs out once it was heard for a lease in all (here after two leases).
    A start that granted a whole lease each time kept it alive as long as the loop lasted."""
    _, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    assert Claimant(api, attempt_id, api.worker, nonce="n").claim().status_code == 200
    claimed = claimed_at(api, attempt_id)  # and the worker dies
    lost_at = None
    for start in range(int(3 * LEASE / 2)):
        at = claimed + seconds(2 * start)
        if reaper_over(api.sessions).reap(at) == [attempt_id]:
            lost_at = at
            break
    assert lost_at is not None, "the dead worker's lease outlived three leases of restarts"
    assert lost_at <= claimed + seconds(2 * LEASE)
    assert attempt_row(api, attempt_id).cause == "infrastructure"


def test_the_reaper_gives_grace_again_after_the_database_comes_back(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    _, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    assert Claimant(api, attempt_id, api.worker, nonce="n").claim().status_code == 200
    claimed = claimed_at(api, attempt_id)
    sessions = FailingOnce(api.sessions)
    reaper = reaper_over(sessions)
    assert reaper.reap(claimed) == [] and reaper.graces == 1
    sessions.fail = True
    assert reaper.reap(claimed + seconds(1)) == []  # the outage: a failed pass
    back = claimed + seconds(2 * LEASE)  # workers could not be heard meanwhile
    assert reaper.reap(back) == [] and reaper.graces == 2
    assert attempt_row(api, attempt_id).status == "running"
    # Heard until one interval after the last pass that worked: the lease had L - 1 s left.
    assert reaper.reap(back + seconds(LEASE - 1)) == [attempt_id]


def test_nothing_is_written_for_an_attempt_with_the_right_secret_but_no_claim(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """A queued attempt has no secret: no token opens it."""
    _, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    worker.secret = "guess"
    assert worker.heartbeat(0).json()["action"] == "stop"
    assert error_code(worker.metrics(1), 409) == "superseded"
    with api.sessions() as session:
        status = session.scalar(select(Attempt.status).where(Attempt.id == attempt_id))
    assert status == "queued"


def test_a_pass_that_fails_for_another_reason_than_an_outage_owes_no_grace(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """A constraint violation or a bug is no deafness: granting grace for it, pass after pass,
    would keep dead workers' leases alive for ever."""
    _, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    assert Claimant(api, attempt_id, api.worker, nonce="n").claim().status_code == 200
    sessions = FailingOnce(api.sessions)
    reaper = reaper_over(sessions)
    assert reaper.reap() == [] and reaper.graces == 1
    sessions.fail = True
    sessions.error = IntegrityError("INSERT", {}, Exception("duplicate key"))
    assert reaper.reap() == []
    assert reaper.hearing()
    expire_now(api, attempt_id, seconds_ago=1)
    assert reaper.reap() == [attempt_id] and reaper.graces == 1


def test_a_pass_cut_short_by_a_statement_timeout_owes_no_grace(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """A statement timeout (a lock timeout, a deadlock) is an error in one statement, not an
    outage: the database answered, and so did the workers' reports. Taking it for deafness
    would give every running lease another period, pass after pass while the cause lasts."""
    _, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    assert Claimant(api, attempt_id, api.worker, nonce="n").claim().status_code == 200
    impatient = create_engine(
        normalize_url(api.settings.database_url),
        connect_args={"options": "-c statement_timeout=500"},
    )
    try:
        reaper = reaper_over(make_session_factory(impatient))
        started = utcnow()
        assert reaper.reap(started) == [] and reaper.graces == 1
        later = started + timedelta(seconds=LEASE + 1)  # the worker died: its lease ran out
        with api.sessions() as blocker:
            # A transaction holds the attempt's row: the reaper's UPDATE waits, and is cancelled.
            blocker.execute(select(Attempt).where(Attempt.id == attempt_id).with_for_update())
            assert reaper.reap(later) == []
            blocker.rollback()
        assert reaper.hearing()
        assert reaper.reap(later) == [attempt_id] and reaper.graces == 1
    finally:
        impatient.dispose()


def test_a_process_that_was_frozen_grants_grace_before_it_judges_a_lease(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """Its passes stopped (SIGSTOP, a suspended host, starved threads) without any error: the
    leases that ran out meanwhile were not heard, and are not judged by that time."""
    _, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    assert Claimant(api, attempt_id, api.worker, nonce="n").claim().status_code == 200
    claimed = claimed_at(api, attempt_id)
    clock = [1000.0]
    reaper = reaper_over(api.sessions, clock=lambda: clock[0])
    assert reaper.reap(claimed) == [] and reaper.graces == 1
    clock[0] += 1.5
    assert reaper.reap(claimed + seconds(1.5)) == [] and reaper.hearing()
    clock[0] += 3 * LEASE  # frozen for three leases
    assert not reaper.hearing()
    assert reaper.reap(claimed + seconds(1.5 + 3 * LEASE)) == [] and reaper.graces == 2
    assert attempt_row(api, attempt_id).status == "running"


def test_one_attempt_that_cannot_be_settled_does_not_stop_the_others_being_reaped(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    ids = []
    for _ in range(2):
        run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
        assert Claimant(api, attempt_id, api.worker, nonce="n").claim().status_code == 200
        ids.append((run_id, attempt_id))
    (broken_run, broken), (_, healthy) = ids
    with api.sessions() as session:
        # An old row the code cannot settle: its plan lost its phases.
        session.execute(update(Run).where(Run.id == broken_run).values(plan={}))
        session.commit()
    expire_now(api, broken, seconds_ago=LEASE + 1)  # the older lease: reaped first
    expire_now(api, healthy, seconds_ago=1)
    assert reap_expired(session_factory=api.sessions, now=utcnow()) == [healthy]
    assert attempt_row(api, broken).status == "running"


def test_pause_and_resume_do_not_judge_leases_while_the_service_owes_grace(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """Right after an outage, before the reaper's grace, a lapsed lease may be a live worker
    the service could not hear: pause asks it (the reaper settles it if it is gone), resume
    waits."""
    run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    assert worker.claim().status_code == 200
    expire_now(api, attempt_id, seconds_ago=2 * LEASE)
    reaper = api.client.app.state.reaper  # type: ignore[attr-defined]
    reaper.owes_grace = True
    resumed = api.client.post(f"/runs/{run_id}/resume", headers=api.admin)
    assert error_code(resumed, 409) == "run_active"
    paused = api.client.post(f"/runs/{run_id}/pause", headers=api.admin)
    assert paused.status_code == 200 and paused.json()["pause_requested_at"] is not None
    assert attempt_row(api, attempt_id).status == "running"  # not taken for dead
    assert worker.heartbeat(2, progress=1).json()["action"] == "pause"  # alive after all


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("GET", "/runs/run_a%00b"),
        ("GET", "/runs/run_a%00b/metrics"),
        ("GET", "/runs?status=running&name=a%00"),
        ("POST", "/internal/attempts/att_a%00b/heartbeat"),
        ("POST", "/internal/attempts/att_a%00b/claim"),
    ],
)
def test_a_nul_in_a_url_is_refused_not_a_server_error(api: Api, method: str, url: str) -> None:
    """Ids and names from the URL reach SQL; Postgres refuses NUL in text."""
    headers = api.worker if url.startswith("/internal") else api.admin
    answer = api.client.request(method, url, headers=headers, json={})
    assert error_code(answer, 422) == "invalid_request"
    assert answer.json()["error"]["details"]["field"] in ("path", "query")


def test_a_metric_name_with_a_nul_is_refused_alone(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """Refused per point: a 500 would be retried, spooled and sent again for ever, holding
    back every report behind it."""
    run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    assert worker.claim().status_code == 200
    points = [
        {"name": "lo\u0000ss", "step": 1, "value": 1.0},
        {"name": "loss", "step": 1, "value": 1.0},
    ]
    answer = worker.post("metrics", {"fencing_token": worker.secret, "points": points})
    assert answer.status_code == 200, answer.text
    assert answer.json()["accepted"] == 1
    assert "NUL" in answer.json()["errors"][0]["error"]
    stored = api.client.get(f"/runs/{run_id}/metrics", headers=api.admin).json()
    assert list(stored) == ["loss"]


@pytest.mark.parametrize(
    ("phase_index", "phase_step"),
    [(1, 4), (0, 3), (0, 5)],
)
def test_a_checkpoint_of_another_phase_or_step_than_its_attempts_is_refused(
    api: Api, tiny_workflow: WorkflowFactory, phase_index: int, phase_step: int
) -> None:
    """A final checkpoint is what the next phase starts from and what a succeeded finish is
    verified by: it must be a step of the attempt's own phase, at its own position."""
    _, attempt_id = start_run(api, tiny_workflow(phases=2, steps=4))
    worker = Claimant(api, attempt_id, api.worker, nonce="n")
    assert worker.claim().status_code == 200
    path = f"{worker.claimed['artifact_dir']}/checkpoints/step-00000004"
    ref = {"path": path, "step": 4, "phase_index": phase_index, "phase_step": phase_step}
    answer = worker.post("checkpoints", {"fencing_token": worker.secret, "checkpoint": ref})
    assert error_code(answer, 422) == "invalid_checkpoint"
    assert error_code(worker.finish("succeeded", 4), 409) == "unverified_finish"


def test_a_phase_never_starts_from_a_checkpoint_in_the_middle_of_the_previous_one(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """Phase 0's final checkpoint was quarantined: phase 1 must not be handed phase 0's step 2
    (its worker would refuse it as a checkpoint error, never retried); it gets none, and once
    it has checkpoints of its own, the newest of them."""
    run_id, attempt_id = start_run(api, tiny_workflow(phases=2, steps=4))
    first = Claimant(api, attempt_id, api.worker, nonce="a")
    assert first.claim().status_code == 200
    for step in (2, 4):
        assert first.checkpoint(step).status_code == 200
    assert first.finish("succeeded", 4).status_code == 200
    with api.sessions() as session:
        session.execute(
            update(Checkpoint)
            .where(Checkpoint.run_id == run_id, Checkpoint.step == 4)
            .values(status="quarantined", reason="manifest mismatch")
        )
        session.commit()
    run = api.client.get(f"/runs/{run_id}", headers=api.admin).json()
    second = Claimant(api, run["attempts"][-1]["id"], api.worker, nonce="b")
    assert second.claim().status_code == 200
    assert second.claimed["phase_index"] == 1 and second.claimed["resume_from"] is None
