"""The worker token is a secret in the worker's settings: never in their repr, their str, their
JSON or a log line, yet sent whole to the service, by the client and by the ping."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from contracts.reports import Heartbeat
from worker.link.client import ServiceClient
from worker.process.celery_app import ping_service
from worker.settings import WorkerSettings

TOKEN = "wkr-7Qx2fz9LmTbc4R1s"


class Service(ThreadingHTTPServer):
    """A local HTTP server that keeps the Authorization header of every request and answers
    as the service answers a heartbeat (and, harmlessly, a ping)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.authorizations: list[str | None] = []
        self.pinged = threading.Event()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: Service

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.authorizations.append(self.headers.get("Authorization"))
        if self.path == "/internal/workers/ping":
            self.server.pinged.set()
        body = json.dumps({"action": "continue", "lease_seconds": 30}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # the test reads the headers it kept, not stderr


@pytest.fixture
def service() -> Iterator[Service]:
    server = Service()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_worker_token_is_in_no_repr_str_json_or_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TRAINCTL_WORKER_TOKEN", TOKEN)
    settings = WorkerSettings()
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("worker").info("settings: %s; %r", settings, settings)
    shown = {
        "repr": repr(settings),
        "str": str(settings),
        "json": settings.model_dump_json(),
        "log": caplog.text,
    }
    assert [where for where, text in shown.items() if TOKEN in text] == []
    assert "worker_token=SecretStr('**********')" in shown["repr"]


def test_the_client_and_the_ping_send_the_whole_token_and_log_none_of_it(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    settings = WorkerSettings(api_url=service.url, worker_token=TOKEN, heartbeat_seconds=60)
    stopped = threading.Event()
    with caplog.at_level(logging.DEBUG):
        with ServiceClient.from_settings(settings) as client:
            client.heartbeat("a1", Heartbeat(fencing_token="secret-a1", step=1))
        pinging = threading.Thread(target=ping_service, args=(settings, stopped))
        pinging.start()
        assert service.pinged.wait(timeout=30)
        stopped.set()
        pinging.join(timeout=30)
    assert service.authorizations == [f"Bearer {TOKEN}"] * 2
    assert TOKEN not in caplog.text
