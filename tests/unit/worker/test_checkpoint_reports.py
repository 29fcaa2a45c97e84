"""What the worker tells the service about its checkpoints beyond registering them: the pinned
steps a registration's answer hands back, and removals (deletions by retention, quarantines)
that are spooled through an outage like every report and never stop training when refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from contracts.reports import CheckpointRef, CheckpointRemoval, Claim, Finish
from worker.link.client import ServiceClient
from worker.link.reporter import ServiceReporter, drain_spools
from worker.link.spool import Spool


class Service:
    """The checkpoint routes of the service: registrations answer `pinned`, removals are
    logged (or refused as pinned when their step is in `refused`); `down` refuses to connect."""

    def __init__(self, *, pinned: list[int] | None = None) -> None:
        self.pinned = pinned or []
        self.refused: set[int] = set()
        self.down = False
        self.received: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        body = json.loads(request.content)
        path = request.url.path
        if path.endswith("/checkpoints/removals"):
            if body["step"] in self.refused:
                error = {"code": "checkpoint_pinned", "message": "run B needs it", "details": {}}
                return httpx.Response(409, json={"error": error})
            self.received.append(f"{body['status']}:{body['step']}:{body['reason']}")
            return httpx.Response(200, json={"accepted": 1})
        if path.endswith("/checkpoints"):
            self.received.append(f"checkpoint:{body['checkpoint']['step']}")
            return httpx.Response(200, json={"accepted": 1, "pinned_steps": self.pinned})
        self.received.append(path.rsplit("/", 1)[-1])
        return httpx.Response(200, json={"accepted": 1})


def client_of(service: Service) -> ServiceClient:
    return ServiceClient(
        "http://service", "t", transport=httpx.MockTransport(service), retries=0, backoff_seconds=0
    )


def reporter_for(service: Service, claim: Claim, spool_dir: Path) -> ServiceReporter:
    return ServiceReporter(
        client_of(service), claim, spool_dir=spool_dir, heartbeat_seconds=5, flush_seconds=0
    )


def ref(step: int) -> CheckpointRef:
    return CheckpointRef(path=f"/c/{step}", step=step, phase_index=0, phase_step=step)


def test_a_registration_hands_back_the_pinned_steps_only_when_the_service_took_it(
    claim: Claim, tmp_path: Path
) -> None:
    service = Service(pinned=[2, 4])
    reporter = reporter_for(service, claim, tmp_path)
    assert reporter.checkpoint(ref(6)) == frozenset({2, 4})
    service.down = True
    # Queued: the pins of an earlier answer may be stale, so none are handed back and
    # retention waits for a registration the service took.
    assert reporter.checkpoint(ref(8)) is None
    reporter.close()


def test_removals_are_spooled_through_an_outage_and_sent_in_order(
    claim: Claim, tmp_path: Path
) -> None:
    service = Service()
    reporter = reporter_for(service, claim, tmp_path)
    service.down = True
    reporter.checkpoint_removed(4, "deleted", "retention: keep_last 2, step 8 registered")
    reporter.checkpoint_removed(6, "quarantined", "failed verification: " + "x" * 5000)
    first, _ = Spool(tmp_path / claim.attempt_id).entries()
    assert json.loads(first.read_text()) == {
        "kind": "removal",
        "report": {
            "fencing_token": claim.fencing_token,
            "step": 4,
            "status": "deleted",
            "reason": "retention: keep_last 2, step 8 registered",
        },
    }
    assert service.received == []

    service.down = False
    reporter.finish(Finish(fencing_token=claim.fencing_token, status="succeeded", step=9))
    reporter.close()
    assert [r.split(":", 2)[:2] for r in service.received] == [
        ["deleted", "4"],
        ["quarantined", "6"],
        ["finish"],
    ]
    # A reason longer than the contract allows is cut, not refused.
    assert len(service.received[1].split(":", 2)[2]) == 2000


def test_a_refused_removal_is_logged_and_training_goes_on(
    claim: Claim, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = Service()
    service.refused = {4}
    reporter = reporter_for(service, claim, tmp_path)
    with caplog.at_level(logging.ERROR, logger="worker.link.reporter"):
        reporter.checkpoint_removed(4, "deleted", "retention")
    assert "refused the deleted report of step 4" in caplog.text
    assert "checkpoint_pinned" in caplog.text
    reporter.checkpoint_removed(6, "deleted", "retention")
    assert service.received == ["deleted:6:retention"]
    reporter.close()


def test_a_removal_says_whether_the_service_recorded_it(claim: Claim, tmp_path: Path) -> None:
    """Retention deletes a directory only once the service recorded its deletion."""
    service = Service()
    service.refused = {4}
    reporter = reporter_for(service, claim, tmp_path)
    assert reporter.checkpoint_removed(2, "deleted", "retention") is True
    assert reporter.checkpoint_removed(4, "deleted", "retention") is False  # pinned
    service.down = True
    assert reporter.checkpoint_removed(6, "deleted", "retention") is False  # spooled
    service.down = False
    assert reporter.checkpoint_removed(8, "deleted", "retention") is False  # behind the spool
    assert service.received == ["deleted:2:retention"]
    reporter.close()


def test_a_removal_left_in_a_spool_is_sent_by_the_next_process(
    claim: Claim, tmp_path: Path
) -> None:
    spool = Spool(tmp_path / claim.attempt_id)
    removal = CheckpointRemoval(
        fencing_token=claim.fencing_token, step=4, status="quarantined", reason="bad manifest"
    )
    assert spool.read(spool.append(removal)) == removal
    spool.release()
    service = Service()
    drain_spools(client_of(service), tmp_path)
    assert service.received == ["quarantined:4:bad manifest"]
    assert not (tmp_path / claim.attempt_id).exists()
