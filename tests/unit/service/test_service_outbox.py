"""The outbox carries attempts and jobs: each row is sent as its task, oldest first, to the
queue of its attempt's device count (jobs to the base queue), and stays for the next pass when
the broker refuses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from contracts.dispatch import EVALUATE_CHECKPOINT_TASK, INSPECT_DATASET_TASK, RUN_PHASE_TASK
from service.db import make_session_factory, upgrade_database
from service.models import Attempt, Job, OutboxMessage, Run, Workflow
from service.workers.dispatch import dispatch_pending


class Broker:
    """Records what would be sent; refuses every send from the `fail_from`-th on."""

    def __init__(self, fail_from: int | None = None) -> None:
        self.sent: list[tuple[str, list[Any], str]] = []
        self.fail_from = fail_from
        self.kwargs: list[dict[str, Any] | None] = []

    def send_task(
        self, name: str, *, args: list[Any], queue: str, kwargs: dict[str, Any] | None = None
    ) -> None:
        if self.fail_from is not None and len(self.sent) >= self.fail_from:
            raise ConnectionError("broker down")
        self.sent.append((name, args, queue))
        self.kwargs.append(kwargs)


@pytest.fixture
def sessions(tmp_path: Path) -> sessionmaker[Session]:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    upgrade_database(url)
    return make_session_factory(url)


def add_attempt(
    session: Session,
    *,
    run_id: str = "run_1",
    devices: int | None = None,
    queue: str | None = "q.worker.w1",
    member: int | None = None,
) -> str:
    # No relationships between the models: flush each parent before its child.
    if session.get(Workflow, "w" * 64) is None:
        session.add(Workflow(id="w" * 64, name="w", spec={}))
        session.flush()
    session.add(
        Run(
            id=run_id,
            workflow_id="w" * 64,
            name="r",
            signature="s" * 64,
            signature_components={},
            plan={},
            total_steps=1,
            max_restarts=0,
            max_preemptions=0,
        )
    )
    session.flush()
    attempt_id = run_id.replace("run_", "att_")
    # devices None: as a row written before device counts (the column's default, one).
    counted = {} if devices is None else {"devices": devices}
    session.add(Attempt(id=attempt_id, run_id=run_id, number=1, phase_index=0, **counted))
    session.flush()
    session.add(OutboxMessage(attempt_id=attempt_id, queue=queue, member=member))
    return attempt_id


def add_job(session: Session, job_id: str, kind: str) -> dict[str, Any]:
    request = {"path": f"/data/{job_id}.jsonl", "sequence_length": 64}
    session.add(Job(id=job_id, kind=kind, request=request))
    session.flush()
    session.add(OutboxMessage(job_id=job_id))
    return request


def send(sessions: sessionmaker[Session], broker: Broker) -> int:
    return dispatch_pending(session_factory=sessions, celery=broker, queue="q")


def test_attempts_and_jobs_are_sent_as_their_tasks_oldest_first(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        attempt_id = add_attempt(session)
        inspection = add_job(session, "job_1", "inspection")
        evaluation = add_job(session, "job_2", "evaluation")
        session.commit()
    broker = Broker()
    assert send(sessions, broker) == 3
    assert broker.sent == [
        (RUN_PHASE_TASK, [attempt_id], "q.worker.w1"),
        (INSPECT_DATASET_TASK, ["job_1", inspection], "q"),
        (EVALUATE_CHECKPOINT_TASK, ["job_2", evaluation], "q"),
    ]
    with sessions() as session:
        assert all(row.sent_at is not None for row in session.scalars(select(OutboxMessage)))
    assert send(sessions, broker) == 0


def test_a_job_refused_by_the_broker_stays_for_the_next_pass(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        add_job(session, "job_1", "inspection")
        add_job(session, "job_2", "inspection")
        session.commit()
    assert send(sessions, Broker(fail_from=1)) == 1
    broker = Broker()
    assert send(sessions, broker) == 1
    assert [args[0] for _, args, _ in broker.sent] == ["job_2"]


@pytest.mark.parametrize("targets", [{}, {"attempt_id": "att_1", "job_id": "job_1"}])
def test_an_outbox_row_names_exactly_one_attempt_or_job(
    sessions: sessionmaker[Session], targets: dict[str, str]
) -> None:
    with sessions() as session:
        add_attempt(session)
        add_job(session, "job_1", "inspection")
        session.commit()
        session.add(OutboxMessage(**targets))
        with pytest.raises(IntegrityError, match="one_target"):
            session.commit()


def test_a_placed_attempt_goes_to_its_workers_queue_and_a_job_to_the_base_queue(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        single = add_attempt(session, run_id="run_1", queue="q.worker.a")
        gang = add_attempt(session, run_id="run_2", devices=2, queue="q.worker.b", member=1)
        inspection = add_job(session, "job_1", "inspection")
        # A row from before placement (no queue): marked sent, never sent: placement sends.
        old = add_attempt(session, run_id="run_3", queue=None)
        session.commit()
    broker = Broker()
    assert send(sessions, broker) == 3
    assert broker.sent == [
        (RUN_PHASE_TASK, [single], "q.worker.a"),
        (RUN_PHASE_TASK, [gang], "q.worker.b"),
        (INSPECT_DATASET_TASK, ["job_1", inspection], "q"),
    ]
    # Member k of a multi-node attempt is told which it is; a single one gets no kwarg.
    assert broker.kwargs == [None, {"member": 1}, None]
    with sessions() as session:
        row = session.scalars(select(OutboxMessage).where(OutboxMessage.attempt_id == old)).one()
        assert row.sent_at is not None
    assert send(sessions, broker) == 0


def test_each_send_of_a_job_counts_as_one_delivery_and_a_refused_one_does_not(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        add_job(session, "job_1", "inspection")
        add_job(session, "job_2", "inspection")
        session.commit()
    assert send(sessions, Broker(fail_from=1)) == 1
    with sessions() as session:
        # Sent again after its worker went silent (service.workers.reaper.requeue_stale_jobs).
        session.add(OutboxMessage(job_id="job_1"))
        session.commit()
    assert send(sessions, Broker()) == 2
    with sessions() as session:
        deliveries = {job.id: job.deliveries for job in session.scalars(select(Job))}
    assert deliveries == {"job_1": 2, "job_2": 1}
