from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from contracts.reports import (
    MAX_POINTS_PER_BATCH,
    MAX_REPORT_BYTES,
    ClaimRequest,
    Finish,
    Heartbeat,
    MetricPoint,
)
from worker.link.client import (
    ServiceClient,
    ServiceError,
    ServiceUnavailable,
    Superseded,
    WorkerAuth,
)
from worker.settings import WorkerSettings


def client_answering(
    handler: Callable[[httpx.Request], httpx.Response], *, retries: int = 3
) -> ServiceClient:
    """A real client whose transport answers in-process instead of over a socket."""
    return ServiceClient(
        "http://service",
        "worker-token",
        transport=httpx.MockTransport(handler),
        retries=retries,
        backoff_seconds=0,
    )


def error(status: int, code: str, message: str = "no") -> httpx.Response:
    return httpx.Response(
        status, json={"error": {"code": code, "message": message, "details": None}}
    )


def test_requests_carry_the_worker_token_and_json_bodies() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"action": "continue", "lease_seconds": 30})

    answer = client_answering(handler).heartbeat(
        "a1", Heartbeat(fencing_token="secret-a1", step=9, progress=4)
    )
    assert answer.action == "continue"
    (request,) = seen
    assert request.url.path == "/internal/attempts/a1/heartbeat"
    assert request.headers["authorization"] == "Bearer worker-token"
    assert json.loads(request.content) == {
        "fencing_token": "secret-a1",
        "step": 9,
        "progress": 4,
    }


def test_a_worker_token_file_is_read_at_each_request(tmp_path: Path) -> None:
    """The embedded stack's workers read <home>/worker-token per request: a rotation rewrites
    it, and the next request carries the new secret, no restart."""
    file = tmp_path / "worker-token"
    file.write_text("first\n")
    settings = WorkerSettings(worker_token="from-env", worker_token_file=file)
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["authorization"])
        return httpx.Response(200, json={"action": "continue", "lease_seconds": 30})

    client = ServiceClient(
        "http://service", WorkerAuth.of(settings), transport=httpx.MockTransport(handler)
    )
    beat = Heartbeat(fencing_token="secret-a1", step=1)
    client.heartbeat("a1", beat)
    file.write_text("rotated\n")
    client.heartbeat("a1", beat)
    file.unlink()  # unreadable: the environment's token meanwhile
    client.heartbeat("a1", beat)
    assert seen == ["Bearer first", "Bearer rotated", "Bearer from-env"]


@pytest.mark.parametrize("code", ["already_claimed", "superseded"])
def test_a_stale_claim_answers_none(code: str) -> None:
    client = client_answering(lambda _: error(409, code))
    assert client.claim("a1", ClaimRequest(hostname="h", pid=1, nonce="n1")) is None


def test_another_conflict_on_claim_is_an_error() -> None:
    client = client_answering(lambda _: error(409, "run_cancelled", "the run was cancelled"))
    with pytest.raises(ServiceError, match="run_cancelled: the run was cancelled"):
        client.claim("a1", ClaimRequest(hostname="h", pid=1, nonce="n1"))


def test_superseded_on_a_report_raises() -> None:
    client = client_answering(lambda _: error(409, "superseded", "the fencing token is stale"))
    with pytest.raises(Superseded, match="stale"):
        client.finish("a1", Finish(fencing_token="stale", status="succeeded", step=10))


def test_server_errors_are_retried_a_bounded_number_of_times() -> None:
    calls = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return (
            error(503, "unavailable")
            if len(calls) < 3
            else httpx.Response(200, json={"accepted": 1})
        )

    assert (
        client_answering(flaky)
        .finish("a1", Finish(fencing_token="secret", status="succeeded", step=1))
        .accepted
        == 1
    )
    assert len(calls) == 3

    calls.clear()

    def broken(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return error(500, "boom")

    always = client_answering(broken, retries=2)
    with pytest.raises(ServiceUnavailable, match="500"):
        always.finish("a1", Finish(fencing_token="secret", status="succeeded", step=1))
    assert len(calls) == 3


def test_client_errors_are_not_retried() -> None:
    calls = []

    def bad(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return error(422, "invalid", "step must be >= 0")

    with pytest.raises(ServiceError, match="422 invalid: step must be >= 0") as caught:
        client_answering(bad).finish(
            "a1", Finish(fencing_token="secret", status="succeeded", step=1)
        )
    assert not isinstance(caught.value, ServiceUnavailable)  # an answer, not an outage
    assert len(calls) == 1


def test_an_unreachable_service_fails_after_the_retries() -> None:
    calls = []

    def down(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(ServiceUnavailable, match="unreachable after 3 tries"):
        client_answering(down, retries=2).heartbeat("a1", Heartbeat(fencing_token="secret", step=1))
    assert len(calls) == 3


def test_metrics_are_split_into_batches_the_service_takes() -> None:
    sizes = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert len(request.content) <= MAX_REPORT_BYTES
        points = json.loads(request.content)["points"]
        sizes.append(len(points))
        return httpx.Response(200, json={"accepted": len(points)})

    n = 2 * MAX_POINTS_PER_BATCH + 500
    points = [MetricPoint(name="loss", step=i, value=1.0) for i in range(n)]
    accepted = client_answering(handler).metrics("a1", fencing_token="secret", points=points)
    assert sizes == [MAX_POINTS_PER_BATCH, MAX_POINTS_PER_BATCH, 500]
    assert accepted.accepted == n
    # Names of the longest stored size: cut by bytes, well before the point count.
    sizes.clear()
    long = [MetricPoint(name="ü" * 200, step=i, value=1.0) for i in range(n)]
    assert client_answering(handler).metrics("a1", fencing_token="s", points=long).accepted == n
    assert len(sizes) > 3 and sum(sizes) == n


def test_metric_errors_are_answered_with_indexes_into_all_the_points() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        points = json.loads(request.content)["points"]
        bad = [i for i, p in enumerate(points) if p["step"] % 700 == 0]
        errors = [{"index": i, "error": "refused"} for i in bad]
        return httpx.Response(200, json={"accepted": len(points) - len(bad), "errors": errors})

    points = [MetricPoint(name="loss", step=i, value=1.0) for i in range(1, 1500)]
    answer = client_answering(handler).metrics("a1", fencing_token="secret", points=points)
    assert answer.accepted == 1497
    assert [points[e.index].step for e in answer.errors] == [700, 1400]
