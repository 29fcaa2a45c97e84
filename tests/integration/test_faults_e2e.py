"""Fault tolerance with real processes (issue 4): workers that vanish or freeze, a broker down
at submit, a service restarted mid-run and a database that goes away for a while. Each run must
end as an uninterrupted one would, with every (metric, step) exactly once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from exact import assert_identical_runs, reference_run, workflow
from procs import (
    Proc,
    Stack,
    assert_each_step_once,
    healthy,
    processes,
    wait_for_run,
    wait_until,
)

from cli.stack import free_port

pytestmark = pytest.mark.integration

# Short leases and a busy reaper so that a lost worker is noticed within seconds.
SERVICE_ENV = {"TRAINCTL_LEASE_SECONDS": "3", "TRAINCTL_REAPER_INTERVAL_SECONDS": "1"}
WORKER_ENV = {"TRAINCTL_HEARTBEAT_SECONDS": "0.5"}


def current_attempt(api: httpx.Client, run_id: str) -> dict[str, Any]:
    return max(api.get(f"/runs/{run_id}").json()["attempts"], key=lambda a: a["number"])


def running_on(api: httpx.Client, run_id: str, workers: list[Proc]) -> Proc | None:
    """The worker process that holds the run's current attempt, once it has trained a step."""
    run = api.get(f"/runs/{run_id}").json()
    attempt = max(run["attempts"], key=lambda a: a["number"])
    if attempt["status"] != "running":
        return None
    return next((w for w in workers if w.pid == attempt["worker_pid"]), None)


def test_workers_killed_at_random_moments_are_replaced_and_nothing_is_lost(
    tmp_path: Path, postgres_url: str
) -> None:
    body = {"workflow": workflow("continued_pretrain", steps=40)}
    kill_after = sorted(random.Random(20261130).sample(range(3, 38), 3))
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        workers = [stack.worker(**WORKER_ENV) for _ in range(2)]
        with stack.api() as api:
            run_id = api.post("/runs", json=body).json()["id"]
            for threshold in kill_after:
                victim = wait_until(
                    lambda t=threshold: (
                        api.get(f"/runs/{run_id}").json()["step"] >= t
                        and running_on(api, run_id, workers)
                    ),
                    timeout=240,
                    what=f"step {threshold} on a worker",
                )
                os.kill(victim.pid, signal.SIGKILL)
                victim.popen.wait(timeout=30)
                workers.remove(victim)
                workers.append(stack.worker(**WORKER_ENV))  # a spot instance comes back
            run = wait_for_run(api, run_id, timeout=300, procs=workers)
            assert run["status"] == "succeeded", run
            statuses = [a["status"] for a in sorted(run["attempts"], key=lambda a: a["number"])]
            assert statuses == ["lost"] * len(kill_after) + ["succeeded"]
            assert run["preemptions"] == len(kill_after)
            assert run["recovery_seconds"] > 0
            assert_each_step_once(api, run)
            assert_identical_runs(api, run, reference_run(api, body, workers[0]))


def test_a_revived_zombie_is_fenced_and_writes_nothing(tmp_path: Path, postgres_url: str) -> None:
    body = {"workflow": workflow("continued_pretrain", steps=30)}
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        zombie = stack.worker(**WORKER_ENV)
        with stack.api() as api:
            run_id = api.post("/runs", json=body).json()["id"]
            wait_until(
                lambda: api.get(f"/runs/{run_id}").json()["step"] >= 6,
                timeout=120,
                what="step 6",
            )
            os.kill(zombie.pid, signal.SIGSTOP)  # frozen past its lease, not dead
            wait_until(
                lambda: current_attempt(api, run_id)["number"] == 2,
                timeout=60,
                what="the reaper to hand the phase on",
            )
            heir = stack.worker(**WORKER_ENV)
            wait_until(
                lambda: current_attempt(api, run_id)["status"] == "running",
                timeout=120,
                what="the new attempt to be claimed",
            )
            os.kill(zombie.pid, signal.SIGCONT)
            run = wait_for_run(api, run_id, timeout=300, procs=[heir])
            assert run["status"] == "succeeded", run
            first, second = sorted(run["attempts"], key=lambda a: a["number"])
            assert (first["status"], second["status"]) == ("lost", "succeeded")
            assert second["worker_pid"] == heir.pid

            # Nothing registered by the zombie after it lost the phase.
            resumed_at = min(
                c["step"]
                for c in api.get(f"/runs/{run_id}/checkpoints").json()["checkpoints"]
                if c["attempt_id"] == second["id"]
            )
            for checkpoint in api.get(f"/runs/{run_id}/checkpoints").json()["checkpoints"]:
                if checkpoint["step"] >= resumed_at:
                    assert checkpoint["attempt_id"] == second["id"], checkpoint
            assert_each_step_once(api, run)
            assert_identical_runs(api, run, reference_run(api, body, heir))


class PrivateRedis:
    """A Redis server of this test's own, so it can be stopped without touching the shared one."""

    def __init__(self, tmp_path: Path) -> None:
        self.port, self.dir = free_port(), tmp_path / "redis"
        self.dir.mkdir()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", str(self.dir)),
            ],
            stdout=subprocess.DEVNULL,
        )
        wait_until(self.answers, timeout=20, what="redis to start")

    def answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.url, socket_connect_timeout=0.2).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=20)


def test_a_run_submitted_while_redis_is_down_is_dispatched_when_it_returns(
    tmp_path: Path, postgres_url: str
) -> None:
    broker = PrivateRedis(tmp_path)
    broker.start()
    try:
        with processes() as procs:
            stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_BROKER_URL=broker.url)
            broker.stop()
            with stack.api() as api:
                created = api.post("/runs", json={"workflow": workflow("summarization", steps=6)})
                assert created.status_code == 201, created.text
                time.sleep(2)
                assert api.get(f"/runs/{created.json()['id']}").json()["status"] == "queued"
                broker.start()
                worker = stack.worker(**WORKER_ENV)
                run = wait_for_run(api, created.json()["id"], timeout=300, procs=[worker])
                assert run["status"] == "succeeded", run
    finally:
        broker.stop()


def test_the_service_restarted_mid_run_loses_no_report(tmp_path: Path, postgres_url: str) -> None:
    body = {"workflow": workflow("continued_pretrain", steps=40)}
    with processes() as procs:
        # A lease long enough to outlast the restart: this test is about reports, not reaping.
        stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_LEASE_SECONDS="120")
        worker = stack.worker(**WORKER_ENV)
        serve = procs[0]
        port = int(stack.url.rsplit(":", 1)[1])
        with stack.api() as api:
            run_id = api.post("/runs", json=body).json()["id"]
            wait_until(
                lambda: api.get(f"/runs/{run_id}").json()["step"] >= 5, timeout=120, what="step 5"
            )
        serve.stop()
        time.sleep(3)  # the worker trains on; its reports wait for the service
        restarted = Proc(
            ["serve", "--port", str(port)], env=stack.env, log=tmp_path / "serve-2.log"
        )
        procs.append(restarted)
        with stack.api() as api:
            wait_until(lambda: healthy(stack.url), timeout=60, what="the restarted service")
            run = wait_for_run(api, run_id, timeout=300, procs=[worker, restarted])
            assert run["status"] == "succeeded", run
            assert [a["status"] for a in run["attempts"]] == ["succeeded"]
            assert_each_step_once(api, run)
            evals = api.get(f"/runs/{run_id}/eval").json()["tasks"]["continued_pretrain"]
            assert [p["step"] for p in evals["history"]] == list(range(0, 41, 4))


def _set_connections(admin_url: str, database: str, *, allowed: bool) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS {str(allowed).lower()}')
        if not allowed:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (database,),
            )


def test_a_database_outage_answers_503_and_loses_no_run(
    tmp_path: Path, postgres_url: str, postgres_admin_url: str
) -> None:
    database = postgres_url.rsplit("/", 1)[1]
    body = {"workflow": workflow("continued_pretrain", steps=30)}
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_LEASE_SECONDS="120")
        worker = stack.worker(**WORKER_ENV)
        with stack.api() as api:
            run_id = api.post("/runs", json=body).json()["id"]
            wait_until(
                lambda: api.get(f"/runs/{run_id}").json()["step"] >= 5, timeout=120, what="step 5"
            )
            _set_connections(postgres_admin_url, database, allowed=False)
            try:
                answer = api.get(f"/runs/{run_id}")
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "database_unavailable"
                assert api.get("/readyz").status_code == 503
                assert api.get("/healthz").status_code == 200
                time.sleep(2)  # the worker trains on meanwhile
            finally:
                _set_connections(postgres_admin_url, database, allowed=True)
            run = wait_for_run(api, run_id, timeout=300, procs=[worker])
            assert run["status"] == "succeeded", run
            assert_each_step_once(api, run)
            assert [r["id"] for r in api.get("/runs").json()["runs"]] == [run_id]


def test_pause_checkpoints_and_a_resume_continues_exactly(
    tmp_path: Path, postgres_url: str
) -> None:
    body = {"workflow": workflow("continued_pretrain", steps=40)}
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_LEASE_SECONDS="60")
        worker = stack.worker(**WORKER_ENV)
        with stack.api() as api:
            run_id = api.post("/runs", json=body).json()["id"]
            wait_until(
                lambda: api.get(f"/runs/{run_id}").json()["step"] >= 5, timeout=120, what="step 5"
            )
            assert api.post(f"/runs/{run_id}/pause").status_code == 200
            paused = wait_until(
                lambda: (r := api.get(f"/runs/{run_id}").json())["status"] == "paused" and r,
                timeout=60,
                what="the worker to checkpoint and pause",
            )
            assert paused["attempts"][0]["status"] == "paused"
            assert paused["latest_checkpoint"]["step"] == paused["step"] < 40
            assert worker.popen.poll() is None, "a pause stops the run, not the worker"

            assert api.post(f"/runs/{run_id}/resume").status_code == 200
            run = wait_for_run(api, run_id, timeout=300, procs=[worker])
            assert run["status"] == "succeeded", run
            assert [a["status"] for a in run["attempts"]] == ["paused", "succeeded"]
            assert_identical_runs(api, run, reference_run(api, body, worker))


def test_cancel_stops_the_worker_and_frees_it(tmp_path: Path, postgres_url: str) -> None:
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_LEASE_SECONDS="60")
        worker = stack.worker(**WORKER_ENV)
        with stack.api() as api:
            long = {"workflow": workflow("continued_pretrain", steps=400)}
            run_id = api.post("/runs", json=long).json()["id"]
            wait_until(
                lambda: api.get(f"/runs/{run_id}").json()["step"] >= 5, timeout=120, what="step 5"
            )
            cancelled = api.post(f"/runs/{run_id}/cancel")
            assert cancelled.status_code == 200
            assert cancelled.json()["status"] == "cancelled"
            # The worker hears it at its next heartbeat and takes the next run.
            short = {"workflow": workflow("summarization", steps=4)}
            next_run = api.post("/runs", json=short).json()
            done = wait_for_run(api, next_run["id"], timeout=300, procs=[worker])
            assert done["status"] == "succeeded"
            run = api.get(f"/runs/{run_id}").json()
            assert run["status"] == "cancelled"
            assert run["step"] < 400
            assert run["attempts"][0]["status"] == "superseded"


def test_an_eval_longer_than_the_lease_keeps_its_attempt(tmp_path: Path, postgres_url: str) -> None:
    """The baseline and final evals of a large held-out file take several leases (about 5 s
    each against a 2 s lease): the worker heartbeats from a thread meanwhile, so the reaper
    never takes the attempt away and the run ends with its one attempt."""
    held_out = workflow("continued_pretrain", steps=4)["evals"][0]["data"]
    big = tmp_path / "held_out.jsonl"
    big.write_text(Path(held_out).read_text() * 40)  # about 120k tokens
    body = {"workflow": workflow("continued_pretrain", steps=4)}
    body["workflow"]["evals"] = [
        {"task": "continued_pretrain", "data": str(big), "every_steps": 100, "sequence_length": 128}
    ]
    env = {"TRAINCTL_LEASE_SECONDS": "2", "TRAINCTL_REAPER_INTERVAL_SECONDS": "0.5"}
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **env)
        stack.worker(**WORKER_ENV)
        with stack.api() as api:
            created = api.post("/runs", json=body)
            assert created.status_code == 201, created.text
            run = wait_for_run(api, created.json()["id"], timeout=180, procs=procs)
            evals = api.get(f"/runs/{run['id']}/eval").json()["tasks"]
    assert run["status"] == "succeeded", run
    assert [a["status"] for a in run["attempts"]] == ["succeeded"], run["attempts"]
    assert [p["step"] for p in evals["continued_pretrain"]["history"]] == [0, 4]
