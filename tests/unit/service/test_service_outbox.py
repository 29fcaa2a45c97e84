"""The outbox carries attempts and jobs: each row is sent as its task, oldest first, and stays
for the next pass when the broker refuses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from contracts.dispatch import EVALUATE_CHECKPOINT_TASK, INSPECT_DATASET_TASK, RUN_PHASE_TASK
from service.db import make_session_factory, upgrade_database
from service.dispatch import dispatch_pending
from service.models import Attempt, Job, OutboxMessage, Run, Workflow


class Broker:
    """Records what would be sent; refuses every send from the `fail_from`-th on."""

    def __init__(self, fail_from: int | None = None) -> None:
        self.sent: list[tuple[str, list[Any], str]] = []
        self.fail_from = fail_from

    def send_task(self, name: str, *, args: list[Any], queue: str) -> None:
        if self.fail_from is not None and len(self.sent) >= self.fail_from:
            raise ConnectionError("broker down")
        self.sent.append((name, args, queue))


@pytest.fixture
def sessions(tmp_path: Path) -> sessionmaker[Session]:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    upgrade_database(url)
    return make_session_factory(url)


def add_attempt(session: Session) -> str:
    # No relationships between the models: flush each parent before its child.
    session.add(Workflow(id="w" * 64, name="w", spec={}))
    session.flush()
    session.add(
        Run(
            id="run_1",
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
    session.add(Attempt(id="att_1", run_id="run_1", number=1, phase_index=0))
    session.flush()
    session.add(OutboxMessage(attempt_id="att_1"))
    return "att_1"


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
        (RUN_PHASE_TASK, [attempt_id], "q"),
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
