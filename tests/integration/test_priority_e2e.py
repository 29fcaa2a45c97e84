"""Preemption by priority with real processes (service, one worker, Postgres, Redis): a
high-priority run submitted while a low one trains on the only worker starts within seconds;
the low one checkpoints and yields (its attempt `paused`, cause `priority`, no preemption
charged), continues by itself once the high one ends, and ends bit-identical to an
uninterrupted run. Then an owner's quota holds with real workers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from exact import assert_identical_runs, reference_run, workflow
from procs import Stack, processes, wait_for_run, wait_until

pytestmark = pytest.mark.integration

SERVICE_ENV = {"TRAINCTL_LEASE_SECONDS": "10"}
WORKER_ENV = {"TRAINCTL_HEARTBEAT_SECONDS": "0.5"}


def test_a_high_priority_run_preempts_a_low_one_which_resumes_exactly(
    tmp_path: Path, postgres_url: str
) -> None:
    low_body = {"workflow": workflow("continued_pretrain", steps=40), "name": "low"}
    high_body = {
        "workflow": workflow("continued_pretrain", steps=4),
        "name": "high",
        "priority": 10,
    }
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            worker = stack.worker(**WORKER_ENV)
            low = api.post("/runs", json=low_body)
            assert low.status_code == 201, low.text
            low_id = low.json()["id"]
            wait_until(
                lambda: api.get(f"/runs/{low_id}").json()["step"] >= 3,
                timeout=180,
                what="the low run to train",
            )
            high = api.post("/runs", json=high_body)
            assert high.status_code == 201, high.text
            high_id = high.json()["id"]
            asked = time.monotonic()

            def high_started() -> dict[str, Any] | None:
                state: dict[str, Any] = api.get(f"/runs/{high_id}").json()
                return state if state["attempts"][0]["status"] != "queued" else None

            wait_until(high_started, timeout=60, what="the high run to start")
            started_after = time.monotonic() - asked
            assert started_after < 30, f"the high run started {started_after:.1f} s later"

            yielded = api.get(f"/runs/{low_id}").json()
            first = yielded["attempts"][0]
            assert (first["status"], first["cause"]) == ("paused", "priority")
            assert first["yield_requested_at"] is not None
            assert yielded["preemptions"] == 0

            high_done = wait_for_run(api, high_id, timeout=300, procs=[worker])
            assert high_done["status"] == "succeeded", high_done
            low_done = wait_for_run(api, low_id, timeout=300, procs=[worker])
            assert low_done["status"] == "succeeded", low_done
            assert [(a["status"], a["cause"]) for a in low_done["attempts"]] == [
                ("paused", "priority"),
                ("succeeded", None),
            ]
            assert (low_done["preemptions"], low_done["restarts"]) == (0, 0)
            low_plain = {k: v for k, v in low_body.items() if k != "name"}
            assert_identical_runs(api, low_done, reference_run(api, low_plain, worker))


def test_an_owners_quota_holds_with_real_workers(tmp_path: Path, postgres_url: str) -> None:
    body = {"workflow": workflow("continued_pretrain", steps=6)}
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            issued = api.post("/tokens", json={"name": "alice", "max_devices": 1})
            assert issued.status_code == 201, issued.text
            alice = {"Authorization": f"Bearer {issued.json()['secret']}"}
            alice_id = issued.json()["token"]["id"]
            workers = [stack.worker(**WORKER_ENV), stack.worker(**WORKER_ENV)]
            wait_until(
                lambda: api.get("/workers").json()["live"] >= 2, timeout=120, what="two workers"
            )
            one = api.post("/runs", json=body, headers=alice).json()["id"]
            two = api.post("/runs", json=body, headers=alice).json()["id"]
            reason = f"quota: owner {alice_id} uses 1 of 1 device and this attempt needs 1"
            # The placement pass after the submission writes why it waits.
            waiting = wait_until(
                lambda: (state := api.get(f"/runs/{two}").json())["waiting_reason"] and state,
                timeout=30,
                what="the second run's reason",
            )
            assert waiting["attempts"][0]["status"] == "queued"
            assert waiting["waiting_reason"] == reason
            first = wait_for_run(api, one, timeout=300, procs=workers)
            second = wait_for_run(api, two, timeout=300, procs=workers)
            assert (first["status"], second["status"]) == ("succeeded", "succeeded")
            # Never both at once: the second started after the first ended.
            assert second["attempts"][0]["claimed_at"] >= first["attempts"][0]["finished_at"]
