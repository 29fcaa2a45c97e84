"""A cancel racing a finish on SQLite (no row locks there): the finish must not be overwritten."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

import service.control as control
from contracts.reports import ClaimRequest, Finish
from service.attempt import claim_attempt, finish_attempt
from service.db import make_session_factory, upgrade_database
from service.errors import ApiError
from service.models import Attempt, Run
from service.run import create_run
from service.schemas import RunCreate
from service.settings import ServiceSettings

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "workflows"


def test_a_cancel_racing_a_finish_does_not_overwrite_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = ServiceSettings(home=tmp_path, data_root=EXAMPLES, broker_url="memory://")
    upgrade_database(settings.database_url)
    sessions = make_session_factory(settings.database_url)
    workflow = json.loads((EXAMPLES / "demo.json").read_text())
    workflow["phases"] = workflow["phases"][:1]
    with sessions() as session:
        run, _ = create_run(
            session=session,
            request=RunCreate(workflow=workflow),
            idempotency_key=None,
            data_root=EXAMPLES,
            default_max_restarts=3,
            default_max_preemptions=3,
        )
        run_id = run.id
        attempt_id = session.scalars(select(Attempt.id).where(Attempt.run_id == run_id)).one()
    with sessions() as session:
        claim = claim_attempt(
            session=session,
            attempt_id=attempt_id,
            request=ClaimRequest(hostname="h", pid=1),
            lease_seconds=60,
            artifact_root=tmp_path,
        )

    read = control._lock

    def read_then_let_the_worker_finish(session: Session, run_id: str) -> Any:
        found = read(session, run_id)  # the cancel has read: run and attempt running
        with sessions() as other:
            finish = Finish(fencing_token=claim.fencing_token, status="succeeded", step=75)
            finish_attempt(session=other, attempt_id=attempt_id, report=finish, lease_seconds=60)
        return found

    monkeypatch.setattr(control, "_lock", read_then_let_the_worker_finish)
    with sessions() as session, pytest.raises(ApiError) as refused:
        control.cancel_run(session=session, run_id=run_id)
    assert refused.value.code == "run_finished"
    with sessions() as session:
        assert session.get(Run, run_id).status == "succeeded"  # type: ignore[union-attr]
        assert session.get(Attempt, attempt_id).status == "succeeded"  # type: ignore[union-attr]
