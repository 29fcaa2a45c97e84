from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from contracts.reports import CheckpointRef, Claim
from contracts.workflow import Workflow
from worker.client import ServiceClient, ServiceUnavailable
from worker.reporter import ServiceReporter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Service:
    """Answers like the service and logs what arrived; `down` makes every request fail to
    connect, as during a service restart."""

    def __init__(self, *, stop: bool = False) -> None:
        self.stop = stop
        self.down = False
        self.received: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        kind = request.url.path.rsplit("/", 1)[-1]
        body = json.loads(request.content)
        if kind == "metrics":
            self.received.append(f"metrics:{','.join(str(p['step']) for p in body['points'])}")
        elif kind == "checkpoints":
            self.received.append(f"checkpoint:{body['checkpoint']['step']}")
        else:
            self.received.append(kind)
        if kind == "heartbeat":
            action = "stop" if self.stop else "continue"
            return httpx.Response(200, json={"action": action, "lease_seconds": 30})
        return httpx.Response(200, json={"accepted": 1})


@pytest.fixture
def claim(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_text_file: Callable[..., Path],
) -> Claim:
    phase = {"name": "p", "objective": "continued_pretrain", "data": [make_text_file()], "steps": 9}
    return make_claim(make_workflow([phase]))


def reporter_for(service: Service, claim: Claim, clock: Clock) -> ServiceReporter:
    client = ServiceClient(
        "http://service", "t", transport=httpx.MockTransport(service), retries=1, backoff_seconds=0
    )
    return ServiceReporter(client, claim, heartbeat_seconds=5, clock=clock)


def ref(step: int) -> CheckpointRef:
    return CheckpointRef(path=f"/c/{step}", step=step, phase_index=0, phase_step=step)


def test_metrics_are_batched_and_sent_before_each_heartbeat_and_checkpoint(claim: Claim) -> None:
    service, clock = Service(), Clock()
    reporter = reporter_for(service, claim, clock)
    for step in (1, 2, 3):
        reporter.metrics(step, {"loss": 1.0})
        clock.now += 2
        assert reporter.should_stop(step) is False
    # 6 s after the claim: one heartbeat, after the buffered points.
    assert service.received == ["metrics:1,2,3", "heartbeat"]
    reporter.metrics(4, {"loss": 1.0})
    assert reporter.checkpoint(ref(4)) is True
    assert service.received[2:] == ["metrics:4", "checkpoint:4"]


def test_training_outlives_a_service_outage_and_reports_in_order(claim: Claim) -> None:
    service, clock = Service(), Clock()
    reporter = reporter_for(service, claim, clock)
    service.down = True
    reporter.metrics(1, {"loss": 1.0})
    assert reporter.checkpoint(ref(1)) is False  # queued, not registered
    clock.now += 5
    assert reporter.should_stop(1) is False  # a failed heartbeat does not stop training
    reporter.metrics(2, {"loss": 1.0})
    with pytest.raises(ServiceUnavailable, match="undelivered"):
        reporter.flush()
    assert service.received == []

    service.down = False
    clock.now += 5
    reporter.metrics(3, {"loss": 1.0})
    assert reporter.should_stop(3) is False
    assert service.received == ["metrics:1", "checkpoint:1", "metrics:2", "metrics:3", "heartbeat"]
    reporter.flush()


def test_a_stop_answer_is_reported_to_the_loop(claim: Claim) -> None:
    service, clock = Service(stop=True), Clock()
    reporter = reporter_for(service, claim, clock)
    assert reporter.should_stop(1) is False  # not due yet: no request
    clock.now += 5
    assert reporter.should_stop(2) is True
    assert service.received == ["heartbeat"]
