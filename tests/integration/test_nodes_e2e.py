"""A phase across machines through the whole stack (`trainctl serve` on Postgres, worker
processes on Redis, each owning one gloo device and standing for a machine): a two-node phase
trains what one device trains; with member 1's worker SIGKILLed after a checkpoint, the
attempt fails naming the member, the other member stops, and the run recovers on two live
workers to end bit-identical to an uninterrupted two-node run; two two-node runs submitted
together on three workers both finish, never half-placed."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from exact import assert_identical_runs, series, workflow
from procs import Proc, Stack, processes, wait_for_run, wait_until

pytestmark = pytest.mark.integration

# The reaper judges members' leases promptly; a lease outlasts the ranks' start on busy cores.
SERVICE_ENV = {"TRAINCTL_LEASE_SECONDS": "15", "TRAINCTL_REAPER_INTERVAL_SECONDS": "1"}
WORKER_ENV = {
    "TRAINCTL_DEVICES": "1",
    "TRAINCTL_HEARTBEAT_SECONDS": "0.5",
    "TRAINCTL_ADVERTISE_ADDRESS": "127.0.0.1",
    "TRAINCTL_COLLECTIVE_TIMEOUT_SECONDS": "60",
    "TRAINCTL_RENDEZVOUS_TIMEOUT_SECONDS": "60",
}
STEPS = 8


def body(*, nodes: int, dropout: bool = True) -> dict[str, Any]:
    doc = workflow("continued_pretrain", steps=STEPS)
    doc["phases"][0]["grad_accum"] = 2  # one microbatch a rank on two nodes: the same batch
    if not dropout:
        # Other ranks draw other dropout masks: only without it does one device match.
        doc["model"]["config"]["attention_dropout"] = 0.0
    if nodes > 1:
        doc["phases"][0]["resources"] = {"nodes": nodes, "devices": 1}
    return {"workflow": doc, "max_restarts": 5, "max_preemptions": 5}


def workers(stack: Stack, api: httpx.Client, count: int) -> list[Proc]:
    started = [
        stack.worker(TRAINCTL_HOME=str(stack.tmp_path / f"w{n}"), **WORKER_ENV)
        for n in range(count)
    ]
    wait_until(lambda: api.get("/workers").json()["live"] >= count, timeout=120, what="the workers")
    return started


def submit(api: httpx.Client, doc: dict[str, Any]) -> str:
    created = api.post("/runs", json=doc)
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def losses(api: httpx.Client, run_id: str) -> list[float]:
    return [float(v) for v in series(api, run_id)["loss"]["values"]]


def test_a_two_node_phase_trains_what_one_device_trains(tmp_path: Path, postgres_url: str) -> None:
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            fleet = workers(stack, api, 2)
            two = wait_for_run(
                api, submit(api, body(nodes=2, dropout=False)), timeout=300, procs=fleet
            )
            assert two["status"] == "succeeded", two
            assert [a["status"] for a in two["attempts"]] == ["succeeded"]
            one = wait_for_run(
                api, submit(api, body(nodes=1, dropout=False)), timeout=300, procs=fleet
            )
            assert one["status"] == "succeeded", one
            got, want = losses(api, two["id"]), losses(api, one["id"])
            assert len(got) == len(want) == STEPS
            for step, (a, b) in enumerate(zip(got, want, strict=True), start=1):
                assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} != {b}"
            # Resources are not signed: the same run on another count.
            assert two["signature"] == one["signature"]


def member_worker(api: httpx.Client, fleet: list[Proc], run_id: str, member: int) -> Proc:
    """The worker process that claimed member `member` of the run's attempt."""

    def find() -> Proc | None:
        for w in api.get("/workers").json()["workers"]:
            a = w.get("assignment")
            if a and a["run_id"] == run_id and a["member"] == member and a["claimed"]:
                return next(p for p in fleet if os.getpgid(w["pid"]) == p.pid)
        return None

    found: Proc = wait_until(find, timeout=120, what=f"member {member} to claim")
    return found


def test_a_two_node_phase_survives_a_killed_member_bit_for_bit(
    tmp_path: Path, postgres_url: str
) -> None:
    doc = body(nodes=2)
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            fleet = workers(stack, api, 3)
            run_id = submit(api, doc)
            victim = member_worker(api, fleet, run_id, 1)
            survivor = member_worker(api, fleet, run_id, 0)
            wait_until(
                lambda: api.get(f"/runs/{run_id}").json()["step"] >= 5,
                timeout=300,
                what="step 5, past the step-4 checkpoint",
            )
            os.killpg(victim.pid, signal.SIGKILL)
            alive = [p for p in fleet if p is not victim]
            killed = wait_for_run(api, run_id, timeout=400, procs=alive)
            assert killed["status"] == "succeeded", killed
            first, *_, last = killed["attempts"]
            assert first["status"] in ("failed", "lost"), first
            assert first["cause"] == "infrastructure", first
            # Member 0 names the member it lost, or the reaper the member whose lease lapsed.
            assert "member 1" in (first["message"] or ""), first
            assert last["status"] == "succeeded"
            # The surviving member stopped its ranks and went on to later attempts.
            assert survivor.alive()
            reference = wait_for_run(api, submit(api, doc), timeout=300, procs=alive)
            assert reference["status"] == "succeeded", reference
            assert [a["status"] for a in reference["attempts"]] == ["succeeded"]
            assert_identical_runs(api, killed, reference)


def test_two_two_node_runs_on_three_workers_both_finish(tmp_path: Path, postgres_url: str) -> None:
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            fleet = workers(stack, api, 3)
            one, two = submit(api, body(nodes=2)), submit(api, body(nodes=2))
            # While one gang trains, the other waits whole: the idle worker holds nothing.
            queued = wait_until(
                lambda: [
                    q for q in api.get("/queue").json()["attempts"] if q["reason"] != "placed"
                ],
                timeout=60,
                what="one run waiting for a whole gang",
            )
            assert queued[0]["nodes"] == 2
            idle = [w for w in api.get("/workers").json()["workers"] if w["assignment"] is None]
            assert len(idle) == 1, "never half-placed: the third worker holds nothing"
            first = wait_for_run(api, one, timeout=400, procs=fleet)
            second = wait_for_run(api, two, timeout=400, procs=fleet)
            assert (first["status"], second["status"]) == ("succeeded", "succeeded")
            assert [a["status"] for a in first["attempts"]] == ["succeeded"]
            assert [a["status"] for a in second["attempts"]] == ["succeeded"]
            earlier, later = sorted((first, second), key=lambda r: r["attempts"][0]["claimed_at"])
            assert later["attempts"][0]["claimed_at"] >= earlier["attempts"][0]["finished_at"]
