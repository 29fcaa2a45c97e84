"""The service's side of a phase across machines (service/workers/lease.py), on Postgres and
Redis, driven through the worker protocol in this process: each member of a two-node attempt
claims its own part (one fencing token, its node rank, the rendezvous at member 0's advertised
address), keeps its own lease, and the attempt is lost when any member's lease lapses or a
member never claims; a failed finish of member 1 fails the attempt naming it."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import select, update
from test_api import get_run, submit

from service.models import Attempt, AttemptMember, utcnow
from service.workers.lease import RENDEZVOUS_PORTS, rendezvous_port
from service.workers.reaper import grant_grace, reap_expired

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration

# Two workers, as their pings name them: key -> (hostname, pid, advertised address).
WORKERS = {"wa": ("host-a", 11, "10.1.0.1"), "wb": ("host-b", 22, "10.1.0.2")}


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    # Passes are driven by the requests and by the tests, not by the periodic threads.
    return make_api(make_settings(reaper_interval_seconds=3600, outbox_interval_seconds=3600))


def ping(api: Api, key: str) -> None:
    hostname, pid, address = WORKERS[key]
    body = {
        "hostname": hostname,
        "pid": pid,
        "version": "0.1.0",
        "queue": api.settings.queue,
        "devices": 1,
        "worker": key,
        "address": address,
    }
    response = api.client.post("/internal/workers/ping", json=body, headers=api.worker)
    assert response.status_code == 200, response.text


class Member:
    """Member k of an attempt, as the worker `key` runs it."""

    def __init__(self, api: Api, attempt_id: str, member: int, key: str) -> None:
        self.api, self.attempt_id, self.member, self.key = api, attempt_id, member, key
        self.nonce = uuid.uuid4().hex
        self.token: str | None = None

    def post(self, action: str, body: dict[str, Any]) -> Any:
        if self.member:
            body = {**body, "member": self.member}
        return self.api.client.post(
            f"/internal/attempts/{self.attempt_id}/{action}", json=body, headers=self.api.worker
        )

    def claim(self, *, nonce: str | None = None, key: str | None = None) -> Any:
        hostname, pid, _ = WORKERS[key or self.key]
        response = self.post(
            "claim", {"hostname": hostname, "pid": pid, "nonce": nonce or self.nonce}
        )
        if response.status_code == 200:
            self.token = response.json()["fencing_token"]
        return response

    def heartbeat(self, step: int = 0, token: str | None = None) -> str:
        response = self.post("heartbeat", {"fencing_token": token or self.token, "step": step})
        assert response.status_code == 200, response.text
        return str(response.json()["action"])

    def finish(self, status: str, step: int = 0, **extra: Any) -> Any:
        return self.post(
            "finish", {"fencing_token": self.token, "status": status, "step": step, **extra}
        )


def two_node_run(api: Api, tiny_workflow: WorkflowFactory) -> tuple[dict[str, Any], Member, Member]:
    """A two-node run placed on both workers; its members as the placement put them."""
    ping(api, "wa")
    ping(api, "wb")
    doc = tiny_workflow(phases=1, steps=10)
    doc["phases"][0]["grad_accum"] = 2
    doc["resources"] = {"nodes": 2, "devices": 1}
    created = submit(api, {"workflow": doc})
    assert created.status_code == 201, created.text
    run = created.json()
    attempt_id = run["attempts"][0]["id"]
    with api.sessions() as session:
        rows = session.scalars(
            select(AttemptMember)
            .where(AttemptMember.attempt_id == attempt_id)
            .order_by(AttemptMember.member)
        ).all()
        keys = [row.worker_id for row in rows]
    assert sorted(keys) == ["wa", "wb"], "placed on both workers at once"
    return run, Member(api, attempt_id, 0, keys[0]), Member(api, attempt_id, 1, keys[1])


def test_members_claim_their_parts_with_one_token_and_meet_at_member_0s_address(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run, first, second = two_node_run(api, tiny_workflow)
    # A member claimed from a worker it is not placed on is refused, naming both.
    wrong = second.claim(key=first.key)
    assert wrong.status_code == 409, wrong.text
    assert wrong.json()["error"]["code"] == "not_placed_here"
    assert second.key in wrong.json()["error"]["message"]
    beyond = Member(api, first.attempt_id, 2, first.key).claim()
    assert beyond.status_code == 409 and beyond.json()["error"]["code"] == "not_a_member"

    # Member 1 claims first: the attempt starts; member 0 joins it.
    one = second.claim()
    assert one.status_code == 200, one.text
    claim1 = one.json()
    assert (claim1["nodes"], claim1["node_rank"], claim1["devices"]) == (2, 1, 1)
    address = WORKERS[first.key][2]
    port = rendezvous_port(first.attempt_id)
    assert RENDEZVOUS_PORTS[0] <= port < RENDEZVOUS_PORTS[1]
    assert claim1["rendezvous"] == {"host": address, "port": port}
    assert get_run(api, run["id"])["status"] == "running"
    zero = first.claim()
    assert zero.status_code == 200, zero.text
    claim0 = zero.json()
    assert claim0["fencing_token"] == claim1["fencing_token"]
    assert (claim0["node_rank"], claim0["rendezvous"]) == (0, {"host": address, "port": port})
    # A retry (same nonce) gets the same answer; another claimant is refused.
    assert second.claim().json() == claim1
    again = second.claim(nonce=uuid.uuid4().hex)
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_claimed"
    # The attempt names member 0's worker, whose claim came second.
    state = get_run(api, run["id"])["attempts"][0]
    assert state["status"] == "running"

    # Each member keeps its own lease; member 1's step is not the run's.
    assert first.heartbeat(step=3) == "continue"
    assert second.heartbeat(step=9) == "continue"
    assert get_run(api, run["id"])["step"] == 3
    with api.sessions() as session:
        row = session.get(AttemptMember, (first.attempt_id, 1))
        assert row is not None and row.heartbeat_at is not None and row.worker_pid == 22
        attempt = session.get(Attempt, first.attempt_id)
        assert attempt is not None and attempt.worker_hostname == WORKERS[first.key][0]
    assert second.heartbeat(token="stale-secret") == "stop"
    # Pause reaches every member.
    assert api.client.post(f"/runs/{run['id']}/pause", headers=api.admin).status_code == 200
    assert (first.heartbeat(step=3), second.heartbeat()) == ("pause", "pause")


def test_a_member_whose_heartbeats_stop_loses_the_attempt_and_the_others_hear_stop(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run, first, second = two_node_run(api, tiny_workflow)
    assert first.claim().status_code == 200 and second.claim().status_code == 200
    assert first.heartbeat(step=2) == "continue" and second.heartbeat() == "continue"
    lease = api.settings.lease_seconds
    now = utcnow()
    # Nothing is due while every member beats within its lease.
    assert reap_expired(session_factory=api.sessions, now=now, lease_seconds=lease) == []
    with api.sessions() as session:
        session.execute(
            update(AttemptMember)
            .where(AttemptMember.attempt_id == first.attempt_id, AttemptMember.member == 1)
            .values(heartbeat_at=now - timedelta(seconds=lease + 1))
        )
        session.commit()
    # Member 0's own lease holds: only a reaper that judges members sees the lapse.
    assert reap_expired(session_factory=api.sessions, now=now) == []
    assert reap_expired(session_factory=api.sessions, now=now, lease_seconds=lease) == [
        first.attempt_id
    ]
    after = get_run(api, run["id"])
    lost = after["attempts"][0]
    assert (lost["status"], lost["cause"]) == ("lost", "infrastructure")
    assert lost["message"].startswith("lost: member 1 of 2 (host-")
    assert "sent no heartbeat" in lost["message"]
    assert after["preemptions"] == 1
    assert [a["status"] for a in after["attempts"]] == ["lost", "queued"]
    # The surviving member, and the lost one should it live, are told to stop.
    assert first.heartbeat(step=2) == "stop"
    assert second.heartbeat() == "stop"
    late = second.finish("failed", cause="infrastructure", message="too late")
    assert late.status_code == 409 and late.json()["error"]["code"] == "superseded"


def test_a_member_that_never_claims_loses_the_attempt_naming_it(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run, first, second = two_node_run(api, tiny_workflow)
    assert first.claim().status_code == 200
    lease = api.settings.lease_seconds
    now = utcnow()
    assert reap_expired(session_factory=api.sessions, now=now, lease_seconds=lease) == []
    # A lease after its placement, member 1 still has not claimed.
    later = now + timedelta(seconds=lease + 1)
    with api.sessions() as session:
        session.execute(
            update(Attempt).where(Attempt.id == first.attempt_id).values(lease_expires_at=later)
        )
        session.commit()
    reaped = reap_expired(session_factory=api.sessions, now=later, lease_seconds=lease)
    assert reaped == [first.attempt_id]
    lost = get_run(api, run["id"])["attempts"][0]
    assert lost["status"] == "lost"
    assert lost["message"].startswith(f"lost: member 1 of 2 (placed on worker {second.key}")
    assert "did not claim its part" in lost["message"]
    assert first.heartbeat() == "stop"


def test_grace_moves_the_members_clocks_as_it_moves_the_attempts_lease(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run, first, second = two_node_run(api, tiny_workflow)
    assert first.claim().status_code == 200 and second.claim().status_code == 200
    lease = api.settings.lease_seconds
    now = utcnow()
    # The service heard nobody for two leases; member 1's last beat was a lease ago.
    deaf = now - timedelta(seconds=lease)
    with api.sessions() as session:
        session.execute(
            update(AttemptMember)
            .where(AttemptMember.attempt_id == first.attempt_id, AttemptMember.member == 1)
            .values(heartbeat_at=deaf)
        )
        session.execute(
            update(Attempt)
            .where(Attempt.id == first.attempt_id)
            .values(lease_expires_at=now + timedelta(seconds=lease))
        )
        session.commit()
    from service.models import ReaperState

    with api.sessions() as session:
        state = session.get(ReaperState, 1)
        assert state is not None
        state.heard_at = now - timedelta(seconds=2 * lease)
        session.commit()
    grant_grace(
        session_factory=api.sessions, now=now, lease_seconds=lease, stall_seconds=None, interval=1
    )
    with api.sessions() as session:
        row = session.get(AttemptMember, (first.attempt_id, 1))
        assert row is not None and row.heartbeat_at is not None
        assert row.heartbeat_at > deaf, "member 1's lease got the time nobody heard"
    assert reap_expired(session_factory=api.sessions, now=now, lease_seconds=lease) == []
    assert get_run(api, run["id"])["attempts"][0]["status"] == "running"


def test_a_failed_finish_of_member_1_fails_the_attempt_naming_it(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run, first, second = two_node_run(api, tiny_workflow)
    assert first.claim().status_code == 200 and second.claim().status_code == 200
    # Only member 0 finishes the attempt otherwise.
    wrong = second.finish("succeeded", step=10)
    assert wrong.status_code == 422 and wrong.json()["error"]["code"] == "invalid_finish"
    failed = second.finish(
        "failed", step=0, cause="infrastructure", message="GangError: lost member 0 of 2"
    )
    assert failed.status_code == 200, failed.text
    after = get_run(api, run["id"])
    attempt = after["attempts"][0]
    assert (attempt["status"], attempt["cause"]) == ("failed", "infrastructure")
    assert attempt["message"] == (
        f"member 1 of 2 ({WORKERS[second.key][0]}, pid {WORKERS[second.key][1]}): "
        "GangError: lost member 0 of 2"
    )
    # An infrastructure failure is recovered (a restart spent), like any failed attempt.
    assert after["restarts"] == 1
    assert [a["status"] for a in after["attempts"]] == ["failed", "queued"]
    assert first.heartbeat() == "stop"
    late = first.finish("failed", cause="infrastructure", message="collective failed")
    assert late.status_code == 409 and late.json()["error"]["code"] == "superseded"


def test_a_one_node_attempt_claimed_as_a_member_is_refused(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    ping(api, "wa")
    run = submit(api, {"workflow": tiny_workflow(phases=1, steps=4)}).json()
    member = Member(api, run["attempts"][0]["id"], 1, "wa")
    refused = member.claim()
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_a_member"
    alone = Member(api, run["attempts"][0]["id"], 0, "wa").claim()
    assert alone.status_code == 200, alone.text
    assert (alone.json()["nodes"], alone.json()["rendezvous"]) == (1, None)
