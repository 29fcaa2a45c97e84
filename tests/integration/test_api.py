"""The API on real Postgres and Redis: errors, workflows, run submission and dispatch, and the
worker protocol driven over HTTP as a worker drives it."""

from __future__ import annotations

import base64
import json
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import select
from weights import write_weights_file

from contracts.api import EvalSummaryPublic, MetricSeriesPublic
from contracts.dispatch import RUN_PHASE_TASK
from contracts.reports import Claim, ClaimRequest
from service.api.app import create_app
from service.auth import find_token
from service.errors import ApiError
from service.models import Attempt, MetricPoint, OutboxMessage, Run, Workflow
from service.settings import ServiceSettings
from service.workers.lease import claim_attempt

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    return make_api(make_settings())


def assert_error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["code"] == code, error
    assert error["message"]
    return dict(error)


def submit(api: Api, body: dict[str, Any], **headers: str) -> Any:
    return api.client.post("/runs", json=body, headers={**api.admin, **headers})


def queued_messages(settings: ServiceSettings) -> list[dict[str, Any]]:
    """Celery messages waiting in Redis for the settings' queue and every worker's own queue
    (where the service sends the attempts it places: contracts.dispatch.worker_queue)."""
    client = redis.Redis.from_url(settings.broker_url)
    try:
        queues = [settings.queue.encode()]
        queues += sorted(client.scan_iter(match=f"{settings.queue}.worker.*"))
        return [json.loads(raw) for queue in queues for raw in client.lrange(queue, 0, -1)]
    finally:
        client.close()


WORKER_KEY = "gpu-1-4242-test"


def ping_worker(
    api: Api, *, pid: int = 4242, devices: int = 1, key: str = WORKER_KEY, hostname: str = "gpu-1"
) -> None:
    """A live worker with its own queue (key `key`), as a worker process's ping says: the
    service places queued attempts on it (service.workers.placement)."""
    body = {
        "hostname": hostname,
        "pid": pid,
        "version": "0.1.0",
        "queue": api.settings.queue,
        "devices": devices,
        "worker": key,
    }
    response = api.client.post("/internal/workers/ping", json=body, headers=api.worker)
    assert response.status_code == 200, response.text


def message_args(message: dict[str, Any]) -> list[Any]:
    args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
    return list(args)


class Worker:
    """The worker's side of /internal/attempts/{id}/..., over HTTP. Checkpoints are registered
    under the claim's `artifact_dir`, where a worker writes them."""

    def __init__(
        self,
        api: Api,
        attempt_id: str,
        token: str | None = None,
        artifact_dir: str | None = None,
    ) -> None:
        self.api, self.attempt_id, self.token = api, attempt_id, token
        self.artifact_dir = artifact_dir
        self.nonce = uuid.uuid4().hex  # one per claim, sent again by its retries

    def post(self, action: str, body: dict[str, Any]) -> Any:
        return self.api.client.post(
            f"/internal/attempts/{self.attempt_id}/{action}", json=body, headers=self.api.worker
        )

    def claim(self, pid: int = 4242) -> Any:
        response = self.post("claim", {"hostname": "gpu-1", "pid": pid, "nonce": self.nonce})
        if response.status_code == 200:
            self.token = response.json()["fencing_token"]
            self.artifact_dir = response.json()["artifact_dir"]
        return response

    def heartbeat(self, step: int, progress: int = 0) -> Any:
        return self.post(
            "heartbeat", {"fencing_token": self.token, "step": step, "progress": progress}
        )

    def metrics(self, points: list[tuple[str, int, float]]) -> Any:
        return self.post(
            "metrics",
            {
                "fencing_token": self.token,
                "points": [{"name": n, "step": s, "value": v} for n, s, v in points],
            },
        )

    def evals(self, results: list[dict[str, Any]]) -> Any:
        return self.post("evals", {"fencing_token": self.token, "results": results})

    def checkpoint_path(self, step: int) -> str:
        return f"{self.artifact_dir}/checkpoints/step-{step:08d}"

    def checkpoint(self, step: int, phase_index: int, phase_step: int) -> Any:
        ref = {
            "path": self.checkpoint_path(step),
            "step": step,
            "phase_index": phase_index,
            "phase_step": phase_step,
        }
        return self.post("checkpoints", {"fencing_token": self.token, "checkpoint": ref})

    def finish(self, status: str, step: int, **extra: Any) -> Any:
        return self.post(
            "finish", {"fencing_token": self.token, "status": status, "step": step, **extra}
        )


def eval_point(step: int, ce: float, phase: str = "phase0") -> dict[str, Any]:
    return {
        "task": "summarization",
        "step": step,
        "phase": phase,
        "cross_entropy": ce,
        "perplexity": 2.718281828**ce,
        "records": 4,
        "target_tokens": 40,
        "oversized_records": 1,
    }


def get_run(api: Api, run_id: str) -> dict[str, Any]:
    response = api.client.get(f"/runs/{run_id}", headers=api.admin)
    assert response.status_code == 200, response.text
    return dict(response.json())


def current_attempt(run: dict[str, Any]) -> dict[str, Any]:
    return dict(max(run["attempts"], key=lambda a: a["number"]))


# --- health, auth and the error shape -----------------------------------------------------


def test_health_needs_no_token_and_readyz_checks_the_database(api: Api) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok"}
    assert api.client.get("/readyz").json() == {"status": "ready"}


def test_readyz_answers_503_when_the_database_is_down(make_settings: SettingsFactory) -> None:
    settings = make_settings(database_url="postgresql+psycopg://postgres@127.0.0.1:1/none")
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200
        assert_error(client.get("/readyz"), 503, "database_unavailable")


def test_every_error_has_the_error_shape(api: Api, tiny_workflow: WorkflowFactory) -> None:
    missing = assert_error(api.client.get("/runs"), 401, "unauthorized")
    assert "Bearer" in missing["message"]
    assert_error(
        api.client.get("/runs", headers={"Authorization": "Bearer nope"}), 401, "unauthorized"
    )
    # Worker tokens are for /internal only, and admin tokens are not for /internal.
    assert_error(api.client.get("/runs", headers=api.worker), 403, "forbidden")
    assert_error(
        api.client.post(
            "/internal/attempts/att_x/claim",
            json={"hostname": "h", "pid": 1, "nonce": "n1"},
            headers=api.admin,
        ),
        403,
        "forbidden",
    )
    assert_error(api.client.get("/runs/run_missing", headers=api.admin), 404, "run_not_found")
    assert_error(api.client.get("/workflows/abc", headers=api.admin), 404, "workflow_not_found")
    assert_error(api.client.get("/no/such/route", headers=api.admin), 404, "not_found")
    invalid = assert_error(
        api.client.get("/runs", params={"limit": 0}, headers=api.admin), 422, "invalid_request"
    )
    assert invalid["details"][0]["path"] == "query.limit"
    both = assert_error(
        submit(api, {"workflow": tiny_workflow(), "workflow_id": "x"}), 422, "invalid_request"
    )
    assert "exactly one" in both["message"]


def test_validate_reports_every_problem_with_its_path(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow(phases=2)
    doc["tokenizer"] = "missing-tokenizer.json"
    doc["phases"][0]["microbatch_size"] = 3
    doc["phases"][1]["steps"] = 0
    doc["phases"][1]["objective"] = "poetry"
    response = api.client.post("/workflows/validate", json=doc, headers=api.admin)
    error = assert_error(response, 422, "invalid_workflow")
    paths = {d["path"] for d in error["details"]}
    assert {"tokenizer", "phases[0]", "phases[1].steps", "phases[1].objective"} <= paths
    assert all(d["message"] for d in error["details"])


def test_validate_answers_the_plan_with_paths_resolved_against_the_data_root(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    response = api.client.post(
        "/workflows/validate", json=tiny_workflow(steps=7), headers=api.admin
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["valid"] is True
    assert answer["plan"]["total_steps"] == 14
    first = answer["plan"]["phases"][0]["sources"][0]["path"]
    assert first == str(api.settings.data_root / "pretrain.jsonl")


def test_workflows_are_content_addressed(api: Api, tiny_workflow: WorkflowFactory) -> None:
    doc = tiny_workflow()
    first = api.client.post("/workflows", json=doc, headers=api.admin)
    assert first.status_code == 201, first.text
    # Defaults written out are the same workflow: same normalised form, same id.
    again = api.client.post("/workflows", json={**doc, "seed": 0}, headers=api.admin)
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    other = api.client.post("/workflows", json={**doc, "seed": 1}, headers=api.admin)
    assert other.status_code == 201
    assert other.json()["id"] != first.json()["id"]
    read = api.client.get(f"/workflows/{first.json()['id']}", headers=api.admin).json()
    assert read["workflow"]["seed"] == 0
    assert read["plan"]["total_steps"] == 20


# --- runs ---------------------------------------------------------------------------------


def test_idempotency_key_returns_the_same_run_and_refuses_another_body(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow()
    first = submit(api, {"workflow": doc, "name": "a"}, **{"Idempotency-Key": "key-1"})
    assert first.status_code == 201, first.text
    again = submit(api, {"workflow": doc, "name": "a"}, **{"Idempotency-Key": "key-1"})
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    conflict = submit(api, {"workflow": doc, "name": "b"}, **{"Idempotency-Key": "key-1"})
    error = assert_error(conflict, 409, "idempotency_conflict")
    assert error["details"]["run_id"] == first.json()["id"]
    with api.sessions() as session:
        assert len(session.scalars(select(Run)).all()) == 1
        assert len(session.scalars(select(Attempt)).all()) == 1


def test_two_runs_of_one_workflow_share_it_and_store_signature_components(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow()
    one, two = submit(api, {"workflow": doc}).json(), submit(api, {"workflow": doc}).json()
    assert one["id"] != two["id"]
    assert one["workflow_id"] == two["workflow_id"]
    assert one["signature"] == two["signature"]
    by_id = submit(api, {"workflow_id": one["workflow_id"], "name": "again"})
    assert by_id.status_code == 201, by_id.text
    assert by_id.json()["signature"] == one["signature"]

    with api.sessions() as session:
        assert len(session.scalars(select(Workflow)).all()) == 1
        run = session.get(Run, one["id"])
        assert run is not None
        components = run.signature_components
    data_root = api.settings.data_root
    assert components["workflow"]["name"] == "tiny"
    assert set(components["data"]) == {
        str(data_root / "pretrain.jsonl"),
        str(data_root / "summaries.jsonl"),
    }
    assert len(components["tokenizer"]["sha256"]) == 64
    assert components["initial_checkpoint"] is None

    # A changed data file is another run identity.
    (data_root / "pretrain.jsonl").write_text('{"text": "changed"}\n')
    changed = submit(api, {"workflow": doc}).json()
    assert changed["signature"] != one["signature"]


def test_initial_checkpoint_is_part_of_the_signature(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow()
    checkpoint = write_weights_file(api.settings.data_root / "base.safetensors")
    plain = submit(api, {"workflow": doc}).json()
    seeded = submit(api, {"workflow": doc, "initial_checkpoint": "base.safetensors"})
    assert seeded.status_code == 201, seeded.text
    assert seeded.json()["initial_checkpoint"] == str(checkpoint)
    assert seeded.json()["signature"] != plain["signature"]
    missing = submit(api, {"workflow": doc, "initial_checkpoint": "nope.safetensors"})
    error = assert_error(missing, 422, "missing_input")
    assert error["details"][0]["path"] == "initial_checkpoint"


def test_submitted_run_is_sent_to_its_queue_and_the_outbox_row_marked_sent(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    ping_worker(api)
    response = submit(api, {"workflow": tiny_workflow()})
    assert response.status_code == 201, response.text
    run = response.json()
    assert run["status"] == "queued"
    assert [a["number"] for a in run["attempts"]] == [1]
    attempt_id = run["attempts"][0]["id"]

    messages = queued_messages(api.settings)
    assert len(messages) == 1
    assert messages[0]["headers"]["task"] == RUN_PHASE_TASK
    assert message_args(messages[0]) == [attempt_id]
    with api.sessions() as session:
        (row,) = session.scalars(select(OutboxMessage)).all()
        assert row.attempt_id == attempt_id
        assert row.sent_at is not None
        # Placed on the one live worker: to its own queue.
        assert row.queue == f"{api.settings.queue}.worker.{WORKER_KEY}"


def test_run_submitted_while_the_broker_is_down_is_kept_in_the_outbox(
    make_settings: SettingsFactory, make_api: ApiFactory, tiny_workflow: WorkflowFactory
) -> None:
    api = make_api(make_settings(broker_url="redis://127.0.0.1:1/0"))
    ping_worker(api)  # a live worker to place the attempt on: its message is then written
    response = submit(api, {"workflow": tiny_workflow()})
    assert response.status_code == 201, response.text
    with api.sessions() as session:
        (row,) = session.scalars(select(OutboxMessage)).all()
        assert row.attempt_id == response.json()["attempts"][0]["id"]
        assert row.sent_at is None


def test_list_runs_newest_first_with_status_filter_and_limit(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow()
    ids = [submit(api, {"workflow": doc, "name": f"r{i}"}).json()["id"] for i in range(3)]
    listed = api.client.get("/runs", headers=api.admin).json()
    assert listed["count"] == 3
    assert [r["id"] for r in listed["runs"]] == ids[::-1]
    page = api.client.get("/runs", params={"limit": 2}, headers=api.admin).json()
    assert [r["id"] for r in page["runs"]] == ids[:0:-1]
    assert page["count"] == 3
    none = api.client.get("/runs", params={"status": "succeeded"}, headers=api.admin).json()
    assert none == {"runs": [], "count": 0, "next_cursor": None}
    bad = api.client.get("/runs", params={"status": "sleeping"}, headers=api.admin)
    assert_error(bad, 422, "invalid_request")


# --- the worker protocol ------------------------------------------------------------------


def test_worker_protocol_runs_every_phase_to_success(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    ping_worker(api)  # each phase is placed on it once the previous one ended
    run = submit(api, {"workflow": tiny_workflow(phases=3, steps=10)}).json()
    run_id = run["id"]
    first = Worker(api, run["attempts"][0]["id"])

    claimed = first.claim()
    assert claimed.status_code == 200, claimed.text
    claim = claimed.json()
    assert claim["run_id"] == run_id
    assert claim["attempt_number"] == 1
    assert claim["phase_index"] == 0
    assert claim["resume_from"] is None
    assert claim["signature"] == run["signature"]
    assert claim["workflow"]["phases"][0]["name"] == "phase0"
    assert claim["digests"]["data"].keys() == {
        str(api.settings.data_root / "pretrain.jsonl"),
        str(api.settings.data_root / "summaries.jsonl"),
    }
    assert claim["artifact_dir"] == str(Path(api.settings.artifact_root) / "runs" / run_id)
    assert claim["lease_seconds"] == api.settings.lease_seconds
    assert_error(Worker(api, first.attempt_id).claim(pid=9), 409, "already_claimed")
    assert get_run(api, run_id)["status"] == "running"

    assert first.heartbeat(step=3).json()["action"] == "continue"
    assert get_run(api, run_id)["step"] == 3
    loss = [("loss", s, 10.0 - s * 0.5) for s in range(1, 11)]
    assert first.metrics([*loss, ("lr", 1, 0.01)]).json() == {"accepted": 11, "errors": []}
    # A point reported again (a resumed attempt re-reporting) overwrites the earlier value.
    assert first.metrics([("loss", 4, 42.0)]).status_code == 200
    assert first.evals([eval_point(0, 5.0), eval_point(5, 3.0), eval_point(10, 3.5)]).json() == {
        "accepted": 3
    }
    assert first.checkpoint(step=10, phase_index=0, phase_step=10).status_code == 200
    assert first.finish("succeeded", step=10).status_code == 200

    # Stale reports after the finish are refused; a heartbeat tells the worker to stop.
    assert_error(first.metrics([("loss", 11, 1.0)]), 409, "superseded")
    assert first.heartbeat(step=10).json()["action"] == "stop"

    for phase in (1, 2):
        state = get_run(api, run_id)
        assert state["status"] == "running"
        assert state["phase_index"] == phase
        assert state["phase"] == f"phase{phase}"
        attempt = current_attempt(state)
        assert (attempt["number"], attempt["phase_index"], attempt["status"]) == (
            phase + 1,
            phase,
            "queued",
        )
        worker = Worker(api, attempt["id"])
        claim = worker.claim().json()
        assert claim["phase_index"] == phase
        # Each phase starts from the previous phase's final checkpoint.
        assert claim["resume_from"]["step"] == phase * 10
        end = (phase + 1) * 10
        worker.metrics([("loss", end, 1.0)])
        assert worker.checkpoint(step=end, phase_index=phase, phase_step=10).status_code == 200
        assert worker.finish("succeeded", step=end).status_code == 200

    final = get_run(api, run_id)
    assert final["status"] == "succeeded"
    assert final["finished_at"] is not None
    assert final["step"] == final["total_steps"] == 30
    assert final["latest_checkpoint"] == {
        "step": 30,
        "path": f"{api.settings.artifact_root}/runs/{run_id}/checkpoints/step-00000030",
        "phase_index": 2,
    }
    assert [(a["number"], a["phase_index"], a["status"]) for a in final["attempts"]] == [
        (1, 0, "succeeded"),
        (2, 1, "succeeded"),
        (3, 2, "succeeded"),
    ]
    assert final["restarts"] == 0
    assert final["attempts"][0]["worker_hostname"] == "gpu-1"
    assert final["attempts"][0]["worker_pid"] == 4242

    # Every attempt's message was sent to the queue.
    sent = [message_args(m)[0] for m in queued_messages(api.settings)]
    assert sorted(sent) == sorted(a["id"] for a in final["attempts"])

    metrics = api.client.get(f"/runs/{run_id}/metrics", headers=api.admin).json()
    # The document's model describes the answer whole (Postgres writes the body; read into the
    # model and written back it is the same JSON).
    assert MetricSeriesPublic.model_validate(metrics).model_dump(mode="json") == metrics
    assert metrics["loss"]["steps"] == [*range(1, 11), 20, 30]
    assert metrics["loss"]["values"][3] == 42.0
    assert metrics["lr"] == {"steps": [1], "values": [0.01]}
    only_lr = api.client.get(
        f"/runs/{run_id}/metrics", params={"names": "lr"}, headers=api.admin
    ).json()
    assert set(only_lr) == {"lr"}
    thin = api.client.get(
        f"/runs/{run_id}/metrics", params={"names": "loss", "max_points": 4}, headers=api.admin
    ).json()
    assert MetricSeriesPublic.model_validate(thin).model_dump(mode="json") == thin
    assert len(thin["loss"]["steps"]) <= 4
    assert thin["loss"]["steps"][0] == 1
    assert thin["loss"]["steps"][-1] == 30

    evals = api.client.get(f"/runs/{run_id}/eval", headers=api.admin).json()
    assert evals["run_id"] == run_id
    assert EvalSummaryPublic.model_validate(evals).model_dump(mode="json") == evals
    summary = evals["tasks"]["summarization"]
    assert summary["baseline"]["step"] == 0
    assert summary["latest"]["step"] == 10
    assert summary["best"]["step"] == 5
    assert summary["best"]["cross_entropy"] == 3.0
    assert [p["step"] for p in summary["history"]] == [0, 5, 10]
    assert summary["latest"]["oversized_records"] == 1

    checkpoints = api.client.get(f"/runs/{run_id}/checkpoints", headers=api.admin).json()
    assert checkpoints["count"] == 3
    assert [c["step"] for c in checkpoints["checkpoints"]] == [10, 20, 30]


def test_stale_fencing_token_is_refused_as_superseded(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow()}).json()
    worker = Worker(api, run["attempts"][0]["id"])
    worker.claim()
    stale = Worker(api, worker.attempt_id, token="stale-secret", artifact_dir=worker.artifact_dir)
    error = assert_error(stale.metrics([("loss", 1, 1.0)]), 409, "superseded")
    assert error["details"]["attempt_id"] == worker.attempt_id
    assert_error(stale.checkpoint(step=5, phase_index=0, phase_step=5), 409, "superseded")
    assert_error(stale.evals([eval_point(0, 1.0)]), 409, "superseded")
    assert_error(stale.finish("succeeded", step=10), 409, "superseded")
    assert stale.heartbeat(step=1).json()["action"] == "stop"
    with api.sessions() as session:
        assert session.scalars(select(MetricPoint)).all() == []
    # The owner is unaffected.
    assert worker.heartbeat(step=1).json()["action"] == "continue"
    assert_error(Worker(api, "att_missing", token="secret").metrics([]), 404, "attempt_not_found")


def test_preempted_attempt_restarts_from_the_latest_checkpoint(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1, steps=10)}).json()
    first = Worker(api, run["attempts"][0]["id"])
    first.claim()
    first.checkpoint(step=6, phase_index=0, phase_step=6)
    assert first.finish("preempted", step=7).status_code == 200

    state = get_run(api, run["id"])
    assert state["status"] == "recovering"
    assert (state["preemptions"], state["restarts"]) == (1, 0)
    retry = current_attempt(state)
    assert (retry["number"], retry["phase_index"], retry["status"]) == (2, 0, "queued")
    assert state["attempts"][0]["status"] == "preempted"

    second = Worker(api, retry["id"])
    claim = second.claim().json()
    assert claim["resume_from"]["step"] == 6
    assert claim["attempt_number"] == 2
    # The resumed attempt reports from its checkpoint on; its heartbeat is the run's step.
    second.heartbeat(step=6)
    assert get_run(api, run["id"])["step"] == 6
    assert get_run(api, run["id"])["status"] == "running"
    assert second.checkpoint(step=10, phase_index=0, phase_step=10).status_code == 200
    assert second.finish("succeeded", step=10).status_code == 200
    assert get_run(api, run["id"])["status"] == "succeeded"


def test_preemptions_beyond_max_preemptions_fail_the_run(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1), "max_preemptions": 1}).json()
    for _ in range(2):
        worker = Worker(api, current_attempt(get_run(api, run["id"]))["id"])
        worker.claim()
        worker.finish("preempted", step=3)
    final = get_run(api, run["id"])
    assert final["status"] == "failed"
    assert final["cause"] == "restarts_exhausted"
    assert "max_preemptions" in final["message"]
    assert final["preemptions"] == 2
    assert len(final["attempts"]) == 2


def test_failed_attempt_fails_the_run_with_its_cause(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow()}).json()
    worker = Worker(api, run["attempts"][0]["id"])
    worker.claim()
    worker.finish("failed", step=4, cause="nan", message="loss is NaN at step 4")
    final = get_run(api, run["id"])
    assert (final["status"], final["cause"]) == ("failed", "nan")
    assert "loss is NaN at step 4" in final["message"]
    assert final["attempts"][0]["cause"] == "nan"
    assert len(final["attempts"]) == 1


def test_concurrent_claims_have_exactly_one_winner(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow()}).json()
    attempt_id = run["attempts"][0]["id"]
    outcomes: list[str] = []
    won: list[tuple[int, Claim]] = []
    barrier = threading.Barrier(8)
    secret = api.worker["Authorization"].removeprefix("Bearer ")

    def claim(pid: int) -> None:
        barrier.wait()
        with api.sessions() as session:
            token = find_token(session=session, token=secret)
            assert token is not None
            try:
                answer = claim_attempt(
                    session=session,
                    attempt_id=attempt_id,
                    request=ClaimRequest(hostname="race", pid=pid, nonce=f"nonce-{pid}"),
                    token=token,
                    lease_seconds=30,
                    artifact_root=api.settings.artifact_root,
                )
                outcomes.append("won")
                won.append((pid, answer))
            except ApiError as err:
                outcomes.append(err.code)

    threads = [threading.Thread(target=claim, args=(pid,)) for pid in range(1, 9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["already_claimed"] * 7 + ["won"]
    ((pid, answer),) = won
    with api.sessions() as session:
        attempt = session.get(Attempt, attempt_id)
        assert attempt is not None
        # The attempt holds the winner's claim, and no loser's.
        assert (attempt.fencing_token, attempt.worker_pid) == (answer.fencing_token, pid)


def test_carrying_optimizer_state_into_the_first_phase_answers_422_naming_it(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow()
    doc["phases"][0]["optimizer_state"] = "carry"
    response = api.client.post("/workflows/validate", json=doc, headers=api.admin)
    error = assert_error(response, 422, "invalid_workflow")
    assert [d["path"] for d in error["details"]] == ["phases[0].optimizer_state"]
    doc["phases"][0]["optimizer_state"] = "reset"
    doc["phases"][1]["optimizer_state"] = "carry"
    response = api.client.post("/workflows/validate", json=doc, headers=api.admin)
    assert response.status_code == 200, response.text


def test_two_eval_sets_of_one_task_need_names_and_keep_their_own_results(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow()
    [summaries] = doc["evals"]
    doc["evals"] = [summaries, {**summaries, "data": "pretrain.jsonl"}]
    response = api.client.post("/workflows/validate", json=doc, headers=api.admin)
    error = assert_error(response, 422, "invalid_workflow")
    assert [d["path"] for d in error["details"]] == ["evals[1].name"]
    assert "duplicate eval set name 'summarization' (also evals[0])" in error["message"]

    doc["evals"][1]["name"] = "summaries-b"
    created = submit(api, {"workflow": doc})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    worker = Worker(api, created.json()["attempts"][0]["id"])
    claim = worker.claim().json()
    assert [e.get("name") for e in claim["workflow"]["evals"]] == [None, "summaries-b"]
    assert worker.evals(
        [eval_point(0, 5.0), {**eval_point(0, 3.0), "name": "summaries-b"}]
    ).json() == {"accepted": 2}
    answer = api.client.get(f"/runs/{run_id}/eval", headers=api.admin).json()["tasks"]
    assert {name: (s["task"], s["latest"]["cross_entropy"]) for name, s in answer.items()} == {
        "summarization": ("summarization", 5.0),
        "summaries-b": ("summarization", 3.0),
    }


def test_the_eval_answer_counts_skipped_records_by_reason_and_names_the_latest_examples(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    created = submit(api, {"workflow": tiny_workflow()})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    worker = Worker(api, created.json()["attempts"][0]["id"])
    worker.claim()
    skipped = {"malformed_json": 1, "no_target": 2}
    # A worker from before skipped records reports neither field: none skipped.
    assert worker.evals([eval_point(0, 5.0)]).json() == {"accepted": 1}
    for step, example in ((5, "eval.jsonl:3: not valid JSON"), (10, "eval.jsonl:3: not JSON")):
        point = {**eval_point(step, 4.0), "skipped_records": skipped}
        assert worker.evals([{**point, "skipped_examples": [example]}]).json() == {"accepted": 1}

    answer = api.client.get(f"/runs/{run_id}/eval", headers=api.admin).json()
    assert EvalSummaryPublic.model_validate(answer).model_dump(mode="json") == answer
    summary = answer["tasks"]["summarization"]
    assert [p["skipped_records"] for p in summary["history"]] == [{}, skipped, skipped]
    assert summary["baseline"]["skipped_records"] == {}
    assert summary["latest"]["skipped_records"] == skipped
    # Examples come once per set, from its latest evaluation, not with every point.
    assert summary["skipped_examples"] == ["eval.jsonl:3: not JSON"]
    assert all("skipped_examples" not in p for p in summary["history"])

    csv = api.client.get(f"/runs/{run_id}/eval.csv", headers=api.admin)
    header, *rows = csv.text.splitlines()
    assert header.endswith(
        ",oversized_records,skipped_malformed_json,skipped_wrong_shape,skipped_no_target"
    )
    assert [row.split(",")[-4:] for row in rows] == [
        ["1", "0", "0", "0"],
        ["1", "1", "0", "2"],
        ["1", "1", "0", "2"],
    ]
