"""Exact resume with real processes: a worker SIGKILLed at a chosen instant, the run resumed by
`POST /runs/{id}/resume` (or handed back after SIGTERM), ends bit-identical to an uninterrupted
run of the same workflow on CPU — weights, optimizer state, learning rate and every step's loss.

The instants are armed with TRAINCTL_TEST_FAILPOINTS (a test knob: with TRAINCTL_TESTING=1),
which makes the worker SIGKILL itself at that point: the same as an external SIGKILL landing
exactly there. Dropout is on, so a resume that did not restore the RNG would differ (the
negative control proves that it does).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from exact import (
    assert_identical_runs,
    differences,
    final_state,
    make_initial_checkpoint,
    reference_run,
    workflow,
)
from procs import Proc, Stack, processes, resume_when_lease_lapses, wait_for_run

pytestmark = pytest.mark.integration

# A failpoint per instant of issue 3: before the first update, in the middle of the warmup,
# right after a checkpoint is registered, and while one is being written.
INSTANTS = {
    "before_first_step": "before_step@1",
    "mid_warmup": "after_step@2",
    "right_after_checkpoint": "after_checkpoint@4",
    "mid_checkpoint_write": "mid_checkpoint@8",
}
# Quick leases and heartbeats so a killed attempt's lease lapses within the test; the reaper
# is held back so that the resume is the explicit `POST /runs/{id}/resume` under test (the
# automatic recovery has its own tests).
SERVICE_ENV = {"TRAINCTL_LEASE_SECONDS": "3", "TRAINCTL_REAPER_INTERVAL_SECONDS": "3600"}
WORKER_ENV = {"TRAINCTL_HEARTBEAT_SECONDS": "0.5"}


def submission(objective: str, tmp_path: Path) -> dict[str, Any]:
    doc = workflow(objective)
    body: dict[str, Any] = {"workflow": doc}
    if objective != "continued_pretrain":  # the SFT case starts from an initial checkpoint
        body["initial_checkpoint"] = str(
            make_initial_checkpoint(tmp_path / "initial", doc["model"]["config"])
        )
    return body


def kill_and_resume(
    stack: Stack, api: httpx.Client, body: dict[str, Any], failpoint: str, **resume_env: str
) -> tuple[dict[str, Any], Proc]:
    """Submit, let a worker armed with `failpoint` die there, then resume on a clean worker."""
    doomed = stack.worker(**WORKER_ENV, TRAINCTL_TESTING="1", TRAINCTL_TEST_FAILPOINTS=failpoint)
    created = api.post("/runs", json=body)
    assert created.status_code == 201, created.text
    assert doomed.popen.wait(timeout=180) == -signal.SIGKILL, doomed.tail()
    before = api.get(f"/runs/{created.json()['id']}").json()
    assert before["status"] == "running", "a SIGKILLed worker says nothing; the run looks alive"

    clean = stack.worker(**WORKER_ENV, **resume_env)
    answer = resume_when_lease_lapses(api, created.json()["id"])
    assert answer["id"] == created.json()["id"], "a resumed run keeps its id"
    run = wait_for_run(api, answer["id"], timeout=300, procs=[clean])
    assert run["status"] == "succeeded", run
    assert [(a["number"], a["status"]) for a in run["attempts"]] == [(1, "lost"), (2, "succeeded")]
    return run, clean


@pytest.mark.parametrize("instant", INSTANTS)
@pytest.mark.parametrize("objective", ["continued_pretrain", "summarization"])
def test_resume_after_sigkill_matches_uninterrupted_run(
    tmp_path: Path, postgres_url: str, objective: str, instant: str
) -> None:
    body = submission(objective, tmp_path)
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            resumed, worker = kill_and_resume(stack, api, body, INSTANTS[instant])
            reference = reference_run(api, body, worker)
            assert_identical_runs(api, resumed, reference)
            if instant == "mid_checkpoint_write":
                # The half-written step-8 directory never counted and was cleaned up.
                checkpoints = Path(resumed["latest_checkpoint"]["path"]).parent
                assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".tmp")]


def test_resume_without_rng_restore_differs(tmp_path: Path, postgres_url: str) -> None:
    """Negative control: the comparison above can fail. With the RNG not restored, dropout
    draws other masks after the resume and the final weights differ."""
    body = submission("continued_pretrain", tmp_path)
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            resumed, worker = kill_and_resume(
                stack,
                api,
                body,
                INSTANTS["right_after_checkpoint"],
                TRAINCTL_TESTING="1",
                TRAINCTL_TEST_SKIP_RNG_RESTORE="true",
            )
            reference = reference_run(api, body, worker)
            weights, _ = final_state(resumed)
            ref_weights, _ = final_state(reference)
            assert differences(weights, ref_weights) != []


def test_sigterm_checkpoints_hands_back_and_loses_no_step(
    tmp_path: Path, postgres_url: str
) -> None:
    """SIGTERM is a preemption notice: the worker checkpoints now, reports `preempted` and
    exits; the service queues the next attempt, which continues from that checkpoint."""
    body = {"workflow": workflow("continued_pretrain", steps=60)}
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            noticed = stack.worker(**WORKER_ENV)
            run_id = api.post("/runs", json=body).json()["id"]
            while api.get(f"/runs/{run_id}").json()["step"] < 3:
                assert noticed.popen.poll() is None, noticed.tail()
                time.sleep(0.05)
            os.kill(noticed.pid, signal.SIGTERM)
            assert noticed.popen.wait(timeout=60) == 0, noticed.tail()

            run = api.get(f"/runs/{run_id}").json()
            first = run["attempts"][0]
            assert first["status"] == "preempted"
            stopped_at = run["latest_checkpoint"]["step"]
            assert 3 <= stopped_at < 60, "the notice was taken mid-phase, with a checkpoint"

            clean = stack.worker(**WORKER_ENV)
            run = wait_for_run(api, run_id, timeout=300, procs=[clean])
            assert run["status"] == "succeeded", run
            assert [a["status"] for a in run["attempts"]] == ["preempted", "succeeded"]
            assert_identical_runs(api, run, reference_run(api, body, clean))


def test_resume_after_sigkill_right_after_a_carried_boundary_matches_uninterrupted_run(
    tmp_path: Path, postgres_url: str
) -> None:
    """A replay phase that carries the optimizers' state across its boundary: the worker dies
    before the phase's first update (after step 6, the previous phase's final checkpoint), and
    the attempt that replaces it loads that checkpoint's optimizer state, as the uninterrupted
    run's attempt did."""
    doc = workflow("continued_pretrain", steps=6)
    (pretrain,) = doc["phases"]
    doc["phases"] = [pretrain, {**pretrain, "name": "replay", "optimizer_state": "carry"}]
    body = {"workflow": doc}
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            doomed = stack.worker(
                **WORKER_ENV, TRAINCTL_TESTING="1", TRAINCTL_TEST_FAILPOINTS="before_step@7"
            )
            run_id = api.post("/runs", json=body).json()["id"]
            assert doomed.popen.wait(timeout=180) == -signal.SIGKILL, doomed.tail()
            clean = stack.worker(**WORKER_ENV)
            resume_when_lease_lapses(api, run_id)
            resumed = wait_for_run(api, run_id, timeout=300, procs=[clean])
            assert resumed["status"] == "succeeded", resumed
            assert [(a["phase_index"], a["status"]) for a in resumed["attempts"]] == [
                (0, "succeeded"),
                (1, "lost"),
                (1, "succeeded"),
            ]
            reference = reference_run(api, body, clean)
            assert_identical_runs(api, resumed, reference)
            # Carried, not reset: AdamW's step count ran on through both phases.
            _, optimizer = final_state(resumed)
            assert {int(s["step"]) for s in optimizer["adamw"]["state"].values()} == {12}


def test_a_full_disk_fails_the_run_at_once_and_resume_matches_uninterrupted_run(
    tmp_path: Path, postgres_url: str
) -> None:
    """The artifact store fills while step 8's checkpoint is written (the failpoint raises
    ENOSPC there, as the write would): the attempt ends `disk_full`, the run fails at once with
    no restart spent and nothing half-written left, and once resumed (space freed) it goes on
    from step 4's checkpoint to the state of a run that never met a full disk, bit for bit."""
    body = submission("continued_pretrain", tmp_path)
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            full = stack.worker(
                **WORKER_ENV, TRAINCTL_TESTING="1", TRAINCTL_TEST_FAILPOINTS="full_mid_checkpoint@8"
            )
            created = api.post("/runs", json={**body, "max_restarts": 3})
            assert created.status_code == 201, created.text
            run_id = created.json()["id"]
            failed = wait_for_run(api, run_id, timeout=300, procs=[full])
            assert (failed["status"], failed["cause"], failed["restarts"]) == (
                "failed",
                "disk_full",
                0,
            )
            assert [(a["status"], a["cause"]) for a in failed["attempts"]] == [
                ("failed", "disk_full")
            ]
            checkpoints = Path(failed["latest_checkpoint"]["path"]).parent
            assert f"no space for the checkpoint of step 8 in {checkpoints}" in failed["message"]
            assert "free, it needs about" in failed["message"]
            assert [p.name for p in checkpoints.iterdir()] == ["step-00000004"]
            full.stop()  # the failpoint would fill the disk again

            clean = stack.worker(**WORKER_ENV)
            resumed = api.post(f"/runs/{run_id}/resume")
            assert resumed.status_code == 200, resumed.text
            run = wait_for_run(api, run_id, timeout=300, procs=[clean])
            assert run["status"] == "succeeded", run
            assert [a["status"] for a in run["attempts"]] == ["failed", "succeeded"]
            assert_identical_runs(api, run, reference_run(api, body, clean))
