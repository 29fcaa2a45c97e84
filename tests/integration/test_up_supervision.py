"""`trainctl up` supervises its workers: a worker killed mid-run is started again, and the run
it held finishes on the new one. Real processes: `up` (uvicorn, SQLite, the broker folder)
and its Celery worker child."""

from __future__ import annotations

import json
import os
import signal
import socket
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest
from exact import workflow
from procs import processes, run_cli, start_api, wait_for_run, wait_until

pytestmark = pytest.mark.integration


def running_attempt(api: httpx.Client, run_id: str, *, after_step: int) -> dict[str, Any] | None:
    run = api.get(f"/runs/{run_id}").json()
    attempt = max(run["attempts"], key=lambda a: a["number"])
    return attempt if attempt["status"] == "running" and run["step"] >= after_step else None


def test_up_restarts_a_killed_worker_and_its_run_still_succeeds(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {
        "TRAINCTL_HOME": str(home),
        "TRAINCTL_TORCH_THREADS": "1",
        # A lost worker is noticed within seconds; the workers `up` starts inherit these.
        "TRAINCTL_LEASE_SECONDS": "3",
        "TRAINCTL_REAPER_INTERVAL_SECONDS": "1",
        "TRAINCTL_HEARTBEAT_SECONDS": "0.5",
    }
    with processes() as procs:
        up, url = start_api(["up", "--workers", "1"], env=env, log=tmp_path / "up.log", procs=procs)
        token = (home / "token").read_text().strip()
        cli_env = {**env, "TRAINCTL_API_URL": url, "TRAINCTL_TOKEN": token}
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as api:
            run_id = api.post("/runs", json={"workflow": workflow("continued_pretrain", steps=120)})
            run_id = run_id.json()["id"]
            attempt = wait_until(
                lambda: running_attempt(api, run_id, after_step=6),
                timeout=240,
                what="the run to train on the worker",
            )
            victim = attempt["worker_pid"]

            # The worker is listed by its ping (hostname, pid, version) and its attempt.
            listed = json.loads(run_cli(["workers", "--json"], env=cli_env))
            assert (listed["count"], listed["live"]) == (1, 1), listed
            (worker,) = listed["workers"]
            assert (worker["hostname"], worker["pid"]) == (socket.gethostname(), victim)
            assert worker["version"] == version("trainctl")
            assert (worker["run_id"], worker["attempt_id"]) == (run_id, attempt["id"])

            # Long enough that the listing above (a CLI process) cannot outlast the run.
            assert api.get(f"/runs/{run_id}").json()["status"] == "running"
            os.kill(victim, signal.SIGKILL)
            run = wait_for_run(api, run_id, timeout=300, procs=[up])
            assert run["status"] == "succeeded", run
            statuses = [a["status"] for a in sorted(run["attempts"], key=lambda a: a["number"])]
            assert statuses == ["lost", "succeeded"]
            successor = run["attempts"][-1]["worker_pid"]
            assert successor != victim

            workers = api.get("/workers").json()
            assert [(w["pid"], w["live"]) for w in workers["workers"]] == [
                (successor, True),
                (victim, False),
            ]
            assert "trainctl_worker_restarts_total 1.0" in api.get("/metrics").text

    log = (tmp_path / "up.log").read_text()
    assert f"worker 0 (pid {victim}) exited with signal SIGKILL" in log
    assert f"worker 0 restarted as pid {successor}" in log
