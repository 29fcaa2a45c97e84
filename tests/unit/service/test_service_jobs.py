"""Jobs over the API on SQLite: submit (202, Location, paths resolved, files checked), read
back by kind, and the worker side (start, result: the first outcome is kept). The worker's
adapter (worker.process.jobs.run_job) is driven against the same app, its work functions
replaced."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from contracts.bounds import EMPTY_PATH
from contracts.jobs import InspectionReport, InspectRequest, LengthStats
from contracts.jobs import Job as JobPublic
from contracts.reports import EvalResult
from service.api.app import create_app
from service.auth import create_token
from service.db import make_session_factory, upgrade_database
from service.models import Job, OutboxMessage
from service.settings import ServiceSettings
from worker.error import DataError
from worker.link.client import ServiceClient
from worker.settings import WorkerSettings

TOKENIZER = Path(__file__).resolve().parents[3] / "examples" / "tokenizer" / "tokenizer.json"


@dataclass
class Api:
    client: TestClient
    sessions: sessionmaker[Session]
    data: Path
    admin: dict[str, str]
    worker: dict[str, str]


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    data = tmp_path / "data"
    data.mkdir()
    settings = ServiceSettings(home=tmp_path / "home", data_root=data, broker_url="memory://")
    upgrade_database(settings.database_url)
    sessions = make_session_factory(settings.database_url)
    with sessions() as session:
        admin = create_token(session=session, name="admin", role="admin")
        worker = create_token(session=session, name="worker", role="worker")
    with TestClient(create_app(settings)) as client:
        yield Api(
            client=client,
            sessions=sessions,
            data=data,
            admin={"Authorization": f"Bearer {admin}"},
            worker={"Authorization": f"Bearer {worker}"},
        )


def inspect_body(api: Api, **overrides: Any) -> dict[str, Any]:
    (api.data / "train.jsonl").write_text('{"source": "a b", "target": "c"}\n')
    # A real one: a worker loads it before the work function (replaced in some tests) runs.
    shutil.copy(TOKENIZER, api.data / "tokenizer.json")
    return {
        "path": "train.jsonl",
        "tokenizer": "tokenizer.json",
        "objective": "summarization",
        "sequence_length": 64,
        **overrides,
    }


def checkpoint_dir(api: Api, *, tokenizer: bool = True) -> Path:
    checkpoint = api.data / "model"
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "config.json").write_text("{}")
    if tokenizer:
        (checkpoint / "tokenizer.json").write_text("{}")
    (api.data / "eval.jsonl").write_text('{"source": "a", "target": "b"}\n')
    return checkpoint


def evaluate_body(api: Api, **overrides: Any) -> dict[str, Any]:
    checkpoint_dir(api)
    return {
        "checkpoint": "model",
        "task": "summarization",
        "data": "eval.jsonl",
        "sequence_length": 64,
        **overrides,
    }


def submit_inspection(api: Api, **overrides: Any) -> dict[str, Any]:
    answer = api.client.post(
        "/datasets/inspect", json=inspect_body(api, **overrides), headers=api.admin
    )
    assert answer.status_code == 202, answer.text
    job: dict[str, Any] = answer.json()
    return job


def report(path: str = "/data/train.jsonl", records: int = 3) -> dict[str, Any]:
    stats = LengthStats(count=records, min=1, mean=2.0, p50=2, p90=3, p99=3, max=3)
    return InspectionReport(
        path=path,
        objective="summarization",
        sequence_length=64,
        formats={"pair": records},
        records=records,
        fit=records - 1,
        refused=1,
        trimmed=0,
        tokens_trimmed=0,
        segments_dropped=0,
        zero_target=0,
        duplicates=0,
        source_end_lost_if_truncated=1,
        lengths={"total": stats},
    ).model_dump(mode="json")


def eval_result() -> dict[str, Any]:
    return EvalResult(
        task="summarization",
        step=0,
        phase="",
        cross_entropy=2.0,
        perplexity=7.389,
        records=4,
        target_tokens=12,
    ).model_dump(mode="json")


# Any: starlette's TestClient answers with its own httpx's Response type.
def start(api: Api, job_id: str) -> Any:
    return api.client.post(f"/internal/jobs/{job_id}/start", headers=api.worker)


def post_result(api: Api, job_id: str, **outcome: Any) -> Any:
    return api.client.post(f"/internal/jobs/{job_id}/result", json=outcome, headers=api.worker)


# --- submit and read -----------------------------------------------------------------------


def test_inspection_is_accepted_with_its_location_and_paths_resolved_against_the_data_root(
    api: Api,
) -> None:
    answer = api.client.post("/datasets/inspect", json=inspect_body(api), headers=api.admin)
    assert answer.status_code == 202, answer.text
    job = answer.json()
    assert job["id"].startswith("job_")
    assert (job["kind"], job["status"], job["result"], job["error"]) == (
        "inspection",
        "queued",
        None,
        None,
    )
    assert answer.headers["location"] == f"/datasets/inspections/{job['id']}"
    assert job["request"]["path"] == str((api.data / "train.jsonl").resolve())
    assert job["request"]["tokenizer"] == str((api.data / "tokenizer.json").resolve())
    assert job["request"]["objective"] == "summarization"
    # Accepted before its message went out; sent once by the time it is read back.
    assert job["deliveries"] == 0
    assert api.client.get(answer.headers["location"], headers=api.admin).json() == {
        **job,
        "deliveries": 1,
    }


def test_submitted_job_is_written_to_the_outbox_in_its_transaction(api: Api) -> None:
    job = submit_inspection(api)
    with api.sessions() as session:
        (row,) = session.scalars(select(OutboxMessage)).all()
        assert (row.job_id, row.attempt_id) == (job["id"], None)
        stored = session.get(Job, job["id"])
        assert stored is not None and stored.request == job["request"]


def test_evaluation_is_accepted_and_read_back_under_evaluations(api: Api) -> None:
    answer = api.client.post("/evaluations", json=evaluate_body(api), headers=api.admin)
    assert answer.status_code == 202, answer.text
    job = answer.json()
    assert answer.headers["location"] == f"/evaluations/{job['id']}"
    assert job["kind"] == "evaluation"
    assert job["request"]["checkpoint"] == str((api.data / "model").resolve())
    assert job["request"]["tokenizer"] is None
    assert job["request"]["batch_size"] == 8
    read = api.client.get(f"/evaluations/{job['id']}", headers=api.admin).json()
    assert read == {**job, "deliveries": 1}


def test_a_missing_file_is_422_naming_the_field(api: Api) -> None:
    body = inspect_body(api, path="nowhere.jsonl")
    answer = api.client.post("/datasets/inspect", json=body, headers=api.admin)
    assert answer.status_code == 422
    error = answer.json()["error"]
    missing = str(api.data / "nowhere.jsonl")
    assert error["code"] == "invalid_request"
    assert error["details"] == [{"path": "path", "message": f"file {missing} not found"}]
    assert "path: file" in error["message"] and missing in error["message"]
    with api.sessions() as session:
        assert session.scalars(select(Job)).all() == []
        assert session.scalars(select(OutboxMessage)).all() == []


def test_every_missing_evaluation_input_is_named(api: Api) -> None:
    body = evaluate_body(api, checkpoint="gone", data="gone.jsonl", tokenizer="gone.json")
    answer = api.client.post("/evaluations", json=body, headers=api.admin)
    assert answer.status_code == 422
    details = answer.json()["error"]["details"]
    assert [d["path"] for d in details] == ["checkpoint", "data", "tokenizer"]
    assert details[0]["message"] == f"directory {api.data / 'gone'} not found"


def test_a_checkpoint_without_a_tokenizer_needs_one_given(api: Api) -> None:
    checkpoint = checkpoint_dir(api, tokenizer=False)
    body = evaluate_body(api)
    (checkpoint / "tokenizer.json").unlink()
    answer = api.client.post("/evaluations", json=body, headers=api.admin)
    assert answer.status_code == 422
    (detail,) = answer.json()["error"]["details"]
    assert detail["path"] == "tokenizer" and "tokenizer.json" in detail["message"]

    (api.data / "tokenizer.json").write_text("{}")
    given = {**body, "tokenizer": "tokenizer.json"}
    assert api.client.post("/evaluations", json=given, headers=api.admin).status_code == 202


def test_preparation_is_accepted_and_read_back_under_preparations(api: Api) -> None:
    answer = api.client.post("/datasets/prepare", json=inspect_body(api), headers=api.admin)
    assert answer.status_code == 202, answer.text
    job = answer.json()
    assert (job["kind"], job["status"]) == ("preparation", "queued")
    assert answer.headers["location"] == f"/datasets/preparations/{job['id']}"
    assert job["request"]["path"] == str((api.data / "train.jsonl").resolve())
    assert job["request"]["tokenizer"] == str((api.data / "tokenizer.json").resolve())
    read = api.client.get(answer.headers["location"], headers=api.admin).json()
    assert read == {**job, "deliveries": 1}
    elsewhere = api.client.get(f"/datasets/inspections/{job['id']}", headers=api.admin)
    assert elsewhere.json()["error"]["code"] == "inspection_not_found"
    with api.sessions() as session:
        (row,) = session.scalars(select(OutboxMessage)).all()
        assert row.job_id == job["id"]
    missing = api.client.get("/datasets/preparations/job_nope", headers=api.admin)
    assert missing.status_code == 404
    assert "POST /datasets/prepare" in missing.json()["error"]["message"]


def test_a_preparation_of_a_missing_file_is_422_naming_the_field(api: Api) -> None:
    body = inspect_body(api, path="nowhere.jsonl", tokenizer="none.json")
    answer = api.client.post("/datasets/prepare", json=body, headers=api.admin)
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == "invalid_request"
    assert [d["path"] for d in error["details"]] == ["path", "tokenizer"]
    assert error["message"].startswith("POST /datasets/prepare: path: file ")
    with api.sessions() as session:
        assert session.scalars(select(Job)).all() == []


def test_an_unknown_field_is_422_naming_it(api: Api) -> None:
    body = inspect_body(api, sequence_lenght=8)
    answer = api.client.post("/datasets/inspect", json=body, headers=api.admin)
    assert answer.status_code == 422
    paths = [d["path"] for d in answer.json()["error"]["details"]]
    assert "sequence_lenght" in paths


def test_unknown_jobs_and_jobs_of_the_other_kind_are_404_in_the_error_shape(api: Api) -> None:
    inspection = submit_inspection(api)
    missing = api.client.get("/datasets/inspections/job_nope", headers=api.admin)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "inspection_not_found"
    assert "POST /datasets/inspect" in missing.json()["error"]["message"]
    other = api.client.get(f"/evaluations/{inspection['id']}", headers=api.admin)
    assert other.status_code == 404
    assert other.json()["error"]["code"] == "evaluation_not_found"
    assert start(api, "job_nope").json()["error"]["code"] == "job_not_found"


def test_public_routes_need_an_admin_token_and_internal_ones_a_worker_token(api: Api) -> None:
    body = inspect_body(api)
    assert api.client.post("/datasets/inspect", json=body).status_code == 401
    assert api.client.post("/datasets/inspect", json=body, headers=api.worker).status_code == 403
    job = submit_inspection(api)
    answer = api.client.post(f"/internal/jobs/{job['id']}/start", headers=api.admin)
    assert answer.status_code == 403


# --- the worker side -----------------------------------------------------------------------


def test_start_marks_the_job_running_and_answers_its_request(api: Api) -> None:
    job = submit_inspection(api)
    started = start(api, job["id"])
    assert started.status_code == 200, started.text
    assert started.json()["status"] == "running"
    assert started.json()["request"] == job["request"]
    with api.sessions() as session:
        stored = session.get(Job, job["id"])
        assert stored is not None and stored.started_at is not None
    # A message delivered again while the job runs (its worker died) starts it again.
    assert start(api, job["id"]).status_code == 200


def test_succeeded_result_is_stored_and_returned(api: Api) -> None:
    job = submit_inspection(api)
    start(api, job["id"])
    answer = post_result(api, job["id"], status="succeeded", result=report())
    assert answer.status_code == 200, answer.text
    read = api.client.get(f"/datasets/inspections/{job['id']}", headers=api.admin).json()
    assert read["status"] == "succeeded"
    assert read["result"] == report()
    assert read["finished_at"] is not None
    assert InspectionReport.model_validate(read["result"]).refused == 1


def test_a_job_answers_its_times_as_before_and_its_model_reads_them_as_date_times(
    api: Api,
) -> None:
    job = submit_inspection(api)
    start(api, job["id"])
    post_result(api, job["id"], status="succeeded", result=report())
    read = api.client.get(f"/datasets/inspections/{job['id']}", headers=api.admin).json()
    with api.sessions() as session:
        stored = session.get(Job, job["id"])
        assert stored is not None and stored.finished_at is not None
        # As isoformat writes them, as jobs always answered (not pydantic's `Z`).
        assert read["created_at"] == stored.created_at.isoformat()
        assert read["finished_at"] == stored.finished_at.isoformat()
    public = JobPublic.model_validate(read)
    assert isinstance(public.created_at, datetime) and isinstance(public.finished_at, datetime)
    # The model describes the whole answer: read and written back, it is the same JSON.
    assert public.model_dump(mode="json") == read


def test_failed_result_keeps_the_message(api: Api) -> None:
    job = submit_inspection(api)
    start(api, job["id"])
    message = "/data/train.jsonl line 2: not JSON"
    assert post_result(api, job["id"], status="failed", error=message).status_code == 200
    read = api.client.get(f"/datasets/inspections/{job['id']}", headers=api.admin).json()
    assert (read["status"], read["error"], read["result"]) == ("failed", message, None)


def test_a_second_different_result_is_409_and_the_same_one_again_is_accepted(api: Api) -> None:
    job = submit_inspection(api)
    start(api, job["id"])
    assert post_result(api, job["id"], status="succeeded", result=report()).status_code == 200
    assert post_result(api, job["id"], status="succeeded", result=report()).status_code == 200
    again = post_result(api, job["id"], status="failed", error="late")
    assert again.status_code == 409
    error = again.json()["error"]
    assert error["code"] == "job_finished"
    assert error["details"] == {"job_id": job["id"], "status": "succeeded"}
    # ...and a finished job is not started again.
    assert start(api, job["id"]).status_code == 409
    read = api.client.get(f"/datasets/inspections/{job['id']}", headers=api.admin).json()
    assert read["status"] == "succeeded"


def test_a_result_before_the_start_is_409(api: Api) -> None:
    job = submit_inspection(api)
    answer = post_result(api, job["id"], status="failed", error="no")
    assert answer.status_code == 409
    assert answer.json()["error"]["code"] == "job_not_started"


def test_a_result_that_is_not_the_kind_s_report_is_422(api: Api) -> None:
    job = submit_inspection(api)
    start(api, job["id"])
    # An EvalResult is no InspectionReport.
    answer = post_result(api, job["id"], status="succeeded", result=eval_result())
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == "invalid_request"
    assert "InspectionReport" in error["message"]
    assert {"path": "result.path", "message": "is required"} in error["details"]
    missing = post_result(api, job["id"], status="succeeded")
    assert missing.status_code == 422
    assert missing.json()["error"]["details"][0]["path"] == "result"
    silent = post_result(api, job["id"], status="failed")
    assert silent.json()["error"]["details"] == [
        {"path": "error", "message": "say why the job failed"}
    ]
    # Nothing was stored: the job still takes a good result.
    assert post_result(api, job["id"], status="succeeded", result=report()).status_code == 200


def test_an_evaluation_result_must_be_an_eval_result_with_finite_numbers(api: Api) -> None:
    job = api.client.post("/evaluations", json=evaluate_body(api), headers=api.admin).json()
    start(api, job["id"])
    wrong = post_result(api, job["id"], status="succeeded", result=report())
    assert wrong.status_code == 422 and "EvalResult" in wrong.json()["error"]["message"]
    # Starlette parses NaN in a body; a stored result must stay JSON.
    body = json.dumps({"status": "succeeded", "result": {**eval_result(), "perplexity": "NaN"}})
    nan = api.client.post(
        f"/internal/jobs/{job['id']}/result",
        content=body.replace('"NaN"', "NaN"),
        headers={**api.worker, "content-type": "application/json"},
    )
    assert nan.status_code == 422
    assert nan.json()["error"]["details"][0]["path"] == "result"
    good = post_result(api, job["id"], status="succeeded", result=eval_result())
    assert good.status_code == 200
    assert EvalResult.model_validate(good.json()["result"]).target_tokens == 12


# --- the worker's adapter against this app -------------------------------------------------


def service_client(api: Api) -> ServiceClient:
    """The worker's real client, its requests answered by the app in this process."""

    def forward(request: httpx.Request) -> httpx.Response:
        answer = api.client.request(
            request.method, request.url.path, content=request.content, headers=request.headers
        )
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

    token = api.worker["Authorization"].removeprefix("Bearer ")
    return ServiceClient("http://service", token, transport=httpx.MockTransport(forward))


def test_worker_runs_a_job_and_posts_its_report(
    api: Api, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from worker.data import inspect
    from worker.process.jobs import run_job

    def inspect_file(request: InspectRequest, *, stores: Any) -> InspectionReport:
        return InspectionReport.model_validate(report(path=request.path, records=5))

    monkeypatch.setattr(inspect, "inspect_file", inspect_file)
    job = submit_inspection(api)
    settings = WorkerSettings(home=tmp_path / "worker", data_roots=(tmp_path,))
    with service_client(api) as client:
        outcome = run_job("inspection", job["id"], job["request"], settings=settings, client=client)
        assert outcome is not None and outcome.status == "succeeded"
        # The same message again is dropped: the job has its outcome.
        assert (
            run_job("inspection", job["id"], job["request"], settings=settings, client=client)
            is None
        )
    read = api.client.get(f"/datasets/inspections/{job['id']}", headers=api.admin).json()
    assert read["status"] == "succeeded"
    assert read["result"]["records"] == 5
    assert read["result"]["path"] == job["request"]["path"]


def test_worker_prepares_a_store_once_and_posts_where_it_is(api: Api, tmp_path: Path) -> None:
    from worker.process.jobs import run_job

    settings = WorkerSettings(
        home=tmp_path / "worker", artifact_root=tmp_path / "artifacts", data_roots=(tmp_path,)
    )
    results = []
    with service_client(api) as client:
        for _ in range(2):
            answer = api.client.post("/datasets/prepare", json=inspect_body(api), headers=api.admin)
            job = answer.json()
            outcome = run_job(
                "preparation", job["id"], job["request"], settings=settings, client=client
            )
            assert outcome is not None and outcome.status == "succeeded", outcome
            read = api.client.get(f"/datasets/preparations/{job['id']}", headers=api.admin).json()
            assert read["status"] == "succeeded"
            results.append(read["result"])
    first, second = results
    assert first["built"] is True and second["built"] is False
    assert first["path"] == str((api.data / "train.jsonl").resolve())
    assert first["records"] == 1 and first["tokens"] > 0
    store = Path(first["store"])
    assert store.parent == tmp_path / "artifacts" / "tokens" and (store / "meta.json").is_file()
    assert (second["store"], second["records"], second["tokens"]) == (
        first["store"],
        first["records"],
        first["tokens"],
    )


def test_worker_reports_a_bad_file_as_a_failed_job_with_its_message(
    api: Api, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from worker.data import inspect
    from worker.process.jobs import run_job

    def inspect_file(request: InspectRequest, *, stores: Any) -> InspectionReport:
        raise DataError(f"{request.path} line 3: not JSON (Expecting value)")

    monkeypatch.setattr(inspect, "inspect_file", inspect_file)
    job = submit_inspection(api)
    settings = WorkerSettings(home=tmp_path / "worker", data_roots=(tmp_path,))
    with service_client(api) as client:
        outcome = run_job("inspection", job["id"], job["request"], settings=settings, client=client)
    assert outcome is not None and outcome.status == "failed"
    read = api.client.get(f"/datasets/inspections/{job['id']}", headers=api.admin).json()
    assert read["status"] == "failed"
    assert read["error"] == f"{job['request']['path']} line 3: not JSON (Expecting value)"


def test_worker_reports_an_unexpected_error_with_its_type_and_place(
    api: Api, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from worker.data import inspect
    from worker.process.jobs import run_job

    def inspect_file(request: InspectRequest, *, stores: Any) -> InspectionReport:
        raise KeyError("lengths")

    monkeypatch.setattr(inspect, "inspect_file", inspect_file)
    job = submit_inspection(api)
    settings = WorkerSettings(home=tmp_path / "worker", data_roots=(tmp_path,))
    with service_client(api) as client:
        run_job("inspection", job["id"], job["request"], settings=settings, client=client)
    read = api.client.get(f"/datasets/inspections/{job['id']}", headers=api.admin).json()
    assert read["status"] == "failed"
    assert read["error"].startswith("KeyError: 'lengths' at ")
    assert "in inspect_file" in read["error"]


def test_worker_client_drops_an_outcome_when_another_came_first(api: Api) -> None:
    from contracts.jobs import JobOutcome

    job = submit_inspection(api)
    with service_client(api) as client:
        started = client.start_job(job["id"])
        assert started is not None and started.request == job["request"]
        first = client.finish_job(job["id"], JobOutcome(status="failed", error="first"))
        assert first is not None and first.status == "failed"
        assert client.finish_job(job["id"], JobOutcome(status="failed", error="late")) is None
        assert client.start_job(job["id"]) is None
    read = api.client.get(f"/datasets/inspections/{job['id']}", headers=api.admin).json()
    assert read["error"] == "first"


# --- jobs whose worker died ------------------------------------------------------------------


def test_a_job_running_past_the_timeout_is_queued_and_sent_again(api: Api) -> None:
    from datetime import timedelta

    from service.models import utcnow
    from service.workers.reaper import requeue_stale_jobs

    stale, fresh, done = (submit_inspection(api)["id"] for _ in range(3))
    for job_id in (stale, fresh, done):
        assert start(api, job_id).status_code == 200
    assert post_result(api, done, status="succeeded", result=report()).status_code == 200
    with api.sessions() as session:
        job = session.get(Job, stale)
        assert job is not None and job.started_at is not None
        job.started_at -= timedelta(hours=2)
        session.commit()
        before = len(
            session.scalars(select(OutboxMessage).where(OutboxMessage.job_id == stale)).all()
        )

    requeued = requeue_stale_jobs(session_factory=api.sessions, now=utcnow(), timeout=3600)
    assert requeued == [stale]
    assert requeue_stale_jobs(session_factory=api.sessions, now=utcnow(), timeout=3600) == []
    with api.sessions() as session:
        statuses = {j.id: j.status for j in session.scalars(select(Job))}
        rows = session.scalars(select(OutboxMessage).where(OutboxMessage.job_id == stale)).all()
    assert statuses == {stale: "queued", fresh: "running", done: "succeeded"}
    assert len(rows) == before + 1
    # The next worker starts it again; its outcome is taken as usual.
    assert start(api, stale).status_code == 200
    assert post_result(api, stale, status="succeeded", result=report()).status_code == 200


def test_a_slow_worker_s_outcome_is_kept_after_its_job_was_queued_again(api: Api) -> None:
    """The timeout sent the job again while its first worker was only slow: that worker's
    outcome is the first, and the message sent again finds the job finished."""
    from datetime import timedelta

    from service.models import utcnow
    from service.workers.reaper import requeue_stale_jobs

    job_id = submit_inspection(api)["id"]
    assert start(api, job_id).status_code == 200
    later = utcnow() + timedelta(hours=2)
    assert requeue_stale_jobs(session_factory=api.sessions, now=later, timeout=3600) == [job_id]
    answer = post_result(api, job_id, status="succeeded", result=report())
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "succeeded"
    assert start(api, job_id).status_code == 409  # the second delivery: dropped


def test_an_evaluation_with_a_non_finite_loss_fails_instead_of_looping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NaN cannot travel in JSON; unstored, the job would be sent again every timeout."""
    from worker.process import jobs
    from worker.train import evaluate

    nan = float("nan")

    def evaluate_checkpoint(request: Any, **_: Any) -> EvalResult:
        return EvalResult(
            task="summarization",
            step=0,
            phase="",
            cross_entropy=nan,
            perplexity=nan,
            records=1,
            target_tokens=3,
        )

    monkeypatch.setattr(evaluate, "evaluate_checkpoint", evaluate_checkpoint)
    request = {"checkpoint": "/m", "task": "summarization", "data": "/e", "sequence_length": 8}
    # The request's paths are stand-ins (nothing reads them): the whole disk is the data root.
    settings = WorkerSettings(device="cpu", data_roots=(Path("/"),))
    outcome = jobs.job_outcome("evaluation", request, settings=settings)
    assert outcome.status == "failed"
    assert outcome.error is not None and "non-finite" in outcome.error


def test_an_empty_path_is_refused_naming_its_field_without_contradiction(api: Api) -> None:
    """The schema says `minLength: 1` for every path a request names; an empty one is 422
    naming the field with a message of its own (it once read "is not an absolute path; give
    it relative to the data root")."""
    cases = [
        ("/datasets/inspect", inspect_body(api, path=""), "path"),
        ("/datasets/prepare", inspect_body(api, tokenizer=""), "tokenizer"),
        ("/evaluations", evaluate_body(api, data=""), "data"),
        ("/evaluations", evaluate_body(api, checkpoint=""), "checkpoint"),
    ]
    for route, body, field in cases:
        answer = api.client.post(route, json=body, headers=api.admin)
        assert answer.status_code == 422, (route, answer.text)
        error = answer.json()["error"]
        assert [d["path"] for d in error["details"]] == [field], (route, error)
        assert error["details"][0]["message"] == EMPTY_PATH, error
        assert "not an absolute path" not in error["message"]
    doc = api.client.get("/openapi.json").json()["components"]["schemas"]
    for model, fields in (
        ("InspectRequest", ("path", "tokenizer")),
        ("PrepareRequest", ("path", "tokenizer")),
        ("EvaluateRequest", ("checkpoint", "data")),
    ):
        for name in fields:
            assert doc[model]["properties"][name]["minLength"] == 1, (model, name)


@pytest.mark.parametrize("route", ["metrics", "eval"])
def test_the_old_csv_query_is_refused_naming_the_route_of_its_own(api: Api, route: str) -> None:
    """`?format=csv` on a JSON route is 422 naming `format` and the CSV route, never JSON
    that an old client would take for CSV."""
    answer = api.client.get(f"/runs/run_nope/{route}", params={"format": "csv"}, headers=api.admin)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request"
    assert [d["path"] for d in error["details"]] == ["query.format"]
    assert f"/runs/{{id}}/{route}.csv" in error["details"][0]["message"]
