"""What the worker does with a service that refuses a report for good, or that it cannot
reach: the loop is never held back, neither by a report that will never be taken nor by the
client's retries while the service is down."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from test_runner import InProcessService, attempt, conflict

from contracts.reports import CheckpointRef, Claim
from contracts.workflow import Workflow
from worker.link.client import ServiceClient
from worker.link.reporter import ServiceReporter
from worker.settings import WorkerSettings


class Service:
    """Counts every request; `refuse` answers 422 to that kind; `down` refuses connections."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.refuse: str | None = None
        self.down = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        kind = request.url.path.rsplit("/", 1)[-1]
        self.requests.append(kind)
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if kind == self.refuse:
            error = {"code": "invalid_request", "message": "no", "details": None}
            return httpx.Response(422, json={"error": error})
        if kind == "heartbeat":
            return httpx.Response(200, json={"action": "continue", "lease_seconds": 30})
        if kind == "metrics":
            points = json.loads(request.content)["points"]
            return httpx.Response(200, json={"accepted": len(points), "errors": []})
        if kind == "checkpoints":
            return httpx.Response(200, json={"accepted": 1, "pinned_steps": []})
        return httpx.Response(200, json={"accepted": 1})


def reporter_for(service: Service, claim: Claim, tmp_path: Path) -> ServiceReporter:
    client = ServiceClient("http://service", "t", transport=httpx.MockTransport(service), retries=2)
    return ServiceReporter(client, claim, spool_dir=tmp_path, heartbeat_seconds=0.001)


def ref(step: int) -> CheckpointRef:
    return CheckpointRef(path=f"/c/step-{step:08d}", step=step, phase_index=0, phase_step=step)


def test_a_report_refused_for_good_is_dropped_and_does_not_hold_back_the_rest(
    claim: Claim, tmp_path: Path
) -> None:
    service = Service()
    reporter = reporter_for(service, claim, tmp_path)
    service.refuse = "evals"
    reporter.evals([])  # nothing to send
    reporter.metrics(1, {"loss": 1.0})
    service.refuse = "metrics"
    assert reporter.checkpoint(ref(1)) == frozenset()  # the refused points are dropped
    service.refuse = None
    reporter.metrics(2, {"loss": 1.0})
    assert reporter.check(2, now=True) == "continue"
    assert service.requests == ["metrics", "checkpoints", "metrics", "heartbeat"]
    assert not list((tmp_path / claim.attempt_id).glob("*.json"))


def test_while_the_keeper_cannot_reach_the_service_the_loop_makes_no_request(
    claim: Claim, tmp_path: Path
) -> None:
    """Each request to a service that is down costs the client's retries (seconds): the loop
    spools at once and leaves the probing to the keeper's heartbeats."""
    service = Service()
    reporter = reporter_for(service, claim, tmp_path)
    service.down = True
    assert reporter.lease.beat() == "continue" and not reporter.lease.reachable
    assert service.requests == ["heartbeat"] * 3  # the keeper's one beat, with its retries
    service.requests.clear()
    reporter.metrics(1, {"loss": 1.0})
    assert reporter.checkpoint(ref(1)) is None  # spooled, not taken
    assert reporter.check(1) == "continue"
    assert reporter.check(1, now=True) == "continue"
    spooled = sorted((tmp_path / claim.attempt_id).glob("*.json"))
    assert len(spooled) == 2 and service.requests == []  # the loop tried nothing
    service.down = False
    assert reporter.lease.beat() == "continue" and reporter.lease.reachable
    assert reporter.check(2) == "continue"
    assert service.requests == ["heartbeat", "metrics", "checkpoints"]


class RefusingSuccess(InProcessService):
    """Refuses a `succeeded` finish as the service does when it cannot verify it."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/finish"):
            body: dict[str, Any] = json.loads(request.content)
            if body["status"] == "succeeded":
                self.posts.append(("finish", body))
                return conflict("unverified_finish")
        return super().__call__(request)


def test_a_refused_success_ends_the_attempt_as_an_infrastructure_failure(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_pairs_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """Without an ending the service believes, the attempt would sit `running` until its
    lease lapsed; a failed finish lets the run recover from its latest checkpoint now."""
    phase = {"name": "sft", "objective": "qa_reasoning", "data": [make_pairs_file()], "steps": 2}
    settings = WorkerSettings(
        home=tmp_path / "home",
        device="cpu",
        heartbeat_seconds=3600,
        spool_flush_seconds=0,
        data_roots=(tmp_path.parent,),  # the session's tokenizer and this test's files
    )
    service = RefusingSuccess(make_claim(make_workflow([phase])))
    assert attempt(service, settings) is None
    succeeded, failed = service.of("finish")
    assert succeeded["status"] == "succeeded"
    assert (failed["status"], failed["cause"]) == ("failed", "infrastructure")
    assert "finish refused" in failed["message"] and "unverified_finish" in failed["message"]


def test_the_first_report_that_finds_the_service_down_stops_the_loop_trying(
    claim: Claim, tmp_path: Path
) -> None:
    """One retry cycle is paid once, by the report that finds the outage, not again by every
    flush until the keeper's own heartbeat fails too."""
    service = Service()
    reporter = reporter_for(service, claim, tmp_path)
    service.down = True
    reporter.metrics(1, {"loss": 1.0})
    assert reporter.check(1, now=True) == "continue"  # the fencing check before a checkpoint
    assert service.requests == ["metrics"] * 3  # one try and its two retries, and no beat
    assert not reporter.lease.reachable
    reporter.metrics(2, {"loss": 1.0})
    assert reporter.check(2) == "continue"
    assert reporter.checkpoint(ref(2)) is None
    assert service.requests == ["metrics"] * 3  # nothing more
