"""The worker's Celery app. A message carries only an attempt id; the service's database is
the truth, and the claim decides who works on what."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

import httpx
from celery import Celery
from celery.signals import setup_logging, worker_ready, worker_shutdown

from contracts.dispatch import served_queues, worker_key, worker_queue
from contracts.reports import WorkerPing
from runtime.broker import broker_options
from runtime.logs import configure_logging
from worker.link.client import WorkerAuth
from worker.process.launch import owned_devices
from worker.settings import WorkerSettings, get_settings

log = logging.getLogger(__name__)

# Redis redelivers a message not acknowledged within this time to another worker. Messages
# are acknowledged when the task ends (acks_late) and a phase may train for hours, so it is
# longer than any phase; a duplicate delivery would in any case lose the claim and be dropped.
VISIBILITY_TIMEOUT_SECONDS = 12 * 3600


class WorkerApp(Celery):
    """The Celery app together with the settings it was configured from, which its tasks use."""

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__("trainctl-worker", include=["worker.process.tasks"])
        self.settings = settings
        self.configure(settings)

    def configure(self, settings: WorkerSettings) -> None:
        self.settings = settings
        broker_url, transport_options = broker_options(settings.broker_url)
        self.conf.update(
            broker_url=broker_url,
            # Transports ignore options they do not know (the filesystem one has no timeout).
            broker_transport_options={
                **transport_options,
                "visibility_timeout": VISIBILITY_TIMEOUT_SECONDS,
            },
            broker_connection_retry_on_startup=True,
            task_default_queue=settings.queue,
            # Acknowledge when the task ends, not when it starts: a worker that dies mid-phase
            # leaves its message to be delivered again (the claim then drops the duplicate).
            task_acks_late=True,
            # ...including when the process running it is killed (SIGKILL, OOM killer).
            task_reject_on_worker_lost=True,
            # One process is one training slot: reserve no message that another idle worker
            # could start now.
            worker_prefetch_multiplier=1,
            # Task arguments are ids; JSON only, never pickle from the broker.
            task_serializer="json",
            result_serializer="json",
            accept_content=["json"],
            # Outcomes are reported to the service over HTTP; there is no result backend.
            task_ignore_result=True,
        )


app = WorkerApp(get_settings())


@setup_logging.connect
def _setup_logging(**_: Any) -> None:
    # Connected, so Celery leaves the root logger to us: one format for every line.
    configure_logging(app.settings.log_format, app.settings.log_level)


# This process's life: a pid reused after a restart makes another key.
_BOOT = secrets.token_hex(4)


def own_key() -> str:
    """This worker process's key (contracts.dispatch.worker_key): the service sends the
    attempts it places here to `worker_queue(queue, own_key())`, and the ping announces it."""
    return worker_key(socket.gethostname(), os.getpid(), _BOOT)


def worker_version() -> str:
    try:
        return package_version("trainctl")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def ping_service(settings: WorkerSettings, stopped: threading.Event) -> None:
    """POST /internal/workers/ping now and every `heartbeat_seconds` until `stopped`, so the
    service lists this worker (GET /workers) and knows a queued run has someone to take it,
    even while no attempt runs here, and how many devices of which kind it owns. A failed
    ping is logged when pinging starts failing and when it works again, and is otherwise
    harmless: the next one says the same."""
    kind, ids = owned_devices(settings)
    ping = WorkerPing(
        hostname=socket.gethostname(),
        # The claiming process: the solo pool trains in this one (start_worker).
        pid=os.getpid(),
        version=worker_version(),
        queue=settings.queue,
        devices=len(ids),
        device_kind=kind,
        worker=own_key(),
        address=settings.advertise_address or socket.gethostname(),
    )
    failing = False
    auth = WorkerAuth.of(settings)
    with httpx.Client(base_url=settings.api_url, auth=auth, timeout=5.0) as http:
        while True:
            try:
                http.post("/internal/workers/ping", json=ping.model_dump()).raise_for_status()
                if failing:
                    log.info("ping to %s works again", settings.api_url)
                failing = False
            except httpx.HTTPError as err:
                if not failing:
                    log.warning("ping to %s failed (%s); retrying quietly", settings.api_url, err)
                failing = True
            if stopped.wait(settings.heartbeat_seconds):
                return


_stop_pinging = threading.Event()


@worker_ready.connect
def _start_pinging(**_: Any) -> None:
    # Ready: connected to the broker and consuming, so able to take a queued run.
    threading.Thread(
        target=ping_service, args=(app.settings, _stop_pinging), name="ping", daemon=True
    ).start()


@worker_shutdown.connect
def _end_pinging(**_: Any) -> None:
    _stop_pinging.set()


def start_worker(settings: WorkerSettings, extra_args: Sequence[str] = ()) -> None:
    """Run a worker process in the foreground until it is stopped. The solo pool trains in this
    very process: one process is one training slot, and SIGKILL kills the training with it."""
    app.configure(settings)
    if settings.metrics_port is not None:
        from worker.metrics import serve

        serve(settings.metrics_port)
    # Its own queue, where the service sends the attempts it places here, and the base queue
    # (jobs; the queues of every rank count its devices can run, for a service from before
    # placement: contracts.dispatch).
    own = worker_queue(settings.queue, own_key())
    queues = ",".join([own, *served_queues(settings.queue, len(owned_devices(settings)[1]))])
    app.worker_main(["worker", "--pool=solo", "--concurrency=1", "-Q", queues, *extra_args])
