"""Celery tasks: thin adapters from a message to a plain function."""

from __future__ import annotations

import threading
from typing import Any

from celery import Task
from celery.exceptions import Reject
from celery.signals import worker_ready, worker_shutting_down

from contracts.dispatch import (
    DIGEST_INPUT_TASK,
    EVALUATE_CHECKPOINT_TASK,
    INSPECT_DATASET_TASK,
    PREPARE_DATASET_TASK,
    RUN_PHASE_TASK,
)
from contracts.jobs import JobKind
from worker.link.client import ServiceClient, ServiceUnavailable
from worker.link.reporter import drain_spools
from worker.process.celery_app import app
from worker.process.jobs import run_job
from worker.process.runner import run_attempt

# Set by a warm shutdown (SIGTERM: the preemption notice of a spot instance). The running
# phase then checkpoints at once and finishes as "preempted"; Celery exits after the task.
_preempted = threading.Event()


@worker_shutting_down.connect
def _on_worker_shutting_down(**_: Any) -> None:
    _preempted.set()


@worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    # Reports a previous process on this machine spooled and never sent (it died, or the service
    # stayed down past its flush): sent before any new work. `run_attempt` drains too; this only
    # sends them sooner, when no message comes.
    with ServiceClient.from_settings(app.settings) as client:
        drain_spools(client, app.settings.spool_dir)


# Every task: shared=False, registered on this app only, not on every Celery app of the process.
# A service that cannot be reached is retried later with backoff (bounded): the message must not
# be lost while its attempt or job waits, unclaimed, in the database. A retried message that
# finds its attempt claimed meanwhile is dropped by the claim.
_TASK: dict[str, Any] = {
    "shared": False,
    "autoretry_for": (ServiceUnavailable,),
    "retry_backoff": 30,
    "retry_backoff_max": 600,
    "max_retries": 8,
}


@app.task(name=RUN_PHASE_TASK, bind=True, **_TASK)
def run_phase(self: Task, attempt_id: str, member: int = 0) -> None:
    """Attempt `attempt_id`, or this worker's part of it (`member` k of an attempt across
    many workers: the service sends each member its own message on its own queue)."""
    if _preempted.is_set():
        # A worker that received its preemption notice may still be handed one more message
        # while it drains; claiming it would only preempt it again. Back to the queue with it.
        raise Reject(f"attempt {attempt_id}: this worker is shutting down", requeue=True)
    # The task id is the same across Celery's retries of this message: the claim's nonce too.
    run_attempt(
        attempt_id,
        settings=app.settings,
        stop_requested=_preempted.is_set,
        delivery=self.request.id,
        member=member,
    )


def _run_job(kind: JobKind, job_id: str, request: dict[str, Any]) -> None:
    if _preempted.is_set():
        raise Reject(f"{kind} job {job_id}: this worker is shutting down", requeue=True)
    run_job(kind, job_id, request, settings=app.settings)


# Jobs: a failure of the work is the job's outcome (posted, never retried); only a service that
# cannot be reached is retried, boundedly, as for run_phase.
@app.task(name=INSPECT_DATASET_TASK, **_TASK)
def inspect_dataset(job_id: str, request: dict[str, Any]) -> None:
    _run_job("inspection", job_id, request)


@app.task(name=PREPARE_DATASET_TASK, **_TASK)
def prepare_dataset(job_id: str, request: dict[str, Any]) -> None:
    _run_job("preparation", job_id, request)


@app.task(name=EVALUATE_CHECKPOINT_TASK, **_TASK)
def evaluate_checkpoint(job_id: str, request: dict[str, Any]) -> None:
    _run_job("evaluation", job_id, request)


@app.task(name=DIGEST_INPUT_TASK, **_TASK)
def digest_input(job_id: str, request: dict[str, Any]) -> None:
    _run_job("digest", job_id, request)
