"""A phase on two gloo ranks through the whole stack (`trainctl serve` on Postgres, a worker
on Redis owning TRAINCTL_DEVICES=2): routed to the two-device queue, trained by two rank
processes, a SIGKILL of one rank recovered from the latest checkpoint to a run bit-identical
to an uninterrupted one, a SIGTERM to the worker's whole process group taken as a preemption
notice (checkpoint, hand back, continue bit-identically), and a run paused on two ranks
resumed on one. Sharded (FSDP2), every rank's shards written with torch.distributed.checkpoint
and read back after a SIGKILL, bit for bit."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from exact import (
    assert_identical_runs,
    differences,
    final_state,
    reference_run,
    series,
    shard_tensors,
    workflow,
)
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


def two_rank_body(sharding: str = "replicate") -> dict[str, Any]:
    doc = workflow("continued_pretrain", steps=STEPS)
    doc["phases"][0]["grad_accum"] = 2  # one microbatch a rank, the same global batch
    doc["phases"][0]["resources"] = {"devices": 2, "sharding": sharding}
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


def killed_and_recovered(api: httpx.Client, worker: Proc, body: dict[str, Any]) -> dict[str, Any]:
    """A run of `body` whose rank 1 is SIGKILLed after the step-4 checkpoint: the other rank
    is ended, the attempt fails naming the rank, and the next attempt continues from that
    checkpoint to the end."""
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
    return killed


def test_a_sharded_phase_writes_its_shards_and_survives_a_killed_rank_bit_for_bit(
    tmp_path: Any, postgres_url: str
) -> None:
    """FSDP2 over two ranks: every checkpoint inside the phase holds each rank's shards
    (torch.distributed.checkpoint), the final one the model whole as well; a rank SIGKILLed
    mid-phase, the next attempt reads the shards back and the run ends bit-identical to an
    uninterrupted one, shards included."""
    body = two_rank_body("fsdp")
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            worker = stack.worker(**WORKER_ENV)
            killed = killed_and_recovered(api, worker, body)
            reference = reference_run(api, body, worker)
            assert_identical_runs(api, killed, reference)
            final = Path(killed["latest_checkpoint"]["path"])
            reference_final = Path(reference["latest_checkpoint"]["path"])
            assert differences(shard_tensors(final), shard_tensors(reference_final)) == []
            # keep_last 2: the final checkpoint and the one before it, shards only.
            kept = api.get(f"/runs/{killed['id']}/checkpoints").json()["checkpoints"]
            inside = [Path(c["path"]) for c in kept if c["step"] < STEPS]
            assert inside, kept
            for path in (*inside, final):
                assert sorted(p.name for p in (path / "shards").iterdir()) == [
                    ".metadata",
                    "__0_0.distcp",
                    "__1_0.distcp",
                ]
            assert not any((p / "model.safetensors").exists() for p in inside)


def test_two_ranks_train_through_the_api_survive_a_killed_rank_and_resume_on_one(
    tmp_path: Any, postgres_url: str
) -> None:
    body = two_rank_body()
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            worker = stack.worker(**WORKER_ENV)

            killed = killed_and_recovered(api, worker, body)

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
