"""A phase on two gloo ranks through the whole stack (`trainctl serve` on Postgres, a worker
on Redis owning TRAINCTL_DEVICES=2): routed to the two-device queue, trained by two rank
processes, a SIGKILL of one rank recovered from the latest checkpoint to a run bit-identical
to an uninterrupted one, a SIGTERM to the worker's whole process group taken as a preemption
notice (checkpoint, hand back, continue bit-identically), and a run paused on two ranks
resumed on one."""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import httpx
import pytest
from exact import assert_identical_runs, final_state, reference_run, series, workflow
from procs import Proc, Stack, processes, wait_for_run, wait_until

pytestmark = pytest.mark.integration

# The reaper recovers promptly; the lease outlasts the ranks' start (imports on a busy core).
SERVICE_ENV = {"TRAINCTL_LEASE_SECONDS": "30", "TRAINCTL_REAPER_INTERVAL_SECONDS": "1"}
WORKER_ENV = {
    "TRAINCTL_DEVICES": "2",
    "TRAINCTL_HEARTBEAT_SECONDS": "0.5",
    "TRAINCTL_COLLECTIVE_TIMEOUT_SECONDS": "60",
}
STEPS = 24


def two_rank_body() -> dict[str, Any]:
    doc = workflow("continued_pretrain", steps=STEPS)
    doc["phases"][0]["grad_accum"] = 2  # one microbatch a rank, the same global batch
    doc["phases"][0]["resources"] = {"devices": 2}
    return {"workflow": doc}


def rank_pid(worker: Proc, rank: int, after: int) -> int:
    """The pid rank `rank` logged when it joined, in the worker's log past offset `after`."""
    pattern = re.compile(rf"rank {rank} of 2 \(pid (\d+)\) joined")

    def find() -> int | None:
        found = pattern.findall(worker.log.read_text(errors="replace")[after:])
        return int(found[-1]) if found else None

    pid: int = wait_until(find, timeout=120, what=f"rank {rank} to join")
    return pid


def step_of(api: httpx.Client, run_id: str) -> int:
    step: int = api.get(f"/runs/{run_id}").json()["step"]
    return step


def test_two_ranks_train_through_the_api_survive_a_killed_rank_and_resume_on_one(
    tmp_path: Any, postgres_url: str
) -> None:
    body = two_rank_body()
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            worker = stack.worker(**WORKER_ENV)

            # A rank SIGKILLed after the step-4 checkpoint: the other is ended, the attempt
            # fails naming the rank, and the next attempt continues from that checkpoint.
            offset = len(worker.log.read_text(errors="replace")) if worker.log.exists() else 0
            created = api.post("/runs", json=body)
            assert created.status_code == 201, created.text
            run_id = created.json()["id"]
            assert created.json()["attempts"][0]["devices"] == 2
            victim = rank_pid(worker, 1, offset)
            wait_until(lambda: step_of(api, run_id) >= 5, timeout=120, what="step 5")
            os.kill(victim, signal.SIGKILL)
            killed = wait_for_run(api, run_id, timeout=300, procs=[worker])
            assert killed["status"] == "succeeded", killed
            first, *_, last = killed["attempts"]
            assert (first["status"], last["status"]) == ("failed", "succeeded"), killed["attempts"]
            assert "rank 1 of 2 ended with signal SIGKILL" in (first["message"] or ""), first

            # The same workflow uninterrupted on two ranks: bit for bit, every step's loss too.
            reference = reference_run(api, body, worker)
            assert [a["devices"] for a in reference["attempts"]] == [2]
            assert_identical_runs(api, killed, reference)

            # SIGTERM to the whole process group, as systemd sends it: the ranks ignore it, the
            # parent passes the notice on, rank 0 checkpoints at the step's end, the attempt is
            # preempted and the worker exits; the next worker continues bit for bit.
            noticed_id = api.post("/runs", json=body).json()["id"]
            wait_until(lambda: step_of(api, noticed_id) >= 5, timeout=120, what="step 5")
            os.killpg(worker.pid, signal.SIGTERM)
            assert worker.popen.wait(timeout=120) == 0, worker.tail()
            noticed = api.get(f"/runs/{noticed_id}").json()
            assert noticed["attempts"][0]["status"] == "preempted", noticed["attempts"]
            assert 5 <= noticed["latest_checkpoint"]["step"] < STEPS
            worker = stack.worker(**WORKER_ENV)
            noticed = wait_for_run(api, noticed_id, timeout=300, procs=[worker])
            assert [a["status"] for a in noticed["attempts"]] == ["preempted", "succeeded"]
            assert_identical_runs(api, noticed, reference)

            # Paused on two ranks, resumed on one: the checkpoint holds the replicated state.
            paused_id = api.post("/runs", json=body).json()["id"]
            wait_until(lambda: step_of(api, paused_id) >= 5, timeout=120, what="step 5")
            assert api.post(f"/runs/{paused_id}/pause").status_code == 200
            wait_until(
                lambda: api.get(f"/runs/{paused_id}").json()["status"] == "paused",
                timeout=120,
                what="the pause",
            )
            resumed = api.post(f"/runs/{paused_id}/resume", json={"devices": 1})
            assert resumed.status_code == 200, resumed.text
            fewer = wait_for_run(api, paused_id, timeout=300, procs=[worker])
            assert fewer["status"] == "succeeded", fewer
            assert [a["devices"] for a in fewer["attempts"]][-1] == 1
            final_state(fewer)  # its final checkpoint is the run's last step
            # Every step's loss, the resumed ones on one rank included, is close to the
            # two-rank run's: the same batches and state. Not equal: dropout masks are drawn
            # per rank (one rank draws rank 1's microbatch masks from rank 0's stream), and
            # Muon orthogonalises in bfloat16. A wrong batch or lost state is ~1e-1 off.
            losses = series(api, paused_id)["loss"]["values"]
            ref_losses = series(api, reference["id"])["loss"]["values"]
            assert len(losses) == len(ref_losses) == STEPS
            apart = [
                (step, a, b)
                for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True), start=1)
                if abs(a - b) > 5e-3 * abs(b)
            ]
            assert apart == []
