"""The lease keeper: one thread renews the lease whatever the loop does, and every heartbeat
carries the loop's progress so that the service can tell a hung worker from a slow one."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from contracts.reports import Claim
from worker.link.client import ServiceClient
from worker.link.lease import LeaseKeeper
from worker.link.reporter import ServiceReporter


class Service:
    """Answers heartbeats with `action`; records each one's body; `down` refuses connections.
    `beats` is set every time a heartbeat arrives, so a test waits on an event, not a clock."""

    def __init__(self, action: str = "continue") -> None:
        self.action = action
        self.down = False
        self.status = 200
        self.received: list[dict[str, Any]] = []
        self.beats = threading.Condition()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        with self.beats:
            self.received.append(json.loads(request.content))
            self.beats.notify_all()
        if self.status == 409:
            error = {"code": "superseded", "message": "stale", "details": None}
            return httpx.Response(409, json={"error": error})
        if self.status == 403:
            error = {"code": "forbidden", "message": "not yours", "details": None}
            return httpx.Response(403, json={"error": error})
        return httpx.Response(200, json={"action": self.action, "lease_seconds": 30})

    def wait_for(self, count: int, timeout: float = 10.0) -> None:
        with self.beats:
            assert self.beats.wait_for(lambda: len(self.received) >= count, timeout), (
                f"{len(self.received)} heartbeats arrived, expected {count}"
            )


def keeper(service: Service, *, interval: float = 60.0, step: int = 0) -> LeaseKeeper:
    client = ServiceClient("http://service", "t", transport=httpx.MockTransport(service), retries=0)
    return LeaseKeeper(
        client, attempt_id="att_1", fencing_token="secret", interval=interval, step=step
    )


def test_heartbeats_carry_the_secret_the_step_and_the_progress_made() -> None:
    service = Service()
    lease = keeper(service, step=4)
    assert lease.beat() == "continue"
    lease.advance(5)
    lease.advance()  # an eval set, say: progress without a step
    assert lease.beat() == "continue"
    assert service.received == [
        {"fencing_token": "secret", "step": 4, "progress": 0},
        {"fencing_token": "secret", "step": 5, "progress": 2},
    ]


def test_the_thread_renews_the_lease_while_the_loop_is_stuck_in_one_long_step() -> None:
    """A step that takes three heartbeat periods (here: the test thread, blocked on the
    service's beats) keeps its lease: the keeper beats on its own, with unchanged progress."""
    service = Service()
    lease = keeper(service, interval=0.05, step=3)
    lease.start()
    try:
        service.wait_for(3)  # the "step" lasts three beats and reports nothing
    finally:
        lease.stop()
    assert {tuple(sorted(b.items())) for b in service.received} == {
        (("fencing_token", "secret"), ("progress", 0), ("step", 3))
    }
    assert lease._thread is None  # joined: no beat can follow
    count = len(service.received)
    assert lease.beat() == "continue" and len(service.received) == count + 1


def test_orders_stick_pause_until_the_attempt_ends_and_stop_for_good() -> None:
    service = Service(action="pause")
    lease = keeper(service)
    assert lease.beat() == "pause"
    service.action = "continue"
    assert lease.beat() == "pause"  # a pause is carried out once, by the loop
    service.status = 409
    assert lease.beat() == "stop"
    service.status, service.action = 200, "continue"
    assert lease.beat() == "stop" and lease.order == "stop"


def test_the_thread_ends_when_told_to_stop() -> None:
    service = Service(action="stop")
    lease = keeper(service, interval=0.01)
    lease.start()
    service.wait_for(1)
    lease.stop()  # joins: the thread ended after the stop order, without being told
    assert len(service.received) == 1 and lease.order == "stop"


def test_an_unreachable_service_orders_nothing_new_and_the_keeper_keeps_trying(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = Service(action="pause")
    lease = keeper(service)
    service.down = True
    with caplog.at_level(logging.WARNING):
        assert lease.beat() == "continue"
    assert "heartbeat at step 0 failed" in caplog.text
    service.down = False
    assert lease.beat() == "pause"


def test_a_refusal_other_than_superseded_is_logged_and_changes_no_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = Service()
    service.status = 403
    lease = keeper(service)
    with caplog.at_level(logging.ERROR):
        assert lease.beat() == "continue"
    assert "refused" in caplog.text and "forbidden" in caplog.text


def test_a_worker_told_to_stop_that_does_not_end_its_attempt_ends_its_process() -> None:
    """The attempt was lost as stalled: the training thread hangs, so nothing will ever close
    the reporter. After abandon_seconds the keeper ends the process for its supervisor."""
    service = Service(action="stop")
    exited = threading.Event()
    codes: list[int] = []

    def exit_(code: int) -> None:
        codes.append(code)
        exited.set()

    client = ServiceClient("http://service", "t", transport=httpx.MockTransport(service))
    lease = LeaseKeeper(
        client,
        attempt_id="att_1",
        fencing_token="secret",
        interval=0.01,
        step=0,
        abandon_seconds=0.05,
        exit=exit_,
    )
    lease.start()
    assert exited.wait(10), "the keeper did not end the hung process"
    lease.stop()
    assert codes == [70]


def test_an_attempt_that_stops_when_told_keeps_its_process() -> None:
    service = Service(action="stop")
    codes: list[int] = []
    client = ServiceClient("http://service", "t", transport=httpx.MockTransport(service))
    lease = LeaseKeeper(
        client,
        attempt_id="att_1",
        fencing_token="secret",
        interval=0.01,
        step=0,
        abandon_seconds=30,
        exit=codes.append,
    )
    lease.start()
    service.wait_for(1)
    lease.stop()  # the loop saw the order and the attempt ended: the keeper's wait ends too
    assert codes == []


def test_the_keeper_beats_three_times_a_lease_whatever_the_worker_setting(
    claim: Claim, tmp_path: Path
) -> None:
    claim = claim.model_copy(update={"lease_seconds": 9.0})
    client = ServiceClient("http://service", "t", transport=httpx.MockTransport(Service()))
    slow = ServiceReporter(client, claim, spool_dir=tmp_path, heartbeat_seconds=60)
    fast = ServiceReporter(client, claim, spool_dir=tmp_path, heartbeat_seconds=1)
    assert (slow.lease.interval, fast.lease.interval) == (3.0, 1.0)
