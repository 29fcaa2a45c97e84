"""Pure pieces of the run and attempt logic: restarts, digests, error paths."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from contracts.reports import MetricPoint as ReportedPoint
from contracts.signature import Digests, compute_signature
from contracts.workflow import validate_workflow
from service.errors import ApiError, validation_details
from service.lifecycle import budget_use, recovery_seconds
from service.models import Attempt
from service.runs.workflow import parse_workflow, workflow_id_of
from service.workers.lease import digests_of
from service.workers.report import finite_or_none, point_error

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def attempt(status: str, cause: str | None = None, number: int = 1, **times: datetime) -> Attempt:
    return Attempt(number=number, phase_index=0, status=status, cause=cause, **times)


def test_budgets_count_infrastructure_errors_and_preemptions_separately() -> None:
    assert budget_use([]).restarts == budget_use([]).preemptions == 0
    attempts = [
        attempt("failed", "infrastructure"),
        attempt("failed", "infrastructure"),
        attempt("failed", "oom"),
        attempt("preempted"),
        attempt("lost", "infrastructure"),
        attempt("succeeded"),
        attempt("superseded"),
        attempt("paused"),
    ]
    use = budget_use(attempts)
    assert (use.restarts, use.preemptions) == (2, 2)


def test_recovery_time_runs_from_a_preemption_or_lease_expiry_to_the_next_claim() -> None:
    attempts = [
        attempt("preempted", number=1, claimed_at=at(0), finished_at=at(10)),
        attempt(
            "lost",
            number=2,
            claimed_at=at(13),
            lease_expires_at=at(40),
            finished_at=at(45),
        ),
        attempt("failed", "oom", number=3, claimed_at=at(47), finished_at=at(50)),
        # After an error, not a preemption: not counted.
        attempt("running", number=4, claimed_at=at(100)),
    ]
    # 13 - 10 after the preemption, 47 - 40 after the lease expired.
    assert recovery_seconds(attempts, now=at(200)) == 10
    waiting = [attempts[0], attempt("queued", number=2)]
    assert recovery_seconds(waiting, now=at(25)) == 15


def test_points_that_cannot_be_stored_say_why() -> None:
    def error(name: str = "loss", step: int = 1, value: float = 1.0) -> str | None:
        return point_error(ReportedPoint(name=name, step=step, value=value))

    assert error() is None
    assert "empty" in (error(name=" ") or "")
    assert "not finite" in (error(value=float("nan")) or "")
    assert "not finite" in (error(value=float("inf")) or "")
    assert "out of range" in (error(step=-1) or "")
    assert "out of range" in (error(step=2**31) or "")
    assert "200" in (error(name="x" * 201) or "")


def test_non_finite_values_are_stored_as_null() -> None:
    assert finite_or_none(float("nan")) is None
    assert finite_or_none(float("-inf")) is None
    assert finite_or_none(0.25) == 0.25


def workflow_doc(tmp_path: Path) -> dict[str, object]:
    (tmp_path / "tok.json").write_text("{}")
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    return {
        "name": "w",
        "model": {"config": {"vocab_size": 10}},
        "tokenizer": "tok.json",
        "microbatch_tokens": 8,
        "phases": [
            {
                "name": "p",
                "objective": "continued_pretrain",
                "data": [{"path": "a.jsonl"}],
                "sequence_length": 4,
                "microbatch_size": 2,
                "steps": 3,
            }
        ],
    }


def test_digests_round_trip_through_the_stored_signature_components(tmp_path: Path) -> None:
    spec = validate_workflow(workflow_doc(tmp_path))
    digests = Digests(tokenizer="t" * 64, data={"/a.jsonl": "d" * 64}, initial_checkpoint="c" * 64)
    signature = compute_signature(workflow=spec, digests=digests, initial_checkpoint="/ck")
    assert digests_of(signature.components) == digests


def test_relative_paths_resolve_against_the_data_root(tmp_path: Path) -> None:
    spec = parse_workflow(workflow_doc(tmp_path), data_root=tmp_path)
    assert spec.tokenizer == str(tmp_path / "tok.json")
    assert spec.phases[0].data[0].path == str(tmp_path / "a.jsonl")
    # Content-addressed: the same document is the same id; another seed is another.
    again = parse_workflow(workflow_doc(tmp_path), data_root=tmp_path)
    assert workflow_id_of(spec) == workflow_id_of(again)
    other = parse_workflow({**workflow_doc(tmp_path), "seed": 3}, data_root=tmp_path)
    assert workflow_id_of(other) != workflow_id_of(spec)


def test_invalid_workflow_lists_every_problem_with_its_path(tmp_path: Path) -> None:
    doc = workflow_doc(tmp_path)
    doc["tokenizer"] = "missing.json"
    doc["microbatch_tokens"] = 16
    with pytest.raises(ApiError) as caught:
        parse_workflow(doc, data_root=tmp_path)
    assert caught.value.status == 422
    assert caught.value.code == "invalid_workflow"
    assert {d["path"] for d in caught.value.details} == {"tokenizer", "phases[0]"}


def test_validation_details_use_json_paths() -> None:
    errors = [
        {"loc": ("body", "phases", 2, "steps"), "msg": "too small", "type": "x"},
        {"loc": ("query", "limit"), "msg": "bad", "type": "x"},
        {"loc": ("body",), "msg": "Value error, give one", "type": "value_error"},
        {"loc": ("body", "name"), "msg": "Field required", "type": "missing"},
    ]
    assert validation_details(errors) == [
        {"path": "phases[2].steps", "message": "too small"},
        {"path": "query.limit", "message": "bad"},
        {"path": "$", "message": "give one"},
        {"path": "name", "message": "is required"},
    ]
