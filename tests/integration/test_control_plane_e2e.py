"""The control plane's own operations with real processes (`trainctl serve` on Postgres,
`trainctl worker` on Redis): a service down for several leases, a step longer than several
leases, and a worker that hangs instead of dying. Runs must come through each of them as an
uninterrupted run would, losing no attempt to the service's own deafness."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
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

LEASE = 5
SERVICE_ENV = {"TRAINCTL_LEASE_SECONDS": str(LEASE), "TRAINCTL_REAPER_INTERVAL_SECONDS": "1"}
WORKER_ENV = {"TRAINCTL_HEARTBEAT_SECONDS": "0.5"}


def counter(port: int, name: str) -> float:
    """A counter of the worker's Prometheus metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.search(rf"^{name}_total (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in the worker's metrics"
    return float(found.group(1))


def test_a_service_down_for_three_leases_loses_no_attempt_and_no_report(
    tmp_path: Path, postgres_url: str
) -> None:
    """Stopped mid-phase for three leases, the service comes back to leases that all ran out
    while it could not hear them. It grants them grace instead of reaping them: the worker
    trains on, spools its reports, delivers them, and the run ends with its one attempt,
    bit-identical to an uninterrupted run."""
    body = {"workflow": workflow("continued_pretrain", steps=60)}
    metrics_port = free_port()
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        worker = stack.worker(**WORKER_ENV, TRAINCTL_METRICS_PORT=str(metrics_port))
        serve = procs[0]
        port = int(stack.url.rsplit(":", 1)[1])
        with stack.api() as api:
            run_id = api.post("/runs", json=body).json()["id"]
            wait_until(
                lambda: api.get(f"/runs/{run_id}").json()["step"] >= 3, timeout=120, what="step 3"
            )
        serve.stop()
        down_at = time.monotonic()
        time.sleep(3 * LEASE)  # the worker trains on, deaf to nobody but the service
        assert counter(metrics_port, "trainctl_worker_reports_spooled") > 0
        restarted = Proc(
            ["serve", "--port", str(port)], env=stack.env, log=tmp_path / "serve-2.log"
        )
        procs.append(restarted)
        wait_until(lambda: healthy(stack.url), timeout=60, what="the restarted service")
        assert time.monotonic() - down_at >= 3 * LEASE
        with stack.api() as api:
            run = wait_for_run(api, run_id, timeout=300, procs=[worker, restarted])
            assert run["status"] == "succeeded", run
            assert [a["status"] for a in run["attempts"]] == ["succeeded"]
            assert (run["preemptions"], run["restarts"]) == (0, 0)
            # Every report spooled while the service was down arrived, each step once.
            spooled = counter(metrics_port, "trainctl_worker_reports_spooled")
            assert counter(metrics_port, "trainctl_worker_reports_unspooled") == spooled > 0
            assert_each_step_once(api, run)
            assert "granted 1 running leases" in restarted.log.read_text()
            assert_identical_runs(api, run, reference_run(api, body, worker))


def failpoints(spec: str) -> dict[str, str]:
    """The worker environment that arms `spec` (worker/failpoint.py; test knobs only)."""
    return {"TRAINCTL_TESTING": "1", "TRAINCTL_TEST_FAILPOINTS": spec}


def test_a_step_longer_than_three_leases_keeps_its_lease(tmp_path: Path, postgres_url: str) -> None:
    """The lease is renewed from the worker's keeper thread, not from the training loop: one
    step that takes three leases (a slow device, a long gradient accumulation) keeps it."""
    lease = 2
    env = {"TRAINCTL_LEASE_SECONDS": str(lease), "TRAINCTL_REAPER_INTERVAL_SECONDS": "0.5"}
    body = {"workflow": workflow("continued_pretrain", steps=6)}
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **env)
        worker = stack.worker(**WORKER_ENV, **failpoints(f"slow_before_step@3={3 * lease}"))
        with stack.api() as api:
            run_id = api.post("/runs", json=body).json()["id"]
            run = wait_for_run(api, run_id, timeout=180, procs=[worker])
            assert run["status"] == "succeeded", run
            assert [a["status"] for a in run["attempts"]] == ["succeeded"]
            assert run["preemptions"] == 0
        assert "slow_before_step@3" in worker.log.read_text()


def test_a_hung_worker_is_detected_by_its_stalled_progress_and_its_phase_recovered(
    tmp_path: Path, postgres_url: str
) -> None:
    """A worker that hangs (not dies) keeps heartbeating from its keeper thread, so its lease
    never lapses; its progress does not move, so after TRAINCTL_STALL_SECONDS the service
    gives the phase to another worker, which finishes it. The hung worker, told to stop and
    unable to, ends its process (exit 70) TRAINCTL_ABANDON_SECONDS later, for its supervisor
    to replace."""
    env = {
        "TRAINCTL_LEASE_SECONDS": "2",
        "TRAINCTL_REAPER_INTERVAL_SECONDS": "0.5",
        "TRAINCTL_STALL_SECONDS": "6",
    }
    body = {"workflow": workflow("continued_pretrain", steps=6)}
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **env)
        hung = stack.worker(
            **WORKER_ENV, **failpoints("hang_before_step@3"), TRAINCTL_ABANDON_SECONDS="2"
        )
        with stack.api() as api:
            run_id = api.post("/runs", json=body).json()["id"]
            wait_until(
                lambda: "hang_before_step@3" in hung.log.read_text(),
                timeout=120,
                what="the worker to hang",
            )
            healthy_worker = stack.worker(**WORKER_ENV)
            run = wait_for_run(api, run_id, timeout=180, procs=[healthy_worker])
            assert run["status"] == "succeeded", run
            first, second = run["attempts"]
            assert (first["status"], first["cause"]) == ("lost", "stalled"), first
            assert first["worker_pid"] == hung.pid
            assert (second["status"], second["worker_pid"]) == ("succeeded", healthy_worker.pid)
            assert run["preemptions"] == 1
        assert hung.popen.wait(timeout=60) == 70
        assert "its training thread hangs" in hung.log.read_text()
