from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from contracts.reports import CheckpointRef, Claim, Finish
from worker.link.client import ServiceClient, ServiceUnavailable, Superseded
from worker.link.reporter import ServiceReporter, drain_spools
from worker.link.spool import Spool


class Clock:
    """A fake monotonic clock; `sleep` advances it and calls `on_sleep` (a service coming
    back while the reporter waits)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.on_sleep: Callable[[], None] = lambda: None

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.on_sleep()


class Service:
    """Answers like the service and logs what arrived; `down` makes every request fail to
    connect (a restart), `failing` answers 503 (a database outage)."""

    def __init__(self, *, action: str = "continue") -> None:
        self.action = action
        self.down = False
        self.failing = False
        self.superseded: set[str] = set()  # kinds answered 409 superseded
        self.refused_steps: set[int] = set()  # metric points answered as per-item errors
        self.received: list[str] = []
        self.beats: list[tuple[int, int]] = []  # (step, progress) of each heartbeat

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if self.failing:
            return httpx.Response(503, json={"error": {"code": "db", "message": "down"}})
        kind = request.url.path.rsplit("/", 1)[-1]
        body = json.loads(request.content)
        if kind in self.superseded:
            error = {"code": "superseded", "message": "stale token", "details": None}
            return httpx.Response(409, json={"error": error})
        if kind == "metrics":
            self.received.append(f"metrics:{','.join(str(p['step']) for p in body['points'])}")
            errors = [
                {"index": i, "error": "value is not finite"}
                for i, p in enumerate(body["points"])
                if p["step"] in self.refused_steps
            ]
            return httpx.Response(
                200, json={"accepted": len(body["points"]) - len(errors), "errors": errors}
            )
        if kind == "checkpoints":
            self.received.append(f"checkpoint:{body['checkpoint']['step']}")
        elif kind == "finish":
            self.received.append(f"finish:{body['status']}")
        else:
            self.received.append(kind)
        if kind == "heartbeat":
            self.beats.append((body["step"], body["progress"]))
            return httpx.Response(200, json={"action": self.action, "lease_seconds": 30})
        return httpx.Response(200, json={"accepted": 1})


def client_of(service: Service) -> ServiceClient:
    return ServiceClient(
        "http://service", "t", transport=httpx.MockTransport(service), retries=1, backoff_seconds=0
    )


def reporter_for(
    service: Service, claim: Claim, clock: Clock, spool_dir: Path, *, flush_seconds: float = 60
) -> ServiceReporter:
    return ServiceReporter(
        client_of(service),
        claim,
        spool_dir=spool_dir,
        heartbeat_seconds=5,
        flush_seconds=flush_seconds,
        clock=clock,
        sleep=clock.sleep,
    )


def ref(step: int) -> CheckpointRef:
    return CheckpointRef(path=f"/c/{step}", step=step, phase_index=0, phase_step=step)


def finish(step: int) -> Finish:
    return Finish(fencing_token="claim-secret-7", status="succeeded", step=step)


def test_metrics_are_batched_and_sent_when_due_and_before_each_fencing_check_and_checkpoint(
    claim: Claim, tmp_path: Path
) -> None:
    service, clock = Service(), Clock()
    reporter = reporter_for(service, claim, clock, tmp_path)
    for step in (1, 2, 3):
        reporter.metrics(step, {"loss": 1.0})
        clock.now += 2
        assert reporter.check(step) == "continue"
    # 6 s after the claim the buffered points are due; the loop's check sends no heartbeat
    # (the lease keeper's thread does, and it was not started here).
    assert service.received == ["metrics:1,2,3"]
    reporter.metrics(4, {"loss": 1.0})
    reporter.progress()
    assert reporter.check(4, now=True) == "continue"  # the fencing check: due or not
    # It carries the last step and the progress so far: four steps, one unit of other work,
    # and the fencing check itself (it comes after a checkpoint was written).
    assert service.beats == [(4, 6)]
    assert reporter.checkpoint(ref(4)) == frozenset()  # held, and nothing pinned
    assert service.received[1:] == ["metrics:4", "heartbeat", "checkpoint:4"]


def test_an_outage_spools_reports_to_disk_and_they_arrive_in_order_exactly_once(
    claim: Claim, tmp_path: Path
) -> None:
    service, clock = Service(), Clock()
    reporter = reporter_for(service, claim, clock, tmp_path)
    service.down = True
    reporter.metrics(1, {"loss": 1.0})
    assert reporter.checkpoint(ref(1)) is None  # spooled, not registered
    clock.now += 5
    assert reporter.check(1) == "continue"  # an unreachable service does not stop training
    service.down, service.failing = False, True  # back, but answering 503
    reporter.metrics(2, {"loss": 1.0})
    reporter.evals([])
    assert reporter.checkpoint(ref(2)) is None
    spool = tmp_path / claim.attempt_id
    files = sorted(p.name for p in spool.glob("*.json"))
    assert files == [f"{n:012d}.json" for n in range(4)]
    first = json.loads((spool / files[0]).read_text())
    assert first == {
        "kind": "metrics",
        "report": {
            "fencing_token": "claim-secret-7",
            "points": [{"name": "loss", "step": 1, "value": 1.0}],
        },
    }
    assert service.received == []

    service.failing = False
    clock.now += 5
    reporter.metrics(3, {"loss": 1.0})
    assert reporter.check(3) == "continue"  # the loop waits for the keeper to hear it back
    assert service.received == []
    assert reporter.lease.beat() == "continue"  # the keeper's next heartbeat gets through
    assert reporter.check(3) == "continue"
    assert service.received == [
        "heartbeat",
        "metrics:1",
        "checkpoint:1",
        "metrics:2",
        "checkpoint:2",
        "metrics:3",
    ]
    assert reporter.checkpoint(ref(3)) == frozenset()
    reporter.finish(finish(3))
    reporter.close()
    assert service.received[-2:] == ["checkpoint:3", "finish:succeeded"]
    assert not spool.exists()


def test_finish_waits_for_the_service_to_come_back(claim: Claim, tmp_path: Path) -> None:
    service, clock = Service(), Clock()
    reporter = reporter_for(service, claim, clock, tmp_path, flush_seconds=300)
    service.down = True
    reporter.metrics(1, {"loss": 1.0})
    sleeps = 0

    def back_after_three_waits() -> None:
        nonlocal sleeps
        sleeps += 1
        service.down = sleeps < 3

    clock.on_sleep = back_after_three_waits
    reporter.finish(finish(1))
    reporter.close()
    assert service.received == ["metrics:1", "finish:succeeded"]
    assert sleeps == 3 and clock.now == 115.0
    assert not (tmp_path / claim.attempt_id).exists()


def test_a_spool_left_on_disk_is_sent_by_the_next_process(claim: Claim, tmp_path: Path) -> None:
    service, clock = Service(), Clock()
    reporter = reporter_for(service, claim, clock, tmp_path, flush_seconds=10)
    service.down = True
    for step in (1, 2):
        reporter.metrics(step, {"loss": 1.0})
        reporter.checkpoint(ref(step))
    with pytest.raises(ServiceUnavailable, match=r"5 reports .* the finish last, are spooled"):
        reporter.finish(finish(2))
    reporter.close()  # the process gives up (or dies: the kernel releases its lock)
    assert len(list((tmp_path / claim.attempt_id).glob("*.json"))) == 5

    service.down = False
    drain_spools(client_of(service), tmp_path)  # a new worker process on this machine
    assert service.received == [
        "metrics:1",
        "checkpoint:1",
        "metrics:2",
        "checkpoint:2",
        "finish:succeeded",
    ]
    assert list(tmp_path.iterdir()) == []
    drain_spools(client_of(service), tmp_path)
    assert len(service.received) == 5  # exactly once


def test_draining_drops_reports_refused_as_stale_and_sends_the_rest(
    claim: Claim, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "attempt-old")
    spool.append(Finish(fencing_token="old-secret", status="preempted", step=4))
    spool.release()
    spool = Spool(tmp_path / "attempt-new")
    spool.append(Finish(fencing_token="new-secret", status="succeeded", step=9))
    spool.release()
    service = Service()

    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["fencing_token"] == "old-secret":
            error = {"code": "superseded", "message": "the fencing token is stale"}
            return httpx.Response(409, json={"error": error})
        return service(request)

    client = ServiceClient("http://s", "t", transport=httpx.MockTransport(handler), retries=0)
    with caplog.at_level(logging.WARNING):
        drain_spools(client, tmp_path)
    assert service.received == ["finish:succeeded"]
    assert "dropping spooled finish report 000000000000.json of attempt attempt-old" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_draining_leaves_alone_the_spool_of_a_live_process(claim: Claim, tmp_path: Path) -> None:
    service, clock = Service(), Clock()
    live = reporter_for(service, claim, clock, tmp_path)
    service.down = True
    live.metrics(1, {"loss": 1.0})
    live.checkpoint(ref(1))
    service.down = False
    drain_spools(client_of(service), tmp_path)
    assert service.received == []
    assert len(list((tmp_path / claim.attempt_id).glob("*.json"))) == 2
    live.close()


def test_a_stop_answer_ends_all_reporting_and_drops_the_spool(claim: Claim, tmp_path: Path) -> None:
    service, clock = Service(action="stop"), Clock()
    reporter = reporter_for(service, claim, clock, tmp_path)
    service.failing = True
    reporter.metrics(1, {"loss": 1.0})
    reporter.checkpoint(ref(1))
    assert reporter.check(1) == "continue"  # not due yet: no request
    service.failing = False
    service.superseded = {"metrics"}  # the spool is refused: the lease lapsed meanwhile
    service.action = "continue"  # (the keeper hears the service back before the refusal)
    assert reporter.lease.beat() == "continue"
    clock.now += 5
    with pytest.raises(Superseded):
        reporter.check(2)
    assert not (tmp_path / claim.attempt_id).exists()
    reporter.metrics(3, {"loss": 1.0})
    assert reporter.checkpoint(ref(3)) is None
    assert reporter.check(3, now=True) == "stop"
    assert service.received == ["heartbeat"]

    service = Service(action="stop")
    reporter = reporter_for(service, claim, clock, tmp_path)
    assert reporter.check(4, now=True) == "stop"
    reporter.metrics(4, {"loss": 1.0})
    assert reporter.checkpoint(ref(4)) is None
    assert service.received == ["heartbeat"]


def test_a_pause_answer_is_reported_to_the_loop(claim: Claim, tmp_path: Path) -> None:
    service, clock = Service(action="pause"), Clock()
    reporter = reporter_for(service, claim, clock, tmp_path)
    clock.now += 5
    assert reporter.check(1) == "continue"  # due, but a check only flushes: no heartbeat
    assert reporter.check(2, now=True) == "pause"
    assert reporter.check(3) == "pause"  # the order sticks
    assert reporter.checkpoint(ref(2)) == frozenset()  # a pausing attempt still reports
    assert service.received == ["heartbeat", "checkpoint:2"]


def test_an_order_the_lease_keeper_heard_reaches_the_loop_at_its_next_check(
    claim: Claim, tmp_path: Path
) -> None:
    service, clock = Service(action="pause"), Clock()
    reporter = reporter_for(service, claim, clock, tmp_path)
    reporter.metrics(1, {"loss": 1.0})
    assert reporter.lease.beat() == "pause"  # what the keeper's thread does every interval
    assert reporter.check(1) == "pause"  # not due: no request, the keeper's order
    assert service.received == ["heartbeat"]

    service.action = "stop"
    assert reporter.lease.beat() == "stop"
    assert reporter.check(2) == "stop"
    # Stopped: nothing more is sent, not even the buffered points of step 1.
    assert reporter.checkpoint(ref(2)) is None
    assert service.received == ["heartbeat", "heartbeat"]


def test_refused_metric_points_are_logged_by_name_and_step(
    claim: Claim, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service, clock = Service(), Clock()
    service.refused_steps = {2}
    reporter = reporter_for(service, claim, clock, tmp_path)
    for step in (1, 2, 3):
        reporter.metrics(step, {"loss": 1.0, "grad_norm": 2.0})
    with caplog.at_level(logging.WARNING):
        assert reporter.checkpoint(ref(3)) == frozenset()
    refused = [r.getMessage() for r in caplog.records if "refused metric point" in r.message]
    assert refused == [
        "attempt attempt-1: the service refused metric point 'loss' at step 2: value is not finite",
        "attempt attempt-1: the service refused metric point 'grad_norm' at step 2: "
        "value is not finite",
    ]
    assert service.received == ["metrics:1,1,2,2,3,3", "checkpoint:3"]
