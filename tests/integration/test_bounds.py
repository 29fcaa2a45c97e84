"""Every string and integer a client or a worker sends is bounded like the column it is stored
in: SQLite stores an over-long string or a 33-bit integer without a word, Postgres refuses it
(and SQLite refuses integers past 64 bits). Either way the API answers 422 in the error shape,
naming the field, and never 500."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from psycopg import sql

from contracts.bounds import MAX_COUNT
from service.api.app import create_app
from service.auth import create_token
from service.db import make_session_factory, upgrade_database
from service.settings import ServiceSettings

pytestmark = pytest.mark.integration

TOO_BIG = MAX_COUNT + 1  # one past a 32-bit Integer column
HUGE = 2**64  # past SQLite's 64-bit integers too


@dataclass
class Service:
    """The API over one database, shared by every case of this module: each case makes its own
    run, and what it sends is refused without a trace."""

    client: TestClient
    admin: dict[str, str]
    worker: dict[str, str]
    workflow: dict[str, Any]


@contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh Postgres database (as conftest's empty_postgres_url), dropped afterwards."""
    admin_url = os.environ.get("TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
    name = f"tc_{uuid.uuid4().hex}"
    create, drop = "CREATE DATABASE {}", "DROP DATABASE IF EXISTS {} WITH (FORCE)"
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL(create).format(sql.Identifier(name)))
    try:
        base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.SQL(drop).format(sql.Identifier(name)))


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    home = tmp_path_factory.mktemp(request.param)
    data = home / "data"
    data.mkdir()
    # The service only hashes the files: small stand-ins do.
    (data / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    (data / "pretrain.jsonl").write_text('{"text": "the quick brown fox"}\n')
    workflow = {
        "name": "bounds",
        "model": {"config": {"vocab_size": 256, "max_position_embeddings": 128}},
        "tokenizer": "tokenizer.json",
        "microbatch_tokens": 128,
        "phases": [
            {
                "name": "phase0",
                "objective": "continued_pretrain",
                "data": [{"path": "pretrain.jsonl"}],
                "sequence_length": 64,
                "microbatch_size": 2,
                "steps": 10,
            }
        ],
    }
    with ExitStack() as stack:
        # SQLite: the embedded default under the home. Both use the broker folder there.
        url = stack.enter_context(postgres_database()) if request.param == "postgres" else ""
        settings = ServiceSettings(home=home, database_url=url, data_root=data)
        upgrade_database(settings.database_url)
        with make_session_factory(settings.database_url)() as session:
            admin = create_token(session=session, name="admin", role="admin")
            worker = create_token(session=session, name="worker", role="worker")
        client = stack.enter_context(TestClient(create_app(settings)))
        yield Service(
            client=client,
            admin={"Authorization": f"Bearer {admin}"},
            worker={"Authorization": f"Bearer {worker}"},
            workflow=workflow,
        )


@dataclass
class Target:
    """A run of its own for one case and, for the worker's cases, its first attempt claimed."""

    service: Service
    run_id: str
    attempt_id: str
    fencing_token: Any = field(default=None)
    artifact_dir: str = ""

    @property
    def client(self) -> TestClient:
        return self.service.client

    @property
    def workflow(self) -> dict[str, Any]:
        return self.service.workflow

    def submit(self, **body: Any) -> Any:
        return self.client.post(
            "/runs", json={"workflow": self.workflow, **body}, headers=self.service.admin
        )

    def worker(self, action: str, body: dict[str, Any]) -> Any:
        if self.fencing_token is None:
            claimed = claim(self)
            assert claimed.status_code == 200, claimed.text
            self.fencing_token = claimed.json()["fencing_token"]
            self.artifact_dir = claimed.json()["artifact_dir"]
        return self.client.post(
            f"/internal/attempts/{self.attempt_id}/{action}",
            json={"fencing_token": self.fencing_token, **body},
            headers=self.service.worker,
        )


def claim(t: Target, **body: Any) -> Any:
    return t.client.post(
        f"/internal/attempts/{t.attempt_id}/claim",
        json={"hostname": "gpu-1", "pid": 4242, "nonce": "bounds-test", **body},
        headers=t.service.worker,
    )


def ping(t: Target, **body: Any) -> Any:
    return t.client.post(
        "/internal/workers/ping",
        json={"hostname": "gpu-1", "pid": 4242, "version": "1", "queue": "q", **body},
        headers=t.service.worker,
    )


def evals(t: Target, **fields: Any) -> Any:
    result = {
        "task": "summarization",
        "step": 0,
        "phase": "phase0",
        "cross_entropy": 2.0,
        "perplexity": 7.39,
        "records": 4,
        "target_tokens": 40,
        "oversized_records": 0,
        **fields,
    }
    return t.worker("evals", {"results": [result]})


def checkpoint(t: Target, name: str) -> Any:
    """Register `name` in the run's checkpoint directory (claiming the attempt first)."""
    t.worker("heartbeat", {"step": 1})
    ref = {
        "path": f"{t.artifact_dir}/checkpoints/{name}",
        "step": 1,
        "phase_index": 0,
        "phase_step": 1,
    }
    return t.worker("checkpoints", {"checkpoint": ref})


def phase(t: Target) -> dict[str, Any]:
    return dict(t.workflow["phases"][0])


def steps_of(t: Target, *steps: int) -> dict[str, Any]:
    phases = [{**phase(t), "name": f"p{i}", "steps": s} for i, s in enumerate(steps)]
    return {**t.workflow, "phases": phases}


# (the field as the error names it, the request that sends it over its bound)
CASES: dict[str, tuple[str, Callable[[Target], Any]]] = {
    "run name": ("name", lambda t: t.submit(name="n" * 201)),
    # Postgres text holds no NUL character; SQLite's does.
    "run name with a NUL": ("name", lambda t: t.submit(name="a\x00b")),
    "workflow name": ("name", lambda t: t.submit(workflow={**t.workflow, "name": "w" * 201})),
    "phase name with a NUL": (
        "phases[0].name",
        lambda t: t.submit(workflow={**t.workflow, "phases": [{**phase(t), "name": "a\x00b"}]}),
    ),
    "phase steps": ("phases[0].steps", lambda t: t.submit(workflow=steps_of(t, TOO_BIG))),
    # Each phase fits, their sum (the run's total_steps, its last global step) does not.
    "total steps": ("phases", lambda t: t.submit(workflow=steps_of(t, MAX_COUNT, MAX_COUNT))),
    "workflow_id": (
        "workflow_id",
        lambda t: t.client.post("/runs", json={"workflow_id": "f" * 65}, headers=t.service.admin),
    ),
    "max_restarts": ("max_restarts", lambda t: t.submit(max_restarts=TOO_BIG)),
    "max_preemptions": ("max_preemptions", lambda t: t.submit(max_preemptions=HUGE)),
    "initial checkpoint run": (
        "initial_checkpoint.CheckpointOf.run",
        lambda t: t.submit(initial_checkpoint={"run": "r" * 33, "step": 0}),
    ),
    "initial checkpoint step": (
        "initial_checkpoint.CheckpointOf.step",
        lambda t: t.submit(initial_checkpoint={"run": t.run_id, "step": HUGE}),
    ),
    "resume initial checkpoint step": (
        "initial_checkpoint.CheckpointOf.step",
        lambda t: t.client.post(
            f"/runs/{t.run_id}/resume",
            json={"initial_checkpoint": {"run": t.run_id, "step": TOO_BIG}},
            headers=t.service.admin,
        ),
    ),
    "idempotency key": (
        "header.idempotency-key",
        lambda t: t.client.post(
            "/runs",
            json={"workflow": t.workflow},
            headers={**t.service.admin, "Idempotency-Key": "k" * 201},
        ),
    ),
    "runs limit": (
        "query.limit",
        lambda t: t.client.get("/runs", params={"limit": HUGE}, headers=t.service.admin),
    ),
    # Compared with an Integer column, which Postgres casts the parameter to.
    "events after step": (
        "query.metrics_after",
        lambda t: t.client.get(
            f"/runs/{t.run_id}/events",
            params={"metrics_after": HUGE},
            headers=t.service.admin,
        ),
    ),
    "claim hostname": ("hostname", lambda t: claim(t, hostname="h" * 256)),
    "claim hostname with a NUL": ("hostname", lambda t: claim(t, hostname="gpu\x00")),
    "claim nonce with a NUL": ("nonce", lambda t: claim(t, nonce="n\x00")),
    "claim pid": ("pid", lambda t: claim(t, pid=TOO_BIG)),
    "claim pid past 64 bits": ("pid", lambda t: claim(t, pid=HUGE)),
    "fencing token with a NUL": (
        "fencing_token",
        lambda t: t.client.post(
            f"/internal/attempts/{t.attempt_id}/heartbeat",
            json={"fencing_token": "f\x00", "step": 1},
            headers=t.service.worker,
        ),
    ),
    "ping hostname": ("hostname", lambda t: ping(t, hostname="h" * 256)),
    "ping hostname with a NUL": ("hostname", lambda t: ping(t, hostname="gpu\x00")),
    "ping version with a NUL": ("version", lambda t: ping(t, version="1\x00")),
    "heartbeat step": ("step", lambda t: t.worker("heartbeat", {"step": TOO_BIG})),
    "eval records": ("results[0].records", lambda t: evals(t, records=TOO_BIG)),
    "eval target_tokens": ("results[0].target_tokens", lambda t: evals(t, target_tokens=TOO_BIG)),
    "eval oversized_records": (
        "results[0].oversized_records",
        lambda t: evals(t, oversized_records=TOO_BIG),
    ),
    "eval skipped_records count": (
        "results[0].skipped_records.malformed_json",
        lambda t: evals(t, skipped_records={"malformed_json": TOO_BIG}),
    ),
    "eval skipped_records reason": (
        f"results[0].skipped_records.{'r' * 65}.[key]",
        lambda t: evals(t, skipped_records={"r" * 65: 1}),
    ),
    "eval skipped_examples": (
        "results[0].skipped_examples",
        lambda t: evals(t, skipped_examples=["f.jsonl:1: not valid JSON"] * 6),
    ),
    "eval skipped example": (
        "results[0].skipped_examples[0]",
        lambda t: evals(t, skipped_examples=["e" * 2001]),
    ),
    "eval task": ("results[0].task", lambda t: evals(t, task="t" * 65)),
    "eval phase": ("results[0].phase", lambda t: evals(t, phase="p" * 201)),
    "eval set name": ("results[0].name", lambda t: evals(t, name="n" * 201)),
    "eval set name with a NUL": ("results[0].name", lambda t: evals(t, name="qa\x00rag")),
    "eval phase with a NUL": ("results[0].phase", lambda t: evals(t, phase="phase\x000")),
    "checkpoint step": (
        "checkpoint.step",
        lambda t: t.worker(
            "checkpoints",
            {"checkpoint": {"path": "x", "step": TOO_BIG, "phase_index": 0, "phase_step": 1}},
        ),
    ),
    "checkpoint path with a NUL": ("checkpoint.path", lambda t: checkpoint(t, "step-1\x00")),
    "finish step": ("step", lambda t: t.worker("finish", {"status": "succeeded", "step": HUGE})),
    "inspection sequence_length": (
        "sequence_length",
        lambda t: t.client.post(
            "/datasets/inspect",
            json={
                "path": "pretrain.jsonl",
                "tokenizer": "tokenizer.json",
                "objective": "continued_pretrain",
                "sequence_length": TOO_BIG,
            },
            headers=t.service.admin,
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_over_long_or_over_large_field_is_422_naming_it(case: str, service: Service) -> None:
    field, send = CASES[case]
    created = service.client.post(
        "/runs", json={"workflow": service.workflow}, headers=service.admin
    )
    assert created.status_code == 201, created.text
    run = created.json()

    response = send(Target(service, run["id"], run["attempts"][0]["id"]))

    assert response.status_code == 422, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["code"] in {"invalid_request", "invalid_workflow"}, error
    assert field in [d["path"] for d in error["details"]], error
    assert field in error["message"], error


def test_a_nul_in_a_message_is_stored_as_a_replacement_character(service: Service) -> None:
    created = service.client.post(
        "/runs", json={"workflow": service.workflow}, headers=service.admin
    )
    assert created.status_code == 201, created.text
    run = created.json()
    target = Target(service, run["id"], run["attempts"][0]["id"])

    # A worker's message quotes what failed, NULs and all; refusing it would lose the finish.
    finished = target.worker(
        "finish", {"status": "failed", "step": 0, "cause": "data", "message": "bad\x00line"}
    )

    assert finished.status_code == 200, finished.text
    stored = service.client.get(f"/runs/{run['id']}", headers=service.admin).json()
    assert stored["status"] == "failed"
    assert stored["attempts"][0]["message"] == "bad\ufffdline"
