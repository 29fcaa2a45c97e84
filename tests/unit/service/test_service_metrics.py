"""`GET /metrics` of the service on SQLite: the status gauges and the route label of requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.db import upgrade_database
from service.models import ATTEMPT_STATUSES, RUN_STATUSES
from service.settings import ServiceSettings


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = ServiceSettings(home=tmp_path / "home", data_root=tmp_path, broker_url="memory://")
    upgrade_database(settings.database_url)
    with TestClient(create_app(settings)) as client:
        yield client


def samples(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} (comments skipped)."""
    return {
        name: float(value)
        for line in text.splitlines()
        if line and not line.startswith("#")
        for name, value in [line.rsplit(" ", 1)]
    }


def test_run_and_attempt_gauges_export_every_status_at_zero(client: TestClient) -> None:
    scraped = samples(client.get("/metrics").text)
    for status in RUN_STATUSES:
        assert scraped[f'trainctl_runs{{status="{status}"}}'] == 0
    for status in ATTEMPT_STATUSES:
        assert scraped[f'trainctl_attempts{{status="{status}"}}'] == 0


def test_the_openapi_document_and_docs_are_labelled_as_their_routes(client: TestClient) -> None:
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert client.get(path).status_code == 200
    client.get("/no/such/route")
    scraped = samples(client.get("/metrics").text)
    for path in ("/openapi.json", "/docs", "/redoc"):
        labels = f'method="GET",route="{path}",status="200"'
        assert scraped[f"trainctl_http_request_duration_seconds_count{{{labels}}}"] == 1
    unmatched = (
        'trainctl_http_request_duration_seconds_count{method="GET",route="unmatched",status="404"}'
    )
    assert scraped[unmatched] == 1
