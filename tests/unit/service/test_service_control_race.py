"""A cancel racing a finish on SQLite (no row locks there): the finish must not be overwritten."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

import service.runs.control as control
from contracts.api import RunCreate
from contracts.reports import CheckpointRef, CheckpointReport, ClaimRequest, Finish
from service.auth import create_token, find_token
from service.db import make_session_factory, upgrade_database
from service.errors import ApiError
from service.models import Attempt, Run
from service.runs.run import create_run
from service.settings import ServiceSettings
from service.workers.lease import claim_attempt
from service.workers.report import finish_attempt, register_checkpoint

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "workflows"


def test_a_cancel_racing_a_finish_does_not_overwrite_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The demo's relative paths leave its folder ("../data"): the examples are the data root.
    settings = ServiceSettings(
        home=tmp_path, data_root=EXAMPLES, data_roots=(EXAMPLES.parent,), broker_url="memory://"
    )
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
            roots=settings.paths,
            default_max_restarts=3,
            default_max_preemptions=3,
        )
        run_id = run.id
        attempt_id = session.scalars(select(Attempt.id).where(Attempt.run_id == run_id)).one()
        worker = find_token(
            session=session, token=create_token(session=session, name="w", role="worker")
        )
        assert worker is not None
    with sessions() as session:
        claim = claim_attempt(
            session=session,
            attempt_id=attempt_id,
            request=ClaimRequest(hostname="h", pid=1, nonce="n1"),
            token=worker,
            lease_seconds=60,
            artifact_root=tmp_path,
        )
        # A success is believed only with the phase's final checkpoint registered.
        final = CheckpointRef(
            path=f"{claim.artifact_dir}/checkpoints/step-00000075",
            step=75,
            phase_index=0,
            phase_step=75,
        )
        register_checkpoint(
            session=session,
            attempt_id=attempt_id,
            report=CheckpointReport(fencing_token=claim.fencing_token, checkpoint=final),
            token=worker,
            lease_seconds=60,
            artifact_root=tmp_path,
        )

    read = control._lock

    def read_then_let_the_worker_finish(session: Session, run_id: str) -> Any:
        found = read(session, run_id)  # the cancel has read: run and attempt running
        with sessions() as other:
            finish = Finish(fencing_token=claim.fencing_token, status="succeeded", step=75)
            finish_attempt(
                session=other,
                attempt_id=attempt_id,
                report=finish,
                token=worker,
                lease_seconds=60,
            )
        return found

    monkeypatch.setattr(control, "_lock", read_then_let_the_worker_finish)
    with sessions() as session, pytest.raises(ApiError) as refused:
        control.cancel_run(session=session, run_id=run_id)
    assert refused.value.code == "run_finished"
    with sessions() as session:
        assert session.get(Run, run_id).status == "succeeded"  # type: ignore[union-attr]
        assert session.get(Attempt, attempt_id).status == "succeeded"  # type: ignore[union-attr]
