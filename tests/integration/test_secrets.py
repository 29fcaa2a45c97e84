"""Secrets stay secret: a full small run on a live stack (`trainctl serve` on Postgres, a Celery
worker on Redis, logging at DEBUG), with the token changes and refusals around it, leaves no
token (admin, user, worker, a rotated one, a wrong one) and no claim secret in any log, any
answer of the API, or the run's record."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import httpx
import pytest
from procs import Stack, processes, run_cli, short_demo_workflow, wait_for_run
from sqlalchemy import text

from service.db import make_engine

pytestmark = pytest.mark.integration


def test_no_token_reaches_a_log_an_answer_or_the_run_record(
    tmp_path: Path, postgres_url: str
) -> None:
    with processes() as procs:
        stack = Stack(
            tmp_path,
            postgres_url,
            procs,
            TRAINCTL_LOG_LEVEL="DEBUG",
            TRAINCTL_DATA_ROOT=str(Path(__file__).resolve().parents[2]),
        )
        worker = stack.worker(TRAINCTL_LOG_LEVEL="DEBUG")
        secrets = {"admin": stack.admin, "worker": stack.worker_token}
        answers: list[str] = []

        def keep(response: httpx.Response) -> httpx.Response:
            answers.append(f"{response.request.url}\n{response.headers}\n{response.text}")
            return response

        with stack.api() as admin:
            # A secret is in the answer of its creation or rotation only: not kept.
            issued = admin.post("/tokens", json={"name": "erin", "role": "user"}).json()
            secrets["user (rotated away)"] = issued["secret"]
            rotated = admin.post(f"/tokens/{issued['token']['id']}/rotate").json()
            secrets["user"] = rotated["secret"]
            secrets["wrong"] = "x" + stack.admin[1:]
            with httpx.Client(base_url=stack.url, timeout=30) as anonymous:
                for token in (secrets["wrong"], secrets["user (rotated away)"]):
                    refused = anonymous.get("/runs", headers={"Authorization": f"Bearer {token}"})
                    assert keep(refused).status_code == 401
                # A worker token on the public API, a user token on the internal one.
                worker_token = {"Authorization": f"Bearer {stack.worker_token}"}
                assert keep(anonymous.get("/runs", headers=worker_token)).status_code == 403
                as_user = {"Authorization": f"Bearer {secrets['user']}"}
                claim = anonymous.post("/internal/attempts/att_x/claim", json={}, headers=as_user)
                assert keep(claim).status_code in (403, 422)

                created = anonymous.post(
                    "/runs",
                    json={"workflow": short_demo_workflow(pretrain_steps=5, sft_steps=3)},
                    headers=as_user,
                )
                assert keep(created).status_code == 201, created.text
            run = wait_for_run(admin, created.json()["id"], timeout=300, procs=procs)
            assert run["status"] == "succeeded", run
            run_id = run["id"]
            for path in (
                f"/runs/{run_id}",
                f"/runs/{run_id}/metrics",
                f"/runs/{run_id}/eval",
                f"/runs/{run_id}/checkpoints?status=all",
                f"/runs/{run_id}/events",
                "/runs",
                "/workers",
                "/tokens?revoked=true",
                "/audit",
                "/whoami",
            ):
                assert keep(admin.get(path)).status_code == 200, path
        # Rotated into a file by the CLI: mode 0600, never printed; listing shows no token.
        token_file = tmp_path / "home" / "erin-token"
        answers.append(
            run_cli(
                ["tokens", "rotate", issued["token"]["id"], "--out", str(token_file)],
                env=stack.env,
            )
        )
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        secrets["user (rotated into a file)"] = token_file.read_text().strip()
        answers.append(run_cli(["tokens", "list", "--json", "--revoked"], env=stack.env))
        assert worker.alive()

    # The run's claim secrets (fencing tokens) and its stored record, from the database.
    engine = make_engine(postgres_url)
    try:
        with engine.connect() as conn:
            fencing = [
                row[0]
                for row in conn.execute(
                    text("SELECT fencing_token FROM attempts WHERE run_id = :id"), {"id": run_id}
                )
            ]
            record = json.dumps(
                [
                    [str(value) for value in row]
                    for table in ("runs", "attempts", "checkpoints", "jobs", "audit_events")
                    for row in conn.execute(text(f"SELECT * FROM {table}"))
                ]
            )
    finally:
        engine.dispose()
    assert len(fencing) == 3 and all(fencing)
    secrets.update({f"claim secret {i}": token for i, token in enumerate(fencing)})

    logs = sorted(tmp_path.rglob("*.log"))
    assert {p.name for p in logs} >= {"serve.log", "worker-1.log"}
    serve_log = (tmp_path / "serve.log").read_text()
    assert "DEBUG" in serve_log and f"/runs/{run_id}" in serve_log  # access lines are there
    for where, body in [
        *[(str(p), p.read_text(errors="replace")) for p in logs],
        *[("answers", answer) for answer in answers],
    ]:
        for name, secret in secrets.items():
            assert secret not in body, f"the {name} token appears in {where}"
    for name, secret in secrets.items():
        if not name.startswith("claim secret"):
            assert secret not in record, f"the {name} token is stored in the clear"
        assert secret not in json.dumps(run)
