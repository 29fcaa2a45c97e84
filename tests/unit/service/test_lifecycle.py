"""The lifecycle table: every status the database allows, and only the transitions drawn in
service/lifecycle.py's docstring."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from service.lifecycle import (
    ATTEMPT_TRANSITIONS,
    FINISHED_RUN,
    RUN_TRANSITIONS,
    AttemptStatus,
    IllegalTransition,
    RunStatus,
    attempt_sources,
    end_attempt,
    move_run,
    run_sources,
)
from service.models import ATTEMPT_STATUSES, RUN_STATUSES, Attempt, Run

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def run(status: RunStatus, **fields: object) -> Run:
    return Run(id="run_1", status=status.value, **fields)


def test_the_check_constraints_allow_exactly_the_lifecycles_statuses() -> None:
    assert set(RUN_STATUSES) == {s.value for s in RunStatus}
    assert set(ATTEMPT_STATUSES) == {s.value for s in AttemptStatus}
    assert set(RUN_TRANSITIONS) == set(RunStatus)
    assert set(ATTEMPT_TRANSITIONS) == set(AttemptStatus)


def test_a_succeeded_run_never_changes_and_a_finished_one_only_resumes() -> None:
    assert RUN_TRANSITIONS[RunStatus.SUCCEEDED] == frozenset()
    for finished in (RunStatus.FAILED, RunStatus.CANCELLED):
        assert RUN_TRANSITIONS[finished] == {RunStatus.RECOVERING}
    # Nothing goes back to queued: a run is queued once, when it is created.
    assert run_sources(RunStatus.QUEUED) == ()
    # A cancel or a pause never overwrites a finished run (their conditional UPDATEs).
    for to in (RunStatus.CANCELLED, RunStatus.PAUSED):
        assert not set(run_sources(to)) & {s.value for s in FINISHED_RUN}


def test_every_attempt_end_is_final() -> None:
    ends = set(AttemptStatus) - {AttemptStatus.QUEUED, AttemptStatus.RUNNING}
    for end in ends:
        assert ATTEMPT_TRANSITIONS[end] == frozenset()
    assert attempt_sources(AttemptStatus.LOST) == ("running",)
    assert set(attempt_sources(AttemptStatus.SUPERSEDED)) == {"queued", "running"}
    assert attempt_sources(AttemptStatus.RUNNING) == ("queued",)


def test_move_run_refuses_what_the_table_does_not_hold() -> None:
    done = run(RunStatus.SUCCEEDED, finished_at=NOW)
    with pytest.raises(IllegalTransition, match="succeeded -> running"):
        move_run(done, RunStatus.RUNNING, now=NOW)
    assert done.status == "succeeded"


def test_finishing_stamps_the_end_and_resuming_clears_it() -> None:
    r = run(RunStatus.RUNNING, pause_requested_at=NOW, message="training")
    move_run(r, RunStatus.FAILED, now=NOW, cause="nan", message="non-finite loss")
    assert (r.status, r.cause, r.finished_at, r.pause_requested_at) == ("failed", "nan", NOW, None)
    move_run(r, RunStatus.RECOVERING, now=NOW, message=None)
    assert (r.status, r.cause, r.finished_at, r.message) == ("recovering", None, None, None)
    move_run(r, RunStatus.RUNNING, now=NOW)  # the message is kept when none is given
    assert r.message is None and r.status == "running"


def test_an_ended_attempt_cannot_end_again() -> None:
    attempt = Attempt(id="att_1", status="running")
    end_attempt(attempt, AttemptStatus.SUCCEEDED, now=NOW)
    assert (attempt.status, attempt.finished_at) == ("succeeded", NOW)
    with pytest.raises(IllegalTransition):
        end_attempt(attempt, AttemptStatus.FAILED, now=NOW, cause="data")
    assert attempt.status == "succeeded"
